"""Admission by tokens in flight: the budget a gateway asks before it sends a request.

Per-user speed falls with the tokens in flight on a server, not with its request count, so a
request-count cap (`--max-num-seqs`) cannot keep chats fast when a few long agent sessions join.
Before it forwards a request a gateway asks: does this request's context (prompt + output limit)
still fit the token budget of some server in the pool? `AdmissionBook` answers, thread-safe, and
keeps every open admission until the gateway releases it.

Accounting rule (docs/admission.md explains why), per target, at every decision:

    accounted = open + max(0, measured - settled_at_poll)

  * open: the tokens of every open admission (prompt + the whole output limit: the most each
    request can come to hold), whether or not the server has started it.
  * measured: the daemon's tokens in flight at the last poll (KV usage x capacity).
  * settled_at_poll: the tokens of the admissions that were open at the last poll and old enough
    (`settle_seconds`) for the server to have started them. Their work is inside `measured` and
    never above their reservation, so `measured - settled_at_poll` is the work no admission
    accounts for: requests sent by gateways that do not ask, or straight to the server, or whose
    lease ran out. It stays counted until the next poll says otherwise.
  A release frees its tokens at once; a burst of admissions between two polls adds to the
  unaccounted work rather than hiding in it; the measurement catches what reservations miss.

Every admission holds a lease of `lease_floor_seconds + lease_output_factor * max_output_tokens /
target_tokens_per_second` (the time its whole output takes at the target speed, with slack).
A lease that runs out is dropped: a gateway that crashed before its release cannot hold budget
forever, and if the request is in fact still running, the measurement still counts it.

What is here, in data-flow order, one job a module: `book` (`AdmissionBook`, pure apart from its
lock, time from an injected clock so tests drive it in simulated time; `measurements_from_readings`:
the daemon's Readings -> one budget and one measurement per target), `api` (`AdmissionApi`, the two
POST handlers, independent of the HTTP server), `metrics` (`AdmissionCollector`, the two metric
families), `sections` (the `admission` and `pools` config sections, which exporter.serve.config
lists), `wiring` (the book and API from a config, and `install`, the daemon extension hook), `client`
(what a gateway calls) and `integrations/` (an ASGI middleware, a simulated gateway). Nothing is
re-exported here: importing the package loads no submodule, so the config loader can list the
sections without loading the daemon.
"""
