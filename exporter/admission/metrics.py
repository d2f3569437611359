"""The admission metric families: decisions by outcome, and the tokens the book accounts to each target.

A handful of samples: the `*MetricFamily` classes' label API reads better here; the per-target
collector (exporter/serve/collector.py) uses raw `Metric` for speed and says why.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter.admission.book import AdmissionBook

# --- metrics -------------------------------------------------------------------------------------


class AdmissionCollector(Collector):
    """Decisions and accounted tokens, fresh families at every scrape.

    # HELP stepbudget_admission_decisions_total Admission decisions ...
    # TYPE stepbudget_admission_decisions_total counter
    stepbudget_admission_decisions_total{decision="admitted",deployment="chat"} 42.0
    # HELP stepbudget_admitted_tokens Tokens the admission budget counts on the target ...
    # TYPE stepbudget_admitted_tokens gauge
    stepbudget_admitted_tokens{deployment="chat",target="10.0.0.5:8000"} 81234.0
    # HELP stepbudget_admission_open_admissions Admissions open now ...
    # TYPE stepbudget_admission_open_admissions gauge
    stepbudget_admission_open_admissions{deployment="chat"} 12.0
    # HELP stepbudget_admission_max_open_admissions The most admissions the book holds open ...
    # TYPE stepbudget_admission_max_open_admissions gauge
    stepbudget_admission_max_open_admissions 100000.0
    """

    def __init__(self, book: AdmissionBook) -> None:
        self._book = book

    def describe(self) -> Iterable[Metric]:
        return list(self._families())

    def generation(self) -> int:
        """The book's version: the cached /metrics page is rebuilt only after an admission change."""
        return self._book.version()

    def collect(self) -> Iterator[Metric]:
        yield from self._families()

    def _families(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "stepbudget_admission_decisions",
            "Admission decisions by the daemon's admission API: admitted, refused (no target has the tokens "
            "left; retry later) or redirected (context above the pools' split: use the long-context pool)",
            labels=["deployment", "decision"])
        for (deployment, decision), count in sorted(self._book.decision_counts().items()):
            decisions.add_metric([deployment, decision], count)
        yield decisions
        accounted = GaugeMetricFamily(
            "stepbudget_admitted_tokens",
            "Tokens the admission budget counts on the target: open admissions (prompt + output limit) plus the "
            "measured tokens in flight no admission accounts for; compare with stepbudget_token_budget_tokens",
            labels=["deployment", "target"])
        for account in sorted(self._book.targets(), key=lambda a: (a.deployment, a.target)):
            accounted.add_metric([account.deployment, account.target], account.accounted_tokens)
        yield accounted
        open_now = GaugeMetricFamily(
            "stepbudget_admission_open_admissions",
            "Admissions open now (admitted, neither released nor past their lease), per deployment: the "
            "admission book's size; a release or a lease's end takes one out at once",
            labels=["deployment"])
        for deployment, count in sorted(self._book.open_admissions().items()):
            open_now.add_metric([deployment], count)
        yield open_now
        yield GaugeMetricFamily(
            "stepbudget_admission_max_open_admissions",
            "The most admissions the book holds open at once, over every deployment; past it admissions "
            "are refused (reason: the admission book is full)",
            value=self._book.max_open_admissions)
