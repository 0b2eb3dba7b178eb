"""Start and stop a local, locked-down Prefect server and the served deployments.

``python -m flows.service start`` (``make serve``):

1. generates the server's credentials once per checkout: ``.state/prefect-auth``
   (``ganpipe:<random>``, mode 0600);
2. ``prefect server start --background`` on 127.0.0.1 only, with basic auth
   (``PREFECT_SERVER_API_AUTH_STRING``), CORS limited to the server's own UI origin, SQLite
   under ``.state/prefect``, telemetry off; ``prefect server status --wait`` until healthy;
3. ``python -m flows.serve ...`` in its own process group (log ``.state/flows-serve.log``),
   which registers the deployments and runs their flow runs;
4. writes ``.state/prefect.env`` (mode 0600; ``. .state/prefect.env`` points a shell's
   ``prefect`` commands at this server, credentials included).

``python -m flows.service stop`` (``make stop``) stops the served flows first (otherwise they
retry the vanished server), then ``prefect server stop``. Prefect offers no allow-list for
the ``Host`` header, so a request with a foreign Host is not refused by name; it still needs
the credentials, and the server only listens on loopback.
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
SERVE = "flows-serve"


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


def client_env(state_dir: Path, port: int) -> dict[str, str]:
    """Environment of the served flows and of any ``prefect`` command using the server."""
    return {
        "PREFECT_HOME": str(state_dir / "prefect"),
        "PREFECT_API_URL": f"http://{HOST}:{port}/api",
        "PREFECT_API_AUTH_STRING": credentials(state_dir),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DVC_NO_ANALYTICS": "1",
    }


def server_env(state_dir: Path, port: int) -> dict[str, str]:
    return {
        **client_env(state_dir, port),
        "PREFECT_SERVER_API_HOST": HOST,
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_API_AUTH_STRING": credentials(state_dir),
        "PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": f"http://{HOST}:{port}",
    }


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
    try:
        pid = int(path.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    return pid


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
    serve_args: list[str],
    extra_env: dict[str, str] | None = None,
    project: Path = PROJECT_ROOT,
    timeout_s: float = 120,
) -> dict[str, str]:
    """Server, then served flows; write ``prefect.env``; return the clients' environment.

    Args:
        project: The checkout whose flows are served (and whose repository they use).

    Raises:
        RuntimeError: something already runs, or a step failed (its output attached).
    """
    env = client_env(state_dir, port)
    if pid_of(state_dir / f"{SERVE}.pid") or pid_of(state_dir / "prefect" / "server.pid"):
        raise RuntimeError(
            f"a server or served flows already run from {state_dir}; make stop first"
        )
    (state_dir / "prefect" / "server.pid").unlink(missing_ok=True)
    started = prefect(["server", "start", "--background"], server_env(state_dir, port))
    waited = started.returncode or prefect(
        ["server", "status", "--wait", "-t", str(int(timeout_s))], env
    )
    if started.returncode or waited.returncode:
        stop(state_dir)
        failed = started if started.returncode else waited
        raise RuntimeError(
            f"prefect server on {HOST}:{port} did not start:\n{failed.stdout}{failed.stderr}"
        )

    since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=2)
    with open(state_dir / f"{SERVE}.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.serve", *serve_args],
            cwd=project,
            env={**os.environ, **env, **(extra_env or {})},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    (state_dir / f"{SERVE}.pid").write_text(f"{proc.pid}\n")
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError, ValueError):
            found = api(env, "/deployments/filter", {"deployments": {"name": {"any_": ["local"]}}})
            if sum(datetime.datetime.fromisoformat(d["updated"]) >= since for d in found) >= 2:
                break
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(state_dir)
            tail = (state_dir / f"{SERVE}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"flows.serve registered no deployments; its log:\n{tail}")
        time.sleep(0.5)
    env_file = state_dir / "prefect.env"
    env_file.touch(mode=0o600)
    env_file.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()))
    return env


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
    """Stop the served flows, then the server; return the names of what was running."""
    stopped = []
    if stop_pid(pid_of(state_dir / f"{SERVE}.pid"), group=True):
        stopped.append(SERVE)
    server = pid_of(state_dir / "prefect" / "server.pid")
    if server:
        prefect(["server", "stop"], {"PREFECT_HOME": str(state_dir / "prefect")})
        stop_pid(server, group=False)
        stopped.append("prefect-server")
    for name in (f"{SERVE}.pid", "prefect.env", "prefect/server.pid"):
        (state_dir / name).unlink(missing_ok=True)
    return stopped


def main() -> None:
    parser = argparse.ArgumentParser(description="Start or stop the local Prefect service.")
    sub = parser.add_subparsers(dest="action", required=True)
    begin = sub.add_parser(
        "start", help="server + served deployments; other options go to flows.serve"
    )
    begin.add_argument("--port", type=int, default=4200)
    sub.add_parser("stop", help="stop what start started")
    args, serve_args = parser.parse_known_args()
    if args.action == "stop":
        stopped = stop(STATE_DIR)
        print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
        return
    try:
        start(STATE_DIR, args.port, serve_args)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    print(
        f"Prefect server: http://{HOST}:{args.port} (UI; user and password in "
        f"{STATE_DIR}/prefect-auth)\n"
        f"Served deployments: ganpipe-pipeline/local, ganpipe-sweep/local; "
        f"log: {STATE_DIR}/{SERVE}.log\n"
        f"Use it from a shell: . {STATE_DIR}/prefect.env && prefect flow-run ls\n"
        "Stop both: make stop"
    )


if __name__ == "__main__":
    main()
