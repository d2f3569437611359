"""A real Prometheus holding a daemon's past export: what a restarted daemon reads its fit back from.

The daemon's pages, each rendered at a past moment, are written as one OpenMetrics file with sample
timestamps, turned into TSDB blocks by `promtool tsdb create-blocks-from openmetrics` (Prometheus's
own backfill) and served by a `prometheus` started on those blocks. The queries then run against
Prometheus's real range-query semantics (steps, lookback, label matching) in seconds, where
scraping the same history live would take as long as the history.

Backfilled series carry no staleness markers (a live Prometheus writes one when a series leaves a
scrape), so a series that stops lingers for the 5-minute lookback; the daemon's families that
matter here keep their series from poll to poll.
"""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from tests.support.e2e.stack import start_process, wait_for
from tests.support.servers import free_port
from tests.support.tools import require_tool

SCRAPE = {"instance": "stepbudget-0:9400", "job": "stepbudget"}  # what a scrape of the daemon adds


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def openmetrics_history(pages: Iterable[tuple[float, str]], scrape: Mapping[str, str] = SCRAPE) -> str:
    """The gauge (and info) samples of each (unix time, /metrics text) page, stamped with its time and
    the scrape's labels, as one OpenMetrics document (each family once, its samples in time order)."""
    families: dict[str, list[str]] = {}
    for moment, text in sorted(pages, key=lambda page: page[0]):
        for family in text_string_to_metric_families(text):
            if family.type != "gauge":
                continue  # counters, histograms: nothing the fit reads
            lines = families.setdefault(family.name, [])
            for sample in family.samples:
                if not math.isfinite(sample.value):
                    continue
                labels = ",".join(f'{name}="{_escape(value)}"' for name, value in sorted({**sample.labels,
                                                                                          **scrape}.items()))
                lines.append(f"{sample.name}{{{labels}}} {sample.value!r} {moment:.3f}")
    out = []
    for name, lines in families.items():
        out.append(f"# TYPE {name} gauge")
        out.extend(lines)
    out.append("# EOF")
    return "\n".join(out) + "\n"


@contextmanager
def prometheus_with_history(document: str, work: Path) -> Iterator[str]:
    """A real Prometheus on 127.0.0.1 serving `document` (openmetrics_history's), scraping nothing;
    its base URL while the context lasts."""
    promtool, prometheus = require_tool("promtool"), require_tool("prometheus")
    source, tsdb = work / "history.om", work / "tsdb"
    source.write_text(document)
    subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(source), str(tsdb)], check=True,
                   capture_output=True, timeout=120)
    config = work / "prometheus.yml"
    config.write_text("global: {}\n")
    address = f"127.0.0.1:{free_port()}"
    process = start_process("prometheus", [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
                                           f"--web.listen-address={address}"], work)
    try:
        url = f"http://{address}"
        wait_for(lambda: requests.get(f"{url}/-/ready", timeout=2).status_code == 200, timeout_seconds=30,
                 what="prometheus ready", state=process.log_tail)
        yield url
    finally:
        process.stop()
