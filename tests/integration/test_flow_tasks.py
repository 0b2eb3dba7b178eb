"""The flows' building blocks on real (tiny) git + DVC projects, without Prefect: a run's
checkout, its params, its stages, its experiment record, and what a kill leaves behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from prefect.states import Failed

from flows import checkout
from flows.checkout import DvcCommandError
from flows.pipeline import retry_only_transient, run_stage
from ganpipe.params import read_yaml
from tests.helpers import experiments, sh

FAIL = "import sys; print('error: widget.size=3 is too big; use 2', file=sys.stderr); sys.exit(2)"
#: The stage writes the value it read (PyYAML, YAML 1.1, as a stage would) as JSON.
ECHO = (
    "import json, time, yaml; v = yaml.safe_load(open('params.yaml'))['value']; "
    "time.sleep(float(open('delay').read())); json.dump({'value': v}, open('out.json', 'w'))"
)

#: Values that a string grammar or a careless dump would change on the way to the stage.
EXACT_VALUES = [
    "ñandú 🦤",
    "back\\slash \\n not a newline",
    "two\nlines",
    "trailing space ",
    "quotes ' and \"",
    "${oc.env:SECRET_TOKEN}",
    "${value}",
    "yes",
    "no",
    "null",
    "~",
    "1e3",
    "0x1F",
    "012",
    "true",
    ".inf",
    "- item",
    "key: value",
    "# not a comment",
    "",
    "[1, 2]",
    "{a: 1}",
    "*alias",
    "!!python/object:os.system",
]


@pytest.fixture
def project(tmp_path) -> Path:
    """A committed git + DVC project: ``echo`` writes its param, ``broken`` fails like ours."""
    stages = {
        "echo": {
            "cmd": f'{sys.executable} -c "{ECHO}"',
            "deps": ["delay"],
            "params": ["value"],
            "outs": ["out.json"],
        },
        "broken": {"cmd": f'{sys.executable} -c "{FAIL}"'},
    }
    root = tmp_path / "project"
    root.mkdir()
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    (root / "params.yaml").write_text("# the value\nvalue: 0\n")
    (root / "delay").write_text("0")
    sh(["git", "init", "-q", "-b", "main"], root)
    sh([sys.executable, "-m", "dvc", "init", "-q"], root)
    sh([sys.executable, "-m", "dvc", "repro", "echo"], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "base"], root)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of the workspace but git's and DVC's own folders."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not {".git", ".dvc"} & set(p.relative_to(root).parts)
    }


def run_experiment(project: Path, overrides: dict, name: str) -> str:
    """What the pipeline flow does, without Prefect: checkout, params, stage, record."""
    base = checkout.resolve_commit(project, None)
    with checkout.checkout(project, base, name) as root:
        checkout.write_params(root / "params.yaml", overrides)
        assert run_stage.fn(str(root), "echo") == "ran"
        checkout.record_experiment(root, base, name, f"test {name}")
    return base


def shown(project: Path) -> dict:
    return experiments(project)


def test_an_experiment_is_made_in_a_checkout_and_recorded_in_the_project(project):
    before = snapshot(project)
    base = run_experiment(project, {"value": 7}, "seven")
    assert snapshot(project) == before  # the workspace is untouched
    assert sh(["git", "worktree", "list"], project).stdout.count("\n") == 1
    assert not list((project / checkout.CHECKOUTS).glob("*"))
    exp = shown(project)["seven"]
    assert exp["params"] == {"value": 7}
    assert checkout.experiment_exists(project, base, "seven")
    # `dvc exp apply` restores it from the shared cache, like any DVC experiment
    sh(["dvc", "exp", "apply", "seven"], project)
    assert json.loads((project / "out.json").read_text()) == {"value": 7}
    assert (project / "params.yaml").read_text() == "# the value\nvalue: 7\n"


def test_unchanged_stages_come_from_the_shared_run_cache(project):
    base = checkout.resolve_commit(project, None)
    with checkout.checkout(project, base, "again") as root:
        assert run_stage.fn(str(root), "echo") == "cached"
        assert json.loads((root / "out.json").read_text()) == {"value": 0}


def test_an_experiment_name_is_taken_once(project):
    base = run_experiment(project, {"value": 1}, "once")
    taken = pytest.raises(ValueError, match="exp_name='once'.*dvc exp remove once")
    with checkout.checkout(project, base, "once") as root, taken:
        checkout.record_experiment(root, base, "once", "second")
    assert shown(project)["once"]["params"] == {"value": 1}


def test_any_string_reaches_the_stage_unchanged(project):
    """One run for the whole table (each DVC run costs seconds); the params file is checked
    value by value in the unit tests."""
    base = checkout.resolve_commit(project, None)
    with checkout.checkout(project, base, "exact") as root:
        checkout.write_params(root / "params.yaml", {"value": EXACT_VALUES})
        assert (root / "params.yaml").read_text().startswith("# the value\n")
        run_stage.fn(str(root), "echo")
        assert json.loads((root / "out.json").read_text()) == {"value": EXACT_VALUES}
        lock = read_yaml((root / "dvc.lock").read_text())  # YAML 1.2, as DVC reads it
        assert lock["stages"]["echo"]["params"]["params.yaml"]["value"] == EXACT_VALUES


def test_failing_stage_raises_its_own_message_and_is_not_retried(project):
    with pytest.raises(DvcCommandError) as info:
        run_stage.fn(str(project), "broken")
    assert str(info.value).splitlines()[0] == "error: widget.size=3 is too big; use 2"
    assert "failed to reproduce 'broken'" in str(info.value)
    assert not info.value.transient
    assert retry_only_transient(None, None, Failed(data=info.value)) is False


def test_a_killed_stage_is_a_transient_failure_and_kill_children_cleans_up(project, monkeypatch):
    monkeypatch.setattr(checkout, "_stopping", threading.Event())  # set by kill_children
    (project / "delay").write_text("60")
    sh(["git", "commit", "-qam", "slow"], project)
    base = checkout.resolve_commit(project, None)
    errors = []

    def run():
        try:
            with checkout.checkout(project, base, "slow") as root:
                run_stage.fn(str(root), "echo")
        except DvcCommandError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    started = time.monotonic()
    thread.start()
    deadline = time.monotonic() + 60
    while not [p for p in checkout._children if "repro" in p.args]:
        assert time.monotonic() < deadline, "dvc repro never started"
        time.sleep(0.1)
    checkout.kill_children()  # what a cancelled flow run does
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - started < 40
    assert errors and errors[0].transient
    assert "killed by SIGKILL" in str(errors[0])
    assert retry_only_transient(None, None, Failed(data=errors[0])) is True
    assert not list((project / checkout.CHECKOUTS).glob("*"))
    alive = subprocess.run(["pgrep", "-f", str(project)], capture_output=True, text=True)
    assert alive.stdout.strip() == ""
    with pytest.raises(DvcCommandError, match="being cancelled"):  # nothing new starts
        checkout.run(["dvc", "version"], project)


def test_stale_checkouts_of_dead_runs_are_pruned(project):
    base = checkout.resolve_commit(project, None)
    dead = subprocess.Popen(["true"])
    dead.wait()
    with checkout.checkout(project, base, "stale") as root:
        (root / ".dvc" / "tmp" / "owner.pid").write_text(f"{dead.pid}\n")
        stale = root
        with checkout.checkout(project, base, "fresh") as fresh:
            assert not stale.exists() and fresh.exists()
            assert os.getpid() == int((fresh / ".dvc/tmp/owner.pid").read_text())
    assert sh(["git", "worktree", "list"], project).stdout.count("\n") == 1


def test_a_checkout_being_made_by_a_live_run_is_not_pruned(project):
    """Two workers start experiments in one project: while one's `git worktree add` fills
    its folder (no owner.pid yet), the other's prune must leave it alone. It removed it
    once, and git failed with "unable to create file src/...: No such file or directory"."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    folder = project / checkout.CHECKOUTS
    making = folder / f"exp-a-{os.getpid()}-1"  # this process, as if mid-checkout
    orphan = folder / f"exp-b-{dead.pid}-1"  # its run was killed before owner.pid
    for path in (making, orphan):
        (path / "src").mkdir(parents=True)
    assert checkout.prune_stale(project) == [orphan]
    assert making.is_dir() and not orphan.exists()
    shutil.rmtree(making)


def test_a_checkout_runs_its_own_code_not_the_workspace_s(tmp_path):
    """An editable install points `import ganpipe` at the user's workspace; a command run in
    a checkout imports the checkout's copy (the code of the commit the run started from)."""
    package = tmp_path / "checkout" / "src" / "ganpipe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    show = [sys.executable, "-c", "import ganpipe; print(ganpipe.__file__)"]
    assert checkout.run(show, tmp_path / "checkout").strip() == str(package / "__init__.py")
    import ganpipe  # this test session's: the workspace's

    assert checkout.run(show, tmp_path).strip() == ganpipe.__file__
