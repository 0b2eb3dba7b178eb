"""The pipeline flow: one DVC experiment, made by DVC in this run's fresh clone and returned
with ``dvc exp push`` (:mod:`flows.clone`); the user's workspace is never written. On demand::

    prefect deployment run ganpipe-pipeline/experiment \
        --param overrides='{"train.strategy": "g_first_detach", "precision": "bf16"}'

Without a server, ``dvc exp run -S train.strategy=g_first_detach`` makes the same experiment.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.runtime import flow_run
from pydantic import Field

from flows import clone
from ganpipe.overrides import apply_overrides, validate_overrides
from ganpipe.params import read_yaml
from reports import ranking as report

#: What the stages measured (stages/train.py MEASUREMENTS_DIR): metrics files that are no
#: DVC outputs, read beside the ones ``dvc metrics show`` reports.
MEASURED_METRICS = ("measurements/train/metrics.json",)


def retry_only_transient(task, task_run, state) -> bool:
    """``retry_condition_fn``: retry a held lock, an I/O hiccup or a killed process, never a
    stage's own error."""
    error = state.data if isinstance(state.data, BaseException) else None
    error = error or state.result(raise_on_failure=False)
    return isinstance(error, clone.DvcCommandError) and error.transient


@task(task_run_name="dvc exp run", retries=2, retry_condition_fn=retry_only_transient)
def run_experiment(root: str, name: str, overrides: dict, shared: bool) -> dict[str, str]:
    """``dvc exp run -n NAME`` in the clone (after its overrides); stage -> ran/cached."""
    return clone.make_experiment(Path(root), name, overrides, shared, get_run_logger().info)


def publish_run(root: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Publish the run as Prefect artifacts; return the record with its metrics.

    ``pipeline-metrics``: a table of every metric (measurements included), every param
    (overridden ones marked) and where the run ran; what a sweep reads back through the API,
    from whichever machine ran the experiment. ``pipeline-run``: markdown for people.
    """
    shown = json.loads(clone.run(["dvc", "metrics", "show", "--json"], root))
    files = {p: e.get("data") or {} for p, e in (shown.get("", {}).get("data") or {}).items()}
    for name in MEASURED_METRICS:
        if (root / name).is_file():
            files[name] = json.loads((root / name).read_text(encoding="utf-8"))
    params = read_yaml((root / "params.yaml").read_text(encoding="utf-8")) or {}
    rows = report.run_rows(files, params, record["overrides"], record["ran_on"])
    create_table_artifact(rows, key="pipeline-metrics", description="Metrics and params")
    record = {**record, "metrics_files": files}
    record["metrics"] = {row["key"]: row["value"] for row in rows if row["kind"] == "metric"}
    create_markdown_artifact(report.run_markdown(record), key="pipeline-run", description="The run")
    return record


@flow(name="ganpipe-pipeline")
def pipeline(
    overrides: dict[str, Any] | None = None,
    exp_name: Annotated[str | None, Field(pattern=clone.NAME)] = None,
    commit: str | None = None,
) -> dict[str, Any]:
    """Make one DVC experiment of every stage of dvc.yaml, in this run's fresh clone.

    Args:
        overrides: params to change, ``{"train.strategy": "g_first_detach"}``; validated by
            the params schema before anything runs, written into the clone's params.yaml
            exactly as given (strings are never parsed).
        exp_name: Name of the DVC experiment (default: the flow run's name).
        commit: The commit to start from (sha, branch or tag; default: the head of the
            repository the deployment clones). Uncommitted changes are never part of a run.
    """
    log = get_run_logger()
    root = Path.cwd()
    with clone.owned(root):
        name = exp_name or flow_run.get_name() or ""
        if not re.fullmatch(clone.NAME, name):  # a flow run's name is the caller's too
            name = time.strftime("pipeline-%Y%m%d-%H%M%S")
        sha, shared = clone.prepare(root, commit, log.info)
        params_text = (root / "params.yaml").read_text(encoding="utf-8")
        valid = validate_overrides(params_text, overrides, "params.yaml of the run's commit")
        if name in clone.experiment_names(root):
            taken = f"{name!r} exists on {sha[:7]}; choose another, or dvc exp remove {name}"
            raise clone.ParamsError("exp_name", [("exp_name", taken)])
        merged = apply_overrides(read_yaml(params_text), valid)
        clone.restore_data(root, merged, shared)
        stages = run_experiment(str(root), name, valid, shared)
        record = {"experiment": name, "commit": sha, "stages": stages, "overrides": valid}
        # where it ran: the worker's environment reaches every flow run it starts
        ran_on = {
            "host": socket.gethostname(),
            "worker": os.environ.get("GANPIPE_WORKER"),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        return publish_run(root, {**record, "ran_on": ran_on})
