"""Config validation: defaults, every error naming key path and file line (exit 2 from the CLI),
close-name suggestions, the extension point, flag overrides on `serve`, and the shipped examples.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from exporter import cli
from exporter.config_validators import string
from exporter.serve.config import (
    DEFAULT_MAX_RESPONSE_BYTES,
    Alerting,
    Auth,
    ConfigError,
    CredentialError,
    Key,
    Section,
    config_from_mapping,
    daemon_sections,
    load_config,
    read_document,
    top_level_keys,
)
from exporter.serve.daemon import build_parser, config_from_args
from tests.support.configs import MINIMAL, write
from tests.support.tools import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(str(write(tmp_path, text)))
    return str(caught.value)


def test_defaults(tmp_path: Path) -> None:
    config = load_config(str(write(tmp_path, MINIMAL)))
    assert (config.listen, config.poll_interval_seconds, config.timeout_seconds,
            config.stale_after_seconds) == (":9421", 15, 5, 60)
    assert config.max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES and config.log_format == "auto"
    [deployment] = config.deployments
    assert (deployment.target_tokens_per_second, deployment.headroom) == (50, 0.9)
    assert deployment.step_budget_seconds == pytest.approx(0.9 / 50)
    assert deployment.kind == "auto" and deployment.tensor_parallel == 1
    assert deployment.resolved.bandwidth_source == "default"
    assert deployment.resolved.setup.effective_bandwidth_bytes_per_second == pytest.approx(0.6 * 3.35e12)
    assert config.alerting.alertmanager_urls == () and config.alerting.for_seconds is None


def test_durations_sizes_and_defaults_section(tmp_path: Path) -> None:
    config = load_config(str(write(tmp_path, textwrap.dedent("""\
        poll_interval: 5s
        timeout: 1500ms
        stale_after: 2m
        max_response_bytes: 1MiB
        defaults: {target_tokens_per_second: 20, headroom: 0.8, bandwidth_efficiency: 0.5}
        alerting: {alertmanager_urls: [http://am:9093], for: 10m}
    """) + textwrap.dedent(MINIMAL))))
    assert (config.poll_interval_seconds, config.timeout_seconds, config.stale_after_seconds) == (5, 1.5, 120)
    assert config.max_response_bytes == 2**20
    [deployment] = config.deployments
    assert deployment.step_budget_seconds == pytest.approx(0.8 / 20)
    assert deployment.resolved.setup.effective_bandwidth_bytes_per_second == pytest.approx(0.5 * 3.35e12)
    assert config.alerting.alertmanager_urls == ("http://am:9093",) and config.alerting.for_seconds == 600


def test_bad_url_names_its_path_and_line(tmp_path: Path) -> None:
    message = error_of(tmp_path, MINIMAL + """\
      - name: agents
        model: llama-3.1-8b
        gpu: h100-sxm
        targets:
          static:
            - 10.0.0.7:8000
    """)
    assert "deployments[1].targets.static[0]" in message
    assert "stepbudget.yaml:12:" in message and "'10.0.0.7:8000'" in message


def test_unknown_key_suggests_the_close_name(tmp_path: Path) -> None:
    message = error_of(tmp_path, "poll_intervall: 10s\n" + textwrap.dedent(MINIMAL))
    assert "stepbudget.yaml:1: poll_intervall: unknown key (did you mean: poll_interval?)" in message
    nested = error_of(tmp_path, MINIMAL.replace("        gpu: h100-sxm\n",
                                                 "        gpu: h100-sxm\n        tensor_paralel: 2\n"))
    assert "deployments[0].tensor_paralel" in nested and "tensor_parallel" in nested and ":5:" in nested


def test_bad_model_or_gpu_fails_at_load_naming_the_key(tmp_path: Path) -> None:
    message = error_of(tmp_path, MINIMAL.replace("h100-sxm", "h100-sxn"))
    assert "stepbudget.yaml:4: deployments[0].gpu: unknown GPU preset 'h100-sxn'" in message
    message = error_of(tmp_path, MINIMAL.replace("qwen3-8b", "qwen9-8b"))
    assert "stepbudget.yaml:3: deployments[0].model:" in message


@pytest.mark.parametrize("fragment, expected", [
    ("poll_interval: soon\n", "poll_interval: cannot read 'soon' as a duration"),
    ("poll_interval: 0s\n", "poll_interval: must be greater than zero"),
    ("listen: localhost\n", "listen: listen: expected HOST:PORT"),
    ("log_format: xml\n", "log_format: expected one of auto, json, console"),
    ("defaults: {headroom: 1.5}\n", "defaults.headroom: must be a ratio in (0, 1]"),
    ("alerting: {alertmanager_urls: [am:9093]}\n", "alerting.alertmanager_urls[0]: expected an http"),
])
def test_bad_values(tmp_path: Path, fragment: str, expected: str) -> None:
    assert expected in error_of(tmp_path, fragment + textwrap.dedent(MINIMAL))


def test_structural_errors(tmp_path: Path) -> None:
    assert "missing required key 'deployments'" in error_of(tmp_path, "listen: :9421\n")
    assert "deployments[0].targets: give at least one of static, dns, kubernetes" in error_of(tmp_path, MINIMAL.replace(
        "        targets:\n          static: [http://10.0.0.5:8000/metrics]\n", "        targets: {}\n"))
    assert "deployments[0].targets.static: the list is empty" in error_of(tmp_path, MINIMAL.replace(
        "[http://10.0.0.5:8000/metrics]", "[]"))
    assert "appears twice" in error_of(tmp_path, "listen: :1\nlisten: :2\n" + textwrap.dedent(MINIMAL))
    assert "name 'chat' is used twice" in error_of(tmp_path, MINIMAL + MINIMAL.split("\n", 1)[1])
    assert "not valid YAML" in error_of(tmp_path, "deployments: [\n")
    assert "must hold a mapping" in error_of(tmp_path, "- a\n- b\n")


def test_kubernetes_dns_auth_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    config = load_config(str(write(tmp_path, f"""\
        deployments:
          - name: chat
            model: qwen3-8b
            gpu: h100-sxm
            targets:
              dns: {{name: vllm.llm.svc.cluster.local, port: 8000}}
              kubernetes: {{namespace: llm, label_selector: "app=vllm", port: 8000}}
            auth: {{bearer_token_file: {token}}}
            tls: {{ca_file: {ca}}}
          - name: batch
            model: qwen3-8b
            gpu: h100-sxm
            targets: {{static: [https://10.0.0.9/metrics]}}
            auth: {{bearer_token_env: VLLM_TOKEN}}
    """)))
    chat, batch = config.deployments
    assert chat.dns.name == "vllm.llm.svc.cluster.local" and chat.dns.path == "/metrics"
    assert chat.kubernetes.label_selector == "app=vllm" and chat.kubernetes.kubeconfig is None
    assert chat.auth.bearer_token() == "abc" and chat.tls.ca_file == str(ca)
    monkeypatch.setenv("VLLM_TOKEN", "from-env")
    assert batch.auth.bearer_token() == "from-env"
    both = error_of(tmp_path, MINIMAL + f"        auth: {{bearer_token_file: {token}, bearer_token_env: X}}\n")
    assert "deployments[0].auth: give at most one of" in both
    missing = error_of(tmp_path, MINIMAL + "        auth: {bearer_token_file: /nonexistent/token}\n")
    assert "deployments[0].auth.bearer_token_file: file '/nonexistent/token' does not exist" in missing


def test_basic_auth_client_certificates_and_alertmanager_credentials(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """basic_auth for targets, the query API and Alertmanager; the password read at each use, from a file
    or the environment; a client certificate with its key; what each refusal says."""
    password = tmp_path / "password"
    password.write_text("hunter2\n")
    cert, key = tmp_path / "client.crt", tmp_path / "client.key"
    cert.write_text("-----BEGIN CERTIFICATE-----\n")
    key.write_text("-----BEGIN PRIVATE KEY-----\n")
    config = load_config(str(write(tmp_path, f"""\
        deployments:
          - name: chat
            model: qwen3-8b
            gpu: h100-sxm
            targets: {{static: [https://10.0.0.9/metrics]}}
            auth: {{basic_auth: {{username: scraper, password_file: {password}}}}}
            tls: {{cert_file: {cert}, key_file: {key}}}
          - name: mimir
            model: qwen3-8b
            gpu: h100-sxm
            targets:
              prometheus:
                url: https://mimir/prometheus
                selector: job="vllm"
                auth: {{basic_auth: {{username: reader, password_env: PROM_PASSWORD}}}}
                tls: {{cert_file: {cert}}}
        alerting:
          alertmanager_urls: [https://am:9093]
          auth: {{bearer_token_env: AM_TOKEN}}
          tls: {{ca_file: {cert}}}
    """)))
    chat, mimir = config.deployments
    # RFC 7617: base64 of "scraper:hunter2" (the file's newline dropped).
    assert chat.auth.authorization() == "Basic c2NyYXBlcjpodW50ZXIy"
    password.write_text("rotated")
    assert chat.auth.authorization() == "Basic c2NyYXBlcjpyb3RhdGVk"  # base64 of "scraper:rotated"
    assert chat.tls.client_cert == (str(cert), str(key))
    assert mimir.prometheus is not None and mimir.prometheus.tls.client_cert == str(cert)
    with pytest.raises(CredentialError, match=r"^basic_auth.password_env: environment variable PROM_PASSWORD is "
                                              r"not set$"):
        mimir.prometheus.auth.authorization()
    monkeypatch.setenv("PROM_PASSWORD", "s3cret")
    assert mimir.prometheus.auth.authorization() == "Basic cmVhZGVyOnMzY3JldA=="  # base64 of "reader:s3cret"
    monkeypatch.setenv("AM_TOKEN", "am-token")
    assert config.alerting.auth.authorization() == "Bearer am-token"
    assert config.alerting.tls.ca_file == str(cert) and Alerting().auth == Auth()
    password.unlink()
    with pytest.raises(CredentialError, match=r"password_file .*: cannot be read: No such file or directory"):
        chat.auth.authorization()

    refused = {
        "        auth: {basic_auth: {username: u}}\n": "deployments[0].auth.basic_auth: give the password in one of",
        f"        auth: {{basic_auth: {{username: u, password_env: P, password_file: {cert}}}}}\n":
            "deployments[0].auth.basic_auth: give one of password_file, password_env, not both",
        "        auth: {basic_auth: {username: u, password_env: P}, bearer_token_env: T}\n":
            "deployments[0].auth: give at most one of bearer_token_file, bearer_token_env, basic_auth",
        f"        tls: {{key_file: {key}}}\n": "deployments[0].tls: key_file is the private key of a client "
                                             "certificate: give cert_file too",
    }
    for extra, message in refused.items():
        assert message in error_of(tmp_path, MINIMAL + extra)
    twins = MINIMAL.replace("static: [http://10.0.0.5:8000/metrics]",
                            "static: ['http://10.0.0.5:8000/metrics?token=a', 'http://10.0.0.5:8000/metrics?token=b']")
    assert twins != MINIMAL
    assert ("two static URLs differ only in a credential's value (http://10.0.0.5:8000/metrics?token=<redacted>)"
            in error_of(tmp_path, twins))


def test_calibration_and_bandwidth_sources(tmp_path: Path) -> None:
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps(CALIBRATION_DOCUMENT))
    config = load_config(str(write(tmp_path, MINIMAL + f"        calibration: {calibration}\n")))
    resolved = config.deployments[0].resolved
    assert resolved.bandwidth_source == "calibrated"
    assert resolved.setup.effective_bandwidth_bytes_per_second == 2.4e12
    assert resolved.setup.step_overhead_seconds == 0.003
    configured = load_config(str(write(tmp_path,
                                       MINIMAL + "        effective_bandwidth: 2TB\n        step_overhead: 2ms\n")))
    resolved = configured.deployments[0].resolved
    assert (resolved.bandwidth_source, resolved.setup.effective_bandwidth_bytes_per_second) == ("configured", 2e12)
    assert resolved.setup.step_overhead_seconds == pytest.approx(0.002)
    both = MINIMAL + f"        calibration: {calibration}\n        effective_bandwidth: 2e12\n"
    assert "not both" in error_of(tmp_path, both)
    calibration.write_text('{"points": []}')
    calibrated = MINIMAL + f"        calibration: {calibration}\n"
    assert "not `stepbudget calibrate --json` output" in error_of(tmp_path, calibrated)


CALIBRATION_DOCUMENT = {"effective_bandwidth_bytes_per_second": 2.4e12, "step_overhead_seconds": 0.003,
                        "agrees": True, "spread_ratio": 0.05, "tolerance_ratio": 0.15, "points": []}
QWEN3_WEIGHTS, QWEN3_KV = 8.19e9 * 2, 2 * 36 * 8 * 128 * 2


def calibrate_json(capsys: pytest.CaptureFixture[str], tmp_path: Path, *points: str) -> Path:
    """The file `stepbudget calibrate --itl ... --json > calibration.json` leaves, accepted or not."""
    cli.main(["calibrate", "--json", *(arg for point in points for arg in ("--itl", point))])
    path = tmp_path / "calibration.json"
    path.write_text(capsys.readouterr().out)
    return path


def test_a_calibration_calibrate_accepted_sets_the_rates_even_with_zero_overhead(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = calibrate_json(capsys, tmp_path, "0.0082@1000")  # one point: overhead not fitted, written as 0
    setup = load_config(str(write(tmp_path, MINIMAL + f"        calibration: {path}\n"))).deployments[0].resolved.setup
    assert setup.effective_bandwidth_bytes_per_second == pytest.approx((QWEN3_WEIGHTS + 1000 * QWEN3_KV) / 0.0082)
    assert setup.step_overhead_seconds == 0


def test_a_calibration_calibrate_rejected_is_refused_naming_deployment_file_and_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The long stream moves half the bytes per second the short one does: spread 100%, over 15%.
    short_gap, long_gap = (QWEN3_WEIGHTS + 1000 * QWEN3_KV) / 2e12, (QWEN3_WEIGHTS + 100_000 * QWEN3_KV) / 1e12
    path = calibrate_json(capsys, tmp_path, f"{short_gap!r}@1000", f"{long_gap!r}@100000")
    assert json.loads(path.read_text())["agrees"] is False
    message = error_of(tmp_path, MINIMAL + f"        calibration: {path}\n")
    assert f"stepbudget.yaml:7: deployments[0].calibration: deployment 'chat': calibration file '{path}'" in message
    assert "rejected by `stepbudget calibrate` (agrees: false)" in message
    assert "spread 100.0%, more than the 15% tolerance" in message and "re-run `stepbudget calibrate`" in message


def test_two_batch_sizes_calibrate_accepted_reach_the_daemon_with_their_per_request_cost(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 1 request of 1,000 tokens at 7.2 ms and 16 of 1,000 at 9.5 ms: their own bandwidths spread 16%
    # (more than 15%) yet a per-request cost reproduces both, so calibrate accepts them and so does serve.
    path = calibrate_json(capsys, tmp_path, "0.0072@1000x1", "0.0095@16000x16")
    document = json.loads(path.read_text())
    assert document["agrees"] is True and document["agreement_basis"] == "fit_residuals"
    a1, a2 = QWEN3_WEIGHTS + 1000 * QWEN3_KV, QWEN3_WEIGHTS + 16000 * QWEN3_KV
    inverse_bandwidth = (0.0095 - 16 * 0.0072) / (a2 - 16 * a1)  # 7.2 ms = a1/bw + r; 9.5 ms = a2/bw + 16 r
    setup = load_config(str(write(tmp_path, MINIMAL + f"        calibration: {path}\n"))).deployments[0].resolved.setup
    assert setup.effective_bandwidth_bytes_per_second == pytest.approx(1 / inverse_bandwidth, rel=1e-6)
    assert setup.per_request_seconds == pytest.approx(0.0072 - a1 * inverse_bandwidth, rel=1e-6)


def test_two_batch_sizes_calibrate_rejected_are_refused_naming_the_fits_miss(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 16 requests at 24 ms against 1 at 9 ms need 860 us per request, past the 300 us bound: the cost is
    # dropped and the bandwidth alone (least squares through the origin) misses the batch-1 point.
    path = calibrate_json(capsys, tmp_path, "9ms@2000", "24ms@32000x16")
    a1, a2 = QWEN3_WEIGHTS + 2000 * QWEN3_KV, QWEN3_WEIGHTS + 32000 * QWEN3_KV
    inverse_bandwidth = (a1 * 0.009 + a2 * 0.024) / (a1 ** 2 + a2 ** 2)
    worst_miss = max(abs(a * inverse_bandwidth - t) / t for a, t in ((a1, 0.009), (a2, 0.024)))
    assert json.loads(path.read_text())["spread_ratio"] == pytest.approx(worst_miss, rel=1e-6)
    message = error_of(tmp_path, MINIMAL + f"        calibration: {path}\n")
    assert f"its fitted terms miss a point by {worst_miss:.1%}, more than the 15% tolerance" in message


def test_a_calibration_with_a_per_request_cost_and_compute_sets_them(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**CALIBRATION_DOCUMENT, "per_request_seconds": 40e-6,
                                "effective_compute_flops_per_second": 600e12}))
    setup = load_config(str(write(tmp_path, MINIMAL + f"        calibration: {path}\n"))).deployments[0].resolved.setup
    assert setup.per_request_seconds == 40e-6 and setup.effective_compute_flops_per_second == 600e12
    path.write_text(json.dumps({**CALIBRATION_DOCUMENT, "per_request_seconds": None,
                                "effective_compute_flops_per_second": None}))
    setup = load_config(str(write(tmp_path, MINIMAL + f"        calibration: {path}\n"))).deployments[0].resolved.setup
    assert setup.per_request_seconds == 0
    assert setup.effective_compute_flops_per_second == pytest.approx(0.5 * 989e12, rel=0.01)


def test_weight_dtype_follows_the_checkpoint_unless_given(tmp_path: Path) -> None:
    checkpoint = tmp_path / "config.json"
    checkpoint.write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "quantization_config": {"quant_method": "awq", "bits": 4}}))
    text = MINIMAL.replace("model: qwen3-8b", f"model: {checkpoint}")
    assert load_config(str(write(tmp_path, text))).deployments[0].resolved.setup.weight_bytes_per_param == 0.5
    assert load_config(str(write(tmp_path, MINIMAL))).deployments[0].resolved.setup.weight_bytes_per_param == 2.0
    given = load_config(str(write(tmp_path, text + "        weight_dtype: bf16\n")))
    assert given.deployments[0].resolved.setup.weight_bytes_per_param == 2.0


@pytest.mark.parametrize("change, expected", [
    ({"agrees": None}, "lacks agrees"),
    ({"effective_bandwidth_bytes_per_second": None, "tolerance_ratio": None},
     "lacks effective_bandwidth_bytes_per_second, tolerance_ratio"),
    ({"effective_bandwidth_bytes_per_second": 0},
     "unusable effective_bandwidth_bytes_per_second: must be greater than zero"),
    ({"effective_bandwidth_bytes_per_second": math.inf},
     "unusable effective_bandwidth_bytes_per_second: expected a number"),
    ({"step_overhead_seconds": -0.001}, "unusable step_overhead_seconds: must not be negative"),
    ({"step_overhead_seconds": math.nan}, "unusable step_overhead_seconds: expected a number"),
    ({"spread_ratio": "wide"}, "unusable spread_ratio: expected a number"),
    ({"agrees": "yes"}, "unusable agrees: expected true or false, got 'yes'"),
    ({"per_request_seconds": -1e-6}, "unusable per_request_seconds: must not be negative"),
    ({"effective_compute_flops_per_second": 0},
     "unusable effective_compute_flops_per_second: must be greater than zero"),
    ({"spread_ratio": 0.4}, "says agrees: true but its spread_ratio 0.4 and tolerance_ratio 0.15 say otherwise"),
])
def test_a_calibration_file_is_checked_key_by_key(tmp_path: Path, change: dict, expected: str) -> None:
    document = {key: value for key, value in {**CALIBRATION_DOCUMENT, **change}.items() if value is not None}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(document))  # json writes NaN and Infinity, as Python's json reads them
    message = error_of(tmp_path, MINIMAL + f"        calibration: {path}\n")
    assert f"deployments[0].calibration: deployment 'chat': calibration file '{path}'" in message
    assert expected in message


@pytest.mark.parametrize("overhead", ["0", "0ms", "0.0"])
def test_a_zero_step_overhead_is_accepted(tmp_path: Path, overhead: str) -> None:
    config = load_config(str(write(tmp_path, MINIMAL + f"        step_overhead: {overhead}\n")))
    assert config.deployments[0].resolved.setup.step_overhead_seconds == 0


@pytest.mark.parametrize("overhead, expected", [
    ("-1", "must not be negative, got -1"),
    ("-2ms", "cannot read '-2ms' as a duration"),
    (".nan", "must be a finite number, got nan"),
    (".inf", "must be a finite number, got inf"),
])
def test_a_negative_or_non_finite_step_overhead_is_refused(tmp_path: Path, overhead: str, expected: str) -> None:
    message = error_of(tmp_path, MINIMAL + f"        step_overhead: {overhead}\n")
    assert "stepbudget.yaml:7: deployments[0].step_overhead: " in message and expected in message


def test_a_tensor_parallel_size_vllm_refuses_fails_at_its_line(tmp_path: Path) -> None:
    message = error_of(tmp_path, MINIMAL + "        tensor_parallel: 3\n")
    assert ("stepbudget.yaml:7: deployments[0].tensor_parallel: tensor parallel 3 does not fit model 'qwen3-8b'"
            in message)
    assert "Total number of attention heads (32) must be divisible by tensor parallel size (3)." in message


def test_the_model_key_reads_a_preset_whatever_the_working_directory_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen3-8b").mkdir()
    assert load_config(str(write(tmp_path, MINIMAL))).deployments[0].architecture.name == "qwen3-8b"
    (tmp_path / "mine").write_text("{}")
    message = error_of(tmp_path, MINIMAL.replace("qwen3-8b", "mine"))
    assert "stepbudget.yaml:3: deployments[0].model: model 'mine' is not a model preset" in message
    assert "write it as a path: ./mine" in message


def test_model_keys_reach_the_setup(tmp_path: Path) -> None:
    config = load_config(str(write(tmp_path, MINIMAL + """\
        gpu_memory: 40GB
        weight_dtype: fp8
        kv_cache_dtype: fp8
        gpu_memory_utilization: 0.8
        tensor_parallel: 2
        params: 8.0e9
    """)))
    setup = config.deployments[0].resolved.setup
    assert (setup.gpu_memory_bytes, setup.weight_bytes_per_param, setup.kv_bytes_per_element) == (40e9, 1, 1)
    assert (setup.gpu_memory_utilization, setup.tensor_parallel, setup.architecture.params) == (0.8, 2, 8.0e9)


def test_extension_sections(tmp_path: Path) -> None:
    """A feature declares its section with the public validators; the loader takes the list it is given."""
    extra = Section("sharding_test", {"index": Key(string, "0", "this shard"), "of": Key(string, "1", "shards")})
    path = write(tmp_path, "sharding_test: {index: '2', of: '3'}\n" + textwrap.dedent(MINIMAL))
    config = config_from_mapping(read_document(str(path)), str(path), sections=(extra,))
    assert config.sections["sharding_test"] == {"index": "2", "of": "3"}
    bad = write(tmp_path, "sharding_test: {whom: x}\n" + textwrap.dedent(MINIMAL))
    with pytest.raises(ConfigError, match=r"stepbudget.yaml:1: sharding_test.whom: unknown key"):
        config_from_mapping(read_document(str(bad)), str(bad), sections=(extra,))
    unknown = error_of(tmp_path, "sharding_test: {index: '2'}\n" + textwrap.dedent(MINIMAL))
    assert "sharding_test: unknown key" in unknown
    with pytest.raises(ValueError, match="listen"):
        top_level_keys((Section("listen", {}),))


def test_the_optional_sections_are_listed_in_one_place() -> None:
    assert [extra.name for extra in daemon_sections()] == ["shard", "admission", "pools"]
    assert set(top_level_keys()) >= {"listen", "deployments", "shard", "admission", "pools"}


def _fresh_python(code: str) -> str:
    """Run `code` in a new interpreter: which modules got imported is only visible from a clean start."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_check_config_does_not_import_the_daemon_stack(tmp_path: Path) -> None:
    """`check-config` validates every section, yet never pays for (or depends on) the poller and server."""
    path = write(tmp_path, "shard: {index: 0, count: 2}\npools: {short: chat, long: chat2, split_tokens: 8000}\n"
                 + textwrap.dedent(MINIMAL) + "  - name: chat2\n    model: qwen3-8b\n    gpu: h100-sxm\n"
                 "    targets: {static: [http://10.0.0.6:8000/metrics]}\n")
    loaded = _fresh_python(f"""
        import sys
        from exporter import cli
        assert cli.main(["check-config", {str(path)!r}]) == 0
        print(" ".join(sorted(name for name in sys.modules if name.startswith("exporter"))))
    """)
    modules = set(loaded.splitlines()[-1].split())
    assert "exporter.serve.config" in modules
    assert not modules & {"exporter.serve.daemon", "exporter.serve.poller", "exporter.serve.server",
                          "exporter.serve.discovery",
                          "exporter.serve.alerting", "exporter.serve.collector"}, modules


def test_validity_does_not_depend_on_import_order() -> None:
    """Importing the config alone knows every section: nothing is added by importing a feature."""
    output = _fresh_python("""
        from exporter.serve.config import config_from_mapping
        config = config_from_mapping({"shard": {"index": 1, "count": 3}, "deployments": [
            {"name": "chat", "model": "qwen3-8b", "gpu": "h100-sxm", "targets": {"static": ["http://a:8000/metrics"]}}]})
        print(dict(config.sections["shard"]))
    """)
    assert output.strip() == "{'index': 1, 'count': 3}"


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args(argv)


def test_serve_flags_override_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "poll_interval: 30s\n" + textwrap.dedent(MINIMAL))
    config = config_from_args(parse_serve(["--config", str(path), "--poll-interval", "2s", "--listen", "127.0.0.1:0",
                                           "--timeout", "1s", "--stale-after", "10s", "--log-format", "json",
                                           "--alertmanager-url", "http://127.0.0.1:9093", "--alert-for", "1m"]))
    assert (config.poll_interval_seconds, config.listen, config.timeout_seconds,
            config.stale_after_seconds) == (2, "127.0.0.1:0", 1, 10)
    assert config.log_format == "json"
    assert config.alerting.alertmanager_urls == ("http://127.0.0.1:9093",) and config.alerting.for_seconds == 60
    with pytest.raises(ConfigError, match="poll_interval: cannot read 'often'"):
        config_from_args(parse_serve(["--config", str(path), "--poll-interval", "often"]))


def test_serve_without_a_file(tmp_path: Path) -> None:
    config = config_from_args(parse_serve(["--target", "http://127.0.0.1:8000/metrics", "--target", "http://127.0.0.1:8001/metrics",
                                           "--model", "llama-3.1-8b", "--gpu", "a100-80gb", "--target-tps", "30"]))
    [deployment] = config.deployments
    assert deployment.static_urls == ("http://127.0.0.1:8000/metrics", "http://127.0.0.1:8001/metrics")
    assert (deployment.model, deployment.gpu, deployment.target_tokens_per_second) == ("llama-3.1-8b", "a100-80gb", 30)
    with pytest.raises(Exception, match="--target needs --model and --gpu"):
        config_from_args(parse_serve(["--target", "http://127.0.0.1:8000/metrics"]))
    with pytest.raises(Exception, match="give --config FILE"):
        config_from_args(parse_serve([]))


def test_check_config_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, MINIMAL)
    assert cli.main(["check-config", str(good)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{good}: ok: 1 deployment(s) (chat), discovery static") and out.count("\n") == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text(textwrap.dedent(MINIMAL).replace("h100-sxm", "h100"))
    assert cli.main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "deployments[0].gpu" in err and "bad.yaml:4:" in err and err.count("\n") == 1
    assert cli.main(["check-config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the config" in capsys.readouterr().err


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.name for path in EXAMPLES])
def test_shipped_examples_are_valid(example: Path, capsys: pytest.CaptureFixture[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(example.parent.parent)  # examples name files relative to the repository
    assert cli.main(["check-config", str(example)]) == 0, capsys.readouterr().err


def test_there_are_examples_for_each_discovery_mode() -> None:
    text = "\n".join(path.read_text() for path in EXAMPLES)
    for mode in ("static:", "dns:", "kubernetes:"):
        assert mode in text


def _nested_key_names(schema: dict) -> set[str]:
    """Every key name a JSON schema of the key tables holds, at any depth (lists and alternatives too)."""
    names = set(schema.get("properties", {}))
    children = [*schema.get("properties", {}).values(), *schema.get("anyOf", [])]
    if isinstance(schema.get("items"), dict):
        children.append(schema["items"])
    return names.union(*(_nested_key_names(child) for child in children))


def test_every_config_key_is_documented() -> None:
    """Every key of the core tables at any depth, found by walking them (a hand-kept list of tables
    missed `online_calibration`'s), and every top-level section name."""
    from exporter.serve import config
    from exporter.serve.config_schema import table_schema

    doc = (REPO / "docs" / "operations.md").read_text()
    names = set(config.TOP_LEVEL_KEYS) | _nested_key_names(table_schema(config.CORE_KEYS))
    assert {"history", "holdout", "min_windows", "prometheus_url", "tenant", "ca_file"} <= names  # the walk reaches
    missing = sorted(name for name in names if f"`{name}`" not in doc)
    assert not missing, f"keys missing from docs/operations.md: {missing}"


def test_the_old_engine_key_names_its_new_name(tmp_path: Path) -> None:
    """`engine` was the page format; it is now `kind` (`engine` is only the engine index)."""
    path = tmp_path / "old.yaml"
    path.write_text("deployments:\n  - name: chat\n    model: qwen3-8b\n    gpu: h100-sxm\n    engine: vllm\n"
                    "    targets: {static: [http://127.0.0.1:8000/metrics]}\n")
    with pytest.raises(ConfigError) as raised:
        load_config(str(path))
    message = str(raised.value)
    assert "engine" in message and "renamed to 'kind'" in message and ":5:" in message


# --- stale_after against the poll interval and the timeouts --------------------------------------


def _prometheus_minimal(**prometheus: str) -> str:
    keys = "".join(f"\n                {key}: {value}" for key, value in prometheus.items())
    return textwrap.dedent(f"""\
        deployments:
          - name: chat
            model: qwen3-8b
            gpu: h100-sxm
            targets:
              prometheus:
                url: http://prom:9090
                selector: job="vllm"{keys}
    """)


def test_a_stale_after_one_failed_poll_would_outlast_is_refused_saying_what_to_set(tmp_path: Path) -> None:
    """poll_interval 60 s, stale_after 60 s: a target whose one poll fails (here by its 5 s timeout) is
    65 s past its last success at that poll, so its values and the alerts' `for` timers were dropped."""
    message = error_of(tmp_path, "poll_interval: 60s\nstale_after: 60s\n" + textwrap.dedent(MINIMAL))
    assert message.startswith(f"{tmp_path / 'stepbudget.yaml'}:2: stale_after: 60s is not longer than "
                              "poll_interval + timeout (60s + 5s = 65s)")
    assert "set stale_after to at least 125s (2 x poll_interval + timeout)" in message
    # One second over the bound is accepted: a single failed poll keeps the values.
    config = load_config(str(write(tmp_path, "poll_interval: 60s\nstale_after: 66s\n" + textwrap.dedent(MINIMAL))))
    assert config.stale_after_seconds == 66


def test_stale_after_not_given_follows_the_poll_interval(tmp_path: Path) -> None:
    """60 s unless 2 x poll_interval + timeout is longer: 60 s polls with a 5 s timeout keep values 125 s."""
    slow = load_config(str(write(tmp_path, "poll_interval: 60s\n" + textwrap.dedent(MINIMAL))))
    assert slow.stale_after_seconds == 2 * 60 + 5
    fast = load_config(str(write(tmp_path, "poll_interval: 10s\ntimeout: 2s\n" + textwrap.dedent(MINIMAL))))
    assert fast.stale_after_seconds == 60


def test_the_prometheus_query_timeout_defaults_from_the_poll_interval(tmp_path: Path) -> None:
    """0.8 x poll_interval (12 s at 15 s: the ~10 s a 2,000-engine query takes), never under `timeout`."""
    (deployment,) = load_config(str(write(tmp_path, _prometheus_minimal()))).deployments
    assert deployment.prometheus is not None and deployment.prometheus.query_timeout_seconds == 12
    short = load_config(str(write(tmp_path, "poll_interval: 2s\n" + _prometheus_minimal())))
    assert short.deployments[0].prometheus.query_timeout_seconds == 5  # type: ignore[union-attr]  # prometheus is set: the line above asserts it
    given = load_config(str(write(tmp_path, "poll_interval: 30s\n" + _prometheus_minimal(query_timeout="40s"))))
    assert given.deployments[0].prometheus.query_timeout_seconds == 40  # type: ignore[union-attr]  # prometheus is set: a prometheus source
    assert given.stale_after_seconds == 2 * 30 + 40  # the slowest read a poll may wait for


def test_stale_after_is_checked_against_a_deployments_query_timeout(tmp_path: Path) -> None:
    message = error_of(tmp_path, "poll_interval: 30s\nstale_after: 60s\n" + _prometheus_minimal(query_timeout="40s"))
    assert ("stale_after: 60s is not longer than poll_interval + "
            "deployments[0].targets.prometheus.query_timeout (30s + 40s = 70s)") in message
    assert "at least 100s" in message


# --- online_calibration.holdout against StepBudgetPredictionDrift's `for` --------------------------


def test_a_holdout_the_drift_alert_would_not_outlast_is_refused_saying_what_to_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The holdout is how long a change of the server's speed shows as prediction error before the fit
    takes it in: shorter than the drift alert's `for` (15m in the rules) + two polls, the change can be
    fitted before the alert fires (tests/serve/test_online_calibration.py shows it absorbed unseen)."""
    text = "defaults:\n  online_calibration:\n    holdout: 10m\n" + textwrap.dedent(MINIMAL)
    message = error_of(tmp_path, text)
    assert message.startswith(f"{tmp_path / 'stepbudget.yaml'}:3: defaults.online_calibration.holdout: "
                              "deployment 'chat': holdout 600s is shorter than the rules' StepBudgetPredictionDrift "
                              "`for` (900s) + 2 x poll_interval (15s) = 930s"), message
    assert "set holdout to at least 930s (default 30m), or shorten the alert's `for` with alerting.drift_for" in message
    assert cli.main(["check-config", str(write(tmp_path, text))]) == 2
    assert "holdout 600s is shorter" in capsys.readouterr().err
    # A deployment's own holdout is named at its own line.
    own = textwrap.dedent(MINIMAL) + "    online_calibration: {holdout: 5m}\n"
    assert ":7: deployments[0].online_calibration.holdout: deployment 'chat': holdout 300s" in error_of(tmp_path, own)
    # Accepted: long enough, the drift alert's `for` shortened with it, or no online calibration.
    assert load_config(str(write(tmp_path, "defaults:\n  online_calibration:\n    holdout: 930s\n"
                                 + textwrap.dedent(MINIMAL))))
    scaled = load_config(str(write(tmp_path, "alerting:\n  drift_for: 5m\n" + text)))
    assert scaled.alerting.drift_for_seconds == 300
    assert load_config(str(write(tmp_path, textwrap.dedent(MINIMAL)
                                 + "    online_calibration: {enabled: false, holdout: 1m}\n")))
    # Not given, the built-in 30m grows to the floor (a long drift `for`, hour-long polls), as
    # stale_after does.
    grown = load_config(str(write(tmp_path, "alerting:\n  drift_for: 1h\n" + textwrap.dedent(MINIMAL))))
    assert grown.deployments[0].online_calibration.holdout_seconds == 3600 + 2 * 15
    slow = load_config(str(write(tmp_path, "poll_interval: 1h\n" + textwrap.dedent(MINIMAL))))
    assert slow.deployments[0].online_calibration.holdout_seconds == 900 + 2 * 3600


def test_the_drift_for_the_config_checks_is_the_rules_and_the_loop_uses_alerting_drift_for() -> None:
    from exporter.serve.alerting import AlertLoop
    from exporter.serve.config import Alerting, packaged_drift_for_seconds

    assert packaged_drift_for_seconds() == 900.0  # rules/stepbudget.alerts.yaml: for: 15m
    loop = AlertLoop(Alerting(drift_for_seconds=60.0, for_seconds=120.0), poll_interval_seconds=15.0)
    fors = {rule.name: rule.for_seconds for rule in loop.rules}
    assert fors["StepBudgetPredictionDrift"] == 60.0 and fors["StepBudgetPredictedStepOverBudget"] == 120.0
    assert {rule.name: rule.for_seconds for rule in AlertLoop(Alerting(), poll_interval_seconds=15.0).rules}[
        "StepBudgetPredictionDrift"] == 900.0


def test_a_bad_external_label_is_named_at_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, textwrap.dedent(MINIMAL) + "alerting:\n  external_labels:\n    cluster-name: prod\n")
    with pytest.raises(ConfigError, match=r"stepbudget.yaml:9: alerting.external_labels.cluster-name: "
                                          r"'cluster-name' is not a Prometheus label name"):
        load_config(path)
    path = write(tmp_path, textwrap.dedent(MINIMAL) + "alerting:\n  external_labels: {cluster: prod-eu}\n"
                                                       "  runbook_base_url: https://wiki.example.com/rb.md\n")
    alerting = load_config(path).alerting
    assert alerting.external_labels == {"cluster": "prod-eu"}
    assert alerting.runbook_base_url == "https://wiki.example.com/rb.md"
