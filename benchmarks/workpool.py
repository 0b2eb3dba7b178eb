"""A sweep of 4 short experiments on the work pool: 1 worker vs 2 workers on this machine.

Builds the tests' tiny project (tests/e2e/conftest.py TINY) in a temporary folder, reproduces
it once, then for each setting starts a server (SQLite) with the deployments, N experiment
workers (``--limit 1`` each, one training thread per run: ``devices.cpu_threads: 1``) and the
sweeps' worker, runs the sweep deployment with a 4-point grid, and reads the report's time
spans. Printed as a table; JSON in benchmarks/results/workpool.json.

- wall time: the sweep flow run, start to end;
- idle gap: on one worker, the time between one run's end and the next run's start (the
  worker's polling interval, ``PREFECT_WORKER_QUERY_SECONDS``, shows here).

    python -m benchmarks.workpool
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import datetime
from pathlib import Path

from flows import service
from tests.e2e.conftest import TINY
from tests.helpers import clone_working_tree, sh

RESULTS = Path(__file__).parent / "results" / "workpool.json"
#: (experiment workers, worker polling interval s)
SETTINGS = [(1, 2.0), (2, 2.0), (1, 10.0)]
GRID = {"train.lr_g": [2e-4, 3e-4, 4e-4, 5e-4]}
#: Each setting gets seeds of its own: with the same params a later setting's experiments
#: would come from DVC's run cache instead of training.
BASE = {"train.kimg": 0.512}


def run_sweep(project: Path, workers: int, query_s: float, name: str, seed: int) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    state = Path(tempfile.mkdtemp(prefix="ganpipe-bench-state-"))
    quick = {"PREFECT_WORKER_QUERY_SECONDS": str(query_s)}
    quick["PREFECT_WORKER_PREFETCH_SECONDS"] = str(query_s)
    env = service.start(
        state,
        service.free_port(),
        project=project,
        local_worker=False,
        extra_env=quick,
    )
    try:
        tools = service.tool_env(env, state)
        for deployment in (service.DEPLOYMENTS["pipeline"], service.DEPLOYMENTS["sweep"]):
            service.prefect(["deployment", "schedule", "clear", deployment, "-y"], tools)
        for index in range(workers):
            service.start_worker(
                state,
                env,
                service.EXPERIMENTS,
                1,
                gpu=str(index),
                name=f"w{index}",
                extra_env=quick,
            )
        settings = {
            PREFECT_API_URL: env["PREFECT_API_URL"],
            PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"],
        }
        parameters = {
            "grid": GRID,
            "base": {**BASE, "seed": seed},
            "metric": "loss.d",
            "sweep_name": name,
        }
        with temporary_settings(settings):
            started = run_deployment(service.DEPLOYMENTS["sweep"], parameters=parameters, timeout=0)
            with get_client(sync_client=True) as client:
                while not (run := client.read_flow_run(started.id)).state.is_final():
                    time.sleep(1)
        assert run.state.is_completed(), run.state
    finally:
        service.stop(state)
        shutil.rmtree(state, ignore_errors=True)
    rows = json.loads((project / f"reports/sweeps/{name}.json").read_text())["runs"]
    gaps = []
    for worker in {r["worker"] for r in rows}:
        spans = sorted(
            (datetime.fromisoformat(r["started"]), datetime.fromisoformat(r["ended"]))
            for r in rows
            if r["worker"] == worker
        )
        gaps += [(b[0] - a[1]).total_seconds() for a, b in itertools.pairwise(spans)]
    runs = [
        (datetime.fromisoformat(r["ended"]) - datetime.fromisoformat(r["started"])).total_seconds()
        for r in rows
    ]
    return {
        "workers": workers,
        "query_s": query_s,
        "wall_s": round((run.end_time - run.start_time).total_seconds(), 1),
        "run_s_mean": round(statistics.mean(runs), 1),
        "idle_gap_s_mean": round(statistics.mean(gaps), 1) if gaps else None,
        "idle_gaps_s": [round(g, 1) for g in gaps],
    }


def main() -> None:
    folder = Path(tempfile.mkdtemp(prefix="ganpipe-bench-"))
    project = clone_working_tree(folder / "clone", TINY)
    sh(["dvc", "repro"], project)
    sh(["git", "add", "-A"], project)
    sh(["git", "commit", "-qm", "baseline"], project)
    try:
        results = [
            run_sweep(project, workers, query_s, f"bench{i}", seed=100 + i)
            for i, (workers, query_s) in enumerate(SETTINGS)
        ]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    one = next(r for r in results if r["workers"] == 1 and r["query_s"] == 2.0)
    two = next(r for r in results if r["workers"] == 2)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    load = os.getloadavg()[0]
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f}",
        "experiments": 4,
        "grid": GRID,
        "base": BASE,
        "results": results,
        "wall_ratio_1_over_2": round(one["wall_s"] / two["wall_s"], 2),
    }
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    print("| workers | polling (s) | sweep wall (s) | run (s, mean) | idle gap (s, mean) |")
    print("|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['workers']} | {r['query_s']:g} | {r['wall_s']} | {r['run_s_mean']} | "
            f"{r['idle_gap_s_mean']} |"
        )
    print(f"wall time 1 worker / 2 workers: {record['wall_ratio_1_over_2']}; {record['machine']}")


if __name__ == "__main__":
    main()
