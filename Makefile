# The two commands of README.md: `make repro` and `make test`. Both create or refresh .venv
# from pyproject.toml, with the exact versions of constraints.txt, and reports/node_modules
# (the vega bundles of the plots page) from reports/package-lock.json.
# The interpreter a new .venv is made from: Debian's python3.11 where it can make one (built
# with profile-guided and link-time optimisation and linked statically: tests and stages, mostly
# Python start-up, cost 10-20% fewer CPU seconds than under pyenv's default build; measured in
# docs/development.md#tests), else python3. `make setup PYTHON=...` picks another.
PYTHON ?= $(or $(shell /usr/bin/python3.11 -c 'import ensurepip' 2>/dev/null && echo /usr/bin/python3.11),python3)
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
NPM_STAMP := reports/node_modules/.installed
# Stage commands (`python -m stages.X`) and tests must find the venv's python, dvc, torchrun.
export PATH := $(BIN):$(PATH)
export DVC_NO_ANALYTICS := 1
export PREFECT_HOME := $(CURDIR)/.state/prefect
export PREFECT_SERVER_ANALYTICS_ENABLED := false

# `make serve`: Prefect's own server, work pool, deployments (prefect.yaml) and two workers,
# in the background, with the credential of .state/prefect.env (made once, mode 0600, in a
# 0700 folder; logs and pids under .state/); SQLite unless PREFECT_DB names a database
# (postgresql+asyncpg://USER:PASSWORD@HOST:5432/DB). Every run clones REPO (default: this
# project) into a temporary folder of the worker, runs `dvc exp run` there and returns the
# experiment with `dvc exp push`. `make worker GPU=N` adds a worker whose runs see only GPU N
# (CUDA_VISIBLE_DEVICES), here or on any machine with the package installed and the server's
# .state/prefect.env copied over. `make stop` stops what both started; `make flow-runs` lists
# the runs. SERVE_ARGS go to `python -m flows.service start`, e.g. SERVE_ARGS="--gpu 0 --limit 2";
# schedules are in prefect.yaml. Docs: docs/orchestration.md, docs/team.md.
PREFECT_PORT ?= 4200
PREFECT_DB ?=
REPO ?=
SERVE_ARGS ?=
GPU ?=
WORKER_ARGS ?=

.PHONY: setup repro report docs test test-fast lint format bench clean serve worker stop flow-runs

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

# docs/parameters.md is generated from the params schema (a unit test fails when it is stale).
docs: setup
	python -m tools.paramdoc --write
	python -m tools.doclinks

# Two pytest-xdist workers (the machine has two cores; a serial run leaves one mostly idle).
# Tests that share a server or a costly module fixture carry an xdist_group marker.
test: setup lint
	python -m pytest -n 2 --dist loadgroup

# The inner loop: everything but the `slow` tests (real dvc, torchrun, servers, browser).
test-fast: setup
	python -m pytest -m "not slow" -n 2 --dist loadgroup

lint: setup
	ruff check .
	ruff format --check .

format: setup
	ruff check --fix .
	ruff format .

bench: setup
	python -m benchmarks.loader

serve: setup
	python -m flows.service start --port $(PREFECT_PORT) \
		$(if $(PREFECT_DB),--database-url '$(PREFECT_DB)') $(if $(REPO),--repo '$(REPO)') $(SERVE_ARGS)

worker: setup
	python -m flows.service worker $(if $(GPU),--gpu $(GPU)) $(WORKER_ARGS)

# flows.service imports the standard library only: works with any python3, even without .venv.
stop:
	python3 -m flows.service stop

flow-runs:
	@test -f .state/prefect.env || { echo "no local Prefect server: run make serve first"; exit 2; }
	. .state/prefect.env && prefect flow-run ls

clean: stop
	rm -rf $(VENV) .state reports/node_modules reports/plots
