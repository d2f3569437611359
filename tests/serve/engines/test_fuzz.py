"""Hostile pages, fuzzed: real captures of every engine cut, mutated and spliced, and random text.

Whatever a server sends, `read_page` returns a reading or raises PageError (nothing else escapes),
and nothing NaN, infinite or negative reaches the export as a valid value: each fuzzed page is
driven through the whole path the daemon uses (adapter -> window over two polls -> reading ->
collector -> the exposition text Prometheus would scrape, parsed back with prometheus_client).
"""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.serve.collector import make_registry
from exporter.serve.config import config_from_mapping
from exporter.serve.derivation import derive_reading
from exporter.serve.discovery import Target
from exporter.serve.engines import ADAPTERS, PageError, read_page
from exporter.serve.snapshot import Histogram, Snapshot
from exporter.serve.window import compute_window
from tests.support.tools import DATA

# The captures of every era, and the pages the engines' own metrics code rendered (data-parallel
# engines, SGLang's priority and is_streaming shares, vLLM's summed blocks): the reader's every path.
CAPTURES = {path.relative_to(DATA).as_posix(): path.read_text(encoding="utf-8")
            for folder, pattern in (("vllm", "*.txt"), ("sglang", "*.txt"), ("tgi", "*.txt"), ("genuine", "*.prom"))
            for path in sorted((DATA / folder).glob(pattern))}
KINDS = ("auto", *ADAPTERS)
# Values a broken or hostile exporter writes where a number belongs.
BAD_VALUES = ("NaN", "+Inf", "-Inf", "-1", "-0.5", "1e309", "-1e309", "nan", "0x10", "1_000", "", "\"1\"",
              "9" * 400, "1e-400", "-0", "inf")
CONFIG = config_from_mapping({"deployments": [
    {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": ["http://127.0.0.1:1/metrics"]}},
]})
DEPLOYMENT = CONFIG.deployments[0]
TARGET = Target("chat", "http://127.0.0.1:1/metrics", "127.0.0.1:1")
# The one exported family that may be negative: (predicted - measured) / measured.
SIGNED = {"stepbudget_prediction_error_ratio"}


@st.composite
def mutated_page(draw: st.DrawFn) -> str:
    """A real capture with a handful of line-level and character-level edits."""
    text = CAPTURES[draw(st.sampled_from(sorted(CAPTURES)))]
    lines = text.split("\n")
    for _ in range(draw(st.integers(0, 6))):
        if not lines:
            break
        where = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(("value", "delete", "duplicate", "insert", "chars", "label")))
        line = lines[where]
        if action == "value" and " " in line:
            lines[where] = line.rsplit(" ", 1)[0] + " " + draw(st.sampled_from(BAD_VALUES))
        elif action == "delete":
            del lines[where]
        elif action == "duplicate":
            lines.insert(where, line)
        elif action == "insert":
            lines.insert(where, draw(st.text(max_size=80)))
        elif action == "chars" and line:
            position = draw(st.integers(0, len(line) - 1))
            lines[where] = line[:position] + draw(st.text(min_size=1, max_size=3)) + line[position + 1:]
        elif action == "label" and "{" in line:
            # A label value with quotes, escapes, newlines and non-ASCII text spliced in.
            value = draw(st.text(max_size=12)).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            lines[where] = line.replace("{", '{zz="' + value + '",', 1)
    page = "\n".join(lines)
    if draw(st.booleans()):
        page = page[: draw(st.integers(0, len(page)))]  # cut off anywhere, as a dropped connection would
    return page


def read_or_page_error(text: str, kind: str) -> tuple[Snapshot, ...]:
    try:
        return read_page(text, kind).snapshots
    except PageError as error:
        assert error.reason
        return ()


def assert_snapshot_clean(snapshot: Snapshot) -> None:
    for spec in fields(snapshot):
        value = getattr(snapshot, spec.name)
        if isinstance(value, float) or (isinstance(value, int) and not isinstance(value, bool)):
            assert math.isfinite(value) and value >= 0, (spec.name, value)
        if isinstance(value, Histogram):
            counts = [count for _, count in value.buckets]
            assert all(math.isfinite(c) and c >= 0 for c in counts)
            assert counts == sorted(counts) and counts[-1] == value.count
            assert math.isfinite(value.sum)


def exported_values(first: tuple[Snapshot, ...], second: tuple[Snapshot, ...]) -> list[tuple[str, float]]:
    """Two polls through window, reading and collector; every sample of the rendered export."""
    previous = {(s.model_name, s.engine): s for s in first}
    readings = []
    for snapshot in second:
        window = compute_window(previous.get((snapshot.model_name, snapshot.engine)), snapshot)
        readings.append(derive_reading(DEPLOYMENT, TARGET, snapshot, window, now_seconds=1.8e9,
                                       scrape_duration_seconds=0.01))
    text = generate_latest(make_registry(lambda: readings, CONFIG.deployments)).decode()
    return [(sample.name, sample.value) for family in text_string_to_metric_families(text) for sample in family.samples]


def assert_export_clean(samples: list[tuple[str, float]]) -> None:
    for name, value in samples:
        assert not math.isnan(value) and math.isfinite(value), (name, value)
        if name in SIGNED:
            assert value > -1, (name, value)  # predicted > 0, so (p - m) / m > -1
        else:
            assert value >= 0, (name, value)
        if name.endswith("_ratio") and name not in SIGNED and name != "stepbudget_token_budget_utilization_ratio":
            assert value <= 1, (name, value)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page=mutated_page(), kind=st.sampled_from(KINDS))
def test_mutated_captures_read_or_refuse_and_never_carry_bad_numbers(page: str, kind: str) -> None:
    for snapshot in read_or_page_error(page, kind):
        assert_snapshot_clean(snapshot)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=600), st.binary(max_size=600)), kind=st.sampled_from(KINDS))
def test_random_text_and_bytes_read_or_refuse(text: str | bytes, kind: str) -> None:
    try:
        reading = read_page(text, kind)  # type: ignore[arg-type]  # hostile input on purpose: bytes too
    except PageError:
        return
    for snapshot in reading.snapshots:
        assert_snapshot_clean(snapshot)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=mutated_page(), second=mutated_page(), clean=st.one_of(st.none(), st.sampled_from(sorted(CAPTURES))))
@pytest.mark.slow  # 1.4 s
def test_two_fuzzed_polls_export_nothing_nan_or_negative(first: str, second: str, clean: str | None) -> None:
    """Mutated pages as the window's earlier and later poll (or a clean capture as the earlier one)."""
    earlier = CAPTURES[clean] if clean is not None else first
    first_snapshots = read_or_page_error(earlier, "auto")
    second_snapshots = read_or_page_error(second, "auto")
    assert_export_clean(exported_values(first_snapshots, second_snapshots))


@pytest.mark.slow  # 2 s
def test_every_capture_exports_cleanly_against_itself_and_each_mutation_kind() -> None:
    """The unmutated captures (both polls the same page) and each bad value in every value slot of one."""
    for text in CAPTURES.values():
        snapshots = read_or_page_error(text, "auto")
        assert_export_clean(exported_values(snapshots, snapshots))
    base = CAPTURES["vllm/vllm_v1_RECONSTRUCTED_single_process.txt"]
    clean = read_or_page_error(base, "vllm")
    lines = base.split("\n")
    for number, line in enumerate(lines):
        if not line.startswith("vllm:") or " " not in line:
            continue
        for bad in ("NaN", "-1", "+Inf"):
            edited = "\n".join([*lines[:number], line.rsplit(" ", 1)[0] + " " + bad, *lines[number + 1:]])
            later = read_or_page_error(edited, "vllm")
            for snapshot in later:
                assert_snapshot_clean(snapshot)
            assert_export_clean(exported_values(clean, later))
            assert_export_clean(exported_values(later, clean))
