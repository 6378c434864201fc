# lmops: `make run` trains and promotes a model, `make test` runs the whole suite.
# Both create .venv on first use from the exact pins in requirements.lock.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
LINT_PATHS := src tests benchmarks production_service kubeflow deploy template.py

.DEFAULT_GOAL := help
.PHONY: help install run test test-fast lint format mlflow-ui serve clean system-tools monitoring-tools browser-tools backends client-tools

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk -F':.*?## ' '{printf "  %-18s %s\n", $$1, $$2}'

$(STAMP): requirements.lock requirements-dev.lock pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.lock
	@# -qq: setuptools' notice on every editable install of a multi-root layout (src/ and .) is no news
	$(BIN)/python -m pip install -qq --no-deps -e .
	@touch $@

install: $(STAMP) ## create .venv and install the pinned dependencies and lmops

run: install ## run the whole pipeline (dvc repro): corpus -> promoted model
	$(BIN)/python template.py
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dvc repro

# Two pytest workers (pytest-xdist), each test file whole on one, so its module fixtures are
# built once: the suite spends most of its time waiting on subprocesses (servers, training
# runs, Prometheus windows), so a second worker shortens it on 2 cores. PYTEST_WORKERS=0
# runs it in one process.
PYTEST_WORKERS ?= 2
test: install ## run the whole test suite
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest --numprocesses=$(PYTEST_WORKERS) --dist=loadfile --durations=30

test-fast: install ## unit tests only
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest tests/unit

# The Debian packages the tests run for real, in one apt-get where any is missing:
# Prometheus, promtool and amtool (tests/monitoring: real rules, a real Prometheus),
# Chromium (tests/browser.py: the plots page, the MLflow UI), PostgreSQL (tests/backends:
# the MLflow backend store; moto's S3 server comes from requirements-dev.lock), tcmalloc
# (the allocator the service preloads: production_service/server.py, serving_env).
# Fails where they are missing and apt-get is not there: CI must not skip.
SYSTEM_PACKAGES := prometheus prometheus-alertmanager chromium postgresql libtcmalloc-minimal4
system-tools: ## install Debian's prometheus, prometheus-alertmanager, chromium, postgresql and tcmalloc via apt
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || echo $$p; done); \
	if [ -z "$$missing" ]; then \
		echo "$(SYSTEM_PACKAGES) are installed"; \
	elif command -v apt-get >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	else \
		echo "install $$missing (Debian's packages: Prometheus 2.x, Alertmanager 0.2x, Chromium, PostgreSQL 13+, tcmalloc): no apt-get here" >&2; exit 1; \
	fi

monitoring-tools browser-tools: system-tools ## (the same packages, by what needs them)

backends: system-tools install ## system-tools, and moto_server, psycopg2, boto3 from make install
	@test -x $(BIN)/moto_server || { echo "$(BIN)/moto_server missing: make install (requirements-dev.lock pins moto[server])" >&2; exit 1; }

# The real clients the service tests drive (tests/service/test_clients.py), each in its own
# venv (their pins clash with ours): lm-evaluation-harness and guidellm. uv (pinned in
# requirements-dev.lock) installs both: its cache hardlinks the big wheels (torch) into
# each venv. torch is the CPU build, 2.13.0+cpu, from pip's configured find-links (a local
# wheel directory), so the CUDA one is never resolved; elsewhere name a source for it:
#   make client-tools CLIENT_TORCH_SOURCE='--extra-index-url https://download.pytorch.org/whl/cpu'
CLIENTS := .venv-clients
PIP_FIND_LINKS ?= $(shell $(BIN)/python -m pip config get global.find-links 2>/dev/null)
CLIENT_TORCH_SOURCE ?= $(addprefix --find-links ,$(PIP_FIND_LINKS))
$(CLIENTS)/%/.installed-stamp: requirements-clients.txt $(STAMP)
	UV_PYTHON_DOWNLOADS=never $(BIN)/uv venv --quiet --allow-existing --python $(PYTHON) $(CLIENTS)/$*
	$(BIN)/uv pip install --quiet --python $(CLIENTS)/$*/bin/python $(CLIENT_TORCH_SOURCE) \
		torch==2.13.0+cpu $$(grep -E '^$*[=\[]' requirements-clients.txt)
	@touch $@

client-tools: $(CLIENTS)/lm-eval/.installed-stamp $(CLIENTS)/guidellm/.installed-stamp ## venvs for lm-eval and guidellm (the live client tests)

lint: install ## ruff lint + format check
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

format: install ## apply ruff's formatting and safe fixes
	$(BIN)/ruff check --fix $(LINT_PATHS)
	$(BIN)/ruff format $(LINT_PATHS)

mlflow-ui: install ## MLflow UI on the tracking store the pipeline wrote; prints the links to the newest run and the model
	@$(BIN)/lmops links --url http://127.0.0.1:$${MLFLOW_PORT:-5000} || true
	$(BIN)/mlflow ui --backend-store-uri $${MLFLOW_TRACKING_URI:-sqlite:///mlflow.db} --host 127.0.0.1 --port $${MLFLOW_PORT:-5000}

serve: install ## serve the promoted model with gunicorn on :5001, probes on :5002 (HOST/PORT/LMOPS_* env honoured)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/lmops serve

clean: ## remove pipeline outputs (keeps .venv and the DVC cache)
	rm -rf data/raw data/processed artifacts/* production_service/model mlflow.db

-include deploy/deploy.mk
