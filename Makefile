# The two commands of README.md: `make repro` and `make test`. Both create or refresh .venv
# from pyproject.toml, with the exact versions of constraints.txt, and reports/node_modules
# (the vega bundles of the plots page) from reports/package-lock.json.
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
NPM_STAMP := reports/node_modules/.installed
# Stage commands (`python -m stages.X`) and tests must find the venv's python, dvc, torchrun.
export PATH := $(BIN):$(PATH)
export DVC_NO_ANALYTICS := 1
export PREFECT_HOME := $(CURDIR)/.state/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false

# `make serve`: a local Prefect server on 127.0.0.1:$(PREFECT_PORT) and the served deployments,
# in the background (logs and pids under .state/); `make stop` stops both. SERVE_ARGS go to
# `python -m flows.serve`, e.g. SERVE_ARGS="--pipeline 60 --sweep off".
PREFECT_PORT ?= 4200
SERVE_ARGS ?=

.PHONY: setup repro report test test-fast lint format bench clean serve stop flow-runs

setup: $(STAMP) $(NPM_STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

# npm ci empties node_modules first, so the stamp inside it goes too until the install succeeds.
$(NPM_STAMP): reports/package.json reports/package-lock.json
	cd reports && npm ci --ignore-scripts --no-audit --no-fund
	touch $(NPM_STAMP)

repro: setup
	dvc repro
	python -m reports.build

report: setup
	python -m reports.build

test: setup lint
	python -m pytest

test-fast: setup
	python -m pytest -m "not slow"

lint: setup
	ruff check .
	ruff format --check .

format: setup
	ruff check --fix .
	ruff format .

bench: setup
	python -m benchmarks.loader

serve: setup
	python -m flows.service start --port $(PREFECT_PORT) $(SERVE_ARGS)

# Standard library only: works with any python3, even without .venv.
stop:
	python3 -m flows.service stop

flow-runs:
	@test -f .state/prefect.env || { echo "no local Prefect server: run make serve first"; exit 2; }
	. .state/prefect.env && prefect flow-run ls

clean: stop
	rm -rf $(VENV) .state reports/node_modules reports/plots
