"""Beyond one machine, on loopback: a real PostgreSQL started here, a Prefect server on it with
credentials, the deployments of a temporary clone, and two process workers that stand for two
GPUs (``CUDA_VISIBLE_DEVICES`` 0 and 1; training runs on the CPU, which ignores it). As on a
team's machines, the workers have no checkout of the project and share no DVC cache with it:
every run clones the team's git remote and pulls from, and pushes to, its DVC remote.

One database, server and pair of workers for the module; the tests run in file order. A
"machine that goes away" is a worker killed with everything it started (SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import itertools
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from flows import service
from tests.e2e.conftest import NO_TRAIN_METRICS, copy_project
from tests.e2e.test_flows_served import (
    client,
    logs,
    no_clone_left,
    processes_in,
    request,
    schedule,
    start_run,
    wait_final,
)
from tests.helpers import experiments, free_port, sh

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("team")]

PIPELINE, EXPERIMENT, SWEEP = service.DEPLOYMENTS.values()

#: Seconds without a heartbeat after which the server marks a flow run Crashed (two missed
#: heartbeats: one late heartbeat on a loaded machine must not crash a healthy run).
CRASH_AFTER_S = 2 * service.HEARTBEAT_S
GPUS = {"gpu0": "0", "gpu1": "1"}
#: A short experiment: every stage reruns (new params) in ~10 s here.
SHORT = {"seed": 1, "train.kimg": 0.256, **NO_TRAIN_METRICS}
#: An experiment long enough to be caught while it trains.
LONG = {"seed": 1, "train.kimg": 40, **NO_TRAIN_METRICS}


def postgres_bin() -> Path:
    """The folder of PostgreSQL's server programs (PATH, then Debian's layout)."""
    found = shutil.which("initdb")
    candidates = [str(Path(found).resolve().parent)] if found else []
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for folder in candidates:
        if (Path(folder) / "initdb").is_file() and (Path(folder) / "postgres").is_file():
            return Path(folder)
    pytest.fail(
        "error: PostgreSQL's initdb and postgres are not on PATH nor in "
        "/usr/lib/postgresql/*/bin; install them: apt-get install postgresql",
        pytrace=False,
    )


def as_postgres_user() -> tuple[list[str], int | None]:
    """The command prefix that runs a program as an unprivileged user (PostgreSQL refuses to
    run as root), and that user's uid (None: this user)."""
    if os.geteuid() != 0:
        return [], None
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        pytest.fail(
            "error: running as root and there is no 'postgres' user for PostgreSQL to run as; "
            "install the postgresql package (it creates it) or run the tests as another user",
            pytrace=False,
        )
    prefix = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups"]
    return prefix, user.pw_uid


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server on 127.0.0.1 on a free port, password auth; its SQLAlchemy URL."""
    programs = postgres_bin()
    prefix, uid = as_postgres_user()
    # Under /tmp, not pytest's tmp folder: that one is mode 0700 for root.
    folder = Path(tempfile.mkdtemp(prefix="ganpipe-pg-"))
    password = "secret-for-the-test"
    (folder / "pw").write_text(password)
    if uid is not None:
        for path in (folder, folder / "pw"):
            os.chown(path, uid, -1)
    initdb = [str(programs / "initdb"), "-D", str(folder / "data"), "-U", "ganpipe"]
    initdb += ["--auth=scram-sha-256", f"--pwfile={folder / 'pw'}", "-E", "UTF8"]
    made = subprocess.run([*prefix, *initdb], capture_output=True, text=True)
    assert made.returncode == 0, made.stdout + made.stderr
    port = free_port()
    listen = ["-h", "127.0.0.1", "-p", str(port), "-k", str(folder)]
    server = subprocess.Popen(
        [*prefix, str(programs / "postgres"), "-D", str(folder / "data"), *listen],
        stdout=(folder / "log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"postgresql+asyncpg://ganpipe:{password}@127.0.0.1:{port}/postgres"
    try:
        deadline = time.monotonic() + 60
        while "ready to accept connections" not in (folder / "log").read_text(errors="replace"):
            assert server.poll() is None and time.monotonic() < deadline, (
                folder / "log"
            ).read_text()
            time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGINT)  # fast shutdown
        server.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


def sql(url: str, query: str):
    """Rows of ``query`` on the database of ``url`` (asyncpg, as the server uses)."""
    import asyncpg

    async def fetch():
        connection = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))
        try:
            return await connection.fetch(query)
        finally:
            await connection.close()

    return asyncio.run(fetch())


@pytest.fixture(scope="module")
def remotes(tmp_path_factory) -> Path:
    """The team's git remote (``git``, bare) and DVC remote (``dvc``)."""
    return tmp_path_factory.mktemp("remotes")


@pytest.fixture(scope="module")
def project(tiny_baseline, remotes, tmp_path_factory) -> Path:
    """A user's clone whose commit names the team's DVC remote, pushed to both remotes."""
    root = copy_project(tiny_baseline, tmp_path_factory.mktemp("team") / "clone")
    sh(["git", "init", "-q", "--bare", "-b", "main", str(remotes / "git")], root)
    sh(["git", "remote", "add", "origin", str(remotes / "git")], root)
    sh(["dvc", "remote", "add", "-d", "shared", str(remotes / "dvc")], root)
    sh(["git", "commit", "-qam", "the team's DVC remote"], root)
    sh(["git", "push", "-q", "origin", "HEAD:refs/heads/main"], root)
    sh(["dvc", "push", "-q"], root)
    return root


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("team-runs")


@pytest.fixture(scope="module")
def team(project, remotes, postgres, runs_dir, tmp_path_factory):
    """Server on PostgreSQL + deployments + the sweeps' worker + two GPU workers, whose runs
    clone the team's git remote."""
    state_dir = tmp_path_factory.mktemp("state")
    env = service.start(
        state_dir,
        free_port(),
        project=project,
        repo=str(remotes / "git"),
        database_url=postgres,
        local_worker=False,
        crash_after_s=CRASH_AFTER_S,
        extra_env={"TMPDIR": str(runs_dir)},
    )
    try:
        schedule(env, state_dir, PIPELINE)
        schedule(env, state_dir, SWEEP)
        for name, gpu in GPUS.items():
            start_gpu_worker(state_dir, env, name, gpu, runs_dir)
        yield env, state_dir
    finally:
        service.stop(state_dir)


def start_gpu_worker(state_dir, env, name, gpu, runs_dir) -> None:
    extra = {"TMPDIR": str(runs_dir)}
    service.start_worker(state_dir, env, service.EXPERIMENTS, 1, gpu, name, extra)


def sweep_parameters(name: str, grid: dict, base: dict, retries: int = 0) -> dict:
    return {"grid": grid, "base": base, "metric": "loss.d", "sweep_name": name, "retries": retries}


def ranking(env: dict, run_id) -> list[dict]:
    """The sweep's ranking table, as any machine reads it: a Prefect artifact."""
    from tests.e2e.test_flows_served import artifacts

    return json.loads(artifacts(env, run_id)["sweep-ranking"].data)


def children(env: dict, run_id) -> list:
    """The experiment flow runs a sweep run started."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    started = FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id]))
    with client(env) as c:
        return c.read_flow_runs(flow_run_filter=started)


def test_the_server_runs_on_postgres_and_wants_credentials(team, postgres):
    env, state_dir = team
    assert request(env, "POST", "/flow_runs/filter", {"Content-Type": "application/json"})[0] == (
        401
    )
    with client(env) as c:
        assert {d.name for d in c.read_deployments()} == {"scheduled", "experiment"}
    names = {row["name"] for row in sql(postgres, "SELECT name FROM deployment")}
    assert names == {"scheduled", "experiment"}  # what the API serves is in PostgreSQL
    workers = {row["name"] for row in sql(postgres, "SELECT name FROM worker")}
    assert set(GPUS) <= workers
    assert not (state_dir / "prefect" / "prefect.db").exists()  # no SQLite on the side


def test_a_sweep_spreads_over_two_workers_and_each_run_records_where_it_ran(
    team, project, runs_dir
):
    env, _ = team
    grid = {"train.strategy": ["d_first_detach", "g_first_detach"], "train.lr_d": [2e-4, 1e-3]}
    run = wait_final(env, start_run(env, SWEEP, sweep_parameters("two", grid, SHORT)).id)
    assert run.state.is_completed(), run.state.message + logs(env, run.id)

    rows = ranking(env, run.id)
    assert len(rows) == 4 and {r["state"] for r in rows} == {"success"}
    losses = [r["loss.d"] for r in rows]
    assert losses == sorted(losses) and all(isinstance(v, float) for v in losses)
    for row in rows:  # each run says which worker and which visible GPU ran it
        assert GPUS[row["worker"]] == row["cuda_visible_devices"], row
    assert {r["worker"] for r in rows} == set(GPUS)
    spans = sorted((r["started"], r["ended"]) for r in rows)
    assert any(b[0] < a[1] for a, b in itertools.pairwise(spans)), spans  # two at once
    from tests.e2e.test_flows_served import artifacts

    markdown = artifacts(env, run.id)["sweep-report"].data
    assert "| 1 | " in markdown and "gpu0, CUDA_VISIBLE_DEVICES=0" in markdown
    sh(["dvc", "exp", "pull", "origin", *(row["experiment"] for row in rows)], project)
    found = experiments(project)  # in the user's clone, from the team's remotes
    for row in rows:
        assert found[row["experiment"]]["params"]["train"]["strategy"] == row["train.strategy"]
    runs = children(env, run.id)
    assert len(runs) == 4 and all(r.state.is_completed() for r in runs)
    no_clone_left(runs_dir)


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (by parent pid, whatever their session)."""
    parents: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(Path(stat).parent.name))
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += parents.get(found[-1], [])
    return found


def worker_of(pid: int) -> str:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"GANPIPE_WORKER="))


def test_a_worker_that_dies_crashes_its_experiment_and_the_sweep_reports_it(team, runs_dir):
    env, state_dir = team
    grid = {"train.lr_g": [3e-4, 4e-4]}
    base = {"seed": 1, "train.kimg": 6, **NO_TRAIN_METRICS}
    started = start_run(env, SWEEP, sweep_parameters("lost", grid, base))
    deadline = time.monotonic() + 300
    while not (training := processes_in(runs_dir, "stages.train")):
        assert time.monotonic() < deadline, logs(env, started.id)
        time.sleep(0.2)
    victim = worker_of(training[0])
    tree = descendants(int((state_dir / "workers" / f"{victim}.pid").read_text()))
    for pid in tree:  # the machine goes away: the worker and all it started, at once
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        run = wait_final(env, started.id, timeout_s=CRASH_AFTER_S + 240)
        crashed_after_s = time.monotonic() - killed_at
    finally:
        start_gpu_worker(state_dir, env, victim, GPUS[victim], runs_dir)
    assert run.state.is_failed(), run.state  # the sweep ends, and says an experiment failed
    assert "1 of 2 experiments failed" in run.state.message
    rows = {r["experiment"]: r for r in ranking(env, run.id)}
    states = sorted(r["state"] for r in rows.values())
    assert states == ["crashed", "success"], rows
    lost = next(r for r in rows.values() if r["state"] == "crashed")
    assert "no heartbeat" in lost["error"]
    done = next(r for r in rows.values() if r["state"] == "success")
    assert done["worker"] != victim
    from tests.e2e.test_flows_served import artifacts

    notes = artifacts(env, run.id)["sweep-report"].data
    assert f"`{lost['experiment']}` crashed" in notes
    # bounded: the crash window after the last heartbeat, plus the other run's remainder
    assert crashed_after_s < CRASH_AFTER_S + 120, crashed_after_s
    assert not processes_in(runs_dir, "stages.train")


def test_cancelling_a_sweep_cancels_every_experiment_run(team, project, runs_dir):
    from prefect.states import Cancelling

    env, _ = team
    known = set(runs_dir.glob("*prefect"))  # left by the worker killed before
    started = start_run(
        env, SWEEP, sweep_parameters("stopped", {"train.lr_g": [3e-4, 4e-4, 5e-4]}, LONG)
    )
    deadline = time.monotonic() + 300
    while len(processes_in(runs_dir, "stages.train")) < 2:  # both workers busy
        assert time.monotonic() < deadline, logs(env, started.id)
        time.sleep(0.2)
    with client(env) as c:
        c.set_flow_run_state(started.id, Cancelling(), force=True)
    run = wait_final(env, started.id, timeout_s=120)
    assert run.state.is_cancelled(), run.state
    deadline = time.monotonic() + 60
    while unfinished := [
        (r.name, r.state_name) for r in children(env, run.id) if not r.state.is_final()
    ]:
        assert time.monotonic() < deadline, unfinished
        time.sleep(1)
    assert len(children(env, run.id)) == 3
    deadline = time.monotonic() + 60
    while processes_in(runs_dir):
        assert time.monotonic() < deadline, "a training process still runs after the cancel"
        time.sleep(0.5)
    no_clone_left(runs_dir, timeout_s=90, known=known)
    listed = sh(["dvc", "exp", "list", "--name-only", "origin"], project).stdout
    assert "stopped" not in listed


def test_an_experiment_travels_to_another_clone_through_the_remotes(team, project, tmp_path):
    """A worker without the project runs an experiment; the user's clone lists and applies
    it, and another clone restores its outputs from the DVC remote without training."""
    env, _ = team
    overrides = {"train.strategy": "g_first_detach", "train.lr_d": 5e-4, **NO_TRAIN_METRICS}
    run = wait_final(
        env, start_run(env, EXPERIMENT, {"overrides": overrides, "exp_name": "travels"}).id
    )
    assert run.state.is_completed(), run.state.message + logs(env, run.id)
    sh(["dvc", "exp", "pull", "origin", "travels"], project)
    metrics_a = experiments(project)["travels"]["metrics"]
    assert metrics_a["metrics/train/metrics.json"]

    other = tmp_path / "b"
    remote = sh(["git", "remote", "get-url", "origin"], project).stdout.strip()
    sh(["git", "clone", "-q", "-b", "main", remote, str(other)], tmp_path)
    sh(["dvc", "exp", "pull", "origin", "travels"], other)
    shown = experiments(other)["travels"]
    assert shown["metrics"] == metrics_a
    assert shown["params"]["train"]["strategy"] == "g_first_detach"

    sh(["dvc", "exp", "apply", "travels"], other)
    restored = sh(["dvc", "repro", "--pull"], other).stdout
    assert "Running stage" not in restored, restored  # train (and all) came from the remote
    lock = yaml.safe_load((other / "dvc.lock").read_text())
    outs = {o["path"]: o["md5"] for o in lock["stages"]["train"]["outs"]}
    assert sh(["dvc", "status", "--json"], other).stdout.strip() in ("{}", "")
    assert (other / "models" / "generator.pt").is_file() and outs["models/generator.pt"]
