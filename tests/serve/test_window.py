"""Two polls -> one window: measured step mean and median, prefill per step, resets, idle windows.

Pages are built here with known bucket counts; expected numbers are worked out in each test with
PromQL's histogram_quantile rule: rank = q x observations, find the first bucket whose cumulative
count reaches the rank, interpolate linearly between its lower and upper edge.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.serve.engines import read_page
from exporter.serve.snapshot import Histogram, Snapshot
from exporter.serve.window import compute_window, histogram_quantile
from exporter.simulator import Simulator
from tests.support.simulated_polls import simulated_polls
from tests.support.simulator import SPEC, calibrated_deployment, true_mean_step_seconds
from tests.support.tools import DATA, require_tool

EDGES = ("0.01", "0.025", "0.05")


def page(buckets: list[float], itl_sum: float, prompt: float, steps: float, edges: tuple[str, ...] = EDGES) -> Snapshot:
    """A vLLM page with an ITL histogram (cumulative `buckets`, last is +Inf) and two counters."""
    labels = 'engine="0",model_name="m"'
    lines = [f'vllm:inter_token_latency_seconds_bucket{{{labels},le="{le}"}} {count}'
             for le, count in zip((*edges, "+Inf"), buckets, strict=True)]
    lines += [
        f"vllm:inter_token_latency_seconds_count{{{labels}}} {buckets[-1]}",
        f"vllm:inter_token_latency_seconds_sum{{{labels}}} {itl_sum}",
        f"vllm:prompt_tokens_total{{{labels}}} {prompt}",
        f"vllm:iteration_tokens_total_count{{{labels}}} {steps}",
    ]
    (snapshot,) = read_page("\n".join(lines) + "\n").snapshots
    return snapshot


def test_mean_median_prefill_from_two_polls() -> None:
    before = page([10, 30, 40, 40], itl_sum=1.0, prompt=1000, steps=100)
    after = page([15, 75, 90, 90], itl_sum=2.6, prompt=1600, steps=250)
    window = compute_window(before, after)
    # deltas: buckets 5, 45, 50, 50 -> 50 observations summing to 1.6 s
    assert window.tokens_generated == 50
    assert window.measured_step_mean_seconds == pytest.approx(1.6 / 50)
    # rank 0.5 x 50 = 25 falls in (0.01, 0.025] where cumulative goes 5 -> 45
    assert window.measured_step_median_seconds == pytest.approx(0.01 + (0.025 - 0.01) * (25 - 5) / (45 - 5))
    assert window.prefill_tokens_per_step == pytest.approx(600 / 150)
    # The page has vllm:prompt_tokens_total only (no local_compute count): the window says so.
    assert window.counter_reset is False
    assert window.notes == ("prompt tokens include prefix-cache hits (the page has no computed-token count): "
                            "prefill per step is an upper bound",)


def test_median_in_the_first_bucket_starts_from_zero() -> None:
    window = compute_window(page([0, 0, 0, 0], 0, 0, 0), page([8, 8, 8, 8], 0.04, 0, 8))
    assert window.measured_step_median_seconds == pytest.approx(0 + 0.01 * (4 / 8))


def test_median_in_the_inf_bucket_is_the_last_finite_edge() -> None:
    window = compute_window(page([0, 0, 0, 0], 0, 0, 0), page([0, 1, 1, 10], 9.0, 0, 10))
    assert window.measured_step_median_seconds == 0.05  # rank 5 > 1 observation at or under 0.05 s
    assert window.measured_step_mean_seconds == pytest.approx(9.0 / 10)


def test_no_new_tokens_is_idle_not_zero() -> None:
    same = page([10, 30, 40, 40], 1.0, 1000, 100)
    window = compute_window(same, same)
    assert window.measured_step_mean_seconds is None and window.measured_step_median_seconds is None
    assert window.prefill_tokens_per_step is None
    assert window.tokens_generated == 0
    assert "idle" in " ".join(window.notes)


@pytest.mark.parametrize(
    "after",
    [
        page([1, 2, 3, 3], 0.1, 1600, 250),  # ITL count went 40 -> 3: restarted
        page([15, 75, 90, 90], 2.6, 10, 250),  # prompt tokens went 1000 -> 10
        page([15, 75, 90, 90], 2.6, 1600, 5),  # engine steps went 100 -> 5
        page([9, 75, 90, 90], 2.6, 1600, 250),  # one bucket went 10 -> 9
    ],
)
def test_any_counter_going_backwards_is_a_reset_with_no_deltas(after: Snapshot) -> None:
    window = compute_window(page([10, 30, 40, 40], 1.0, 1000, 100), after)
    assert window.counter_reset is True
    assert (window.measured_step_mean_seconds, window.measured_step_median_seconds) == (None, None)
    assert (window.prefill_tokens_per_step, window.tokens_generated) == (None, None)


def test_changed_bucket_edges_give_a_mean_but_no_median() -> None:
    before = page([10, 30, 40, 40], 1.0, 1000, 100)
    after = page([15, 60, 75, 90, 90], 2.6, 1000, 200, edges=("0.01", "0.025", "0.04", "0.05"))
    window = compute_window(before, after)
    assert window.measured_step_median_seconds is None
    assert window.measured_step_mean_seconds == pytest.approx(1.6 / 50)
    assert window.prefill_tokens_per_step == 0.0
    assert any("edges changed" in note for note in window.notes)


def test_first_poll_and_other_engine_have_no_window() -> None:
    current = page([10, 30, 40, 40], 1.0, 1000, 100)
    assert compute_window(None, current).measured_step_mean_seconds is None
    other = Snapshot(kind="vllm", model_name="m", engine="1")
    window = compute_window(other, current)
    assert window.tokens_generated is None and window.counter_reset is False


def test_missing_histogram_or_step_counter_is_said() -> None:
    bare = Snapshot(kind="vllm", model_name="m", engine="0", prompt_tokens_total=5)
    window = compute_window(bare, bare)
    assert window.measured_step_mean_seconds is None and window.prefill_tokens_per_step is None
    assert len(window.notes) == 2


def test_quantile_edge_cases_match_promql() -> None:
    inf = float("inf")
    assert histogram_quantile(0.5, ((0.1, 0.0), (inf, 0.0))) is None  # no observations: NaN in PromQL
    assert histogram_quantile(0.5, ((0.1, 3.0), (0.2, 5.0))) is None  # no +Inf bucket
    assert histogram_quantile(0.5, ((inf, 3.0),)) is None  # fewer than two buckets
    assert histogram_quantile(0.5, ((-1.0, 4.0), (0.0, 4.0), (inf, 4.0))) == -1.0  # first edge <= 0
    # non-monotonic input is made monotonic first (counts 4, 2 -> 4, 4): rank 2 in the first bucket
    assert histogram_quantile(0.5, ((0.1, 4.0), (0.2, 2.0), (inf, 4.0))) == pytest.approx(0.1 * 2 / 4)


@pytest.mark.parametrize(
    "before, after",
    [([10, 30, 40, 40], [15, 75, 90, 90]), ([0, 0, 0, 0], [8, 8, 8, 8]), ([0, 0, 0, 0], [0, 1, 1, 10]),
     ([1, 2, 3, 4], [1, 2, 9, 12])],
)
def test_median_agrees_with_real_promql(tmp_path: Path, before: list[float], after: list[float]) -> None:
    """The same two polls in Prometheus's own engine (promtool): histogram_quantile over the deltas."""
    window = compute_window(page(before, 1.0, 0, 0), page(after, 2.6, 0, 1))
    series = "\n".join(
        f"      - series: 'itl_bucket{{le=\"{le}\"}}'\n        values: '{b} {a}'"
        for le, b, a in zip((*EDGES, "+Inf"), before, after, strict=True)
    )
    (tmp_path / "rules.yaml").write_text("groups: []\n")
    (tmp_path / "test.yaml").write_text(
        textwrap.dedent(
            """\
            rule_files: [rules.yaml]
            evaluation_interval: 1m
            tests:
              - interval: 1m
                input_series:
            {series}
                promql_expr_test:
                  - expr: histogram_quantile(0.5, itl_bucket - itl_bucket offset 1m)
                    eval_time: 1m
                    exp_samples:
                      - labels: '{{}}'
                        value: {value!r}
            """
        ).format(series=series, value=window.measured_step_median_seconds)
    )
    result = subprocess.run([require_tool("promtool"), "test", "rules", "test.yaml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _histogram(edges: list[float], increments: list[int]) -> Histogram:
    counts, running = [], 0.0
    for step in increments:
        running += step
        counts.append(running)
    buckets = tuple(zip([*edges, float("inf")], counts, strict=True))
    total = sum(e * i for e, i in zip([*edges, edges[-1] * 2], increments, strict=True))
    return Histogram(buckets=buckets, count=running, sum=total)


@settings(max_examples=200, deadline=None)
@given(
    edges=st.lists(st.floats(0.001, 10), min_size=1, max_size=6, unique=True).map(sorted),
    data=st.data(),
)
def test_fuzz_windows_are_never_negative_nan_or_outside_the_edges(edges: list[float], data: st.DataObject) -> None:
    increments = st.lists(st.integers(0, 50), min_size=len(edges) + 1, max_size=len(edges) + 1)
    counters = st.one_of(st.none(), st.floats(0, 1e6))
    snaps = [
        Snapshot(
            kind="vllm", model_name="m", engine="0",
            inter_token_latency=data.draw(st.one_of(st.none(), increments.map(lambda inc: _histogram(edges, inc)))),
            prompt_tokens_total=data.draw(counters), engine_steps_total=data.draw(counters),
        )
        for _ in range(2)
    ]
    window = compute_window(snaps[0], snaps[1])
    for value in (window.measured_step_mean_seconds, window.prefill_tokens_per_step, window.tokens_generated):
        assert value is None or (math.isfinite(value) and value >= 0)
    median = window.measured_step_median_seconds
    assert median is None or 0 <= median <= edges[-1]
    if window.counter_reset:
        assert (window.measured_step_mean_seconds, median, window.prefill_tokens_per_step) == (None, None, None)


def test_a_sum_wobbling_in_its_last_bits_is_not_a_restart() -> None:
    before = page([10, 30, 40, 40], itl_sum=7.631999999999873, prompt=0, steps=0)
    after = page([10, 30, 40, 40], itl_sum=7.631999999999872, prompt=0, steps=0)
    window = compute_window(before, after)
    assert window.counter_reset is False
    assert window.measured_step_mean_seconds is None  # idle: no new observations


def test_a_request_prefilling_in_chunks_beside_one_decoding_is_not_a_second_api_server() -> None:
    """One stream decoding while 8,000-token prompts (one output token each) queue behind it: every
    step carries the stream's token and a 2,048-token chunk (max_num_batched_tokens 2,048 - 1), with
    2 requests running and 1 ITL observation per step. Reading the ITL per running request as the
    steps (as before) halved them: ~4,090 prefill tokens per step, the mix dropped, 140 ms predicted
    against a measured 73 ms."""
    sim = Simulator(SPEC, record_steps=True)
    sim.submit(200, 100_000)
    for _ in range(150):
        sim.submit(8000, 1)
    polls = list(simulated_polls(sim, calibrated_deployment(), 10.0, 40.0))
    for poll in polls[1:]:  # the first poll has no window; the prompts last until ~45 s
        reading = poll.reading
        true_prefill = sum(s.prefill_tokens for s in poll.steps) / len(poll.steps)
        assert true_prefill == pytest.approx(2047, abs=1)  # 2,048 - the decoding stream's token
        assert {s.running for s in poll.steps} == {2}
        assert not any("several API servers" in note for note in reading.notes)
        # Prompts are counted when their last chunk finishes, and a prompt is part-way at each poll: its
        # chunks are placed in the window they ran in from the KV cache's growth, within a block.
        assert reading.prefill_tokens_per_step == pytest.approx(true_prefill, rel=0.05)
        # The iteration-tokens histogram observes each prompt in its last step, as the counters count it:
        # its parts are scaled to the prompt tokens the window computed.
        assert reading.prefill_mix is not None
        assert sum(tokens * share for tokens, share in reading.prefill_mix) == pytest.approx(
            reading.prefill_tokens_per_step, rel=1e-3)
        measured = true_mean_step_seconds(poll.steps)
        assert measured is not None and reading.measured_step_seconds == pytest.approx(measured)
        # Each window holds dozens of whole 8,000-token prompts, computed in chunks: their tokens stood,
        # on average, halfway through their prompts, and attend to that much.
        assert reading.prefill_mean_context_tokens == pytest.approx(8000 / 2, rel=0.02)
        # Within 20%: this deployment was calibrated on decode alone, and predicts GEMMs and attention at
        # the default half of the dense peak, where the simulated GPU runs them at 55% of it.
        assert reading.predicted_step_seconds == pytest.approx(measured, rel=0.2)


def test_several_api_servers_are_still_told_apart_while_a_prompt_prefills_in_chunks() -> None:
    # 100 steps of 40 decoding requests and one prompt prefilling 2,048 tokens a step (10 prompts of
    # 20,480 finish: 10 first tokens); two API servers each observe every step: 200 observations.
    def snapshot(steps: float, itl: float, computed: float, generated: float) -> Snapshot:
        return Snapshot(kind="vllm", model_name="m", engine="0", requests_running=41,
                        prompt_tokens_computed_total=computed, generation_tokens_total=generated,
                        engine_steps_total=steps,
                        inter_token_latency=Histogram(((0.05, itl), (math.inf, itl)), itl, itl * 0.02))

    before = snapshot(0, 0, 0, 0)
    window = compute_window(before, snapshot(200, 4000, 204_800, 4010))
    # At most min((4,000 + 10 + 204,800) / 41, (4,000 + 10) / 40) = 100.25 steps: 200 > 1.8 x 100.25.
    assert any("several API servers" in note for note in window.notes)
    assert window.prefill_tokens_per_step == pytest.approx(204_800 / (4000 / 41))
    one_server = compute_window(before, snapshot(100, 4000, 204_800, 4010))
    assert one_server.prefill_tokens_per_step == pytest.approx(2048)
    assert not any("several API servers" in note for note in one_server.notes)


def test_the_real_16_stream_window_counts_its_steps_once() -> None:
    """vLLM 0.32.0's own pages 10 s apart, 16 streams decoding (tests/data/vllm-0.32.0-cpu/README.md):
    181 steps, 2,896 ITL observations = 16 x 181."""
    data = DATA / "vllm-0.32.0-cpu"
    (before,) = read_page((data / "vllm-0.32.0-cpu_REAL_16streams_t0.prom").read_text()).snapshots
    (after,) = read_page((data / "vllm-0.32.0-cpu_REAL_16streams_t1.prom").read_text()).snapshots
    window = compute_window(before, after)
    assert window.tokens_generated == 2896
    assert not any("several API servers" in note for note in window.notes)
    assert window.prefill_tokens_per_step == 0.0


@pytest.mark.parametrize("context_tokens", [10_000, 40_000, 70_000, 90_000])
def test_steps_inside_one_itl_bucket_export_its_bounds_not_a_median(context_tokens: int) -> None:
    """Two streams decoding alone at a cached context: steps of ~11, 15, 20 and 23 ms, every one in
    vLLM's default (10 ms, 25 ms] ITL bucket. PromQL's interpolation puts each window's median at
    the bucket's middle, 17.5 ms, whatever the step: that is no measurement and is not exported; the
    bucket's bounds are, and the mean (delta sum / delta count) is the step time itself."""
    sim = Simulator(SPEC, record_steps=True)
    for _ in range(2):
        sim.submit(context_tokens, 20_000, cached_prefix_tokens=context_tokens - 1)
    *_, poll = simulated_polls(sim, calibrated_deployment(), 5.0, 10.0)
    observations = [s.seconds for s in poll.steps for _ in range(s.decode_tokens)]
    assert all(0.010 < seconds <= 0.025 for seconds in observations)
    reading = poll.reading
    assert reading.measured_step_median_seconds is None
    assert (reading.measured_step_median_lower_seconds, reading.measured_step_median_upper_seconds) == (0.010, 0.025)
    assert reading.measured_step_seconds == pytest.approx(statistics.fmean(observations))


def test_a_median_inside_a_narrow_bucket_is_exported_with_its_bounds() -> None:
    # Buckets 1 ms wide around 20 ms (a server started with finer ITL buckets): 100 observations,
    # 30 up to 20 ms, 90 up to 21 ms -> rank 50 in (20 ms, 21 ms], 20 of its 60 in.
    edges = ("0.019", "0.02", "0.021", "0.05")
    before = page([0, 0, 0, 0, 0], itl_sum=0.0, prompt=0, steps=0, edges=edges)
    after = page([10, 30, 90, 100, 100], itl_sum=2.05, prompt=0, steps=50, edges=edges)
    window = compute_window(before, after)
    median = 0.020 + (0.021 - 0.020) * (50 - 30) / (90 - 30)
    assert window.measured_step_median_seconds == pytest.approx(median)
    assert window.measured_step_median_point_seconds == pytest.approx(median)  # 1 ms is 5% of 20.3 ms
    assert (window.measured_step_median_lower_seconds, window.measured_step_median_upper_seconds) == (0.020, 0.021)


def test_a_median_in_the_inf_bucket_has_a_lower_bound_only() -> None:
    window = compute_window(page([0, 0, 0, 0], 0, 0, 0), page([0, 1, 1, 10], 9.0, 0, 10))
    assert window.measured_step_median_point_seconds is None
    assert (window.measured_step_median_lower_seconds, window.measured_step_median_upper_seconds) == (0.05, None)


def _engine(*, usage: float, prompt: float, generated: float, admitted: float, computed: float,
            finished_prompt: float = 0.0, finished_generated: float = 0.0, admitted_hits: float = 0.0,
            counted_hits: float = 0.0, steps: float, itl_observations: float | None = None) -> Snapshot:
    """One vLLM engine of 101 blocks of 128 tokens (100 usable: usage 0.01 is one block); with
    `itl_observations`, an ITL histogram of that many 50 ms steps."""
    itl = (None if itl_observations is None else
           Histogram(((math.inf, itl_observations),), itl_observations, 0.05 * itl_observations))
    return Snapshot(kind="vllm", model_name="m", engine="0", kv_cache_usage_ratio=usage, kv_cache_blocks=101,
                    block_size_tokens=128, prompt_tokens_total=prompt, prompt_tokens_computed_total=computed,
                    prompt_tokens_local_cache_hit_total=counted_hits, generation_tokens_total=generated,
                    prompt_tokens_admitted_total=admitted, prompt_tokens_admitted_cached_total=admitted_hits,
                    finished_prompt_tokens_total=finished_prompt, finished_generation_tokens_total=finished_generated,
                    engine_steps_total=steps, inter_token_latency=itl)


def test_a_chunk_is_read_where_it_stood_in_its_prompt() -> None:
    """A 6,000-token prompt beside one chat: 2,048 of it computed at the first poll, a 2,047-token chunk (the
    budget less the chat's token) by the second, the last 1,905 tokens and its first token by the third.
    The chat holds 1,535 tokens, then 1,536 and 1,537: 12 blocks, then 13. A token at position k attends
    to k tokens, so a chunk from k0 to k1 attends to (k1^2 - k0^2) / 2 in all."""
    chat_prompt, long_prompt = 1000, 6000
    first = _engine(usage=(12 + 16) / 100, prompt=chat_prompt, generated=535, admitted=chat_prompt + long_prompt,
                    computed=chat_prompt, steps=10, itl_observations=534)
    second = _engine(usage=(12 + 32) / 100, prompt=chat_prompt, generated=536, admitted=chat_prompt + long_prompt,
                     computed=chat_prompt, steps=11, itl_observations=535)
    third = _engine(usage=(13 + 47) / 100, prompt=chat_prompt + long_prompt, generated=538,
                    admitted=chat_prompt + long_prompt, computed=chat_prompt + long_prompt, steps=12,
                    itl_observations=536)
    went_on = compute_window(first, second)
    # KV slots 2,048 .. 4,095 of the prompt; the chat's one partly filled slot reads as a 2,049th token.
    assert went_on.prefill_tokens_per_step == pytest.approx(2047)
    assert went_on.prefill_mean_context_tokens == pytest.approx((4096 ** 2 - 2049 ** 2) / 2 / 2047)
    assert went_on.prefill_mean_context_tokens == pytest.approx(2048 + 2047 / 2, abs=2)
    finished = compute_window(second, third)
    assert finished.prefill_tokens_per_step is not None and finished.prefill_mean_context_tokens is not None
    # The window computed the prompt's last 1,905 tokens. What they attended to is placed within a position
    # each (the KV cache read the prompt's 4,095 tokens as 4,096), however many tokens the cache's growth
    # reads the window as (here the chat's new block too: 2,045).
    attended = finished.prefill_tokens_per_step * finished.prefill_mean_context_tokens
    assert attended == pytest.approx((long_prompt ** 2 - 4095 ** 2) / 2, abs=long_prompt)
    # A page without the ITL histogram cannot say how many prompts were counted: where they stood is unknown.
    no_itl = [replace(snapshot, inter_token_latency=None) for snapshot in (first, second)]
    assert compute_window(*no_itl).prefill_mean_context_tokens is None


def test_a_long_prompt_counted_beside_chats_is_read_from_its_own_step() -> None:
    """On a GPU a long prompt is admitted and counted within one poll: a 4,000-token prompt and three chats'
    100-token prompts, 40 requests decoding, 24 steps. Their computed tokens attend to 4,000^2 / 2 +
    3 x 100^2 / 2 = 8,015,000 pairs; read as 4 prompts of equal length it would be 4 x 1,075^2 / 2 =
    2,311,250. The iteration-tokens histogram observes each prompt in its own step: the long one's in the
    (2,048, 4,096] bucket, placed inside it by the known token total, within a quarter."""
    edges = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, math.inf)

    def engine(steps: list[int], prompt: float, generated: float, itl: float) -> Snapshot:
        iteration = Histogram(tuple((edge, float(sum(1 for t in steps if t <= edge))) for edge in edges),
                              float(len(steps)), float(sum(steps)))
        return Snapshot(kind="vllm", model_name="m", engine="0", requests_running=40, prompt_tokens_total=prompt,
                        prompt_tokens_computed_total=prompt, generation_tokens_total=generated,
                        engine_steps_total=len(steps), iteration_tokens=iteration,
                        inter_token_latency=Histogram(((math.inf, itl),), itl, 0.03 * itl))

    decode_steps = [40] * 10
    window_steps = [40] * 20 + [4000 + 40] + [100 + 40] * 3
    # 24 steps of 40 decoding requests: 960 ITL observations, and 4 first tokens
    window = compute_window(engine(decode_steps, 1000, 400, 400),
                            engine(decode_steps + window_steps, 1000 + 4300, 400 + 960 + 4, 400 + 960))
    assert window.prefill_tokens_per_step == pytest.approx(4300 / 24)
    assert window.prefill_mean_context_tokens is not None
    attended = window.prefill_mean_context_tokens * 4300
    assert attended == pytest.approx((4000 ** 2 + 3 * 100 ** 2) / 2, rel=0.25)
    assert attended > 2 * 4 * (4300 / 4) ** 2 / 2


def test_a_chunk_is_placed_only_while_a_prompt_is_part_way() -> None:
    """The KV cache grows by 16 blocks in one step while nothing is counted: with a 2,048-token prompt
    admitted and uncounted it is that prompt's chunk; with nothing admitted (prefix caching off: vLLM
    then counts no admission) the window keeps the counters' 0, as on pages before."""
    before = _engine(usage=0.10, prompt=1000, generated=500, admitted=1000, computed=1000, steps=10)
    after = _engine(usage=0.26, prompt=1000, generated=501, admitted=3048, computed=1000, steps=11)
    # 16 blocks x 128 tokens, less the one sampled token the running request's context gained
    assert compute_window(before, after).prefill_tokens_per_step == pytest.approx(16 * 128 - 1)
    no_caching = [replace(snapshot, prompt_tokens_admitted_total=0.0, prompt_tokens_admitted_cached_total=0.0)
                  for snapshot in (before, after)]
    assert compute_window(*no_caching).prefill_tokens_per_step == 0
    absent = [replace(snapshot, prompt_tokens_admitted_total=None) for snapshot in (before, after)]
    assert compute_window(*absent).prefill_tokens_per_step == 0


def test_a_chunk_is_held_within_what_was_part_way() -> None:
    """The cache's growth is the chunk give or take the partly filled blocks, so it is bounded by the
    prompt admitted: 20 blocks' growth with 1,000 tokens part-way reads 1,000; and the cache freeing a
    finished request's blocks while a prompt is part-way at both ends never reads as negative work."""
    before = _engine(usage=0.10, prompt=1000, generated=500, admitted=1000, computed=1000, steps=10)
    grown = _engine(usage=0.30, prompt=1000, generated=500, admitted=2000, computed=1000, steps=11)
    assert compute_window(before, grown).prefill_tokens_per_step == 1000
    # 2,000 tokens part-way at both ends (a prompt aborted mid-way stays admitted and uncounted), and a
    # request aborted while decoding frees its 20 blocks uncounted: vLLM observes no finished request for
    # an abort (0.32.0 vllm/v1/engine/output_processor.py l. 552-614).
    stuck_before = _engine(usage=0.30, prompt=1000, generated=500, admitted=3000, computed=1000, steps=10)
    stuck_after = _engine(usage=0.10, prompt=1000, generated=500, admitted=3000, computed=1000, steps=12)
    assert compute_window(stuck_before, stuck_after).prefill_tokens_per_step == 0


def test_cache_hits_admitted_with_a_prompt_are_not_computed_work() -> None:
    """A 3,072-token prompt admitted with 1,024 of it in the prefix cache: its first chunk's step holds
    the hit blocks (referenced) and 2,048 computed tokens; only the latter are prefill."""
    before = _engine(usage=0.10, prompt=1000, generated=500, admitted=1000, computed=1000, steps=10)
    after = _engine(usage=0.34, prompt=1000, generated=500, admitted=4072, admitted_hits=1024, computed=1000, steps=11)
    assert compute_window(before, after).prefill_tokens_per_step == pytest.approx(24 * 128 - 1024)
