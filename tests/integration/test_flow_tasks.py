"""A flow run's building blocks on real (tiny) git + DVC projects, without Prefect: a fresh
clone, its params, ``dvc exp run`` and ``dvc exp push`` back to the project, its data, and
what a kill leaves behind."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from prefect.states import Failed

from flows import clone
from flows.clone import DvcCommandError
from flows.pipeline import retry_only_transient
from ganpipe.params import ParamsError, read_yaml
from tests.helpers import experiments, sh

#: The stage writes the value it read (PyYAML, YAML 1.1, as a stage would) as JSON.
ECHO = (
    "import json, time, yaml; v = yaml.safe_load(open('params.yaml'))['value']; "
    "time.sleep(float(open('delay').read())); json.dump({'value': v}, open('out.json', 'w'))"
)
#: Fails like our stages do (an ``error:`` line, a non-zero exit) when the value is "boom".
CHECK = (
    "import sys, yaml; v = yaml.safe_load(open('params.yaml'))['value']; "
    "v == 'boom' and sys.exit('error: value=boom is too big; use 2')"
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
    """A committed git + DVC project whose stages write and check its param."""
    stages = {
        "echo": {
            "cmd": f'{sys.executable} -c "{ECHO}"',
            "deps": ["delay"],
            "params": ["value"],
            "outs": ["out.json"],
        },
        "check": {"cmd": f'{sys.executable} -c "{CHECK}"', "params": ["value"]},
    }
    root = tmp_path / "project"
    root.mkdir()
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    (root / "params.yaml").write_text("# the value\nvalue: 0\n")
    (root / "delay").write_text("0")
    sh(["git", "init", "-q", "-b", "main"], root)
    sh([sys.executable, "-m", "dvc", "init", "-q"], root)
    sh([sys.executable, "-m", "dvc", "repro"], root)
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


def fresh_clone(project: Path, commit: str | None = None) -> tuple[Path, bool]:
    """What the deployments' git_clone pull step and the flow's first step make."""
    root = project.parent / f"clone-{time.monotonic_ns()}"
    sh(["git", "clone", "-q", str(project), str(root)], project.parent)
    return root, clone.prepare(root, commit, print)[1]


def make(project: Path, overrides: dict, name: str) -> tuple[Path, dict]:
    root, shared = fresh_clone(project)
    return root, clone.make_experiment(root, name, overrides, shared, print)


def test_an_experiment_is_made_in_a_clone_and_pushed_to_the_project(project):
    before = snapshot(project)
    root, stages = make(project, {"value": 7}, "seven")
    assert stages == {"echo": "ran", "check": "ran"}
    assert snapshot(project) == before  # the workspace is untouched
    assert experiments(project)["seven"]["params"] == {"value": 7}
    assert "seven" in clone.experiment_names(root)
    # `dvc exp apply` restores it from the shared cache, like any DVC experiment
    sh(["dvc", "exp", "apply", "seven"], project)
    assert json.loads((project / "out.json").read_text()) == {"value": 7}
    assert (project / "params.yaml").read_text() == "# the value\nvalue: 7\n"


@pytest.mark.parametrize("link", [".dvc/config.local", ".dvc/tmp", ".dvc"])
def test_a_commit_carrying_dvcs_own_files_as_links_is_refused_before_any_write(project, link):
    """The origin's remotes and credentials are copied into the clone's .dvc/config.local and
    DVC writes its settings, cache and temporaries under .dvc: a commit whose entry there is a
    link (force-added past DVC's .gitignore) would have the run write where it points."""
    secret = "['remote \"store\"']\n    url = https://example.com/store\n    password = hunter2\n"
    victim = project.parent / "victim"
    victim.mkdir()
    (victim / "config.local").write_text("the user's own file\n")
    moved = project / link
    kept = project.parent / "kept"
    if moved.exists():
        moved.rename(kept)
    moved.symlink_to(victim if link != ".dvc/config.local" else victim / "config.local")
    sh(["git", "add", "-f", link], project)
    sh(["git", "commit", "-qm", "a link"], project)
    moved.unlink()
    if kept.exists():
        kept.rename(moved)
    (project / ".dvc" / "config.local").write_text(secret)  # the origin's own, as DVC keeps it
    root = project.parent / "clone"
    sh(["git", "clone", "-q", str(project), str(root)], project.parent)
    assert (root / link).is_symlink()
    with pytest.raises(ParamsError, match=f"carries {link} as a symbolic link") as caught:
        clone.prepare(root, None, print)
    assert f"git rm --cached {link}" in str(caught.value)
    assert (victim / "config.local").read_text() == "the user's own file\n"
    assert sorted(p.name for p in victim.iterdir()) == ["config.local"]


def test_unchanged_stages_come_from_the_shared_run_cache(project):
    root, stages = make(project, {}, "again")
    assert set(stages.values()) == {"cached"}
    assert json.loads((root / "out.json").read_text()) == {"value": 0}


def test_any_string_reaches_the_stage_unchanged(project):
    """One run for the whole table (each DVC run costs seconds); the params file is checked
    value by value in the unit tests."""
    root, _ = make(project, {"value": EXACT_VALUES}, "exact")
    assert (root / "params.yaml").read_text().startswith("# the value\n")
    assert json.loads((root / "out.json").read_text()) == {"value": EXACT_VALUES}
    lock = read_yaml((root / "dvc.lock").read_text())  # YAML 1.2, as DVC reads it
    assert lock["stages"]["echo"]["params"]["params.yaml"]["value"] == EXACT_VALUES


def test_a_run_starts_from_the_commit_it_is_given(project):
    first = sh(["git", "rev-parse", "HEAD"], project).stdout.strip()
    (project / "delay").write_text("0.1")
    sh(["git", "commit", "-qam", "later"], project)
    root, _ = fresh_clone(project, first)
    assert (root / "delay").read_text() == "0"
    with pytest.raises(ParamsError, match="'nope' is not a commit"):
        fresh_clone(project, "nope")
    # an option where the commit goes never reaches git (it ran as a shell command once)
    witness = project.parent / "upload-pack-ran"
    with pytest.raises(ParamsError, match="is no sha, branch or tag"):
        fresh_clone(project, f"--upload-pack=touch {witness};")
    assert not witness.exists()


def test_stages_and_git_never_see_the_workers_credential(project, monkeypatch):
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "ganpipe:secret")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    shown = clone.run(["sh", "-c", "env"], project)
    assert "secret" not in shown and "PREFECT_API_URL" not in shown


def test_failing_stage_raises_its_own_message_and_is_not_retried(project):
    with pytest.raises(DvcCommandError) as info:
        make(project, {"value": "boom"}, "boom")
    assert str(info.value).splitlines()[0] == "error: value=boom is too big; use 2"
    assert "failed to reproduce 'check'" in str(info.value)
    assert not info.value.transient
    assert retry_only_transient(None, None, Failed(data=info.value)) is False
    assert "boom" not in experiments(project)


def test_a_killed_stage_is_a_transient_failure_and_kill_children_cleans_up(project, monkeypatch):
    monkeypatch.setattr(clone, "_stopping", threading.Event())  # set by kill_children
    (project / "delay").write_text("60")
    sh(["git", "commit", "-qam", "slow"], project)
    errors = []

    def run():
        try:
            make(project, {"value": 3}, "slow")
        except DvcCommandError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    started = time.monotonic()
    thread.start()
    deadline = time.monotonic() + 60
    while not (started_procs := [p for p in clone._children if "exp" in p.args]):
        assert time.monotonic() < deadline, "dvc exp run never started"
        time.sleep(0.1)
    time.sleep(2)  # the stage is running
    clone.kill_children()  # what a cancelled flow run does
    thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - started < 60
    assert errors and errors[0].transient
    assert "killed by SIGKILL" in str(errors[0])
    assert retry_only_transient(None, None, Failed(data=errors[0])) is True
    for proc in started_procs:  # the whole process group, stage included, within 10 s
        deadline = time.monotonic() + 10
        with pytest.raises(ProcessLookupError):
            while time.monotonic() < deadline:
                os.killpg(proc.pid, 0)
                time.sleep(0.2)
    with pytest.raises(DvcCommandError, match="being cancelled"):  # nothing new starts
        clone.run(["dvc", "version"], project)


def test_an_image_folder_tracked_by_dvc_reaches_the_run_and_an_untracked_one_is_named(project):
    (project / "images").mkdir()
    (project / "images" / "a.png").write_bytes(b"png")
    sh(["dvc", "add", "-q", "images"], project)
    (project / "loose").mkdir()
    sh(["git", "add", "images.dvc", ".gitignore"], project)
    sh(["git", "commit", "-qm", "own images"], project)
    root, shared = fresh_clone(project)
    assert not (root / "images").exists()
    clone.restore_data(root, {"data": {"source": "folder", "path": "images"}}, shared)
    assert (root / "images" / "a.png").read_bytes() == b"png"
    with pytest.raises(ParamsError, match="'loose' is tracked by neither git nor DVC.*dvc add"):
        clone.restore_data(root, {"data": {"source": "folder", "path": "loose"}}, shared)
    with pytest.raises(ParamsError, match="must be a folder inside the project"):
        clone.restore_data(root, {"data": {"source": "folder", "path": "/etc"}}, shared)


def test_a_clone_runs_its_own_code_not_the_workspace_s(tmp_path):
    """An editable install points `import ganpipe` at the user's workspace; a command run in
    a clone imports the clone's copy (the code of the commit the run started from)."""
    package = tmp_path / "clone" / "src" / "ganpipe"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    show = [sys.executable, "-c", "import ganpipe; print(ganpipe.__file__)"]
    assert clone.run(show, tmp_path / "clone").strip() == str(package / "__init__.py")
    import ganpipe  # this test session's: the workspace's

    assert clone.run(show, tmp_path).strip() == ganpipe.__file__


def test_the_run_removes_its_clone_however_it_ends_and_a_cancel_kills_first(tmp_path, monkeypatch):
    monkeypatch.setattr(clone, "_stopping", threading.Event())  # set by kill_children
    monkeypatch.chdir(tmp_path)

    def made_by_the_pull_step(name: str) -> Path:
        folder = tmp_path / name
        (folder / clone.CLONE_MARK).parent.mkdir(parents=True)
        (folder / clone.CLONE_MARK).touch()
        return folder

    done = made_by_the_pull_step("done")
    with clone.owned(done):  # a run that ends well
        pass
    assert not done.exists() and Path.cwd() == tmp_path
    failed = made_by_the_pull_step("failed")
    with pytest.raises(RuntimeError), clone.owned(failed):
        raise RuntimeError("a stage failed")
    assert not failed.exists() and not clone._stopping.is_set()  # nothing was killed
    project = tmp_path / "project"  # a flow called in a folder no pull step made
    (project / ".git").mkdir(parents=True)
    with clone.owned(project):
        pass
    assert (project / ".git").is_dir()
    cancelled = made_by_the_pull_step("cancelled")

    def run():
        with contextlib.suppress(DvcCommandError):
            clone.run(["sh", "-c", "sleep 60 & sleep 60; true"], cancelled)

    thread = threading.Thread(target=run)
    with pytest.raises(KeyboardInterrupt), clone.owned(cancelled):  # the worker's SIGTERM
        thread.start()
        deadline = time.monotonic() + 10
        while not (sleeper := list(clone._children)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        raise KeyboardInterrupt
    thread.join(timeout=10)
    assert not cancelled.exists() and clone._stopping.is_set()
    deadline = time.monotonic() + 10
    with pytest.raises(ProcessLookupError):  # the shell and its background sleep
        while time.monotonic() < deadline:
            os.killpg(sleeper[0].pid, 0)
            time.sleep(0.2)

    # The worker's SIGTERM inside clone.run, in the main thread, as Prefect's handler raises it:
    # the command being read must still be killed (it went on and wrote into the removed clone).
    interrupted = made_by_the_pull_step("interrupted")
    clone._stopping.clear()  # a new run
    started = []

    def terminate(signum, frame):
        started.extend(clone._children)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, terminate)
    try:
        signal.alarm(2)
        with pytest.raises(KeyboardInterrupt), clone.owned(interrupted):
            clone.run(["sh", "-c", "sleep 60 & sleep 60; true"], interrupted)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert len(started) == 1 and not interrupted.exists() and not clone._children
    with pytest.raises(ProcessLookupError):  # killed, not left running
        os.killpg(started[0].pid, 0)
