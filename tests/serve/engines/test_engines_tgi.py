"""TGI pages -> Snapshots: what TGI offers, what is derived, and what stays None."""

from __future__ import annotations

import math

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.serve.alerting import AlertLoop
from exporter.serve.collector import make_registry
from exporter.serve.config import Alerting, config_from_mapping
from exporter.serve.derivation import derive_reading
from exporter.serve.discovery import Target
from exporter.serve.engines import read_page
from tests.support.clocks import ManualClock
from tests.support.tools import DATA

PAGE = (DATA / "tgi" / "tgi_CONSTRUCTED_from_source.txt").read_text()


def test_constructed_page_every_field() -> None:
    reading = read_page(PAGE)
    assert reading.kind == "tgi"
    (snap,) = reading.snapshots
    assert (snap.model_name, snap.engine) == ("", "0")  # TGI's page names no model and has no engine index
    assert snap.requests_running == 2.0  # tgi_batch_current_size 2
    assert snap.requests_waiting == 1.0  # tgi_queue_size 1
    assert snap.kv_cache_reserved_tokens == 2048.0  # tgi_batch_current_max_tokens 2048 (reserved, not held)
    assert (snap.tokens_in_flight, snap.kv_cache_usage_ratio) == (None, None)  # TGI says neither
    assert snap.kv_cache_capacity_tokens == 16000.0  # tgi_batch_max_total_tokens 16000
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
    assert {m.split(":")[0] for m in snap.missing} == {"preemptions_total", "block_size_tokens", "tokens_in_flight",
                                                       "kv_cache_usage_ratio", "kv_cache_used_tokens"}


def test_counter_with_total_suffix_and_no_capacity() -> None:
    page = ('tgi_batch_current_size 3\ntgi_batch_current_max_tokens 900\n'
            'tgi_batch_inference_count_total{method="decode"} 77\n')
    (snap,) = read_page(page).snapshots
    assert snap.engine_steps_total == 77.0
    assert snap.kv_cache_usage_ratio is None
    assert any(m.startswith("kv_cache_usage_ratio: TGI has no KV usage metric") for m in snap.missing)


def _packed_page(reserved: float, capacity: float, running: int) -> str:
    return (f"tgi_batch_current_size {running}\ntgi_queue_size 4\ntgi_batch_current_max_tokens {reserved:g}\n"
            f"tgi_batch_max_total_tokens {capacity:g}\n")


def test_a_packed_batch_raises_no_kv_cache_alert_and_exports_the_reservation_apart(clock: ManualClock) -> None:
    """TGI's router admits until the batch's reservation (prompt + max_new_tokens each) meets
    max_batch_total_tokens: 16 chats of 1,000-token prompts asking up to 3,000 new tokens reserve
    16 x 4,000 = 64,000 of a 65,000-token budget (98%) on their first step, with 16 x 1,000 tokens in the
    cache. Before, that read as a 98% full cache and StepBudgetKVCacheNearlyFull fired 10 minutes later,
    for as long as the router kept the batch packed. Now the reservation is its own series, no usage
    ratio is derived from it, and the prediction uses it as an upper bound, marked as an estimate."""
    deployment = config_from_mapping({"deployments": [{
        "name": "tgi", "model": "qwen3-8b", "gpu": "h100-sxm", "kind": "tgi",
        "targets": {"static": ["http://127.0.0.1:1/metrics"]}}]}).deployments[0]
    reserved = 16 * (1_000 + 3_000)
    (snap,) = read_page(_packed_page(reserved, 65_000, 16)).snapshots
    target = Target(deployment="tgi", target="127.0.0.1:1", url="http://127.0.0.1:1/metrics")
    reading = derive_reading(deployment, target, snap, None, now_seconds=0.0, scrape_duration_seconds=0.01)
    assert reading.kv_cache_reserved_tokens == reserved
    assert reading.kv_cache_usage_ratio is None
    assert reading.tokens_in_flight == reserved and ("tokens_in_flight", "kv_reservation") in reading.estimated
    assert reading.predicted_step_seconds is not None  # still predicted, from the upper bound
    alerts = AlertLoop(Alerting(alertmanager_urls=("http://am.invalid:9093",)), poll_interval_seconds=15,
                       generator_url="http://stepbudget/", clock=clock, post=lambda *_: None)
    for _ in range(12):  # past KVCacheNearlyFull's 10 minutes
        alerts.evaluate([reading], clock.now)
        clock.advance(60)
    assert "StepBudgetKVCacheNearlyFull" not in {alert["alertname"] for alert in alerts.firing()}
    samples = {sample.name: sample.value for family in text_string_to_metric_families(
        generate_latest(make_registry(lambda: [reading], [deployment])).decode()) for sample in family.samples}
    assert samples["stepbudget_kv_cache_reserved_tokens"] == reserved
    assert "stepbudget_kv_cache_usage_ratio" not in samples
