"""The two checks before a rollout, run as an SRE runs them (`python -m exporter.cli` in a subprocess):
`check-config --offline` (structure and values, no file the config names is read) and `serve --once`
(every target polled as serve polls it, its reading printed, exit 1 naming a target that is down or
unreadable). The targets are real HTTP servers on 127.0.0.1: the simulated vLLM, a closed port, and a
server answering garbage."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.simulator.scenarios import builtin_scenarios
from exporter.simulator.server import ServerHandle, start_server
from tests.support.servers import PageServer, free_port, wait_until

# What each file key of this config names (key path -> file), none of which exists.
MISSING = "/nonexistent/stepbudget"
FILE_KEYS = {
    "deployments[0].model": f"{MISSING}/models/qwen/config.json",
    "deployments[0].calibration": f"{MISSING}/calibration.json",
    "deployments[0].targets.kubernetes.kubeconfig": f"{MISSING}/kubeconfig",
    "deployments[0].auth.bearer_token_file": f"{MISSING}/vllm-token",
    "deployments[0].tls.ca_file": f"{MISSING}/ca.pem",
    "deployments[0].tls.cert_file": f"{MISSING}/client.pem",
    "deployments[0].tls.key_file": f"{MISSING}/client.key",
    "alerting.auth.basic_auth.password_file": f"{MISSING}/alertmanager-password",
    "admission.token_file": f"{MISSING}/admission-token",
}


def mounted_config(files: dict[str, str]) -> dict[str, Any]:
    """A config naming a file at every key that takes one (`files`: key path -> file)."""
    return {
        "deployments": [{
            "name": "chat", "model": files["deployments[0].model"], "gpu": "h100-sxm", "tensor_parallel": 2,
            "calibration": files["deployments[0].calibration"],
            "targets": {"kubernetes": {"namespace": "llm", "label_selector": "app=vllm",
                                       "kubeconfig": files["deployments[0].targets.kubernetes.kubeconfig"]}},
            "auth": {"bearer_token_file": files["deployments[0].auth.bearer_token_file"]},
            "tls": {"ca_file": files["deployments[0].tls.ca_file"], "cert_file": files["deployments[0].tls.cert_file"],
                    "key_file": files["deployments[0].tls.key_file"]},
        }],
        "alerting": {"alertmanager_urls": ["http://127.0.0.1:9093"],
                     "auth": {"basic_auth": {"username": "sre",
                                             "password_file": files["alerting.auth.basic_auth.password_file"]}}},
        "admission": {"enabled": True, "token_file": files["admission.token_file"]},
    }


def stepbudget(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "exporter.cli", *args], capture_output=True, text=True, timeout=60)


def write(path: Path, config: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


# --- check-config --offline ---------------------------------------------------------------------------


def test_offline_check_passes_on_files_that_do_not_exist_and_lists_each(tmp_path: Path) -> None:
    config = write(tmp_path / "stepbudget.yaml", mounted_config(FILE_KEYS))
    done = stepbudget("check-config", "--offline", config)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{config}: ok (offline: {len(FILE_KEYS)} file(s) not read): 1 deployment(s)")
    listed = [line.strip() for line in done.stdout.splitlines()[1:]]
    expected = [f"not read (offline): {key} {file}" for key, file in FILE_KEYS.items()]
    model_line = f"not read (offline): deployments[0].model {FILE_KEYS['deployments[0].model']}"
    assert sorted(line.split(" (tensor_parallel")[0] for line in listed) == sorted(expected)
    assert f"{model_line} (tensor_parallel not checked against its attention heads)" in listed


def test_without_offline_a_missing_file_still_fails_naming_its_key(tmp_path: Path) -> None:
    config = write(tmp_path / "stepbudget.yaml", mounted_config(FILE_KEYS))
    done = stepbudget("check-config", config)
    assert done.returncode == 2
    assert f"deployments[0].calibration: file '{FILE_KEYS['deployments[0].calibration']}' does not exist" \
        in done.stderr


# Each file the loader opens, with what it refuses when the file is there but wrong.
READ_FILES = {
    "deployments[0].calibration": ("not JSON\n", "deployment 'chat': calibration file"),
    "admission.token_file": ("", "the file is empty; put the bearer token in it"),
    "deployments[0].model": ("not JSON\n", "not valid JSON"),
}


@pytest.mark.parametrize("key", READ_FILES)
def test_offline_opens_no_file_even_one_that_is_there(tmp_path: Path, key: str) -> None:
    """A file that is there but would be refused when read: offline it is listed, not read; without
    --offline the read refuses it. (The other files read are left out, so this one is what fails.)"""
    files = {name: str(tmp_path / Path(file).name) for name, file in FILE_KEYS.items()}
    for file in files.values():
        Path(file).write_text("present\n")
    content, refusal = READ_FILES[key]
    Path(files[key]).write_text(content)
    config = mounted_config(files)
    if key != "deployments[0].model":
        config["deployments"][0]["model"] = "qwen3-8b"
    if key != "deployments[0].calibration":
        del config["deployments"][0]["calibration"]
    if key != "admission.token_file":
        del config["admission"]
    path = write(tmp_path / "stepbudget.yaml", config)
    offline = stepbudget("check-config", "--offline", path)
    assert offline.returncode == 0, offline.stderr
    assert f"not read (offline): {key} {files[key]}" in offline.stdout
    online = stepbudget("check-config", path)
    assert online.returncode == 2
    assert refusal in online.stderr


@pytest.mark.parametrize("change, message", [
    (lambda c: c["deployments"][0].update(kv_cache_dtype="fp7"), "deployments[0]: kv cache dtype"),
    (lambda c: c["deployments"][0].update(tensor_parallel=0), "deployments[0].tensor_parallel: expected a whole"),
    (lambda c: c["deployments"][0]["tls"].pop("cert_file"), "deployments[0].tls: key_file is the private key"),
    (lambda c: c["deployments"][0]["auth"].update(bearer_token_env="TOKEN"),
     "deployments[0].auth: give at most one of"),
    (lambda c: c["alerting"].update(alertmanager_urls=["alertmanager:9093"]),
     "alerting.alertmanager_urls[0]: expected an http:// or https:// URL"),
    (lambda c: c["deployments"][0].update(effective_bandwidth="2TB/s"),
     "deployments[0]: give effective_bandwidth or calibration, not both"),
])
def test_offline_still_refuses_a_bad_value(tmp_path: Path, change: Any, message: str) -> None:
    config = mounted_config(FILE_KEYS)
    change(config)
    done = stepbudget("check-config", "--offline", write(tmp_path / "bad.yaml", config))
    assert done.returncode == 2, done.stdout
    assert message in done.stderr
    assert done.stderr.startswith(f"stepbudget check-config: error: {tmp_path / 'bad.yaml'}:")


# --- serve --once -----------------------------------------------------------------------------------


@pytest.fixture()
def simulated_vllm() -> Iterator[ServerHandle]:
    """The simulated vLLM at 30x real time, once its 40 chats are running."""
    handle = start_server(scenario=builtin_scenarios()["steady-chat"], speed=30.0)
    try:
        wait_until(lambda: len(handle.simulator.running) >= 40)
        yield handle
    finally:
        handle.stop()


@pytest.fixture()
def garbage_server() -> Iterator[PageServer]:
    server = PageServer()
    try:
        server.serve_text("<html><body>Welcome to nginx!</body></html>\n")
        yield server
    finally:
        server.close()


def once_config(tmp_path: Path, *urls: str, listen: str = ":9421") -> str:
    return write(tmp_path / "stepbudget.yaml", {
        "listen": listen,
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": list(urls)}}]})


@pytest.mark.slow  # 2 s
def test_once_prints_the_simulated_servers_reading_and_starts_no_server(
        tmp_path: Path, simulated_vllm: ServerHandle) -> None:
    """The daemon's listen port is held by someone else: `serve` would exit 2 there, `--once` never binds."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        config = once_config(tmp_path, f"{simulated_vllm.url}/metrics", listen=f"127.0.0.1:{holder.getsockname()[1]}")
        text = stepbudget("serve", "--once", "--config", config, "--once-interval-seconds", "0.5")
        as_json = stepbudget("serve", "--once", "--config", config, "--once-interval-seconds", "0.5", "--json")
    capacity = simulated_vllm.simulator.capacity_tokens
    target = f"127.0.0.1:{simulated_vllm.port}"
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert lines[0] == "2 poll(s), 0.5s apart; 1 target(s)"
    assert lines[1] == f"chat/{target}: up, vllm page, 1 engine reading(s)"
    assert lines[2].startswith("  qwen3-8b engine 0: ") and f"tokens in flight of {capacity:,} capacity" in lines[2]
    assert "predicted step " in lines[3] and "measured step " in lines[3] and "mean between the polls" in lines[3]
    assert as_json.returncode == 0, as_json.stderr
    (check,) = json.loads(as_json.stdout)
    assert (check["deployment"], check["target"], check["up"], check["error"], check["kind"]) == (
        "chat", target, True, None, "vllm")
    (reading,) = check["readings"]
    assert reading["kv_cache_capacity_tokens"] == capacity
    assert reading["requests_running"] > 0  # the fixture waited for its chats to run
    assert reading["tokens_in_flight"] > 0 and reading["predicted_step_seconds"] > 0
    assert reading["measured_step_seconds"] > 0  # two polls 15 simulated seconds apart
    assert reading["step_budget_seconds"] == pytest.approx(0.9 / 50)  # the default headroom / target_tps


def test_once_with_no_interval_polls_once_and_leaves_the_measured_step_out(
        tmp_path: Path, simulated_vllm: ServerHandle) -> None:
    done = stepbudget("serve", "--once", "--config", once_config(tmp_path, f"{simulated_vllm.url}/metrics"),
                      "--once-interval-seconds", "0", "--json")
    assert done.returncode == 0, done.stderr
    (reading,) = json.loads(done.stdout)[0]["readings"]
    assert reading["measured_step_seconds"] is None and reading["tokens_in_flight"] > 0


@pytest.mark.parametrize("bad", ["closed port", "garbage"])
def test_once_fails_naming_a_target_that_is_down_or_unreadable(
        tmp_path: Path, simulated_vllm: ServerHandle, garbage_server: PageServer, bad: str) -> None:
    bad_url = f"http://127.0.0.1:{free_port()}/metrics" if bad == "closed port" else garbage_server.url
    bad_target = bad_url.removeprefix("http://").removesuffix("/metrics")
    done = stepbudget("serve", "--once", "--config", once_config(tmp_path, f"{simulated_vllm.url}/metrics", bad_url),
                      "--once-interval-seconds", "0.2")
    assert done.returncode == 1
    reason = "Connection refused" if bad == "closed port" else "not Prometheus text"
    failure = next(line for line in done.stderr.splitlines() if line.startswith("stepbudget serve --once: "))
    assert failure.startswith(f"stepbudget serve --once: chat/{bad_target}: ") and reason in failure, done.stderr
    assert f"chat/{bad_target}: DOWN: " in done.stdout
    assert f"chat/127.0.0.1:{simulated_vllm.port}: up, vllm page" in done.stdout  # the good one still read


def test_once_only_flags_without_once_are_refused(tmp_path: Path) -> None:
    done = stepbudget("serve", "--config", once_config(tmp_path, "http://127.0.0.1:9/metrics"), "--json")
    assert done.returncode == 2
    assert "--json and --once-interval-seconds go with --once" in done.stderr
