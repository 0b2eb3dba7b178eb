"""The DVC workspace as the flows see it: commands, stages, params overrides, one lock.

Flows never import torch or DVC's internals: every action is a ``python -m dvc ...``
subprocess in the project folder (flows -> dvc -> stages -> ganpipe). This module holds
what the pipeline and sweep flows share, written without Prefect so it can be tested alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from ganpipe.params import ParamsError, parse_params, read_yaml

#: The project this file belongs to (flows/ sits at its root).
PROJECT_ROOT = Path(__file__).resolve().parents[1]

#: Lines of a failed command's output kept for its error message.
TAIL_LINES = 40

#: Output of a DVC command that failed for a reason that goes away by itself: another DVC
#: process holds the repository lock (dvc/lock.py FAILED_TO_LOCK_MESSAGE), or the file
#: system stalled. Anything else (a stage's own error, a bad target) fails the same way
#: on every attempt and is never retried.
TRANSIENT_PATTERNS = (
    re.compile(r"Unable to acquire lock\. Most likely another DVC process is running"),
    re.compile(r"Resource temporarily unavailable|Stale file handle|Interrupted system call"),
)

#: errno values of a failed process start that are worth another attempt.
TRANSIENT_ERRNOS = {errno.EAGAIN, errno.EINTR, errno.ENOMEM, errno.EBUSY}


class DvcCommandError(RuntimeError):
    """A DVC command failed. The message is the failing stage's own words, then DVC's.

    Attributes:
        command: The argv that failed.
        returncode: Its exit status (None when it could not start).
        transient: True when retrying may succeed (a held lock, an I/O hiccup).
        tail: The last lines of its output.
    """

    def __init__(self, command: list[str], returncode: int | None, tail: str, transient: bool):
        self.command = command
        self.returncode = returncode
        self.tail = tail
        self.transient = transient
        super().__init__(failure_message(command, returncode, tail))


def failure_message(command: list[str], returncode: int | None, tail: str) -> str:
    """One readable message for a failed command: its ``error:`` and ``ERROR:`` lines first.

    Stages print ``error: <what and how to fix it>`` and exit 2; DVC then prints
    ``ERROR: failed to reproduce 'stage' ...``. Both are kept, without duplicates; when
    neither appears (a crash), the last lines of the output stand in.
    """
    lines = [line.rstrip() for line in tail.splitlines() if line.strip()]
    wanted = [line for line in lines if re.match(r"\s*(error|ERROR)\b", line)]
    if not wanted:
        wanted = lines[-10:]
    shown = " ".join(c for c in command if c not in (sys.executable, "-m"))
    ended = "did not run to its end" if returncode is None else f"exited with {returncode}"
    return "\n".join([*dict.fromkeys(wanted), f"(`{shown}` {ended})"])


def is_transient(output: str) -> bool:
    """Whether a failed DVC command's output says that an identical retry may succeed."""
    return any(pattern.search(output) for pattern in TRANSIENT_PATTERNS)


def dvc_env() -> dict[str, str]:
    """Environment of DVC subprocesses: this interpreter's tools first, no analytics.

    Stage commands are ``python -m stages.NAME``; they must find the Python that has
    ganpipe installed, so its bin folder goes first on PATH.
    """
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "DVC_NO_ANALYTICS": "1",
    }


def run_dvc(
    args: list[str],
    project: Path,
    log: Callable[[str], None] | None = None,
    leaves_daemons: bool = False,
) -> str:
    """Run ``dvc ARGS`` in ``project``, passing each output line to ``log``; return the output.

    Args:
        leaves_daemons: The command starts background processes that outlive it
            (``dvc queue start``). They would inherit a pipe and hold it open, so the
            output goes through a temporary file, logged once the command exits.

    Raises:
        DvcCommandError: non-zero exit, or the process could not start.
    """
    command = [sys.executable, "-m", "dvc", *args]
    log = log or logging.getLogger(__name__).info
    with tempfile.TemporaryFile("w+", errors="replace") as spool:
        try:
            proc = subprocess.Popen(
                command,
                cwd=project,
                env=dvc_env(),
                stdout=spool if leaves_daemons else subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                errors="replace",
            )
        except OSError as exc:
            transient = exc.errno in TRANSIENT_ERRNOS
            raise DvcCommandError(command, None, str(exc), transient) from exc
        if leaves_daemons:
            proc.wait()
            spool.seek(0)
            stream: Iterable[str] = spool.read().splitlines()
        else:
            assert proc.stdout is not None
            stream = proc.stdout
        output: list[str] = []
        for raw in stream:
            # tqdm redraws progress bars with carriage returns; keep the last state only.
            line = raw.rstrip("\n").rsplit("\r", 1)[-1]
            output.append(line)
            if line.strip():
                log(line)
    returncode = proc.wait()
    if returncode != 0:
        tail = "\n".join(output[-TAIL_LINES:])
        raise DvcCommandError(command, returncode, tail, is_transient(tail))
    return "\n".join(output)


def dvc_output(args: list[str], project: Path, timeout_s: float | None = None) -> str:
    """Run a DVC command that only reports (``exp show``, ``queue status``); return stdout.

    Args:
        timeout_s: Kill the command (and anything it started) after this many seconds.

    Raises:
        DvcCommandError: non-zero exit, or killed at ``timeout_s`` (then ``transient``).
    """
    command = [sys.executable, "-m", "dvc", *args]
    with subprocess.Popen(
        command,
        cwd=project,
        env=dvc_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise DvcCommandError(
                command, None, f"no answer after {timeout_s:.0f} s; killed", transient=True
            ) from None
    if proc.returncode != 0:
        output = stdout + stderr
        raise DvcCommandError(command, proc.returncode, output, is_transient(output))
    return stdout


def dvc_json(args: list[str], project: Path) -> Any:
    """Run a DVC command that prints JSON (``metrics show --json``...) and parse its output."""
    return json.loads(dvc_output(args, project))


#: A task row of ``dvc queue status``: ``<rev> <name> <created> <status>``.
QUEUE_ROW = re.compile(
    r"^[0-9a-f]{7,}\s+(?P<name>\S+)\s.*\s(?P<status>Queued|Running|Success|Failed)\s*$"
)
#: Which state a name shows when it has several tasks (one lost, then queued again). A
#: success is never the older one: DVC refuses to queue a name that already succeeded.
STATE_RANK = {"failed": 0, "success": 1, "queued": 2, "running": 3}


def queue_states(status_text: str) -> dict[str, str]:
    """Name -> ``queued``, ``running``, ``success`` or ``failed``, from ``dvc queue status``.

    A name queued again after a lost task has two rows; the unfinished or successful one
    counts, not the old failure.
    """
    states: dict[str, str] = {}
    for line in status_text.splitlines():
        match = QUEUE_ROW.match(line.strip())
        if match:
            name, state = match["name"], match["status"].lower()
            if STATE_RANK[state] >= STATE_RANK.get(states.get(name, "failed"), 0):
                states[name] = state
    return states


def queue_workers_alive(project: Path) -> int:
    """How many of ``project``'s DVC queue workers are running.

    ``dvc queue start`` records each worker's pid in ``.dvc/tmp/exps/celery/<worker>.pid``
    and leaves the file when the worker exits; a pid counts while its process is still a
    queue worker: not a zombie, not reused by another program (an empty command line, as
    just after exec, gets the benefit of the doubt).
    """
    alive = 0
    for pid_file in (project / ".dvc" / "tmp" / "exps" / "celery").glob("*.pid"):
        try:
            proc = Path("/proc") / str(int(pid_file.read_text()))
            state = proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
            cmdline = proc.joinpath("cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        alive += state != "Z" and (not cmdline or b"queue-worker" in cmdline)
    return alive


def stage_names(dvc_yaml: Path) -> list[str]:
    """The stages of ``dvc.yaml``, upstream first, otherwise in the order of the file.

    A stage comes after every stage whose outputs (``outs``, ``metrics``, ``plots``) it
    depends on, so a stage added to dvc.yaml is picked up without touching the flows.
    ``foreach``/``matrix`` groups keep their file position (``dvc repro NAME`` runs the
    whole group).

    Raises:
        ValueError: dvc.yaml has no stages, or its dependencies form a cycle.
    """
    spec = yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) or {}
    stages: Mapping[str, Any] = spec.get("stages") or {}
    if not stages:
        raise ValueError(f"{dvc_yaml} defines no stages")

    def paths(entries: Any) -> list[str]:
        found = []
        for entry in entries or []:
            names = entry if isinstance(entry, Mapping) else [entry]
            found += [os.path.normpath(str(name)) for name in names]
        return found

    produced = {
        name: paths(body.get("outs")) + paths(body.get("metrics")) + paths(body.get("plots"))
        for name, body in stages.items()
    }

    def upstream(name: str) -> set[str]:
        deps = paths(stages[name].get("deps"))
        return {
            other
            for other, outs in produced.items()
            if other != name
            and any(dep == out or dep.startswith(out + os.sep) for dep in deps for out in outs)
        }

    waiting = {name: upstream(name) for name in stages}
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
    spec = yaml.safe_load(dvc_yaml.read_text(encoding="utf-8")) or {}
    found: list[str] = []
    for body in (spec.get("stages") or {}).values():
        for kind in ("outs", "metrics", "plots"):
            for entry in body.get(kind) or []:
                found += list(entry) if isinstance(entry, Mapping) else [str(entry)]
    return list(dict.fromkeys(found))


def apply_overrides(params: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``params`` with dotted-key ``overrides`` applied (``{"train.kimg": 5}``).

    Raises:
        ParamsError: a key sets a whole section instead of one value.
    """
    result = json.loads(json.dumps(params))
    problems = []
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = result
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
            if node is None:
                break
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


def validate_overrides(project: Path, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check ``overrides`` against params.yaml and the schema; return them normalised.

    The overrides are applied to the project's params.yaml and the result is validated by
    the same schema every stage uses, so a typo or a bad value fails here, naming the key,
    before any stage runs. The returned values are the schema's (``1`` for a float key
    becomes ``1.0``; types are strict, so a quoted ``"0.5"`` is refused), ready for
    :func:`write_overrides` or :func:`set_args`.

    Raises:
        ParamsError: listing every problem, keys named as in params.yaml.
    """
    overrides = dict(overrides or {})
    bad_keys = [k for k in overrides if not isinstance(k, str) or not re.fullmatch(r"[\w.]+", k)]
    if bad_keys:
        raise ParamsError(
            "overrides",
            [(str(k), "keys are dotted params names, e.g. train.kimg") for k in bad_keys],
        )
    params_file = project / "params.yaml"
    raw = read_yaml(params_file.read_text(encoding="utf-8")) or {}
    merged = apply_overrides(raw, overrides)
    valid = parse_params(merged, f"{params_file} with overrides {overrides}")
    normalised = flatten(valid.model_dump(mode="json"))
    return {key: normalised.get(key, value) for key, value in overrides.items()}


def set_args(overrides: Mapping[str, Any]) -> list[str]:
    """``dvc exp run`` arguments setting ``overrides``: ``["-S", "train.kimg=5", ...]``.

    JSON spells values the way DVC's ``-S`` (Hydra's override grammar) reads them: quoted
    strings, true/false, null, [lists].
    """
    return [arg for key, value in overrides.items() for arg in ("-S", f"{key}={json.dumps(value)}")]


def write_overrides(project: Path, overrides: Mapping[str, Any]) -> None:
    """Set ``overrides`` in the project's params.yaml, keeping its comments and layout.

    This is what ``dvc exp run -S`` does to the workspace before it runs the stages; the
    pipeline flow does it once, then runs the stages one by one. The file is replaced
    atomically.
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedSeq

    rt = YAML()
    rt.preserve_quotes = True
    rt.width = 4096
    # ruamel writes None as an empty value; params.yaml spells it null.
    rt.representer.add_representer(
        type(None), lambda rep, _: rep.represent_scalar("tag:yaml.org,2002:null", "null")
    )
    path = project / "params.yaml"
    data = rt.load(path.read_text(encoding="utf-8"))
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        if isinstance(value, list):
            value = CommentedSeq(value)
            value.fa.set_flow_style()
        node[leaf] = value
    text = io.StringIO()
    rt.dump(data, text)
    write_atomic(path, text.getvalue())


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` in one rename: readers see the old or the new file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    if not isinstance(tree, Mapping):
        return {prefix: tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def experiments(exp_show: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Named experiments of ``dvc exp show --json``: name -> its record.

    Each record has ``params`` (params.yaml, nested), ``metrics`` (file -> nested values),
    ``state`` (``queued``, ``running``, ``success``, ``failed``; ``success`` for a finished
    workspace experiment) and ``error``. Where a name appears twice (a lost queue task and
    its second run), the record of the later run counts (:data:`STATE_RANK`).
    """
    found: dict[str, dict[str, Any]] = {}
    for commit in exp_show:
        for exp in commit.get("experiments") or []:
            executor = exp.get("executor") or {}
            for rev in exp.get("revs") or []:
                name = rev.get("name") or exp.get("name")
                data = rev.get("data") or {}
                error = rev.get("error")
                state = executor.get("state") or ("failed" if error else "success")
                if name in found and STATE_RANK.get(found[name]["state"], 0) > STATE_RANK.get(
                    state, 0
                ):
                    continue
                found[name] = {
                    "params": ((data.get("params") or {}).get("params.yaml") or {}).get("data")
                    or {},
                    "metrics": {
                        path: entry.get("data") or {}
                        for path, entry in (data.get("metrics") or {}).items()
                    },
                    "state": state,
                    "error": (error or {}).get("msg"),
                    "rev": rev.get("rev"),
                }
    return found


@contextlib.contextmanager
def workspace_lock(
    project: Path, timeout_s: float, log: Callable[[str], None] | None = None
) -> Iterator[None]:
    """Hold the project's flow lock: one flow at a time changes the workspace.

    DVC locks the repository for one command; a flow runs several (one per stage, with
    params changed by the first), so two flows interleaving their stages would train one
    run's model with the other's params. An ``flock`` on ``.dvc/tmp/flows.lock`` makes
    the second flow wait; the kernel releases it if the holder dies.

    Raises:
        TimeoutError: the lock was not free within ``timeout_s`` seconds.
    """
    log = log or logging.getLogger(__name__).info
    path = project / ".dvc" / "tmp" / "flows.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    handle.seek(0)
                    holder = handle.read().strip() or "another flow"
                    log(f"workspace busy ({holder}); waiting for {path}")
                    waited = True
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{path} is still held after {timeout_s:.0f} s by another flow run; "
                        "wait for it to finish or raise lock_timeout_s"
                    ) from None
                time.sleep(0.5)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} since {time.strftime('%H:%M:%S')}\n")
        handle.flush()
        if waited:
            log("workspace lock acquired")
        try:
            yield
        finally:
            handle.truncate(0)
            fcntl.flock(handle, fcntl.LOCK_UN)
