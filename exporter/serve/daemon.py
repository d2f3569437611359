"""`stepbudget serve`: config -> discovery -> poller -> readings -> /metrics and the alert loop.

Flags override config keys (and validate the same way); with `--target URL --model M --gpu G` the
daemon runs without a file. SIGTERM and SIGINT stop it within a few seconds with exit code 0.

Optional features (admission) hook in through `extensions_for(config)`, the one list of what a
config turns on besides polling: each hook gets the built Daemon (config, poller, server with its
route table) before polling starts. Nothing is registered by importing a module.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from exporter import __version__
from exporter.admission import wiring as admission
from exporter.capacity.presets import CUSTOM_GPU, FIGURE_KEYS, GPU_FIGURE_FLAGS, is_custom_gpu, require_figures
from exporter.errors import InputError
from exporter.logs import configure_logging
from exporter.redaction import redact
from exporter.serve.alerting import AlertLoop
from exporter.serve.collector import make_registry
from exporter.serve.config import (
    LOG_FORMATS,
    Config,
    Deployment,
    config_from_mapping,
    empty_document,
    parse_listen,
    read_document,
)
from exporter.serve.engines import server_kinds
from exporter.serve.fetch import MAX_CACHED_REQUESTS, HttpFetcher
from exporter.serve.once import run_once
from exporter.serve.online_calibration import MAX_WINDOWS_PER_DEPLOYMENT, OnlineCalibrator
from exporter.serve.online_seed import start_seeding
from exporter.serve.poller import Poller
from exporter.serve.polling import build_polling
from exporter.serve.prometheus_source import PrometheusSource
from exporter.serve.server import Response, StepBudgetServer, TargetRow
from exporter.serve.sharding import parse_shard, shard_section
from exporter.serve.state_sizes import StateSizes

log = structlog.get_logger("stepbudget.daemon")

STOP_POLL_SECONDS = 0.2


@dataclass
class Daemon:
    config: Config
    poller: Poller
    server: StepBudgetServer
    alert_loop: AlertLoop
    fetcher: HttpFetcher
    sources: tuple[PrometheusSource, ...] = ()
    state_sizes: StateSizes | None = None


Extension = Callable[[Daemon], object]


def extensions_for(config: Config) -> list[Extension]:
    """The hooks this config turns on, run on the built Daemon before the first poll.

    Listed here, in one place, so what runs follows from the config alone, not from which modules
    happen to be imported. (Sharding is not a hook: it wraps discovery inside `build_daemon`.)
    """
    hooks: list[Extension] = []
    if admission.admission_enabled(config):
        hooks.append(admission.install)
    return hooks


# --- flags -----------------------------------------------------------------------------------------


def start_serving(daemon: Daemon) -> list[object]:
    """What `serve` does between building the daemon and polling: the config's extensions, the page
    refresh after each poll, then /metrics served. One place, so tests start a daemon as `serve` does.
    Returns what each extension installed."""
    installed = [hook(daemon) for hook in extensions_for(daemon.config)]
    if daemon.state_sizes is not None:  # after every other listener: the sizes each poll left
        daemon.poller.add_listener(daemon.state_sizes.on_poll)
    # Last listener, after the extensions' (admission sync): the page is re-rendered once per poll
    # with everything the poll changed, and scrapes are served from it.
    daemon.poller.add_listener(lambda result: daemon.server.metrics_page.refresh())
    daemon.server.start()
    return installed


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (see docs/operations.md)")
    parser.add_argument("--listen", help="HOST:PORT or :PORT to serve /metrics on (default :9421)")
    parser.add_argument("--poll-interval", metavar="DURATION", help="poll every target this often (default 15s)")
    parser.add_argument("--timeout", metavar="DURATION", help="per-target fetch deadline (default 5s)")
    parser.add_argument("--stale-after", metavar="DURATION",
                        help="drop a failing target's values after this (default 60s)")
    parser.add_argument("--max-response-bytes", metavar="SIZE", help="refuse pages larger than this (default 4MiB)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, help="json, console, or auto (console on a TTY)")
    parser.add_argument("--target", action="append", metavar="URL", default=[],
                        help="a metrics URL to poll (repeatable); with --model and --gpu, no config file needed")
    parser.add_argument("--deployment", default="default", help="deployment name for --target (default: default)")
    parser.add_argument("--model", help="model preset or config.json for --target")
    parser.add_argument("--gpu", help=f"GPU preset for --target, or `{CUSTOM_GPU}`: a device given by "
                                      "--gpu-memory, --gpu-bandwidth and --gpu-flops (all three then required)")
    parser.add_argument("--gpu-memory", metavar="SIZE", help="the device's memory for --target, e.g. 24GB "
                                                             "(overrides the preset's)")
    parser.add_argument("--gpu-bandwidth", metavar="RATE", help="the device's peak memory bandwidth for --target, "
                                                                "e.g. 600GB/s (overrides the preset's)")
    parser.add_argument("--gpu-flops", metavar="RATE", help="the device's peak dense FLOP/s for --target, one figure "
                                                            "for every precision, e.g. 125e12 (overrides the preset's)")
    parser.add_argument("--tensor-parallel", type=int, help="GPUs per replica for --target")
    parser.add_argument("--kind", choices=server_kinds(),
                        help="the servers' page format for --target: auto (detected from the page) or an engine "
                             "adapter's kind")
    parser.add_argument("--target-tps", type=float, help="per-user speed target for --target (default 50)")
    parser.add_argument("--alertmanager-url", action="append", metavar="URL", default=[],
                        help="Alertmanager to post alerts to (repeatable); overrides alerting.alertmanager_urls")
    parser.add_argument("--alert-for", metavar="DURATION", help="overrides alerting.for (the page's `for`)")
    parser.add_argument("--shard", metavar="INDEX/COUNT",
                        help="poll only shard INDEX of COUNT "
                             "(0 <= INDEX < COUNT; rendezvous hash of each target's URL); "
                             "overrides the config's shard section")
    once = parser.add_argument_group(
        "one-shot check (--once)",
        "Poll every target once as serve would (same discovery, timeouts and page reading), print each "
        "target's reading (engine kind read off the page, tokens in flight, KV capacity, predicted step, "
        "measured step) and exit: 0 when every target was read, 1 naming each target down or unreadable "
        "(and each deployment that found no target). No HTTP server, no alert loop, no online calibration.")
    once.add_argument("--once", action="store_true", help="poll, print, exit (see above)")
    once.add_argument("--once-interval-seconds", type=float, metavar="SECONDS",
                      help="the measured step is a difference of each server's counters between two polls, so "
                           "--once polls twice, this far apart (default: poll_interval, the daemon's window); "
                           "0 polls once and leaves the measured step out")
    once.add_argument("--json", action="store_true",
                      help="with --once: print a JSON list, one object per target (deployment, target, url, up, "
                           "error, kind, readings)")


_TOP_LEVEL_FLAGS = {"listen": "listen", "poll_interval": "poll_interval", "timeout": "timeout",
                    "stale_after": "stale_after", "max_response_bytes": "max_response_bytes",
                    "log_format": "log_format"}


def config_from_args(args: argparse.Namespace) -> Config:
    """The config file (or an empty one) with every given flag applied on top, then validated."""
    if args.config:
        document = read_document(args.config)
    elif args.target:
        document = empty_document()
    else:
        raise InputError("give --config FILE, or --target URL with --model and --gpu")
    for flag, key in _TOP_LEVEL_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            document[key] = value
    if args.target:
        if not args.model or not args.gpu:
            raise InputError("--target needs --model and --gpu (or put the deployment in --config)")
        deployment: dict[str, Any] = {"name": args.deployment, "model": args.model, "gpu": gpu_from_flags(args),
                                      "targets": {"static": list(args.target)}}
        for flag, key in (("tensor_parallel", "tensor_parallel"), ("kind", "kind"),
                          ("target_tps", "target_tokens_per_second")):
            if getattr(args, flag) is not None:
                deployment[key] = getattr(args, flag)
        document["deployments"] = [*(document.get("deployments") or []), deployment]
    if args.alertmanager_url or args.alert_for:
        alerting = dict(document.get("alerting") or {})
        if args.alertmanager_url:
            alerting["alertmanager_urls"] = list(args.alertmanager_url)
        if args.alert_for:
            alerting["for"] = args.alert_for
        document["alerting"] = alerting
    if getattr(args, "shard", None) is not None:
        document["shard"] = shard_section(parse_shard(args.shard))
    return config_from_mapping(document, args.config or "")


def gpu_from_flags(args: argparse.Namespace) -> str | dict[str, Any]:
    """`--gpu` and its figure flags as the config's `gpu` value: a preset's name, the preset with the
    figures given replacing its own, or (`custom`) the device wholly by its figures, which must all be given.
    The figures stay text: the config's validators read them, as they read every other flag."""
    figures = dict(zip(FIGURE_KEYS, (args.gpu_memory, args.gpu_bandwidth, args.gpu_flops), strict=True))
    if is_custom_gpu(args.gpu):
        require_figures(dict(zip(GPU_FIGURE_FLAGS, figures.values(), strict=True)), f"--gpu {CUSTOM_GPU}")
        return {"name": CUSTOM_GPU, **figures}
    given = {key: value for key, value in figures.items() if value is not None}
    return {"preset": args.gpu, **given} if given else str(args.gpu)


# --- wiring ----------------------------------------------------------------------------------------


def build_daemon(config: Config) -> Daemon:
    host, port = parse_listen(config.listen)
    # The online fit publishes the setups it fits; the poller predicts with them and the collector exports them.
    calibrator = OnlineCalibrator(config.deployments)
    polling = build_polling(config, calibrator.setups_in_use)
    poller, fetcher, sources, shard = polling.poller, polling.fetcher, polling.sources, polling.shard
    registry = make_registry(poller.readings, config.deployments, poller.deployment_targets, poller.not_ready,
                             poller.mixed_targets, calibrator.setups_in_use)
    server = StepBudgetServer(host, port, registry, ready=lambda: poller.ready,
                              targets=lambda: _target_rows(poller))
    # The loop always evaluates, so `GET /api/v1/alerts` shows pending and firing alerts; it posts
    # to Alertmanager only when `alerting.alertmanager_urls` is set.
    # A shard polls a share of each deployment's targets: none of its own says nothing of the others,
    # so only Prometheus, summing over the shards, raises StepBudgetNoTargets for a sharded daemon.
    alert_loop = AlertLoop(config.alerting, poll_interval_seconds=config.poll_interval_seconds,
                           generator_url=f"http://{host or _hostname()}:{server.port}/",
                           deployment_alerts=shard is None or shard.count == 1,
                           scales_to_zero=[d.name for d in config.deployments if d.scales_to_zero])
    if calibrator.deployments:
        # Before the alert loop, so a poll's refit is in place for the next poll's predictions.
        poller.add_listener(calibrator.on_poll)
        start_seeding(calibrator)
    poller.add_listener(alert_loop.on_poll)
    server.register_route("GET", "/api/v1/alerts", lambda request: _alerts_response(alert_loop))
    return Daemon(config, poller, server, alert_loop, fetcher, sources,
                  watch_state(poller, fetcher, alert_loop, calibrator, server))


def watch_state(poller: Poller, fetcher: HttpFetcher, alert_loop: AlertLoop, calibrator: OnlineCalibrator,
                server: StepBudgetServer) -> StateSizes:
    """Every structure keyed by target, series, engine or connection, measured once per poll and exported
    (`stepbudget_state_entries`, `stepbudget_state_max_entries`; docs/operations.md, "Memory bounds")."""
    sizes = StateSizes()
    sizes.watch("poller_targets", lambda: len(poller.target_states()))
    sizes.watch("fetch_pools", lambda: fetcher.sizes()[0], MAX_CACHED_REQUESTS + 1)
    sizes.watch("fetch_routes", lambda: fetcher.sizes()[1], MAX_CACHED_REQUESTS + 1)
    sizes.watch("alert_series", lambda: alert_loop.sizes()[0])
    sizes.watch("alerts", lambda: alert_loop.sizes()[1])
    sizes.watch("calibration_windows", lambda: calibrator.sizes()[0],
                MAX_WINDOWS_PER_DEPLOYMENT * len(calibrator.deployments))
    sizes.watch("calibration_engines", lambda: calibrator.sizes()[1])
    sizes.watch("http_connections", server.open_connections, server.limits.reset_above_connections)
    server.registry.register(sizes)
    return sizes


def _alerts_response(alert_loop: AlertLoop) -> Response:
    body = {"status": "success", "data": {"alerts": alert_loop.active()}}
    return Response(200, json.dumps(body).encode(), "application/json")


def _hostname() -> str:
    import socket

    return socket.gethostname()


def _target_rows(poller: Poller) -> list[TargetRow]:
    rows = []
    for state in poller.target_states():
        readings = [r for r in state.readings if r.target_up]
        detail = state.last_error or ", ".join(
            f"{r.model_name}/{r.engine}: "
            + (f"{r.tokens_in_flight:,.0f} tokens in flight" if r.tokens_in_flight is not None
               else "tokens in flight unknown")
            for r in readings)
        rows.append(TargetRow(state.target.deployment, state.target.target, state.kind,
                              state.last_error is None and state.last_success_seconds is not None, detail))
    return rows


def run(args: argparse.Namespace) -> int:
    if not args.once and (args.json or args.once_interval_seconds is not None):
        raise InputError("--json and --once-interval-seconds go with --once")
    interval = args.once_interval_seconds
    if interval is not None and not (math.isfinite(interval) and interval >= 0):
        raise InputError(f"--once-interval-seconds must be 0 or more, got {interval:g}")
    config = config_from_args(args)
    if args.once:
        # Warnings only (a target down, a page problem) on stderr: stdout is the readings.
        configure_logging(config.log_format, level=logging.WARNING)
        return run_once(config, interval, args.json)
    configure_logging(config.log_format)
    stop = threading.Event()

    def request_stop(signum: int, frame: object) -> None:
        log.info("stopping", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    try:
        daemon = build_daemon(config)
    except OSError as error:
        raise InputError(f"listen {config.listen}: cannot serve there: {error.strerror or error}") from None
    start_serving(daemon)
    for deployment in config.deployments:
        log.info("deployment_mode", deployment=deployment.name, mode=deployment.mode, **_sources_of(deployment))
    log.info("started", version=__version__, listen=config.listen, port=daemon.server.port,
             poll_interval_seconds=config.poll_interval_seconds, timeout_seconds=config.timeout_seconds,
             deployments=[_describe(d) for d in config.deployments],
             alertmanagers=[redact(url) for url in config.alerting.alertmanager_urls] or "off")
    daemon.poller.start()
    try:
        while not stop.wait(STOP_POLL_SECONDS):
            pass
    finally:
        started = time.monotonic()
        daemon.poller.stop()
        daemon.server.stop()
        daemon.fetcher.close()
        for source in daemon.sources:
            source.close()
        log.info("stopped", shutdown_seconds=round(time.monotonic() - started, 3))
    return 0


def _describe(deployment: Deployment) -> dict[str, Any]:
    return {"name": deployment.name, "model": deployment.model, "gpu": deployment.gpu,
            "kind": deployment.kind, "bandwidth_source": deployment.resolved.bandwidth_source,
            "mode": deployment.mode, **_sources_of(deployment)}


def _sources_of(deployment: Deployment) -> dict[str, Any]:
    """Where a deployment's servers are read from, as the start-up log says it."""
    sources: dict[str, Any] = {}
    if deployment.prometheus:
        sources["prometheus"] = f"{redact(deployment.prometheus.url)} {{{deployment.prometheus.selector}}}"
    if deployment.static_urls:
        sources["static"] = [redact(url) for url in deployment.static_urls]
    if deployment.dns:
        sources["dns"] = f"{deployment.dns.name}:{deployment.dns.port}"
    if deployment.kubernetes:
        sources["kubernetes"] = f"{deployment.kubernetes.namespace}/{deployment.kubernetes.label_selector}"
    return sources
