"""What a real vLLM 0.32.0 page gives that older captures never had, read off the pages of a running
server (tests/data/vllm-0.32.0-cpu/, README there): vLLM's own bytes read per step beside ours, the
waiting requests by reason, the front end's admission rejections and the engine's sleep state.

Each number is worked out here by hand from the page lines (quoted beside it) and from the model's
architecture (tiny-llama.config.json), never by calling the code under test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.serve.alerting import AlertLoop
from exporter.serve.collector import make_registry
from exporter.serve.config import Alerting, Deployment, config_from_mapping
from exporter.serve.derivation import derive_reading
from exporter.serve.discovery import Target
from exporter.serve.engines import read_page
from exporter.serve.engines.vllm import sleep_state
from exporter.serve.reading import Reading, page_setup
from exporter.serve.snapshot import Snapshot
from exporter.serve.window import compute_window
from tests.support.tools import DATA

PAGES = DATA / "vllm-0.32.0-cpu"
T0 = (PAGES / "vllm-0.32.0-cpu_REAL_16streams_t0.prom").read_text()
T1 = (PAGES / "vllm-0.32.0-cpu_REAL_16streams_t1.prom").read_text()
IDLE = (PAGES / "vllm-0.32.0-cpu_REAL_idle.prom").read_text()
NGRAM = (PAGES / "vllm-0.32.0-cpu_REAL_ngram_spec_decode.prom").read_text()
URL = "http://127.0.0.1:8000/metrics"
TARGET = Target("tiny", URL, "127.0.0.1:8000")
SERIES = {"deployment": "tiny", "target": "127.0.0.1:8000", "model_name": "tiny", "engine": "0"}
NEW_METRICS = ("stepbudget_requests_waiting_for_capacity", "stepbudget_server_step_read_bytes",
               "stepbudget_step_read_bytes_ratio", "stepbudget_engine_sleeping")

# tiny-llama.config.json: hidden 512, 8 layers, 8 heads of 64 (MHA: 8 KV heads), intermediate 1,408,
# vocab 8,192, untied lm_head; served with --dtype float32.
HIDDEN, LAYERS, HEADS, HEAD_DIM, INTERMEDIATE, VOCAB, FP32 = 512, 8, 8, 64, 1408, 8192, 4


def tiny(**keys: object) -> Deployment:
    return config_from_mapping({"deployments": [{
        "name": "tiny", "model": str(PAGES / "tiny-llama.config.json"), "gpu": "h100-sxm", "weight_dtype": "fp32",
        "effective_bandwidth": 2e12, "targets": {"static": [URL]}, **keys}]}).deployments[0]


def only(page: str) -> Snapshot:
    [snapshot] = read_page(page).snapshots
    return snapshot


def edited(page: str, line: str, value: str) -> str:
    """The real page with one sample's value changed (the line must be on it exactly once)."""
    assert page.count(line + " ") == 1, line
    start = page.index(line + " ")
    end = page.index("\n", start)
    return page[:start] + f"{line} {value}" + page[end:]


def reading_of(deployment: Deployment, before: str | None, now: str) -> Reading:
    current = only(now)
    window = compute_window(only(before), current) if before is not None else None
    return derive_reading(deployment, TARGET, current, window, now_seconds=1000.0, scrape_duration_seconds=0.1)


def exported(deployment: Deployment, reading: Reading) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = generate_latest(make_registry(lambda: [reading], [deployment])).decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_the_adapter_reads_the_new_families_off_the_real_pages() -> None:
    t0, t1 = only(T0), only(T1)
    # vllm:estimated_read_bytes_per_gpu_total{engine="0",model_name="tiny"} 1.55866671104e+11 / 2.05236381696e+11
    assert (t0.server_read_bytes_total, t1.server_read_bytes_total) == (1.55866671104e11, 2.05236381696e11)
    # vllm:num_requests_waiting_by_reason{...,reason="capacity"} 0.0 (and reason="deferred" 0.0)
    assert t0.requests_waiting_for_capacity == 0.0
    # vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"} 0.0, "..._tokens" 0.0
    assert t0.admission_rejections_total == 0.0
    # vllm:engine_sleep_state{...,sleep_state="awake"} 1.0, weights_offloaded 0.0, discard_all 0.0
    assert (t0.sleep_state, t1.sleep_state, only(IDLE).sleep_state) == ("awake", "awake", "awake")
    # What the older fixtures had still reads the same: kv_cache_usage_perc 0.12549019607843137,
    # cache_config_info kv_cache_size_tokens="32768" block_size="128", iteration_tokens_total_count 856.0.
    assert (t0.kv_cache_usage_ratio, t0.kv_cache_capacity_tokens) == (0.12549019607843137, 32768.0)
    assert (t0.block_size_tokens, t0.engine_steps_total, t0.requests_running) == (128, 856.0, 16.0)
    assert [m.split(":")[0] for m in t0.missing] == ["tokens_in_flight", "kv_cache_used_tokens"]
    assert read_page(T0).problems == ()


def test_our_bytes_per_step_beside_vllms_on_the_real_window() -> None:
    reading = reading_of(tiny(), T0, T1)
    # vLLM's own: the counter's delta over the engine steps' delta (iteration_tokens_total_count 856 -> 1037).
    server_per_step = (2.05236381696e11 - 1.55866671104e11) / (1037 - 856)
    # Ours, from the architecture: embeddings, per layer q/k/v/o, gate/up/down and two norms, a final
    # norm and an untied lm_head; float32.
    attention = 4 * HIDDEN * HIDDEN
    mlp = 3 * HIDDEN * INTERMEDIATE
    params = VOCAB * HIDDEN + LAYERS * (attention + mlp + 2 * HIDDEN) + HIDDEN + VOCAB * HIDDEN
    assert params == 34_087_424  # the README's 34.1M
    # A decode step reads every weight but the input-embedding table, of which it looks up one row
    # per token (16 running requests, no prompt tokens computed in the window:
    # prompt_tokens_by_source_total{source="local_compute"} 4768 at both polls).
    weights_read = (params - VOCAB * HIDDEN) * FP32 + 16 * HIDDEN * FP32
    kv_per_token = 2 * LAYERS * HEADS * HEAD_DIM * FP32  # cache_dtype="auto": the model's float32
    # Tokens in flight at each end: the used blocks (usage x (256 - 1 null block) = 32 and 48 blocks of
    # 128) less the half-empty last block of each of the 16 running requests, (128 - 1) / 2 tokens.
    tokens_t0, tokens_t1 = 32 * 128 - 16 * 63.5, 48 * 128 - 16 * 63.5
    ours = weights_read + kv_per_token * (tokens_t0 + tokens_t1) / 2
    assert reading.server_step_read_bytes == pytest.approx(server_per_step)
    assert reading.step_read_bytes_ratio == pytest.approx(ours / server_per_step)
    assert reading.step_read_bytes == pytest.approx(weights_read + kv_per_token * tokens_t1)
    # About 7% under vLLM's figure: docs/model.md says why (contexts inside their last blocks, activations).
    assert 0.93 < ours / server_per_step < 0.94
    samples = exported(tiny(), reading)
    [(labels, server_exported)] = samples["stepbudget_server_step_read_bytes"]
    assert labels == SERIES and server_exported == pytest.approx(server_per_step)
    [(labels, ratio_exported)] = samples["stepbudget_step_read_bytes_ratio"]
    assert labels == SERIES and ratio_exported == pytest.approx(ours / server_per_step)
    assert samples["stepbudget_engine_sleeping"] == [(SERIES, 0.0)]
    assert samples["stepbudget_requests_waiting_for_capacity"] == [(SERIES, 0.0)]
    assert reading.lacking == ()


def test_a_server_without_mfu_metrics_gives_no_estimate_not_zero_bytes() -> None:
    """0.32 and 0.33 write the family on every page, but count only with --enable-mfu-metrics: the
    genuine 0.33.0 pages stepped 30 times (iteration_tokens_total_count 30 -> 60) at 0.0 bytes."""
    before = (DATA / "genuine" / "vllm-0.33.0_GENUINE_dp1_t0.prom").read_text()
    after = (DATA / "genuine" / "vllm-0.33.0_GENUINE_dp1_t1.prom").read_text()
    window = compute_window(only(before), only(after))
    assert window.server_read_bytes_per_step is None
    assert any("--enable-mfu-metrics" in note for note in window.notes)
    # The real spec-decode page's counter is 0.0 after 93 steps too; a window ending on it says the same.
    earlier = edited(NGRAM, 'vllm:iteration_tokens_total_count{engine="0",model_name="tiny"}', "50.0")
    assert compute_window(only(earlier), only(NGRAM)).server_read_bytes_per_step is None


def test_a_sleeping_engine_is_not_an_idle_one() -> None:
    """The idle page, its sleep gauge set as AsyncLLM.sleep(level=1) sets it: awake 0, weights_offloaded 1
    (0.32.0 vllm/v1/metrics/loggers.py l. 1335-1352, called from vllm/v1/engine/async_llm.py l. 1160)."""
    asleep = edited(IDLE, 'vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="awake"}', "0.0")
    asleep = edited(asleep, 'vllm:engine_sleep_state{engine="0",model_name="tiny",sleep_state="weights_offloaded"}',
                    "1.0")
    # A budget the weights alone miss: an awake idle engine is predicted over it, and the loop says so.
    deployment = tiny(target_tokens_per_second=1e6)
    awake_reading, sleeping = reading_of(deployment, IDLE, IDLE), reading_of(deployment, IDLE, asleep)
    assert awake_reading.predicted_step_seconds is not None and awake_reading.tokens_in_flight == 0.0
    assert sleeping.sleep_state == "weights_offloaded" and sleeping.engine_sleeping == 1.0
    for name in ("tokens_in_flight", "kv_cache_usage_ratio", "kv_cache_capacity_tokens", "step_read_bytes",
                 "predicted_step_seconds", "predicted_memory_step_seconds", "measured_step_seconds",
                 "token_budget_tokens", "token_budget_utilization_ratio", "predicted_user_tokens_per_second"):
        assert getattr(sleeping, name) is None, name
    # What it still says is the server's own count: num_requests_running 0.0, num_requests_waiting 0.0.
    assert (sleeping.requests_running, sleeping.requests_waiting, sleeping.target_up) == (0.0, 0.0, True)
    assert any("asleep" in note for note in sleeping.notes)
    for reading, alerts in ((awake_reading, {"StepBudgetPredictedStepOverBudget"}), (sleeping, set())):
        loop = AlertLoop(Alerting(), poll_interval_seconds=15)
        loop.evaluate([reading], 0.0)
        assert {alert["labels"]["alertname"] for alert in loop.active()} == alerts  # type: ignore[index]  # JSON-shaped
    samples = exported(deployment, sleeping)
    assert samples["stepbudget_engine_sleeping"] == [(SERIES, 1.0)]
    assert "stepbudget_tokens_in_flight" not in samples and "stepbudget_predicted_step_seconds" not in samples


@pytest.mark.parametrize("awake, weights_offloaded, discard_all, state", [
    ("1.0", "0.0", "0.0", "awake"),
    ("0.0", "1.0", "0.0", "weights_offloaded"),  # sleep level 1
    ("0.0", "0.0", "1.0", "discard_all"),  # sleep level 2
    ("0.0", "0.0", "0.0", "kv_cache_released"),  # release_kv_cache_memory: async_llm.py l. 1162-1167
])
def test_each_sleep_encoding(awake: str, weights_offloaded: str, discard_all: str, state: str) -> None:
    page = IDLE
    for label, value in (("awake", awake), ("weights_offloaded", weights_offloaded), ("discard_all", discard_all)):
        page = edited(page, f'vllm:engine_sleep_state{{engine="0",model_name="tiny",sleep_state="{label}"}}', value)
    assert only(page).sleep_state == state
    assert sleep_state({"awake": float(awake), "weights_offloaded": float(weights_offloaded),
                        "discard_all": float(discard_all)}) == state


def test_waiting_for_capacity_per_engine_on_a_genuine_dp2_page() -> None:
    """vLLM 0.33.0's own code wrote these: engine 0 has 3 waiting, all for capacity."""
    page = (DATA / "genuine" / "vllm-0.33.0_GENUINE_dp2_t1.prom").read_text()
    snapshots = {s.engine: s for s in read_page(page).snapshots}
    # vllm:num_requests_waiting_by_reason{engine="0",...,reason="capacity"} 3.0; engine="1" 0.0
    assert (snapshots["0"].requests_waiting_for_capacity, snapshots["1"].requests_waiting_for_capacity) == (3.0, 0.0)
    assert snapshots["0"].requests_waiting == 3.0
    # vllm:admission_rejections_total{model_name=...} has no engine label: one figure for the server.
    assert all("admission_rejections_total" in s.server_wide for s in snapshots.values())
    assert read_page(page).problems == ()


def test_rejections_in_the_window_are_said_and_summed_over_reasons() -> None:
    rejecting = edited(T1, 'vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"}', "2.0")
    rejecting = edited(rejecting, 'vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_tokens"}',
                       "5.0")
    assert only(rejecting).admission_rejections_total == 7.0
    window = compute_window(only(T0), only(rejecting))
    assert window.admission_rejections == 7.0
    reading = derive_reading(tiny(), TARGET, only(rejecting), window, now_seconds=0, scrape_duration_seconds=0)
    assert any("refused 7 requests" in note for note in reading.notes)


def test_pages_without_the_families_keep_the_old_reading() -> None:
    """A capture from before 0.32 has none of them: the snapshot says nothing of them, the reading
    predicts as before, and nothing new is exported or logged as lacking."""
    page = (DATA / "vllm" / "vllm_metrics_sample_v1_0.8era_production-stack_issue318_partial.txt").read_text()
    snapshot = read_page(page).snapshots[0]
    assert (snapshot.server_read_bytes_total, snapshot.requests_waiting_for_capacity, snapshot.sleep_state,
            snapshot.admission_rejections_total) == (None, None, None, None)
    deployment = config_from_mapping({"deployments": [{"name": "tiny", "model": "qwen3-8b", "gpu": "h100-sxm",
                                                       "targets": {"static": [URL]}}]}).deployments[0]
    reading = derive_reading(deployment, TARGET, snapshot, compute_window(snapshot, snapshot), now_seconds=0,
                             scrape_duration_seconds=0)
    assert reading.engine_sleeping is None and reading.step_read_bytes_ratio is None
    assert reading.predicted_step_seconds is not None
    assert not set(NEW_METRICS) & set(reading.lacking)
    samples = exported(deployment, reading)
    assert not set(NEW_METRICS) & set(samples)


def test_the_pages_auto_cache_dtype_follows_a_float32_model() -> None:
    """vLLM's cache_dtype "auto" is the model's dtype (vllm/utils/torch_utils.py l. 438-445): 4 bytes
    for a float32 model, not the 16 bits "auto" means in a config of a 16-bit model."""
    setup = tiny().resolved.setup
    assert page_setup(setup, "auto", None).kv_bytes_per_element == 4.0
    bf16 = tiny(weight_dtype="bf16").resolved.setup
    assert page_setup(bf16, "auto", None).kv_bytes_per_element == 2.0
    assert page_setup(setup, "fp8", None).kv_bytes_per_element == 1.0
    assert math.isclose(page_setup(tiny(weight_dtype="int4").resolved.setup, "auto", None).kv_bytes_per_element, 2.0)


def test_a_bfloat16_config_served_in_float32_is_read_in_the_width_the_page_allocated(tmp_path: Path) -> None:
    """The suite's model with a config.json that says bfloat16, as served with --dtype float32 (what the CPU
    backend needs): the page's cache_config_info says 1 GiB of KV (kv_cache_memory_bytes="1073741824") holds
    32,768 tokens, 32,768 B a token = 2 (K and V) x 8 layers x 8 KV heads x 64 head dims x 4 bytes. The KV
    bytes and, with cache_dtype "auto", the weights follow the page; the disagreement is exported."""
    config = json.loads((PAGES / "tiny-llama.config.json").read_text())
    config["dtype"] = "bfloat16"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    deployment = config_from_mapping({"deployments": [{
        "name": "tiny", "model": str(path), "gpu": "h100-sxm", "effective_bandwidth": 2e12,
        "targets": {"static": [URL]}}]}).deployments[0]
    configured = deployment.resolved.setup
    assert (configured.weight_bytes_per_param, configured.kv_bytes_per_element) == (2.0, 2.0)
    assert only(T1).kv_cache_bytes_per_token == 1073741824 / 32768 == 2 * 8 * 8 * 64 * 4
    reading = reading_of(deployment, T0, T1)
    assert set(reading.setup_disagreements) == {("kv_bytes_per_token", str(2 * 8 * 8 * 64 * 2), "32768"),
                                                ("weight_dtype", "16-bit", "float32")}
    samples = exported(deployment, reading)
    assert samples["stepbudget_kv_bytes_per_token"][0][1] == 32768
    # 34.1M parameters (the model's own count, scripts/make_tiny_llama.py) in float32.
    weights = samples["stepbudget_weight_bytes"][0][1]
    assert weights == pytest.approx(4 * configured.architecture.params)
    info = {(labels["quantity"], labels["configured"], labels["page"])
            for labels, _ in samples["stepbudget_setup_disagreement_info"]}
    assert info == set(reading.setup_disagreements)
    # Predicted with the page's widths: the same as a deployment configured in float32 outright.
    float32 = tiny()  # weight_dtype fp32, the same config.json otherwise
    assert reading.step_read_bytes == pytest.approx(reading_of(float32, T0, T1).step_read_bytes)
    assert reading_of(float32, T0, T1).setup_disagreements == ()


def test_a_page_whose_blocks_were_overridden_says_no_bytes_per_token() -> None:
    """--num-gpu-blocks-override sizes the cache apart from kv_cache_memory_bytes: their ratio says nothing."""
    line = next(line for line in T1.splitlines() if line.startswith("vllm:cache_config_info{"))
    overridden = T1.replace(line, line.replace('num_gpu_blocks_override="None"', 'num_gpu_blocks_override="128"'))
    assert only(overridden).kv_cache_bytes_per_token is None


BETWEEN_IDLE = [(PAGES / f"vllm-0.32.0-cpu_REAL_between_idle_t{i}.prom").read_text() for i in range(2)]


def test_a_request_between_two_idle_polls_is_measured_and_not_scored() -> None:
    """One request (200 prompt ids, 40 tokens out) came and went between two polls 3 s apart that both found
    nothing running: its 40 tokens gave 39 token gaps (the ITL count moved by 39, one per token after the
    first). The window's step is measured, but neither end
    saw the load its steps ran, so no prediction is set beside it: at an empty batch it would read as a slow
    model, and a lightly loaded server would drift for ever."""
    before, after = BETWEEN_IDLE
    assert _itl_count(after) - _itl_count(before) == 40 - 1
    reading = reading_of(tiny(), before, after)
    assert reading.requests_running == 0 and reading.measured_step_seconds is not None
    assert reading.window_predicted_step_seconds is None and reading.prediction_error_ratio is None
    assert any("came and went" in note for note in reading.notes)
    assert "stepbudget_prediction_error_ratio" not in exported(tiny(), reading)
    # The same pages a poll apart with a request still running at the end are scored as before.
    running = edited(after, 'vllm:num_requests_running{engine="0",model_name="tiny"}', "1.0")
    assert reading_of(tiny(), before, running).prediction_error_ratio is not None


def _itl_count(page: str) -> float:
    line = next(line for line in page.splitlines() if line.startswith("vllm:inter_token_latency_seconds_count{"))
    return float(line.rsplit(" ", 1)[1])
