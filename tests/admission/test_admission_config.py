"""The `admission` and `pools` config sections: `check-config` accepts the example, and every bad
value is exit 2 with one line naming the file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import exporter.admission.book
import exporter.admission.sections
import exporter.admission.wiring
from exporter.cli import main
from tests.support.tools import REPO

EXAMPLE = REPO / "examples" / "admission.yaml"


def write_example(tmp_path: Path, change: dict[str, object] | None = None, token: str = "t0ken\n") -> Path:
    """The shipped example with its token file made real, and `change` merged into its sections."""
    token_file = tmp_path / "admission-token"
    token_file.write_text(token)
    document = yaml.safe_load(EXAMPLE.read_text())
    document["admission"]["token_file"] = str(token_file)
    for section, values in (change or {}).items():
        document[section] = {**document[section], **values} if isinstance(values, dict) else values
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def check(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["check-config", str(path)])
    captured = capsys.readouterr()
    return code, (captured.out + captured.err).strip()


def test_the_example_config_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, output = check(write_example(tmp_path), capsys)
    assert code == 0, output
    assert "2 deployment(s) (chat, agents)" in output


def test_admission_is_off_without_the_section(tmp_path: Path) -> None:
    from exporter.serve.config import config_from_mapping

    config = config_from_mapping({"deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                                                   "targets": {"static": ["http://10.0.0.5:8000/metrics"]}}]})
    assert exporter.admission.wiring.api_from_config(config) is None
    assert exporter.admission.sections.pools_from_config(config) is None


@pytest.mark.parametrize(("change", "token", "message"), [
    ({"admission": {"token_file": None}}, "t", "admission: enabled: true needs token_file"),
    ({}, "  \n", "admission: admission.token_file"),
    ({"admission": {"tokenfile": "x"}}, "t", "admission.tokenfile: unknown key (did you mean: token_file"),
    ({"admission": {"enabled": "yes please"}}, "t", "admission.enabled"),
    ({"pools": {"long": "agnets"}}, "t",
     "pools.long: deployment 'agnets' is not in deployments (did you mean: agents?)"),
    ({"pools": {"long": "chat"}}, "t", "pools: short and long name the same deployment 'chat'"),
    ({"pools": {"split_tokens": -5}}, "t", "pools.split_tokens"),
    ({"pools": {"short": None}}, "t", "pools: missing required key 'short'"),
])
def test_bad_sections_exit_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             change: dict[str, object], token: str, message: str) -> None:
    path = write_example(tmp_path, change, token)
    code, output = check(path, capsys)
    assert code == 2
    assert output.startswith(f"stepbudget check-config: error: {path}:")
    assert message in output
    assert len(output.splitlines()) == 1


def test_the_daemon_builds_the_book_from_the_config(tmp_path: Path) -> None:
    from exporter.serve.config import load_config

    api = exporter.admission.wiring.api_from_config(load_config(str(write_example(tmp_path))))
    assert api is not None
    assert api.book.deployments == ("chat", "agents")
    assert api.book.pools == exporter.admission.book.Pools("chat", "agents", 32_000)
