"""The Prefect flows for real: a local server with credentials on a free loopback port, the
deployments of prefect.yaml on its process work pool with one local worker (and the sweeps'
worker: what ``make serve`` starts), fresh git clones and DVC experiments with tiny params.

One server and its workers for the module; the tests run in file order. The workers have no
checkout of the project (they run in the state folder): every flow run clones it into its
own temporary folder (under this module's ``TMPDIR``) and returns its experiment with
``dvc exp push``, so the project's workspace must stay byte-identical through all of them
(checked by the last test).
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from PIL import Image

from flows import service
from ganpipe.params import read_yaml
from tests.e2e.conftest import NO_TRAIN_METRICS, NO_TRAIN_METRICS_ARGS, TINY, copy_project
from tests.helpers import experiments, free_port, sh

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("served")]

PIPELINE, EXPERIMENT, SWEEP = service.DEPLOYMENTS.values()
INTERVAL_S = 5
#: How long no scheduled run may be unfinished before the schedule counts as stopped
#: (longer than the runner takes to pick up a due run).
QUIET_S = 5
#: What a flow run could change in the workspace if it ran there.
WORKSPACE = ("params.yaml", "dvc.lock", "data", "models", "metrics")


def snapshot(root: Path, names=WORKSPACE) -> dict[str, bytes]:
    files = {}
    for name in names:
        for path in [root / name, *sorted((root / name).rglob("*"))]:
            if path.is_file():
                files[str(path.relative_to(root))] = path.read_bytes()
    return files


@pytest.fixture(scope="module")
def project(tiny_baseline, tmp_path_factory) -> Path:
    """A copy of the reproduced tiny baseline: runs start from its commit and cache."""
    return copy_project(tiny_baseline, tmp_path_factory.mktemp("flows") / "clone")


@pytest.fixture(scope="module")
def workspace_before(project) -> dict[str, bytes]:
    return snapshot(project)


#: Seconds a flow run may stay Pending (its process starting) before it is marked Crashed.
START_WITHIN_S = 60


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    """Where the workers make each run's temporary folder (their TMPDIR)."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def served(project, workspace_before, runs_dir, tmp_path_factory):
    """Server + deployments (no schedules: the test of schedules sets its own) + the local
    worker (two runs at a time, so that a sweep's experiments can overlap) + the sweeps'
    worker, stopped at the end."""
    state_dir = tmp_path_factory.mktemp("state")
    # The workers poll as make serve's do (service.QUERY_S): polling every second cost the
    # server CPU the tests' stages need (docs/orchestration.md#one-worker-or-two).
    env = service.start(
        state_dir,
        free_port(),
        project=project,
        limit=2,
        start_within_s=START_WITHIN_S,
        extra_env={"TMPDIR": str(runs_dir)},
    )
    try:
        schedule(env, state_dir, PIPELINE)  # no run before the test of schedules sets one
        schedule(env, state_dir, SWEEP)
        yield env, state_dir
    finally:
        service.stop(state_dir)


def schedule(env: dict, state_dir: Path, deployment: str, *how: str) -> None:
    """Replace the schedules prefect.yaml gave ``deployment`` (``--interval S``, ``--cron
    C``), or clear them (no ``how``), with Prefect's own CLI as a user would."""
    tools = service.tool_env(env, state_dir)
    if how:
        service.prefect(
            ["deployment", "schedule", "create", deployment, *how, "--replace", "-y"], tools
        )
    else:
        service.prefect(["deployment", "schedule", "clear", deployment, "-y"], tools)


@contextlib.contextmanager
def client(env: dict):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    settings = {
        PREFECT_API_URL: env["PREFECT_API_URL"],
        PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"],
    }
    with temporary_settings(settings), get_client(sync_client=True) as c:
        yield c


def start_run(env: dict, deployment: str, parameters: dict):
    """Create a flow run of ``deployment`` and return it at once (the runner picks it up)."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    settings = {
        PREFECT_API_URL: env["PREFECT_API_URL"],
        PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"],
    }
    with temporary_settings(settings):
        return run_deployment(deployment, parameters=parameters, timeout=0, as_subflow=False)


def wait_final(env: dict, run_id, timeout_s: float = 300):
    """The flow run once it is in a final state (completed, failed, crashed...)."""
    deadline = time.monotonic() + timeout_s
    with client(env) as c:
        while time.monotonic() < deadline:
            run = c.read_flow_run(run_id)
            if run.state and run.state.is_final():
                return run
            time.sleep(1)
    raise AssertionError(f"flow run {run_id} not final after {timeout_s} s:\n{logs(env, run_id)}")


def run_and_wait(env: dict, deployment: str, parameters: dict, timeout_s: float = 300):
    return wait_final(env, start_run(env, deployment, parameters).id, timeout_s)


def task_runs(env: dict, run_id) -> dict:
    """Task run name -> task run, of one flow run."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client(env) as c:
        runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return {run.name: run for run in runs}


def artifacts(env: dict, run_id) -> dict:
    """Artifact key -> artifact, of one flow run."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    flow_filter = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
    with client(env) as c:
        return {a.key: a for a in c.read_artifacts(artifact_filter=flow_filter)}


def logs(env: dict, run_id) -> str:
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with client(env) as c:
        found = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return "\n".join(entry.message for entry in found)


def no_clone_left(runs_dir: Path, timeout_s: float = 30, known=frozenset()) -> None:
    """Every run's clone in the workers' temporary folders but those in ``known`` folders is
    gone (the flow removes its clone as it ends; a worker killed with its runs leaves theirs,
    as any killed process would)."""
    deadline = time.monotonic() + timeout_s
    while left := {git.parent for git in runs_dir.glob("*prefect/*/.git")} - clones_in(known):
        assert time.monotonic() < deadline, left
        time.sleep(0.5)


def clones_in(folders) -> set[Path]:
    return {git.parent for folder in folders for git in Path(folder).glob("*/.git")}


def processes_in(runs_dir: Path, text: str = "") -> list[int]:
    """Processes working in a run's clone under ``runs_dir`` whose command line has ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if (
                proc.name.isdigit()
                and os.readlink(proc / "cwd").startswith(str(runs_dir) + "/")
                and text.encode() in (proc / "cmdline").read_bytes()
            ):
                found.append(int(proc.name))
    return found


def request(env: dict, method: str, path: str, headers: dict, body: bytes | None = None):
    url = env["PREFECT_API_URL"] + path
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers, method=method)) as r:
            return r.status, r.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers


def test_the_server_wants_credentials_listens_on_loopback_and_takes_no_paths(served):
    env, state_dir = served
    port = int(env["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0])
    token = base64.b64encode(env["PREFECT_API_AUTH_STRING"].encode()).decode()
    json_body = {"Content-Type": "application/json"}
    assert request(env, "POST", "/flow_runs/filter", json_body, b"{}")[0] == 401
    wrong = {**json_body, "Authorization": "Basic " + base64.b64encode(b"ganpipe:x").decode()}
    assert request(env, "POST", "/flow_runs/filter", wrong, b"{}")[0] == 401
    authorised = {**json_body, "Authorization": f"Basic {token}"}
    assert request(env, "POST", "/flow_runs/filter", authorised, b"{}")[0] == 200
    assert (state_dir / "prefect.env").stat().st_mode & 0o777 == 0o600
    assert (state_dir / "server.log").stat().st_mode & 0o777 == 0o600
    for folder in (state_dir, state_dir / "prefect", state_dir / "workers"):
        assert folder.stat().st_mode & 0o777 == 0o700

    def preflight(origin: str):
        headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
        return request(env, "OPTIONS", "/flow_runs/filter", headers)[1]

    assert preflight("http://evil.example").get("access-control-allow-origin") is None
    own = f"http://127.0.0.1:{port}"
    assert preflight(own).get("access-control-allow-origin") == own

    # every listening socket on the port is bound to 127.0.0.1 (/proc/net/tcp: hex, LISTEN=0A)
    listening = [
        line.split()[1]
        for table in ("/proc/net/tcp", "/proc/net/tcp6")
        for line in Path(table).read_text().splitlines()[1:]
        if line.split()[1].endswith(f":{port:04X}") and line.split()[3] == "0A"
    ]
    assert listening == [f"0100007F:{port:04X}"]

    with client(env) as c:
        for name in (PIPELINE, EXPERIMENT, SWEEP):
            schema = c.read_deployment_by_name(name).parameter_openapi_schema["properties"]
            assert not [key for key in schema if "path" in key or "dir" in key], name
    # a parameter the flow does not declare never reaches a stage
    run = run_and_wait(env, EXPERIMENT, {"project_dir": "/tmp"})
    assert run.state.is_failed() or run.state.is_crashed(), run.state
    assert not [name for name in task_runs(env, run.id) if name.startswith("dvc")]


def test_a_run_whose_process_never_starts_is_crashed_within_the_bound(served):
    env, _ = served
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    settings = {
        PREFECT_API_URL: env["PREFECT_API_URL"],
        PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"],
    }
    with temporary_settings(settings):
        started = run_deployment(
            EXPERIMENT, job_variables={"command": "false"}, timeout=0, as_subflow=False
        )
    run = wait_final(env, started.id, timeout_s=START_WITHIN_S + 90)
    assert run.state.is_crashed() or run.state.is_failed(), run.state


def test_scheduled_runs_are_experiments_with_artifacts_and_are_listed(
    served, project, tiny_baseline, runs_dir
):
    env, state_dir = served
    schedule(env, state_dir, PIPELINE, "--interval", str(INTERVAL_S))
    with client(env) as c:
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
        # The schedule fired: pause it so that the next tests run alone, and let the runs
        # already started finish. Pausing deletes the future runs only: runs already due
        # (Late, waiting for the runner's one slot) stay and would start later, so runs
        # still waiting are deleted until nothing is left unfinished for QUIET_S.
        c.pause_deployment(deployment.id)
        deadline, quiet_since = time.monotonic() + 180, time.monotonic()
        while time.monotonic() - quiet_since < QUIET_S:
            unfinished = [r for r in scheduled_runs() if not r.state.is_final()]
            assert time.monotonic() < deadline, [(r.name, r.state) for r in unfinished]
            for r in unfinished:
                if r.state.type.value == "SCHEDULED":
                    with contextlib.suppress(Exception):  # the runner may take it meanwhile
                        c.delete_flow_run(r.id)
            if unfinished:
                quiet_since = time.monotonic()
            time.sleep(1)
        done = [r for r in scheduled_runs() if r.state.is_completed()]
    assert done, [(r.name, r.state) for r in scheduled_runs()]
    run = done[0]

    found = artifacts(env, run.id)
    table = json.loads(found["pipeline-metrics"].data)
    metrics = {row["key"]: row["value"] for row in table if row["kind"] == "metric"}
    params = {row["key"]: row["value"] for row in table if row["kind"] == "param"}
    assert metrics["step"] == 128 and params["train.kimg"] == TINY["train"]["kimg"]
    markdown = found["pipeline-run"].data
    assert f"DVC experiment: **{run.name}**" in markdown
    # every stage from the shared cache: train has no persisted output (its checkpoints
    # are no DVC output), so DVC's run cache restores it too
    for stage in yaml.safe_load((project / "dvc.yaml").read_text())["stages"]:
        assert f"{stage} (cached)" in markdown
    rev = experiments(project)[run.name]["rev"]
    lock = yaml.safe_load(sh(["git", "show", f"{rev}:dvc.lock"], project).stdout)
    assert model_md5(lock) == model_md5(yaml.safe_load((tiny_baseline / "dvc.lock").read_text()))
    assert experiments(project)[run.name]["params"]["seed"] == TINY["seed"]
    no_clone_left(runs_dir)

    # what a user of `make flow-runs` gets, with the environment `make serve` wrote
    shell = f". {state_dir / 'prefect.env'} && {sys.executable} -m prefect flow-run ls"
    listed = subprocess.run(
        ["bash", "-c", shell],
        env={**os.environ, "COLUMNS": "250", "PREFECT_API_AUTH_STRING": ""},
        capture_output=True,
        text=True,
    )
    assert listed.returncode == 0, listed.stderr
    assert run.name in listed.stdout and "COMPLETED" in listed.stdout


def test_run_with_overrides_makes_an_experiment_with_those_params(served, project):
    env, _ = served
    overrides = {
        "data.image_size": 16,
        "train.strategy": "g_first_detach",
        "model.g_channels.4": 24,  # an int-keyed map, overridden in place
        **NO_TRAIN_METRICS,
    }
    run = run_and_wait(env, PIPELINE, {"overrides": overrides, "exp_name": "flow-small"})
    assert run.state.is_completed(), run.state.message
    exp = experiments(project)["flow-small"]
    assert exp["params"]["data"]["image_size"] == 16
    assert exp["params"]["train"]["strategy"] == "g_first_detach"
    assert exp["metrics"]["metrics/train/metrics.json"]["step"] == 128
    params = read_yaml(sh(["git", "show", f"{exp['rev']}:params.yaml"], project).stdout)
    assert params["model"]["g_channels"][4] == 24 and "4" not in params["model"]["g_channels"]
    assert "DVC experiment: **flow-small**" in artifacts(env, run.id)["pipeline-run"].data
    # the name is taken now: a second run under it fails before any stage
    again = run_and_wait(env, PIPELINE, {"exp_name": "flow-small"})
    assert again.state.is_failed() and "dvc exp remove flow-small" in again.state.message


def test_bad_override_fails_before_any_stage(served, project):
    env, _ = served
    run = run_and_wait(env, PIPELINE, {"overrides": {"train.batch_sise": 8}})
    assert run.state.is_failed()
    assert "train.batch_sise" in run.state.message
    assert "Did you mean train.batch_size" in run.state.message
    assert not [name for name in task_runs(env, run.id) if name.startswith("dvc")]
    for path in ("/etc", "../outside"):  # the worker's own folders are out of reach
        overrides = {"data.source": "folder", "data.path": path}
        run = run_and_wait(env, PIPELINE, {"overrides": overrides})
        assert run.state.is_failed() and "must be a folder inside the project" in run.state.message
    # a folder the project does not track is invisible to a run: named, with the fix
    (project / "my-images").mkdir(exist_ok=True)
    overrides = {"data.source": "folder", "data.path": "my-images"}
    run = run_and_wait(env, PIPELINE, {"overrides": overrides})
    assert run.state.is_failed() and "dvc add my-images" in run.state.message
    assert not [name for name in task_runs(env, run.id) if name.startswith("dvc")]
    (project / "my-images").rmdir()


def test_failing_stage_fails_the_run_with_its_message_without_retry(served, project, runs_dir):
    env, _ = served
    overrides = {"data.source": "folder", "data.path": "src"}  # tracked, but no images
    run = run_and_wait(env, PIPELINE, {"overrides": overrides})
    assert run.state.is_failed()
    assert "error: data.path=" in run.state.message and "holds no image files" in run.state.message
    tasks = task_runs(env, run.id)
    assert tasks["dvc exp run"].state.is_failed()
    assert tasks["dvc exp run"].run_count == 1  # a stage's own error is not retried
    no_clone_left(runs_dir)


def model_md5(lock: dict) -> str:
    outs = lock["stages"]["train"]["outs"]
    return next(o["md5"] for o in outs if o["path"] == "models/generator.pt")


def test_a_flow_run_and_a_user_running_experiments_in_the_workspace(
    served, project, tiny_baseline, runs_dir
):
    """The user loops `dvc exp run -S seed=N` in the workspace while a served run with
    seed 1 goes on: both complete, and every experiment's dvc.lock holds the params its
    models were trained with (training is deterministic: one seed, one model)."""
    env, _ = served
    stop, log = project.parent / "stop-user-loop", project.parent / "user-loop.log"
    no_metrics = " ".join(NO_TRAIN_METRICS_ARGS)
    loop = (
        f"n=2; while [ ! -e {stop} ]; do "
        f"dvc exp run -S seed=$n {no_metrics} --name user-$n && n=$((n+1)) || sleep 0.5; done"
    )
    user = subprocess.Popen(
        ["bash", "-c", loop],
        cwd=project,
        env={**os.environ, "DVC_NO_ANALYTICS": "1"},
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        time.sleep(2)  # the user's first experiment has started writing the workspace
        run = run_and_wait(env, PIPELINE, {"overrides": {"seed": 1}, "exp_name": "flow-seed1"})
        deadline = time.monotonic() + 240
        while "user-2" not in experiments(project):
            assert user.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(2)
    finally:
        stop.touch()
        user.wait(timeout=300)
    assert run.state.is_completed(), run.state.message

    found = experiments(project)
    made = {name: exp for name, exp in found.items() if name.startswith(("user-", "flow-seed1"))}
    assert made["flow-seed1"]["params"]["seed"] == 1
    by_seed: dict[int, set[str]] = {}
    for name, exp in made.items():
        lock = yaml.safe_load(sh(["git", "show", f"{exp['rev']}:dvc.lock"], project).stdout)
        seed = lock["stages"]["train"]["params"]["params.yaml"]["seed"]
        assert seed == exp["params"]["seed"] == (1 if name == "flow-seed1" else int(name[5:]))
        by_seed.setdefault(seed, set()).add(model_md5(lock))
    baseline = yaml.safe_load((tiny_baseline / "dvc.lock").read_text())
    assert by_seed[1] == {model_md5(baseline)}  # the flow's models are seed 1's
    assert all(len(md5s) == 1 for md5s in by_seed.values()), by_seed
    assert len({next(iter(m)) for m in by_seed.values()}) == len(by_seed)  # seeds differ

    # the workspace holds what the user's last experiment left, nothing of the flow's
    last = max((n for n in made if n.startswith("user-")), key=lambda n: int(n[5:]))
    for name in ("params.yaml", "dvc.lock"):
        committed = sh(["git", "show", f"{made[last]['rev']}:{name}"], project).stdout
        assert (project / name).read_text() == committed, name
    no_clone_left(runs_dir)
    # back to the baseline for the next tests (what the user would do)
    sh(["git", "checkout", "--", "."], project)
    sh(["dvc", "checkout", "-q"], project)


def test_sweep_runs_in_parallel_retries_a_killed_experiment_and_ranks(served, project, runs_dir):
    env, _ = served
    parameters = {
        "grid": {
            "train.strategy": ["d_first_detach", "g_first_detach"],
            "train.lr_d": [2e-4, 1e-3],
        },
        "base": {"seed": 1, "train.kimg": 0.256, **NO_TRAIN_METRICS},
        "metric": "loss.d",
        "sweep_name": "tiny",
        "parallel": 2,
        "retries": 1,
    }
    started = start_run(env, SWEEP, parameters)
    deadline = time.monotonic() + 300
    while not (training := processes_in(runs_dir, "stages.train")):
        assert time.monotonic() < deadline, logs(env, started.id)
        time.sleep(0.05)
    os.kill(training[0], signal.SIGKILL)  # a worker process dies mid-experiment
    run = wait_final(env, started.id, timeout_s=400)
    assert run.state.is_completed(), run.state.message + logs(env, run.id)

    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    below = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))
    with client(env) as c:
        experiment_runs = c.read_flow_runs(flow_run_filter=below)
    spans = sorted((r.start_time, r.end_time) for r in experiment_runs)
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans)), spans  # two ran at once
    # the killed stage is a transient failure: its experiment's `dvc exp run` ran again
    counts = sorted(task_runs(env, r.id)["dvc exp run"].run_count for r in experiment_runs)
    assert counts == [1, 1, 1, 2], counts
    assert any("exited with -9" in logs(env, r.id) for r in experiment_runs)
    result = json.loads((project / "reports/sweeps/tiny.json").read_text())
    # ... as flow runs of their own on the worker: their recorded time spans overlap
    runs = sorted((r["started"], r["ended"]) for r in result["runs"])
    assert any(b[0] < a[1] for a, b in itertools.pairwise(runs)), runs
    assert len(result["runs"]) == 4 and {r["state"] for r in result["runs"]} == {"success"}
    losses = [row["loss.d"] for row in result["runs"]]
    assert losses == sorted(losses) and all(isinstance(v, float) for v in losses)
    found = experiments(project)
    for row in result["runs"]:
        exp = found[row["experiment"]]
        assert exp["params"]["train"]["strategy"] == row["train.strategy"]
        assert exp["metrics"]["metrics/train/metrics.json"]["loss"]["d"] == row["loss.d"]
    assert "| 1 | " in (project / "reports/sweeps/tiny.md").read_text()
    with Image.open(project / "reports/sweeps/tiny.png") as image:
        assert image.format == "PNG"
    assert {"sweep-ranking", "sweep-report"} <= set(artifacts(env, run.id))
    no_clone_left(runs_dir)
    report_bytes = (project / "reports/sweeps/tiny.md").read_bytes()
    again = run_and_wait(env, SWEEP, parameters)  # a report is never overwritten
    assert again.state.is_failed() and "tiny.md exists" in again.state.message
    assert (project / "reports/sweeps/tiny.md").read_bytes() == report_bytes
    sh(["rm", "-r", "reports/sweeps"], project)  # not tracked: the workspace's own


def test_cancelling_a_sweep_stops_its_experiments_and_leaves_nothing(served, project, runs_dir):
    from prefect.states import Cancelling

    env, _ = served
    parameters = {
        "grid": {"train.lr_g": [3e-4, 4e-4, 5e-4]},
        "base": {"seed": 1, "train.kimg": 40, **NO_TRAIN_METRICS},
        "sweep_name": "cancelled",
        "parallel": 2,
    }
    started = start_run(env, SWEEP, parameters)
    deadline = time.monotonic() + 300
    while not processes_in(runs_dir, "stages.train"):
        assert time.monotonic() < deadline, logs(env, started.id)
        time.sleep(0.2)
    with client(env) as c:
        c.set_flow_run_state(started.id, Cancelling(), force=True)
    run = wait_final(env, started.id, timeout_s=120)
    assert run.state.is_cancelled(), run.state
    deadline = time.monotonic() + 60
    while processes_in(runs_dir):
        assert time.monotonic() < deadline, "an experiment still runs after the cancel"
        time.sleep(0.5)
    no_clone_left(runs_dir)
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    # The experiments' subflow runs died with their process; the server's cancellation
    # clean-up service (every 20 s) cancels the children of a cancelled flow run.
    children = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id]))
    deadline = time.monotonic() + 90
    with client(env) as c:
        while unfinished := [
            r.name for r in c.read_flow_runs(flow_run_filter=children) if not r.state.is_final()
        ]:
            assert time.monotonic() < deadline, unfinished
            time.sleep(2)
    assert not [name for name in experiments(project) if name.startswith("cancelled")]
    assert not (project / "reports/sweeps/cancelled.md").exists()


def test_stop_stops_what_start_started_and_the_workspace_never_changed(
    served, project, workspace_before
):
    env, state_dir = served
    workers = sorted((state_dir / "workers").glob("*.pid"))
    pids = [int(path.read_text()) for path in workers]
    pids.append(int((state_dir / "server.pid").read_text()))
    names = sorted(path.stem for path in workers)
    assert len(names) == 2  # the local experiments worker and the sweeps' worker
    assert sorted(service.stop(state_dir)) == sorted(["server", *names])
    for pid in pids:
        assert service.gone(pid)
    port = int(env["PREFECT_API_URL"].rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
    assert service.stop(state_dir) == []
    assert (state_dir / "prefect.env").stat().st_mode & 0o777 == 0o600  # kept: the credential
    assert snapshot(project) == workspace_before
