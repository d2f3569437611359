"""The simulator's page agrees with a running vLLM 0.32.0's page family by family (DESIGN §5).

The real pages are in tests/data/vllm-0.32.0-cpu/ (the load behind each in its README). Both sides
go through prometheus_client's own text parser; the simulator's page is rendered in-process under
a load like the real one's (16 streams of 128-token prompts and 1,024-token answers, max model
length 2,048, `--enable-mfu-metrics`, served as "tiny"). Compared per vllm: family: presence, TYPE,
HELP, label names, the values of the enumerated labels and the histogram bucket edges.

What the real pages have and the simulator does not serve, and why:
  * `python_*`, `process_*`: the process's own collectors; the simulator's page carries its own
    process's (not compared: their values describe whichever process renders the page);
  * `http_*`: prometheus_fastapi_instrumentator's, on vLLM's FastAPI app (not vLLM's metrics code);
    the simulator's HTTP server is not FastAPI;
The ngram page is compared with the simulator serving speculative decoding (3 draft tokens, as the
real server's --speculative-config): its `vllm:spec_decode_*` families are the real page's too.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from exporter.simulator import ServerSpec, Simulator
from exporter.simulator.cli import build_parser, spec_from_args
from tests.support.simulator import QWEN, kv_bytes_per_token_by_hand, step, structure
from tests.support.tools import DATA

REAL = DATA / "vllm-0.32.0-cpu"
STREAMS_T0 = REAL / "vllm-0.32.0-cpu_REAL_16streams_t0.prom"
STREAMS_T1 = REAL / "vllm-0.32.0-cpu_REAL_16streams_t1.prom"
IDLE = REAL / "vllm-0.32.0-cpu_REAL_idle.prom"
NGRAM = REAL / "vllm-0.32.0-cpu_REAL_ngram_spec_decode.prom"
# vllm: families of a real page the simulator does not serve, with the reason (module docstring).
NOT_SERVED: dict[Path, dict[str, str]] = {}
# Labels whose values are an enumeration fixed by vLLM's code (loggers.py), not by the load.
ENUMERATED_LABELS = ("engine", "model_name", "reason", "source", "finished_reason", "sleep_state")


def _simulated_page(enable_mfu_metrics: bool = True, num_speculative_tokens: int = 0) -> tuple[Simulator, str]:
    """The simulator under the real pages' load, 5 simulated seconds into the 16 streams."""
    sim = Simulator(ServerSpec(max_model_len=2048, max_num_seqs=32, served_model_name="tiny",
                               enable_mfu_metrics=enable_mfu_metrics, num_speculative_tokens=num_speculative_tokens,
                               spec_acceptance_length=2.5 if num_speculative_tokens else 1.0), record_steps=True)
    for _ in range(16):
        sim.submit(128, 1024)
    sim.run_until(5.0)
    return sim, sim.render_metrics().decode()


def _vllm_families(text: str) -> dict[str, tuple[str, str, frozenset[str], tuple[str, ...]]]:
    return {name: shape for name, shape in structure(text).items()
            if name.startswith("vllm:") and not name.endswith("_created")}


def _samples(text: str, family_name: str) -> list[Sample]:
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == family_name]
    return list(family.samples)


def _label_values(samples: Iterable[Sample]) -> dict[str, frozenset[str]]:
    values: dict[str, set[str]] = {}
    for sample in samples:
        if sample.name.endswith("_created"):
            continue
        for label in ENUMERATED_LABELS:
            if label in sample.labels:
                values.setdefault(label, set()).add(sample.labels[label])
    return {label: frozenset(found) for label, found in values.items()}


def _value(text: str, name: str, **labels: str) -> float:
    """The value of the one sample `name{labels}` on the page."""
    (value,) = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == name and sample.labels == labels]
    return value


@pytest.mark.parametrize("real_page", [STREAMS_T1, IDLE, NGRAM], ids=lambda path: path.stem)
def test_the_simulators_families_types_help_labels_and_buckets_are_the_real_pages(real_page: Path) -> None:
    real = _vllm_families(real_page.read_text())
    _, text = _simulated_page(num_speculative_tokens=3 if real_page == NGRAM else 0)
    ours = _vllm_families(text)
    not_served = set(NOT_SERVED.get(real_page, {}))
    assert not_served <= set(real), "an exclusion names a family the real page does not have"
    assert set(real) - not_served - set(ours) == set(), "real vLLM 0.32.0 families the simulator lost"
    assert set(ours) - set(real) == set(), "families the simulator serves that vLLM 0.32.0 does not"
    for name in sorted(set(real) - not_served):
        real_type, real_help, real_labels, real_edges = real[name]
        our_type, our_help, our_labels, our_edges = ours[name]
        assert our_type == real_type, name
        assert our_help == real_help, name
        assert our_labels == real_labels, name
        assert our_edges == real_edges, name


def test_enumerated_label_values_are_the_real_pages() -> None:
    real_text = STREAMS_T1.read_text()
    _, text = _simulated_page()
    real_names = {f.name for f in text_string_to_metric_families(real_text) if f.name.startswith("vllm:")}
    assert len(real_names) > 30
    for name in sorted(real_names):
        assert _label_values(_samples(text, name)) == _label_values(_samples(real_text, name)), name
    # Spelled out, from vLLM's own lists (loggers.py:47, :560, :606) as the real page shows them.
    sleep = {s.labels["sleep_state"]: s.value for s in _samples(text, "vllm:engine_sleep_state")}
    assert sleep == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    rejections = [s.labels for s in _samples(text, "vllm:admission_rejections") if s.name.endswith("_total")]
    assert rejections == [{"model_name": "tiny", "reason": "max_num_queued_reqs"},
                          {"model_name": "tiny", "reason": "max_num_queued_tokens"}]  # no engine label


def test_cache_config_info_has_the_real_pages_labels_and_the_simulators_cache() -> None:
    (real,) = _samples(STREAMS_T1.read_text(), "vllm:cache_config_info")
    sim, text = _simulated_page()
    (ours,) = _samples(text, "vllm:cache_config_info")
    assert set(ours.labels) == set(real.labels)
    # The real page: 256 blocks of 128 tokens, 32,768 tokens (VLLM_CPU_KVCACHE_SPACE=1 GiB, README):
    # kv_cache_size_tokens counts the null block in.
    assert (real.labels["num_gpu_blocks"], real.labels["block_size"], real.labels["kv_cache_size_tokens"]) == (
        "256", "128", "32768")
    assert real.labels["effective_attention_block_size"] == real.labels["block_size"]
    assert ours.labels["num_gpu_blocks"] == str(sim.num_gpu_blocks)
    assert ours.labels["kv_cache_size_tokens"] == str(sim.num_gpu_blocks * 16)
    assert ours.labels["block_size"] == ours.labels["effective_attention_block_size"] == "16"
    assert ours.labels["cache_dtype"] == "auto" and ours.labels["enable_prefix_caching"] == "True"


def test_kv_cache_usage_leaves_the_null_block_out_as_the_real_page_does() -> None:
    # README: 16 requests of 128 + ~700 tokens hold 3 blocks of 128 each, 48 of the 255 usable blocks.
    real_usage = _value(STREAMS_T1.read_text(), "vllm:kv_cache_usage_perc", engine="0", model_name="tiny")
    assert real_usage == pytest.approx(48 / 255)
    sim, text = _simulated_page()
    assert sim.steps is not None
    usage = _value(text, "vllm:kv_cache_usage_perc", engine="0", model_name="tiny")
    assert usage == pytest.approx(sim.steps[-1].used_blocks / (sim.num_gpu_blocks - 1))


def test_the_estimated_counters_are_the_simulated_gpus_own_flops_and_bytes() -> None:
    """One request of 100 prompt tokens and 2 output tokens on Qwen3-8B (bf16, block size 16):
    step 1 prefills 100 tokens into 7 blocks, step 2 decodes 1 token in the same 7 blocks."""
    sim = Simulator(ServerSpec(served_model_name="tiny", enable_mfu_metrics=True), record_steps=True)
    request = sim.submit(100, 2)
    step(sim)
    step(sim)
    assert request.finished
    text = sim.render_metrics().decode()
    labels = {"engine": "0", "model_name": "tiny"}
    kv_per_token = kv_bytes_per_token_by_hand()  # 147,456 bytes
    weight_bytes = QWEN.params * 2
    held_kv_bytes = 7 * 16 * kv_per_token  # whole blocks are read, each step
    assert _value(text, "vllm:estimated_read_bytes_per_gpu_total", **labels) == pytest.approx(
        2 * weight_bytes + 2 * held_kv_bytes)
    assert _value(text, "vllm:estimated_write_bytes_per_gpu_total", **labels) == pytest.approx(101 * kv_per_token)
    # GEMMs: 2 FLOPs per parameter per token, 101 tokens; attention of the prefill chunk: QK^T and AV,
    # 4 x layers x heads x head_dim per (query, key) pair, 100 queries over 50 keys on average.
    attention = 4 * QWEN.layers * QWEN.attention_heads * QWEN.head_dim * 100 * 50
    assert _value(text, "vllm:estimated_flops_per_gpu_total", **labels) == pytest.approx(
        2 * QWEN.params * 101 + attention)


def test_without_the_flag_the_estimated_counters_are_on_the_page_at_zero() -> None:
    # perf.py:1757 declares them whatever the flag; only the scheduler's PerfStats need it (scheduler.py:420).
    sim, text = _simulated_page(enable_mfu_metrics=False)
    assert sim.step_count > 0
    for name in ("vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
                 "vllm:estimated_write_bytes_per_gpu_total"):
        assert _value(text, name, engine="0", model_name="tiny") == 0.0


def test_the_real_pages_estimated_counters_grow_with_the_steps_and_the_flag_sets_ours() -> None:
    real_t0, real_t1 = STREAMS_T0.read_text(), STREAMS_T1.read_text()
    labels = {"engine": "0", "model_name": "tiny"}
    for name in ("vllm:estimated_flops_per_gpu_total", "vllm:estimated_read_bytes_per_gpu_total",
                 "vllm:estimated_write_bytes_per_gpu_total"):
        assert _value(real_t1, name, **labels) > _value(real_t0, name, **labels) > 0
    parser = argparse.ArgumentParser()
    build_parser(parser)
    assert spec_from_args(parser.parse_args(["--enable-mfu-metrics"])).enable_mfu_metrics
    assert not spec_from_args(parser.parse_args([])).enable_mfu_metrics


def test_request_histograms_time_each_phase_of_a_finished_request() -> None:
    """A request alone: queued 0 s (admitted at once), prefill = its first step, decode = the rest;
    n = 1, max_tokens as asked, and TPOT the mean gap after the first token."""
    sim = Simulator(ServerSpec(served_model_name="tiny"), record_steps=True)
    sim.submit(100, 4)
    for _ in range(4):
        step(sim)
    assert sim.steps is not None and len(sim.steps) == 4
    first, *rest = sim.steps
    text = sim.render_metrics().decode()
    labels = {"engine": "0", "model_name": "tiny"}
    decode_seconds = sum(s.seconds for s in rest)
    assert _value(text, "vllm:request_queue_time_seconds_sum", **labels) == 0.0
    assert _value(text, "vllm:request_prefill_time_seconds_sum", **labels) == pytest.approx(first.seconds)
    assert _value(text, "vllm:request_decode_time_seconds_sum", **labels) == pytest.approx(decode_seconds)
    assert _value(text, "vllm:request_inference_time_seconds_sum", **labels) == pytest.approx(
        first.seconds + decode_seconds)
    assert _value(text, "vllm:request_time_per_output_token_seconds_sum", **labels) == pytest.approx(
        decode_seconds / 3)
    assert _value(text, "vllm:request_params_n_sum", **labels) == 1.0
    assert _value(text, "vllm:request_params_max_tokens_sum", **labels) == 4.0
    assert _value(text, "vllm:request_max_num_generation_tokens_sum", **labels) == 4.0
    assert _value(text, "vllm:request_params_n_bucket", le="1.0", **labels) == 1.0
