"""The flows' tasks on real (tiny) DVC projects, called as ``task.fn()``: a pipeline stage,
and the sweep's wait on DVC's experiment queue."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml
import zc.lockfile
from prefect.states import Failed

from flows import sweep, workspace
from flows.pipeline import retry_only_transient, run_stage
from flows.workspace import DvcCommandError
from tests.helpers import sh

FAIL = "import sys; print('error: widget.size=3 is too big; use 2', file=sys.stderr); sys.exit(2)"


@pytest.fixture
def dvc_project(tmp_path) -> Path:
    """A git + DVC repository with one stage that works and one that fails like ours do."""
    stages = {
        "make": {
            "cmd": f"{sys.executable} -c \"open('out.txt', 'w').write('x')\"",
            "outs": ["out.txt"],
        },
        "broken": {"cmd": f'{sys.executable} -c "{FAIL}"'},
    }
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    sh(["git", "init", "-q"], tmp_path)
    sh([sys.executable, "-m", "dvc", "init", "-q"], tmp_path)
    return tmp_path


def test_stage_runs_then_is_cached(dvc_project):
    assert run_stage.fn(str(dvc_project), "make") == "ran"
    assert (dvc_project / "out.txt").read_text() == "x"
    assert run_stage.fn(str(dvc_project), "make") == "cached"


def test_failing_stage_raises_its_own_message_and_is_not_retried(dvc_project):
    with pytest.raises(DvcCommandError) as info:
        run_stage.fn(str(dvc_project), "broken")
    assert str(info.value).splitlines()[0] == "error: widget.size=3 is too big; use 2"
    assert "failed to reproduce 'broken'" in str(info.value)
    assert not info.value.transient
    assert retry_only_transient(None, None, Failed(data=info.value)) is False


def test_held_dvc_lock_is_a_transient_failure(dvc_project):
    lock = zc.lockfile.LockFile(str(dvc_project / ".dvc" / "tmp" / "lock"))
    try:
        with pytest.raises(DvcCommandError) as info:
            run_stage.fn(str(dvc_project), "make")
    finally:
        lock.close()
    assert info.value.transient
    assert "Unable to acquire lock" in str(info.value)
    assert retry_only_transient(None, None, Failed(data=info.value)) is True
    assert run_stage.fn(str(dvc_project), "make") == "ran"  # free again


@pytest.fixture
def queue_project(tmp_path) -> Path:
    """A committed git + DVC project whose one stage writes a param after a few seconds."""
    slow = (
        "import time, yaml; value = yaml.safe_load(open('params.yaml'))['value']; "
        "time.sleep(3); open('out.txt', 'w').write(str(value))"
    )
    stage = {"cmd": f'{sys.executable} -c "{slow}"', "params": ["value"], "outs": ["out.txt"]}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"slow": stage}}))
    (tmp_path / "params.yaml").write_text("value: 0\n")
    sh(["git", "init", "-q"], tmp_path)
    sh([sys.executable, "-m", "dvc", "init", "-q"], tmp_path)
    sh(["git", "add", "-A"], tmp_path)
    sh(["git", "commit", "-qm", "base"], tmp_path)
    return tmp_path


def wait_until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return found


@pytest.mark.slow
def test_an_experiment_lost_by_its_queue_worker_is_queued_again(queue_project, monkeypatch, caplog):
    """The worker dies while running q-a (as when DVC's worker stops while taking a task):
    q-a shows as running with no worker; the sweep queues it again and it completes."""
    monkeypatch.setattr(sweep, "NO_WORKER_GRACE_S", 5.0)
    overrides = {"q-a": {"value": 7}}
    sweep.queue_experiment.fn(str(queue_project), "q-a", overrides["q-a"])
    sweep.start_workers.fn(str(queue_project), 1)

    def status():
        return workspace.queue_states(workspace.dvc_output(["queue", "status"], queue_project))

    wait_until(lambda: status().get("q-a") == "running", 60, "q-a never started")
    pid_file = queue_project / ".dvc/tmp/exps/celery/dvc-exp-worker-1.pid"
    os.killpg(os.getpgid(int(pid_file.read_text())), signal.SIGKILL)
    wait_until(lambda: not workspace.queue_workers_alive(queue_project), 10, "worker alive")
    assert status()["q-a"] == "running"  # lost: shown as running, run by no one

    with caplog.at_level(logging.WARNING, logger="flows"):
        found = sweep.wait_for.fn(str(queue_project), overrides, 1, 0.5, 180.0, 30.0)
    assert "queueing q-a again" in caplog.text
    assert found["q-a"]["state"] == "success"
    assert found["q-a"]["params"] == {"value": 7}
