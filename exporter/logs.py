"""Structured logs: one JSON object per line (console lines on a TTY), stdlib loggers bridged in.

Why JSON: in Kubernetes the log pipeline indexes fields, so a 2 a.m. search for
`target="10.0.3.7:8000"` finds every line about that server. Failures carry `target` and `reason`.
apscheduler's and urllib3's stdlib logs go through the same renderer (ProcessorFormatter bridge);
apscheduler's per-run INFO chatter is silenced, its WARNINGs (a poll still running when the next one
is due: "maximum number of running instances reached") are kept.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import IO, Any

import structlog
from urllib3.exceptions import InsecureRequestWarning

from exporter.redaction import redact_event

_SHARED_PROCESSORS: list[structlog.types.Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


class EveryMinuteAtMost(logging.Filter):
    """Passes a record containing `marker` at most once per `period_seconds`, saying how many were held.

    apscheduler warns at every skipped run while a poll overruns its interval (at 1 s intervals,
    once a second): the first line says it, the rest would bury everything else.
    """

    def __init__(self, marker: str, period_seconds: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._marker, self._period, self._clock = marker, period_seconds, clock
        self._last: float | None = None
        self._held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self._marker not in record.getMessage():
            return True
        now = self._clock()
        if self._last is not None and now - self._last < self._period:
            self._held += 1
            return False
        if self._held:
            record.msg = f"{record.getMessage()} (and {self._held} more like it in the last {self._period:g}s)"
            record.args = None
        self._last, self._held = now, 0
        return True


# A client that resets or drops its connection mid-request or between keep-alive requests: routine
# (a scraper closing its connection, a load generator stopped), not a fault of the server.
_DISCONNECTS = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
_http_log = structlog.get_logger("stepbudget.http")


class StructuredHTTPServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer whose request errors are log lines. socketserver's own handle_error prints
    a raw traceback to stderr for any error while a request is handled (CPython 3.11
    Lib/socketserver.py l. 371-383), a client resetting its keep-alive connection included: lines of
    traceback in a JSON log stream, for something routine. Here a disconnect is one debug line, and
    anything else one error line with its traceback."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        client = f"{client_address[0]}:{client_address[1]}"  # (host, port), or IPv6's (host, port, flow, scope)
        if isinstance(error, _DISCONNECTS):
            # Where logging is configured (the daemon) this is hidden at the default INFO. A process that
            # never configures it (stepbudget simulate, the demo) gets structlog's default, which prints
            # every level to stdout: there a routine disconnect is no line at all.
            if structlog.is_configured():
                _http_log.debug("client_disconnected", client=client, reason=f"{type(error).__name__}: {error}")
        else:
            _http_log.exception("http_request_failed", client=client)


def say_tls_verification_is_off(logger: Any, target: str) -> None:
    """One structured line per server whose certificate is not checked (`insecure_skip_verify`),
    in place of urllib3's InsecureRequestWarning: a bare Python warning on stderr, in the middle of
    JSON logs, naming no target."""
    warnings.filterwarnings("ignore", category=InsecureRequestWarning)
    logger.warning("tls_verification_disabled", target=target,
                   reason="insecure_skip_verify is set: the server's certificate is not checked")


def use_json(log_format: str, stream: IO[str]) -> bool:
    if log_format == "auto":
        return not (hasattr(stream, "isatty") and stream.isatty())
    return log_format == "json"


def configure_logging(log_format: str = "auto", *, level: int = logging.INFO, stream: IO[str] | None = None) -> None:
    """Route structlog and stdlib logging to one handler on `stream` (default stderr)."""
    stream = stream or sys.stderr
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json(log_format, stream)
        else structlog.dev.ConsoleRenderer(colors=hasattr(stream, "isatty") and stream.isatty())
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=_SHARED_PROCESSORS,
        # Credentials redacted last, tracebacks included (exporter/redaction.py): the sources redact what
        # they log; this is the backstop for a URL that reaches a line some other way.
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, redact_event, renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # apscheduler logs every run at INFO ("Running job ...", "executed successfully"): noise at
    # a 15 s interval. WARNING keeps "maximum number of running instances reached" (a slow poll).
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
    scheduler_log = logging.getLogger("apscheduler.scheduler")
    for old_filter in [f for f in scheduler_log.filters if isinstance(f, EveryMinuteAtMost)]:
        scheduler_log.removeFilter(old_filter)
    scheduler_log.addFilter(EveryMinuteAtMost("maximum number of running instances reached"))
    # uvicorn (the daemon's HTTP server) warns at every unreadable request and every 503 past the
    # connection cap: a hostile client could fill the log with them. Its errors (a bug) still show.
    logging.getLogger("uvicorn").setLevel(logging.ERROR)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    structlog.configure(
        processors=[*_SHARED_PROCESSORS, structlog.processors.StackInfoRenderer(),
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
