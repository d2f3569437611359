"""The online fit on README's own story, on a running vLLM 0.32.0 (CPU backend): chats, then two long sessions
join with nothing in between, the daemon starting from an uncalibrated description of this host.

One real server, one `stepbudget serve` (the real daemon, as a subprocess, polling every 3 s), one load: 10
chat lanes that start together (128-token prompts, 500 tokens out, so they stay in step and most windows
between their turns compute no prompt token), then at JOIN_SECONDS two sessions of 3,000-token prompts join
and decode beside them. Nothing between the two: the fit has only seen the chats when the sessions join,
and its holdout keeps each scored window out of the fit that predicts it.

Every assertion compares what the daemon exported with what the clients measured (their own token gaps) or
with the daemon's own measured step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from exporter.demo import read_metrics, start_daemon, stop_daemon, target_views, wait_until_ready
from exporter.real_vllm.loadgen import LoadGenerator, Phase, Stream
from tests.support.client_truth import clients_mean_gap_ratio
from tests.support.real_vllm import host_device, serving
from tests.support.servers import free_port

pytestmark = pytest.mark.real_engine

POLL_SECONDS = 3.0
HOLDOUT_SECONDS = 30.0
MIN_WINDOWS = 12
MAX_MODEL_LEN = 4096
CHATS = Phase("chats", 10, 128, 500)
SESSIONS = Phase("sessions", 2, 3000, 900)
JOIN_SECONDS = 100.0
END_SECONDS = 190.0
DRIFT_RATIO = 0.15  # StepBudgetPredictionDrift's threshold
FAR_RATIO = 0.25


@dataclass(frozen=True)
class Poll:
    at_seconds: float  # since the chats started
    values: dict[str, float]
    fit_in_use: bool  # some term of the deployment's setup is the online fit's

    @property
    def decode_only(self) -> bool:
        return self.values.get("prefill_tokens_per_step", 0.0) == 0.0


@dataclass
class Run:
    polls: list[Poll]
    streams: list[Stream]
    started_at_seconds: float


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    workdir = tmp_path_factory.mktemp("online-fit")
    with serving(workdir, max_model_len=MAX_MODEL_LEN) as server:
        port = free_port()
        config = {
            "listen": f"127.0.0.1:{port}", "poll_interval": f"{POLL_SECONDS:g}s", "timeout": "10s",
            # The holdout must outlast the drift alert's `for` and two polls.
            "alerting": {"drift_for": f"{HOLDOUT_SECONDS - 2 * POLL_SECONDS:g}s"},
            "deployments": [{
                "name": "tiny", "model": str(server.settings.model_dir / "config.json"), "gpu": host_device(),
                "online_calibration": {"history": "1h", "holdout": f"{HOLDOUT_SECONDS:g}s",
                                       "min_windows": MIN_WINDOWS},
                "targets": {"static": [server.metrics_url]}}],
        }
        config_path = workdir / "stepbudget.yaml"
        config_path.write_text(yaml.safe_dump(config))
        daemon = start_daemon(config_path, workdir / "daemon.log")
        load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=11)
        try:
            wait_until_ready(f"http://127.0.0.1:{port}", daemon, workdir / "daemon.log")
            yield _drive(load, f"http://127.0.0.1:{port}/metrics")
        finally:
            load.stop_all()
            load.join(300)
            stop_daemon(daemon)


def _drive(load: LoadGenerator, metrics_url: str) -> Run:
    started = time.time()
    load.start(CHATS)
    polls: list[Poll] = []
    joined = False
    while (now := time.time() - started) < END_SECONDS:
        if not joined and now >= JOIN_SECONDS:
            load.start(SESSIONS)
            joined = True
        time.sleep(POLL_SECONDS)
        samples = read_metrics(metrics_url)
        views = target_views(samples)
        if not views:
            continue
        fit_in_use = any(sample.labels.get("source") == "online" for sample in samples)
        polls.append(Poll(time.time() - started, views[0].values, fit_in_use))
    load.stop_all()
    assert load.join(300)
    assert not load.errors(), load.errors()
    return Run(polls, load.streams, started)


def _joined_decode_only(run: Run) -> list[Poll]:
    """Decode-only polls whose whole window lies after the sessions joined, scored by a fit in use."""
    return [poll for poll in run.polls if poll.at_seconds - POLL_SECONDS > JOIN_SECONDS and poll.decode_only
            and poll.fit_in_use and "prediction_error_ratio" in poll.values]


def test_the_fit_replaced_the_seed_before_the_sessions_joined(run: Run) -> None:
    """From chats alone: MIN_WINDOWS windows older than the holdout, about 70 s in."""
    first = next((poll for poll in run.polls if poll.fit_in_use), None)
    assert first is not None and first.at_seconds < JOIN_SECONDS, [(p.at_seconds, p.fit_in_use) for p in run.polls]


def test_the_joined_windows_step_as_the_clients_measured(run: Run) -> None:
    """The measured step the predictions are scored against is the clients' own mean token gap over the
    scored windows (within 5%, `clients_mean_gap_ratio`): the score is of the prediction, not of the
    reading. The daemon's window ends at its own poll, up to a poll before this test reads it."""
    windows = []
    for poll in _joined_decode_only(run):
        end = run.started_at_seconds + poll.at_seconds
        gaps = [gap for stream in run.streams for gap in stream.token_gaps_in(end - POLL_SECONDS, end)]
        windows.append((poll.values["measured_step_seconds"], gaps))
    assert len(windows) >= 3 and sum(len(gaps) for _, gaps in windows) >= 150, windows
    assert abs(clients_mean_gap_ratio(windows)) <= 0.05, [(step, len(gaps)) for step, gaps in windows]


def test_decode_only_windows_after_the_join_are_predicted_within_the_drift_alerts_fifteen_percent(run: Run) -> None:
    """The decode-only windows of the joined load, which the fit never absorbed (its holdout), within the drift
    alert's 15% of the measured step at the median, and three in four within 25%: the fit learned the bytes'
    rate from the chats, and the sessions' contexts are read, not learned. A model that missed what the
    sessions read is off in every window: before the step was read off each request's context, the whole
    phase read 30-45% low, which fails both. 10% does not hold on this CPU: the joined windows read low at the
    median in every run (a CI run -7.7%; runs here -11.6% and -13.1%, 5 and 6 windows of about 21 past 20%;
    a quiet `make test` run within 10%). One sign each time reads as the sessions' 3,000-token contexts
    costing this CPU more per byte than the chats' did (the host's own drift moves both ways), which the fit
    cannot learn from the chats before the sessions join."""
    scored = _joined_decode_only(run)
    assert len(scored) >= 5, [(p.at_seconds, p.decode_only, p.fit_in_use) for p in run.polls]
    errors = [(round(poll.at_seconds), round(poll.values["prediction_error_ratio"], 3),
               poll.values["tokens_in_flight"]) for poll in scored]
    shown = f"(at s, error, tokens in flight): {errors}"  # every window, so a failure says which
    assert abs(statistics.median(error for _, error, _ in errors)) <= DRIFT_RATIO, shown
    assert sum(abs(error) > FAR_RATIO for _, error, _ in errors) <= len(errors) / 4, shown
