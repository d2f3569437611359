"""One schema for the daemon config: the chart's values.schema.json is generated from config.py's
key tables (exporter/serve/config_schema.py), and both refuse and accept the same documents."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from jsonschema import Draft7Validator

from exporter.errors import InputError
from exporter.serve import config as config_module
from exporter.serve.config import ConfigError, config_from_mapping
from exporter.serve.config_schema import (
    BANDWIDTH_PATTERN,
    FLOPS_PATTERN,
    chart_config_schema,
    config_schema,
    parser_schema,
)
from exporter.units import (
    DURATION_PATTERN,
    parse_bandwidth_bytes_per_second,
    parse_duration_seconds,
    parse_flops_per_second,
    parse_overhead_seconds,
)
from tests.support.tools import REPO

VALUES_SCHEMA = REPO / "helm" / "stepbudget" / "values.schema.json"


def test_chart_values_schema_config_is_generated_from_the_key_tables() -> None:
    committed = json.loads(VALUES_SCHEMA.read_text())["properties"]["config"]
    assert committed == chart_config_schema(), (
        "helm/stepbudget/values.schema.json drifted from exporter/serve/config.py: run `make chart-schema`")


def test_every_key_of_every_section_is_in_the_schema() -> None:
    schema = config_schema()
    assert set(schema["properties"]) == set(config_module.TOP_LEVEL_KEYS)
    deployment = schema["properties"]["deployments"]["items"]
    assert set(deployment["properties"]) == set(config_module.DEPLOYMENT_KEYS)
    assert deployment["required"] == ["name", "model", "gpu", "targets"]
    kubernetes = deployment["properties"]["targets"]["properties"]["kubernetes"]
    assert kubernetes["required"] == ["namespace", "label_selector"]
    assert kubernetes["additionalProperties"] is False


def test_an_unmapped_parser_fails_loudly() -> None:
    """A new key type must get a JSON schema, not silently an empty (accept-anything) one."""
    def _new_kind_of_value(value, where):
        return value
    with pytest.raises(ValueError, match="_new_kind_of_value"):
        parser_schema(_new_kind_of_value)


THIS_FILE = str(Path(__file__).resolve())  # a file that exists, for the keys that name one
# NVIDIA A10 by its datasheet numbers.
A10 = {"name": "a10", "memory": "24GB", "peak_bandwidth": "600GB/s", "peak_flops": "125TFLOP/s"}


def _deployment(**overrides: object) -> dict:
    return {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm",
            "targets": {"static": ["http://10.0.0.5:8000/metrics"]}, **overrides}


# Each document is judged by check-config's validation and by the generated schema; they agree.
DOCUMENTS = [
    ({"deployments": [_deployment()]}, True),
    ({"poll_interval": "1m30s", "timeout": "2s500ms", "deployments": [_deployment()]}, True),
    ({"poll_interval": 15, "max_response_bytes": "8MiB", "deployments": [_deployment()]}, True),
    ({"defaults": {"headroom": 0.85}, "alerting": {"alertmanager_urls": "http://am:9093"},
      "deployments": [_deployment(kind="sglang", step_overhead="2ms", effective_bandwidth="2TB")]}, True),
    ({"deployments": [_deployment(targets={"kubernetes": {"namespace": "llm", "label_selector": "app=v"}})]}, True),
    ({"deployments": [_deployment(auth=None, tls=None)]}, True),
    # A zero-allowed duration takes the compound form too: the schema's pattern is the same for both.
    ({"deployments": [_deployment(step_overhead="1s500ms")]}, True),
    ({"deployments": [_deployment(step_overhead="0m0s")]}, True),
    ({"poll_intervall": "15s", "deployments": [_deployment()]}, False),
    ({"poll_interval": "1m30", "deployments": [_deployment()]}, False),
    ({"poll_interval": "30s1m", "deployments": [_deployment()]}, False),
    ({"deployments": []}, False),
    ({}, False),
    ({"deployments": [_deployment(targets={"kubernetes": {"label_selector": "app=v"}})]}, False),
    ({"deployments": [_deployment(targets={})]}, False),
    ({"deployments": [_deployment(targets={"static": []})]}, False),
    ({"deployments": [_deployment(kind="vllmm")]}, False),
    ({"deployments": [_deployment(headroom=1.5)]}, False),
    ({"deployments": [_deployment(tensor_parallel=0)]}, False),
    ({"deployments": [_deployment(targets={"dns": {"name": "v.llm", "port": 70000}})]}, False),
    ({"deployments": [_deployment(auth={"bearer_token_env": "A", "bearer_token_file": "/x"})]}, False),
    ({"deployments": [_deployment(targets={"static": ["vllm:8000/metrics"]})]}, False),
    ({"log_format": "xml", "deployments": [_deployment()]}, False),
    ({"shard": {"index": 0}, "deployments": [_deployment()]}, False),
    # A device by its numbers (or a preset with some replaced); rates may end with /s.
    ({"deployments": [_deployment(gpu=A10)]}, True),
    ({"deployments": [_deployment(gpu={**A10, "peak_bandwidth": 6e11, "peak_flops": "125e12"})]}, True),
    ({"deployments": [_deployment(gpu={"preset": "h100-sxm", "peak_bandwidth": "2TB/s"})]}, True),
    ({"deployments": [_deployment(gpu={**A10, "preset": None})]}, True),
    ({"deployments": [_deployment(effective_bandwidth="2TB/s")]}, True),
    ({"deployments": [_deployment(gpu={k: v for k, v in A10.items() if k != "peak_flops"})]}, False),
    ({"deployments": [_deployment(gpu={k: v for k, v in A10.items() if k != "name"})]}, False),
    ({"deployments": [_deployment(gpu={**A10, "peak_flops": None})]}, False),
    ({"deployments": [_deployment(gpu={"preset": None, "peak_bandwidth": "2TB/s"})]}, False),
    ({"deployments": [_deployment(gpu={**A10, "peak_bandwidth": -6e11})]}, False),
    ({"deployments": [_deployment(gpu={**A10, "peak_bandwidth": "600GBs"})]}, False),
    ({"deployments": [_deployment(gpu={**A10, "peak_flops": "125TB/s"})]}, False),
    ({"deployments": [_deployment(gpu={**A10, "peak_flop": "125e12"})]}, False),
    ({"deployments": [_deployment(gpu=["a10"])]}, False),
    # Credentials: basic auth with its password in exactly one place, a client key only with its certificate,
    # and never `user:password@` in a URL.
    ({"deployments": [_deployment(auth={"basic_auth": {"username": "u", "password_env": "P"}})]}, True),
    ({"deployments": [_deployment(auth={"basic_auth": {"username": "u", "password_file": THIS_FILE},
                                        "bearer_token_env": None})]}, True),
    ({"alerting": {"alertmanager_urls": ["https://am:9093"],
                   "auth": {"basic_auth": {"username": "u", "password_env": "P"}},
                   "tls": {"cert_file": THIS_FILE, "key_file": THIS_FILE}},
      "deployments": [_deployment(targets={"prometheus": {"url": "https://mimir/prometheus", "selector": 'job="v"',
                                                          "auth": {"bearer_token_env": "T"},
                                                          "tls": {"cert_file": THIS_FILE}}})]}, True),
    ({"deployments": [_deployment(targets={"static": ["http://10.0.0.5:8000/metrics?token=x"]})]}, True),
    ({"deployments": [_deployment(auth={"basic_auth": {"username": "u"}})]}, False),
    ({"deployments": [_deployment(auth={"basic_auth": {"password_env": "P"}})]}, False),
    ({"deployments": [_deployment(auth={"basic_auth": {"username": "u", "password_env": "P",
                                                       "password_file": THIS_FILE}})]}, False),
    ({"deployments": [_deployment(auth={"basic_auth": {"username": "u", "password_env": "P"},
                                        "bearer_token_env": "T"})]}, False),
    ({"deployments": [_deployment(tls={"key_file": THIS_FILE})]}, False),
    ({"deployments": [_deployment(targets={"static": ["http://u:p@10.0.0.5:8000/metrics"]})]}, False),
    ({"alerting": {"alertmanager_urls": "http://am:s3cret@am:9093"}, "deployments": [_deployment()]}, False),
    # The labels every alert the daemon sends carries, as Prometheus's external labels; a runbook base.
    ({"alerting": {"external_labels": {"cluster": "prod-eu", "region": 3}, "runbook_base_url": "https://wiki/rb"},
      "deployments": [_deployment()]}, True),
    ({"alerting": {"external_labels": {"cluster-name": "prod"}}, "deployments": [_deployment()]}, False),
    ({"alerting": {"external_labels": {"__tenant": "a"}}, "deployments": [_deployment()]}, False),
    ({"alerting": {"external_labels": {"alertname": "a"}}, "deployments": [_deployment()]}, False),
    ({"alerting": {"external_labels": {"cluster": ""}}, "deployments": [_deployment()]}, False),
    ({"alerting": {"external_labels": {"cluster": ["a"]}}, "deployments": [_deployment()]}, False),
    ({"alerting": {"external_labels": ["cluster=prod"]}, "deployments": [_deployment()]}, False),
    ({"alerting": {"runbook_base_url": "wiki/runbook.md"}, "deployments": [_deployment()]}, False),
]


@pytest.mark.parametrize(("document", "valid"), DOCUMENTS)
def test_check_config_and_the_schema_agree(document: dict, valid: bool) -> None:
    schema_valid = Draft7Validator(config_schema()).is_valid(document)
    try:
        config_from_mapping(json.loads(json.dumps(document)))
        daemon_valid = True
    except ConfigError:
        daemon_valid = False
    assert (daemon_valid, schema_valid) == (valid, valid)


@pytest.mark.parametrize(("text", "seconds"), [
    ("15s", 15.0), ("5m", 300.0), ("250ms", 0.25), ("1.5s", 1.5), ("90", 90.0),
    # Prometheus's compound form, largest unit first: 60 + 30, 3600 + 5 * 60, 2 + 0.5.
    ("1m30s", 90.0), ("1h5m", 3900.0), ("2s500ms", 2.5),
])
def test_durations_parse_and_match_the_schema_pattern(text: str, seconds: float) -> None:
    assert parse_duration_seconds(text) == seconds
    assert parse_overhead_seconds(text) == seconds  # the zero-allowed reader (step_overhead, a rule's `for`)
    assert re.search(DURATION_PATTERN, text)


@pytest.mark.parametrize("text", ["1m30", "30s1m", "1m1m", "soon", "1 m 30 s"])
def test_malformed_durations_are_refused_by_both(text: str) -> None:
    with pytest.raises(InputError):
        parse_duration_seconds(text)
    with pytest.raises(InputError):
        parse_overhead_seconds(text)
    assert not re.search(DURATION_PATTERN, text)


_RATES = {"bandwidth": (BANDWIDTH_PATTERN, parse_bandwidth_bytes_per_second),
          "flops": (FLOPS_PATTERN, parse_flops_per_second)}


@pytest.mark.parametrize(("rate", "text", "readable"), [
    ("bandwidth", "600GB/s", True), ("bandwidth", "2TB", True), ("bandwidth", "2 tb/S", True),
    ("bandwidth", "1GiB/s", True), ("bandwidth", "6e11", True),
    ("bandwidth", "600GBs", False), ("bandwidth", "2TB/s/s", False), ("bandwidth", "/s", False),
    ("flops", "125e12", True), ("flops", "125T", True), ("flops", "125TFLOPS", True), ("flops", "1.2TFLOP/s", True),
    ("flops", "2.25 pflop/s", True), ("flops", "125TB/s", False), ("flops", "125 FLOPS/ms", False),
    ("flops", "lots", False),
])
def test_rates_match_the_schema_pattern_exactly_when_readable(rate: str, text: str, readable: bool) -> None:
    pattern, parse = _RATES[rate]
    assert bool(re.search(pattern, text)) is readable
    if readable:
        parse(text)
    else:
        with pytest.raises(InputError):
            parse(text)
