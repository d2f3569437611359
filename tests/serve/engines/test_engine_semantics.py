"""What real servers mean, beyond the genuine pages: the page's own KV dtype and block size, hybrid
KV caches, estimated values marked, lasting page problems logged once, several API servers, and
releases whose step histogram counts cache hits. Pages are vLLM's format (tests.support.pages.vllm_page);
every expected number is worked out here from the inputs.
"""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from exporter.capacity import kv_cache
from exporter.capacity.presets import get_model_preset
from exporter.serve.config import Config, config_from_mapping
from exporter.serve.snapshot import Histogram, Snapshot
from exporter.serve.window import compute_window
from tests.support.clocks import ManualClock
from tests.support.pages import VllmState, vllm_page
from tests.support.pollers import MakePoller, scrape
from tests.support.servers import PageServer
from tests.support.tools import DATA


def _config(url: str, **deployment: object) -> Config:
    return config_from_mapping({"poll_interval": "15s", "deployments": [{
        "name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "effective_bandwidth": 2e12,
        "targets": {"static": [url]}, **deployment}]})


def test_the_pages_fp8_kv_cache_wins_over_the_config_and_is_said_once(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    config = _config(page_server.url)  # kv_cache_dtype defaults to "auto": 16-bit
    poller = make_poller(config, clock)
    state = VllmState(running=10, kv_usage_ratio=0.25, num_gpu_blocks=4096, block_size=32, cache_dtype="fp8")
    page_server.serve_text(vllm_page(state))
    with capture_logs() as logs:
        poller.poll_once()
        poller.poll_once()
    (reading,) = poller.readings()
    arch = get_model_preset("qwen3-8b")
    # The used blocks (the null block is not among the usage's), less each request's half-empty last block.
    tokens = 0.25 * (4096 - 1) * 32 - 10 * (32 - 1) / 2
    fp8_kv_per_token = 2 * arch.layers * arch.kv_heads * arch.head_dim * 1  # one byte per element
    assert reading.tokens_in_flight == tokens
    assert reading.step_read_bytes == pytest.approx(arch.params * 2 + fp8_kv_per_token * tokens)
    assert (reading.kv_cache_dtype, reading.block_size_tokens) == ("fp8", 32)
    said = [line for line in logs if line["event"] == "page_overrides_config"]
    assert len(said) == 1  # two polls, one line
    assert (said[0]["page_kv_cache_dtype"], said[0]["configured_kv_cache_dtype"]) == ("fp8", "auto")
    assert (said[0]["page_block_size"], said[0]["configured_block_size"]) == (32, 16)
    samples = scrape(config, poller)
    [(info, _)] = samples["stepbudget_model_info"]
    assert (info["kv_cache_dtype"], info["configured_kv_cache_dtype"], info["kv_cache_dtype_source"]) == \
        ("fp8", "auto", "page")
    assert samples["stepbudget_kv_bytes_per_token"] == [({"deployment": "chat"}, fp8_kv_per_token)]


def test_a_page_without_capacity_is_marked_estimated_and_logged_once(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    config = _config(page_server.url)
    poller = make_poller(config, clock)
    page = vllm_page(VllmState(running=4, kv_usage_ratio=0.5))
    without_capacity = "\n".join(line for line in page.splitlines() if "cache_config_info" not in line) + "\n"
    page_server.serve_text(without_capacity)
    with capture_logs() as logs:
        for _ in range(3):
            poller.poll_once()
            clock.advance(15)
    (reading,) = poller.readings()
    capacity = kv_cache.kv_capacity_tokens(config.deployments[0].resolved.setup)
    assert reading.kv_cache_capacity_tokens == capacity
    assert reading.tokens_in_flight == pytest.approx(0.5 * capacity)
    marks = {(labels["quantity"], labels["reason"])
             for labels, _ in scrape(config, poller)["stepbudget_estimated_info"]}
    # The page has no request counters either: the context read is the memory held (docs/engines.md).
    assert marks == {("kv_cache_capacity_tokens", "model_capacity"), ("kv_cache_used_tokens", "model_capacity"),
                     ("tokens_in_flight", "kv_memory_held"), ("tokens_in_flight", "model_capacity")}
    # The page lacks the same thing at every poll: one line saying so, not one a poll.
    [said] = [line for line in logs if line["event"] == "reading_partial"]
    assert said["estimated"] == ["kv_cache_capacity_tokens: model_capacity", "kv_cache_used_tokens: model_capacity",
                                 "tokens_in_flight: kv_memory_held", "tokens_in_flight: model_capacity"]
    page_server.serve_text(page)
    with capture_logs() as logs:
        poller.poll_once()
    (reading,) = poller.readings()
    assert reading.estimated == (("tokens_in_flight", "kv_memory_held"),)
    assert reading.kv_cache_capacity_tokens == 4096 * 16
    [cleared] = [line for line in logs if line["event"] == "reading_partial"]  # the change is said too
    assert cleared["estimated"] == ["tokens_in_flight: kv_memory_held"]


def test_a_lasting_page_problem_is_logged_once_per_change(page_server: PageServer, clock: ManualClock,
                                                          make_poller: MakePoller) -> None:
    poller = make_poller(_config(page_server.url), clock)
    odd = vllm_page(VllmState(running=4, kv_usage_ratio=0.5)) + 'vllm:num_requests_running{engine="0" 3\n'
    page_server.serve_text(odd)
    with capture_logs() as logs:
        for _ in range(4):
            poller.poll_once()
        page_server.serve_text(vllm_page(VllmState(running=4, kv_usage_ratio=0.5)))
        poller.poll_once()
    events = [line["event"] for line in logs if line["event"].startswith("page_problem")]
    assert events == ["page_problem", "page_problems_cleared"]


def test_hybrid_kv_usage_counts_blocks_of_every_group_not_tokens(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    """Gemma 3 27B: 10 full-attention and 52 sliding-window layers of 1,024 tokens. vLLM's hybrid
    allocator cuts them into groups of 10 layers: 1 full group and 6 sliding groups sharing one pool;
    a decoding request holds at most cdiv(1023, 16) + 1 = 65 blocks in each sliding group."""
    config = _config(page_server.url, model="gemma-3-27b")
    poller = make_poller(config, clock)
    # 10,001 blocks (one is vLLM's null block), half in use by 10 running requests: 500 blocks each.
    page_server.serve_text(vllm_page(VllmState(model_name="google/gemma-3-27b-it", running=10,
                                               kv_usage_ratio=0.5, num_gpu_blocks=10001, block_size=16)))
    poller.poll_once()
    (reading,) = poller.readings()
    # 500 blocks = 6 x 65 (sliding groups, full windows) + 1 x C / 16 (the full group) -> C = 110 x 16.
    context = (500 - 6 * 65) * 16
    assert reading.kv_cache_used_tokens == pytest.approx(10 * context)
    assert reading.kv_cache_capacity_tokens == pytest.approx(10 * context / 0.5)
    # A page without request counters: the context read is taken as the context held.
    assert reading.tokens_in_flight == pytest.approx(10 * context)
    assert set(reading.estimated) == {("kv_cache_used_tokens", "hybrid_kv_blocks"),
                                      ("kv_cache_capacity_tokens", "hybrid_kv_blocks"),
                                      ("tokens_in_flight", "kv_memory_held"), ("tokens_in_flight", "hybrid_kv_blocks")}
    # Not usage x blocks x block size, which counts every group's blocks as context tokens.
    assert reading.tokens_in_flight < 0.5 * 10000 * 16 / 4


def test_hybrid_kv_context_inside_the_window_grows_every_group() -> None:
    layout = kv_cache.hybrid_kv_layout(get_model_preset("gemma-3-27b"), 16)
    assert layout is not None
    assert (layout.group_layers, layout.full_groups, layout.sliding_groups, layout.sliding_blocks_per_request) == \
        (10, 1, 6, 65)
    # 100 blocks a request, all 7 groups growing alike: 100 / 7 blocks of 16 tokens.
    assert kv_cache.context_from_blocks(layout, 100, 16) == pytest.approx(100 / 7 * 16)


def _snapshot(*, steps: float, itl_count: float, running: float, computed: float, generated: float,
              iteration_sum: float) -> Snapshot:
    buckets = ((64.0, steps), (float("inf"), steps))
    return Snapshot(kind="vllm", model_name="m", engine="0", requests_running=running,
                    prompt_tokens_total=computed, prompt_tokens_computed_total=computed,
                    generation_tokens_total=generated, engine_steps_total=steps,
                    inter_token_latency=Histogram(((0.05, itl_count), (float("inf"), itl_count)), itl_count,
                                                  itl_count * 0.02),
                    iteration_tokens=Histogram(buckets, steps, iteration_sum))


def test_several_api_servers_over_counting_steps_fall_back_to_itl_per_running_request() -> None:
    # 100 real steps of 40 requests: 4,000 ITL observations, 2,000 computed prompt tokens. Three API
    # servers each observed every step: vllm:iteration_tokens_total counted 300.
    before = _snapshot(steps=0, itl_count=0, running=40, computed=0, generated=0, iteration_sum=0)
    after = _snapshot(steps=300, itl_count=4000, running=40, computed=2000, generated=4000, iteration_sum=6000)
    window = compute_window(before, after)
    assert window.prefill_tokens_per_step == pytest.approx(2000 / (4000 / 40))
    assert window.prefill_mix is None  # each observation was a share of a step, not a step
    assert any("several API servers" in note for note in window.notes)
    one_server = compute_window(before, _snapshot(steps=100, itl_count=4000, running=40, computed=2000,
                                                  generated=4000, iteration_sum=6000))
    assert one_server.prefill_tokens_per_step == pytest.approx(2000 / 100)


def test_a_step_histogram_that_counts_cache_hits_is_not_used_as_the_mix() -> None:
    # Before 0.23.0 each observation held the full prompt: 100 steps, 40 decode tokens each, 20,000
    # prompt tokens of which 2,000 computed; the histogram's sum says 22,000 prompt tokens.
    before = _snapshot(steps=0, itl_count=0, running=40, computed=0, generated=0, iteration_sum=0)
    after = _snapshot(steps=100, itl_count=4000, running=40, computed=2000, generated=4000,
                      iteration_sum=4000 + 20000)
    window = compute_window(before, after)
    assert window.prefill_tokens_per_step == pytest.approx(20)
    assert window.prefill_mix is None
    assert any("disagrees with the computed prompt tokens" in note for note in window.notes)


def test_fp8_on_a_genuine_page_wins_over_the_config(page_server: PageServer, clock: ManualClock,
                                                    make_poller: MakePoller) -> None:
    """vLLM 0.33.0's own page (tests/data/genuine), its CacheConfig run with cache_dtype="fp8": the
    label is CacheConfig.metrics_info()'s string of that field, the only byte that differs from the
    page as rendered with "auto" (vllm/config/cache.py: every field becomes a label)."""
    import json

    genuine = DATA / "genuine"
    page = (genuine / "vllm-0.33.0_GENUINE_dp1_t1.prom").read_text()
    label = ',cache_dtype="auto"'  # not mamba_cache_dtype / mamba_ssm_cache_dtype
    assert page.count(label) == 1
    fed = json.loads((genuine / "vllm-0.33.0_GENUINE_dp1.expected.json").read_text())["phases"][1]["engines"]["0"]
    config = _config(page_server.url)
    poller = make_poller(config, clock)
    page_server.serve_text(page.replace(label, ',cache_dtype="fp8"'))
    poller.poll_once()
    (reading,) = poller.readings()
    arch = get_model_preset("qwen3-8b")
    # num_gpu_blocks="23574" block_size="16" on the page: the used blocks (no null block among the usage's)
    # less each running request's half-empty last block.
    assert fed["kv_cache_capacity_tokens"] == 23574 * 16
    tokens = fed["kv_cache_usage_ratio"] * (23574 - 1) * 16 - fed["requests_running"] * (16 - 1) / 2
    fp8_kv_per_token = 2 * arch.layers * arch.kv_heads * arch.head_dim * 1
    assert reading.kv_cache_dtype == "fp8"
    assert reading.kv_cache_used_tokens == pytest.approx(tokens)
    # What each step reads: the requests' contexts as the page's request counters hold them (vllm:prompt_tokens
    # 140,822 + generation_tokens 2,400 - request_prompt_tokens_sum 12,193 - request_generation_tokens_sum 120).
    context = 140822 + 2400 - 12193 - 120
    assert reading.tokens_in_flight == pytest.approx(context)
    assert reading.step_read_bytes == pytest.approx(arch.params * 2 + fp8_kv_per_token * context)
