"""Start and stop a local Prefect server and the served deployments (``make serve/stop``).

``python -m flows.service start`` starts, each in its own process group, in the
background:

1. ``prefect server start --host 127.0.0.1 --port PORT``: the API and UI, bound to
   loopback only, SQLite database under ``PREFECT_HOME`` (``.state/prefect``), telemetry
   off; its log is ``.state/prefect-server.log``;
2. ``python -m flows.serve ...``: registers the deployments and runs their flow runs; its
   log is ``.state/flows-serve.log``.

It returns once the server answers and the deployments are registered, and writes
``.state/prefect.env`` (``. .state/prefect.env`` points a shell's ``prefect`` commands at
this server). ``python -m flows.service stop`` stops exactly what ``start`` recorded in
``.state/*.pid``: the served flows first (otherwise they retry the vanished server), then
the server.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

#: The project this file belongs to. Only the standard library is imported here, so
#: ``make stop`` works even while the virtual environment is being rebuilt.
PROJECT_ROOT = Path(__file__).resolve().parents[1]
STATE_DIR = PROJECT_ROOT / ".state"
SERVER, SERVE = "prefect-server", "flows-serve"
#: What the command line of each recorded pid must contain (a pid may have been reused).
MARKERS = {SERVER: b"prefect", SERVE: b"flows.serve"}


def prefect_env(state_dir: Path, port: int) -> dict[str, str]:
    """Environment of the server, the served flows and any ``prefect`` command using them."""
    return {
        "PREFECT_HOME": str(state_dir / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
    }


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def free_port() -> int:
    """A loopback port nobody listens on (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def api(url: str, path: str, body: dict | None = None, timeout_s: float = 5.0):
    """GET (or POST ``body`` to) the Prefect REST API; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url.rstrip("/") + path, data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read() or b"null")


def spawn(
    name: str, command: list[str], state_dir: Path, env: dict[str, str], cwd: Path = PROJECT_ROOT
) -> int:
    """Start ``command`` in a new session (own process group); record its pid; return it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / f"{name}.log", "ab") as log:
        proc = subprocess.Popen(
            command,
            cwd=cwd,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (state_dir / f"{name}.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def log_tail(state_dir: Path, name: str, lines: int = 30) -> str:
    path = state_dir / f"{name}.log"
    text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
    return "\n".join(text)


def wait_until(check, what: str, pid: int, timeout_s: float, state_dir: Path, name: str) -> None:
    """Poll ``check()`` until true; fail early if process ``pid`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid) or _exited(pid):
            raise RuntimeError(
                f"{name} exited before {what}; its log:\n{log_tail(state_dir, name)}"
            )
        try:
            if check():
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError(
        f"no {what} after {timeout_s:.0f} s; {name} log:\n{log_tail(state_dir, name)}"
    )


def _exited(pid: int) -> bool:
    """Reap ``pid`` if it is our exited child (a zombie still answers kill(pid, 0))."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == pid


def start_server(state_dir: Path, port: int, timeout_s: float = 120) -> str:
    """Start ``prefect server start`` on 127.0.0.1:``port``; return the API URL once healthy.

    Raises:
        RuntimeError: the port is taken, or the server died while starting (log attached).
        TimeoutError: no healthy answer within ``timeout_s``.
    """
    if not port_is_free(port):
        raise RuntimeError(
            f"port {port} on 127.0.0.1 is in use; stop what uses it or choose another "
            "(make serve PREFECT_PORT=4201)"
        )
    env = prefect_env(state_dir, port)
    command = [sys.executable, "-m", "prefect", "server", "start"]
    pid = spawn(SERVER, [*command, "--host", "127.0.0.1", "--port", str(port)], state_dir, env)
    url = env["PREFECT_API_URL"]
    try:
        wait_until(
            lambda: api(url, "/health") is True, "healthy API", pid, timeout_s, state_dir, SERVER
        )
    except BaseException:
        stop_group(state_dir, SERVER)
        raise
    return url


def start_serving(
    state_dir: Path,
    port: int,
    serve_args: list[str],
    project: Path = PROJECT_ROOT,
    extra_env: dict[str, str] | None = None,
    timeout_s: float = 120,
) -> None:
    """Start ``python -m flows.serve SERVE_ARGS`` in ``project``; return once it registered.

    Args:
        project: The checkout whose flows are served (and whose workspace they run).
        extra_env: More environment, e.g. ``PREFECT_RUNNER_POLL_FREQUENCY``.
    """
    env = {**prefect_env(state_dir, port), **(extra_env or {})}
    url = env["PREFECT_API_URL"]
    since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=2)
    command = [sys.executable, "-m", "flows.serve", *serve_args]
    pid = spawn(SERVE, command, state_dir, env, cwd=project)

    def registered() -> bool:
        found = api(url, "/deployments/filter", {"deployments": {"name": {"any_": ["local"]}}})
        fresh = [d for d in found if datetime.datetime.fromisoformat(d["updated"]) >= since]
        return len(fresh) >= 2

    try:
        wait_until(registered, "registered deployments", pid, timeout_s, state_dir, SERVE)
    except BaseException:
        stop_group(state_dir, SERVE)
        raise


def stop_group(state_dir: Path, name: str, timeout_s: float = 30) -> bool:
    """SIGTERM the process group recorded in ``NAME.pid``, SIGKILL after ``timeout_s``.

    Returns whether something was running. Background processes of non-interactive
    shells ignore SIGINT, hence SIGTERM.
    """
    pid_file = state_dir / f"{name}.pid"
    if not pid_file.exists():
        return False
    pid = int(pid_file.read_text().split()[0])
    running = alive(pid) and not _exited(pid) and _is_ours(pid, name)
    if running:
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            running = False
        deadline = time.monotonic() + timeout_s
        while running and time.monotonic() < deadline and _group_alive(pid):
            _exited(pid)
            time.sleep(0.2)
        if _group_alive(pid):
            os.killpg(pid, signal.SIGKILL)
            _exited(pid)
    pid_file.unlink(missing_ok=True)
    return running


def _is_ours(pid: int, name: str) -> bool:
    """Whether ``pid`` still runs the command ``start`` recorded (not a reused pid)."""
    try:
        return MARKERS[name] in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid file


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def start(
    state_dir: Path,
    port: int,
    serve_args: list[str],
    project: Path = PROJECT_ROOT,
    extra_env: dict[str, str] | None = None,
) -> str:
    """Server, then served flows; write ``prefect.env``; return the API URL."""
    for name in (SERVER, SERVE):
        pid_file = state_dir / f"{name}.pid"
        if pid_file.exists() and alive(int(pid_file.read_text().split()[0])):
            raise RuntimeError(f"{name} is already running ({pid_file}); run `make stop` first")
    url = start_server(state_dir, port)
    try:
        start_serving(state_dir, port, serve_args, project, extra_env)
    except BaseException:
        stop_group(state_dir, SERVER)
        raise
    env = prefect_env(state_dir, port)
    (state_dir / "prefect.env").write_text(
        "".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items())
    )
    return url


def stop(state_dir: Path) -> list[str]:
    """Stop the served flows, then the server; return the names of what was running."""
    stopped = [name for name in (SERVE, SERVER) if stop_group(state_dir, name)]
    (state_dir / "prefect.env").unlink(missing_ok=True)
    return stopped


def main() -> None:
    parser = argparse.ArgumentParser(description="Start or stop the local Prefect service.")
    sub = parser.add_subparsers(dest="action", required=True)
    begin = sub.add_parser(
        "start",
        help="server + served deployments in the background; other options go to "
        "flows.serve (--pipeline, --sweep, --timezone, --limit)",
    )
    begin.add_argument("--port", type=int, default=4200)
    begin.add_argument("--state-dir", type=Path, default=STATE_DIR)
    end = sub.add_parser("stop", help="stop what start started")
    end.add_argument("--state-dir", type=Path, default=STATE_DIR)
    # Options that `start` does not know (--pipeline 60 ...) are passed to flows.serve.
    args, serve_args = parser.parse_known_args()
    if args.action == "stop" and serve_args:
        parser.error(f"stop takes no options {serve_args}")
    state_dir = args.state_dir.resolve()
    if args.action == "stop":
        stopped = stop(state_dir)
        print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
        return
    try:
        url = start(state_dir, args.port, serve_args)
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    ui = url.removesuffix("/api")
    print(
        f"Prefect server: {ui} (UI), API {url}; logs: {state_dir}/{SERVER}.log\n"
        f"Served deployments: ganpipe-pipeline/local, ganpipe-sweep/local; "
        f"log: {state_dir}/{SERVE}.log\n"
        f"Use it from a shell: . {state_dir}/prefect.env && prefect flow-run ls\n"
        "Stop both: make stop"
    )


if __name__ == "__main__":
    main()
