"""The sweep flow: a grid of experiments, run as Prefect work, compared in one report.

Every combination of the grid (default: the three update strategies x fp32/bf16 x two
seeds, at a small ``train.kimg``) is validated by the params schema first; then each is one
run of the deployment ``ganpipe-pipeline/experiment``: a flow run of its own that any
worker of the work pool may take, in a fresh clone at the commit the sweep started from,
returned as a DVC experiment (:mod:`flows.pipeline`). The sweep starts them all (at most
``parallel`` unfinished at once, if given) and waits for their final states; N workers run
N at a time. Cancelling the sweep cancels them; one whose worker died is marked Crashed by
the server (no heartbeat) and started again if ``retries`` allows. Then the comparison is
published as Prefect artifacts (a ranking table and a markdown report) and, when the
project is a folder on this machine, written to its ``reports/sweeps/NAME.md`` (+ ``.png``,
``.json``): the place comes from the sweep's validated name, never from a caller's path.

On demand, with the server's credentials (``. .state/prefect.env``; docs/orchestration.md)::

    prefect deployment run ganpipe-sweep/scheduled --param sweep_name=tiny \\
        --param grid='{"train.strategy": ["d_first_detach", "g_first_detach"]}' \\
        --param base='{"train.kimg": 1}'

The sweep runs on the ``sweeps`` queue's worker, its experiments on the ``experiments`` queue's
(``make serve``, ``make worker GPU=N``); without workers they wait, Scheduled.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.runtime import flow_run as this_flow_run
from prefect.runtime import task_run as this_task_run
from prefect.states import Cancelled, Cancelling
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import Field

from flows import clone
from flows.pipeline import (
    retry_only_transient,
    run_logger,
)
from ganpipe.overrides import ParamsError, validate_overrides
from reports import ranking as report

#: The deployment a sweep runs each experiment as (prefect.yaml).
EXPERIMENT = "ganpipe-pipeline/experiment"

#: The question this project started from: which update strategy, at which precision.
DEFAULT_GRID: dict[str, list[Any]] = {
    "train.strategy": ["d_first_retain", "d_first_detach", "g_first_detach"],
    "precision": ["fp32", "bf16"],
    "seed": [0, 1],
}
#: The most combinations one sweep runs (each is a flow run and a thread of the sweep).
MAX_POINTS = 256
#: Shared by every run of the default sweep: short training (20k images per run).
DEFAULT_BASE: dict[str, Any] = {"train.kimg": 20}


def plan_runs(
    grid: dict[str, list[Any]], base: dict[str, Any], sweep_name: str
) -> dict[str, dict[str, Any]]:
    """Experiment name -> grid values, one per combination, in grid order.

    Raises:
        ParamsError: an empty grid or an empty list of values.
    """
    if not isinstance(grid, dict) or not grid:
        raise ParamsError("grid", [("grid", "give a mapping of params keys to lists of values")])
    if not isinstance(base, dict):
        raise ParamsError("base", [("base", "give a mapping of params keys to values")])
    empty = [key for key, values in grid.items() if not isinstance(values, list) or not values]
    if empty:
        raise ParamsError("grid", [(str(key), "needs a non-empty list of values") for key in empty])
    if (points := math.prod(len(values) for values in grid.values())) > MAX_POINTS:
        problem = f"{points} combinations; a sweep runs at most {MAX_POINTS}: split it"
        raise ParamsError("grid", [("grid", problem)])
    runs = {}
    for combo in itertools.product(*grid.values()):
        settings = dict(zip(grid, combo, strict=True))
        name = f"{sweep_name}-" + "-".join(re.sub(r"[^A-Za-z0-9_]+", "_", str(v)) for v in combo)
        if len(name) > 100 or name in runs:  # cut, or two values alike once slugged
            digest = hashlib.sha256(json.dumps(settings, default=str).encode()).hexdigest()
            name = f"{name[:91]}-{digest[:8]}"
        runs[clone.check_name("experiment", name)] = settings
    return runs


def validate_runs(
    params_text: str, planned: dict[str, dict[str, Any]], base: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Validate every combination as the pipeline flow would; return name -> overrides.

    Raises:
        ParamsError: listing every invalid combination and its problems; nothing runs.
    """
    valid, problems = {}, []
    for name, settings in planned.items():
        try:
            valid[name] = validate_overrides(params_text, {**base, **settings}, name)
        except ParamsError as exc:
            problems.append((name, str(exc)))
    if problems:
        raise ParamsError("sweep grid", problems)
    return valid


#: Seconds between two looks at an experiment run's state.
POLL_S = 1.0

#: Experiment name -> its latest flow run, of this process's sweep (cancelled with it).
_started: dict[str, Any] = {}
_lock = threading.Lock()
#: Set when the sweep is being cancelled: waiting stops, new runs are cancelled at once.
_stopping = threading.Event()


def cancel_experiments() -> list[str]:
    """Cancel every experiment run this sweep started and that has not ended; return them.

    A run still waiting for a worker is cancelled outright; one that a worker took is set
    Cancelling, and its worker kills its process (whose stages die with it).
    """
    _stopping.set()
    with _lock:
        started = dict(_started)
    cancelled = []
    with get_client(sync_client=True) as client:
        for name, run_id in started.items():
            state = client.read_flow_run(run_id).state
            if state is None or state.is_final():
                continue
            waiting = state.is_scheduled()
            client.set_flow_run_state(run_id, Cancelled() if waiting else Cancelling(), force=True)
            cancelled.append(name)
    return cancelled


def experiment_result(client: SyncPrefectClient, run: FlowRun) -> dict[str, Any]:
    """What a finished experiment run published (its ``pipeline-metrics`` table, read through
    the API whichever machine ran it): metrics by file, where it ran, its time span."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
    )

    found = client.read_artifacts(
        artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]),
            key=ArtifactFilterKey(any_=["pipeline-metrics"]),
        )
    )
    metrics, ran_on = report.read_run_rows(json.loads(found[0].data) if found else [])
    return {
        "metrics_files": metrics,
        "ran_on": ran_on,
        "flow_run": str(run.id),
        "started": run.start_time.isoformat() if run.start_time else None,
        "ended": run.end_time.isoformat() if run.end_time else None,
    }


@task(retry_condition_fn=retry_only_transient)
def run_point(name: str, overrides: dict[str, Any], commit: str, key: str) -> dict[str, Any]:
    """One experiment of the sweep: a run of the experiment deployment, waited for.

    The idempotency key (sweep run, experiment, attempt) makes a repeated call return the
    run already made instead of a second one.

    Raises:
        ExperimentFailed: the run failed, crashed or was cancelled (``transient`` says
            whether a retry may help).
    """
    attempt = this_task_run.run_count or 1
    run = run_deployment(
        EXPERIMENT,
        parameters={"overrides": overrides, "exp_name": name, "commit": commit},
        flow_run_name=name,
        timeout=0,
        idempotency_key=f"{key}:{name}:{attempt}",
    )
    with _lock:
        _started[name] = run.id
    if _stopping.is_set():  # the sweep was cancelled while this run was being created
        cancel_experiments()
    with get_client(sync_client=True) as client:
        while not (run := client.read_flow_run(run.id)).state.is_final():
            if _stopping.wait(POLL_S):
                raise clone.ExperimentFailed(name, "cancelled", "the sweep was cancelled")
        if run.state.is_completed():
            return experiment_result(client, run)
    message = (run.state.message or "").removeprefix("Flow run encountered an exception: ")
    raise clone.ExperimentFailed(name, run.state.type.value.lower(), message)


def report_folder(root: Path) -> Path | None:
    """``reports/sweeps`` of the project the clone ``root`` came from, if that is a working
    tree on this machine; None otherwise (a team's git remote: the artifacts only)."""
    origin = Path(clone.run(["git", "remote", "get-url", "origin"], root).strip())
    return origin / "reports" / "sweeps" if (origin / ".git").exists() else None


@task(task_run_name="publish report")
def publish_report(
    planned: dict[str, dict[str, Any]],
    found: dict[str, dict[str, Any]],
    metric: str,
    higher_is_better: bool,
    folder: Path,
    sweep_name: str,
    context: dict[str, Any],
) -> dict[str, Any]:
    """Write the report (markdown, PNG plot, JSON) as ``folder/NAME.*`` and publish it as
    Prefect artifacts."""
    failed = [n for n, exp in found.items() if exp.get("state") != "success"]
    md_path = folder / f"{sweep_name}.md"
    markdown, table = report.write_sweep_report(
        md_path, planned, found, metric, higher_is_better, context
    )
    create_table_artifact(table, key="sweep-ranking", description=f"Sweep runs ranked by {metric}")
    create_markdown_artifact(markdown, key="sweep-report", description=f"Sweep report ({md_path})")
    return {"report": str(md_path), "runs": table, "failed": failed}


@flow(name="ganpipe-sweep")
def sweep(
    grid: dict[str, list[Any]] | None = None,
    base: dict[str, Any] | None = None,
    metric: str = "fid",
    higher_is_better: bool = False,
    sweep_name: str | None = None,
    parallel: Annotated[int, Field(ge=0, le=MAX_POINTS)] = 0,
    retries: Annotated[int, Field(ge=0, le=5)] = 0,
) -> dict[str, Any]:
    """Run a grid of DVC experiments and publish their comparison.

    Args:
        grid: params key -> values; every combination is one experiment
            (default :data:`DEFAULT_GRID`).
        base: overrides shared by every run (default :data:`DEFAULT_BASE`; ``{}`` for none).
        metric: dotted metric key to rank by, looked up in every DVC metrics file.
        higher_is_better: rank descending (e.g. for precision or recall).
        sweep_name: the report's name and the experiments' prefix (letters, digits, ``-``,
            ``_``; default ``sweep-YYYYmmdd-HHMMSS``).
        parallel: experiments at once (0: all); each trains in its own process.
        retries: new attempts of an experiment whose process was killed.
    """
    log = run_logger()
    root = Path.cwd()
    with clone.owned(root):
        grid = DEFAULT_GRID if grid is None else grid
        base = DEFAULT_BASE if base is None else base
        sweep_name = clone.check_name(
            "sweep_name", sweep_name or time.strftime("sweep-%Y%m%d-%H%M%S")
        )
        folder = report_folder(root) or root / "reports" / "sweeps"
        if (folder / f"{sweep_name}.md").exists():  # a report is never overwritten
            taken = f"{folder}/{sweep_name}.md exists; choose another name, or remove it"
            raise ParamsError("sweep_name", [("sweep_name", taken)])
        commit = clone.run(["git", "rev-parse", "HEAD"], root).strip()
        planned = plan_runs(grid, base, sweep_name)
        overrides = validate_runs((root / "params.yaml").read_text(), planned, base)
        log.info("sweep %s: %d experiments at %s", sweep_name, len(planned), commit[:7])
        key = str(this_flow_run.id or uuid.uuid4())
        found: dict[str, dict[str, Any]] = {}
        _stopping.clear()
        with ThreadPoolTaskRunner(max_workers=parallel or len(overrides)) as runner:
            point = run_point.with_options(retries=retries)
            futures = {
                name: runner.submit(
                    point.with_options(task_run_name=f"experiment {name}"),
                    {"name": name, "overrides": values, "commit": commit, "key": key},
                )
                for name, values in overrides.items()
            }
            try:
                for name, future in futures.items():
                    while not future.state.is_final():
                        # A bounded wait: an unbounded one would not let Prefect's SIGTERM
                        # handler (the worker cancelling this run) raise until it returned.
                        future.wait(timeout=1)
                    if future.state.is_completed():
                        result = future.result()
                        found[name] = {
                            "metrics": result["metrics_files"],
                            "state": "success",
                            **{k: result[k] for k in ("ran_on", "flow_run", "started", "ended")},
                        }
                    else:
                        error = future.state.result(raise_on_failure=False)
                        found[name] = {
                            "state": getattr(error, "state", "failed"),
                            "error": (str(error) or repr(error)).splitlines()[0],
                        }
            except BaseException as exc:
                # Cancelled (the worker's SIGTERM): cancel every experiment run now, before the
                # task runner waits for its threads on the way out.
                if not isinstance(exc, Exception):
                    for future in futures.values():
                        future.wrapped_future.cancel()  # those waiting for a thread never start
                    log.info("sweep cancelled: cancelling %s", ", ".join(cancel_experiments()))
                raise
        context = {
            "sweep": f"{report.code(sweep_name)}, {time.strftime('%Y-%m-%d %H:%M')}",
            "project commit": f"`{commit[:7]}` (every experiment starts from it)",
            "grid": report.code(json.dumps(grid)),
            "shared overrides": report.code(json.dumps(base)),
            "where": "the workers of work pool `ganpipe` (column *ran on*)",
            "experiments": "`dvc exp show`; `dvc exp apply NAME` restores one in the workspace",
        }
        result = publish_report(
            planned, found, metric, higher_is_better, folder, sweep_name, context
        )
        if result["failed"]:
            raise RuntimeError(
                f"{len(result['failed'])} of {len(planned)} experiments failed "
                f"({', '.join(result['failed'])}); the report lists why: {result['report']}"
            )
        return result
