"""The per-user speed objective's evidence: each poll window's decode tokens, and those of the windows whose
measured per-user speed met the target (exporter/serve/reading.count_decode_tokens), counted on real vLLM
pages and summed by the recording rules (the speed-objective group of the alerts file) with the real promtool.

Two real vLLM 0.32.0 windows (CPU backend, tests/data/vllm-0.32.0-cpu/README.md): 4 streams with ngram
drafts of 3 tokens, and 16 plain streams. Under speculative decoding a step gives a stream several tokens:
counted as inter-token gaps, or judged by 1 / step, the first window's tokens would be a third of what they
are and its streams slower than they were.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import replace
from pathlib import Path

import prometheus_client
import pytest
import yaml

from exporter.serve.collector import make_registry
from exporter.serve.config import config_from_mapping
from exporter.serve.derivation import derive_reading
from exporter.serve.discovery import Target
from exporter.serve.engines import read_page
from exporter.serve.reading import Reading, count_decode_tokens
from exporter.serve.window import compute_window
from tests.support.monitoring import ALERTS_FILE
from tests.support.tools import DATA as TESTS_DATA
from tests.support.tools import require_tool

DATA = TESTS_DATA / "vllm-0.32.0-cpu"
NGRAM = (DATA / "vllm-0.32.0-cpu_REAL_ngram_spec_decode.prom").read_text()
STREAMS = [(DATA / f"vllm-0.32.0-cpu_REAL_16streams_t{i}.prom").read_text() for i in (0, 1)]
TARGET_TOKENS_PER_SECOND = 25.0
RATIO_5M = "deployment_model_name:stepbudget_decode_tokens_under_target:ratio_rate5m"


def _value(page: str, name: str) -> float:
    (value,) = re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", page, re.M)
    return float(value)


def _zeroed(page: str) -> str:
    """The ngram page as it read when its server started (tests/serve/test_spec_decode.py says why that is the
    window of its 4 streams): every vllm: counter and histogram at 0."""
    return re.sub(r"^(vllm:\S+(?:_total|_bucket|_count|_sum)(?:\{[^}]*\})?) \S+$", r"\1 0.0", page, flags=re.M)


def _reading(target: str, before: str, after: str) -> Reading:
    deployment = config_from_mapping({"deployments": [{
        "name": "tiny", "model": str(DATA / "tiny-llama.config.json"), "gpu": "h100-sxm", "weight_dtype": "fp32",
        "target_tokens_per_second": TARGET_TOKENS_PER_SECOND, "targets": {"static": [f"http://{target}/metrics"]}}]}
    ).deployments[0]
    start, end = read_page(before).snapshots[0], read_page(after).snapshots[0]
    return derive_reading(deployment, Target("tiny", f"http://{target}/metrics", target), end,
                          compute_window(start, end), now_seconds=0.0, scrape_duration_seconds=0.0)


def test_the_counters_add_each_window_and_its_tokens_at_target() -> None:
    first = Reading(deployment="d", target="t", target_up=True)  # a first poll: no window
    counted = count_decode_tokens(first, None, 50.0)
    assert (counted.decode_tokens_total, counted.decode_tokens_at_target_total) == (0.0, 0.0)
    fast = count_decode_tokens(replace(first, window_decode_tokens=600.0, measured_user_tokens_per_second=50.0),
                               counted, 50.0)  # exactly at the target: it counts
    assert (fast.decode_tokens_total, fast.decode_tokens_at_target_total) == (600.0, 600.0)
    slow = count_decode_tokens(replace(first, window_decode_tokens=300.0, measured_user_tokens_per_second=49.0),
                               fast, 50.0)
    assert (slow.decode_tokens_total, slow.decode_tokens_at_target_total) == (900.0, 600.0)
    idle = count_decode_tokens(first, slow, 50.0)  # no window tokens (idle, a counter reset)
    assert (idle.decode_tokens_total, idle.decode_tokens_at_target_total) == (900.0, 600.0)
    # A failed poll keeps them (a counter that vanished and came back from 0 would read as a reset) ...
    down = idle.down(scrape_duration_seconds=1.0, keep_values=False)
    assert (down.decode_tokens_total, down.decode_tokens_at_target_total) == (900.0, 600.0)
    assert count_decode_tokens(down, idle, 50.0) is down
    # ... and a prefill server has no decode speed to judge.
    assert count_decode_tokens(replace(first, role="prefill"), slow, 50.0).decode_tokens_total is None


def test_a_spec_decode_window_counts_every_token_after_the_first_and_judges_tokens_per_step() -> None:
    """The ngram window: 800 tokens generated for 4 requests (4 first tokens) = 796 decode tokens, where its
    282 inter-token gaps x (1 + 517 accepted / 282) would say 799 (3 accepted drafts past the requests' last
    token) and the gaps alone 282. Its streams got (1 + 517 / 282) tokens per mean gap, over 25 tokens/s,
    where 1 / gap is under it."""
    reading = count_decode_tokens(_reading("127.0.0.1:8000", _zeroed(NGRAM), NGRAM), None, TARGET_TOKENS_PER_SECOND)
    tokens = _value(NGRAM, "generation_tokens_total") - _value(NGRAM, "time_to_first_token_seconds_count")
    assert tokens == 796.0
    assert reading.decode_tokens_total == tokens and reading.decode_tokens_at_target_total == tokens
    gaps = _value(NGRAM, "inter_token_latency_seconds_count")
    mean_gap = _value(NGRAM, "inter_token_latency_seconds_sum") / gaps
    per_step = 1 + _value(NGRAM, "spec_decode_num_accepted_tokens_total") / gaps
    assert 1 / mean_gap < TARGET_TOKENS_PER_SECOND <= per_step / mean_gap
    assert reading.measured_user_tokens_per_second == pytest.approx(per_step / mean_gap)


def test_the_recording_rules_give_the_pools_share_of_tokens_under_target(tmp_path: Path) -> None:
    """A pool of the two servers, their counters as the daemon exports them (before: a first poll, 0; after:
    the window), scraped a minute apart: the 5-minute ratio is the plain window's 2,896 tokens (its streams
    at 1 / 55 ms = 18 tokens/s, under 25) over both windows' 2,896 + 796, to a millionth."""
    plain = count_decode_tokens(_reading("10.0.0.6:8000", *STREAMS), None, TARGET_TOKENS_PER_SECOND)
    spec = count_decode_tokens(_reading("10.0.0.5:8000", _zeroed(NGRAM), NGRAM), None, TARGET_TOKENS_PER_SECOND)
    plain_tokens = _value(STREAMS[1], "generation_tokens_total") - _value(STREAMS[0], "generation_tokens_total")
    assert plain_tokens == 2896.0 and plain.decode_tokens_total == plain_tokens
    assert plain.decode_tokens_at_target_total == 0.0
    deployment = config_from_mapping({"deployments": [{
        "name": "tiny", "model": str(DATA / "tiny-llama.config.json"), "gpu": "h100-sxm", "weight_dtype": "fp32",
        "targets": {"static": ["http://10.0.0.5:8000/metrics"]}}]}).deployments[0]
    page = prometheus_client.generate_latest(make_registry(lambda: [plain, spec], [deployment])).decode()
    series = []
    for line in page.splitlines():
        if line.startswith(("stepbudget_decode_tokens_total{", "stepbudget_decode_tokens_at_target_total{",
                            "stepbudget_speed_objective_ratio{")):
            selector, value = line.rsplit(" ", 1)
            selector = selector.replace("}", ',instance="10.1.0.9:9421",job="stepbudget"}')
            start = "0" if "_total" in selector else value
            series.append({"series": selector, "values": f"{start} {value}x5"})
    assert len(series) == 5, page
    tests = {"rule_files": [str(ALERTS_FILE)], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": f"round({RATIO_5M} * 1000000)", "eval_time": "1m", "exp_samples": [{
            "labels": '{deployment="tiny",model_name="tiny"}',
            "value": round(plain_tokens / (plain_tokens + 796.0) * 1e6)}]}]}]}
    path = tmp_path / "speed_test.yaml"
    path.write_text(yaml.safe_dump(tests))
    result = subprocess.run([require_tool("promtool"), "test", "rules", str(path)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
