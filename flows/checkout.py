"""Where flow runs happen: a git worktree of the project per run, never the user's workspace.

A run checks out the commit it starts from into ``.dvc/tmp/flows/<run>/`` (git worktree,
detached; DVC ignores ``.dvc/`` when it collects stages, git ignores ``.dvc/tmp``), points
the checkout's DVC at the project's cache (``.dvc/config.local``: outputs and run cache are
shared, so unchanged stages are restored instead of run), writes its params as a YAML file,
runs ``dvc repro`` there, and records the result as a DVC experiment of the project: a commit
on top of the start commit under ``refs/exps/<baseline>/<name>``, the ref ``dvc exp show`` /
``dvc exp apply`` read. The ref is written with ``git update-ref`` rather than
``dvc exp save``: DVC's experiment commands keep scratch refs (``refs/exps/stash``,
``refs/exps/exec/*``) that every worktree of a repository shares, so a save here could take
the stash of a ``dvc exp run`` the user runs in the workspace at the same moment.

Every child process starts in its own session and is registered, so that a cancelled run
(SIGTERM from Prefect's runner) kills what it started (:func:`kill_children`). No Prefect
here; nothing imports torch or DVC's internals.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
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

import yaml

from ganpipe.params import ParamsError, parse_params, read_yaml

#: The project this file belongs to (flows/ sits at its root). Deployments take no path:
#: a served flow always works on the checkout it was served from.
PROJECT_ROOT = Path(__file__).resolve().parents[1]
#: Where run checkouts live, relative to the project.
CHECKOUTS = Path(".dvc") / "tmp" / "flows"
#: The train stage's checkpoints (stages/train.py CHECKPOINTS), shared with every checkout.
CHECKPOINTS_DIR = Path("checkpoints")
#: What the stages measured (timings, memory; stages/train.py MEASUREMENTS_DIR): metrics
#: files outside DVC's outputs, read beside the ones ``dvc metrics show`` reports.
MEASURED_METRICS = ("measurements/train/metrics.json",)
#: Lines of a failed command's output kept for its error message.
TAIL_LINES = 40
#: Output of a failed DVC command that an identical retry may not see: a held repository
#: lock (dvc/lock.py FAILED_TO_LOCK_MESSAGE), a file-system stall, a killed stage process.
TRANSIENT = re.compile(
    r"Unable to acquire lock\. Most likely another DVC process is running"
    r"|Resource temporarily unavailable|Stale file handle|Interrupted system call"
    r"|exited with -\d+"  # DVC's words for a stage command killed by a signal
    r"|Unable to create '[^']*\.lock': File exists"  # git: another command holds that lock
)
#: Experiment names become git ref names; this is a safe subset of them.
EXP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*(?<![.])(?<!\.lock)")

_children: set[subprocess.Popen] = set()
_checkouts: set[Path] = set()
_lock = threading.Lock()
#: Set once this process is being cancelled: no new child process starts after that.
_stopping = threading.Event()


class DvcCommandError(RuntimeError):
    """A command failed. The message is the failing stage's own words, then DVC's.

    Attributes:
        command: The argv that failed.
        returncode: Its exit status (negative: killed by that signal).
        tail: The last lines of its output.
        transient: True when retrying may succeed (a held lock, an I/O hiccup, a killed
            process).
    """

    def __init__(self, command: list[str], returncode: int | None, tail: str):
        self.command, self.returncode, self.tail = command, returncode, tail
        killed = returncode is not None and (returncode < 0 or returncode in (137, 143))
        self.transient = killed or bool(TRANSIENT.search(tail))
        super().__init__(failure_message(command, returncode, tail))


class ExperimentFailed(RuntimeError):
    """An experiment run (a flow run of its own, on any worker) ended without success.

    Attributes:
        state: Its final state, lower case: ``failed``, ``crashed`` (its process or machine
            died) or ``cancelled``.
        transient: True when running it again may succeed: it crashed, or a stage was
            killed or hit a held lock or an I/O hiccup (:data:`TRANSIENT`).
    """

    def __init__(self, name: str, state: str, message: str):
        self.state = state
        self.transient = state == "crashed" or bool(TRANSIENT.search(message))
        super().__init__(f"experiment {name} {state}: {message}")


def failure_message(command: list[str], returncode: int | None, tail: str) -> str:
    """One readable message for a failed command: its ``error:`` and ``ERROR:`` lines first.

    Stages print ``error: <what and how to fix it>`` and exit 2; DVC then prints
    ``ERROR: failed to reproduce 'stage' ...``. Both are kept, without duplicates; when
    neither appears (a crash), the last lines of the output stand in.
    """
    lines = [line.rstrip() for line in tail.splitlines() if line.strip()]
    wanted = [line for line in lines if re.match(r"\s*(error|ERROR)\b", line)] or lines[-10:]
    shown = " ".join(c for c in command if c not in (sys.executable, "-m"))
    if returncode is None:
        ended = "did not run"
    elif returncode < 0:
        ended = f"killed by {signal.Signals(-returncode).name}"
    else:
        ended = f"exited with {returncode}"
    return "\n".join([*dict.fromkeys(wanted), f"(`{shown}` {ended})"])


def run(args: list[str], cwd: Path, log: Callable[[str], None] | None = None) -> str:
    """Run ``args`` in ``cwd``, passing each output line to ``log``; return the output.

    ``dvc`` means this interpreter's DVC; stage commands find this interpreter's tools
    first on PATH. In a checkout of the project (``cwd/src/ganpipe`` exists) they import
    the checkout's ``ganpipe``, not the one an editable install points at (the user's
    workspace, whose code may have moved on from the commit the run started from). The
    process gets a session of its own and is registered until it ends.

    Raises:
        DvcCommandError: non-zero exit (or killed).
    """
    command = [sys.executable, "-m", "dvc", *args[1:]] if args[0] == "dvc" else args
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "DVC_NO_ANALYTICS": "1",
    }
    if (Path(cwd) / "src" / "ganpipe").is_dir():
        paths = [str(Path(cwd).resolve() / "src"), os.environ.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path)
    log = log or logging.getLogger(__name__).debug
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
    try:
        assert proc.stdout is not None
        for raw in proc.stdout:
            # tqdm redraws progress bars with carriage returns; keep the last state only.
            line = raw.rstrip("\n").rsplit("\r", 1)[-1]
            output.append(line)
            if line.strip():
                log(line)
        returncode = proc.wait()
    finally:
        with _lock:
            _children.discard(proc)
    if returncode != 0:
        raise DvcCommandError(command, returncode, "\n".join(output[-TAIL_LINES:]))
    return "\n".join(output)


def kill_children() -> None:
    """SIGKILL every process group this process started and remove its checkouts.

    Called when a flow run ends abnormally (cancelled: Prefect's runner sends SIGTERM to the
    flow run's process only, so what that process started must be stopped by it).
    """
    _stopping.set()
    with _lock:
        procs, checkouts = list(_children), list(_checkouts)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    for path in checkouts:
        remove_checkout(path)


def git(args: list[str], cwd: Path, attempts: int = 3) -> str:
    """``git ARGS`` in ``cwd``; a lock held by another git command is waited out briefly."""
    for attempt in range(attempts):
        try:
            return run(["git", *args], cwd).strip()
        except DvcCommandError as exc:
            if not exc.transient or attempt == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def resolve_commit(project: Path, rev: str | None) -> str:
    """The full sha of ``rev`` (default ``HEAD``) in the project's git repository.

    Raises:
        ValueError: ``rev`` names no commit.
    """
    try:
        return git(
            ["rev-parse", "--verify", "--end-of-options", f"{rev or 'HEAD'}^{{commit}}"], project
        )
    except DvcCommandError:
        raise ValueError(
            f"commit={rev!r} is not a commit of {project}; give a sha, branch or tag"
        ) from None


@contextlib.contextmanager
def checkout(project: Path, commit: str, name: str) -> Iterator[Path]:
    """A git worktree of ``project`` at ``commit`` sharing its DVC cache, removed at the end.

    Stale checkouts (their owner process is gone, e.g. killed) are removed first.
    """
    prune_stale(project)
    slug = re.sub(r"[^\w.-]", "_", name)
    path = project / CHECKOUTS / f"{slug}-{os.getpid()}-{threading.get_ident() % 10**6}"
    cache = run(["dvc", "cache", "dir"], project).strip().splitlines()[-1]
    with _lock:
        _checkouts.add(path)
    try:
        git(["worktree", "add", "--detach", "--force", str(path), commit], project)
        (path / ".dvc" / "tmp").mkdir(parents=True, exist_ok=True)
        (path / ".dvc" / "tmp" / "owner.pid").write_text(f"{os.getpid()}\n")
        local = project / ".dvc" / "config.local"
        if local.exists():  # remotes and their credentials
            shutil.copyfile(local, path / ".dvc" / "config.local")
        run(["dvc", "config", "--local", "cache.dir", str(Path(project, cache).resolve())], path)
        share_checkpoints(project, path)
        yield path
    except BaseException as exc:
        if not isinstance(exc, Exception):  # cancelled (SIGTERM from Prefect's runner), ^C
            kill_children()
        raise
    finally:
        remove_checkout(path)
        with _lock:
            _checkouts.discard(path)


def share_checkpoints(project: Path, path: Path) -> None:
    """Hard-link the project's training checkpoints (``checkpoints/``) into the checkout.

    They are no DVC output (dvc.lock must not depend on which runs a workspace holds), so
    a fresh checkout has none; linked, a train stage that DVC reruns there resumes its run
    (same bytes, by the checkpoint contract) instead of starting over. Checkpoints are
    replaced by rename, never written in place, so the links never change the project's
    files.
    """
    source = project / CHECKPOINTS_DIR
    if source.is_dir() and not (path / CHECKPOINTS_DIR).exists():
        shutil.copytree(source, path / CHECKPOINTS_DIR, copy_function=os.link)


def remove_checkout(path: Path) -> None:
    """Remove a run checkout and git's record of it (nothing if already gone)."""
    shutil.rmtree(path, ignore_errors=True)
    project = path.parents[len(CHECKOUTS.parts)]
    subprocess.run(["git", "worktree", "prune"], cwd=project, capture_output=True)


def owner_of(path: Path) -> int | None:
    """The pid of the process that made checkout ``path`` (None: unknown).

    ``owner.pid`` is written once ``git worktree add`` has filled the folder; until then
    (another run's checkout being made right now) the pid in the folder's name says it.
    """
    try:
        return int((path / ".dvc" / "tmp" / "owner.pid").read_text())
    except (OSError, ValueError):
        try:
            return int(path.name.rsplit("-", 2)[1])
        except (IndexError, ValueError):
            return None


def prune_stale(project: Path) -> list[Path]:
    """Remove the run checkouts whose owner process has ended; return them."""
    stale = []
    for path in sorted((project / CHECKOUTS).glob("*")):
        owner = owner_of(path)
        if owner is None or not _signalable(owner):
            stale.append(path)
            remove_checkout(path)
    return stale


def _signalable(pid: int) -> bool:
    """Whether this process may signal ``pid`` (it runs, and as this user)."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def record_experiment(path: Path, baseline: str, name: str, message: str) -> str:
    """Commit the checkout on top of ``baseline`` as DVC experiment ``name``; return the sha.

    The ref is created only if absent (``git update-ref REF NEW ''``), so two runs can never
    overwrite each other's experiment.

    Raises:
        ValueError: an experiment of that name exists on ``baseline``.
    """
    git(["add", "-A"], path)
    identity = []
    for key, default in (("user.name", "ganpipe flow"), ("user.email", "ganpipe@localhost")):
        with contextlib.suppress(DvcCommandError):
            git(["config", key], path)
            continue
        identity += ["-c", f"{key}={default}"]
    git([*identity, "commit", "-q", "--no-verify", "--allow-empty", "-m", message], path)
    sha = git(["rev-parse", "HEAD"], path)
    try:
        git(["update-ref", experiment_ref(baseline, name), sha, ""], path)
    except DvcCommandError as exc:
        if "reference already exists" not in exc.tail:
            raise
        raise ValueError(
            f"exp_name={name!r}: an experiment of that name exists on commit {baseline[:7]}; "
            f"choose another name or remove it (dvc exp remove {name})"
        ) from None
    return sha


def experiment_ref(baseline: str, name: str) -> str:
    """DVC's ref of experiment ``name`` on ``baseline`` (dvc/repo/experiments/refs.py)."""
    return f"refs/exps/{baseline[:2]}/{baseline[2:]}/{name}"


def push_remote(project: Path) -> str | None:
    """The git remote experiments are pushed to, if the project asks for it: DVC's own
    settings ``exp.auto_push true`` and ``exp.git_remote NAME`` (``dvc config``), the ones
    ``dvc exp run`` obeys. None when ``auto_push`` is off."""
    listed = run(["dvc", "config", "--list"], project)
    config = dict(line.partition("=")[::2] for line in listed.splitlines() if "=" in line)
    if config.get("exp.auto_push", "").lower() not in ("true", "1", "yes"):
        return None
    return config.get("exp.git_remote") or "origin"


def experiment_exists(project: Path, baseline: str, name: str) -> bool:
    return bool(git(["for-each-ref", experiment_ref(baseline, name)], project))


def check_exp_name(name: str) -> None:
    """Raises ValueError unless ``name`` can be a DVC experiment name (a git ref part)."""
    if not EXP_NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"exp_name={name!r} is not a valid experiment name; use letters, digits, "
            "'-', '_' and '.', starting with a letter or digit (it becomes a git ref)"
        )


def stage_names(dvc_yaml: Path) -> list[str]:
    """The stages of ``dvc.yaml``, upstream first, otherwise in the order of the file.

    A stage comes after every stage whose outputs (``outs``, ``metrics``, ``plots``) it
    depends on, so a stage added to dvc.yaml is picked up without touching the flows.

    Raises:
        ValueError: dvc.yaml has no stages, or its dependencies form a cycle.
    """
    stages: Mapping[str, Any] = (yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {}
    if not stages:
        raise ValueError(f"{dvc_yaml} defines no stages")

    def paths(entries: Any) -> list[str]:
        found = []
        for entry in entries or []:
            found += [
                os.path.normpath(str(n)) for n in (entry if isinstance(entry, Mapping) else [entry])
            ]
        return found

    produced = {
        name: [p for kind in ("outs", "metrics", "plots") for p in paths(body.get(kind))]
        for name, body in stages.items()
    }
    waiting = {
        name: {
            other
            for other, outs in produced.items()
            if other != name
            for dep in paths(stages[name].get("deps"))
            for out in outs
            if dep == out or dep.startswith(out + os.sep)
        }
        for name in stages
    }
    order: list[str] = []
    while waiting:
        ready = [name for name in stages if name in waiting and not waiting[name] - set(order)]
        if not ready:
            raise ValueError(f"{dvc_yaml}: the stages {sorted(waiting)} depend on each other")
        order.append(ready[0])
        del waiting[ready[0]]
    return order


def stage_outputs(dvc_yaml: Path) -> list[str]:
    """Every output path declared in ``dvc.yaml`` (outs, metrics, plots), in file order."""
    found: list[str] = []
    for body in ((yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {}).values():
        for kind in ("outs", "metrics", "plots"):
            for entry in body.get(kind) or []:
                found += list(entry) if isinstance(entry, Mapping) else [str(entry)]
    return list(dict.fromkeys(found))


def apply_overrides(params: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` with dotted-key ``overrides`` applied (``{"train.kimg": 5}``).

    Raises:
        ParamsError: a key sets a whole section, or reaches inside a value.
    """
    result = copy.deepcopy(dict(params))
    problems = []

    def name_in(node: dict, part: str) -> str | int:
        # YAML reads `4: 128` (model.g_channels) with an int key: "…g_channels.4" means it.
        return int(part) if part.isdigit() and int(part) in node else part

    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = result
        for part in parents:
            node = node.setdefault(name_in(node, part), {}) if isinstance(node, dict) else None
            if node is None:
                break
        if isinstance(node, dict):
            leaf = name_in(node, leaf)
        if isinstance(node, dict) and isinstance(node.get(leaf), dict):
            inner = ", ".join(f"{key}.{name}" for name in node[leaf])
            problems.append((key, f"is a section; override single values such as {inner}"))
        elif isinstance(node, dict):
            node[leaf] = value
        else:
            problems.append((key, f"{'.'.join(parents)} is a value, not a section"))
    if problems:
        raise ParamsError("overrides", problems)
    return result


def validate_overrides(
    params_text: str, overrides: Mapping[str, Any] | None, where: str = "params.yaml"
) -> dict[str, Any]:
    """Check ``overrides`` against the params file ``params_text`` and the schema.

    The overrides are applied and the result validated by the schema every stage uses, so
    a typo or a bad value fails here, naming the key, before any stage runs. The returned
    values are the schema's (``1`` for a float key becomes ``1.0``; a quoted ``"0.5"`` for
    a number is refused).

    Raises:
        ParamsError: listing every problem, keys named as in params.yaml.
    """
    overrides = dict(overrides or {})
    bad = [k for k in overrides if not isinstance(k, str) or not re.fullmatch(r"[\w.]+", k)]
    if bad:
        raise ParamsError(
            "overrides", [(str(k), "keys are dotted params names, e.g. train.kimg") for k in bad]
        )
    merged = apply_overrides(read_yaml(params_text) or {}, overrides)
    valid = parse_params(merged, f"{where} with overrides {overrides}")
    normalised = flatten(valid.model_dump(mode="json"))
    return {key: normalised.get(key, value) for key, value in overrides.items()}


def write_params(path: Path, overrides: Mapping[str, Any]) -> None:
    """Set ``overrides`` in the params file ``path``, keeping its comments and layout.

    Strings are written double-quoted, so every value reads back unchanged by YAML 1.1 and
    1.2 readers alike (``yes``, ``null``, ``1e3``, ``${x}``, newlines, backslashes).
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedSeq
    from ruamel.yaml.scalarstring import DoubleQuotedScalarString

    rt = YAML()
    rt.preserve_quotes = True
    rt.width = 4096
    rt.allow_unicode = True
    # ruamel writes None as an empty value; params.yaml spells it null.
    rt.representer.add_representer(
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null")
    )

    def exact(value: Any) -> Any:
        if isinstance(value, str):
            return DoubleQuotedScalarString(value)
        if isinstance(value, list):
            seq = CommentedSeq(exact(v) for v in value)
            seq.fa.set_flow_style()
            return seq
        return value

    data = rt.load(path.read_text(encoding="utf-8"))
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = exact(value)
    text = io.StringIO()
    rt.dump(data, text)
    path.write_text(text.getvalue(), encoding="utf-8")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    if not isinstance(tree, Mapping):
        return {prefix: tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat
