"""The daemon's numbers on pages rendered by the engines' own metrics code (tests/data/genuine/,
provenance in PROVENANCE.md there): each pair is served on 127.0.0.1 as t0 then t1, polled by the
real poller, and every figure is checked against what was fed to vLLM's or SGLang's code (the
`.expected.json` beside each page), within 1%.

What each expected value is, computed here from the fed values:
- capacity per engine: the fed `kv_cache_capacity_tokens` (vLLM 0.23.0 writes num_gpu_blocks summed
  over its data-parallel engines; the per-engine value must still come out);
- tokens in flight (each running request's whole context): SGLang's fed decode_sum_seq_lens; for vLLM,
  what the engine's own request counters on the page hold for the requests past their prefill and not
  finished (prompt + generation totals less the finished requests' sums, worked out here from the raw
  samples); KV used (memory held): SGLang's fed used tokens, vLLM's fed usage ratio x capacity. The
  renderer fed vLLM's usage apart from its requests, so the two differ on these pages;
- measured step: delta(ITL sum) / delta(ITL count) of the fed observations (SGLang's histogram is
  server-wide, so it is the server-wide series' value);
- computed prefill per step: delta(locally computed prompt tokens) / delta(engine steps), where
  pages without prefix-cache hits computed every prompt token.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from exporter.capacity import model
from exporter.serve.config import Config, config_from_mapping
from exporter.serve.engines import read_page
from exporter.serve.poller import Poller
from exporter.serve.reading import Reading
from tests.support.clocks import ManualClock
from tests.support.pollers import MakePoller
from tests.support.servers import PageServer
from tests.support.tools import DATA

GENUINE = DATA / "genuine"
PAIRS = sorted(path.name.removesuffix(".expected.json") for path in GENUINE.glob("*.expected.json"))


def _expected(name: str) -> dict[str, Any]:
    return json.loads((GENUINE / f"{name}.expected.json").read_text())


def _config(url: str) -> Config:
    return config_from_mapping({"poll_interval": "15s", "deployments": [{
        "name": "genuine", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": [url]}}]})


def _poll_pair(name: str, page_server: PageServer, clock: ManualClock, make_poller: MakePoller
               ) -> tuple[Poller, dict[str, Reading]]:
    poller = make_poller(_config(page_server.url), clock)
    for number in (0, 1):
        page_server.serve_text((GENUINE / f"{name}_t{number}.prom").read_bytes())
        poller.poll_once()
        clock.advance(15)
    readings = {reading.engine: reading for reading in poller.readings()}
    assert all(reading.target_up for reading in readings.values()), [r.notes for r in readings.values()]
    return poller, readings


def _counted_context(page: str, engine: str) -> float:
    """prompt + generation totals less the finished requests' prompt and generation sums, for one engine,
    from the page's raw sample lines."""
    def sample(name: str) -> float:
        match = re.search(rf'^vllm:{name}{{engine="{engine}",[^}}]*}} (\S+)$', page, re.MULTILINE)
        assert match is not None, (name, engine)
        return float(match.group(1))
    return (sample("prompt_tokens_total") + sample("generation_tokens_total") - sample("request_prompt_tokens_sum")
            - sample("request_generation_tokens_sum"))


def _usage(engine: dict[str, Any]) -> float:
    return float(engine.get("kv_cache_usage_ratio_exact", engine.get("kv_cache_usage_ratio")))


def _same(read: float | None, fed: float) -> bool:
    return read is not None and read == pytest.approx(fed, rel=1e-9)


@pytest.mark.parametrize("name", PAIRS)
def test_every_page_snapshot_holds_each_fed_value(name: str) -> None:
    """The page reader alone (read_page), at each phase, against every value the engine's code was
    fed: each adapter rule these pages exercise (totals and partitions, absent counters, the summed
    num_gpu_blocks, the page's block size and dtype, the computed share of prompt tokens), each
    checked on a page written by the engine, not by a test."""
    fed = _expected(name)
    for phase in fed["phases"]:
        reading = read_page((GENUINE / phase["page"]).read_text())
        assert reading.problems == ()
        snapshots = {snapshot.engine: snapshot for snapshot in reading.snapshots}
        assert sorted(snapshots) == sorted(phase["engines"])
        tokenizer = phase.get("tokenizer")  # SGLang: one tokenizer for every rank (server-wide)
        for engine, values in phase["engines"].items():
            snap = snapshots[engine]
            assert (snap.kind, snap.model_name) == (reading.kind, fed["model_name"])
            checks: dict[str, float | None] = {
                "requests_running": snap.requests_running, "requests_waiting": snap.requests_waiting,
                "kv_cache_capacity_tokens": snap.kv_cache_capacity_tokens, "preemptions_total": snap.preemptions_total,
                "block_size_tokens": snap.block_size_tokens, "tokens_in_flight": snap.kv_cache_used_tokens,
                "engine_steps_total": snap.engine_steps_total,
                "prompt_tokens_cached_total": snap.prompt_tokens_cached_total,
                "prompt_tokens_local_compute_total": snap.prompt_tokens_computed_total,
                "num_gpu_blocks_per_engine": snap.kv_cache_blocks,
            }
            for key, read in checks.items():
                if key in values:
                    assert _same(read, values[key]), (phase["page"], engine, key, read, values[key])
            assert isinstance(snap.block_size_tokens, int)
            usage = values.get("token_usage_as_exported", values.get("kv_cache_usage_ratio"))
            assert _same(snap.kv_cache_usage_ratio, usage)
            counts = tokenizer or values
            assert _same(snap.prompt_tokens_total, counts["prompt_tokens_total"])
            assert _same(snap.generation_tokens_total, counts["generation_tokens_total"])
            itl = snap.inter_token_latency
            assert itl is not None and _same(itl.count, counts["itl_count"]) and _same(itl.sum, counts["itl_sum"])
            if reading.kind == "vllm":
                assert snap.kv_cache_dtype == "auto"
                # Without cache hits fed, every prompt token was computed locally and none was cached.
                if "prompt_tokens_local_compute_total" not in values:
                    assert _same(snap.prompt_tokens_computed_total, values["prompt_tokens_total"])
                    assert _same(snap.prompt_tokens_cached_total, 0.0)
                steps = snap.iteration_tokens
                assert steps is not None and _same(steps.count, values["engine_steps_total"])
                # Each engine's own blocks, though the page writes their sum over the engines (FAMILIES.md).
                assert _same(snap.kv_cache_blocks, values["kv_cache_capacity_tokens"] / values["block_size_tokens"])
            assert [m.split(":")[0] for m in snap.missing] == (
                ["tokens_in_flight", "kv_cache_used_tokens"] if reading.kind == "vllm" else ["engine_steps_total"])


@pytest.mark.parametrize("name", PAIRS)
def test_every_engine_reads_what_was_fed(name: str, page_server: PageServer, clock: ManualClock,
                                         make_poller: MakePoller) -> None:
    fed = _expected(name)
    t0, t1 = fed["phases"]
    _, readings = _poll_pair(name, page_server, clock, make_poller)
    for engine, values in t1["engines"].items():
        before = t0["engines"][engine]
        reading = readings[engine]
        capacity = values["kv_cache_capacity_tokens"]
        assert reading.kv_cache_capacity_tokens == pytest.approx(capacity, rel=0.01)
        held = values.get("tokens_in_flight", _usage(values) * capacity)
        assert reading.kv_cache_used_tokens == pytest.approx(held, rel=0.01)
        read = values.get("decode_sum_seq_lens") or values.get("tokens_in_flight")
        if read is None:  # vLLM
            read = _counted_context((GENUINE / t1["page"]).read_text(), engine)
        assert reading.tokens_in_flight == pytest.approx(read, rel=0.01)
        assert reading.requests_running == values["requests_running"]
        assert reading.estimated == ()  # every figure came from the page
        if "itl_count" in values:  # vLLM: one histogram per engine
            mean = (values["itl_sum"] - before["itl_sum"]) / (values["itl_count"] - before["itl_count"])
            assert reading.measured_step_seconds == pytest.approx(mean, rel=0.01)
        if "engine_steps_total" in values:
            computed = "prompt_tokens_local_compute_total" if "prompt_tokens_local_compute_total" in values \
                else "prompt_tokens_total"  # no cache hits fed: every prompt token was computed
            steps = values["engine_steps_total"] - before["engine_steps_total"]
            prefill = (values[computed] - before[computed]) / steps
            assert reading.prefill_tokens_per_step == pytest.approx(prefill, rel=0.01)
    if "tokenizer" in t1:  # SGLang: the ITL histogram is the tokenizer's, one for the whole server
        mean = (t1["tokenizer"]["itl_sum"] - t0["tokenizer"]["itl_sum"]) / (
            t1["tokenizer"]["itl_count"] - t0["tokenizer"]["itl_count"])
        several = len(t1["engines"]) > 1
        series = readings[""] if several else readings["0"]
        # Under speculative decoding SGLang observes each token at the step / its tokens: the step is
        # the ITL mean x the accept length the page gives (tests/serve/test_spec_decode.py).
        mean *= series.tokens_per_step or 1.0
        assert series.measured_step_seconds == pytest.approx(mean, rel=0.01)
        if several:  # never a rank's prediction against the server's measurement
            assert all(readings[engine].measured_step_seconds is None for engine in t1["engines"])


def test_data_parallel_without_kv_cache_size_tokens_gives_each_engine_its_blocks(
        page_server: PageServer, clock: ManualClock, make_poller: MakePoller) -> None:
    name = "vllm-0.23.0_GENUINE_dp2"
    fed = _expected(name)
    assert fed["cache_config_info"]["kv_cache_size_tokens"] is None
    summed = fed["cache_config_info"]["num_gpu_blocks"]
    _, readings = _poll_pair(name, page_server, clock, make_poller)
    for engine, values in fed["phases"][1]["engines"].items():
        # 47,148 blocks summed over two engines on every series; each engine has 23,574.
        assert summed == 2 * values["num_gpu_blocks_per_engine"]
        assert readings[engine].kv_cache_capacity_tokens == values["num_gpu_blocks_per_engine"] * 16


def _fed_mean_step(setup: model.ServingSetup, reading: Reading, computed_per_step: list[float],
                   prompt_per_step: list[float]) -> float:
    """The model's mean over the fed steps, each step's prompt tokens computed after its cache hits (the
    fed prompt tokens less the computed ones): they attend to those and to each other."""
    groups = model.groups_from_total(reading.tokens_in_flight or 0.0, reading.requests_running or 0.0)
    return sum(model.predict_step(setup, groups, computed, prefill_context_tokens=prompt - computed).step_seconds
               for computed, prompt in zip(computed_per_step, prompt_per_step, strict=True)) / len(computed_per_step)


def test_prefix_cache_hits_are_not_prefill_work(page_server: PageServer, clock: ManualClock,
                                                make_poller: MakePoller) -> None:
    """Agent turns re-send ~100,000-token conversations, ~99% of them cached (vLLM 0.33.0's own
    accounting): the prediction follows the tokens the engine computed, step by step."""
    name = "vllm-0.33.0_GENUINE_prefix_cache_dp1"
    fed = _expected(name)
    t0, t1 = (phase["engines"]["0"] for phase in fed["phases"])
    poller, readings = _poll_pair(name, page_server, clock, make_poller)
    reading = readings["0"]
    steps = t1["engine_steps_total"] - t0["engine_steps_total"]
    cached = t1["prompt_tokens_cached_total"] - t0["prompt_tokens_cached_total"]
    total = t1["prompt_tokens_total"] - t0["prompt_tokens_total"]
    assert cached > 0.9 * total  # the window is mostly cache hits
    setup = poller.config.deployments[0].resolved.setup
    truth = _fed_mean_step(setup, reading, t1["prompt_tokens_computed_per_step"], t1["prompt_tokens_total_per_step"])
    assert reading.predicted_step_seconds == pytest.approx(truth, rel=0.10)
    # Counting the cache hits as prefill (what prompt_tokens_total alone says) is a far longer step.
    counted_as_prefill = model.predict_step(
        setup, model.groups_from_total(reading.tokens_in_flight or 0.0, reading.requests_running or 0.0),
        total / steps).step_seconds
    assert counted_as_prefill > 5 * truth


# vLLM's vllm:iteration_tokens_total edges (vllm/v1/metrics/loggers.py; FAMILIES.md).
ITERATION_EDGES = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)


def _cumulative(tokens_per_step: list[float]) -> dict[float, float]:
    return {edge: float(sum(1 for tokens in tokens_per_step if tokens <= edge)) for edge in ITERATION_EDGES}


@pytest.mark.parametrize("burst_share", [0.05, 0.10, 0.25])
def test_bursty_prefill_predicts_the_mean_step(burst_share: float, page_server: PageServer, clock: ManualClock,
                                               make_poller: MakePoller) -> None:
    """40 chats of 2,000 tokens; a 2,048-token chunk rides in `burst_share` of 1,000 steps."""
    from tests.support.pages import VllmState, vllm_page

    running, context, chunk, steps = 40, 2000, 2048, 1000
    bursts = int(burst_share * steps)
    per_step = [running + chunk] * bursts + [running] * (steps - bursts)
    capacity = 23574 * 16
    common = {"running": running, "kv_usage_ratio": running * context / capacity, "num_gpu_blocks": 23574}
    before = VllmState(**common, prompt_tokens_computed=0, iteration_buckets=_cumulative([]))
    after = VllmState(**common, prompt_tokens=bursts * chunk, prompt_tokens_computed=bursts * chunk,
                      generation_tokens=running * steps, engine_steps=steps, iteration_tokens_sum=sum(per_step),
                      iteration_buckets=_cumulative(per_step), itl_count=running * steps,
                      itl_sum=running * steps * 0.02,
                      itl_buckets={0.01: 0, 0.025: running * steps, 0.05: running * steps, 0.1: running * steps})
    config = _config(page_server.url)
    poller = make_poller(config, clock)
    for state in (before, after):
        page_server.serve_text(vllm_page(state))
        poller.poll_once()
        clock.advance(15)
    (reading,) = poller.readings()
    setup = config.deployments[0].resolved.setup
    groups = model.groups_from_total(running * context, running)
    truth = sum(model.predict_step(setup, groups, tokens - running).step_seconds for tokens in per_step) / steps
    assert reading.prefill_tokens_per_step == pytest.approx(bursts * chunk / steps), reading.notes
    assert reading.predicted_step_seconds == pytest.approx(truth, rel=0.05)
    # The step at the mean prefill, which the daemon predicted before, is far under the mean step.
    at_mean = model.predict_step(setup, groups, bursts * chunk / steps).step_seconds
    assert at_mean < 0.9 * truth
