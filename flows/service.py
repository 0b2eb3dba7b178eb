"""Start and stop a locked-down Prefect server, the project's deployments and its workers.

``python -m flows.service start`` (``make serve``):

1. generates the server's credentials once per checkout: ``.state/prefect-auth``
   (``ganpipe:<random>``, mode 0600);
2. ``prefect server start`` in the background (log ``.state/prefect-server.log``) on
   127.0.0.1 (``--host`` for a team server), with basic auth
   (``PREFECT_SERVER_API_AUTH_STRING``), CORS limited to the server's own UI origin, telemetry
   off, on SQLite under ``.state/prefect`` or on the database of
   ``--database-url`` (``PREFECT_API_DATABASE_CONNECTION_URL``, e.g. PostgreSQL);
   ``prefect server status --wait`` until healthy;
3. ``python -m flows.deploy ...``: the work pool, its queues, the deployments, the crash
   automation (:mod:`flows.deploy`);
4. two workers in the background (logs and pids in ``.state/workers/``): one for the
   ``experiments`` queue taking one run at a time (the machine's GPU, or ``--gpu``), one for
   the ``sweeps`` queue (a sweep only waits for its experiments);
5. writes ``.state/prefect.env`` (mode 0600; ``. .state/prefect.env`` points a shell's
   ``prefect`` commands, and ``make worker`` on any machine, at this server).

``python -m flows.service worker --gpu N`` (``make worker GPU=N``) starts one more worker for
the ``experiments`` queue with ``CUDA_VISIBLE_DEVICES=N``: every flow run it starts inherits
its environment. On another machine, copy ``.state/prefect.env`` (URL and credentials) from
the server's host first. ``python -m flows.service stop`` (``make stop``) stops this
checkout's workers first (otherwise they retry the vanished server), then the server if it
runs here. Prefect offers no allow-list for the ``Host`` header, so a request with a foreign
Host is not refused by name; it still needs the credentials.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import datetime
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
STATE_DIR = PROJECT_ROOT / ".state"
HOST = "127.0.0.1"
WORKERS = "workers"
SERVER_LOG = "prefect-server.log"
#: flows/deploy.py's names (this module imports the standard library only).
POOL, EXPERIMENTS, SWEEPS = "ganpipe", "experiments", "sweeps"
EXPERIMENT = "ganpipe-pipeline/experiment"
DEPLOYMENTS = ("ganpipe-pipeline/scheduled", EXPERIMENT, "ganpipe-sweep/scheduled")
#: Seconds between a flow run's heartbeats (flows/deploy.py HEARTBEAT_S).
HEARTBEAT_S = 30
#: Seconds between a worker's polls for work; Prefect's 10 s is long beside short runs
#: (benchmarks/workpool.py measures the gap it leaves between two runs).
QUERY_S = 2
#: Sweeps one machine's sweep worker runs at once (each only waits for its experiments).
SWEEP_LIMIT = 4


def credentials(state_dir: Path) -> str:
    """``user:password`` of the local server, made once into ``prefect-auth`` (mode 0600)."""
    path = state_dir / "prefect-auth"
    state_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"ganpipe:{secrets.token_urlsafe(24)}\n")
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return path.read_text().strip()


def client_env(state_dir: Path, port: int, host: str = HOST) -> dict[str, str]:
    """Environment of the workers and of any ``prefect`` command using the server."""
    return {
        "PREFECT_HOME": str(state_dir / "prefect"),
        "PREFECT_API_URL": f"http://{host}:{port}/api",
        "PREFECT_API_AUTH_STRING": credentials(state_dir),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
    }


def server_env(
    state_dir: Path, port: int, host: str = HOST, database_url: str | None = None
) -> dict[str, str]:
    env = {
        **client_env(state_dir, port, host),
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_API_AUTH_STRING": credentials(state_dir),
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": f"http://{host}:{port}",
    }
    if database_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    return env


def prefect(args: list[str], env: dict[str, str], timeout_s: float = 180):
    """``prefect ARGS`` with ``env``, in a session of its own (so is the server it starts)."""
    return subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        start_new_session=True,
    )


def free_port() -> int:
    """A loopback port nobody listens on (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def api(env: dict[str, str], path: str, body: dict | None = None):
    """POST ``body`` (or GET) to the server's REST API, with the credentials; the JSON."""
    token = base64.b64encode(env["PREFECT_API_AUTH_STRING"].encode()).decode()
    request = urllib.request.Request(
        env["PREFECT_API_URL"] + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Basic {token}"},
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read() or b"null")


def pid_of(path: Path) -> int | None:
    """The pid in the file ``path`` if that process still runs (a zombie does not)."""
    try:
        pid = int(path.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    return None if gone(pid) else pid


def gone(pid: int) -> bool:
    """Whether ``pid`` has ended (reaped here if it is our child; a zombie counts as ended)."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def start(
    state_dir: Path,
    port: int,
    deploy_args: list[str],
    extra_env: dict[str, str] | None = None,
    project: Path = PROJECT_ROOT,
    timeout_s: float = 120,
    host: str = HOST,
    database_url: str | None = None,
    gpu: str | None = None,
    limit: int = 1,
    local_worker: bool = True,
) -> dict[str, str]:
    """Server, deployments, workers; write ``prefect.env``; return the clients' environment.

    Args:
        deploy_args: Options of ``python -m flows.deploy`` (schedules, ``--crash-after``).
        extra_env: Added to the environment of the deploy step and of the workers.
        project: The checkout whose flows are deployed (and whose repository they use).
        database_url: SQLAlchemy URL of the server's database (default: SQLite in
            ``state_dir/prefect``), e.g. ``postgresql+asyncpg://user:pw@host:5432/prefect``.
        gpu: ``CUDA_VISIBLE_DEVICES`` of the local experiments worker (default: inherited).
        limit: Flow runs the local experiments worker runs at once.
        local_worker: False starts the server and the deployments only (a team server whose
            GPUs are on other machines; the sweeps worker still starts).

    Raises:
        RuntimeError: something already runs, or a step failed (its output attached).
    """
    env = client_env(state_dir, port, host)
    if running_workers(state_dir) or pid_of(state_dir / "prefect" / "server.pid"):
        raise RuntimeError(f"a server or workers already run from {state_dir}; make stop first")
    (state_dir / "prefect").mkdir(parents=True, exist_ok=True)
    # Not `prefect server start --background`: it hands the server pipes that nobody reads
    # once it has returned, so the first warning the server prints kills it (EPIPE; measured:
    # the server died when a sweep retried an experiment). Same command, in the foreground,
    # writing to a log file, in a session of its own.
    with open(state_dir / SERVER_LOG, "ab") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start"],
            env={**os.environ, **server_env(state_dir, port, host, database_url)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (state_dir / "prefect" / "server.pid").write_text(f"{server.pid}\n")
    waited = prefect(["server", "status", "--wait", "-t", str(int(timeout_s))], env)
    if waited.returncode or server.poll() is not None:
        stop(state_dir)
        tail = (state_dir / SERVER_LOG).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"prefect server on {host}:{port} did not start:\n{waited.stdout}{tail}")
    deployed = subprocess.run(
        [sys.executable, "-m", "flows.deploy", *deploy_args],
        cwd=project,
        env={**os.environ, **env, **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if deployed.returncode:
        stop(state_dir)
        raise RuntimeError(f"flows.deploy failed:\n{deployed.stdout}{deployed.stderr[-3000:]}")
    try:
        start_worker(
            state_dir,
            env,
            SWEEPS,
            SWEEP_LIMIT,
            gpu="",
            extra_env=extra_env,
            project=project,
            timeout_s=timeout_s,
        )
        if local_worker:
            start_worker(
                state_dir,
                env,
                EXPERIMENTS,
                limit,
                gpu=gpu,
                extra_env=extra_env,
                project=project,
                timeout_s=timeout_s,
            )
    except RuntimeError:
        stop(state_dir)
        raise
    env_file = state_dir / "prefect.env"
    env_file.touch(mode=0o600)
    env_file.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
    return env


def worker_name(queue: str, gpu: str | None) -> str:
    """``HOST-gpuN`` for an experiments worker with a GPU, ``HOST-QUEUE`` otherwise."""
    node = socket.gethostname().split(".")[0]
    if queue == EXPERIMENTS and gpu:
        return f"{node}-gpu{gpu.replace(',', '_')}"
    return f"{node}-{queue}"


def start_worker(
    state_dir: Path,
    env: dict[str, str],
    queue: str,
    limit: int,
    gpu: str | None = None,
    name: str | None = None,
    extra_env: dict[str, str] | None = None,
    project: Path = PROJECT_ROOT,
    timeout_s: float = 120,
) -> str:
    """A ``process`` worker of the pool for ``queue`` in the background; return its name.

    ``CUDA_VISIBLE_DEVICES`` is set to ``gpu`` (``""``: none) unless ``gpu`` is None, and
    ``GANPIPE_WORKER`` to the worker's name: the flow runs it starts inherit both and record
    them. It runs in ``project`` (the deployments' directory must be this checkout) in a
    session of its own; pid and log in ``state_dir/workers/NAME.{pid,log}``.

    Raises:
        RuntimeError: the worker did not register with the server within ``timeout_s``.
    """
    name = name or worker_name(queue, gpu)
    folder = state_dir / WORKERS
    folder.mkdir(parents=True, exist_ok=True)
    if pid_of(folder / f"{name}.pid"):
        raise RuntimeError(f"worker {name} already runs from {state_dir}; make stop first")
    worker_env = {
        **env,
        "GANPIPE_WORKER": name,
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
        "PREFECT_WORKER_QUERY_SECONDS": str(QUERY_S),
        "PREFECT_WORKER_PREFETCH_SECONDS": str(QUERY_S),
        **(extra_env or {}),
    }
    if gpu is not None:
        worker_env["CUDA_VISIBLE_DEVICES"] = gpu
    command = ["worker", "start", "--pool", POOL, "--work-queue", queue, "--type", "process"]
    command += ["--limit", str(limit), "--name", name]
    since = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=2)
    with open(folder / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", *command],
            cwd=project,
            env={**os.environ, **worker_env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (folder / f"{name}.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            found = api(env, f"/work_pools/{POOL}/workers/filter", {})
            if any(
                w["name"] == name
                and datetime.datetime.fromisoformat(w["last_heartbeat_time"]) >= since
                for w in found
            ):
                return name
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_pid(proc.pid, group=True)
            (folder / f"{name}.pid").unlink(missing_ok=True)
            tail = (folder / f"{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"worker {name} did not start; its log:\n{tail}")
        time.sleep(0.5)


def deployed_directory(env: dict[str, str]) -> str | None:
    """The directory the deployments run in (their ``set_working_directory`` pull step)."""
    deployment = api(env, f"/deployments/name/{EXPERIMENT}")
    for step in deployment.get("pull_steps") or []:
        for name, args in step.items():
            if name.endswith("set_working_directory"):
                return args.get("directory")
    return None


def running_workers(state_dir: Path) -> list[Path]:
    return [p for p in sorted((state_dir / WORKERS).glob("*.pid")) if pid_of(p)]


def stop_pid(pid: int | None, group: bool, timeout_s: float = 30) -> bool:
    """SIGTERM ``pid`` (its process group if ``group``), SIGKILL after ``timeout_s``.

    Background processes of non-interactive shells ignore SIGINT, hence SIGTERM.
    """
    if pid is None:
        return False
    kill = os.killpg if group else os.kill
    with contextlib.suppress(ProcessLookupError):
        kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not gone(pid):
            kill(pid, 0)
            time.sleep(0.2)
        if not gone(pid):
            kill(pid, signal.SIGKILL)
    return True


def stop(state_dir: Path) -> list[str]:
    """Stop the workers, then the server; return the names of what was running."""
    stopped = []
    for path in sorted((state_dir / WORKERS).glob("*.pid")):
        if stop_pid(pid_of(path), group=True):
            stopped.append(f"worker {path.stem}")
        path.unlink(missing_ok=True)
    server = pid_of(state_dir / "prefect" / "server.pid")
    if server:
        stop_pid(server, group=True)
        stopped.append("prefect-server")
    for name in ("prefect.env", "prefect/server.pid"):
        if name != "prefect.env" or server:  # a worker-only machine keeps the server's env
            (state_dir / name).unlink(missing_ok=True)
    return stopped


def read_env_file(path: Path) -> dict[str, str]:
    """``export K=V`` lines of ``prefect.env`` as a dict."""
    env = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.removeprefix("export ").partition("=")
        if sep:
            env[key] = shlex.split(value)[0] if value else ""
    return env


def worker_main(args: argparse.Namespace, extra: list[str]) -> None:
    """``make worker GPU=N``: one more experiments worker, against the configured server."""
    if extra:
        raise RuntimeError(f"unknown options {' '.join(extra)}")
    env_file = STATE_DIR / "prefect.env"
    env = read_env_file(env_file) if env_file.exists() else {}
    for key in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING"):
        env[key] = os.environ.get(key) or env.get(key, "")
    if not env["PREFECT_API_URL"]:
        raise RuntimeError(
            f"no server: run make serve here, or copy {env_file} from the server's host "
            "(or set PREFECT_API_URL and PREFECT_API_AUTH_STRING)"
        )
    env.setdefault("PREFECT_HOME", str(STATE_DIR / "prefect"))
    env.update({"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1"})
    try:
        directory = deployed_directory(env)
    except OSError as exc:
        raise RuntimeError(f"server {env['PREFECT_API_URL']} did not answer: {exc}") from None
    if directory != str(PROJECT_ROOT):
        raise RuntimeError(
            f"the deployments run in {directory} but this checkout is {PROJECT_ROOT}; clone "
            f"the project at {directory} on this machine and start the worker there"
        )
    gpu = None if args.gpu in (None, "") else str(args.gpu)
    name = start_worker(STATE_DIR, env, EXPERIMENTS, args.limit, gpu=gpu, name=args.name)
    print(
        f"worker {name} (CUDA_VISIBLE_DEVICES={gpu if gpu is not None else 'inherited'}) "
        f"takes experiment runs from {env['PREFECT_API_URL']}; log: "
        f"{STATE_DIR / WORKERS / name}.log; stop: make stop"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Start or stop the Prefect service.")
    sub = parser.add_subparsers(dest="action", required=True)
    begin = sub.add_parser(
        "start", help="server + deployments + workers; other options go to flows.deploy"
    )
    begin.add_argument("--port", type=int, default=4200)
    begin.add_argument(
        "--host",
        default=HOST,
        help="address to listen on (default loopback; another one exposes the API and its "
        "basic auth on the network: docs/team.md)",
    )
    begin.add_argument(
        "--database-url",
        default=os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL") or None,
        help="the server's database (default SQLite in .state/prefect)",
    )
    begin.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES of the local worker")
    begin.add_argument("--limit", type=int, default=1, help="runs the local worker takes at once")
    begin.add_argument(
        "--no-worker", action="store_true", help="no local experiments worker (team server)"
    )
    work = sub.add_parser("worker", help="one more experiments worker (make worker GPU=N)")
    work.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES of its runs")
    work.add_argument("--limit", type=int, default=1, help="runs it takes at once")
    work.add_argument("--name", default=None, help="default HOST-gpuN")
    sub.add_parser("stop", help="stop what start and worker started")
    args, extra = parser.parse_known_args()
    try:
        if args.action == "stop":
            stopped = stop(STATE_DIR)
            print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
        elif args.action == "worker":
            worker_main(args, extra)
        else:
            start(
                STATE_DIR,
                args.port,
                extra,
                host=args.host,
                database_url=args.database_url,
                gpu=args.gpu,
                limit=args.limit,
                local_worker=not args.no_worker,
            )
            print(
                f"Prefect server: http://{args.host}:{args.port} (UI; user and password in "
                f"{STATE_DIR}/prefect-auth), on "
                f"{'the database of --database-url' if args.database_url else 'SQLite'}\\n"
                f"Deployments: {', '.join(DEPLOYMENTS)} on work pool {POOL}\\n"
                f"Workers: {', '.join(p.stem for p in running_workers(STATE_DIR))}; logs: "
                f"{STATE_DIR / WORKERS}/\\n"
                f"Use it from a shell: . {STATE_DIR}/prefect.env && prefect flow-run ls\\n"
                "More workers: make worker GPU=N; stop all: make stop"
            )
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
