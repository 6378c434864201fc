# lmops: `make run` trains and promotes a model, `make test` runs the whole suite.
# Both create .venv on first use from the exact pins in requirements.lock.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
LINT_PATHS := src tests benchmarks production_service kubeflow deploy template.py

.DEFAULT_GOAL := help
.PHONY: help install run test test-fast lint format mlflow-ui serve clean monitoring-tools browser-tools backends client-tools

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

test: install ## run the whole test suite
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest

test-fast: install ## unit tests only
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest tests/unit

# Prometheus, promtool and amtool for tests/monitoring (real rules, a real Prometheus).
# Fails where they are missing and apt-get is not there to install them: CI must not skip.
monitoring-tools: ## install Debian's prometheus + prometheus-alertmanager (promtool, amtool) via apt
	@if command -v prometheus >/dev/null && command -v promtool >/dev/null && command -v amtool >/dev/null; then \
		echo "prometheus, promtool and amtool are installed"; \
	elif command -v apt-get >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager; \
	else \
		echo "install Prometheus (prometheus, promtool) and Alertmanager (amtool) 2.x/0.2x: no apt-get here" >&2; exit 1; \
	fi

# Headless Chromium for the browser tests (tests/browser.py: the plots page, the MLflow UI).
browser-tools: ## install Debian's chromium (headless screenshots in the tests) via apt
	@if command -v chromium >/dev/null; then \
		echo "chromium is installed"; \
	elif command -v apt-get >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends chromium; \
	else \
		echo "install Chromium (the \`chromium\` command): no apt-get here" >&2; exit 1; \
	fi

# The production backends tests/backends runs the pipeline against, for real: Debian's
# PostgreSQL (the MLflow backend store) here, moto's S3 server (artifacts, the DVC remote)
# from requirements-dev.lock. The tests start and stop the servers themselves.
# Fails where PostgreSQL is missing and apt-get is not there to install it: CI must not skip.
backends: install ## install Debian's postgresql via apt (moto_server, psycopg2, boto3 come with make install)
	@if ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null; then \
		echo "postgresql is installed"; \
	elif command -v apt-get >/dev/null; then \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends postgresql; \
	else \
		echo "install PostgreSQL 13 or later (initdb, pg_ctl): no apt-get here" >&2; exit 1; \
	fi
	@test -x $(BIN)/moto_server || { echo "$(BIN)/moto_server missing: make install (requirements-dev.lock pins moto[server])" >&2; exit 1; }

# The real clients the service tests drive (tests/service/test_clients.py), each in its own
# venv (their pins clash with ours): lm-evaluation-harness and guidellm. torch first, so
# no CUDA build is pulled in.
CLIENTS := .venv-clients
$(CLIENTS)/%/.installed-stamp: requirements-clients.txt
	@test -x $(CLIENTS)/$*/bin/python || $(PYTHON) -m venv $(CLIENTS)/$*
	$(CLIENTS)/$*/bin/python -m pip install --quiet torch==2.13.0
	$(CLIENTS)/$*/bin/python -m pip install --quiet $$(grep -E '^$*[=\[]' requirements-clients.txt)
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
