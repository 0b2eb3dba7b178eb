"""The pipeline flow: one DVC experiment, made by DVC in a fresh clone of the project.

A deployment run starts in the clone its ``git_clone`` pull step made (prefect.yaml); the
flow moves it to the requested commit, validates the overrides, writes them into the
clone's params.yaml, runs ``dvc exp run -n NAME`` (unchanged stages come from the shared run
cache) and returns the experiment with ``dvc exp push`` (:mod:`flows.clone`). The user's
workspace is never written: the experiment appears in ``dvc exp show`` there.

Run once by hand (in a temporary clone of this project; a temporary local Prefect API
starts when no server is configured)::

    python -m flows.pipeline --set train.strategy=g_first_detach --set precision=bf16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.exceptions import MissingContextError
from prefect.runtime import flow_run

from flows import clone
from ganpipe.errors import UserError
from ganpipe.overrides import apply_overrides, flatten, validate_overrides
from ganpipe.params import read_yaml

PROJECT_ROOT = Path(__file__).resolve().parents[1]
#: What the stages measured (stages/train.py MEASUREMENTS_DIR): metrics files that are no
#: DVC outputs, read beside the ones ``dvc metrics show`` reports.
MEASURED_METRICS = ("measurements/train/metrics.json",)


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a run; a plain logger outside one."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("flows")


def retry_only_transient(task, task_run, state) -> bool:
    """``retry_condition_fn``: retry a held lock, an I/O hiccup or a killed process, never a
    stage's own error."""
    error = state.data if isinstance(state.data, BaseException) else None
    error = error or state.result(raise_on_failure=False)
    return isinstance(error, clone.DvcCommandError | clone.ExperimentFailed) and error.transient


def check_overrides(root: Path, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The overrides validated against the clone's params.yaml (values as the schema has
    them); raises ParamsError naming every bad key."""
    text = (root / "params.yaml").read_text(encoding="utf-8")
    return validate_overrides(text, overrides, "params.yaml of the run's commit")


@task(task_run_name="dvc exp run", retries=2, retry_condition_fn=retry_only_transient)
def run_experiment(root: str, name: str, overrides: dict, shared: bool) -> dict[str, str]:
    """``dvc exp run -n NAME`` in the clone (after its overrides); stage -> ran/cached."""
    return clone.make_experiment(Path(root), name, overrides, shared, run_logger().info)


def where_it_ran() -> dict[str, str | None]:
    """Which machine, worker and GPUs run this process (the worker's environment reaches
    every flow run it starts: ``GANPIPE_WORKER``, ``CUDA_VISIBLE_DEVICES``)."""
    return {
        "host": socket.gethostname(),
        "worker": os.environ.get("GANPIPE_WORKER"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


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
    rows = [
        {"kind": "metric", "source": source, "key": key, "value": value}
        for source, data in files.items()
        for key, value in flatten(data).items()
    ]
    rows += [
        {
            "kind": "param (override)" if key in record["overrides"] else "param",
            "source": "params.yaml",
            "key": key,
            "value": json.dumps(value) if isinstance(value, list) else value,
        }
        for key, value in flatten(params).items()
    ]
    rows += [
        {"kind": "run", "source": "environment", "key": key, "value": value}
        for key, value in record["ran_on"].items()
    ]
    create_table_artifact(rows, key="pipeline-metrics", description="Metrics and params")
    record = {**record, "metrics_files": files}
    record["metrics"] = {row["key"]: row["value"] for row in rows if row["kind"] == "metric"}
    create_markdown_artifact(run_markdown(record), key="pipeline-run", description="The run")
    return record


def run_markdown(record: dict[str, Any]) -> str:
    """The markdown artifact of one pipeline run (callers' strings only inside code)."""
    exp = record["experiment"]
    lines = [
        "# ganpipe pipeline run",
        "",
        f"- DVC experiment: **{exp}** on commit `{record['commit'][:7]}` "
        f"(`dvc exp show`, `dvc exp apply {exp}` in the project)",
        "- ran on: " + ", ".join(f"{k} {code(v)}" for k, v in record["ran_on"].items()),
        "- stages: " + ", ".join(f"{name} ({how})" for name, how in record["stages"].items()),
    ]
    if record["overrides"]:
        lines.append(f"- overrides: {code(json.dumps(record['overrides']))}")
    lines += ["", "| metric | value |", "|---|---:|"]
    for key, value in record["metrics"].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            lines.append(f"| {code(key)} | {float(value):.6g} |")
    return "\n".join(lines)


def code(value: Any) -> str:
    """``value`` as one line of markdown code: no line breaks, pipes or backticks of its own."""
    text = " ".join(str(value).split()).replace("`", "'").replace("|", "/")
    return f"`{text}`"


@flow(name="ganpipe-pipeline")
def pipeline(
    overrides: dict[str, Any] | None = None,
    exp_name: str | None = None,
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
    log = run_logger()
    root = Path.cwd()
    with clone.owned(root):
        name = exp_name or flow_run.get_name() or time.strftime("pipeline-%Y%m%d-%H%M%S")
        clone.check_name("exp_name", name)
        sha, shared = clone.prepare(root, commit, log.info)
        valid = check_overrides(root, overrides)
        if name in clone.experiment_names(root):
            raise clone.ParamsError(
                "exp_name",
                [
                    (
                        "exp_name",
                        f"{name!r} exists on {sha[:7]}; choose another, or dvc exp remove {name}",
                    )
                ],
            )
        merged = apply_overrides(read_yaml((root / "params.yaml").read_text()), valid)
        clone.restore_data(root, merged, shared)
        stages = run_experiment(str(root), name, valid, shared)
        record = {"experiment": name, "commit": sha, "stages": stages, "overrides": valid}
        return publish_run(root, {**record, "ran_on": where_it_ran()})


@contextmanager
def temporary_clone(project: Path = PROJECT_ROOT) -> Iterator[Path]:
    """A fresh clone of ``project`` in a temporary folder, the working directory meanwhile:
    what a deployment's pull step makes, for a flow run by hand."""
    before = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="ganpipe-run-") as folder:
        root = Path(folder) / "clone"
        subprocess.run(["git", "clone", "-q", str(project), str(root)], check=True)
        os.chdir(root)
        try:
            yield root
        finally:
            os.chdir(before)


def cli(parse: Callable[[], dict[str, Any]], validate: Callable[[dict], None], run) -> None:
    """Parse, validate against this project's committed params, run; one ``error:`` line
    (exit 2) for bad input, never a traceback."""
    from ruamel.yaml import YAMLError

    try:
        args = parse()
        validate(args)
    except (UserError, YAMLError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    with temporary_clone():
        run(**args)


def committed_params(commit: str | None = None) -> str:
    """params.yaml of ``commit`` (default HEAD) of this project.

    Raises:
        ParamsError: ``commit`` names no commit.
    """
    shown = subprocess.run(
        ["git", "show", f"{commit or 'HEAD'}:params.yaml"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
    )
    if shown.returncode:
        raise clone.ParamsError("commit", [("commit", f"{commit!r} is not a commit here")])
    return shown.stdout


def _parse_set(text: str) -> tuple[str, Any]:
    from ruamel.yaml import YAMLError

    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"--set {text!r}: expected key=value")
    try:
        return key, read_yaml(value)
    except YAMLError as exc:
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"--set {key}: {reason}; quote a string value") from None


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the ganpipe pipeline flow once.")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="key=value (YAML)")
    parser.add_argument("--name", dest="exp_name", default=None, help="DVC experiment name")
    parser.add_argument("--commit", default=None, help="git commit to start from (default HEAD)")

    def parse() -> dict[str, Any]:
        args = parser.parse_args()
        return {
            "overrides": dict(_parse_set(s) for s in args.sets),
            "exp_name": args.exp_name,
            "commit": args.commit,
        }

    def validate(args: dict[str, Any]) -> None:
        if args["exp_name"]:
            clone.check_name("exp_name", args["exp_name"])
        text = committed_params(args["commit"])
        validate_overrides(text, args["overrides"], "params.yaml of the commit")

    cli(parse, validate, pipeline)


if __name__ == "__main__":
    main()
