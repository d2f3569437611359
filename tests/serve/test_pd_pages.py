"""Prefill/decode disaggregation on pages vLLM 0.32.0's own metrics code wrote (tests/data/vllm-0.32.0-genuine-pd,
provenance in its README): a NixlConnector pair, the prefill side serving only max_tokens=1 requests and holding
their KV until the decode side pulls it, the decode side receiving its prompts by KV transfer; and pages of a
real vLLM 0.32.0 (CPU backend) run with ExampleConnector and with NixlConnector's prefill side.

Every expectation is worked out here from the values fed to vLLM's code (the `.expected.json` beside each pair).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from exporter.serve.alerting import PAGE_ALERT, AlertLoop
from exporter.serve.config import Alerting, Config, Tls, config_from_mapping
from exporter.serve.engines import read_page
from exporter.serve.poller import Poller
from exporter.serve.reading import Reading, server_role
from tests.support.clocks import ManualClock
from tests.support.pollers import MakePoller, scrape
from tests.support.tools import DATA

PD = DATA / "vllm-0.32.0-genuine-pd"
URL = "http://10.0.0.9:8000/metrics"
POLL_SECONDS = 15.0


def _fed(role: str) -> dict[str, Any]:
    fed: dict[str, Any] = json.loads((PD / f"vllm-0.32.0_GENUINE_pd_{role}.expected.json").read_text())
    return fed


def _config() -> Config:
    return config_from_mapping({"poll_interval": "15s", "deployments": [{
        "name": "pd", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [URL]}}]})


def _rig(make_poller: MakePoller, clock: ManualClock, role: str) -> tuple[Poller, AlertLoop, list[str]]:
    pages = [(PD / f"vllm-0.32.0_GENUINE_pd_{role}_t{phase}.prom").read_text() for phase in (0, 1)]

    def fetch(url: str, *, bearer_token: str | None, tls: Tls) -> str:
        return pages[0]

    poller: Poller = make_poller(_config(), clock, fetch=fetch)
    alerts = AlertLoop(Alerting(), poll_interval_seconds=POLL_SECONDS, clock=clock)
    poller.add_listener(alerts.on_poll)
    return poller, alerts, pages


def _window(make_poller: MakePoller, clock: ManualClock, role: str) -> tuple[Reading, Poller, AlertLoop, float]:
    """The reading of the t0 -> t1 window, polled as far apart as the pages were rendered."""
    poller, alerts, pages = _rig(make_poller, clock, role)
    first, second = _fed(role)["traffic"]["page_times"]
    poller.poll_once()
    pages.pop(0)
    clock.advance(second - first)
    poller.poll_once()
    (reading,) = poller.readings()
    return reading, poller, alerts, second - first


def test_a_prefill_server_gets_a_prefill_budget_and_no_decode_step(make_poller: MakePoller,
                                                                   clock: ManualClock) -> None:
    reading, poller, _, seconds = _window(make_poller, clock, "prefill")
    t0, t1 = (phase["engines"]["0"] for phase in _fed("prefill")["phases"])
    assert t1["itl_count"] == 0 and t1["generation_tokens_total"] > 0  # every request ended at its first token
    assert reading.role == "prefill"
    assert reading.predicted_step_seconds is None and reading.step_budget_seconds is None
    assert reading.token_budget_tokens is None and reading.token_budget_utilization_ratio is None
    # Computed prompt tokens: the counted ones between the pages, plus at most what was admitted at t1 and not
    # counted yet (a prompt part-way through its prefill: queries - local hits - computed).
    counted = t1["prompt_tokens_by_source"]["local_compute"] - t0["prompt_tokens_by_source"]["local_compute"]
    part_way = t1["prefix_cache_queries_total"] - t1["prefix_cache_hits_total"] \
        - t1["prompt_tokens_by_source"]["local_compute"]
    assert (counted, part_way) == (50_987, 4_124)
    assert reading.prefill_tokens_per_second is not None
    assert counted / seconds <= reading.prefill_tokens_per_second <= (counted + part_way) / seconds
    capacity = reading.prefill_capacity_tokens_per_second
    assert capacity is not None and capacity > 0
    assert reading.prefill_utilization_ratio == pytest.approx(reading.prefill_tokens_per_second / capacity)
    # 17 requests' first tokens in the window, ttft_sum over them.
    ttft = (t1["ttft_sum"] - t0["ttft_sum"]) / (t1["ttft_count"] - t0["ttft_count"])
    assert reading.measured_time_to_first_token_seconds == pytest.approx(ttft)
    # Its KV holds the finished requests' blocks until the decode side pulls them: memory held, read by no step.
    assert reading.kv_cache_used_tokens == pytest.approx(t1["kv_cache_used_blocks"] * 16 - 1 * 7.5)
    exported = scrape(_config(), poller)
    assert [labels["role"] for labels, _ in exported["stepbudget_target_role_info"]] == ["prefill"]
    assert "stepbudget_predicted_step_seconds" not in exported
    assert exported["stepbudget_prefill_capacity_tokens_per_second"][0][1] == pytest.approx(capacity)


def test_a_prefill_server_never_raises_the_page(make_poller: MakePoller, clock: ManualClock) -> None:
    """Sixteen minutes of polls (the t1 page held): no decode-step page, pending or firing."""
    _, poller, alerts, _ = _window(make_poller, clock, "prefill")
    for _ in range(round(16 * 60 / POLL_SECONDS)):
        clock.advance(POLL_SECONDS)
        poller.poll_once()
        names = {labels["alertname"] for alert in alerts.active()
                 if isinstance(labels := alert["labels"], dict)}
        assert not names & {PAGE_ALERT, "StepBudgetMeasuredStepOverBudget", "StepBudgetPrefillInterference"}


def test_a_decode_server_reads_transferred_prompts_as_no_prefill(make_poller: MakePoller, clock: ManualClock) -> None:
    reading, _, _, _ = _window(make_poller, clock, "decode")
    t0, t1 = (phase["engines"]["0"] for phase in _fed("decode")["phases"])
    transferred = t1["prompt_tokens_by_source"]["external_kv_transfer"]
    assert transferred >= 0.5 * t1["prompt_tokens_total"]
    assert reading.role == "decode"
    # Nothing computed locally (vLLM does not count the recomputed last token); the tokens admitted and awaiting
    # their transfer are the connector's hits, not a prompt part-way: no prefill at all.
    assert t1["prompt_tokens_by_source"]["local_compute"] == t0["prompt_tokens_by_source"]["local_compute"] == 0
    admitted_not_counted = (t1["prefix_cache_queries_total"] - t1["prefix_cache_hits_total"]
                            - t1["external_prefix_cache_hits_total"])
    assert admitted_not_counted == 0
    assert reading.prefill_tokens_per_step == 0
    assert not any("part-way" in note for note in reading.notes)
    # Each open request's whole context; the requests still waiting on their KV (deferred) have no first token.
    context = (t1["prompt_tokens_total"] + t1["generation_tokens_total"] - t1["finished_prompt_tokens_sum"]
               - t1["finished_generation_tokens_sum"])
    assert t1["ttft_count"] - t1["finished_requests_total"] == t1["requests_running"]
    assert reading.tokens_in_flight == pytest.approx(context)
    # The cache holds the waiting requests' blocks too, and the shared system prompt once.
    assert reading.kv_cache_used_tokens == pytest.approx(t1["kv_cache_used_blocks"] * 16
                                                         - t1["requests_running"] * 7.5)
    assert reading.predicted_step_seconds is not None and reading.measured_step_seconds is not None


@pytest.mark.parametrize("page", ["vllm-0.32.0-cpu_REAL_pd_nixl_prefill_only_held.prom",
                                  "vllm-0.32.0-cpu_REAL_pd_example_connector_prefill.prom"])
def test_a_real_prefill_server_is_read_as_one(page: str) -> None:
    """A real vLLM 0.32.0 that served six 1,000-token max_tokens=1 requests: no ITL observation, six tokens."""
    (snapshot,) = read_page((PD / page).read_text()).snapshots
    itl = snapshot.inter_token_latency
    assert itl is not None and itl.count == 0 and snapshot.generation_tokens_total == 6
    assert server_role("auto", snapshot) == "prefill"
    assert server_role("both", snapshot) == "both"  # the config wins


def test_a_real_decode_server_with_example_connector_is_read_as_one() -> None:
    """ExampleConnector loads whole 128-token blocks: 6 x 896 tokens transferred, 624 computed locally."""
    (snapshot,) = read_page((PD / "vllm-0.32.0-cpu_REAL_pd_example_connector_decode.prom").read_text()).snapshots
    assert (snapshot.prompt_tokens_transferred_total, snapshot.prompt_tokens_computed_total) == (6 * 896, 624)
    assert server_role("auto", snapshot) == "decode"
