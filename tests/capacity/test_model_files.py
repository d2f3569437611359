"""Models named the way vLLM takes them: a Hugging Face id (`Qwen/Qwen3-8B`) resolved offline from a model
config folder (where the chart mounts its `models` value), from the Hugging Face cache a server filled, from a
model's folder, or, opted into, from a hub on 127.0.0.1; and a clear error where none has it.

The config.json under tests/data/hf_configs/ is the model's published file; each test lays it out the way
the place it is read from holds it (the hub cache's `models--owner--name/snapshots/<rev>/`, a ConfigMap key).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from exporter.capacity import model_files
from exporter.capacity.deployment import load_architecture
from exporter.capacity.hf_config import load_hf_config
from exporter.errors import InputError
from tests.support.chart import CHART, helm, of_kind
from tests.support.servers import PageServer, free_port, send_text
from tests.support.tools import DATA, REPO

CONFIGS = DATA / "hf_configs"
QWEN = CONFIGS / "Qwen3-8B" / "config.json"
LLAMA = CONFIGS / "Llama-3.1-8B" / "config.json"


@pytest.fixture(autouse=True)
def nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every place looked in starts empty and inside the test's folder: no file of this machine's is read."""
    for name in ("HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", model_files.MODEL_HUB_ENV, "HF_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(model_files.MODEL_CONFIGS_ENV, str(tmp_path / "no-configs"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path


def fields(path: Path) -> tuple[int, int, int, int]:
    """What the file says, read here by hand: layers, hidden size, attention and KV heads."""
    raw = json.loads(path.read_text())
    return raw["num_hidden_layers"], raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"]


def cache_snapshot(hub: Path, model_id: str, revision: str, source: Path) -> Path:
    """A snapshot as huggingface_hub lays one out: models--owner--name/snapshots/<revision>/config.json."""
    folder = hub / f"models--{model_id.replace('/', '--')}" / "snapshots" / revision
    folder.mkdir(parents=True)
    shutil.copy(source, folder / "config.json")
    return folder / "config.json"


def set_ref(hub: Path, model_id: str, revision: str) -> None:
    refs = hub / f"models--{model_id.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(revision)


def test_an_id_reads_the_snapshot_refs_main_names_in_the_hub_cache(nowhere: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    hub = nowhere / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    cache_snapshot(hub, "Qwen/Qwen3-8B", "a1b2", QWEN)
    newer = cache_snapshot(hub, "Qwen/Qwen3-8B", "c3d4", LLAMA)  # a later revision than the one main names
    os.utime(newer.parent, (2e9, 2e9))
    set_ref(hub, "Qwen/Qwen3-8B", "a1b2")
    architecture = load_architecture("Qwen/Qwen3-8B")
    assert architecture.name == "Qwen/Qwen3-8B"
    assert (architecture.layers, architecture.hidden_size, architecture.attention_heads,
            architecture.kv_heads) == fields(QWEN)
    assert "snapshots/a1b2/config.json" in architecture.source  # the file read is named where it is shown
    assert architecture == replace(load_hf_config(str(QWEN), name="Qwen/Qwen3-8B"), source=architecture.source)


def test_without_refs_the_newest_snapshot_is_read(nowhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = nowhere / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    older = cache_snapshot(hub, "Qwen/Qwen3-8B", "old", LLAMA)
    os.utime(older.parent, (1e9, 1e9))
    cache_snapshot(hub, "Qwen/Qwen3-8B", "new", QWEN)
    assert load_architecture("Qwen/Qwen3-8B").layers == fields(QWEN)[0]


@pytest.mark.parametrize("variable, hub_under", [("HF_HOME", "hub"), ("XDG_CACHE_HOME", "huggingface/hub"),
                                                 ("HOME", ".cache/huggingface/hub")])
def test_the_cache_is_where_huggingface_hub_puts_it(variable: str, hub_under: str, nowhere: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, str(nowhere / "root"))
    cache_snapshot(nowhere / "root" / hub_under, "meta-llama/Llama-3.1-8B", "r1", LLAMA)
    assert load_architecture("meta-llama/Llama-3.1-8B").layers == fields(LLAMA)[0]


@pytest.mark.parametrize("layout", ["owner--name.json", "owner/name/config.json"])
def test_a_model_config_folder_comes_before_the_cache(layout: str, nowhere: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    folder = nowhere / "models"
    target = folder / ("Qwen--Qwen3-8B.json" if layout == "owner--name.json" else "Qwen/Qwen3-8B/config.json")
    target.parent.mkdir(parents=True)
    shutil.copy(QWEN, target)
    hub = nowhere / "hub"
    cache_snapshot(hub, "Qwen/Qwen3-8B", "r1", LLAMA)  # the cache holds another file: the folder wins
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv(model_files.MODEL_CONFIGS_ENV, os.pathsep.join([str(nowhere / "empty"), str(folder)]))
    assert (load_architecture("Qwen/Qwen3-8B").hidden_size, load_architecture("Qwen/Qwen3-8B").kv_heads) == (
        fields(QWEN)[1], fields(QWEN)[3])


def test_a_model_folder_path_reads_its_config_json(nowhere: Path) -> None:
    folder = nowhere / "models" / "qwen3-8b-instruct"
    folder.mkdir(parents=True)
    shutil.copy(QWEN, folder / "config.json")
    assert load_architecture(str(folder)).layers == fields(QWEN)[0]


def test_a_relative_owner_name_folder_that_exists_is_a_path_as_vllm_reads_it(
        nowhere: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (nowhere / "work" / "Qwen" / "Qwen3-8B").mkdir(parents=True)
    shutil.copy(LLAMA, nowhere / "work" / "Qwen" / "Qwen3-8B" / "config.json")
    monkeypatch.chdir(nowhere / "work")
    assert load_architecture("Qwen/Qwen3-8B").layers == fields(LLAMA)[0]


def test_an_id_found_nowhere_names_where_it_looked_the_nearest_preset_and_how_to_ship_it(nowhere: Path) -> None:
    with pytest.raises(InputError) as error:
        load_architecture("Qwen/Qwen3-8B")
    message = str(error.value)
    assert str(nowhere / "no-configs" / "Qwen--Qwen3-8B.json") in message
    assert str(nowhere / "home" / ".cache" / "huggingface" / "hub" / "models--Qwen--Qwen3-8B") in message
    assert "model: qwen3-8b" in message  # the preset of the same model
    assert "`models` value" in message and model_files.MODEL_CONFIGS_ENV in message
    assert model_files.MODEL_HUB_ENV in message


def test_a_near_miss_suggests_the_closest_preset_and_an_unlike_name_none(nowhere: Path) -> None:
    with pytest.raises(InputError, match=r"nearest preset: qwen3-8b"):
        load_architecture("Qwen/Qwen3-8B-Instruct")
    with pytest.raises(InputError) as error:
        load_architecture("acme/totally-different")
    assert "nearest preset" not in str(error.value)


@pytest.fixture
def hub() -> Iterator[PageServer]:
    server = PageServer()
    yield server
    server.close()


def test_an_opted_in_hub_is_fetched_once_with_the_token_and_kept(hub: PageServer, nowhere: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    hub.respond = lambda handler: send_text(handler, QWEN.read_bytes(), content_type="application/json")
    monkeypatch.setenv(model_files.MODEL_HUB_ENV, hub.url.removesuffix("/metrics") + "/")
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    assert load_architecture("Qwen/Qwen3-8B").layers == fields(QWEN)[0]
    assert load_architecture("Qwen/Qwen3-8B").layers == fields(QWEN)[0]
    assert [request["path"] for request in hub.requests] == ["/Qwen/Qwen3-8B/resolve/main/config.json"]
    assert hub.requests[0]["authorization"] == "Bearer hf_test"
    assert (nowhere / "tmp" / "stepbudget-models" / "Qwen--Qwen3-8B.json").read_bytes() == QWEN.read_bytes()


@pytest.mark.parametrize("status, hint", [(401, "HF_TOKEN"), (404, "spelling")])
def test_a_hub_refusal_says_why(status: int, hint: str, hub: PageServer, nowhere: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    hub.serve_text("no", status=status)
    monkeypatch.setenv(model_files.MODEL_HUB_ENV, hub.url.removesuffix("/metrics"))
    with pytest.raises(InputError, match=rf"HTTP {status}.*{hint}"):
        load_architecture("meta-llama/Llama-3.1-8B")
    assert not (nowhere / "tmp" / "stepbudget-models").exists()  # nothing half-kept for the next start


def test_a_hub_that_is_down_or_answers_no_json_is_an_error(hub: PageServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(model_files.MODEL_HUB_ENV, f"http://127.0.0.1:{free_port()}")
    with pytest.raises(InputError, match=r"cannot fetch http://127\.0\.0\.1:\d+/Qwen/Qwen3-8B/resolve/main/config"):
        load_architecture("Qwen/Qwen3-8B")
    hub.serve_text("<html>login</html>")
    monkeypatch.setenv(model_files.MODEL_HUB_ENV, hub.url.removesuffix("/metrics"))
    with pytest.raises(InputError, match=r"did not answer a JSON config\.json"):
        load_architecture("Qwen/Qwen3-8B")


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "exporter.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, check=False)


def test_plan_by_id_from_the_cache_equals_plan_by_the_file(nowhere: Path) -> None:
    hub = nowhere / "hub"
    cache_snapshot(hub, "Qwen/Qwen3-8B", "r1", QWEN)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    by_id = _cli("plan", "--model", "Qwen/Qwen3-8B", "--gpu", "h100-sxm", "--json", env=env)
    by_file = _cli("plan", "--model", str(QWEN), "--gpu", "h100-sxm", "--json", env=env)
    assert by_id.returncode == 0, by_id.stderr
    plan_by_id, plan_by_file = json.loads(by_id.stdout), json.loads(by_file.stdout)
    assert plan_by_id.pop("model") == "Qwen/Qwen3-8B"
    plan_by_file.pop("model")
    assert plan_by_id == plan_by_file


CHART_VALUES = {
    "config": {"deployments": [{"name": "qwen", "model": "Qwen/Qwen3-8B", "gpu": "h100-sxm",
                                "targets": {"static": ["http://vllm.default.svc:8000/metrics"]}}]},
}


def _mount(config_map: dict, volume: dict, root: Path) -> None:
    """Lay the ConfigMap's keys out as the kubelet does for this volume: each item's key at its path."""
    items = volume["configMap"].get("items") or [{"key": key, "path": key} for key in config_map["data"]]
    for item in items:
        (root / item["path"]).parent.mkdir(parents=True, exist_ok=True)
        (root / item["path"]).write_text(config_map["data"][item["key"]])


def test_the_chart_mounts_a_models_config_json_where_the_daemon_reads_it(nowhere: Path) -> None:
    values = nowhere / "values.yaml"
    values.write_text(yaml.safe_dump(CHART_VALUES))
    rendered = helm("template", "sb", str(CHART), "-f", str(values), "--set-file", f"models.Qwen/Qwen3-8B={QWEN}")
    assert rendered.returncode == 0, rendered.stderr
    docs = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    config_map = of_kind(docs, "ConfigMap")[0]
    pod = of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] == "/etc/stepbudget"
    assert json.loads(config_map["data"]["Qwen--Qwen3-8B.json"]) == json.loads(QWEN.read_text())
    # The pod's /etc/stepbudget, here: config.yaml and models/Qwen--Qwen3-8B.json; the daemon reads the model
    # from models/ (its default folder is /etc/stepbudget/models), with no cache and no network.
    root = nowhere / "etc-stepbudget"
    _mount(config_map, volume, root)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) == [
        "config.yaml", "models/Qwen--Qwen3-8B.json"]
    assert model_files.DEFAULT_MODEL_CONFIGS == f"{mount['mountPath']}/models"
    env = {**os.environ, model_files.MODEL_CONFIGS_ENV: str(root / "models"), "HF_HUB_CACHE": str(nowhere / "none")}
    checked = _cli("check-config", str(root / "config.yaml"), env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    env[model_files.MODEL_CONFIGS_ENV] = str(nowhere / "empty")
    refused = _cli("check-config", str(root / "config.yaml"), env=env)
    assert refused.returncode != 0 and "Qwen--Qwen3-8B.json" in refused.stdout + refused.stderr


def test_the_chart_takes_a_models_json_object_and_refuses_a_key_that_is_no_id(nowhere: Path) -> None:
    values = nowhere / "values.yaml"
    values.write_text(yaml.safe_dump({**CHART_VALUES, "models": {"Qwen/Qwen3-8B": json.loads(QWEN.read_text())}}))
    rendered = helm("template", "sb", str(CHART), "-f", str(values))
    assert rendered.returncode == 0, rendered.stderr
    config_map = of_kind([d for d in yaml.safe_load_all(rendered.stdout) if d], "ConfigMap")[0]
    assert json.loads(config_map["data"]["Qwen--Qwen3-8B.json"]) == json.loads(QWEN.read_text())
    refused = helm("template", "sb", str(CHART), "-f", str(values), "--set", "models.qwen3=x")
    assert refused.returncode != 0 and "qwen3" in refused.stderr
