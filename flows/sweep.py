"""The sweep flow: a grid of DVC experiments, queued, awaited, compared in one report.

Every combination of the grid (default: the three update strategies x fp32/bf16 x two
seeds, at a small ``train.kimg``) is validated by the params schema, then queued with
``dvc exp run --queue -S ...`` and run by ``dvc queue start`` workers, each in its own
temporary copy of the project (DVC's queue), so the workspace stays free. When all have
finished, ``dvc exp show --json`` is collected and the comparison published: a table
ranked by a metric (default ``fid``) with step time and peak memory, and a markdown report
with a plot, written to ``reports/sweep.md`` (+ ``.png``, ``.json``) and as Prefect
artifacts. This report is the project's answer to "which strategy should I use".

Run once by hand::

    python -m flows.sweep                                   # the default grid
    python -m flows.sweep --grid '{"train.strategy": ["d_first_detach", "g_first_detach"]}' \\
        --base '{"train.kimg": 1}' --name tiny
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from flows import report, workspace
from flows.pipeline import retry_only_transient, run_logger
from ganpipe.params import ParamsError

#: The question this project started from: which update strategy, at which precision.
DEFAULT_GRID: dict[str, list[Any]] = {
    "train.strategy": ["d_first_retain", "d_first_detach", "g_first_detach"],
    "precision": ["fp32", "bf16"],
    "seed": [0, 1],
}
#: Shared by every run of the default sweep: short training (20k images per run).
DEFAULT_BASE: dict[str, Any] = {"train.kimg": 20}
#: Grid keys that repeat a setting rather than define one; the summary averages over them.
REPEAT_KEYS = ("seed",)
FINISHED = ("success", "failed")
#: Consecutive failed polls of the queue tolerated (and failed `dvc exp show` at the end).
MAX_POLL_ERRORS = 5
#: Seconds a `dvc queue status` or `dvc exp show` may take before it is killed and asked again.
POLL_TIMEOUT_S = 120.0
#: Seconds unfinished experiments may go without a live queue worker before they count as lost.
NO_WORKER_GRACE_S = 30.0
#: How many times lost experiments are queued again before the sweep gives up.
MAX_REQUEUES = 2


def plan_runs(
    grid: dict[str, list[Any]], base: dict[str, Any], sweep_name: str
) -> dict[str, dict[str, Any]]:
    """Experiment name -> grid values, one per combination, in grid order.

    Raises:
        ValueError: an empty grid or an empty list of values.
    """
    if not grid:
        raise ValueError("grid is empty; give at least one key with a list of values")
    empty = [key for key, values in grid.items() if not isinstance(values, list) or not values]
    if empty:
        raise ValueError(f"grid values must be non-empty lists; fix {', '.join(empty)}")
    runs = {}
    for combo in itertools.product(*grid.values()):
        settings = dict(zip(grid, combo, strict=True))
        slug = "-".join(re.sub(r"[^A-Za-z0-9_]+", "_", str(v)) for v in combo)
        runs[f"{sweep_name}-{slug}"] = settings
    return runs


@task(task_run_name="validate grid")
def validate_runs(
    project: str, planned: dict[str, dict[str, Any]], base: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Validate every combination with the params schema; return name -> full overrides.

    Raises:
        ValueError: listing every invalid combination and its problems; nothing is queued.
    """
    valid, problems = {}, []
    for name, settings in planned.items():
        try:
            valid[name] = workspace.validate_overrides(Path(project), {**base, **settings})
        except ParamsError as exc:
            problems.append(f"{name}: {exc}")
    if problems:
        raise ValueError("invalid sweep combinations:\n" + "\n".join(problems))
    return valid


@task(retries=3, retry_delay_seconds=10, retry_condition_fn=retry_only_transient)
def queue_experiment(project: str, name: str, overrides: dict[str, Any]) -> str:
    """``dvc exp run --queue --name NAME -S ...``: snapshot the workspace with the overrides."""
    args = ["exp", "run", "--queue", "--name", name, *workspace.set_args(overrides)]
    workspace.run_dvc(args, Path(project), run_logger().info)
    return name


@task(
    task_run_name="start queue workers",
    retries=3,
    retry_delay_seconds=10,
    retry_condition_fn=retry_only_transient,
)
def start_workers(project: str, jobs: int) -> None:
    """``dvc queue start -j JOBS``; the workers exit when the queue is empty."""
    args = ["queue", "start", "-j", str(jobs)]
    workspace.run_dvc(args, Path(project), run_logger().info, leaves_daemons=True)


@task(task_run_name="wait for experiments")
def wait_for(
    project: str,
    overrides: dict[str, dict[str, Any]],
    jobs: int,
    poll_s: float,
    timeout_s: float,
    lock_timeout_s: float,
) -> dict[str, dict[str, Any]]:
    """Wait until every named experiment succeeded or failed; return their records.

    Progress is read from ``dvc queue status``, which only reads the queue's own files;
    ``dvc exp show`` also opens and fetches from the running experiments' temporary copies,
    so it runs once, at the end. (In one CI run, polling with ``dvc exp show`` went silent
    for six minutes after both experiments had finished.) Every call is killed and asked
    again after :data:`POLL_TIMEOUT_S`.

    DVC's queue can lose a task: a worker that is stopping because the queue looked empty
    takes a task queued at that moment and exits without running it, which then shows as
    running forever. When unfinished experiments have had no live worker for
    :data:`NO_WORKER_GRACE_S`, the lost ones are queued again (up to :data:`MAX_REQUEUES`
    times) and workers started.

    Returns:
        name -> its record from :func:`flows.workspace.experiments`.

    Raises:
        TimeoutError: naming the experiments still queued or running.
        RuntimeError: experiments lost again after :data:`MAX_REQUEUES` new starts.
    """
    log = run_logger()
    root = Path(project)
    names = list(overrides)
    deadline = time.monotonic() + timeout_s
    last, requeues, idle_since = "", 0, None
    while True:
        queued = workspace.queue_states(ask_dvc(["queue", "status"], root, poll_s))
        states = {name: queued.get(name, "missing") for name in names}
        counts = {s: sum(v == s for v in states.values()) for s in sorted(set(states.values()))}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items())
        if summary != last:
            log.info("experiments: %s", summary)
            last = summary
        pending = [n for n, s in states.items() if s not in FINISHED]
        if not pending:
            break
        if workspace.queue_workers_alive(root):
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > NO_WORKER_GRACE_S:
            if requeues == MAX_REQUEUES:
                raise RuntimeError(
                    f"DVC's queue lost {', '.join(pending)} again after {requeues} new "
                    "start(s): no queue worker is running them; see `dvc queue status` and "
                    "`dvc queue logs NAME`, then run the sweep again"
                )
            requeues += 1
            lost = [n for n in pending if states[n] != "queued"]
            log.warning(
                "no DVC queue worker alive for %.0f s with %s unfinished; queueing %s again "
                "and starting workers (%d/%d)",
                NO_WORKER_GRACE_S,
                ", ".join(pending),
                ", ".join(lost) or "nothing",
                requeues,
                MAX_REQUEUES,
            )
            requeue(root, {n: overrides[n] for n in lost}, lock_timeout_s)
            start_workers.fn(project, jobs)
            idle_since = None
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(pending)} experiment(s) unfinished after {timeout_s:.0f} s: "
                f"{', '.join(pending)}; see `dvc queue status` (raise timeout_s for long grids)"
            )
        time.sleep(poll_s)
    return collect(root, names, poll_s)


def requeue(project: Path, overrides: dict[str, dict[str, Any]], lock_timeout_s: float) -> None:
    """Queue lost experiments again: mark the lost task failed, remove it, queue it anew.

    Like the first queueing, this snapshots the workspace, so it waits for the flow lock.
    """
    log = run_logger()
    with workspace.workspace_lock(project, lock_timeout_s, log.info):
        for name, values in overrides.items():
            for command in (["queue", "kill", name], ["queue", "remove", name]):
                try:
                    workspace.run_dvc(command, project, log.info)
                except workspace.DvcCommandError as exc:
                    log.warning("%s", exc)
            queue_experiment.fn(str(project), name, values)


def collect(project: Path, names: list[str], poll_s: float) -> dict[str, dict[str, Any]]:
    """The finished experiments' records from ``dvc exp show --json``."""
    found = workspace.experiments(json.loads(ask_dvc(["exp", "show", "--json"], project, poll_s)))
    missing = [n for n in names if n not in found]
    if missing:
        raise RuntimeError(
            f"`dvc exp show` lists no experiment named {', '.join(missing)}, although "
            "`dvc queue status` says it finished; see `dvc queue logs NAME`"
        )
    return {name: found[name] for name in names}


def ask_dvc(args: list[str], project: Path, poll_s: float) -> str:
    """Output of a reporting DVC command, asked again (``poll_s`` apart) while it fails.

    Each try is killed after :data:`POLL_TIMEOUT_S`. A failure can be passing: ``dvc exp
    show`` trips over a queue worker's run files vanishing ("No such file or directory:
    .dvc/tmp/exps/run/..."). The error of the try after :data:`MAX_POLL_ERRORS` is raised.
    """
    misses = 0
    while True:
        try:
            return workspace.dvc_output(args, project, POLL_TIMEOUT_S)
        except workspace.DvcCommandError as exc:
            misses += 1
            if misses > MAX_POLL_ERRORS:
                raise
            run_logger().warning(
                "dvc %s failed (%d/%d), asking again: %s", args[0], misses, MAX_POLL_ERRORS, exc
            )
            time.sleep(poll_s)


def failure_reasons(project: Path, names: list[str]) -> dict[str, str]:
    """The stage's own error message of each failed experiment (``dvc queue logs``)."""
    reasons = {}
    for name in names:
        command = ["queue", "logs", name]
        try:
            output = workspace.run_dvc(command, project, lambda _: None)
        except workspace.DvcCommandError as exc:
            output = exc.tail
        reasons[name] = workspace.failure_message(["dvc", *command], 0, output).splitlines()[0]
    return reasons


@task(task_run_name="publish report")
def publish_report(
    project: str,
    planned: dict[str, dict[str, Any]],
    found: dict[str, dict[str, Any]],
    metric: str,
    higher_is_better: bool,
    report_path: str,
    context: dict[str, Any],
) -> dict[str, Any]:
    """Write the report (markdown, PNG plot, JSON) and publish it as Prefect artifacts."""
    failed = [n for n, exp in found.items() if exp.get("state") == "failed"]
    runs = report.collect_runs(planned, found, metric, failure_reasons(Path(project), failed))
    keys = list(next(iter(planned.values())))
    group_keys = [k for k in keys if k not in REPEAT_KEYS]
    groups = report.group_runs(runs, group_keys, higher_is_better)
    perf = [k for k in report.PERF_KEYS if any(k in r.perf for r in runs)]
    panels = [("metric", f"{metric} ({'higher' if higher_is_better else 'lower'} is better)")]
    panels += [(k, report.PERF_TITLES[k]) for k in perf]

    md_path = Path(report_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    png_path = report.draw_plot(md_path.with_suffix(".png"), groups, panels)
    title = "Which update strategy? Sweep report" if "train.strategy" in keys else "Sweep report"
    markdown = report.render_markdown(
        title, runs, group_keys, metric, higher_is_better, context, png_path.name
    )
    md_path.write_text(markdown, encoding="utf-8")
    ranked = report.rank_runs(runs, higher_is_better)
    table = [
        {
            "rank": i,
            "experiment": r.name,
            **r.settings,
            metric: r.metric,
            **{report.PERF_TITLES[k]: r.perf.get(k) for k in perf},
            "state": r.state,
        }
        for i, r in enumerate(ranked, 1)
    ]
    md_path.with_suffix(".json").write_text(
        json.dumps({"context": context, "metric": metric, "runs": table}, indent=2) + "\n"
    )
    create_table_artifact(table, key="sweep-ranking", description=f"Sweep runs ranked by {metric}")
    create_markdown_artifact(
        markdown.replace(f"]({png_path.name})", f"](file://{png_path})"),
        key="sweep-report",
        description=f"Sweep report, also in {md_path}",
    )
    return {"report": str(md_path), "plot": str(png_path), "runs": table, "failed": failed}


def _git_commit(project: Path) -> str:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=project, capture_output=True, text=True
    )
    return result.stdout.strip() or "unknown"


@flow(name="ganpipe-sweep")
def sweep(
    grid: dict[str, list[Any]] | None = None,
    base: dict[str, Any] | None = None,
    metric: str = "fid",
    higher_is_better: bool = False,
    sweep_name: str | None = None,
    jobs: int = 1,
    report_path: str = "reports/sweep.md",
    project_dir: str | None = None,
    poll_s: float = 10.0,
    timeout_s: float = 48 * 3600,
    lock_timeout_s: float = 6 * 3600,
) -> dict[str, Any]:
    """Run a grid of DVC experiments and publish their comparison.

    Args:
        grid: params key -> values; every combination is one experiment
            (default :data:`DEFAULT_GRID`).
        base: overrides shared by every run (default :data:`DEFAULT_BASE`; ``{}`` for none).
        metric: dotted metric key to rank by, looked up in every DVC metrics file.
        higher_is_better: rank descending (e.g. for precision or recall).
        sweep_name: prefix of the experiment names (default ``sweep-YYYYmmdd-HHMMSS``).
        jobs: parallel queue workers (each runs one experiment; mind the CPU threads).
        report_path: markdown report, relative to the project; ``.png`` and ``.json`` beside.
        project_dir: the DVC project (default: the one holding this file).
        poll_s: seconds between checks of the queue.
        timeout_s: give up waiting after this many seconds.
        lock_timeout_s: how long to wait for a pipeline run that is changing the workspace.
    """
    log = run_logger()
    project = Path(project_dir).resolve() if project_dir else workspace.PROJECT_ROOT
    grid = DEFAULT_GRID if grid is None else grid
    base = DEFAULT_BASE if base is None else base
    sweep_name = sweep_name or time.strftime("sweep-%Y%m%d-%H%M%S")
    planned = plan_runs(grid, base, sweep_name)
    overrides = validate_runs(str(project), planned, base)
    log.info("sweep %s: %d experiments", sweep_name, len(planned))
    # Queueing snapshots the workspace; a pipeline run must not be half-way through it.
    with workspace.workspace_lock(project, lock_timeout_s, log.info):
        for name, values in overrides.items():
            queue_experiment.with_options(task_run_name=f"queue {name}")(str(project), name, values)
    start_workers(str(project), jobs)
    found = wait_for(str(project), overrides, jobs, poll_s, timeout_s, lock_timeout_s)
    context = {
        "sweep": f"`{sweep_name}`, {time.strftime('%Y-%m-%d %H:%M')}",
        "project commit": f"`{_git_commit(project)}` (experiments start from the workspace)",
        "grid": f"`{json.dumps(grid)}`",
        "shared overrides": f"`{json.dumps(base)}`",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {jobs} queue worker(s)",
        "experiments": "`dvc exp show`; `dvc exp apply NAME` restores one in the workspace",
    }
    result = publish_report(
        str(project), planned, found, metric, higher_is_better, str(project / report_path), context
    )
    if result["failed"]:
        raise RuntimeError(
            f"{len(result['failed'])} of {len(planned)} experiments failed "
            f"({', '.join(result['failed'])}); the report lists why: {result['report']}"
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="Run the ganpipe sweep flow once.")
    parser.add_argument("--grid", type=json.loads, default=None, help="JSON: key -> list")
    parser.add_argument("--base", type=json.loads, default=None, help="JSON: key -> value")
    parser.add_argument("--metric", default="fid")
    parser.add_argument("--higher-is-better", action="store_true")
    parser.add_argument("--name", dest="sweep_name", default=None)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--report", dest="report_path", default="reports/sweep.md")
    parser.add_argument("--project-dir", default=None, help="default: this checkout")
    args = parser.parse_args()
    sweep(**vars(args))


if __name__ == "__main__":
    main()
