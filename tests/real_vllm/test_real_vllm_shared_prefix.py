"""Prefix sharing, a prefill-only server, and a config that says the wrong dtype, on a running vLLM 0.32.0
(CPU backend), checked against what the clients themselves know.

Two real servers, one after the other, each stopped before the next starts (tests/support/real_vllm.py):

1. Prefix caching on (vLLM's default), a 2 GiB cache, serving a copy of the suite's tiny Llama whose
   config.json says bfloat16 while the server runs --dtype float32. First three waves of 16 streams with
   prompts all their own (no sharing) give the clients' step at three contexts, and `stepbudget calibrate
   --itl` fits the deployment's bandwidth and overhead from them; the online fit is off, so nothing the
   daemon sees of the sharing can be learned. Then, with the daemon's own Poller reading the page every
   3 s: the control, 16 streams of ~3,256 ids all their own (a load the fit never saw, with the contexts
   of what follows), and 16 streams that share one 3,000-token system prompt, each with 128 to 384 ids of
   its own after it and 320 tokens out: ~55,000 tokens of context mid-phase, ~10,000 tokens of cache.
2. A fresh server that only ever prefills (max_tokens 1, as a prefill/decode proxy sends requests to its
   prefill side, its start's warm-up request included): two clients send 1,200-token prompts for 30 s.

Every assertion compares the daemon's reading with the load generator's ground truth
(exporter/real_vllm/loadgen.py): each request's whole context, the tokens and blocks the cache holds for
them (the prefix once), the token gaps and the prompt tokens the clients sent.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from exporter.real_vllm.drive import PollRecord, RecordingPoller, Step, drive, dump_run
from exporter.real_vllm.loadgen import (
    LoadGenerator,
    Phase,
    Stream,
    contexts_held_at,
    prompt_tokens_first_returned_in,
    unique_blocks_held_at,
    unique_tokens_held_at,
)
from exporter.serve.alerting import AlertLoop
from exporter.serve.config import Alerting, Config, config_from_mapping
from tests.support.client_truth import DELIVERY_SECONDS, MARGIN_SECONDS, clients_mean_gap_ratio, unsettled
from tests.support.pollers import scrape
from tests.support.real_vllm import BLOCK_SIZE_TOKENS, MODEL_CONFIG, host_device, serving

pytestmark = pytest.mark.real_engine

POLL_SECONDS = 3.0
PAGE = "StepBudgetPredictedStepOverBudget"
# 2 GiB of cache: 512 blocks of 128 tokens (32,768 B a token: 2 x 8 layers x 8 KV heads x 64 x 4 B). The most
# any phase holds: the control, 16 x ceil((3,384 + 128) / 128) = 448 blocks; the shared phase 23 + 16 x
# (ceil((3,384 + 320) / 128) - 23) = 119 at most.
KV_CACHE_GIB = 2
MAX_MODEL_LEN = 4096
STREAMS = 16
# 320, not 160: the phase is settled (all 16 decoding, none starting or ending) only from the last one's first
# token to the first one's last, and the prefills stagger their starts by seconds. On one CI host 160 steps
# of ~75 ms left one 3 s window settled, where the checks need two.
OUTPUT_TOKENS = 320
SHARED_PREFIX_TOKENS = 3000
OWN_PROMPT_TOKENS = 256  # 128 to 384 each (spread 0.5): their blocks do not fill up in step
SHARED = Phase("shared", STREAMS, SHARED_PREFIX_TOKENS + OWN_PROMPT_TOKENS, OUTPUT_TOKENS, spread_ratio=0.5,
               shared_prefix_tokens=SHARED_PREFIX_TOKENS, output_spread_ratio=0.0)
# The calibration's waves: 16 streams at once (the shared phase's batch: the per-request cost, which calibrate
# cannot separate on this CPU, is then in the fitted overhead), prompts all their own, 96 tokens out. Their
# contexts span those the phases run at (~13,000 to ~49,000 tokens in flight against their ~53,000 to ~57,000), as
# docs/model.md tells a user to calibrate: the fit is a line, and on a CPU whose step grows less than
# linearly with context it predicts high past its longest point. On one CI host, waves of 128, 384 and 768
# ids (2,800 to 13,000 tokens in flight) predicted the control 18-21% high in every window.
CALIBRATION_PROMPTS = (768, 1536, 3000)
CALIBRATION_OUTPUT_TOKENS = 96
# The control: the shared phase's contexts, every id a request's own (+-128 ids), 128 tokens out.
UNIQUE = Phase("unique", STREAMS, SHARED_PREFIX_TOKENS + OWN_PROMPT_TOKENS, 128, spread_ratio=0.04,
               output_spread_ratio=0.0)
PREFILL = Phase("prefill", 2, 1200, 1, spread_ratio=0.5)
PREFILL_SECONDS = 30.0
PREFILL_TARGET_TOKENS_PER_SECOND = 30.0  # a 30 ms step budget: any decode step predicted for a prefill pages
PAGE_FOR_SECONDS = 2 * POLL_SECONDS


@dataclass
class SharedRun:
    """The first server's run: the calibration it was predicted with, the control's and the shared phase's
    polls and streams, and two polls of the same page by a deployment whose config says bfloat16 (with what
    it exported)."""

    calibration: dict[str, object]
    polls: list[PollRecord]
    streams: list[Stream]
    config: Config
    bf16_polls: list[PollRecord]
    bf16_samples: dict[str, list[tuple[dict[str, str], float]]]


@dataclass
class PrefillRun:
    polls: list[PollRecord]
    streams: list[Stream]
    config: Config
    samples: dict[str, list[tuple[dict[str, str], float]]]  # what the daemon exported at the phase's last poll


@dataclass
class Runs:
    shared: SharedRun
    prefill: PrefillRun


def _bf16_copy(directory: Path) -> Path:
    """The suite's tiny Llama with its config.json saying bfloat16 (the same weights, linked): the server
    runs it in float32 all the same (--dtype float32), as a site that wrote the checkpoint's dtype in its
    config and serves at another would."""
    directory.mkdir()
    for source in MODEL_CONFIG.parent.iterdir():
        if source.name == "config.json":
            config = json.loads(source.read_text())
            config["dtype"] = "bfloat16"  # transformers 5's key for it, as make_tiny_llama.py wrote "float32"
            config.pop("torch_dtype", None)
            (directory / "config.json").write_text(json.dumps(config, indent=2))
        elif not source.name.startswith("."):
            (directory / source.name).symlink_to(source)
    return directory


def _deployment(name: str, model: Path, url: str, **keys: object) -> dict[str, object]:
    return {"name": name, "model": str(model), "gpu": host_device(), "online_calibration": {"enabled": False},
            "targets": {"static": [url]}, **keys}


def _config(*deployments: dict[str, object]) -> Config:
    return config_from_mapping({"poll_interval": f"{POLL_SECONDS:g}s", "stale_after": "60s", "timeout": "10s",
                                "deployments": list(deployments)})


def _wave_point(base_url: str, vocab_size: int, seed: int, prompt_tokens: int) -> str:
    """16 streams of `prompt_tokens` ids all their own, started together: the median of their clients' token
    gaps while all of them decode, at the contexts they held in the middle of that span, as calibrate's
    `--itl SECONDS@TOKENSxREQUESTS` takes it."""
    load = LoadGenerator(base_url, "tiny", vocab_size=vocab_size, seed=seed)
    load.start(Phase("wave", STREAMS, prompt_tokens, CALIBRATION_OUTPUT_TOKENS))
    time.sleep(1.0)  # every client has sent its one request (a request lasts seconds)
    load.stop("wave")
    assert load.join(300)
    assert not load.errors(), load.errors()
    streams = load.streams
    assert len(streams) == STREAMS
    start = max(s.arrivals[1][0] for s in streams)  # all past their prefill
    end = min(s.arrivals[-1][0] for s in streams)  # all still decoding
    gaps = load.token_gaps_in(start, end)
    assert len(gaps) >= STREAMS * CALIBRATION_OUTPUT_TOKENS // 2, (prompt_tokens, len(gaps))
    return f"{statistics.median(gaps)!r}@{load.tokens_held_at((start + end) / 2)}x{STREAMS}"


def _calibrate(model_config: Path, points: Sequence[str], path: Path) -> dict[str, object]:
    """`stepbudget calibrate --itl ... --json` as a user runs it, its document kept at `path`: its fitted
    bandwidth and per-step overhead, which must describe the waves: each point within 15% of the fit, the
    tolerance calibrate itself judges agreement by. Not 5% or 10%: the waves run a minute apart, and a host's
    speed moves by 10-16% within minutes (a run on one host with other work on the two cores read +8.1%, -6.5%
    and +1.4%, a quiet one missed by 2.5% at most; on another, quiet, three runs missed by 2.6%, 10.6% and
    16.5% at most, the last two with no wave before the first taken).

    Its verdict is not taken: at one batch size calibrate judges the points' raw bandwidths (read bytes /
    step, overhead left in), and on this CPU the fixed part of a 16-request step (~30 ms of ~45-80) spreads
    them by half (a run here: 4.6, 5.8 and 7.0 GB/s), though overhead and bandwidth together miss the points
    by 1.2% at most. Points at several batch sizes would be judged by the fit, but this CPU's ~0.8 ms a
    request is over calibrate's 300 us bound for that term, and refitted without it they miss by 26%."""
    host = host_device()
    command = [sys.executable, "-m", "exporter.cli", "calibrate", "--model", str(model_config),
               "--weight-dtype", "float32", "--kv-cache-dtype", "float32", "--gpu", "custom",
               "--gpu-memory", host["memory"], "--gpu-bandwidth", host["peak_bandwidth"],
               "--gpu-flops", host["peak_flops"], *(arg for point in points for arg in ("--itl", point)), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    path.write_text(done.stdout)
    assert done.returncode in (0, 2) and done.stdout.strip(), (
        f"calibrate exited {done.returncode} with no document: {done.stderr}")
    document: dict[str, object] = json.loads(done.stdout)
    fitted = document["points"]
    assert isinstance(fitted, list) and len(fitted) == len(points)
    assert all(abs(point["residual_ratio"]) <= 0.15 for point in fitted), (points, done.stdout)
    return document


def _shared_run(log_dir: Path) -> SharedRun:
    model_dir = _bf16_copy(log_dir / "tiny-llama-config-bf16")
    model_config = model_dir / "config.json"
    with serving(log_dir, model_dir=model_dir, max_model_len=MAX_MODEL_LEN, kv_cache_gib=KV_CACHE_GIB) as server:
        # One wave first, not taken: the first batch of 16 after the server's start stepped 20-50% slower
        # than the same wave later (three runs here on 2026-12-07: 81, 65 and 54 ms at 13,000 tokens).
        _wave_point(server.base_url, server.vocab_size, 99, CALIBRATION_PROMPTS[0])
        points = [_wave_point(server.base_url, server.vocab_size, 100 + index, prompt)
                  for index, prompt in enumerate(CALIBRATION_PROMPTS)]
        calibration_path = log_dir / "calibration.json"
        calibration = _calibrate(model_config, points, calibration_path)
        config = _config(_deployment("tiny", model_config, server.metrics_url, weight_dtype="float32",
                                     effective_bandwidth=calibration["effective_bandwidth_bytes_per_second"],
                                     step_overhead=calibration["step_overhead_seconds"],
                                     target_tokens_per_second=6.0))
        # The same page read as a site whose config says what the checkpoint's config.json says.
        bf16_config = _config(_deployment("tiny-bf16", model_config, server.metrics_url,
                                          target_tokens_per_second=6.0))
        recorder, bf16_recorder = RecordingPoller(config), RecordingPoller(bf16_config)
        load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=7)
        try:
            # Each phase one wave: every client sends one request (they last seconds) and the phase drains.
            polls = drive(recorder, load, [Step(start=UNIQUE, seconds=1.0),
                                           Step(stop=UNIQUE.name, drain=True, label=UNIQUE.name)], POLL_SECONDS)
            warm = load.warm_prefix(SHARED)
            assert warm.error is None, warm.error
            polls += drive(recorder, load, [Step(start=SHARED, seconds=1.0),
                                            Step(stop=SHARED.name, drain=True, label=SHARED.name)], POLL_SECONDS)
            dump_run(log_dir / "shared-run.json", polls, load)
            bf16_polls = [bf16_recorder.poll("idle") for _ in range(2)]
            bf16_samples = scrape(bf16_config, bf16_recorder.poller)
        finally:
            load.stop_all()
            load.join(60)
            recorder.close()
            bf16_recorder.close()
    return SharedRun(calibration, polls, load.streams, config, bf16_polls, bf16_samples)


def _prefill_run(log_dir: Path) -> PrefillRun:
    with serving(log_dir, max_model_len=MAX_MODEL_LEN, warm_up_max_tokens=1) as server:
        config = _config(_deployment("tiny-prefill", MODEL_CONFIG, server.metrics_url, weight_dtype="float32",
                                     target_tokens_per_second=PREFILL_TARGET_TOKENS_PER_SECOND))
        recorder = RecordingPoller(config)
        load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=11)
        try:
            polls = drive(recorder, load, [Step(start=PREFILL, seconds=PREFILL_SECONDS)], POLL_SECONDS)
            samples = scrape(config, recorder.poller)  # the phase's last poll, the clients still sending
            load.stop_all()
            assert load.join(120)
            dump_run(log_dir / "prefill-run.json", polls, load)
        finally:
            load.stop_all()
            load.join(60)
            recorder.close()
    return PrefillRun(polls, load.streams, config, samples)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Both servers' runs, one server after the other; neither is running when the tests read them."""
    shared = _shared_run(tmp_path_factory.mktemp("real-vllm-shared-prefix"))
    prefill = _prefill_run(tmp_path_factory.mktemp("real-vllm-prefill-only"))
    yield Runs(shared, prefill)


# --- 1. a shared system prompt ------------------------------------------------------------------------------


def _settled_windows(run: SharedRun, phase: Phase) -> Iterator[tuple[PollRecord, list[float]]]:
    """Each window between two consecutive settled polls of the phase: its end poll and the phase's
    clients' token gaps inside it."""
    streams = _phase_streams(run, phase)
    settled = {poll.at_seconds for poll in _settled_polls(run, phase)}
    for before, after in itertools.pairwise(run.polls):
        if before.at_seconds in settled and after.at_seconds in settled:
            yield after, [gap for s in streams for gap in s.token_gaps_in(before.at_seconds, after.at_seconds)]


def _phase_streams(run: SharedRun, phase: Phase = SHARED) -> list[Stream]:
    """A wave's 16 requests (for the shared phase, not the warm-up request that put the prefix in the cache)."""
    streams = [s for s in run.streams if s.shared_prefix == (phase.name if phase.shared_prefix_tokens else "")
               and s.max_tokens == phase.max_tokens and s.prompt_tokens > SHARED_PREFIX_TOKENS]
    assert len(streams) == STREAMS
    return streams


def _settled_polls(run: SharedRun, phase: Phase = SHARED) -> list[PollRecord]:
    """The phase's polls where all 16 requests ran, none of them starting, in its prefill, ending or
    stalled about the poll (tests/support/client_truth.py `unsettled`), and none waiting."""
    streams = _phase_streams(run, phase)
    settled = [poll for poll in run.polls
               if poll.phase == phase.name and not poll.reading.requests_waiting
               and all(s.running_at(poll.at_seconds) and not unsettled(s, poll.at_seconds) for s in streams)]
    # Shared: prefill ~6 s, then 320 steps of 0.07-0.1 s. The control: ~35 s of prefills, then all 16 decode
    # ~20 s. Four polls or more each; 3 at the least on a host twice as slow.
    assert len(settled) >= 3, (phase.name, [(p.phase, p.at_seconds) for p in run.polls])
    return settled


def _window_errors(run: SharedRun, phase: Phase) -> list[tuple[float, float, float | None, float | None]]:
    """Windows between two settled polls of the phase (all 16 decoding throughout, no prompt computed): the
    measured step, held to the clients' mean token gap over the windows within 5% (`clients_mean_gap_ratio`),
    and the prediction for each window (the mean of its two ends) against it: (end, predicted / measured - 1,
    tokens in flight, KV used)."""
    errors = []
    windows = []
    for after, gaps in _settled_windows(run, phase):
        reading = after.reading
        measured, predicted = reading.measured_step_seconds, reading.window_predicted_step_seconds
        assert measured is not None and predicted is not None, reading.notes
        windows.append((measured, gaps))
        errors.append((after.at_seconds, predicted / measured - 1, reading.tokens_in_flight,
                       reading.kv_cache_used_tokens))
    assert len(errors) >= 2, (phase.name, errors)
    assert abs(clients_mean_gap_ratio(windows)) <= 0.05, (phase.name, [(m, len(g)) for m, g in windows])
    return errors


def test_the_engine_shared_the_prefix_the_clients_sent(runs: Runs) -> None:
    """The ground truth's premise, from the page's own counters: each of the 16 requests found the prefix's
    23 whole blocks (2,944 tokens) in the cache and computed only the rest of its prompt."""
    run = runs.shared
    streams = _phase_streams(run)
    # The shared wave's first poll (after the warm-up request) and its last.
    start = max(i for i, poll in enumerate(run.polls) if poll.phase == "idle")
    first, last = run.polls[start].snapshot, run.polls[-1].snapshot
    assert first.prompt_tokens_cached_total is not None and last.prompt_tokens_cached_total is not None
    whole_prefix_blocks = SHARED_PREFIX_TOKENS // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
    assert last.prompt_tokens_cached_total - first.prompt_tokens_cached_total == STREAMS * whole_prefix_blocks
    assert last.prompt_tokens_computed_total is not None and first.prompt_tokens_computed_total is not None
    assert (last.prompt_tokens_computed_total - first.prompt_tokens_computed_total
            == sum(s.prompt_tokens for s in streams) - STREAMS * whole_prefix_blocks)


def test_tokens_in_flight_count_each_running_requests_whole_context(runs: Runs) -> None:
    """At every settled poll, within 5% of the contexts the clients' requests held (each counted whole,
    the 3,000 shared tokens once for each of the 16), taken MARGIN_SECONDS either side of the poll. The
    memory held (the prefix once) is a sixth to a fifth of that (16 x (3,000 + 256 + 0 to 320) against
    3,000 + 16 x (256 + 0 to 320): 6.3 as decoding starts, 4.7 at its end): a reading of memory held fails this
    by 79% to 84%."""
    run = runs.shared
    streams = _phase_streams(run)
    for poll in _settled_polls(run):
        t = poll.at_seconds
        low = contexts_held_at(streams, t - MARGIN_SECONDS)
        high = contexts_held_at(streams, t + MARGIN_SECONDS)
        assert low > 4 * unique_tokens_held_at(streams, t + MARGIN_SECONDS)  # the sharing is the load's most
        tokens = poll.reading.tokens_in_flight
        assert tokens is not None, poll.reading.notes
        assert low * 0.95 <= tokens <= high * 1.05, (t, tokens, low, high)


def test_kv_cache_used_tokens_hold_the_shared_prefix_once(runs: Runs) -> None:
    """At every settled poll, the memory held: within 5% of what the clients' requests hold with the prefix
    once, between its tokens (the daemon may leave out each last block's empty slots) and its blocks (23
    whole prefix blocks shared, each request's own ceil(context / 128) - 23). The page's own block count is
    held to the clients' blocks too: the ground truth describes the engine."""
    run = runs.shared
    streams = _phase_streams(run)
    for poll in _settled_polls(run):
        t = poll.at_seconds
        low_tokens = unique_tokens_held_at(streams, t - MARGIN_SECONDS)
        high_blocks = unique_blocks_held_at(streams, t + MARGIN_SECONDS, BLOCK_SIZE_TOKENS)
        low_blocks = unique_blocks_held_at(streams, t - MARGIN_SECONDS, BLOCK_SIZE_TOKENS)
        page_blocks = poll.snapshot.used_block_tokens
        assert page_blocks is not None
        assert low_blocks * 0.95 <= page_blocks / BLOCK_SIZE_TOKENS <= high_blocks * 1.05, (t, page_blocks)
        used = poll.reading.kv_cache_used_tokens
        assert used is not None, poll.reading.notes
        assert low_tokens * 0.95 <= used <= high_blocks * BLOCK_SIZE_TOKENS * 1.05, (t, used, low_tokens, high_blocks)
        in_flight = poll.reading.tokens_in_flight
        shared = poll.reading.kv_cache_shared_ratio
        assert in_flight and shared is not None
        assert shared == pytest.approx(1 - used / in_flight, abs=1e-9)


def test_the_fit_predicts_the_control_it_never_saw(runs: Runs) -> None:
    """The control, 16 streams of ~3,256 ids all their own: over the windows between settled polls the step
    predicted from the unique waves' fit is within 25% of the measured one (each the clients' mean token gap
    within 5%), the median window's error. So the rates describe a load of the shared phase's contexts, its
    sharing aside, well enough to tell the sharing's effect (the memory held predicts about a third of
    what the whole contexts do here) from the fit's. The median, not each window: the calibration ran a minute before,
    and a host's speed moves by 10-16% within minutes (tests/real_vllm/test_real_vllm_calibration.py). 25%,
    not 15%: about 50,000 tokens in flight, a CPU's step moves more from run to run than its fit misses. On
    one host (300 MiB of L3, shared with other machines' work) the waves' longest point, the same 16 x 3,000
    ids each run, stepped 123 to 167 ms in five runs, and the control's windows read -1% to -10% and -2% to
    -3% in two runs, -13% to -27% in a third (median -18%) a minute after a fit its own waves met within
    1.6%, and -1% to +14% in a fourth. On another, quieter host a run read -9.3% to +4.1%, median -3.6%."""
    errors = _window_errors(runs.shared, UNIQUE)
    assert abs(statistics.median(error for _, error, _, _ in errors)) <= 0.25, (_fit(runs.shared), errors)


def test_a_shared_prefix_step_lies_between_the_memory_held_and_the_whole_contexts(runs: Runs) -> None:
    """The shared phase with the same rates, the online fit off: the sharing is read off the page, never
    learned. Within 10% of the measured step is what a user would want here; on this CPU it is not: reading a
    block 16 requests share costs it about a third of reading 16 blocks of their own (its 480 MiB L3 holds
    the shared 11.5 MiB a layer), so 16 x ~3,256 tokens with a 3,000-token prefix shared stepped 75-93 ms
    where the same contexts all unique stepped 180-215 ms (four runs on 2026-12-05: whole contexts +118% to
    +153%, memory held -27% to -33%). What holds, and what this checks window by window: the prediction from
    each request's whole context (what the daemon exports) is above the measured step, so the page fires
    early rather than late, and the prediction from the memory held (what a reading of KV usage gives) is
    below it. docs/model.md, "Prefix caching", says what the model does not know."""
    run = runs.shared
    bandwidth = float(str(run.calibration["effective_bandwidth_bytes_per_second"]))
    kv_bytes_per_token = 32_768  # this model in float32 (test_kv_bytes_per_token_follow_the_page...)
    windows = []
    for after, gaps in _settled_windows(run, SHARED):
        reading = after.reading
        measured, whole = reading.measured_step_seconds, reading.predicted_step_seconds
        tokens, used = reading.tokens_in_flight, reading.kv_cache_used_tokens
        assert measured is not None and whole is not None and tokens and used, reading.notes
        windows.append((measured, gaps))
        # The same prediction with the KV read term at the memory held: fewer bytes, the same rate.
        held = whole - (tokens - used) * kv_bytes_per_token / bandwidth
        assert held < measured < whole, (after.at_seconds, held, measured, whole, tokens, used)
    assert len(windows) >= 2
    assert abs(clients_mean_gap_ratio(windows)) <= 0.05, [(m, len(g)) for m, g in windows]


def _fit(run: SharedRun) -> str:
    return (f"fitted from unique waves: {run.calibration['effective_bandwidth_bytes_per_second']} B/s, "
            f"overhead {run.calibration['step_overhead_seconds']} s; (window end, predicted / measured - 1, "
            "tokens in flight, KV used):")


# --- 3. a config whose dtype is not the server's ------------------------------------------------------------


def test_kv_bytes_per_token_follow_the_page_where_the_config_says_bfloat16(runs: Runs) -> None:
    """The server runs float32 (its page: kv_cache_memory_bytes / kv_cache_size_tokens = 1 GiB / 32,768
    tokens); the deployment names a config.json that says bfloat16 and no dtype of its own. The daemon
    predicts with the page's 32,768 B a token (2 x layers x KV heads x head_dim x 4 B, from the config by
    hand), not the config's 16,384, and says so in the reading's setup_disagreements."""
    run = runs.shared
    config = json.loads(MODEL_CONFIG.read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    float32_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    assert float32_bytes == 32_768
    ((labels, value),) = run.bf16_samples["stepbudget_kv_bytes_per_token"]
    assert labels == {"deployment": "tiny-bf16"} and value == float32_bytes
    for poll in run.bf16_polls:
        disagreements = poll.reading.setup_disagreements
        # (quantity, configured, page): a dtype, 16-bit as configured, 32-bit on the page.
        assert any("dtype" in quantity and "16" in configured and "32" in page
                   for quantity, configured, page in disagreements), disagreements
    # The deployment whose config says float32 (weight_dtype) has nothing to disagree about.
    for poll in run.polls:
        assert not [d for d in poll.reading.setup_disagreements if "dtype" in d[0]], poll.reading.setup_disagreements


# --- 2. a server that only prefills -------------------------------------------------------------------------


def _prefill_windows(run: PrefillRun) -> list[tuple[PollRecord, PollRecord]]:
    windows = [(before, after) for before, after in zip(run.polls, run.polls[1:], strict=False)
               if after.phase == PREFILL.name]
    assert len(windows) >= 8, len(windows)
    return windows


def test_a_prefill_only_server_gets_a_prefill_budget_and_no_decode_step(runs: Runs) -> None:
    """Every poll of the phase: role "prefill", no predicted step and no step budget (nothing to page on),
    the prefill rate and the rate its compute allows present and positive, and the daemon exports them."""
    run = runs.prefill
    assert all(s.max_tokens == 1 for s in run.streams)
    for _, after in _prefill_windows(run):
        reading = after.reading
        assert reading.role == "prefill", (after.at_seconds, reading.role, reading.notes)
        assert reading.predicted_step_seconds is None and reading.step_budget_seconds is None, reading
        assert (reading.prefill_tokens_per_second or 0.0) > 0, reading.notes
        assert (reading.prefill_capacity_tokens_per_second or 0.0) > 0, reading.notes
    exported = {name for name, samples in run.samples.items() if samples}
    assert {"stepbudget_prefill_tokens_per_second", "stepbudget_prefill_capacity_tokens_per_second"} <= exported
    assert all(value > 0 for name in ("stepbudget_prefill_tokens_per_second",
                                      "stepbudget_prefill_capacity_tokens_per_second")
               for _, value in run.samples[name])
    assert not {"stepbudget_predicted_step_seconds", "stepbudget_step_budget_seconds"} & exported


def test_the_prefill_rate_is_the_prompt_tokens_the_clients_sent_per_second(runs: Runs) -> None:
    """The daemon's prompt tokens per second times each window's length is the prompt tokens of the requests
    whose one token came back in the window (random ids: no cache hits, every prompt token computed), within
    10%. The server counts a prompt in the step that returns its token, a moment before its client reads it,
    and renders its page somewhere in the poll's fetch: a prompt the clients read about a poll may be in the
    window on either side of it, so each window is held between the prompts read well inside it (after
    DELIVERY_SECONDS past its start, before its end's fetch began) and all that may be in it (from its start's
    fetch to DELIVERY_SECONDS past its end; a CI run on 2 cores read 4,522 tokens in a window whose clients
    had 4,069 by 0.3 s past its end). Over the phase, where only its last edge is open, within 10% too."""
    run = runs.prefill
    windows = _prefill_windows(run)
    read_total = 0.0
    for before, after in windows:
        rate = after.reading.prefill_tokens_per_second
        assert rate is not None, after.reading.notes
        read = rate * (after.at_seconds - before.at_seconds)
        low = prompt_tokens_first_returned_in(run.streams, before.at_seconds + DELIVERY_SECONDS,
                                              after.fetch_started_seconds)
        high = prompt_tokens_first_returned_in(run.streams, before.fetch_started_seconds,
                                               after.at_seconds + DELIVERY_SECONDS)
        assert low * 0.9 <= read <= high * 1.1, (after.at_seconds, read, low, high)
        read_total += read
    start, end = windows[0][0].at_seconds, windows[-1][1].at_seconds
    sent = prompt_tokens_first_returned_in(run.streams, start, end)
    assert sent >= 20 * 600, sent  # at least 20 prompts went through: one edge's prompt weighs under 10%
    assert read_total / (end - start) == pytest.approx(sent / (end - start), rel=0.10), (read_total, sent)


def test_time_to_first_token_is_the_clients(runs: Runs) -> None:
    """The mean time to first token the daemon reads over the phase's windows lies inside the clients' (sent
    to their one token back): the server's clock starts when its front end takes the request in and stops
    when its front end handles the token (0.32.0 vllm/v1/metrics/stats.py l. 478, 501-503, 521), both a
    moment inside the client's; each request of two queues behind the other's chunks for most of a second.
    At most 5% over the clients' mean (the windows sample the requests, the clients count each one), and
    at most DELIVERY_SECONDS / 2 under it, the front end's share at each end on a host starved of a core."""
    run = runs.prefill
    read = [after.reading.measured_time_to_first_token_seconds for _, after in _prefill_windows(run)]
    assert all(value is not None and value > 0 for value in read), read
    clients = statistics.mean(first - s.sent_at_seconds for s in run.streams
                              if (first := s.first_token_at_seconds) is not None)
    server = statistics.mean(value or 0.0 for value in read)
    assert clients - DELIVERY_SECONDS / 2 <= server <= clients * 1.05, (server, clients)


def test_no_decode_page_for_a_prefill_only_server(runs: Runs) -> None:
    """The daemon's in-process alert loop over the phase's readings, its page's `for` cut to two polls: the
    page is never pending, let alone firing, for a server with no decode step (a 30 ms budget, which any
    step of 1,200-token prompts would be predicted far over)."""
    run = runs.prefill
    loop = AlertLoop(Alerting(for_seconds=PAGE_FOR_SECONDS), poll_interval_seconds=POLL_SECONDS,
                     post=lambda *a: None)
    for poll in run.polls:
        loop.evaluate([poll.reading], poll.at_seconds)
        active = [alert for alert in loop.active() if _alertname(alert) == PAGE]
        assert not active, (poll.phase, poll.at_seconds, active, poll.reading.predicted_step_seconds)


def _alertname(alert: dict[str, object]) -> object:
    labels = alert["labels"]
    assert isinstance(labels, dict)
    return labels.get("alertname")
