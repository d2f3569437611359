"""Sharding: shards partition the targets exactly, rebalance minimally when the count changes, hash
the same in every process, and `--shard` / config `shard` are validated with clear errors.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from exporter.errors import InputError
from exporter.serve import sharding
from exporter.serve.config import ConfigError, load_config
from exporter.serve.discovery import NotReadyPod, Target, target_label
from exporter.serve.sharding import Shard, ShardedDiscovery, keep_targets, parse_shard, shard_of
from tests.support.configs import MINIMAL, write
from tests.support.tools import REPO, require_tool

CHART = REPO / "helm" / "stepbudget"


def fleet(count: int) -> list[Target]:
    """`count` targets spread over loopback addresses and ports, as a discovered pod list would be."""
    urls = [f"http://127.0.{i // 250}.{i % 250 + 1}:{8000 + i % 7}/metrics" for i in range(count)]
    return [Target("chat", url, target_label(url)) for url in urls]


def shards_of(targets: list[Target], count: int) -> list[list[Target]]:
    return [keep_targets(targets, Shard(index, count)) for index in range(count)]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13])
def test_every_target_is_in_exactly_one_shard(count: int) -> None:
    targets = fleet(1000)
    shards = shards_of(targets, count)
    placed = [target.url for shard in shards for target in shard]
    assert sorted(placed) == sorted(t.url for t in targets)  # all of them, none twice
    assert len(set(placed)) == len(placed)
    # And balanced: each shard near 1000/count, within 5 binomial standard deviations.
    p = 1 / count
    slack = 5 * math.sqrt(1000 * p * (1 - p))
    for shard in shards:
        assert abs(len(shard) - 1000 * p) <= slack, [len(s) for s in shards]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_adding_a_shard_moves_only_into_the_new_one_about_one_in_count_plus_one(count: int) -> None:
    targets = fleet(2000)
    before = {t.url: shard_of(t.url, count) for t in targets}
    after = {t.url: shard_of(t.url, count + 1) for t in targets}
    moved = [url for url in before if before[url] != after[url]]
    assert all(after[url] == count for url in moved), "a target moved between two old shards"
    p = 1 / (count + 1)
    expected = 2000 * p
    assert abs(len(moved) - expected) <= 5 * math.sqrt(2000 * p * (1 - p)), (len(moved), expected)
    # Removing the last shard is the same move backwards: its targets spread, nobody else moves.
    assert {url for url in after if after[url] == count} == set(moved)


def test_order_of_discovery_does_not_matter_and_order_is_kept() -> None:
    targets = fleet(300)
    shard = Shard(1, 3)
    kept = keep_targets(targets, shard)
    assert [t.url for t in keep_targets(list(reversed(targets)), shard)] == [t.url for t in reversed(kept)]
    positions = [targets.index(t) for t in kept]
    assert positions == sorted(positions)


def test_the_hash_is_the_same_in_another_process_with_another_hash_seed() -> None:
    urls = [t.url for t in fleet(200)]
    here = [shard_of(url, 5) for url in urls]
    script = textwrap.dedent("""
        import json, sys
        from exporter.serve.sharding import shard_of
        urls = json.loads(sys.stdin.read())
        print(json.dumps([shard_of(url, 5) for url in urls]))
    """)
    import json

    for seed in ("1", "12345"):
        result = subprocess.run([sys.executable, "-c", script], input=json.dumps(urls), capture_output=True,
                                text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed}, cwd=REPO)
        assert json.loads(result.stdout) == here


def test_weight_is_blake2b_of_index_and_identity() -> None:
    """The documented hash, so another implementation (a script, a Go sidecar) can agree with it."""
    import hashlib

    digest = hashlib.blake2b(b"2\x00http://10.0.0.1:8000/metrics", digest_size=8).digest()
    assert sharding.shard_weight("http://10.0.0.1:8000/metrics", 2) == int.from_bytes(digest, "big")
    url = "http://10.0.0.1:8000/metrics"
    weights = [sharding.shard_weight(url, i) for i in range(4)]
    assert shard_of(url, 4) == weights.index(max(weights))


# --- the flag and the config section -------------------------------------------------------------


def test_parse_shard_reads_index_and_count() -> None:
    assert parse_shard("2/5") == Shard(2, 5)
    assert parse_shard(" 0 / 1 ") == Shard(0, 1)
    assert str(parse_shard("4/7")) == "4/7"


@pytest.mark.parametrize("text, phrase", [
    ("3/3", "0 <= INDEX < COUNT"),
    ("5/3", "0 <= INDEX < COUNT"),
    ("0/0", "at least 1"),
    ("-1/3", "expected INDEX/COUNT"),
    ("1.5/3", "expected INDEX/COUNT"),
    ("2", "expected INDEX/COUNT"),
    ("a/b", "expected INDEX/COUNT"),
    ("/3", "pod-index"),
    ("$(STEPBUDGET_SHARD_INDEX)/3", "pod-index"),
])
def test_bad_shard_flags_are_clear_input_errors(text: str, phrase: str) -> None:
    with pytest.raises(InputError) as caught:
        parse_shard(text)
    assert phrase in str(caught.value)
    assert repr(text) in str(caught.value)


def test_config_shard_section_is_read(tmp_path: Path) -> None:
    config = load_config(str(write(tmp_path, "shard:\n  index: 1\n  count: 3\n" + textwrap.dedent(MINIMAL))))
    assert sharding.shard_from_config(config) == Shard(1, 3)
    assert sharding.shard_from_config(load_config(str(write(tmp_path, MINIMAL)))) is None


@pytest.mark.parametrize("section, phrase", [
    ("shard:\n  index: 3\n  count: 3\n", "index must satisfy 0 <= index < count, got index 3 with count 3"),
    ("shard:\n  index: -1\n  count: 3\n", "shard.index: expected a whole number >= 0"),
    ("shard:\n  index: 0\n  count: 0\n", "shard.count: expected a whole number >= 1"),
    ("shard:\n  index: 0\n", "missing required key 'count'"),
    ("shard:\n  index: 0\n  count: 2\n  of: 2\n", "shard.of: unknown key"),
])
def test_bad_shard_section_names_the_file_line_and_key(tmp_path: Path, section: str, phrase: str) -> None:
    path = write(tmp_path, section + textwrap.dedent(MINIMAL))
    with pytest.raises(ConfigError) as caught:
        load_config(str(path))
    message = str(caught.value)
    assert phrase in message
    assert message.startswith(f"{path}:")
    assert "shard" in message


def test_serve_with_a_bad_shard_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from exporter.cli import main

    code = main(["serve", "--target", "http://127.0.0.1:9/metrics", "--model", "qwen3-8b", "--gpu", "h100-sxm",
                 "--shard", "3/3", "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "--shard '3/3'" in err


# --- the daemon polls only its shard ------------------------------------------------------------


class _ListDiscovery:
    def __init__(self, targets: list[Target]) -> None:
        self.targets = targets

    def discover(self) -> list[Target]:
        return list(self.targets)


def test_sharded_discovery_follows_the_discovered_list() -> None:
    targets = fleet(60)
    source = _ListDiscovery(targets[:30])
    discovery = ShardedDiscovery(source, Shard(0, 2))
    first = discovery.discover()
    assert [t.url for t in first] == [t.url for t in targets[:30] if shard_of(t.url, 2) == 0]
    source.targets = targets
    assert [t.url for t in discovery.discover()] == [t.url for t in targets if shard_of(t.url, 2) == 0]


def test_each_pod_not_ready_is_reported_by_exactly_one_shard() -> None:
    """Not-Ready pods (StepBudgetTargetNotReady's evidence) are split by namespace/pod like targets by URL:
    every one on exactly one shard, so the shards' in-process loops raise it once."""
    source = _ListDiscovery([])
    pods = [NotReadyPod("chat", "llm", f"vllm-{i}", f"u{i}", 1.8e9, 900.0, "Running") for i in range(40)]
    source.not_ready = lambda: list(pods)  # type: ignore[attr-defined]  # the real Discovery's method, faked
    shares = [ShardedDiscovery(source, Shard(index, 3)).not_ready() for index in range(3)]
    assert sorted(pod.pod for share in shares for pod in share) == sorted(pod.pod for pod in pods)
    assert all(shard_of(f"llm/{pod.pod}", 3) == index for index, share in enumerate(shares) for pod in share)
    assert ShardedDiscovery(source, Shard(0, 1)).not_ready() == pods
    assert ShardedDiscovery(_ListDiscovery([]), Shard(0, 2)).not_ready() == []  # a discovery without any


def test_daemon_with_shard_flag_polls_only_its_shard() -> None:
    """`serve --shard I/N` end to end through the flags, the config and one poll (ports refuse fast)."""
    import argparse

    from exporter.serve import daemon

    urls = [f"http://127.0.9.{i}:9/metrics" for i in range(1, 41)]  # nothing listens there: refused at once
    parser = argparse.ArgumentParser()
    daemon.build_parser(parser)
    polled: list[set[str]] = []
    for index in range(3):
        args = parser.parse_args(["--model", "qwen3-8b", "--gpu", "h100-sxm", "--listen", "127.0.0.1:0",
                                  "--timeout", "1s", "--shard", f"{index}/3",
                                  *[item for url in urls for item in ("--target", url)]])
        config = daemon.config_from_args(args)
        assert config.sections["shard"] == {"index": index, "count": 3}
        built = daemon.build_daemon(config)
        try:
            result = built.poller.poll_once()
        finally:
            built.poller.stop()
            built.server.stop()
            built.fetcher.close()
        assert all(not reading.target_up for reading in result.readings)
        polled.append({reading.target for reading in result.readings})
        assert polled[-1] == {target_label(url) for url in urls if shard_of(url, 3) == index}
    assert set().union(*polled) == {target_label(url) for url in urls}


# --- the chart's StatefulSet passes a shard the daemon accepts, one per ordinal -----------------


def test_chart_statefulset_shard_argument_parses_for_every_ordinal() -> None:
    helm = require_tool("helm")
    rendered = subprocess.run([helm, "template", "sb", str(CHART), "-f", str(CHART / "ci" / "statefulset-values.yaml"),
                               "--set", "replicas=4"], capture_output=True, text=True, check=True).stdout
    sts = next(doc for doc in yaml.safe_load_all(rendered) if doc and doc["kind"] == "StatefulSet")
    main = sts["spec"]["template"]["spec"]["containers"][0]
    argument = main["args"][main["args"].index("--shard") + 1]
    variable = re.fullmatch(r"\$\((\w+)\)/4", argument)
    assert variable, argument
    assert variable.group(1) in {env["name"] for env in main["env"]}
    # Kubernetes substitutes $(VAR) from the env; every ordinal 0..replicas-1 is one valid shard.
    shards = [parse_shard(argument.replace(variable.group(0).split("/")[0], str(ordinal))) for ordinal in range(4)]
    assert shards == [Shard(i, 4) for i in range(4)]


def test_chart_refuses_statefulset_mode_where_pods_have_no_index_label() -> None:
    helm = require_tool("helm")
    args = [helm, "template", "sb", str(CHART), "-f", str(CHART / "ci" / "statefulset-values.yaml")]
    old = subprocess.run([*args, "--kube-version", "1.27.0"], capture_output=True, text=True, check=False)
    assert old.returncode != 0 and "apps.kubernetes.io/pod-index" in old.stderr
    assert subprocess.run([*args, "--kube-version", "1.28.0"], capture_output=True, text=True).returncode == 0
    default = subprocess.run([helm, "template", "sb", str(CHART), "--kube-version", "1.25.0"],
                             capture_output=True, text=True, check=False)
    assert default.returncode == 0, default.stderr  # Deployment mode keeps the chart's 1.25 floor


def test_check_config_knows_the_shard_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from exporter.cli import main

    good = write(tmp_path, "shard: {index: 2, count: 4}\n" + textwrap.dedent(MINIMAL))
    assert main(["check-config", str(good)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("shard: {index: 4, count: 4}\n" + textwrap.dedent(MINIMAL))
    assert main(["check-config", str(bad)]) == 2
    assert f"{bad}:1: shard: index must satisfy 0 <= index < count" in capsys.readouterr().err
