"""`stepbudget calibrate`: offline points, the agreement verdict, and live measurement against a
streaming OpenAI-compatible stub on 127.0.0.1 (real sockets, chunked server-sent events)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from exporter.capacity import calibrate
from exporter.capacity.deployment import build_setup
from exporter.capacity.presets import get_model_preset
from exporter.cli import main

QWEN3_KV = 2 * 36 * 8 * 128 * 2
QWEN3_WEIGHTS = 8.19e9 * 2


def qwen3_read_bytes(context: float) -> float:
    """Bytes one step of a lone Qwen3-8B bf16 stream reads, by hand: weights plus its KV cache."""
    return QWEN3_WEIGHTS + QWEN3_KV * context


# --- offline -----------------------------------------------------------------------------------


def test_one_offline_point_gives_bytes_over_gap(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--itl", "0.0082@1000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(qwen3_read_bytes(1000) / 0.0082)
    assert out["bandwidth_efficiency"] == pytest.approx(qwen3_read_bytes(1000) / 0.0082 / 3.35e12)
    assert out["step_overhead_seconds"] == 0 and out["overhead_fitted"] is False
    assert out["agrees"] is True and out["spread_ratio"] == 0
    (point,) = out["points"]
    assert point["read_bytes"] == qwen3_read_bytes(1000)
    assert set(point) >= {"itl_seconds", "tokens_in_flight", "read_bytes", "bandwidth_bytes_per_second",
                          "fitted_seconds", "residual_ratio"}


def test_two_offline_points_fit_bandwidth_and_overhead(capsys: pytest.CaptureFixture[str]) -> None:
    bandwidth, overhead = 2.0e12, 0.0004
    gaps = {c: overhead + qwen3_read_bytes(c) / bandwidth for c in (1000, 100_000)}
    argv = ["calibrate"] + [arg for c, gap in gaps.items() for arg in ("--itl", f"{gap!r}@{c}")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "2.000 TB/s per GPU (60% of the 3.35 TB/s datasheet peak)" in text
    assert "per-step overhead    0.400 ms" in text
    own = [qwen3_read_bytes(c) / gap for c, gap in gaps.items()]
    assert f"spread {max(own) / min(own) - 1:.1%}, within the 15% tolerance" in text
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(bandwidth)
    assert out["step_overhead_seconds"] == pytest.approx(overhead)
    assert all(abs(p["residual_ratio"]) < 1e-9 for p in out["points"])


def test_disagreeing_points_print_everything_then_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    # The long stream moves half the bytes per second the short one does: no single bandwidth fits.
    short_gap, long_gap = qwen3_read_bytes(1000) / 2e12, qwen3_read_bytes(100_000) / 1e12
    assert main(["calibrate", "--itl", f"{short_gap!r}@1000", "--itl", f"{long_gap!r}@100000"]) == 2
    captured = capsys.readouterr()
    assert "spread 100.0%, OUTSIDE the 15% tolerance" in captured.out
    assert "100,000 tokens" in captured.out
    err = captured.err.strip()
    assert len(err.splitlines()) == 1
    assert "does not fit this server" in err and "prefix caching" in err


def test_a_long_point_no_slower_than_a_short_one_is_refused_with_its_document(
        capsys: pytest.CaptureFixture[str]) -> None:
    # A server whose speed moved between the points: the 100,000-token stream stepped no slower than
    # the 1,000-token one. A fit with an overhead gives the overhead the whole gap and a bandwidth of
    # zero or less; the points are still what was measured, so they are printed and refused, not lost.
    short_gap, long_gap = 0.0100, 0.0099
    argv = ["calibrate", "--itl", f"{short_gap!r}@1000", "--itl", f"{long_gap!r}@100000", "--json"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    short_bytes, long_bytes = qwen3_read_bytes(1000), qwen3_read_bytes(100_000)
    # The bandwidth alone, least squares through the origin: 1/bandwidth = sum(bytes * gap) / sum(bytes^2).
    inverse_bandwidth = (short_bytes * short_gap + long_bytes * long_gap) / (short_bytes ** 2 + long_bytes ** 2)
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(1 / inverse_bandwidth)
    assert out["step_overhead_seconds"] == 0 and out["overhead_fitted"] is False
    assert out["agrees"] is False
    assert out["spread_ratio"] == pytest.approx((long_bytes / long_gap) / (short_bytes / short_gap) - 1)
    assert any("did not grow with the bytes read" in note for note in out["notes"]), out["notes"]
    assert "does not fit this server" in captured.err


def test_bad_itl_points_name_the_expected_form(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--itl", "0.01"]) == 2
    assert "SECONDS@TOKENS[xREQUESTS]" in capsys.readouterr().err
    assert main(["calibrate", "--itl", "0.01@0"]) == 2
    assert "must be greater than zero" in capsys.readouterr().err
    assert main(["calibrate"]) == 2
    assert "--itl" in capsys.readouterr().err


def test_the_shared_flags_take_a_zero_overhead(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--itl", "0.0082@1000", "--step-overhead", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(qwen3_read_bytes(1000) / 0.0082)
    assert main(["calibrate", "--itl", "0.0082@1000", "--step-overhead", "-1"]) == 2
    assert "--step-overhead: cannot read '-1'" in capsys.readouterr().err


def test_a_tp_vllm_refuses_is_refused_with_vllms_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--itl", "0.0082@1000", "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--tp 3" in err
    assert "Total number of attention heads (32) must be divisible by tensor parallel size (3)." in err


# --- a streaming stub of an OpenAI-compatible server --------------------------------------------


@dataclass
class Stub:
    """Streams `max_tokens` chunks, one per step of `step_seconds(context)`; records the requests."""

    step_seconds: Callable[[int], float] = lambda context: 0.0
    model_name: str = "stub-model"
    requests: list[dict] = field(default_factory=list)
    hang: threading.Event | None = None  # set: the server answers; unset: it stalls before answering
    url: str = ""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    stub: Stub

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": self.stub.model_name, "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.stub.requests.append(request)
        if self.stub.hang is not None:
            self.stub.hang.wait(5)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        step = self.stub.step_seconds(len(request["prompt"]))
        for index in range(request["max_tokens"]):
            time.sleep(step)
            chunk = {"id": "cmpl-1", "object": "text_completion", "model": request["model"],
                     "choices": [{"index": 0, "text": f" t{index}", "finish_reason": None}]}
            self._chunk(f"data: {json.dumps(chunk)}\n\n")
        self._chunk("data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, text: str) -> None:
        data = text.encode()
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()


@pytest.fixture
def stub() -> Iterator[Stub]:
    state = Stub()
    handler = type("Handler", (_Handler,), {"stub": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        if state.hang is not None:
            state.hang.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_measure_stream_drops_the_first_gap_and_takes_the_median(stub: Stub) -> None:
    # An injected clock: the request is sent at 0, chunks arrive at the listed times.
    times = iter([0.0, 0.5, 0.62, 0.70, 0.85, 0.95])
    measurement = calibrate.measure_stream(stub.url, "m", 8, 5, 5.0, clock=lambda: next(times))
    assert measurement.first_chunk_seconds == 0.5
    assert measurement.gaps_seconds == pytest.approx((0.12, 0.08, 0.15, 0.10))
    assert measurement.itl_seconds == pytest.approx(0.10)  # median of 0.08, 0.15, 0.10
    (request,) = stub.requests
    assert request["prompt"] == calibrate.synthetic_prompt(8) and len(request["prompt"]) == 8
    assert all(isinstance(token, int) for token in request["prompt"])
    assert request["stream"] is True and request["ignore_eos"] is True
    assert request["temperature"] == 0 and request["max_tokens"] == 5 and request["model"] == "m"


@pytest.mark.slow  # 2 s
def test_live_calibration_recovers_the_stub_bandwidth(stub: Stub) -> None:
    bandwidth, overhead = 0.4e12, 0.001
    stub.step_seconds = lambda context: overhead + qwen3_read_bytes(context) / bandwidth
    setup = build_setup(get_model_preset("qwen3-8b"), "h100-sxm").setup
    result = calibrate.calibrate_live(stub.url, setup, short_context_tokens=256, long_context_tokens=100_000,
                                      output_tokens=10, timeout_seconds=10)
    # First a request at the short context that is not timed (a server's first steps after it starts
    # are slower), then the two points.
    assert [(len(r["prompt"]), r["max_tokens"]) for r in stub.requests] == [
        (256, calibrate.WARMUP_OUTPUT_TOKENS), (256, 10), (100_000, 10)]
    assert stub.requests[0]["prompt"] == stub.requests[1]["prompt"]
    assert [point.tokens_in_flight for point in result.points] == [256, 100_000]
    assert all(r["model"] == "stub-model" for r in stub.requests)  # discovered from GET /v1/models
    # A sleep overshoots by a scheduling delay; allow each median that much, relative to the
    # difference between the two gaps that the slope of the fit rests on.
    slack_seconds = 0.002
    difference = (qwen3_read_bytes(100_000) - qwen3_read_bytes(256)) / bandwidth
    assert result.effective_bandwidth_bytes_per_second == pytest.approx(bandwidth, rel=2 * slack_seconds / difference)
    # Sleeps only ever overshoot, and a steady overshoot lands in the fitted overhead, not the slope.
    assert overhead - slack_seconds <= result.step_overhead_seconds < stub.step_seconds(256)
    assert result.agrees


def test_live_cli_prints_the_json_keys(stub: Stub, capsys: pytest.CaptureFixture[str]) -> None:
    bandwidth = 0.5e12
    stub.step_seconds = lambda context: qwen3_read_bytes(context) / bandwidth
    argv = ["calibrate", "--url", stub.url, "--short-context", "256", "--long-context", "100000",
            "--tokens", "6", "--model-name", "chosen", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"effective_bandwidth_bytes_per_second", "step_overhead_seconds", "points", "agrees",
            "spread_ratio"} <= set(out)
    assert [p["tokens_in_flight"] for p in out["points"]] == [256, 100_000]
    assert [p["read_bytes"] for p in out["points"]] == [qwen3_read_bytes(256), qwen3_read_bytes(100_000)]
    assert all(p["chunks"] == 6 for p in out["points"])
    # Sleeps overshoot by a scheduling delay (as in the test above): the slope rests on the gaps' difference.
    slack_seconds = 0.002
    difference = (qwen3_read_bytes(100_000) - qwen3_read_bytes(256)) / bandwidth
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(bandwidth, rel=2 * slack_seconds / difference)
    assert [r["model"] for r in stub.requests] == ["chosen"] * 3  # the untimed first request, then the points


def test_an_unreachable_or_stalled_server_fails_with_one_line(stub: Stub, capsys: pytest.CaptureFixture[str]) -> None:
    stub.hang = threading.Event()
    assert main(["calibrate", "--url", stub.url, "--model-name", "m", "--timeout", "0.2"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "timed out" in err and "/v1/completions" in err


def test_itl_points_at_two_batch_sizes_fit_a_per_request_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3-8B, 2,000 tokens per request: 1 request at 9 ms, 16 at 12 ms (about 43 us per request)."""
    assert main(["calibrate", "--itl", "9ms@2000", "--itl", "12ms@32000x16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The points' own bandwidths differ by the per-request cost; the fit reproduces both, so they agree.
    assert out["agrees"] is True and out["agreement_basis"] == "fit_residuals"
    assert out["spread_ratio"] == pytest.approx(0, abs=1e-9)
    kv, weights = 2 * 36 * 8 * 128 * 2, 8.19e9 * 2
    # 9 ms = (W + 2000 kv)/bw + r;  12 ms = (W + 32000 kv)/bw + 16 r
    a1, a2 = weights + 2000 * kv, weights + 32000 * kv
    inverse_bandwidth = (0.012 - 16 * 0.009) / (a2 - 16 * a1)
    assert out["effective_bandwidth_bytes_per_second"] == pytest.approx(1 / inverse_bandwidth, rel=1e-6)
    assert out["per_request_seconds"] == pytest.approx(0.009 - a1 * inverse_bandwidth, rel=1e-6)
    assert out["effective_compute_flops_per_second"] is None
    assert [p["running_requests"] for p in out["points"]] == [1, 16]


def test_a_per_request_cost_past_its_bound_is_not_fitted(capsys: pytest.CaptureFixture[str]) -> None:
    """16 requests at 24 ms against 1 at 9 ms would need 860 us per request, past the 300 us bound: the two
    points cannot separate that from the bandwidth reliably, so it is left out, with a note."""
    assert main(["calibrate", "--itl", "9ms@2000", "--itl", "24ms@32000x16", "--json"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["per_request_seconds"] is None
    assert any("bound" in note for note in out["notes"])
    # Without it the bandwidth alone (least squares through the origin) misses the points by far
    # more than 15%: refused, saying so.
    kv, weights = 2 * 36 * 8 * 128 * 2, 8.19e9 * 2
    a1, a2 = weights + 2000 * kv, weights + 32000 * kv
    inverse_bandwidth = (a1 * 0.009 + a2 * 0.024) / (a1 ** 2 + a2 ** 2)
    worst_miss = max(abs(a * inverse_bandwidth - t) / t for a, t in ((a1, 0.009), (a2, 0.024)))
    assert out["agrees"] is False and out["spread_ratio"] == pytest.approx(worst_miss, rel=1e-6)
    assert f"the fitted terms miss the points by at most {worst_miss:.1%}" in captured.err
    assert "more than 15%" in captured.err
