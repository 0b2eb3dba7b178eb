"""Flow logic that needs no Prefect server and no DVC run: overrides, stage order, errors,
retry decisions, the sweep plan and its report (tasks called through ``task.fn()``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from PIL import Image
from prefect.states import Failed

from flows import report, sweep, workspace
from flows.pipeline import _parse_set, check_overrides, retry_only_transient
from flows.serve import parse_schedule
from flows.sweep import DEFAULT_GRID, plan_runs, validate_runs
from flows.workspace import DvcCommandError
from ganpipe.params import ParamsError
from tests.conftest import REPO

LOCK_OUTPUT = (
    "ERROR: Unable to acquire lock. Most likely another DVC process is running or was "
    "terminated abruptly. Check the page <https://dvc.org/doc/user-guide/troubleshooting"
    "#lock-issue> for other possible reasons and to learn how to resolve this."
)
STAGE_OUTPUT = """Running stage 'prepare':
> python -m stages.prepare
error: data.path='nope' does not exist; point it at an image folder
ERROR: failed to reproduce 'prepare': failed to run: python -m stages.prepare, exited with 2
"""


@pytest.fixture
def project(tmp_path) -> Path:
    """params.yaml and dvc.yaml of this repository, comments included."""
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def write_dvc_yaml(root: Path, stages: dict) -> Path:
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    return root / "dvc.yaml"


# -- stages ----------------------------------------------------------------------------


def test_stage_names_of_this_repository_are_upstream_first():
    names = workspace.stage_names(REPO / "dvc.yaml")
    assert names[0] == "prepare"
    assert names.index("train") < names.index("generate")
    assert set(names) == set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])


def test_stage_names_follow_dependencies_not_file_order(tmp_path):
    path = write_dvc_yaml(
        tmp_path,
        {
            "report": {"cmd": "r", "deps": ["metrics/eval/metrics.json", "samples"]},
            "evaluate": {
                "cmd": "e",
                "deps": ["models/g.pt"],
                "metrics": ["metrics/eval/metrics.json"],
            },
            "generate": {"cmd": "g", "deps": ["models/g.pt"], "outs": ["samples"]},
            "train": {
                "cmd": "t",
                "deps": ["data/train"],
                "outs": [{"models/g.pt": {"cache": True}}],
            },
            "prepare": {"cmd": "p", "outs": ["data/train"]},
        },
    )
    assert workspace.stage_names(path) == ["prepare", "train", "evaluate", "generate", "report"]


def test_stage_names_refuse_a_cycle_and_an_empty_file(tmp_path):
    path = write_dvc_yaml(
        tmp_path,
        {
            "a": {"cmd": "a", "deps": ["y"], "outs": ["x"]},
            "b": {"cmd": "b", "deps": ["x"], "outs": ["y"]},
        },
    )
    with pytest.raises(ValueError, match="depend on each other"):
        workspace.stage_names(path)
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    with pytest.raises(ValueError, match="defines no stages"):
        workspace.stage_names(tmp_path / "dvc.yaml")


def test_stage_outputs_list_samples_and_metrics():
    outputs = workspace.stage_outputs(REPO / "dvc.yaml")
    assert "samples/grid.png" in outputs
    assert "metrics/train/metrics.json" in outputs


# -- overrides -------------------------------------------------------------------------


def test_overrides_are_validated_and_normalised(project):
    valid = check_overrides.fn(
        str(project), {"train.strategy": "g_first_detach", "train.kimg": 1, "seed": 3}, None
    )
    assert valid == {"train.strategy": "g_first_detach", "train.kimg": 1.0, "seed": 3}
    assert isinstance(valid["train.kimg"], float)
    assert check_overrides.fn(str(project), None, None) == {}


@pytest.mark.parametrize("name", ["my run", "-x", "a..b", "x.lock", "dot.", "a/b"])
def test_a_bad_experiment_name_is_refused_before_any_stage(project, name):
    with pytest.raises(ValueError, match="is not a valid experiment name"):
        check_overrides.fn(str(project), {}, name)


def test_command_line_overrides_are_read_as_dvc_reads_them():
    # `--set train.lr_g=1e-3` is a number, as in `dvc exp run -S train.lr_g=1e-3`.
    assert _parse_set("train.lr_g=1e-3") == ("train.lr_g", 0.001)
    assert _parse_set("train.strategy=g_first_detach") == ("train.strategy", "g_first_detach")
    assert _parse_set("devices.gpus=[0, 1]") == ("devices.gpus", [0, 1])


def test_a_quoted_number_in_an_override_is_refused(project):
    with pytest.raises(ParamsError, match=r"train.kimg: .*\(got '0.5'\); write the number"):
        workspace.validate_overrides(project, {"train.kimg": "0.5"})


def test_a_typo_in_an_override_names_the_key_and_the_fix(project):
    with pytest.raises(ParamsError) as info:
        workspace.validate_overrides(project, {"train.batch_sise": 8, "precision": "fp8"})
    message = str(info.value)
    assert "train.batch_sise" in message and "Did you mean train.batch_size" in message
    assert "precision" in message and "fp8" in message


def test_an_override_of_a_section_or_inside_a_value_is_refused(project):
    with pytest.raises(ParamsError, match=r"train: is a section; override single values"):
        workspace.validate_overrides(project, {"train": {"kimg": 1}})
    with pytest.raises(ParamsError, match="seed is a value, not a section"):
        workspace.validate_overrides(project, {"seed.x": 1})
    with pytest.raises(ParamsError, match="dotted params names"):
        workspace.validate_overrides(project, {"train kimg": 1})


def test_cross_section_rules_apply_to_overrides(project):
    with pytest.raises(ParamsError, match="train.batch_size=63 is not divisible by world size 2"):
        workspace.validate_overrides(project, {"train.batch_size": 63, "devices.nproc_per_node": 2})


def test_write_overrides_keeps_comments_and_layout(project):
    before = (project / "params.yaml").read_text()
    overrides = {"train.strategy": "g_first_detach", "train.betas": [0.0, 0.99], "data.path": None}
    workspace.write_overrides(project, overrides)
    after = (project / "params.yaml").read_text()
    assert yaml.safe_load(after) == workspace.apply_overrides(yaml.safe_load(before), overrides)
    assert (
        "  strategy: g_first_detach   # d_first_retain | d_first_detach | g_first_detach" in after
    )
    assert "  betas: [0.0, 0.99]" in after
    assert "  path: null" in after
    changed = [
        (a, b) for a, b in zip(before.splitlines(), after.splitlines(), strict=True) if a != b
    ]
    assert len(changed) == 2  # strategy and betas; path was null already


def test_set_args_are_read_back_by_dvc_grammar():
    assert workspace.set_args({"train.strategy": "g_first_detach", "train.betas": [0.5, 0.9]}) == [
        "-S",
        'train.strategy="g_first_detach"',
        "-S",
        "train.betas=[0.5, 0.9]",
    ]


# -- failures and retries --------------------------------------------------------------


def test_a_stage_error_leads_the_message_and_is_not_transient():
    error = DvcCommandError(["python", "-m", "dvc", "repro", "prepare"], 255, STAGE_OUTPUT, False)
    lines = str(error).splitlines()
    assert lines[0] == "error: data.path='nope' does not exist; point it at an image folder"
    assert lines[1].startswith("ERROR: failed to reproduce 'prepare'")
    assert not workspace.is_transient(STAGE_OUTPUT)


def test_a_held_dvc_lock_is_transient():
    assert workspace.is_transient(LOCK_OUTPUT)
    # the text DVC prints, from DVC itself
    from dvc.lock import FAILED_TO_LOCK_MESSAGE

    assert workspace.is_transient(FAILED_TO_LOCK_MESSAGE)


def test_a_crash_without_error_lines_keeps_the_last_lines():
    tail = "\n".join(f"line {i}" for i in range(30)) + "\nTraceback ...\nKeyError: 'x'"
    message = workspace.failure_message(["dvc", "repro"], 1, tail)
    assert "KeyError: 'x'" in message and "line 0" not in message


@pytest.mark.parametrize(
    ("error", "retry"),
    [
        (DvcCommandError(["dvc"], 255, LOCK_OUTPUT, True), True),
        (DvcCommandError(["dvc"], 255, STAGE_OUTPUT, False), False),
        (ValueError("bad"), False),
    ],
)
def test_retry_condition_retries_only_transient_errors(error, retry):
    assert retry_only_transient(None, None, Failed(data=error)) is retry


def test_workspace_lock_makes_a_second_flow_wait_then_time_out(tmp_path):
    (tmp_path / ".dvc").mkdir()
    messages: list[str] = []
    with workspace.workspace_lock(tmp_path, 1.0):
        failure: list[BaseException] = []

        def second():
            try:
                with workspace.workspace_lock(tmp_path, 0.5, messages.append):
                    pass
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=second)
        thread.start()
        thread.join()
    assert isinstance(failure[0], TimeoutError) and "lock_timeout_s" in str(failure[0])
    assert messages and "workspace busy (pid" in messages[0]
    with workspace.workspace_lock(tmp_path, 0.5):  # free again
        pass


# -- schedules -------------------------------------------------------------------------


def test_schedules_parse_cron_interval_and_off():
    assert parse_schedule("0 2 * * *", "UTC").cron == "0 2 * * *"
    assert parse_schedule("90", "UTC").interval.total_seconds() == 90
    assert parse_schedule("off", "UTC") is None
    with pytest.raises(ValueError, match="5-field cron"):
        parse_schedule("nightly", "UTC")


# -- sweep -----------------------------------------------------------------------------


def test_default_grid_is_strategies_by_precision_by_two_seeds():
    planned = plan_runs(DEFAULT_GRID, {}, "sw")
    assert len(planned) == 12
    assert planned["sw-g_first_detach-bf16-1"] == {
        "train.strategy": "g_first_detach",
        "precision": "bf16",
        "seed": 1,
    }
    with pytest.raises(ValueError, match="non-empty lists; fix seed"):
        plan_runs({"seed": []}, {}, "sw")


def test_a_bad_combination_stops_the_sweep_before_queueing(project):
    planned = plan_runs({"train.loss": ["bce", "wgan_gp"]}, {}, "sw")
    with pytest.raises(ValueError) as info:
        validate_runs.fn(str(project), planned, {"train.kimg": 1})
    assert "sw-wgan_gp" in str(info.value) and "model.norm" in str(info.value)
    assert "sw-bce:" not in str(info.value)


# `dvc queue status` of DVC 3.67 after a worker lost r2-a and it was queued again
QUEUE_STATUS = """Task     Name    Created    Status
21fe2a0  r2-a    06:02 PM   Queued
367498f  r2-a    06:00 PM   Failed
c014440  r2-b    06:00 PM   Success
9a0b1c2  r3-x    Nov 21     Running
07079ea  r0-a    05:58 PM   Failed

Worker status: 0 active, 0 idle
"""


def test_queue_status_is_read_per_name_and_a_requeued_name_is_pending():
    assert workspace.queue_states(QUEUE_STATUS) == {
        "r2-a": "queued",
        "r2-b": "success",
        "r3-x": "running",
        "r0-a": "failed",
    }


def test_exp_show_keeps_the_later_run_of_a_requeued_name():
    def rev(name, error=None):
        return {"name": name, "rev": name, "data": {}, "error": error}

    lost = {"revs": [rev("r2-a", {"msg": "lost"})], "executor": {"state": "failed"}}
    again = {"revs": [rev("r2-a")], "executor": None}
    for order in ([again, lost], [lost, again]):
        found = workspace.experiments([{"experiments": order}])
        assert found["r2-a"]["state"] == "success", order


def test_queue_workers_are_counted_from_their_pid_files(tmp_path):
    celery = tmp_path / ".dvc" / "tmp" / "exps" / "celery"
    celery.mkdir(parents=True)
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "exp", "queue-worker", "w1"]
    )
    try:
        (celery / "dvc-exp-worker-1.pid").write_text(str(worker.pid))
        (celery / "dvc-exp-worker-2.pid").write_text(str(os.getpid()))  # not a worker
        (celery / "dvc-exp-worker-3.pid").write_text("999999999")  # gone
        assert workspace.queue_workers_alive(tmp_path) == 1
    finally:
        worker.kill()
        worker.wait()
    assert workspace.queue_workers_alive(tmp_path) == 0
    assert workspace.queue_workers_alive(tmp_path / "no-project") == 0


def test_a_dvc_command_that_never_answers_is_killed_with_what_it_started(tmp_path, monkeypatch):
    """A hung `dvc exp show` must not hang the sweep: it is killed, children included."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nsleep 60 &\necho $! > {tmp_path}/child\nsleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setattr(workspace.sys, "executable", str(fake))
    started = time.monotonic()
    with pytest.raises(DvcCommandError) as info:
        workspace.dvc_output(["exp", "show", "--json"], tmp_path, timeout_s=1)
    assert time.monotonic() - started < 10
    assert info.value.transient and info.value.returncode is None
    assert "no answer after 1 s" in str(info.value)
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 5
    while (
        Path(f"/proc/{child}").exists() and b"sleep" in Path(f"/proc/{child}/cmdline").read_bytes()
    ):
        assert time.monotonic() < deadline, "the command's own child still runs"
        time.sleep(0.05)


def test_experiments_lost_again_and_again_stop_the_sweep(tmp_path, monkeypatch):
    """No worker ever runs r-a: it is queued again MAX_REQUEUES times, then the sweep fails."""
    calls = []
    monkeypatch.setattr(sweep, "NO_WORKER_GRACE_S", 0.0)
    monkeypatch.setattr(workspace, "dvc_output", lambda *a, **k: "abc1234  r-a  06:00 PM  Running")
    monkeypatch.setattr(workspace, "queue_workers_alive", lambda root: 0)
    monkeypatch.setattr(sweep, "requeue", lambda root, lost, timeout: calls.append(sorted(lost)))
    monkeypatch.setattr(sweep.start_workers, "fn", lambda project, jobs: calls.append(jobs))
    with pytest.raises(RuntimeError, match="lost r-a again after 2 new start"):
        sweep.wait_for.fn(str(tmp_path), {"r-a": {"seed": 1}}, 3, 0.0, 60.0, 1.0)
    assert calls == [["r-a"], 3, ["r-a"], 3]


def exp(metrics: dict, state: str = "success") -> dict:
    return {"metrics": metrics, "state": state, "error": None}


def sweep_records() -> tuple[dict, dict]:
    planned = {
        f"s-{strategy}-{seed}": {"train.strategy": strategy, "seed": seed}
        for strategy in ("a", "b")
        for seed in (0, 1)
    }
    fid = {"s-a-0": 30.0, "s-a-1": 34.0, "s-b-0": 20.0, "s-b-1": 22.0}
    found = {
        name: exp(
            {
                "metrics/train/metrics.json": {"perf": {"images_per_s": 1000.0 + i}},
                "metrics/eval/metrics.json": {"fid": value, "kid": 0.1},
            }
        )
        for i, (name, value) in enumerate(fid.items())
    }
    return planned, found


def test_report_ranks_by_fid_and_groups_over_seeds(tmp_path):
    planned, found = sweep_records()
    runs = report.collect_runs(planned, found, "fid")
    assert [r.name for r in report.rank_runs(runs)] == ["s-b-0", "s-b-1", "s-a-0", "s-a-1"]
    groups = report.group_runs(runs, ["train.strategy"])
    assert [g.settings["train.strategy"] for g in groups] == ["b", "a"]
    assert groups[0].mean("metric") == 21.0
    text = report.render_markdown("T", runs, ["train.strategy"], "fid", False, {}, "p.png")
    assert "| 1 | b | 21 | 20 – 22 | 1,002 | 2/2 |" in text
    assert "**Best by mean `fid`: b**" in text and "do not overlap" in text
    assert "`perf.step_ms` is not in the training metrics" in text
    assert "![fid and step cost per setting](p.png)" in text


def test_report_says_when_the_metric_is_missing_instead_of_failing():
    planned, found = sweep_records()
    runs = report.collect_runs(planned, found, "fid_typo")
    text = report.render_markdown("T", runs, ["train.strategy"], "fid_typo", False, {}, None)
    assert "No finished run has the metric `fid_typo`" in text
    assert "nothing is ranked" in text
    assert "| — | `s-a-0` | a | 0 | — | 1,000 | success |" in text


def test_report_shows_step_time_and_memory_and_failures():
    planned, found = sweep_records()
    for i, record in enumerate(found.values()):
        record["metrics"]["metrics/train/metrics.json"]["perf"].update(
            step_ms=10.0 + i, peak_memory_mb=100.0
        )
    found["s-a-1"] = exp({}, "failed")
    runs = report.collect_runs(planned, found, "fid", {"s-a-1": "error: boom"})
    text = report.render_markdown("T", runs, ["train.strategy"], "fid", False, {}, None)
    assert "step ms mean" in text and "peak memory MB mean" in text
    assert "| 2 | a | 30 | — | 10 | 100 | 1,000 | 1/2 |" in text
    assert "`s-a-1` failed: error: boom" in text
    assert "One of them has a single run" in text


def test_overlapping_seed_ranges_are_called_noise():
    planned, found = sweep_records()
    found["s-b-1"]["metrics"]["metrics/eval/metrics.json"]["fid"] = 31.0
    runs = report.collect_runs(planned, found, "fid")
    groups = report.group_runs(runs, ["train.strategy"])
    assert "within seed noise" in report.verdict(groups, "fid", False)
    higher = report.group_runs(runs, ["train.strategy"], higher_is_better=True)
    assert higher[0].settings["train.strategy"] == "a"


def test_plot_is_a_png_with_one_panel_per_measure(tmp_path):
    planned, found = sweep_records()
    groups = report.group_runs(report.collect_runs(planned, found, "fid"), ["train.strategy"])
    path = report.draw_plot(tmp_path / "r.png", groups, [("metric", "fid"), ("images_per_s", "x")])
    with Image.open(path) as image:
        assert image.format == "PNG"
        assert image.height == 2 * (34 + 26 * 2 + 34)
        # some pixels are drawn in the dot colour
        assert (30, 80, 160) in {
            image.getpixel((x, y)) for x in range(image.width) for y in range(image.height)
        }
