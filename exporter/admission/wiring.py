"""Admission wired into the daemon: the book and API from a config, reconciled at every poll, and
`install`, the extension hook exporter.serve.daemon calls when `admission.enabled` is on."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from exporter.admission.api import MAX_BODY_BYTES, AdmissionApi, ApiResponse, read_token_file
from exporter.admission.book import (
    AdmissionBook,
    DeploymentPolicy,
    measurements_from_readings,
)
from exporter.admission.metrics import AdmissionCollector
from exporter.admission.sections import pools_from_config
from exporter.serve.server import Handler, Request, Response, StepBudgetServer

if TYPE_CHECKING:
    from exporter.serve.config import Config
    from exporter.serve.daemon import Daemon
    from exporter.serve.poller import Poller


def admission_enabled(config: Config) -> bool:
    """Whether the config turns the admission API on (`admission.enabled`)."""
    raw = config.sections.get("admission")
    return bool(raw and raw["enabled"])


def api_from_config(config: Config, *, clock: Callable[[], float] = time.monotonic) -> AdmissionApi | None:
    """The admission API for a daemon config, or None when `admission.enabled` is off."""
    if not admission_enabled(config):
        return None
    token = read_token_file(config.sections["admission"]["token_file"])
    return AdmissionApi(book_from_config(config, clock=clock), token)


def book_from_config(config: Config, *, clock: Callable[[], float] = time.monotonic,
                     with_pools: bool = True) -> AdmissionBook:
    """An empty book for a daemon config's deployments (and its `pools`, unless `with_pools` is off)."""
    return AdmissionBook(
        [DeploymentPolicy(d.name, d.target_tokens_per_second) for d in config.deployments],
        pools_from_config(config) if with_pools else None, clock=clock,
        poll_interval_seconds=config.poll_interval_seconds,
    )


def sync_at_every_poll(book: AdmissionBook, poller: Poller) -> None:
    """Feed each of the poller's results to the book: reconcile, suspend, forget (`AdmissionBook.sync`)."""
    poller.add_listener(lambda result: book.sync(*measurements_from_readings(result.readings)))


# --- the daemon: routes, poll listener, metrics ------------------------------------------------------


def install(daemon: Daemon) -> AdmissionApi | None:
    """Daemon extension hook (listed by `daemon.extensions_for`): with `admission.enabled`, serve the
    API, reconcile at every poll and export the admission metrics on the daemon's registry. Off by
    default: nothing is added. Returns the installed API (its `book` is the live state), for tests
    and embedders."""
    api = api_from_config(daemon.config)
    if api is None:
        return None

    serve_api(daemon.server, api)
    sync_at_every_poll(api.book, daemon.poller)
    daemon.server.registry.register(AdmissionCollector(api.book))
    return api


def serve_api(server: StepBudgetServer, api: AdmissionApi) -> None:
    """POST /v1/admission and /v1/release on the server. The token is checked on the headers, before
    the body is read; a body over the API's limit is refused (413) from its declared length, unread."""

    def response(answer: ApiResponse) -> Response:
        return Response(answer.status, answer.encoded(), "application/json", dict(answer.headers))

    def route(handler: Callable[[Mapping[str, str], bytes], ApiResponse]) -> Handler:
        def handle(request: Request) -> Response:
            return response(handler(request.headers, request.body))

        return handle

    def authorize(headers: Mapping[str, str]) -> Response | None:
        refused = api.refusal(headers)
        return None if refused is None else response(refused)

    for path, handler in (("/v1/admission", api.admission), ("/v1/release", api.release)):
        server.register_route("POST", path, route(handler), authorize=authorize, max_body_bytes=MAX_BODY_BYTES)
