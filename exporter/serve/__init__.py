"""The daemon, `stepbudget serve`: its modules in data-flow order (docs/architecture.md).

config (YAML -> Config; `config_schema` turns its key tables into the chart's values schema) ->
discovery (static, DNS, Kubernetes targets; `sharding` keeps this shard's share) -> poller (fetch
every target's /metrics on a schedule, with timeouts) -> engines (one page -> one Snapshot per
model and engine; `snapshot` is their contract) -> window (two Snapshots -> measured step and
prefill per step) -> reading (Snapshot + Window + the capacity model -> one Reading) -> collector
and server (the Readings as /metrics, and the HTTP endpoints) and alert_rules/alerting (the
in-process alert loop, its rules read from the packaged `rules/`). `daemon` wires them together.
"""
