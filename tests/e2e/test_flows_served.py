"""The Prefect flows for real: a local server on a free loopback port, the deployments
served from a temporary clone (what ``make serve`` starts), real DVC runs with tiny params.

One server and one serve process for the module; the tests run in file order and share
the clone's DVC workspace, as the deployments of a real checkout would.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from flows import service, workspace
from tests.e2e.conftest import TINY, copy_project
from tests.helpers import sh

pytestmark = pytest.mark.slow

PIPELINE, SWEEP = "ganpipe-pipeline/local", "ganpipe-sweep/local"
INTERVAL_S = 5


@pytest.fixture(scope="module")
def project(tiny_baseline, tmp_path_factory) -> Path:
    """A copy of the reproduced tiny baseline: later runs start from its cache."""
    return copy_project(tiny_baseline, tmp_path_factory.mktemp("flows") / "clone")


@pytest.fixture(scope="module")
def served(project, tmp_path_factory):
    """Server + served deployments (pipeline every INTERVAL_S seconds), stopped at the end."""
    state_dir = tmp_path_factory.mktemp("state")
    url = service.start(
        state_dir,
        service.free_port(),
        ["--pipeline", str(INTERVAL_S), "--sweep", "off"],
        project=project,
        extra_env={"PREFECT_RUNNER_POLL_FREQUENCY": "1"},
    )
    try:
        yield url, state_dir
    finally:
        service.stop(state_dir)


@contextlib.contextmanager
def client(url: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as c:
        yield c


def start_run(url: str, deployment: str, parameters: dict):
    """Create a flow run of ``deployment`` and return it at once (the runner picks it up)."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}):
        return run_deployment(deployment, parameters=parameters, timeout=0, as_subflow=False)


def wait_final(url: str, run_id, timeout_s: float = 300):
    """The flow run once it is in a final state (completed, failed, crashed...)."""
    deadline = time.monotonic() + timeout_s
    with client(url) as c:
        while time.monotonic() < deadline:
            run = c.read_flow_run(run_id)
            if run.state and run.state.is_final():
                return run
            time.sleep(1)
    raise AssertionError(
        f"flow run {run_id} not finished after {timeout_s} s: {run.state}; its log:\n"
        + logs(url, run_id)
    )


def run_and_wait(url: str, deployment: str, parameters: dict, timeout_s: float = 300):
    return wait_final(url, start_run(url, deployment, parameters).id, timeout_s)


def task_runs(url: str, run_id) -> dict:
    """Task run name -> task run, of one flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client(url) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return {run.name: run for run in runs}


def artifacts(url: str, run_id) -> dict:
    """Artifact key -> artifact, of one flow run."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    flow_filter = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
    with client(url) as c:
        return {a.key: a for a in c.read_artifacts(artifact_filter=flow_filter)}


def logs(url: str, run_id) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with client(url) as c:
        found = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return "\n".join(entry.message for entry in found)


def experiment(project: Path, name: str) -> dict:
    shown = json.loads(sh(["dvc", "exp", "show", "--json"], project).stdout)
    return workspace.experiments(shown)[name]


def test_scheduled_runs_complete_with_artifacts_and_are_listed(served, project):
    url, state_dir = served
    with client(url) as c:
        deployment = c.read_deployment_by_name(PIPELINE)

        def scheduled_runs():
            return [
                r
                for r in c.read_flow_runs()
                if r.deployment_id == deployment.id and r.auto_scheduled
            ]

        deadline = time.monotonic() + 120
        while not any(r.state.type.value != "SCHEDULED" for r in scheduled_runs()):
            assert time.monotonic() < deadline, "the schedule fired no run within 120 s"
            time.sleep(0.5)
        # The schedule fired: pause it (this deletes its future runs) so that the next tests
        # run alone, and let the runs already started finish.
        c.pause_deployment(deployment.id)
        deadline = time.monotonic() + 180
        while not all(r.state.is_final() for r in scheduled_runs()):
            assert time.monotonic() < deadline, [(r.name, r.state) for r in scheduled_runs()]
            time.sleep(1)
        done = [r for r in scheduled_runs() if r.state.is_completed()]
    assert done, [(r.name, r.state) for r in scheduled_runs()]
    run = done[0]

    found = artifacts(url, run.id)
    assert {"pipeline-metrics", "pipeline-run"} <= set(found)
    table = json.loads(found["pipeline-metrics"].data)
    metrics = {row["key"]: row["value"] for row in table if row["kind"] == "metric"}
    params = {row["key"]: row["value"] for row in table if row["kind"] == "param"}
    assert metrics["step"] == 128 and params["train.kimg"] == TINY["train"]["kimg"]
    markdown = found["pipeline-run"].data
    assert f"file://{project}/samples/grid.png" in markdown
    assert "no experiment: `dvc repro`" in markdown
    stages = workspace.stage_names(project / "dvc.yaml")
    assert {"prepare", "featurenet", "train", "generate", "evaluate"} <= set(stages)
    assert ", ".join(f"{stage} (cached)" for stage in stages) in markdown
    html = markdown.split("[index.html](file://")[1].split(")")[0]
    assert Path(html).is_file()

    # what a user of `make serve` types, with the environment it wrote
    env = {**os.environ, "COLUMNS": "250"}
    for line in (state_dir / "prefect.env").read_text().splitlines():
        key, value = line.removeprefix("export ").split("=", 1)
        env[key] = value
    listed = subprocess.run(
        [sys.executable, "-m", "prefect", "flow-run", "ls"], env=env, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr
    assert run.name in listed.stdout and "COMPLETED" in listed.stdout


def test_run_with_overrides_makes_an_experiment_with_those_params(served, project):
    url, _ = served
    overrides = {"data.image_size": 16, "train.strategy": "g_first_detach"}
    run = run_and_wait(url, PIPELINE, {"overrides": overrides, "exp_name": "flow-small"})
    assert run.state.is_completed(), run.state.message
    exp = experiment(project, "flow-small")
    assert exp["params"]["data"]["image_size"] == 16
    assert exp["params"]["train"]["strategy"] == "g_first_detach"
    assert exp["metrics"]["metrics/train/metrics.json"]["step"] == 128
    # like `dvc exp run`, the workspace holds the experiment's params and outputs
    assert Image.open(project / "samples/grid.png").size == (2 * 18 + 2, 2 * 18 + 2)
    assert "up to date" in sh(["dvc", "status"], project).stdout
    assert "DVC experiment: **flow-small**" in artifacts(url, run.id)["pipeline-run"].data


def test_bad_override_fails_before_any_stage(served, project):
    url, _ = served
    run = run_and_wait(url, PIPELINE, {"overrides": {"train.batch_sise": 8}})
    assert run.state.is_failed()
    assert "train.batch_sise" in run.state.message
    assert "Did you mean train.batch_size" in run.state.message
    assert not [name for name in task_runs(url, run.id) if name.startswith("stage")]


def test_failing_stage_fails_the_run_with_its_message_without_retry(served, project):
    url, _ = served
    params_before = (project / "params.yaml").read_text()
    overrides = {"data.source": "folder", "data.path": "no-such-folder"}
    run = run_and_wait(url, PIPELINE, {"overrides": overrides, "retry_delay_s": 1})
    assert run.state.is_failed()
    assert "error: data.path='no-such-folder' does not exist" in run.state.message
    tasks = task_runs(url, run.id)
    assert tasks["stage prepare"].state.is_failed()
    assert tasks["stage prepare"].run_count == 1  # a stage's own error is not retried
    assert "stage train" not in tasks
    assert (project / "params.yaml").read_text() == params_before


def test_held_dvc_lock_is_retried_until_free(served, project):
    url, _ = served
    release = project.parent / "release-lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys, time, zc.lockfile\n"
            "lock = zc.lockfile.LockFile(sys.argv[1]); print('held', flush=True)\n"
            "deadline = time.time() + 120\n"
            "while not os.path.exists(sys.argv[2]) and time.time() < deadline: time.sleep(0.1)\n",
            str(project / ".dvc" / "tmp" / "lock"),
            str(release),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        started = start_run(url, PIPELINE, {"stage_retries": 10, "retry_delay_s": 1})
        deadline = time.monotonic() + 120
        while "Unable to acquire lock" not in logs(url, started.id):
            assert time.monotonic() < deadline, logs(url, started.id)
            time.sleep(1)
        release.touch()
        run = wait_final(url, started.id)
    finally:
        release.touch()
        holder.wait(timeout=30)
    assert run.state.is_completed(), run.state.message
    assert task_runs(url, run.id)["stage prepare"].run_count >= 2


def test_two_runs_at_once_take_turns_on_the_workspace(served, project):
    url, _ = served
    # the baseline's data (seed 1, 32 px): prepare and featurenet come from DVC's run cache;
    # both set every key either changes, as the workspace keeps the last run's params
    shared = {"seed": 1, "data.image_size": 32}
    a_set = {**shared, "train.lr_g": 0.001, "train.kimg": 0.128}
    b_set = {**shared, "train.lr_g": 0.0002, "train.kimg": 0.096}
    first = start_run(url, PIPELINE, {"overrides": a_set, "exp_name": "flow-a"})
    second = start_run(url, PIPELINE, {"overrides": b_set, "exp_name": "flow-b"})
    runs = [wait_final(url, first.id), wait_final(url, second.id)]
    assert all(run.state.is_completed() for run in runs), [r.state.message for r in runs]

    a, b = experiment(project, "flow-a"), experiment(project, "flow-b")
    assert a["params"]["train"]["lr_g"] == 0.001 and b["params"]["train"]["kimg"] == 0.096
    assert a["params"]["data"]["image_size"] == b["params"]["data"]["image_size"] == 32
    assert a["metrics"]["metrics/train/metrics.json"]["step"] == 128
    assert b["metrics"]["metrics/train/metrics.json"]["step"] == 96
    assert "up to date" in sh(["dvc", "status"], project).stdout

    # one run's stages all ran before the other's: the flow lock, not luck
    spans = []
    for run in runs:
        stages = [t for name, t in task_runs(url, run.id).items() if name.startswith("stage")]
        spans.append((min(t.start_time for t in stages), max(t.end_time for t in stages)))
    spans.sort()
    assert spans[0][1] <= spans[1][0], spans
    assert any("workspace busy" in logs(url, run.id) for run in runs)


def test_sweep_publishes_a_ranked_report(served, project):
    url, _ = served
    parameters = {
        "grid": {"train.strategy": ["d_first_detach", "g_first_detach"]},
        "base": {"seed": 1},
        "metric": "loss.d",
        "sweep_name": "tiny",
        "poll_s": 2,
        "report_path": "reports/tiny.md",
    }
    run = run_and_wait(url, SWEEP, parameters, timeout_s=400)
    assert run.state.is_completed(), run.state.message

    result = json.loads((project / "reports/tiny.json").read_text())
    names = [row["experiment"] for row in result["runs"]]
    assert sorted(names) == ["tiny-d_first_detach", "tiny-g_first_detach"]
    losses = [row["loss.d"] for row in result["runs"]]
    assert losses == sorted(losses) and all(isinstance(v, float) for v in losses)
    for row in result["runs"]:
        exp = experiment(project, row["experiment"])
        assert exp["params"]["train"]["strategy"] == row["train.strategy"]
        assert exp["metrics"]["metrics/train/metrics.json"]["loss"]["d"] == row["loss.d"]
    markdown = (project / "reports/tiny.md").read_text()
    assert "| 1 | " in markdown and "tiny-g_first_detach" in markdown
    with Image.open(project / "reports/tiny.png") as image:
        assert image.format == "PNG"
    assert {"sweep-ranking", "sweep-report"} <= set(artifacts(url, run.id))


def test_stop_stops_what_start_started(served):
    url, state_dir = served
    pids = {
        name: int((state_dir / f"{name}.pid").read_text())
        for name in ("prefect-server", "flows-serve")
    }
    assert sorted(service.stop(state_dir)) == ["flows-serve", "prefect-server"]
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert service.port_is_free(int(url.rsplit(":", 1)[1].split("/")[0]))
    assert not (state_dir / "prefect.env").exists()
    assert service.stop(state_dir) == []
