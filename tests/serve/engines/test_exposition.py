"""The Prometheus text reader: exact names, label escapes, garbage, truncation, and no stray exceptions."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.serve.engines import PageError, read_page
from exporter.serve.engines.exposition import histogram_from_samples, parse_labels, parse_value, scan_page
from tests.support.tools import DATA

REAL_PAGE = (DATA / "vllm" / "vllm_v1_RECONSTRUCTED_single_process.txt").read_text()


def test_selects_exact_sample_names_only() -> None:
    page = (
        'vllm:prompt_tokens_total{model_name="m"} 10.0\n'
        "# HELP vllm:prompt_tokens_cached_total HELP and TYPE lines may sit anywhere\n"
        "# TYPE vllm:prompt_tokens_cached_total counter\n"
        'vllm:prompt_tokens_cached_total{model_name="m"} 7.0\n'
        'vllm:prompt_tokens_by_source_total{model_name="m",source="local"} 3.0\n'
        'vllm:prompt_tokens_created{model_name="m"} 1.7959705e+09\n'
    )
    scan = scan_page(page, frozenset({"vllm:prompt_tokens_total"}))
    assert scan.samples == {"vllm:prompt_tokens_total": [({"model_name": "m"}, 10.0)]}
    assert scan.sample_lines == 4  # the others are read as samples, just not kept


def test_label_values_with_escapes_commas_braces_and_unicode() -> None:
    # On the wire: \" is a quote, \\ a backslash, \n a newline; , and } inside quotes are plain text.
    line = 'm{a="say \\"hi\\"",b="C:\\\\dir",c="two\\nlines",d="x,y}z",e="Grüße ✓"} 1.5'
    parsed = parse_labels(line, 1)
    assert parsed is not None
    labels, end = parsed
    assert labels == {"a": 'say "hi"', "b": "C:\\dir", "c": "two\nlines", "d": "x,y}z", "e": "Grüße ✓"}
    assert line[end:] == " 1.5"


def test_label_sets_tolerate_spacing_trailing_comma_and_any_order() -> None:
    page = 'x{ b = "2" , a="1", } 3 1712345678000\nx{} 4\nx 5\n'
    scan = scan_page(page, frozenset({"x"}))
    assert [labels for labels, _ in scan.samples["x"]] == [{"b": "2", "a": "1"}, {}]
    # the timestamp is ignored, and the duplicate unlabelled series keeps the last value
    assert [value for _, value in scan.samples["x"]] == [3.0, 5.0]
    assert any("duplicate series" in problem for problem in scan.problems)


@pytest.mark.parametrize(
    "token, expected",
    [("NaN", math.nan), ("+Inf", math.inf), ("-Inf", -math.inf), ("1.5e+09", 1.5e9), ("-2", -2.0), (".5", 0.5)],
)
def test_values_as_prometheus_writes_them(token: str, expected: float) -> None:
    value = parse_value(token)
    assert value is not None
    assert (math.isnan(value) and math.isnan(expected)) or value == expected


@pytest.mark.parametrize("token", ["1_000", "infinity", "0x10", "abc", ""])
def test_values_python_accepts_but_prometheus_does_not_write(token: str) -> None:
    assert parse_value(token) is None


# The value grammar of the text format (exposition_formats.md: Go's ParseFloat spellings that
# Prometheus writes), as a regular expression: parse_value must take exactly these tokens.
GRAMMAR = re.compile(r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[Ii]nf|NaN|nan)")
TOKEN_PARTS = st.sampled_from(["0", "1", "9", ".", "e", "E", "+", "-", "_", " ", "\t", "\r", "Inf", "inf", "NaN",
                               "nan", "INF", "infinity", "x", "\u0661", "\uff11", "1e999", "0x1", "j"])


@settings(max_examples=3000, deadline=None)
@given(st.lists(TOKEN_PARTS, max_size=6).map("".join))
@pytest.mark.slow  # 2 s
def test_values_are_exactly_the_grammars(token: str) -> None:
    expected = float(token) if GRAMMAR.fullmatch(token) else None
    value = parse_value(token)
    if expected is None or value is None:
        assert value is expected, token
    else:
        assert value == expected or (math.isnan(value) and math.isnan(expected)), token


def test_malformed_lines_are_skipped_and_counted() -> None:
    page = 'good{a="1"} 1\nbad{a="1" 2\n$ curl http://x/metrics\ngood{a="2"} 3\n'
    scan = scan_page(page, frozenset({"good", "bad"}))
    assert [value for _, value in scan.samples["good"]] == [1.0, 3.0]
    assert "bad" not in scan.samples
    assert scan.malformed_lines == 2
    assert scan.problems == ["2 malformed line(s) skipped (first at line 2)"]


def test_byte_order_mark_does_not_hide_the_first_sample() -> None:
    scan = scan_page('\ufeffx{a="1"} 2\n', frozenset({"x"}))
    assert scan.samples == {"x": [({"a": "1"}, 2.0)]}


def test_last_line_without_newline_is_dropped_as_cut_off() -> None:
    # "0.125" cut to "0.12" would be misread; a page ends with a newline, so the stub is dropped.
    scan = scan_page('u{e="0"} 1\nu{e="1"} 0.12', frozenset({"u"}))
    assert scan.samples["u"] == [({"e": "0"}, 1.0)]
    assert any("truncated" in problem for problem in scan.problems)


@pytest.mark.parametrize(
    "page, reason",
    [
        ("", "empty page"),
        ("  \n\n", "empty page"),
        ("<!DOCTYPE html><html><body>502 Bad Gateway</body></html>", "not Prometheus text"),
        ("\n  <html><head></head></html>", "not Prometheus text"),
        ("\x1f\x8b\x08\x00\x00\x00\x00\x00" + "garbage" * 10, "not Prometheus text"),
        ('{"error": "not found"}\n', "not Prometheus text"),
        ("process_open_fds 6.0\n", "no known engine metrics"),
        ("Not Found\n", "not Prometheus text"),
        ("# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n", "no samples"),
    ],
)
def test_unusable_pages_raise_page_error_with_a_reason(page: str, reason: str) -> None:
    with pytest.raises(PageError) as caught:
        read_page(page)
    assert caught.value.reason == reason


def test_bytes_with_invalid_utf8_are_garbage_not_a_crash() -> None:
    with pytest.raises(PageError) as caught:
        read_page(bytes(range(256)) * 4)  # type: ignore[arg-type]  # bytes on purpose: refused as garbage
    assert caught.value.reason == "not Prometheus text"


def test_unknown_server_kind_is_a_page_error() -> None:
    with pytest.raises(PageError) as caught:
        read_page(REAL_PAGE, kind="trtllm")
    assert caught.value.reason == "unknown server kind"


def test_histogram_checks() -> None:
    inf = math.inf
    complete, why = histogram_from_samples([(inf, 4.0), (0.1, 1.0), (0.2, 3.0)], 4.0, 0.5)
    assert why == "" and complete is not None
    assert complete.buckets == ((0.1, 1.0), (0.2, 3.0), (inf, 4.0))  # sorted by edge
    assert histogram_from_samples([(0.1, 1.0), (0.2, 3.0)], 4.0, 0.5)[1].startswith("incomplete (no +Inf")
    assert histogram_from_samples([(0.1, 1.0), (inf, 4.0)], None, 0.5)[1].startswith("incomplete (no _count")
    assert histogram_from_samples([(0.1, 3.0), (0.2, 1.0), (inf, 4.0)], 4.0, 0.5)[1] == "buckets are not cumulative"
    assert "differs from _count" in histogram_from_samples([(0.1, 1.0), (inf, 4.0)], 5.0, 0.5)[1]
    assert "NaN" in histogram_from_samples([(0.1, math.nan), (inf, 4.0)], 4.0, 0.5)[1]
    assert "NaN" in histogram_from_samples([(0.1, 1.0), (inf, 4.0)], 4.0, inf)[1]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=400))
def test_fuzz_any_text_gives_a_reading_or_page_error(text: str) -> None:
    try:
        reading = read_page(text)
    except PageError as error:
        assert error.reason
        return
    assert reading.kind in ("vllm", "sglang", "tgi")


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(min_value=0, max_value=len(REAL_PAGE)),
       flips=st.lists(st.tuples(st.integers(0, len(REAL_PAGE) - 1), st.characters()), max_size=6))
def test_fuzz_cut_and_corrupted_real_pages(cut: int, flips: list[tuple[int, str]]) -> None:
    chars = list(REAL_PAGE[:cut])
    for position, char in flips:
        if position < len(chars):
            chars[position] = char
    try:
        reading = read_page("".join(chars))
    except PageError:
        return
    for snapshot in reading.snapshots:
        for name in ("requests_running", "requests_waiting", "kv_cache_usage_ratio", "prompt_tokens_total"):
            value = getattr(snapshot, name)
            assert value is None or (math.isfinite(value) and value >= 0)


@pytest.mark.parametrize("name", ["vllm/vllm_v1_RECONSTRUCTED_single_process.txt",
                                  "vllm/vllm_v1_RECONSTRUCTED_multiprocess.txt",
                                  *sorted(path.relative_to(DATA).as_posix() for path in DATA.glob("genuine/*.prom"))])
def test_agrees_with_prometheus_client_parser_on_every_sample(name: str) -> None:
    """Every sample of the page, read by this reader and by prometheus_client's own parser; the
    genuine pages were written by prometheus_client itself, through vLLM's and SGLang's own code."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (DATA / name).read_text()
    theirs = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    scan = scan_page(text, frozenset(sample_name for sample_name, _ in theirs))
    ours = {(n, tuple(sorted(labels.items()))): value for n, series in scan.samples.items() for labels, value in series}
    assert ours == theirs
    assert scan.problems == []


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True), st.text(max_size=30), max_size=5))
def test_label_values_round_trip_through_prometheus_escaping(labels: dict[str, str]) -> None:
    # Escaping as prometheus_client's exposition writes it: backslash, newline, quote.
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    line = "m{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels.items()) + "} 1"
    parsed = parse_labels(line, 1)
    assert parsed is not None
    assert parsed[0] == labels


def _cold_scan(text: str, wanted: frozenset[str]) -> tuple[object, ...]:
    """The page read by a reader that remembers nothing (every line read in full)."""
    from exporter.serve.engines import exposition

    remember = exposition._remember
    exposition._HEADS.clear()
    exposition._remember = lambda *args: None
    try:
        return _scan_facts(scan_page(text, wanted))
    finally:
        exposition._remember = remember


def _scan_facts(scan: object) -> tuple[object, ...]:
    return (repr(scan.samples), scan.problems, scan.sample_lines, scan.malformed_lines)  # type: ignore[attr-defined]  # both scan kinds have these fields


TRICKY = (
    'x{a="1"} 1\n'
    'x{a="1"} 2\n'                      # a duplicate after a remembered head
    'x{a="2"} 3 1712345678000\n'        # a timestamp
    'x{a="3"} 4 \n'                     # trailing space: the head is then the whole sample
    "x 5\n"
    "x  6\n"                            # two spaces
    'x{a="4"} }\n'                      # a brace where the value goes
    'x{a="5"}\t7\n'                     # a tab before the value
    'x{a="6"} 1_0\n'                    # float() takes it, Prometheus does not write it
    "y 1\n"
    "y \n"                              # an unwanted name, then only a space
    "_y 1\n"
    "_y \n"                             # a name that starts with "_" is read stripped
    "  x{a=\"7\"} 8\n"                  # leading whitespace
    "y{b=\"1\"} NaN\n"
    "# x 9\n"
    "\n"
    "x{a=\"8\" 9\n"                     # unclosed label set
    'x{a="9",} 10\n'
)


@pytest.mark.parametrize("wanted", [frozenset({"x"}), frozenset({"x", "y"}), frozenset({"y", "_y"})])
def test_a_page_reads_the_same_with_its_heads_remembered(wanted: frozenset[str]) -> None:
    """scan_page remembers each line's head between polls: the second and later reads of a page
    (and of a page whose values changed) must give exactly what a reader with no memory gives."""
    cold = _cold_scan(TRICKY, wanted)
    assert _scan_facts(scan_page(TRICKY, wanted)) == cold
    assert _scan_facts(scan_page(TRICKY, wanted)) == cold
    changed = TRICKY.replace(" 1\n", " 11\n").replace("\t7", "\t+Inf")
    cold_changed = _cold_scan(changed, wanted)
    scan_page(TRICKY, wanted)
    assert _scan_facts(scan_page(changed, wanted)) == cold_changed


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([*TRICKY.splitlines(keepends=True), 'x{a="1"} -2\n', "y 3e5\n", "x\n"]),
                max_size=12))
def test_fuzz_remembered_heads_never_change_a_reading(lines: list[str]) -> None:
    text = "".join(lines) + 'x{a="0"} 0\n'
    cold = _cold_scan(text, frozenset({"x", "_y"}))
    for _ in range(2):
        assert _scan_facts(scan_page(text, frozenset({"x", "_y"}))) == cold


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=200), st.text(alphabet=st.characters(max_codepoint=127), max_size=200)))
def test_binary_characters_are_counted_as_the_regex_counts_them(sample: str) -> None:
    from exporter.serve.engines import exposition

    assert exposition._binary_count(sample) == len(exposition._BINARY_RE.findall(sample))
