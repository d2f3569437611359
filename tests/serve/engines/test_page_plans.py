"""A page read again reads exactly as the first time: the reader remembers each line's head
(exposition.py) and each page layout's selection (families.py's Plan); neither may change a reading.
Every stored page, and pages whose values were changed to anything (NaN, negative, -0.0, +Inf,
histograms that stop adding up), read the same warm as with no memory at all."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.serve import engines
from exporter.serve.engines import PageError, PageReading, exposition, read_page, wanted_names
from tests.support.tools import DATA

PAGES = sorted([*DATA.rglob("*.txt"), *DATA.rglob("*.prom")])  # every stored page
SINGLE = (DATA / "vllm" / "vllm_v1_RECONSTRUCTED_single_process.txt").read_text()


def _outcome(text: str, kind: str) -> PageReading | str:
    try:
        return read_page(text, kind)
    except PageError as error:
        return f"PageError: {error}"


def cold(text: str, kind: str) -> PageReading | str:
    """The page read with nothing remembered: every line read in full, every selection made by `select`."""
    remember = exposition._remember
    exposition._HEADS.clear()
    engines._PLANS.clear()
    exposition._remember = lambda *args: None
    try:
        return _outcome(text, kind)
    finally:
        exposition._remember = remember


@pytest.fixture(autouse=True)
def forget() -> Iterator[None]:
    yield
    exposition._HEADS.clear()
    engines._PLANS.clear()


@pytest.mark.parametrize("path", PAGES, ids=lambda path: path.name)
@pytest.mark.parametrize("kind", ["auto", "vllm", "sglang", "tgi"])
def test_every_stored_page_reads_the_same_warm(path: Path, kind: str) -> None:
    text = path.read_text()
    expected = cold(text, kind)
    for _ in range(3):
        assert repr(_outcome(text, kind)) == repr(expected)


def test_a_plain_page_is_planned() -> None:
    first = read_page(SINGLE)
    assert any(plan is not None for plan in engines._PLANS.values()) is False  # first read: no layout yet
    assert read_page(SINGLE) == first
    assert any(plan is not None for plan in engines._PLANS.values())
    assert read_page(SINGLE) == first


def with_values(text: str, values: dict[int, float]) -> str:
    """`text` with the values of some wanted samples (by their order on the page) replaced."""
    wanted = wanted_names("auto")
    lines = text.split("\n")
    turn = 0
    for number, line in enumerate(lines):
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted and " " in line:
            if turn in values:
                value = values[turn]
                written = ("NaN" if math.isnan(value) else "+Inf" if value == math.inf
                           else "-Inf" if value == -math.inf else repr(value))
                lines[number] = line.rsplit(" ", 1)[0] + " " + written
            turn += 1
    return "\n".join(lines)


VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.0, 7.0, 1e9, -1.0]))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 60), VALUES, min_size=1, max_size=4))
@pytest.mark.slow  # 1.4 s
def test_fuzz_changed_values_read_the_same_through_the_plan(values: dict[int, float]) -> None:
    changed = with_values(SINGLE, values)
    expected = cold(changed, "auto")
    read_page(SINGLE)
    read_page(SINGLE)  # the layout is planned from the original values
    assert repr(_outcome(changed, "auto")) == repr(expected)


ITL_BUCKET = 'vllm:inter_token_latency_seconds_bucket{engine="0",le="%s",model_name="Qwen/Qwen3-8B"}'


@pytest.mark.parametrize("change", ["buckets out of order", "an edge twice", "no +Inf bucket"])
def test_a_histogram_planned_from_odd_edges_reads_as_cold(change: str) -> None:
    """The plan sorts and checks a histogram's edges once; edges out of page order are sorted as
    histogram_from_samples sorts them, and edges that fail its checks leave the wording to `select`."""
    lines = SINGLE.split("\n")
    at = [number for number, line in enumerate(lines) if line.startswith(ITL_BUCKET.split("{")[0] + "{")]
    if change == "buckets out of order":
        lines[at[0]], lines[at[1]] = lines[at[1]], lines[at[0]]
    elif change == "an edge twice":
        lines[at[1]] = lines[at[1]].replace('le="0.025"', 'le="0.0250"')
        lines[at[2]] = lines[at[2]].replace('le="0.05"', 'le="0.025"')
    else:
        del lines[at[-1]]
    page = "\n".join(lines)
    expected = cold(page, "vllm")
    for _ in range(3):
        assert repr(_outcome(page, "vllm")) == repr(expected)
    assert any(plan is not None for plan in engines._PLANS.values()), "the warm reads went through a plan"
    if change == "buckets out of order":
        assert isinstance(expected, PageReading)
        histogram = expected.snapshots[0].inter_token_latency
        assert histogram is not None
        edges = [edge for edge, _ in histogram.buckets]
        assert edges == sorted(edges) and edges[-1] == math.inf
    else:
        assert isinstance(expected, PageReading) and expected.snapshots[0].inter_token_latency is None
