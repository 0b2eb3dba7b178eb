"""The sweep flow: a grid of experiments, each a run of ``ganpipe-pipeline/experiment``
(:mod:`flows.pipeline`) at the sweep's start commit, validated first and compared in one
report: Prefect artifacts, and ``reports/sweeps/NAME.md`` (+ ``.png``, ``.json``) when the
project is a folder here, a place made from the validated name. On demand::

    prefect deployment run ganpipe-sweep/scheduled --param sweep_name=tiny \
        --param grid='{"train.strategy": ["d_first_detach", "g_first_detach"]}'
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import re
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas import filters as f
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.runtime import flow_run as this_flow_run
from prefect.states import Cancelling
from pydantic import Field

from flows import clone
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
#: The most combinations one sweep runs (each is a flow run).
MAX_POINTS = 256
#: A grid: params key -> values, neither empty (Prefect checks the flow's signature).
Grid = Annotated[dict[str, Annotated[list[Any], Field(min_length=1)]], Field(min_length=1)]
#: Shared by every run of the default sweep: short training (20k images per run).
DEFAULT_BASE: dict[str, Any] = {"train.kimg": 20}


def plan_runs(
    grid: dict[str, list[Any]], base: dict[str, Any], sweep_name: str
) -> dict[str, dict[str, Any]]:
    """Experiment name -> grid values, one per combination, in grid order.

    Raises:
        ParamsError: more than :data:`MAX_POINTS` combinations.
    """
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
        runs[name] = settings
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


#: Seconds between two looks at the experiment runs' states.
POLL_S = 1.0


def experiment_result(client: SyncPrefectClient, run: FlowRun) -> dict[str, Any]:
    """What a finished experiment run published (its ``pipeline-metrics`` table, read through
    the API whichever machine ran it): metrics by file, where it ran, its time span."""
    only = f.ArtifactFilter(
        flow_run_id=f.ArtifactFilterFlowRunId(any_=[run.id]),
        key=f.ArtifactFilterKey(any_=["pipeline-metrics"]),
    )
    found = client.read_artifacts(artifact_filter=only)
    metrics, ran_on = report.read_run_rows(json.loads(found[0].data) if found else [])
    return {
        "state": "success",
        "metrics": metrics,
        "ran_on": ran_on,
        "flow_run": str(run.id),
        "started": run.start_time.isoformat() if run.start_time else None,
        "ended": run.end_time.isoformat() if run.end_time else None,
    }


def run_experiments(
    overrides: dict[str, dict[str, Any]], commit: str, parallel: int, retries: int, log
) -> dict[str, dict[str, Any]]:
    """Start each experiment as a run of the experiment deployment (at most ``parallel``
    unfinished, 0: all at once) and wait for the final states; name -> what it gave.

    A run that crashed (its process or machine died) or failed transiently (a held lock, a
    killed stage) starts again while ``retries`` allows; the idempotency key (sweep run,
    experiment, attempt) makes a repeated start return the run already made. The runs are
    subflows of the sweep: cancelling the sweep needs nothing here, since the server cancels
    the children of a cancelled flow run (its cancellation clean-up, every few seconds).
    """
    key = str(this_flow_run.id or uuid.uuid4())
    waiting, running, attempts, found = list(overrides), {}, Counter(), {}
    with get_client(sync_client=True) as client:
        try:
            while waiting or running:
                while waiting and len(running) < (parallel or len(overrides)):
                    name = waiting.pop(0)
                    attempts[name] += 1
                    run_id = run_deployment(
                        EXPERIMENT,
                        parameters={
                            "overrides": overrides[name],
                            "exp_name": name,
                            "commit": commit,
                        },
                        flow_run_name=name,
                        timeout=0,
                        idempotency_key=f"{key}:{name}:{attempts[name]}",
                    ).id
                    running[run_id] = name
                time.sleep(POLL_S)
                ids = f.FlowRunFilter(id=f.FlowRunFilterId(any_=list(running)))
                for run in client.read_flow_runs(flow_run_filter=ids):  # one request per look
                    if not run.state.is_final():
                        continue
                    name = running.pop(run.id)
                    if run.state.is_completed():
                        found[name] = experiment_result(client, run)
                        continue
                    state = run.state.type.value.lower()
                    message = (run.state.message or "").removeprefix(
                        "Flow run encountered an exception: "
                    )
                    transient = state == "crashed" or clone.TRANSIENT.search(message)
                    if transient and attempts[name] <= retries:
                        log.info("experiment %s %s; starting it again", name, state)
                        waiting.append(name)
                    else:
                        error = f"experiment {name} {state}: {message}".splitlines()[0]
                        found[name] = {"state": state, "error": error}
        except BaseException:  # failed or cancelled: no experiment outlives its sweep
            for run_id in running:
                with contextlib.suppress(Exception):
                    client.set_flow_run_state(run_id, Cancelling(), force=True)
            raise
    return found


@flow(name="ganpipe-sweep")
def sweep(
    grid: Grid | None = None,
    base: dict[str, Any] | None = None,
    metric: str = "fid",
    higher_is_better: bool = False,
    sweep_name: Annotated[str | None, Field(pattern=clone.NAME)] = None,
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
    log = get_run_logger()
    root = Path.cwd()
    with clone.owned(root):
        grid = DEFAULT_GRID if grid is None else grid
        base = DEFAULT_BASE if base is None else base
        sweep_name = sweep_name or time.strftime("sweep-%Y%m%d-%H%M%S")
        origin = Path(clone.run(["git", "remote", "get-url", "origin"], root).strip())
        # the user's project when it is a working tree here; else the clone (artifacts only)
        folder = (origin if (origin / ".git").exists() else root) / "reports" / "sweeps"
        if (folder / f"{sweep_name}.md").exists():  # a report is never overwritten
            taken = f"{folder}/{sweep_name}.md exists; choose another name, or remove it"
            raise ParamsError("sweep_name", [("sweep_name", taken)])
        commit = clone.run(["git", "rev-parse", "HEAD"], root).strip()
        planned = plan_runs(grid, base, sweep_name)
        overrides = validate_runs((root / "params.yaml").read_text(), planned, base)
        log.info("sweep %s: %d experiments at %s", sweep_name, len(planned), commit[:7])
        found = run_experiments(overrides, commit, parallel, retries, log)
        context = {
            "sweep": f"{report.code(sweep_name)}, {time.strftime('%Y-%m-%d %H:%M')}",
            "project commit": f"`{commit[:7]}` (every experiment starts from it)",
            "grid": report.code(json.dumps(grid)),
            "shared overrides": report.code(json.dumps(base)),
            "where": "the workers of work pool `ganpipe` (column *ran on*)",
            "experiments": "`dvc exp show`; `dvc exp apply NAME` restores one in the workspace",
        }
        md_path = folder / f"{sweep_name}.md"
        markdown, table = report.write_sweep_report(
            md_path, planned, found, metric, higher_is_better, context
        )
        create_table_artifact(table, key="sweep-ranking", description=f"Ranked by {metric}")
        create_markdown_artifact(markdown, key="sweep-report", description=f"Report {md_path}")
        if failed := [name for name, exp in found.items() if exp["state"] != "success"]:
            raise RuntimeError(
                f"{len(failed)} of {len(planned)} experiments failed ({', '.join(failed)}); "
                f"the report lists why: {md_path}"
            )
        return {"report": str(md_path), "runs": table, "failed": failed}
