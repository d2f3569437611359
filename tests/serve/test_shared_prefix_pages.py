"""Shared prefixes on a genuine vLLM 0.33.0 page: tokens in flight count what each step reads, not what the
cache holds.

The page pair is tests/data/genuine/vllm-0.33.0_GENUINE_dp1 (rendered by vLLM's own metrics code; Qwen3-8B,
377,184 tokens of KV in 23,574 blocks of 16), edited here the way a server looks when 64 requests, each a
4,000-token system prompt shared by all of them, 200 tokens of its own prompt and 300 sampled, are running:
- the request counters count each request whole (vLLM counts a prompt's full length, cache hits included,
  when its prefill ends: 0.33.0 vllm/v1/metrics/stats.py), so the counters hold 64 x 4,500 = 288,000 tokens;
- the cache holds the prefix's blocks once: with prefix caching, 250 blocks of the prefix and
  ceil(500 / 16) = 32 blocks of each request's own tokens, 2,298 of the 23,573 usable blocks, where without
  sharing each request holds ceil(4,500 / 16) = 282 blocks, 18,048 in all.
Each decode step reads 288,000 tokens of KV either way (no cascade attention in vLLM 0.32.0 and later).
At a 50 tok/s target the Qwen3-8B/H100 budget is about 134,000 tokens (DESIGN §1), so the page must fire
whether or not the prefix is shared; before, the shared page read 36,000 tokens and never fired.
"""

from __future__ import annotations

import math
import re

import pytest

from exporter.capacity.architecture import kv_bytes_per_token, weight_read_bytes
from exporter.serve.alerting import PAGE_ALERT, AlertLoop
from exporter.serve.config import Alerting, Config, Tls, config_from_mapping
from exporter.serve.poller import Poller
from exporter.serve.reading import Reading
from tests.support.clocks import ManualClock
from tests.support.pollers import MakePoller
from tests.support.tools import DATA

GENUINE = DATA / "genuine"
URL = "http://10.0.0.7:8000/metrics"
POLL_SECONDS = 15.0
REQUESTS, SHARED_TOKENS, OWN_PROMPT_TOKENS, GENERATED_TOKENS = 64, 4000, 200, 300
BLOCK_TOKENS, USABLE_BLOCKS = 16, 23574 - 1  # the null block is never handed out (block_pool.py)
# What the t1 page's counters already hold for the 4 requests that finished before (read off the page).
FINISHED_REQUESTS, FINISHED_PROMPT, FINISHED_GENERATED = 4, 12193, 120
ITL_OBSERVATIONS_T0_T1 = 2356 - 1160  # the page pair's ITL counts: one token per request per step between


def _edited(phase: int, *, shared: bool) -> str:
    """The genuine page of `phase` (0 or 1) with 64 running requests of 4,500 tokens of context at t1 (the
    ITL's tokens fewer at t0), every figure worked out from the load above."""
    page = (GENUINE / f"vllm-0.33.0_GENUINE_dp1_t{phase}.prom").read_text()
    generated = REQUESTS * GENERATED_TOKENS - (ITL_OBSERVATIONS_T0_T1 if phase == 0 else 0)
    own_blocks = math.ceil((OWN_PROMPT_TOKENS + GENERATED_TOKENS) / BLOCK_TOKENS)
    blocks = (SHARED_TOKENS // BLOCK_TOKENS + REQUESTS * own_blocks if shared
              else REQUESTS * math.ceil((SHARED_TOKENS + OWN_PROMPT_TOKENS + GENERATED_TOKENS) / BLOCK_TOKENS))
    values = {
        "num_requests_running": REQUESTS, "num_requests_waiting": 0,
        "kv_cache_usage_perc": blocks / USABLE_BLOCKS,
        "prompt_tokens_total": FINISHED_PROMPT + REQUESTS * (SHARED_TOKENS + OWN_PROMPT_TOKENS),
        "generation_tokens_total": FINISHED_GENERATED + generated,
        "request_prompt_tokens_sum": FINISHED_PROMPT, "request_prompt_tokens_count": FINISHED_REQUESTS,
        "request_generation_tokens_sum": FINISHED_GENERATED,
        "time_to_first_token_seconds_count": FINISHED_REQUESTS + REQUESTS,
    }
    for name, value in values.items():
        page, found = re.subn(rf'^(vllm:{name}{{engine="0",model_name="Qwen/Qwen3-8B"}}) \S+$',
                              rf"\g<1> {float(value)!r}", page, flags=re.MULTILINE)
        assert found == 1, name
    # The TTFT histogram's +Inf bucket holds every observation, as its _count does.
    page, found = re.subn(r'^(vllm:time_to_first_token_seconds_bucket{engine="0",le="\+Inf",'
                          r'model_name="Qwen/Qwen3-8B"}) \S+$',
                          rf"\g<1> {float(FINISHED_REQUESTS + REQUESTS)!r}", page, flags=re.MULTILINE)
    assert found == 1
    return page


def _config() -> Config:
    return config_from_mapping({"poll_interval": "15s", "deployments": [{
        "name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [URL]}}]})


def _poll(make_poller: MakePoller, clock: ManualClock, *, shared: bool, minutes: float = 0.0
          ) -> tuple[Reading, AlertLoop]:
    pages = [_edited(0, shared=shared), _edited(1, shared=shared)]

    def fetch(url: str, *, bearer_token: str | None, tls: Tls) -> str:
        return pages[0] if len(pages) > 1 else pages[-1]

    poller: Poller = make_poller(_config(), clock, fetch=fetch)
    alerts = AlertLoop(Alerting(), poll_interval_seconds=POLL_SECONDS, clock=clock)
    poller.add_listener(alerts.on_poll)
    poller.poll_once()
    pages.pop(0)
    for _ in range(1 + round(minutes * 60 / POLL_SECONDS)):
        clock.advance(POLL_SECONDS)
        poller.poll_once()
    (reading,) = poller.readings()
    return reading, alerts


@pytest.mark.parametrize("shared", [True, False])
def test_each_request_is_counted_whole_and_the_cache_holds_what_it_holds(
        shared: bool, make_poller: MakePoller, clock: ManualClock) -> None:
    reading, _ = _poll(make_poller, clock, shared=shared)
    context = REQUESTS * (SHARED_TOKENS + OWN_PROMPT_TOKENS + GENERATED_TOKENS)  # 288,000
    assert reading.tokens_in_flight == pytest.approx(context)
    # KV used: the blocks' token slots less half a block per request for the partly filled last one.
    blocks = 250 + 64 * 32 if shared else 64 * 282
    assert reading.kv_cache_used_tokens == pytest.approx(blocks * 16 - 64 * 7.5, rel=1e-6)
    assert reading.kv_cache_shared_ratio == pytest.approx(
        1 - (blocks * 16 - 64 * 7.5) / context if shared else 0.0, abs=0.02)
    assert reading.kv_cache_usage_ratio == pytest.approx(blocks / USABLE_BLOCKS)
    assert reading.estimated == ()  # every figure from the page's own counters
    # Qwen3-8B at 60% of an H100's 3.35 TB/s, 18 ms budget: (0.018 x 2.01e12 - weights) / 147,456 B.
    weights = 8.19e9 * 2  # the preset's 8.19e9 parameters in bf16 (test_the_model_agrees_with_the_hand_figures)
    budget = (0.9 / 50 * 0.6 * 3.35e12 - weights) / 147456
    assert reading.token_budget_tokens == pytest.approx(budget, rel=0.02)
    assert reading.token_budget_utilization_ratio is not None and reading.token_budget_utilization_ratio > 2.0
    assert reading.step_budget_seconds is not None and reading.predicted_step_seconds is not None
    # 288,000 tokens x 147,456 B + the weights, at 2.01e12 B/s: the step reads every request's whole context.
    memory_seconds = (context * 147456 + weights) / (0.6 * 3.35e12)
    assert reading.predicted_memory_step_seconds == pytest.approx(memory_seconds, rel=1e-3)
    assert reading.predicted_step_seconds > reading.step_budget_seconds


def test_the_model_agrees_with_the_hand_figures() -> None:
    """The hand figures above are the preset's: a check on the test's own arithmetic."""
    deployment = _config().deployments[0]
    setup = deployment.resolved.setup
    assert kv_bytes_per_token(setup.architecture, setup.kv_bytes_per_element) == 147456
    assert weight_read_bytes(setup.architecture, setup.weight_bytes_per_param, 1.0) == pytest.approx(8.19e9 * 2)


@pytest.mark.parametrize("shared", [True, False])
def test_the_page_fires_with_or_without_sharing(shared: bool, make_poller: MakePoller, clock: ManualClock) -> None:
    _, alerts = _poll(make_poller, clock, shared=shared, minutes=6)
    assert PAGE_ALERT in {alert["alertname"] for alert in alerts.firing()}
    assert "StepBudgetPrefillInterference" not in {alert["alertname"] for alert in alerts.firing()}
