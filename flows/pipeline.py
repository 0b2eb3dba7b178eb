"""The pipeline flow: one DVC experiment, made in a checkout of its own, stage by stage.

A run checks out the commit it starts from (default: the project's ``HEAD``) into a git
worktree sharing the project's DVC cache (:mod:`flows.checkout`), writes its overrides into
that checkout's params.yaml, runs every stage of dvc.yaml as a Prefect task
(``dvc repro STAGE``: unchanged stages come from the run cache), records the result as a
DVC experiment of the project (``dvc exp show`` / ``dvc exp apply NAME`` in the workspace)
and removes the checkout. The user's workspace is never written. With DVC's
``exp.auto_push`` set (``dvc config exp.auto_push true``, ``exp.git_remote``), the experiment
is pushed: its ref to the git remote, its outputs and the run cache to the DVC remote. The
sweep runs this flow once per grid point, so an experiment is a flow run of its own.

Run once by hand (a temporary local Prefect API starts when no server is configured)::

    python -m flows.pipeline --set train.strategy=g_first_detach --set precision=bf16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.exceptions import MissingContextError
from prefect.runtime import flow_run

from flows import checkout
from flows.checkout import DvcCommandError
from ganpipe.params import read_yaml
from reports.build import ReportError, build_report

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp")


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run; a plain logger when called as ``task.fn()``."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("flows")


def retry_only_transient(task, task_run, state) -> bool:
    """``retry_condition_fn``: retry a held lock, an I/O hiccup or a killed process, never a
    stage's own error."""
    error = state.data if isinstance(state.data, BaseException) else None
    if error is None:
        error = state.result(raise_on_failure=False)
    return isinstance(error, DvcCommandError | checkout.ExperimentFailed) and error.transient


@task(task_run_name="validate overrides")
def check_overrides(
    project: str, commit: str, overrides: dict[str, Any] | None, exp_name: str
) -> dict[str, Any]:
    """Validate the overrides against params.yaml of ``commit``; check that ``exp_name`` is
    free. Returns the overrides with the schema's values; fails (never retried) naming every
    bad key, or the experiment name."""
    checkout.check_exp_name(exp_name)
    if checkout.experiment_exists(Path(project), commit, exp_name):
        raise ValueError(
            f"exp_name={exp_name!r}: an experiment of that name exists on commit {commit[:7]}; "
            f"choose another name or remove it (dvc exp remove {exp_name})"
        )
    text = checkout.git(["show", f"{commit}:params.yaml"], Path(project))
    return checkout.validate_overrides(text, overrides, f"params.yaml of {commit[:7]}")


@task(retries=3, retry_delay_seconds=10, retry_condition_fn=retry_only_transient)
def run_stage(path: str, stage: str) -> str:
    """``dvc repro STAGE`` in the run's checkout; return ``ran`` or ``cached``.

    Raises:
        DvcCommandError: carrying the stage's ``error:`` message; ``transient`` says
            whether the retry policy applies.
    """
    output = checkout.run(["dvc", "repro", stage], Path(path), run_logger().info)
    return "ran" if f"Running stage '{stage}'" in output else "cached"


@task(retries=3, retry_delay_seconds=5, retry_condition_fn=retry_only_transient)
def push_experiment(project: str, remote: str, ref: str) -> str:
    """``dvc exp push --run-cache REMOTE REF``: the experiment's git ref to the git remote, its
    outputs and the project's run cache to the default DVC remote, so that another clone
    lists it (``dvc exp pull``) and restores it without training (``dvc repro --pull``)."""
    checkout.run(["dvc", "exp", "push", "--run-cache", remote, ref], Path(project))
    return remote


def where_it_ran() -> dict[str, str | None]:
    """Which machine, worker and GPUs run this process (the worker's environment reaches
    every flow run it starts: ``GANPIPE_WORKER``, ``CUDA_VISIBLE_DEVICES``)."""
    return {
        "host": socket.gethostname(),
        "worker": os.environ.get("GANPIPE_WORKER"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def publish_run(root: Path, project: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Publish the run's record as Prefect artifacts; return it with the metrics added.

    Artifacts: ``pipeline-metrics`` (a table of every metric, measurements included, every
    param, overridden params marked, and where the run ran: rows of kind ``run``) and
    ``pipeline-run`` (markdown: the experiment, the stages, where it ran, links to the
    samples and the plots page, kept in ``.state/runs/RUN/`` of the project). The table
    is what a sweep reads back through the API, from whichever machine ran the experiment.
    """
    shown = json.loads(checkout.run(["dvc", "metrics", "show", "--json"], root))
    files = {p: e.get("data") or {} for p, e in (shown.get("", {}).get("data") or {}).items()}
    # Measurements (step time, memory) are not DVC outputs; a stage restored from the run
    # cache measured nothing in this checkout.
    for name in checkout.MEASURED_METRICS:
        if (root / name).is_file():
            files[name] = json.loads((root / name).read_text(encoding="utf-8"))
    params = read_yaml((root / "params.yaml").read_text(encoding="utf-8")) or {}
    rows = [
        {"kind": "metric", "source": source, "key": key, "value": value}
        for source, data in files.items()
        for key, value in checkout.flatten(data).items()
    ]
    rows += [
        {
            "kind": "param (override)" if key in record["overrides"] else "param",
            "source": "params.yaml",
            "key": key,
            "value": json.dumps(value) if isinstance(value, list) else value,
        }
        for key, value in checkout.flatten(params).items()
    ]
    rows += [
        {"kind": "run", "source": "environment", "key": key, "value": value}
        for key, value in record["ran_on"].items()
    ]
    create_table_artifact(
        rows, key="pipeline-metrics", description="Metrics and params of this run"
    )

    keep = project / ".state" / "runs" / re.sub(r"[^\w.-]", "_", record["experiment"])
    samples = []
    for output in checkout.stage_outputs(root / "dvc.yaml"):
        if output.lower().endswith(IMAGE_SUFFIXES) and (root / output).is_file():
            (keep / output).parent.mkdir(parents=True, exist_ok=True)
            samples.append(str(shutil.copyfile(root / output, keep / output)))
    try:
        plots = str(build_report(root, out=keep / "plots"))
    except ReportError as exc:
        run_logger().warning("offline plots page not built (%s); using DVC's default page", exc)
        checkout.run(["dvc", "plots", "show", "--out", str(keep / "plots")], root)
        plots = str(keep / "plots" / "index.html")
    record = {**record, "samples": samples, "plots": [plots], "metrics_files": files}
    record["metrics"] = {row["key"]: row["value"] for row in rows if row["kind"] == "metric"}
    create_markdown_artifact(
        run_markdown(record), key="pipeline-run", description="What this run made"
    )
    return record


def run_markdown(record: dict[str, Any]) -> str:
    """The markdown artifact of one pipeline run."""
    exp = record["experiment"]
    lines = [
        "# ganpipe pipeline run",
        "",
        f"- DVC experiment: **{exp}** on commit `{record['commit'][:7]}` "
        f"(`dvc exp show`, `dvc exp apply {exp}` in the project)",
        "- ran on: " + ", ".join(f"{key} `{value}`" for key, value in record["ran_on"].items()),
    ]
    if record["overrides"]:
        lines.append(f"- overrides: `{json.dumps(record['overrides'], ensure_ascii=False)}`")
    lines += [
        "- stages: " + ", ".join(f"{name} ({how})" for name, how in record["stages"].items()),
        "- samples: " + ", ".join(f"[{Path(p).name}](file://{p})" for p in record["samples"]),
        "- plots: " + ", ".join(f"[{Path(p).name}](file://{p})" for p in record["plots"]),
        "",
        "| metric | value |",
        "|---|---:|",
    ]
    for key, value in record["metrics"].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            lines.append(f"| {key} | {float(value):.6g} |")
    return "\n".join(lines)


@flow(name="ganpipe-pipeline")
def pipeline(
    overrides: dict[str, Any] | None = None,
    exp_name: str | None = None,
    commit: str | None = None,
    stage_retries: int = 3,
    retry_delay_s: float = 10.0,
) -> dict[str, Any]:
    """Make one DVC experiment: every stage of dvc.yaml in a checkout of its own.

    Args:
        overrides: params to change, ``{"train.strategy": "g_first_detach"}``; validated by
            the params schema before anything runs, written into the checkout's params.yaml
            exactly as given (strings are never parsed).
        exp_name: Name of the DVC experiment (default: the flow run's name).
        commit: The git commit to start from (sha, branch or tag; default: ``HEAD``). The
            workspace's uncommitted changes are not part of a run.
        stage_retries: Attempts after a transient failure of a stage (killed, I/O).
        retry_delay_s: Seconds between those attempts.
    """
    log = run_logger()
    project = checkout.PROJECT_ROOT
    exp_name = exp_name or flow_run.get_name() or time.strftime("pipeline-%Y%m%d-%H%M%S")
    sha = checkout.resolve_commit(project, commit)
    valid = check_overrides(str(project), sha, overrides, exp_name)
    retry = {"retries": stage_retries, "retry_delay_seconds": retry_delay_s}
    with checkout.checkout(project, sha, exp_name) as root:
        log.info("experiment %s: checkout of %s in %s", exp_name, sha[:7], root)
        if valid:
            checkout.write_params(root / "params.yaml", valid)
            log.info("params.yaml: %s", json.dumps(valid, ensure_ascii=False))
        stages = {
            stage: run_stage.with_options(task_run_name=f"stage {stage}", **retry)(str(root), stage)
            for stage in checkout.stage_names(root / "dvc.yaml")
        }
        message = f"ganpipe experiment {exp_name}: {json.dumps(valid, ensure_ascii=False)}"
        checkout.record_experiment(root, sha, exp_name, message)
        remote = checkout.push_remote(project)
        if remote:
            ref = checkout.experiment_ref(sha, exp_name)
            push_experiment.with_options(task_run_name=f"push to {remote}")(
                str(project), remote, ref
            )
        record = {
            "experiment": exp_name,
            "commit": sha,
            "stages": stages,
            "overrides": valid,
            "ran_on": where_it_ran(),
        }
        return publish_run(root, project, record)


def _parse_set(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected key=value")
    return key, read_yaml(value)


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the ganpipe pipeline flow once.")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        type=_parse_set,
        default=[],
        help="key=value (YAML value)",
    )
    parser.add_argument("--name", dest="exp_name", default=None, help="DVC experiment name")
    parser.add_argument("--commit", default=None, help="git commit to start from (default HEAD)")
    args = parser.parse_args()
    pipeline(overrides=dict(args.sets), exp_name=args.exp_name, commit=args.commit)


if __name__ == "__main__":
    main()
