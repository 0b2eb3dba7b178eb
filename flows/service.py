"""``make serve`` / ``make worker`` / ``make stop``: Prefect's own CLI, plus what it lacks.

``start``: server, work pool, the ``ganpipe_repo`` variable, ``prefect deploy --all``, the
automations of automations.yaml, two workers; ``worker``: one more, on any machine with the
server's ``.state/prefect.env``; ``stop``. What Prefect's CLI lacks: starting in the
background without dying on a closed pipe, stopping what was started, and a credential that
stays home (0600 files, 0700 folders, never sent to another URL). flows/README.md has more.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
STATE_DIR = PROJECT_ROOT / ".state"
HOST = "127.0.0.1"
AUTH = "PREFECT_API_AUTH_STRING"
POOL, EXPERIMENTS, SWEEPS = "ganpipe", "experiments", "sweeps"
DEPLOYMENTS = {
    "pipeline": "ganpipe-pipeline/scheduled",
    "experiment": "ganpipe-pipeline/experiment",
    "sweep": "ganpipe-sweep/scheduled",
}
#: Seconds between a flow run's heartbeats (Prefect's minimum is 30); set on the workers.
HEARTBEAT_S = 30
#: Seconds between a worker's polls for work (Prefect's 10 s is long beside short runs).
QUERY_S = 2
#: Sweeps one machine's sweep worker runs at once (each only waits for its experiments).
SWEEP_LIMIT = 4


def private_fd(path: Path, flags: int = os.O_WRONLY) -> int:
    """``path`` opened as mode 0600 whatever existed before (opened with the mode, then
    ``fchmod``); a symbolic link there is refused (OSError), never followed."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def private_file(path: Path, text: str | None = None) -> Path:
    """``path`` (written with ``text``) as mode 0600 (:func:`private_fd`)."""
    truncate = os.O_TRUNC if text is not None else 0
    with os.fdopen(private_fd(path, os.O_WRONLY | truncate), "w") as handle:
        handle.write(text or "")
    return path


def private_dir(path: Path) -> Path:
    """The folder ``path`` as mode 0700; a symbolic link there is refused."""
    path.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        raise OSError(f"{path} is a symbolic link; the credential's folders must not be")
    os.chmod(path, 0o700)
    return path


def read_env_file(path: Path) -> dict[str, str]:
    """``export K=V`` lines of ``prefect.env`` as a dict."""
    env = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.removeprefix("export ").partition("=")
        if sep:
            env[key] = shlex.split(value)[0] if value else ""
    return env


def client_env(state_dir: Path, port: int, host: str = HOST) -> dict[str, str]:
    """URL and credential of the local server: the credential made once, kept in
    ``prefect.env``; the URL rewritten there for this port."""
    private_dir(state_dir)
    env_file = state_dir / "prefect.env"
    old = read_env_file(env_file) if env_file.exists() else {}
    auth = old.get("PREFECT_API_AUTH_STRING") or f"ganpipe:{secrets.token_urlsafe(24)}"
    env = {"PREFECT_API_URL": f"http://{host}:{port}/api", "PREFECT_API_AUTH_STRING": auth}
    private_file(env_file, "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
    return env


def tool_env(env: dict[str, str], state_dir: Path) -> dict[str, str]:
    """The environment of every ``prefect`` command and process started here: the server is
    reached directly, never through a proxy of the environment (which would see the
    credential)."""
    host = urllib.parse.urlsplit(env["PREFECT_API_URL"]).hostname or HOST
    bypass = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), host]))
    return {
        **os.environ,
        "NO_PROXY": bypass,
        "no_proxy": bypass,
        **env,
        "PREFECT_HOME": str(private_dir(state_dir / "prefect")),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
    }


def prefect(args: list[str], env: dict[str, str], cwd: Path = PROJECT_ROOT, timeout_s=180):
    """``prefect ARGS``; raises RuntimeError with its output when it fails."""
    done = subprocess.run(
        [sys.executable, "-m", "prefect", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode:
        raise RuntimeError(f"prefect {' '.join(args)} failed:\n{done.stdout}{done.stderr[-3000:]}")
    return done.stdout


def background(args: list[str], env: dict[str, str], log: Path, pid: Path) -> subprocess.Popen:
    """``prefect ARGS`` in a session of its own, writing to ``log`` (0600), pid in ``pid``.

    Not ``prefect server start --background``: that hands the server pipes nobody reads once
    it has returned, so the first warning it prints kills it (EPIPE).
    """
    with os.fdopen(private_fd(log, os.O_WRONLY | os.O_APPEND), "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", *args],
            env=env,
            cwd=log.parent,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    private_file(pid, f"{proc.pid}\n")
    return proc


def automations(project: Path, crash_after_s: float, start_within_s: float) -> None:
    """The automations of ``project/automations.yaml``, replacing those of the same names: a
    flow run that sent a heartbeat and then nothing for ``crash_after_s`` (its machine died),
    or that a worker took but whose process did not start running within ``start_within_s``
    (a command that fails), is marked Crashed (Prefect's zombie recipe)."""
    import yaml
    from prefect.automations import Automation
    from prefect.exceptions import ObjectNotFound

    spec = yaml.safe_load((project / "automations.yaml").read_text())["automations"]
    bounds = {
        "prefect.flow-run.heartbeat": crash_after_s,
        "prefect.flow-run.Pending": start_within_s,
    }
    for automation in spec:
        within = automation["trigger"]["within"] = bounds[automation["trigger"]["after"][0]]
        for action in automation["actions"]:
            action["message"] = action["message"].format(within=within)
        with contextlib.suppress(ValueError, ObjectNotFound):
            Automation.read(name=automation["name"]).delete()
        Automation.model_validate(automation).create()


def start(
    state_dir: Path,
    port: int,
    project: Path = PROJECT_ROOT,
    repo: str | None = None,
    host: str = HOST,
    database_url: str | None = None,
    gpu: str | None = None,
    limit: int = 1,
    local_worker: bool = True,
    crash_after_s: float = 3 * HEARTBEAT_S,
    start_within_s: float = 300,
    extra_env: dict[str, str] | None = None,
) -> dict[str, str]:
    """Server, deployments, automations, workers; return URL and credential.

    Args:
        project: The checkout whose prefect.yaml is deployed.
        repo: What runs clone (default: ``project``); a team's git remote URL.
        database_url: The server's database (default SQLite in ``state_dir/prefect``).
        gpu: ``CUDA_VISIBLE_DEVICES`` of the local experiments worker (default: inherited).
        local_worker: False: the sweeps worker only (a team server whose GPUs are elsewhere).

    Raises:
        RuntimeError: something already runs, or a step failed (its output attached).
    """
    if running(state_dir):
        raise RuntimeError(f"a server or workers already run from {state_dir}; make stop first")
    env = client_env(state_dir, port, host)
    tools = tool_env({**env, **(extra_env or {})}, state_dir)
    server = {
        "PREFECT_SERVER_API_HOST": host,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_API_AUTH_STRING": env["PREFECT_API_AUTH_STRING"],
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": f"http://{host}:{port}",
        # A cancelled sweep's experiment runs (its subflows) are cancelled by this service.
        "PREFECT_SERVER_SERVICES_CANCELLATION_CLEANUP_LOOP_SECONDS": "5",
    }
    if database_url:
        server["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url
    proc = background(
        ["server", "start"], {**tools, **server}, state_dir / "server.log", state_dir / "server.pid"
    )
    try:
        prefect(["server", "status", "--wait", "-t", "120"], tools)
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server on {host}:{port} exited")
        prefect(["work-pool", "create", POOL, "--type", "process", "--overwrite"], tools)
        prefect(["variable", "set", "ganpipe_repo", repo or str(project), "--overwrite"], tools)
        prefect(["--no-prompt", "deploy", "--all"], tools, cwd=project)  # prefect.yaml's schedules
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        os.environ.update(NO_PROXY=tools["NO_PROXY"], no_proxy=tools["no_proxy"])  # direct
        settings = {PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: env[AUTH]}
        with temporary_settings(settings):
            automations(project, crash_after_s, start_within_s)
        start_worker(state_dir, env, SWEEPS, SWEEP_LIMIT, gpu="", extra_env=extra_env)
        if local_worker:
            start_worker(state_dir, env, EXPERIMENTS, limit, gpu=gpu, extra_env=extra_env)
    except Exception as exc:  # whatever failed: nothing of it is left running
        stop(state_dir)
        tail = (state_dir / "server.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"{exc}\nserver log:\n{tail}") from None
    return env


def start_worker(
    state_dir: Path,
    env: dict[str, str],
    queue: str,
    limit: int,
    gpu: str | None = None,
    name: str | None = None,
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 120,
) -> str:
    """``prefect worker start`` for ``queue`` in the background; return its name.

    ``CUDA_VISIBLE_DEVICES`` is set to ``gpu`` (``""``: none) unless it is None, and
    ``GANPIPE_WORKER`` to the worker's name: the runs it starts inherit both and record them.

    Raises:
        RuntimeError: the worker did not reach the server within ``timeout_s``.
    """
    node = socket.gethostname().split(".")[0]
    name = name or (f"{node}-gpu{gpu}" if queue == EXPERIMENTS and gpu else f"{node}-{queue}")
    folder = private_dir(state_dir / "workers")
    if pid_of(folder / f"{name}.pid"):
        raise RuntimeError(f"worker {name} already runs from {state_dir}; make stop first")
    worker_env = {
        **env,
        "GANPIPE_WORKER": name,
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_S),
        "PREFECT_WORKER_QUERY_SECONDS": str(QUERY_S),
        "PREFECT_WORKER_PREFETCH_SECONDS": str(QUERY_S),
        "PREFECT_WORKER_ENABLE_CANCELLATION": "true",  # cancelled while still waiting
        **(extra_env or {}),
    }
    if gpu is not None:
        worker_env["CUDA_VISIBLE_DEVICES"] = gpu
    command = ["worker", "start", "--pool", POOL, "--work-queue", queue, "--type", "process"]
    log = folder / f"{name}.log"
    seen = log.stat().st_size if log.exists() else 0  # the log of an earlier start
    command += ["--limit", str(limit), "--name", name]
    proc = background(command, tool_env(worker_env, state_dir), log, folder / f"{name}.pid")
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        new = log.read_bytes()[seen:]
        if b"Unable to reach the Prefect API" in new:  # it still prints "started!"
            break
        if f"Worker {name!r} started!".encode() in new:
            return name
        time.sleep(0.5)
    stop_pids([proc.pid])
    (folder / f"{name}.pid").unlink(missing_ok=True)
    tail = log.read_text(errors="replace")[-3000:]
    raise RuntimeError(f"worker {name} did not start; its log:\n{tail}")


def pid_of(path: Path) -> int | None:
    """The pid in the file ``path`` if that process still runs (a zombie does not)."""
    try:
        pid = int(path.read_text().split()[0])
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


def running(state_dir: Path) -> list[Path]:
    pids = [state_dir / "server.pid", *sorted((state_dir / "workers").glob("*.pid"))]
    return [path for path in pids if pid_of(path)]


def stop_pids(pids: list[int], timeout_s: float = 30) -> None:
    """SIGTERM the process groups of ``pids`` at once, SIGKILL those left after ``timeout_s``
    (a loaded machine's Prefect worker can take that long to shut down)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(gone(pid) for pid in pids):
        time.sleep(0.2)
    for pid in pids:
        if not gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def stop(state_dir: Path) -> list[str]:
    """Stop the workers (all at once), then the server; return the names of what ran."""
    stopped = []
    for group in (sorted((state_dir / "workers").glob("*.pid")), [state_dir / "server.pid"]):
        running = {path: pid for path in group if (pid := pid_of(path))}
        stop_pids(list(running.values()))
        stopped += [path.stem for path in running]
        for path in group:
            path.unlink(missing_ok=True)
    return stopped


def worker_main(gpu: str | None, limit: int, name: str | None) -> str:
    """``make worker GPU=N``: one more experiments worker, for the server of prefect.env."""
    env_file = STATE_DIR / "prefect.env"
    if not env_file.exists():
        raise RuntimeError(f"no server: run make serve here, or copy {env_file} from its host")
    env = read_env_file(env_file)
    named = os.environ.get("PREFECT_API_URL")
    if named and named != env.get("PREFECT_API_URL"):
        raise RuntimeError(
            f"PREFECT_API_URL={named} is not the server of {env_file} "
            f"({env.get('PREFECT_API_URL')}); its credential goes to that server only: "
            "unset PREFECT_API_URL, or copy that server's prefect.env"
        )
    private_file(env_file)
    gpu = gpu or None
    name = start_worker(STATE_DIR, env, EXPERIMENTS, limit, gpu=gpu, name=name)
    return (
        f"worker {name} (CUDA_VISIBLE_DEVICES={gpu if gpu is not None else 'inherited'}) takes "
        f"runs from {env['PREFECT_API_URL']}; log {STATE_DIR}/workers/{name}.log; make stop"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Start or stop the Prefect service.")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("stop", help="stop what start and worker started")
    begin = sub.add_parser("start", help="server + deployments + workers")
    work = sub.add_parser("worker", help="one more experiments worker (make worker GPU=N)")
    for command in (begin, work):
        command.add_argument("--gpu", default=None, help="CUDA_VISIBLE_DEVICES of its runs")
        command.add_argument("--limit", type=int, default=1, help="runs its worker takes at once")
    begin.add_argument("--port", type=int, default=4200)
    begin.add_argument("--host", default=HOST, help="address to listen on (docs/team.md)")
    begin.add_argument("--database-url", default=None, help="default SQLite in .state/prefect")
    begin.add_argument("--repo", default=None, help="what runs clone (default this project)")

    def bound(text: str) -> float:
        if float(text) < 10:  # Prefect's automations wait at least 10 s
            raise argparse.ArgumentTypeError(f"{text} s is under the 10 s Prefect allows")
        return float(text)

    begin.add_argument("--crash-after", dest="crash_after_s", type=bound, default=3 * HEARTBEAT_S)
    begin.add_argument("--start-within", dest="start_within_s", type=bound, default=300)
    begin.add_argument("--no-worker", dest="local_worker", action="store_false")
    work.add_argument("--name", default=None, help="default HOST-gpuN")
    args = vars(parser.parse_args())
    try:
        if (action := args.pop("action")) == "stop":
            stopped = stop(STATE_DIR)
            print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
        elif action == "worker":
            print(worker_main(**args))
        else:
            env = start(STATE_DIR, **args)
            print(
                f"Prefect server: {env['PREFECT_API_URL'][:-4]} (user and password in "
                f"{STATE_DIR}/prefect.env)\nDeployments: {', '.join(DEPLOYMENTS.values())}\n"
                f"Workers: {', '.join(p.stem for p in running(STATE_DIR)[1:])}; logs in "
                f"{STATE_DIR}/workers/\nFrom a shell: . {STATE_DIR}/prefect.env && "
                "prefect flow-run ls\nMore workers: make worker GPU=N; stop all: make stop"
            )
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
