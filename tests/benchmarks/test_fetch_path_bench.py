"""benchmarks/fetch_path.py compares like with like: both fetchers read the same pages whole from the
same loopback server, count a failed fetch as an error, and the benchmark steps aside without pycurl."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import fetch_path
from benchmarks.scale import free_port, start_path_fleet, stop


def test_without_pycurl_it_says_so_and_writes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(fetch_path, "have_pycurl", lambda: False)
    output = tmp_path / "fetch_path.json"
    assert fetch_path.main(["--targets", "10", "--output", str(output)]) == 0
    assert "skipped, pycurl is not installed" in capsys.readouterr().err
    assert not output.exists()


def test_both_fetchers_read_every_page_alike_and_count_failures() -> None:
    pytest.importorskip("pycurl")
    fleet, port = start_path_fleet(12, 3600.0)
    try:
        urls = [f"http://127.0.0.1:{port}/t/{index}/metrics" for index in range(12)]
        broken = [f"http://127.0.0.1:{port}/nothing-here", f"http://127.0.0.1:{free_port()}/metrics"]
        project = fetch_path.ProjectCycle(5.0, 4 << 20)
        curl = fetch_path.CurlCycle(5.0, 4 << 20, concurrency=4)
        try:
            first = project(urls), curl(urls)
            again = project(urls), curl(urls)  # kept-alive connections, reused
            failing = project(broken), curl(broken)
        finally:
            project.close()
            curl.close()
    finally:
        stop(fleet)
    assert first[0] == first[1] == again[0] == again[1]
    ok, errors, characters = first[0]
    assert (ok, errors) == (12, 0) and characters > 12 * 10_000
    assert [(ok, errors) for ok, errors, _ in failing] == [(0, 2), (0, 2)]
