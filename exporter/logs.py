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
from typing import IO

import structlog

_SHARED_PROCESSORS: list[structlog.types.Processor] = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


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
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                    structlog.processors.format_exc_info, renderer],
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
