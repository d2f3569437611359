"""TGI pages -> Snapshots: what TGI offers, what is derived, and what stays None."""

from __future__ import annotations

import math
from pathlib import Path

from exporter.serve.engines import read_page

PAGE = (Path(__file__).parent / "data" / "tgi" / "tgi_CONSTRUCTED_from_source.txt").read_text()


def test_constructed_page_every_field() -> None:
    reading = read_page(PAGE)
    assert reading.kind == "tgi"
    (snap,) = reading.snapshots
    assert (snap.model_name, snap.engine) == ("", "0")  # TGI's page names no model and has no engine index
    assert snap.requests_running == 2.0  # tgi_batch_current_size 2
    assert snap.requests_waiting == 1.0  # tgi_queue_size 1
    assert snap.tokens_in_flight == 2048.0  # tgi_batch_current_max_tokens 2048 (reserved tokens)
    assert snap.kv_cache_capacity_tokens == 16000.0  # tgi_batch_max_total_tokens 16000
    assert snap.kv_cache_usage_ratio == 2048 / 16000
    assert snap.prompt_tokens_total == 400.0  # tgi_request_input_length_sum 400
    assert snap.generation_tokens_total == 200.0  # tgi_request_generated_tokens_sum 200
    assert snap.engine_steps_total == 200.0  # tgi_batch_inference_count{method="decode"} 200
    itl = snap.inter_token_latency  # tgi_batch_inference_duration{method="decode"}, not prefill
    assert itl is not None
    assert itl.count == 200.0 and math.isclose(itl.sum, 200 * 0.02)
    assert [le for le, _ in itl.buckets][:-1] == [0.0001 * 1.5**k for k in range(1, 36)]
    # every decode step took 20 ms: buckets below 0.02 s hold none, the rest all 200
    assert all(count == (0.0 if le < 0.02 else 200.0) for le, count in itl.buckets)
    assert (snap.preemptions_total, snap.block_size_tokens) == (None, None)
    assert {m.split(":")[0] for m in snap.missing} == {"preemptions_total", "block_size_tokens"}


def test_counter_with_total_suffix_and_no_capacity() -> None:
    page = ('tgi_batch_current_size 3\ntgi_batch_current_max_tokens 900\n'
            'tgi_batch_inference_count_total{method="decode"} 77\n')
    (snap,) = read_page(page).snapshots
    assert snap.engine_steps_total == 77.0
    assert snap.kv_cache_usage_ratio is None  # no tgi_batch_max_total_tokens to divide by
    assert any(m.startswith("kv_cache_usage_ratio: TGI has no KV usage metric") for m in snap.missing)
