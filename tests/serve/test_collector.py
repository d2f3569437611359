"""Every exported metric over a two-poll sequence, each value worked out by hand in the test from
the pages served and the model's inputs; plus the export's hygiene (no stale label sets, nothing
exported as NaN, labels exactly as DESIGN §3).

The model servers are real HTTP servers on 127.0.0.1 serving vLLM V1 pages built from numbers
(tests/support/pages.py), and SGLang/TGI captures from tests/data.
"""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter import __version__
from exporter.capacity.presets import get_gpu, get_model_preset
from exporter.serve.collector import PER_TARGET, make_registry
from exporter.serve.config import Config, config_from_mapping
from exporter.serve.discovery import Discovery
from exporter.serve.online_fit_types import setup_key
from exporter.serve.reading import Reading
from tests.support.clocks import ManualClock
from tests.support.pages import VllmState, vllm_page
from tests.support.pollers import MakePoller, scrape
from tests.support.servers import PageServer
from tests.support.tools import DATA


def make_config(urls: list[str], **deployment: object) -> Config:
    return config_from_mapping({
        "poll_interval": "15s", "stale_after": "60s",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                         "targets": {"static": urls}, **deployment}],
    })


def only(samples: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    assert len(samples[name]) == 1, samples.get(name)
    return samples[name][0][1]


def test_two_poll_sequence_every_value_by_hand(page_server: PageServer, clock: ManualClock,
                                               make_poller: MakePoller) -> None:
    config = make_config([page_server.url], effective_bandwidth=2e12, target_tokens_per_second=50, headroom=0.9)
    poller = make_poller(config, clock)
    first = VllmState(running=6, waiting=0, kv_usage_ratio=0.1, preemptions=3, prompt_tokens=1000, engine_steps=500,
                      generation_tokens=100,
                      itl_buckets={0.01: 10, 0.025: 60, 0.05: 100, 0.1: 100}, itl_count=100, itl_sum=1.5)
    # 200 ITL observations of 6 to 8 running requests: 28 engine steps.
    second = VllmState(running=8, waiting=2, kv_usage_ratio=0.3, preemptions=5, prompt_tokens=5000, engine_steps=528,
                       generation_tokens=304,
                       itl_buckets={0.01: 20, 0.025: 150, 0.05: 280, 0.1: 300}, itl_count=300, itl_sum=5.9)
    page_server.serve_text(vllm_page(first))
    poller.poll_once()
    clock.advance(15)
    page_server.serve_text(vllm_page(second))
    poller.poll_once()
    samples = scrape(config, poller)

    labels = {"deployment": "chat", "target": page_server.url.removeprefix("http://").removesuffix("/metrics"),
              "model_name": "Qwen/Qwen3-8B", "engine": "0"}
    for spec in PER_TARGET:
        for sample_labels, _ in samples.get(spec.name, []):
            assert sample_labels == labels, spec.name

    # Inputs of the model, written out: Qwen3-8B, 36 layers, 8 KV heads of 128, 8.19e9 params, bf16.
    arch = get_model_preset("qwen3-8b")
    kv_per_token = 2 * arch.layers * arch.kv_heads * arch.head_dim * 2
    weights = arch.params * 2
    bandwidth = 2e12
    compute = 0.5 * get_gpu("h100-sxm").peak_flops_per_second["bf16"]

    # Usage ratio x (GPU blocks - the null block) x block size, less 8 running requests' half-empty last
    # blocks of 16 tokens ((16 - 1) / 2 each).
    tokens = 0.3 * (4096 - 1) * 16 - 8 * (16 - 1) / 2
    measured_mean = (5.9 - 1.5) / (300 - 100)
    # Median from bucket deltas as histogram_quantile: 200 observations, rank 100; deltas
    # 0.01:10, 0.025:90, 0.05:180 -> inside (0.025, 0.05], 10 of that bucket's 90 in: 27.8 ms, which
    # the bucket (25 ms wide) cannot tell from any step between 25 and 50 ms. Its bounds are exported.
    interpolated_median = 0.025 + (0.05 - 0.025) * (100 - 90) / (180 - 90)
    assert 0.05 - 0.025 > 0.1 * interpolated_median
    prefill = (5000 - 1000) / (528 - 500)
    memory_step = (weights + kv_per_token * tokens) / bandwidth
    gemm_step = 2 * arch.params * (8 + prefill) / compute
    # 204 tokens sampled, 200 of them ITL observations: 4 first tokens, 4 prompts of 4,000 / 4 tokens,
    # whose tokens attend to 4 x 1,000^2 / 2 in all, 500 each on average.
    prompt_context = 4 * 1000 ** 2 / 2 / 4000
    # Decode tokens attend to their contexts, prefill tokens to theirs: 4 FLOPs per query head dimension
    # per token, every layer.
    flops_per_attended = 4 * arch.layers * arch.attention_heads * arch.head_dim
    attention_step = flops_per_attended * (tokens + prefill * prompt_context) / compute
    compute_step = gemm_step + attention_step
    # By phase: GEMMs, then attention, each at the longer of its memory and compute time.
    predicted = max(weights / bandwidth, gemm_step) + max(kv_per_token * tokens / bandwidth, attention_step)
    step_budget = 0.9 / 50
    token_budget = (step_budget * bandwidth - weights) / kv_per_token

    assert only(samples, "stepbudget_target_up") == 1
    assert only(samples, "stepbudget_target_scrape_duration_seconds") == pytest.approx(0.125)
    assert only(samples, "stepbudget_target_last_success_timestamp_seconds") == clock.now
    assert only(samples, "stepbudget_tokens_in_flight") == pytest.approx(tokens)
    assert only(samples, "stepbudget_kv_cache_capacity_tokens") == 4096 * 16
    assert only(samples, "stepbudget_kv_cache_usage_ratio") == pytest.approx(0.3)
    assert only(samples, "stepbudget_requests_running") == 8
    assert only(samples, "stepbudget_requests_waiting") == 2
    assert only(samples, "stepbudget_preemptions_total") == 5
    assert only(samples, "stepbudget_prefill_tokens_per_step") == pytest.approx(prefill)
    assert only(samples, "stepbudget_prefill_mean_context_tokens") == pytest.approx(prompt_context)
    assert only(samples, "stepbudget_step_read_bytes") == pytest.approx(weights + kv_per_token * tokens)
    assert only(samples, "stepbudget_predicted_memory_step_seconds") == pytest.approx(memory_step)
    assert only(samples, "stepbudget_predicted_compute_step_seconds") == pytest.approx(compute_step)
    assert only(samples, "stepbudget_predicted_step_seconds") == pytest.approx(predicted)
    assert only(samples, "stepbudget_measured_step_seconds") == pytest.approx(measured_mean)
    assert "stepbudget_measured_step_median_seconds" not in samples
    assert only(samples, "stepbudget_measured_step_median_lower_seconds") == 0.025
    assert only(samples, "stepbudget_measured_step_median_upper_seconds") == 0.05
    # The error is for the window's load: the mean of the predictions at its two ends (the first poll's
    # 6 running requests at 10% usage, the second's 8 at 30%), each with the window's prefill.
    start_tokens = 0.1 * (4096 - 1) * 16 - 6 * (16 - 1) / 2
    start_gemm = 2 * arch.params * (6 + prefill) / compute
    start_attention = flops_per_attended * (start_tokens + prefill * prompt_context) / compute
    at_start = max(weights / bandwidth, start_gemm) + max(kv_per_token * start_tokens / bandwidth, start_attention)
    expected_error = ((at_start + predicted) / 2 - measured_mean) / measured_mean
    assert only(samples, "stepbudget_prediction_error_ratio") == pytest.approx(expected_error)
    assert only(samples, "stepbudget_predicted_user_tokens_per_second") == pytest.approx(1 / predicted)
    assert only(samples, "stepbudget_step_budget_seconds") == pytest.approx(step_budget)
    assert only(samples, "stepbudget_token_budget_tokens") == pytest.approx(token_budget)
    assert only(samples, "stepbudget_token_budget_utilization_ratio") == pytest.approx(tokens / token_budget)
    [(bw_labels, bw_value)] = samples["stepbudget_effective_bandwidth_bytes_per_second"]
    assert bw_labels == {**labels, "source": "configured"} and bw_value == bandwidth

    assert samples["stepbudget_kv_bytes_per_token"] == [({"deployment": "chat"}, kv_per_token)]
    assert samples["stepbudget_weight_bytes"] == [({"deployment": "chat"}, weights)]
    # The page's cache_config_info says cache_dtype="auto", which agrees with the config's "auto".
    setup = setup_key(config.deployments[0].resolved)
    assert samples["stepbudget_model_info"] == [({"deployment": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                                                  "tensor_parallel": "1", "kv_cache_dtype": "auto",
                                                  "configured_kv_cache_dtype": "auto",
                                                  "kv_cache_dtype_source": "page", "setup": setup}, 1.0)]
    # What the online fit reads back after a restart: the setup the window ran on (the page has no
    # iteration-tokens histogram here, so no prefill mix).
    assert samples["stepbudget_window_setup_info"] == [
        ({**labels, "setup": setup, "kv_cache_dtype": "auto", "block_size": "16"}, 1.0)]
    assert "stepbudget_prefill_mix_tokens" not in samples
    assert samples["stepbudget_build_info"] == [({"version": __version__}, 1.0)]


def test_the_reading_knows_every_exported_value() -> None:
    from exporter.serve.reading import VALUE_FIELDS

    assert [spec.name.removeprefix("stepbudget_") for spec in PER_TARGET][1:] == list(VALUE_FIELDS)


def _exported(readings: list[Reading]) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The collector's page for hand-built readings, parsed back: sample name -> [(labels, value)]."""
    text = generate_latest(make_registry(lambda: readings, ())).decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def test_tokens_in_flight_and_kv_used_are_two_series() -> None:
    """What a step reads and what the cache holds, exported side by side. Eight chats on one shared
    2,000-token system prompt, each with 500 tokens of its own: every step reads 8 x 2,500 tokens of
    context, while the cache holds the prompt once plus 8 x 500."""
    tokens_in_flight = 8 * (2000 + 500)
    used = 2000 + 8 * 500
    capacity = 65536
    shared = 1 - used / tokens_in_flight
    assert (tokens_in_flight, used, shared) == (20000, 6000, pytest.approx(0.7))
    decode = Reading(deployment="chat", target="10.0.0.5:8000", model_name="Qwen/Qwen3-8B", engine="0",
                     target_up=True, tokens_in_flight=tokens_in_flight, kv_cache_used_tokens=used,
                     kv_cache_capacity_tokens=capacity, kv_cache_usage_ratio=used / capacity,
                     kv_cache_shared_ratio=shared, role="decode")
    samples = _exported([decode])
    labels = {"deployment": "chat", "target": "10.0.0.5:8000", "model_name": "Qwen/Qwen3-8B", "engine": "0"}
    assert samples["stepbudget_tokens_in_flight"] == [(labels, 20000)]
    assert samples["stepbudget_kv_cache_used_tokens"] == [(labels, 6000)]
    assert samples["stepbudget_kv_cache_usage_ratio"] == [(labels, pytest.approx(6000 / 65536))]
    assert samples["stepbudget_kv_cache_shared_ratio"] == [(labels, pytest.approx(0.7))]
    assert samples["stepbudget_target_role_info"] == [({**labels, "role": "decode"}, 1.0)]
    # Not a prefill server: no prefill budget, and no disagreement with the configured model.
    for name in ("stepbudget_prefill_tokens_per_second", "stepbudget_prefill_capacity_tokens_per_second",
                 "stepbudget_prefill_utilization_ratio", "stepbudget_setup_disagreement_info"):
        assert name not in samples, name


def test_a_prefill_server_exports_its_prefill_budget_and_no_decode_step() -> None:
    """A prefill-only server of Qwen3-8B on an H100 SXM: its capacity is what half the dense bf16 peak
    computes at 2 FLOPs per active parameter per prompt token; the window computed 27,000 prompt tokens a
    second and answered 40 first tokens in 12 s. No decode step, so no predicted step or budget."""
    arch = get_model_preset("qwen3-8b")
    compute = 0.5 * get_gpu("h100-sxm").peak_flops_per_second["bf16"]
    capacity = compute / (2 * arch.params)
    rate = 27000.0
    ttft = 12.0 / 40
    prefill = Reading(deployment="prefill", target="10.0.1.5:8000", model_name="Qwen/Qwen3-8B", engine="0",
                      namespace="llm", pod="prefill-0", target_up=True, role="prefill",
                      prefill_tokens_per_second=rate, prefill_capacity_tokens_per_second=capacity,
                      prefill_utilization_ratio=rate / capacity, measured_time_to_first_token_seconds=ttft,
                      setup_disagreements=(("kv_bytes_per_token", "147456", "73728"),
                                           ("weight_dtype", "bf16", "fp8")))
    samples = _exported([prefill])
    labels = {"deployment": "prefill", "target": "10.0.1.5:8000", "model_name": "Qwen/Qwen3-8B", "engine": "0",
              "namespace": "llm", "pod": "prefill-0"}
    assert samples["stepbudget_prefill_tokens_per_second"] == [(labels, 27000)]
    assert samples["stepbudget_prefill_capacity_tokens_per_second"] == [(labels, pytest.approx(capacity))]
    assert capacity == pytest.approx(494.7e12 / (2 * 8.19e9))  # ~30,200 prompt tokens a second
    assert samples["stepbudget_prefill_utilization_ratio"] == [(labels, pytest.approx(27000 / capacity))]
    assert samples["stepbudget_measured_time_to_first_token_seconds"] == [(labels, 0.3)]
    assert samples["stepbudget_target_role_info"] == [({**labels, "role": "prefill"}, 1.0)]
    assert sorted(samples["stepbudget_setup_disagreement_info"], key=lambda row: row[0]["quantity"]) == [
        ({**labels, "quantity": "kv_bytes_per_token", "configured": "147456", "page": "73728"}, 1.0),
        ({**labels, "quantity": "weight_dtype", "configured": "bf16", "page": "fp8"}, 1.0)]
    for name in ("stepbudget_predicted_step_seconds", "stepbudget_step_budget_seconds",
                 "stepbudget_token_budget_tokens", "stepbudget_token_budget_utilization_ratio"):
        assert name not in samples, name


def test_a_role_not_yet_known_exports_no_role() -> None:
    samples = _exported([Reading(deployment="chat", target="10.0.0.9:8000", target_up=False)])
    assert "stepbudget_target_role_info" not in samples
    assert samples["stepbudget_target_up"] == [({"deployment": "chat", "target": "10.0.0.9:8000"}, 0.0)]


def test_first_poll_exports_no_measurement_and_no_made_up_zeros(page_server: PageServer, clock: ManualClock,
                                                                make_poller: MakePoller) -> None:
    """One poll gives no window: measured, error and prefill are left out, not exported as 0."""
    config = make_config([page_server.url])
    poller = make_poller(config, clock)
    page_server.serve_text(vllm_page(VllmState(running=2, kv_usage_ratio=0.05, itl_count=10, itl_sum=0.2)))
    poller.poll_once()
    samples = scrape(config, poller)
    for name in ("stepbudget_measured_step_seconds", "stepbudget_measured_step_median_seconds",
                 "stepbudget_measured_step_median_lower_seconds", "stepbudget_measured_step_median_upper_seconds",
                 "stepbudget_prediction_error_ratio", "stepbudget_prefill_tokens_per_step"):
        assert name not in samples, name
    # The used blocks (the usage counts no null block) less the 2 running requests' half-empty last blocks.
    tokens = 0.05 * (4096 - 1) * 16 - 2 * (16 - 1) / 2
    assert only(samples, "stepbudget_tokens_in_flight") == pytest.approx(tokens)
    # Decode only, since the prefill rate is unknown: 2 tokens in the step.
    arch = get_model_preset("qwen3-8b")
    compute = 0.5 * get_gpu("h100-sxm").peak_flops_per_second["bf16"]
    attention = 4 * arch.layers * arch.attention_heads * arch.head_dim * tokens
    assert only(samples, "stepbudget_predicted_compute_step_seconds") == pytest.approx(
        (2 * arch.params * 2 + attention) / compute)
    # The default bandwidth is 0.6 x the datasheet peak, and says so.
    [(bw_labels, bw_value)] = samples["stepbudget_effective_bandwidth_bytes_per_second"]
    assert bw_labels["source"] == "default" and bw_value == pytest.approx(0.6 * 3.35e12)


def test_two_engines_on_one_page_are_two_readings(page_server: PageServer, clock: ManualClock,
                                                  make_poller: MakePoller) -> None:
    config = make_config([page_server.url])
    poller = make_poller(config, clock)
    page_server.serve_text(vllm_page(VllmState(engine="0", running=1, kv_usage_ratio=0.25),
                                     VllmState(engine="1", running=3, kv_usage_ratio=0.5)))
    poller.poll_once()
    tokens = {labels["engine"]: value for labels, value in scrape(config, poller)["stepbudget_tokens_in_flight"]}
    # Each engine's 4,096 blocks of 16 less the null block, less its running requests' half-empty last blocks.
    assert tokens == {"0": pytest.approx(0.25 * 4095 * 16 - 1 * 7.5), "1": pytest.approx(0.5 * 4095 * 16 - 3 * 7.5)}


def test_gone_model_and_gone_target_leave_the_export(make_page_server, clock: ManualClock,
                                                     make_poller: MakePoller) -> None:
    """Fresh families per scrape: a model renamed on the server or a target no longer discovered
    leaves no series behind."""
    first, second = make_page_server(), make_page_server()
    config = make_config([first.url, second.url])
    poller = make_poller(config, clock)
    first.serve_text(vllm_page(VllmState(model_name="old-model", running=1, kv_usage_ratio=0.1)))
    second.serve_text(vllm_page(VllmState(running=1, kv_usage_ratio=0.1)))
    poller.poll_once()
    models = {labels["model_name"] for labels, _ in scrape(config, poller)["stepbudget_target_up"]}
    assert models == {"old-model", "Qwen/Qwen3-8B"}
    first.serve_text(vllm_page(VllmState(model_name="new-model", running=1, kv_usage_ratio=0.1)))
    poller._discovery = Discovery(make_config([first.url]).deployments, timeout_seconds=1.0)  # now finds one target
    poller.poll_once()
    samples = scrape(config, poller)
    assert [labels["model_name"] for labels, _ in samples["stepbudget_target_up"]] == ["new-model"]
    assert all(labels["model_name"] == "new-model" for labels, _ in samples["stepbudget_tokens_in_flight"])


@pytest.mark.parametrize("capture, kind", [
    ("sglang/sglang_metrics_sample_v0.5.1_issue13485_partial.txt", "sglang"),
    ("sglang/sglang_metrics_sample_2024-11_pr1853_partial.txt", "sglang"),
    ("tgi/tgi_CONSTRUCTED_from_source.txt", "tgi"),
    ("vllm/vllm_v1_RECONSTRUCTED_multiprocess.txt", "vllm"),
    ("vllm/vllm_metrics_sample_v1_0.8era_production-stack_issue318_partial.txt", "vllm"),
])
def test_each_engine_kind_flows_through(page_server: PageServer, clock: ManualClock, capture: str, kind: str,
                                        make_poller: MakePoller) -> None:
    """A real capture of each engine becomes up readings, the engine kind detected, and every
    exported value finite (nothing invalid slips out as a number)."""
    from exporter.serve.engines import read_page

    text = (DATA / capture).read_text()
    expected = read_page(text)
    config = make_config([page_server.url])
    poller = make_poller(config, clock)
    page_server.serve_text(text)
    poller.poll_once()
    assert [state.kind for state in poller.target_states()] == [kind]
    samples = scrape(config, poller)
    ups = samples["stepbudget_target_up"]
    assert len(ups) == len(expected.snapshots) and all(value == 1 for _, value in ups)
    for snapshot in expected.snapshots:
        if snapshot.tokens_in_flight is not None:
            direct = [v for labels, v in samples["stepbudget_tokens_in_flight"]
                                if labels.get("model_name", "") == snapshot.model_name
                                and labels.get("engine", "") == snapshot.engine]
            assert direct == [snapshot.tokens_in_flight]
    for name, rows in samples.items():
        assert all(math.isfinite(value) for _, value in rows), name


# --- the HTTP server that serves the collector -------------------------------------------------------------


def test_server_endpoints_readiness_and_route_table(page_server: PageServer, clock: ManualClock,
                                                    make_poller: MakePoller) -> None:
    import requests

    from exporter.serve.server import Response, StepBudgetServer, TargetRow

    config = make_config([page_server.url])
    poller = make_poller(config, clock)
    page_server.serve_text(vllm_page(VllmState(running=2, kv_usage_ratio=0.5)))
    rows = [TargetRow("chat", "10.0.0.5:8000", "vllm", True, "32,768 tokens in flight"),
            TargetRow("chat", "10.0.0.6:8000", None, False, "HTTP 500 <oops>")]
    server = StepBudgetServer("127.0.0.1", 0, make_registry(poller.readings, config.deployments),
                              ready=lambda: poller.ready, targets=lambda: rows)
    server.register_route("POST", "/v1/echo", lambda request: Response(200, request.body[::-1]))

    def broken(request):
        raise RuntimeError("handler bug")

    server.register_route("GET", "/broken", broken)
    with pytest.raises(ValueError):
        server.register_route("GET", "/metrics", broken)
    server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert requests.get(f"{base}/-/healthy", timeout=5).status_code == 200
        assert requests.get(f"{base}/-/ready", timeout=5).status_code == 503
        poller.poll_once()
        assert requests.get(f"{base}/-/ready", timeout=5).status_code == 200
        metrics = requests.get(f"{base}/metrics", timeout=5)
        assert metrics.headers["Content-Type"].startswith("text/plain")
        assert "stepbudget_tokens_in_flight{" in metrics.text
        open_metrics = requests.get(f"{base}/metrics", headers={"Accept": "application/openmetrics-text"}, timeout=5)
        assert open_metrics.headers["Content-Type"].startswith("application/openmetrics-text")
        assert open_metrics.text.rstrip().endswith("# EOF")
        landing = requests.get(f"{base}/", timeout=5).text
        assert "href='/metrics'" in landing and "10.0.0.6:8000" in landing and "DOWN" in landing
        assert "HTTP 500 &lt;oops&gt;" in landing  # escaped
        assert requests.post(f"{base}/v1/echo", data=b"abc", timeout=5).content == b"cba"
        assert requests.get(f"{base}/v1/echo", timeout=5).status_code == 405
        assert requests.get(f"{base}/nope", timeout=5).status_code == 404
        assert requests.get(f"{base}/broken", timeout=5).status_code == 500
        assert requests.get(f"{base}/-/healthy", timeout=5).status_code == 200  # still serving
    finally:
        server.stop()


def test_server_stops_whether_or_not_it_was_started() -> None:
    """A daemon built but never started (a test, a failed start) must stop without hanging."""
    from exporter.serve.server import StepBudgetServer

    never_started = StepBudgetServer("127.0.0.1", 0, make_registry(tuple, ()), ready=lambda: False)
    never_started.stop()
    started = StepBudgetServer("127.0.0.1", 0, make_registry(tuple, ()), ready=lambda: False)
    started.start()
    started.stop()
    started.stop()  # twice is harmless

