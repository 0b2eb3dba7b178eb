"""The pipeline flow's stage task on a real (tiny) DVC project, called as ``task.fn()``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
import zc.lockfile
from prefect.states import Failed

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
