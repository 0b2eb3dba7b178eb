"""Where a flow run happens: a fresh clone of the project, and DVC's own experiments.

The deployments' ``git_clone`` pull step (prefect.yaml) makes the clone in the worker's
per-run folder; here it is moved to the run's commit, its DVC cache wired (the origin's on
the same machine, else its DVC remote), the overrides written into params.yaml, and the
experiment made and returned by DVC itself (``dvc exp run -n NAME``, ``dvc exp push origin
NAME``). Nothing here writes git refs or reads dvc.yaml. Every child process runs in a
session of its own, so that a cancelled run kills what it started (:func:`kill_children`);
the run removes its clone however it ends (:func:`owned`): the worker's own clean-up comes
after its bookkeeping and fails while a process still writes into the folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ganpipe.overrides import ParamsError, check_inside, write_params

#: Lines of a failed command's output kept for its error message.
TAIL_LINES = 40
#: Output of a failed command that an identical retry may not see: a held lock, a
#: file-system stall, a stage killed by a signal (DVC: "exited with -9").
TRANSIENT = re.compile(
    r"Unable to acquire lock|Resource temporarily unavailable|Stale file handle"
    r"|Interrupted system call|exited with -\d+|Unable to create '[^']*\.lock': File exists"
)
#: Experiment and sweep names: a safe part of a git ref name and of a file name (the flows'
#: signatures carry it, so Prefect refuses another name before a run is made).
NAME = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}$"
#: A commit to start from: a sha, a branch or a tag (``HEAD~1`` too); never an option.
REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./~^-]{0,199}")
#: What the worker's credential and server address are: no stage or git command gets them.
PRIVATE_ENV = ("PREFECT_API_AUTH_STRING", "PREFECT_API_KEY", "PREFECT_API_URL")
#: The mark the deployments' pull step leaves in a clone it made (prefect.yaml): only such a
#: folder is removed when the run ends.
CLONE_MARK = Path(".git") / "ganpipe-run-clone"
#: What DVC writes into a clone, each the machine's own (DVC's .gitignore keeps them out of
#: git): a commit that carries one as a symbolic link would have the run write the origin's
#: remotes and credentials, DVC's settings, its cache or its temporaries where the link points.
MACHINE_OWN = (".dvc", ".dvc/config.local", ".dvc/tmp", ".dvc/cache")
#: How DVC reports what ``dvc exp run`` did with each stage.
STAGE_LINE = re.compile(r"(Running stage|Stage) '([^']+)'( is cached| didn't change)?")

_children: set[subprocess.Popen] = set()
_lock = threading.Lock()
_stopping = threading.Event()


class DvcCommandError(RuntimeError):
    """A command failed; the message is the stage's own ``error:`` lines, then DVC's;
    ``transient`` when a retry may succeed (a lock, an I/O hiccup, a killed process)."""

    def __init__(self, command: list[str], returncode: int | None, tail: str):
        self.command, self.returncode, self.tail = command, returncode, tail
        killed = returncode is not None and (returncode < 0 or returncode in (137, 143))
        self.transient = killed or bool(TRANSIENT.search(tail))
        lines = [line.rstrip() for line in tail.splitlines() if line.strip()]
        wanted = [line for line in lines if re.match(r"\s*(error|ERROR)\b", line)] or lines[-10:]
        shown = " ".join(c for c in command if c not in (sys.executable, "-m"))
        ended = "did not run" if returncode is None else f"exited with {returncode}"
        if returncode is not None and returncode < 0:
            ended = f"killed by {signal.Signals(-returncode).name}"
        super().__init__("\n".join([*dict.fromkeys(wanted), f"(`{shown}` {ended})"]))


def run(args: list[str], cwd: Path, log: Callable[[str], None] | None = None) -> str:
    """Run ``args`` in ``cwd`` (``dvc``: this interpreter's), each line to ``log``; the output.

    Stage commands find this interpreter's tools first on PATH and import the clone's own
    ``ganpipe`` (``cwd/src``), not the one an editable install points at.

    Raises:
        DvcCommandError: non-zero exit (or killed, or this run is being cancelled).
    """
    command = [sys.executable, "-m", "dvc", *args[1:]] if args[0] == "dvc" else args
    python_path = [str(Path(cwd).resolve() / "src"), os.environ.get("PYTHONPATH", "")]
    env = {
        **{k: v for k, v in os.environ.items() if k not in PRIVATE_ENV},
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(p for p in python_path if p),
        "DVC_NO_ANALYTICS": "1",
    }
    if _stopping.is_set():
        raise DvcCommandError(command, None, "not started: this flow run is being cancelled")
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    with _lock:
        _children.add(proc)
    output: list[str] = []
    for raw in proc.stdout or []:
        line = raw.rstrip("\n").rsplit("\r", 1)[-1]  # tqdm's redraws: the last state
        output.append(line)
        if line.strip() and log:
            log(line)
    returncode = proc.wait()
    with _lock:  # not on the way out of a cancelled run: kill_children must still see it
        _children.discard(proc)
    if returncode != 0:
        raise DvcCommandError(command, returncode, "\n".join(output[-TAIL_LINES:]))
    return "\n".join(output)


def kill_children() -> None:
    """SIGKILL every process group this process started (a cancelled run: the worker
    signals the flow run's process only)."""
    _stopping.set()
    with _lock:
        procs = list(_children)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    for proc in procs:  # until the whole group is gone: a dying process may still write
        with contextlib.suppress(ProcessLookupError, PermissionError):
            while time.monotonic() < deadline:
                proc.poll()  # reaps the leader: a zombie still counts as a member
                os.killpg(proc.pid, 0)
                time.sleep(0.1)
    with _lock:
        _children.difference_update(procs)


@contextlib.contextmanager
def owned(root: Path) -> Iterator[Path]:
    """The run's clone ``root``, removed when the block ends however it ends (a folder the
    deployments' pull step made, :data:`CLONE_MARK`; any other folder is left alone);
    cancelled (the worker's SIGTERM) or ^C, the stages this process started are killed first."""
    try:
        yield root
    except BaseException as exc:
        if not isinstance(exc, Exception):
            kill_children()
        raise
    finally:
        if (root / CLONE_MARK).is_file() and not (root / CLONE_MARK).is_symlink():
            os.chdir(root.parent)  # a process whose folder is gone cannot ask where it is
            shutil.rmtree(root, ignore_errors=True)


def prepare(root: Path, commit: str | None, log: Callable[[str], None]) -> tuple[str, bool]:
    """Move the clone ``root`` to ``commit`` and wire its DVC cache; (sha, shared cache).

    On the machine of its origin (a folder with a DVC cache) the clone uses that cache, so
    outputs and the run cache are shared and unchanged stages are restored, not run;
    otherwise DVC pulls what is missing from the project's DVC remote.

    Raises:
        ParamsError: ``commit`` is no commit of the origin.
    """
    if commit:
        if not REVISION.fullmatch(commit):
            problem = ("commit", f"{commit!r} is no sha, branch or tag")
            raise ParamsError("commit", [problem])
        try:
            if subprocess.run(
                ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=root, capture_output=True
            ).returncode:
                run(
                    ["git", "fetch", "-q", "--depth", "1", "--end-of-options", "origin", commit],
                    root,
                )
            run(["git", "checkout", "-q", "--detach", commit], root)
        except DvcCommandError:
            problem = ("commit", f"{commit!r} is not a commit of the project")
            raise ParamsError("commit", [problem]) from None
    if run(["git", "rev-parse", "--is-shallow-repository"], root).strip() == "true":
        run(["git", "fetch", "-q", "--unshallow", "origin"], root)  # dvc exp needs history
    sha = run(["git", "rev-parse", "HEAD"], root).strip()
    for path in MACHINE_OWN:  # DVC writes into them: never where a commit's link points
        if (root / path).is_symlink():
            problem = (
                f"{sha[:7]} carries {path} as a symbolic link, and a run writes there; DVC "
                f"keeps it out of git: git rm --cached {path} && git commit"
            )
            raise ParamsError("commit", [("commit", problem)])
    origin = Path(run(["git", "remote", "get-url", "origin"], root).strip())
    shared = (origin / ".dvc").is_dir()
    if shared:
        cache = run(["dvc", "cache", "dir"], origin).strip().splitlines()[-1]
        if (origin / ".dvc" / "config.local").is_file():  # remotes and their credentials
            (root / ".dvc" / "config.local").write_bytes(
                (origin / ".dvc" / "config.local").read_bytes()
            )
        run(["dvc", "cache", "dir", "--local", str((origin / cache).resolve())], root)
    # DVC's update check is a detached daemon that would write into the clone after the run.
    run(["dvc", "config", "--local", "core.check_update", "false"], root)
    log(f"clone of {origin} at {sha[:7]}, DVC cache {'shared' if shared else 'pulled'}")
    return sha, shared


def restore_data(root: Path, params: Mapping[str, Any], shared: bool) -> None:
    """Make sure the image folder of ``data.path`` is in the clone: git-tracked, or tracked
    with ``dvc add`` and restored from the cache (or the DVC remote).

    Raises:
        ParamsError: ``data.path`` leaves the project or is tracked by neither.
    """
    data = params.get("data") or {}
    path = data.get("path")
    if data.get("source", "digits") == "digits" or not path:
        return
    check_inside(path, root)
    if not (root / path).exists():
        with contextlib.suppress(DvcCommandError):
            run(["dvc", "checkout" if shared else "pull", "--", path], root)
    if not (root / path).exists():
        problem = (
            f"{path!r} is tracked by neither git nor DVC in this commit, so a run cannot see "
            f"it; track it: dvc add {path} && git add {path}.dvc && git commit (and dvc push "
            "for another machine)"
        )
        raise ParamsError("data.path", [("data.path", problem)])


def make_experiment(
    root: Path, name: str, overrides: Mapping[str, Any], shared: bool, log: Callable[[str], None]
) -> dict[str, str]:
    """Write ``overrides`` into params.yaml, ``dvc exp run -n NAME``, ``dvc exp push``.

    The experiment goes back to ``origin`` (the user's repository, or the team's git
    remote); with a DVC remote configured its outputs and the run cache go there too.
    Returns stage name -> ``ran`` or ``cached``.

    Raises:
        DvcCommandError: a stage failed (its ``error:`` line first), or the push did.
    """
    write_params(root / "params.yaml", overrides)
    output = run(["dvc", "exp", "run", "-n", name, *([] if shared else ["--pull"])], root, log)
    stages = {m[2]: "cached" if m[3] else "ran" for m in STAGE_LINE.finditer(output)}
    remote = subprocess.run(
        [sys.executable, "-m", "dvc", "remote", "default"], cwd=root, capture_output=True
    )
    cache = ["--run-cache"] if remote.returncode == 0 and remote.stdout.strip() else ["--no-cache"]
    run(["dvc", "exp", "push", *cache, "origin", name], root, log)
    return stages


def experiment_names(root: Path) -> set[str]:
    """The experiments the origin holds on the clone's commit (``dvc exp list origin``)."""
    listed = run(["dvc", "exp", "list", "--name-only", "origin"], root)
    return {line.strip() for line in listed.splitlines() if line.strip()}
