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

.PHONY: setup repro report test test-fast lint format bench clean

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

clean:
	rm -rf $(VENV) .state reports/node_modules reports/plots
