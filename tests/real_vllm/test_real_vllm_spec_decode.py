"""The real vLLM 0.32.0 CPU server with ngram speculative decoding.

Four greedy streams on repetitive prompts (16 random ids repeated), with --speculative-config ngram, 3
draft tokens. The daemon's reading over the streams' window must give each client's speed within 10%,
and must not page at a 25 tok/s target that every client is above. Not run on the branch that wrote it
(it starts vLLM): run it with `pytest -m real_engine tests/real_vllm/test_real_vllm_spec_decode.py`.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from exporter.real_vllm.loadgen import LoadGenerator
from exporter.serve.alerting import PAGE_ALERT, AlertLoop
from exporter.serve.config import Alerting, config_from_mapping
from exporter.serve.derivation import derive_reading
from exporter.serve.discovery import Target
from exporter.serve.engines import read_page
from exporter.serve.window import compute_window
from tests.support.real_vllm import MODEL_CONFIG, host_device, serving

pytestmark = pytest.mark.real_engine

SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                          "prompt_lookup_min": 2})
STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS, TARGET_TOKENS_PER_SECOND = 4, 128, 200, 25.0


def test_ngram_speculation_per_user_speed_and_no_page(tmp_path: Path) -> None:
    with serving(tmp_path, extra_args=("--speculative-config", SPECULATIVE)) as server:
        load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, repeat_ids=16)
        before_text = server.metrics_text()
        workers = [threading.Thread(target=load.one, args=(PROMPT_TOKENS, OUTPUT_TOKENS)) for _ in range(STREAMS)]
        for worker in workers:
            worker.start()
        time.sleep(3.0)  # mid-load: the streams are decoding
        during_text = server.metrics_text()
        for worker in workers:
            worker.join(300.0)
        after_text = server.metrics_text()
    streams = load.streams
    assert len(streams) == STREAMS and all(stream.error is None for stream in streams)
    speeds = []
    for stream in streams:
        (first_at, first_count), (last_at, last_count) = stream.arrivals[0], stream.arrivals[-1]
        speeds.append((last_count - first_count) / (last_at - first_at))
    clients = sum(speeds) / len(speeds)
    assert min(speeds) > TARGET_TOKENS_PER_SECOND
    deployment = config_from_mapping({"deployments": [{
        "name": "tiny", "model": str(MODEL_CONFIG), "gpu": host_device(), "weight_dtype": "fp32",
        "target_tokens_per_second": TARGET_TOKENS_PER_SECOND, "targets": {"static": [server.metrics_url]}}]}
    ).deployments[0]
    target = Target("tiny", server.metrics_url, "127.0.0.1")
    (start,), (during,), (end,) = (read_page(text).snapshots for text in (before_text, during_text, after_text))
    window = compute_window(start, end)
    assert window.tokens_per_step is not None and window.tokens_per_step > 1.5
    reading = derive_reading(deployment, target, during, window, now_seconds=0.0, scrape_duration_seconds=0.0)
    assert reading.measured_user_tokens_per_second is not None
    measured = reading.measured_user_tokens_per_second
    assert abs(measured / clients - 1) < 0.10, (measured, clients)
    loop = AlertLoop(Alerting(), poll_interval_seconds=15)
    for i in range(4):
        loop.evaluate([reading], 300.0 * i)
    assert PAGE_ALERT not in {alert["labels"]["alertname"] for alert in loop.active()}  # type: ignore[index]  # JSON-shaped
