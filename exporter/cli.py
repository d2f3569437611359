"""The `stepbudget` command: dispatches each verb to the module that owns it.

Only the chosen verb's module is imported, so `stepbudget plan` never pays for the daemon's
imports (apscheduler, lightkube, the HTTP server). Each verb module provides
`build_parser(parser: argparse.ArgumentParser) -> None` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from exporter import __version__
from exporter.errors import InputError

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "plan": ("exporter.capacity.planner", "offline sizing: KV bytes/token, capacity, token budget, per-user speed"),
    "calibrate": ("exporter.calibrate_verb", "measure effective bandwidth (and per-step overhead) from one stream"),
    "serve": ("exporter.serve.daemon", "the daemon: poll model servers, predict and measure every step, export, alert"),
    "simulate": ("exporter.simulator.cli", "a simulated vLLM server on loopback, driven by a workload scenario"),
    "demo": ("exporter.demo", "simulated servers + calibration + the daemon + a live terminal view"),
    "check-config": ("exporter.serve.config", "validate a daemon config file"),
}

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT = 0, 1, 2


def _top_level_help() -> str:
    width = max(len(verb) for verb in VERBS)
    lines = [f"usage: stepbudget {{{','.join(VERBS)}}} [options]", "",
             "Plan and watch LLM serving capacity in tokens in flight.", "", "verbs:"]
    lines += [f"  {verb.ljust(width)}  {summary}" for verb, (_, summary) in VERBS.items()]
    lines += ["", "`stepbudget VERB --help` shows a verb's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_top_level_help())
        return EXIT_OK if argv else EXIT_BAD_INPUT
    if argv[0] == "--version":
        print(f"stepbudget {__version__}")
        return EXIT_OK
    verb = argv[0]
    if verb not in VERBS:
        from exporter.suggest import close_names

        hint = close_names(verb, VERBS)
        print(f"stepbudget: error: unknown verb {verb!r}{hint}; verbs: {', '.join(VERBS)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    module_name, summary = VERBS[verb]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"stepbudget {verb}", description=summary)
    module.build_parser(parser)
    args = parser.parse_args(argv[1:])  # argparse exits 2 itself on a malformed flag
    try:
        return int(module.run(args))
    except InputError as error:
        print(f"stepbudget {verb}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `stepbudget plan --json | head`: the reader left; say nothing more and exit quietly.
        sys.stderr.close()
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
