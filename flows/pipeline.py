"""The pipeline flow: every stage of dvc.yaml as a Prefect task, then the run's record.

Each stage task runs ``dvc repro STAGE``, in the order of dvc.yaml's dependencies. With
overrides the flow first writes them into params.yaml (what ``dvc exp run -S`` does) and
at the end records the workspace as a DVC experiment (``dvc exp save --name``), so the
run shows up in ``dvc exp show`` like one made by ``dvc exp run``. One ``dvc exp run``
per stage is not an option: a second run under the same name needs ``--force``, which
also re-runs every upstream stage. DVC decides what is cached; Prefect decides when,
retries a stage only for transient failures (a held DVC lock, an I/O hiccup), and keeps
the record: a table artifact of the metrics and params, and a markdown artifact naming
the experiment and where the samples and plots are.

Run once by hand (a temporary local Prefect API starts when no server is configured)::

    python -m flows.pipeline --set train.strategy=g_first_detach --set precision=bf16
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.exceptions import MissingContextError
from prefect.runtime import flow_run

from flows import workspace
from flows.workspace import DvcCommandError
from ganpipe.params import read_yaml
from reports.build import ReportError, build_report

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp")
#: DVC experiment names are git ref names; this is a safe subset of them.
EXP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(?<![.])(?<!\.lock)")


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run; a plain logger when called as ``task.fn()``."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("flows")


def retry_only_transient(task, task_run, state) -> bool:
    """``retry_condition_fn``: retry a held lock or an I/O hiccup, never a stage's own error."""
    error = state.data if isinstance(state.data, BaseException) else None
    if error is None:
        error = state.result(raise_on_failure=False)
    return isinstance(error, DvcCommandError) and error.transient


@task(task_run_name="validate overrides")
def check_overrides(
    project: str, overrides: dict[str, Any] | None, exp_name: str | None
) -> dict[str, Any]:
    """Validate the overrides with the params schema and check that ``exp_name`` is free.

    Returns the overrides with the schema's values. Fails (never retried) naming every bad
    key, or the experiment name that is taken.
    """
    valid = workspace.validate_overrides(Path(project), overrides)
    if exp_name and (not EXP_NAME.fullmatch(exp_name) or ".." in exp_name):
        raise ValueError(
            f"exp_name={exp_name!r} is not a valid experiment name; use letters, digits, "
            "'-', '_' and '.', starting with a letter or digit (it becomes a git ref)"
        )
    if exp_name:
        listed = workspace.run_dvc(["exp", "list", "--name-only"], Path(project), lambda _: None)
        if exp_name in listed.split():
            raise ValueError(
                f"exp_name={exp_name!r}: an experiment of that name exists on this commit; "
                f"choose another name or remove it (dvc exp remove {exp_name})"
            )
    return valid


@task(task_run_name="set params")
def set_params(project: str, overrides: dict[str, Any]) -> None:
    """Write the overrides into params.yaml, as ``dvc exp run -S`` would."""
    workspace.write_overrides(Path(project), overrides)
    run_logger().info("params.yaml: %s", json.dumps(overrides))


@task(retries=3, retry_delay_seconds=10, retry_condition_fn=retry_only_transient)
def run_stage(project: str, stage: str) -> str:
    """``dvc repro STAGE`` (and what it depends on, if stale); return ``ran`` or ``cached``.

    Raises:
        DvcCommandError: carrying the stage's ``error:`` message; ``transient`` says
            whether the retry policy applies.
    """
    output = workspace.run_dvc(["repro", stage], Path(project), run_logger().info)
    return "ran" if f"Running stage '{stage}'" in output else "cached"


@task(retries=3, retry_delay_seconds=10, retry_condition_fn=retry_only_transient)
def save_experiment(project: str, exp_name: str) -> str:
    """Record the workspace (params, metrics, outputs) as DVC experiment ``exp_name``."""
    workspace.run_dvc(["exp", "save", "--name", exp_name], Path(project), run_logger().info)
    return exp_name


@task(task_run_name="publish artifacts")
def publish_run(
    project: str,
    stages: dict[str, str],
    overrides: dict[str, Any],
    exp_name: str | None,
) -> dict[str, Any]:
    """Publish the run's record as Prefect artifacts; return it as a dict.

    Artifacts: ``pipeline-metrics`` (a table of every metric and param, overridden params
    marked) and ``pipeline-run`` (markdown: the experiment, the stages, links to the
    samples and the plots HTML).
    """
    root = Path(project)
    metrics = workspace.dvc_json(["metrics", "show", "--json"], root)
    params = read_yaml((root / "params.yaml").read_text(encoding="utf-8")) or {}
    rows = []
    for source, entry in (metrics.get("", {}).get("data") or {}).items():
        for key, value in workspace.flatten(entry.get("data") or {}).items():
            rows.append({"kind": "metric", "source": source, "key": key, "value": value})
    for key, value in workspace.flatten(params).items():
        rows.append(
            {
                "kind": "param (override)" if key in overrides else "param",
                "source": "params.yaml",
                "key": key,
                "value": json.dumps(value) if isinstance(value, list) else value,
            }
        )
    create_table_artifact(
        rows, key="pipeline-metrics", description="Metrics and params of this pipeline run"
    )

    outputs = workspace.stage_outputs(root / "dvc.yaml")
    samples = [str(root / p) for p in outputs if p.lower().endswith(IMAGE_SUFFIXES)]
    plots = [str(root / p) for p in outputs if p.lower().endswith(".html")]
    if not plots:
        plots = [render_plots(root, flow_run.get_name() or time.strftime("%Y%m%d-%H%M%S"))]
    record = {
        "experiment": exp_name,
        "stages": stages,
        "overrides": overrides,
        "samples": samples,
        "plots": plots,
        "metrics": {row["key"]: row["value"] for row in rows if row["kind"] == "metric"},
    }
    create_markdown_artifact(
        run_markdown(record, root), key="pipeline-run", description="What this run made"
    )
    return record


def render_plots(root: Path, run_name: str) -> str:
    """The offline plots page (README "Reports") of the workspace, under ``.state/plots/RUN/``.

    Without the vega bundles (``make setup`` installs them) it falls back to DVC's own page,
    which needs internet to draw the curves.
    """
    folder = Path(".state") / "plots" / re.sub(r"[^\w.-]", "_", run_name)
    try:
        return str(build_report(root, out=folder))
    except ReportError as exc:
        run_logger().warning("offline plots page not built (%s); using DVC's default page", exc)
    workspace.run_dvc(["plots", "show", "--out", str(root / folder)], root, run_logger().debug)
    return str(root / folder / "index.html")


def run_markdown(record: dict[str, Any], root: Path) -> str:
    """The markdown artifact of one pipeline run."""
    exp = record["experiment"]
    lines = ["# ganpipe pipeline run", "", f"- project: `{root}`"]
    if exp:
        lines.append(f"- DVC experiment: **{exp}** (`dvc exp show`, `dvc exp apply {exp}`)")
    else:
        lines.append("- no experiment: `dvc repro` in the workspace (results in dvc.lock)")
    if record["overrides"]:
        lines.append(f"- overrides: `{json.dumps(record['overrides'])}`")
    lines += [
        "- stages: " + ", ".join(f"{name} ({how})" for name, how in record["stages"].items()),
        "- samples: " + ", ".join(f"[{Path(p).name}](file://{p})" for p in record["samples"]),
        "- plots: " + ", ".join(f"[{Path(p).name}](file://{p})" for p in record["plots"]),
        "",
        "| metric | value |",
        "|---|---:|",
        *(f"| {key} | {value:.6g} |" for key, value in _numbers(record["metrics"]).items()),
    ]
    return "\n".join(lines)


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in values.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }


@flow(name="ganpipe-pipeline")
def pipeline(
    overrides: dict[str, Any] | None = None,
    exp_name: str | None = None,
    project_dir: str | None = None,
    stage_retries: int = 3,
    retry_delay_s: float = 10.0,
    lock_timeout_s: float = 6 * 3600,
) -> dict[str, Any]:
    """Run every stage of dvc.yaml in order, then publish the run's metrics and params.

    Args:
        overrides: params to change for this run, ``{"train.strategy": "g_first_detach"}``;
            validated by the params schema before anything runs. Given overrides make the
            run a DVC experiment; like ``dvc exp run``, its params and outputs stay in the
            workspace afterwards (params.yaml is restored if a stage fails).
        exp_name: Name of the DVC experiment (default: the flow run's name when overrides
            are given; no experiment otherwise).
        project_dir: The DVC project (default: the one holding this file).
        stage_retries: Attempts after a transient failure of a stage (held lock, I/O).
        retry_delay_s: Seconds between those attempts.
        lock_timeout_s: How long to wait for another flow run using the same workspace.
    """
    log = run_logger()
    project = str(Path(project_dir).resolve() if project_dir else workspace.PROJECT_ROOT)
    if overrides and not exp_name:
        exp_name = flow_run.get_name() or time.strftime("pipeline-%Y%m%d-%H%M%S")
    valid = check_overrides(project, overrides, exp_name)
    stages = workspace.stage_names(Path(project) / "dvc.yaml")
    log.info("stages: %s; experiment: %s", ", ".join(stages), exp_name or "none (dvc repro)")
    retry = {"retries": stage_retries, "retry_delay_seconds": retry_delay_s}
    done: dict[str, str] = {}
    params_file = Path(project) / "params.yaml"
    with workspace.workspace_lock(Path(project), lock_timeout_s, log.info):
        before = params_file.read_text(encoding="utf-8")
        try:
            if valid:
                # Another run may have changed params.yaml while this one waited: check again.
                set_params(project, workspace.validate_overrides(Path(project), valid))
            for stage in stages:
                done[stage] = run_stage.with_options(task_run_name=f"stage {stage}", **retry)(
                    project, stage
                )
            if exp_name:
                save_experiment.with_options(task_run_name="save experiment", **retry)(
                    project, exp_name
                )
        except BaseException:
            if valid:
                # Leave the workspace's params as they were, so the next (scheduled) run
                # does not inherit this run's failing overrides.
                workspace.write_atomic(params_file, before)
                log.warning("params.yaml restored to its content before this run")
            raise
        return publish_run(project, done, valid, exp_name)


def _parse_set(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected key=value")
    return key, read_yaml(value)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the ganpipe pipeline flow once.")
    parser.add_argument(
        "--set", dest="sets", action="append", type=_parse_set, default=[], help="key=value"
    )
    parser.add_argument("--name", dest="exp_name", default=None, help="DVC experiment name")
    parser.add_argument("--project-dir", default=None, help="default: this checkout")
    args = parser.parse_args()
    pipeline(overrides=dict(args.sets), exp_name=args.exp_name, project_dir=args.project_dir)


if __name__ == "__main__":
    main()
