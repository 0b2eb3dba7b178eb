# The two commands of README.md: `make repro` and `make test`. Both create or refresh .venv
# from pyproject.toml, with the exact versions of constraints.txt.
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
# Stage commands (`python -m stages.X`) and tests must find the venv's python, dvc, torchrun.
export PATH := $(BIN):$(PATH)
export DVC_NO_ANALYTICS := 1
export PREFECT_HOME := $(CURDIR)/.state/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: setup repro test test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[test]'
	touch $(STAMP)

repro: setup
	dvc repro

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
	rm -rf $(VENV) .state
