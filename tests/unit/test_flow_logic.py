"""Flow logic that needs no Prefect server and no DVC run: overrides and the params file
they become, errors, retry decisions, the server's credential file, the sweep plan and its
report."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from PIL import Image
from prefect.states import Failed
from ruamel.yaml import YAML

from flows import service
from flows.clone import DvcCommandError
from flows.pipeline import MEASURED_METRICS, retry_only_transient
from flows.sweep import DEFAULT_GRID, plan_runs, validate_runs
from ganpipe import overrides as ov
from ganpipe.params import ParamsError, read_yaml
from reports import ranking as report
from tests.conftest import REPO
from tests.integration.test_flow_tasks import EXACT_VALUES

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
PARAMS = (REPO / "params.yaml").read_text()


@pytest.fixture
def project(tmp_path) -> Path:
    """params.yaml and dvc.yaml of this repository, comments included, committed."""
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(REPO / name, tmp_path / name)
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t"}
    env.update(GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "base"]):
        subprocess.run(["git", *command], cwd=tmp_path, env=env, check=True)
    return tmp_path


def write_dvc_yaml(root: Path, stages: dict) -> Path:
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    return root / "dvc.yaml"


# -- stages ----------------------------------------------------------------------------


def test_measurements_are_no_stage_output_and_the_flows_read_them():
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())
    outputs = [
        str(next(iter(entry)) if isinstance(entry, dict) else entry)
        for body in spec["stages"].values()
        for kind in ("outs", "metrics", "plots")
        for entry in body.get(kind) or []
    ]
    assert "metrics/train/metrics.json" in outputs
    assert not [o for o in outputs if o.startswith(("measurements", "checkpoints"))]
    assert all(name.startswith("measurements/") for name in MEASURED_METRICS)
    drawn = [f for entry in spec["plots"] for p in entry.values() for f in p["y"]]
    assert [f for f in drawn if "perf" in f] == [
        f"measurements/train/plots/metrics/perf/{k}.tsv"
        for k in ("images_per_s", "step_ms", "peak_memory_mb")
    ]


# -- overrides -------------------------------------------------------------------------


def test_overrides_are_validated_and_normalised():
    overrides = {"train.strategy": "g_first_detach", "train.kimg": 1, "seed": 3}
    valid = ov.validate_overrides(PARAMS, overrides)
    assert valid == {"train.strategy": "g_first_detach", "train.kimg": 1.0, "seed": 3}
    assert isinstance(valid["train.kimg"], float)
    assert ov.validate_overrides(PARAMS, None) == {}


@pytest.mark.parametrize("name", ["my run", "-x", "a..b", "x.lock", "dot.", "a/b", "x" * 101])
def test_a_bad_experiment_or_sweep_name_is_refused_by_the_flows_signatures(name):
    from prefect.exceptions import ParameterTypeError

    from flows.pipeline import pipeline
    from flows.sweep import sweep

    with pytest.raises(ParameterTypeError, match="exp_name.*should match pattern"):
        pipeline.validate_parameters({"exp_name": name})
    with pytest.raises(ParameterTypeError, match="sweep_name.*should match pattern"):
        sweep.validate_parameters({"sweep_name": name})
    assert pipeline.validate_parameters({"exp_name": "a-b_9"})["exp_name"] == "a-b_9"


def test_a_quoted_number_in_an_override_is_refused():
    with pytest.raises(ParamsError, match=r"train.kimg: .*\(got '0.5'\); write the number"):
        ov.validate_overrides(PARAMS, {"train.kimg": "0.5"})


def test_a_typo_in_an_override_names_the_key_and_the_fix():
    with pytest.raises(ParamsError) as info:
        ov.validate_overrides(PARAMS, {"train.batch_sise": 8, "precision": "fp8"})
    message = str(info.value)
    assert "train.batch_sise" in message and "Did you mean train.batch_size" in message
    assert "precision" in message and "fp8" in message


def test_an_override_of_a_section_or_inside_a_value_is_refused():
    with pytest.raises(ParamsError, match=r"train: is a section; override single values"):
        ov.validate_overrides(PARAMS, {"train": {"kimg": 1}})
    with pytest.raises(ParamsError, match="seed is a value, not a section"):
        ov.validate_overrides(PARAMS, {"seed.x": 1})
    with pytest.raises(ParamsError, match="dotted params names"):
        ov.validate_overrides(PARAMS, {"train kimg": 1})


def test_cross_section_rules_apply_to_overrides():
    with pytest.raises(ParamsError, match="train.batch_size=63 is not divisible by world size 2"):
        ov.validate_overrides(PARAMS, {"train.batch_size": 63, "devices.nproc_per_node": 2})


def test_write_params_keeps_comments_and_layout(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(PARAMS)
    overrides = {"train.strategy": "g_first_detach", "train.betas": [0.0, 0.99], "data.path": None}
    ov.write_params(path, overrides)
    after = path.read_text()
    assert read_yaml(after) == ov.apply_overrides(read_yaml(PARAMS), overrides)
    assert (
        '  strategy: "g_first_detach" # d_first_retain | d_first_detach | g_first_detach' in after
    )
    assert "  betas: [0.0, 0.99]" in after
    assert "  path: null" in after
    changed = [
        (a, b) for a, b in zip(PARAMS.splitlines(), after.splitlines(), strict=True) if a != b
    ]
    assert len(changed) == 2  # strategy and betas; path was null already


@pytest.mark.parametrize("value", EXACT_VALUES)
def test_any_string_is_written_so_that_every_yaml_reader_gets_it_back(tmp_path, value):
    path = tmp_path / "params.yaml"
    path.write_text("# a comment\ndata:\n  path: null\n")
    ov.write_params(path, {"data.path": value})
    text = path.read_text()
    assert yaml.safe_load(text)["data"]["path"] == value  # PyYAML, YAML 1.1
    assert read_yaml(text)["data"]["path"] == value  # ruamel, YAML 1.2, as DVC reads it
    assert YAML().load(io.StringIO(text))["data"]["path"] == value  # DVC's round trip
    assert "\\u00f1" not in text  # unicode stays readable, not escaped


# -- failures and retries --------------------------------------------------------------


def test_a_stage_error_leads_the_message_and_is_not_transient():
    error = DvcCommandError(["python", "-m", "dvc", "repro", "prepare"], 255, STAGE_OUTPUT)
    lines = str(error).splitlines()
    assert lines[0] == "error: data.path='nope' does not exist; point it at an image folder"
    assert lines[1].startswith("ERROR: failed to reproduce 'prepare'")
    assert not error.transient


def test_a_held_dvc_lock_and_a_killed_process_are_transient():
    from dvc.lock import FAILED_TO_LOCK_MESSAGE  # the text DVC prints, from DVC itself

    assert DvcCommandError(["dvc"], 255, LOCK_OUTPUT).transient
    assert DvcCommandError(["dvc"], 255, FAILED_TO_LOCK_MESSAGE).transient
    killed = DvcCommandError(["dvc", "repro"], -9, "Running stage 'train'")
    assert killed.transient and "killed by SIGKILL" in str(killed)


def test_a_crash_without_error_lines_keeps_the_last_lines():
    tail = "\n".join(f"line {i}" for i in range(30)) + "\nTraceback ...\nKeyError: 'x'"
    message = str(DvcCommandError(["dvc", "repro"], 1, tail))
    assert "KeyError: 'x'" in message and "line 0" not in message


@pytest.mark.parametrize(
    ("error", "retry"),
    [
        (DvcCommandError(["dvc"], 255, LOCK_OUTPUT), True),
        (DvcCommandError(["dvc"], -15, ""), True),
        (DvcCommandError(["dvc"], 255, STAGE_OUTPUT), False),
        (ValueError("bad"), False),
    ],
)
def test_retry_condition_retries_only_transient_errors(error, retry):
    assert retry_only_transient(None, None, Failed(data=error)) is retry


# -- the local server ------------------------------------------------------------------


def test_the_credential_file_is_made_once_and_0600_whatever_existed(tmp_path):
    (tmp_path / "prefect.env").write_text("export OLD=1\n")
    os.chmod(tmp_path / "prefect.env", 0o644)  # copied between machines by hand
    first = service.client_env(tmp_path, 4321)
    user, password = first["PREFECT_API_AUTH_STRING"].split(":")
    assert user == "ganpipe" and len(password) >= 24
    assert (tmp_path / "prefect.env").stat().st_mode & 0o777 == 0o600
    assert tmp_path.stat().st_mode & 0o777 == 0o700
    again = service.client_env(tmp_path, 4322)
    assert again["PREFECT_API_AUTH_STRING"] == first["PREFECT_API_AUTH_STRING"]
    assert service.read_env_file(tmp_path / "prefect.env") == again
    assert again["PREFECT_API_URL"] == "http://127.0.0.1:4322/api"


def test_the_credential_is_never_written_through_a_link_nor_sent_through_a_proxy(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (tmp_path / "prefect.env").symlink_to(victim)
    with pytest.raises(OSError):
        service.client_env(tmp_path, 4321)
    assert victim.read_text() == "mine"
    env = {"PREFECT_API_URL": "http://10.0.0.5:4200/api", "PREFECT_API_AUTH_STRING": "a:b"}
    tools = service.tool_env(env, tmp_path / "state")
    assert "10.0.0.5" in tools["NO_PROXY"].split(",") and tools["no_proxy"] == tools["NO_PROXY"]


def test_the_worker_refuses_to_send_the_credential_to_another_server(tmp_path, monkeypatch):

    monkeypatch.setattr(service, "STATE_DIR", tmp_path)
    service.client_env(tmp_path, 4321)
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:35555/api")
    started = []
    monkeypatch.setattr(service, "start_worker", lambda *a, **k: started.append(a))
    with pytest.raises(RuntimeError, match="is not the server of"):
        service.worker_main(gpu=None, limit=1, name=None)
    assert not started
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4321/api")
    service.worker_main(gpu="0", limit=1, name=None)
    assert started[0][1]["PREFECT_API_URL"] == "http://127.0.0.1:4321/api"


# -- sweep -----------------------------------------------------------------------------


def test_default_grid_is_strategies_by_precision_by_two_seeds():
    planned = plan_runs(DEFAULT_GRID, {}, "sw")
    assert len(planned) == 12
    assert planned["sw-g_first_detach-bf16-1"] == {
        "train.strategy": "g_first_detach",
        "precision": "bf16",
        "seed": 1,
    }
    from prefect.exceptions import ParameterTypeError

    from flows.sweep import sweep

    with pytest.raises(ParameterTypeError, match="grid.seed: List should have at least 1 item"):
        sweep.validate_parameters({"grid": {"seed": []}})
    with pytest.raises(ParameterTypeError, match="grid: Dictionary should have at least 1"):
        sweep.validate_parameters({"grid": {}})


def test_a_bad_combination_stops_the_sweep_before_anything_runs():
    planned = plan_runs({"train.loss": ["bce", "wgan_gp"]}, {}, "sw")
    with pytest.raises(ParamsError) as info:
        validate_runs(PARAMS, planned, {"train.kimg": 1})
    assert "sw-wgan_gp" in str(info.value) and "model.norm" in str(info.value)
    assert "sw-bce:" not in str(info.value)


class FakeClient:
    """A sync Prefect client in a ``with`` block; tests add the calls the sweep makes."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_sweep_keeps_parallel_runs_and_starts_again_only_crashed_or_transient_ones(
    monkeypatch,
):
    import logging
    import types
    import uuid

    from prefect.states import Completed, Crashed, Failed

    from flows import sweep

    ends = {  # experiment -> the final state of each attempt, in order
        "a": [Crashed(message="no heartbeat"), Completed()],
        "b": [Failed(message="error: train.lr_g must be > 0")],
        "c": [Failed(message="Unable to acquire lock"), Crashed(message="lost")],
    }
    runs, started, most = {}, [], [0]

    def start(name, parameters, flow_run_name, timeout, idempotency_key):
        assert name == sweep.EXPERIMENT and timeout == 0
        run_id = uuid.uuid4()
        attempt = len([s for s in started if s[0] == flow_run_name])
        runs[run_id] = types.SimpleNamespace(
            id=run_id, state=ends[flow_run_name][attempt], start_time=None, end_time=None
        )
        started.append((flow_run_name, idempotency_key.rsplit(":", 1)[1]))
        most[0] = max(most[0], len(runs) - len(set(finished)))  # a run read is final
        return runs[run_id]

    finished = []

    class Client(FakeClient):
        def read_flow_runs(self, flow_run_filter):
            finished.extend(flow_run_filter.id.any_)
            return [runs[run_id] for run_id in flow_run_filter.id.any_]

        def read_artifacts(self, artifact_filter):
            return []

    monkeypatch.setattr(sweep, "run_deployment", start)
    monkeypatch.setattr(sweep, "get_client", lambda sync_client: Client())
    monkeypatch.setattr(sweep, "POLL_S", 0)
    found = sweep.run_experiments(
        {n: {"seed": 0} for n in ends}, "abc", 2, 1, logging.getLogger("t")
    )
    assert started == [("a", "1"), ("b", "1"), ("c", "1"), ("a", "2"), ("c", "2")]
    assert most[0] <= 2  # never more than `parallel` unfinished
    assert found["a"]["state"] == "success"
    assert found["b"] == {
        "state": "failed",
        "error": "experiment b failed: error: train.lr_g must be > 0",
    }
    assert found["c"] == {"state": "crashed", "error": "experiment c crashed: lost"}


def test_a_sweep_that_fails_cancels_the_experiments_it_left_running(monkeypatch):
    import logging
    import types
    import uuid

    from prefect.states import Running

    from flows import sweep

    started, cancelled = [], []

    def start(name, parameters, flow_run_name, timeout, idempotency_key):
        started.append(types.SimpleNamespace(id=uuid.uuid4(), state=Running()))
        return started[-1]

    class Client(FakeClient):
        def read_flow_runs(self, flow_run_filter):
            raise RuntimeError("the API went away")

        def set_flow_run_state(self, run_id, state, force):
            cancelled.append((run_id, state.type.value, force))

    monkeypatch.setattr(sweep, "run_deployment", start)
    monkeypatch.setattr(sweep, "get_client", lambda sync_client: Client())
    monkeypatch.setattr(sweep, "POLL_S", 0)
    with pytest.raises(RuntimeError, match="went away"):
        sweep.run_experiments({"a": {}, "b": {}, "c": {}}, "abc", 2, 0, logging.getLogger("t"))
    assert cancelled == [(run.id, "CANCELLING", True) for run in started] and len(started) == 2


@pytest.mark.parametrize("key", sorted(ov.MACHINE_KEYS))
def test_a_caller_cannot_set_what_describes_the_machine(key):
    # e.g. devices.rdzv_endpoint=attacker:29400 would make torchrun unpickle its store
    with pytest.raises(ParamsError, match=rf"{key}: it describes the machine"):
        ov.validate_overrides(PARAMS, {key: "x"})


def test_a_fine_tune_from_outside_the_project_is_refused():
    with pytest.raises(ParamsError, match="'/root/models' is not a folder inside init/"):
        ov.validate_overrides(PARAMS, {"train.init_from": "/root/models"})


def test_grid_points_never_share_a_name_and_a_grid_is_bounded():
    planned = plan_runs({"data.path": ["own/a-b", "own/a_b", "own/a.b"], "seed": [0, 1]}, {}, "s")
    assert len(planned) == 6 and len({tuple(v.items()) for v in planned.values()}) == 6
    long = plan_runs({"seed": [0, 1]}, {}, "x" * 99)
    assert len(long) == 2 and all(len(name) <= 100 for name in long)
    with pytest.raises(ParamsError, match="257 combinations; a sweep runs at most 256"):
        plan_runs({"seed": list(range(257))}, {}, "big")


@pytest.mark.parametrize("path", ["/etc", "../outside", "images/../../x"])
def test_a_data_path_outside_the_project_is_refused(path):
    with pytest.raises(ParamsError, match="must be a folder inside the project"):
        ov.validate_overrides(PARAMS, {"data.source": "folder", "data.path": path})
    valid = ov.validate_overrides(PARAMS, {"data.source": "folder", "data.path": "img"})
    assert valid["data.path"] == "img"


def test_an_int_keyed_map_is_overridden_in_place(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(PARAMS)
    ov.write_params(path, ov.validate_overrides(PARAMS, {"model.g_channels.4": 64}))
    channels = read_yaml(path.read_text())["model"]["g_channels"]
    assert channels[4] == 64 and "4" not in channels


HOSTILE = "x`|\n## injected\n<script>alert(1)</script>|"


def test_callers_strings_cannot_break_out_of_the_reports():
    assert "\n" not in report.code(HOSTILE) and report.code(HOSTILE).count("`") == 2
    planned = {"s-0": {"train.strategy": HOSTILE}}
    found = {"s-0": {"state": "failed", "error": HOSTILE}}
    runs = report.collect_runs(planned, found, HOSTILE)
    text = report.render_markdown("T", runs, ["train.strategy"], HOSTILE, False, {}, None)
    assert not [line for line in text.splitlines() if line.startswith(("## injected", "<"))]
    record = {
        "experiment": "e",
        "commit": "0" * 40,
        "ran_on": {"worker": HOSTILE},
        "stages": {"train": "ran"},
        "overrides": {"data.path": HOSTILE},
        "metrics": {HOSTILE: 1.0},
    }
    assert not [
        line for line in report.run_markdown(record).splitlines() if line.startswith("## inj")
    ]


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
                "measurements/train/metrics.json": {"perf": {"images_per_s": 1000.0 + i}},
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
    assert "| 1 | `b` | 21 | 20 – 22 | 1,002 | 2/2 |" in text
    assert "**Best by mean `fid`: `b`**" in text and "do not overlap" in text
    assert "`perf.step_ms` is not in the training metrics" in text
    assert "![the metric and step cost per setting](p.png)" in text


def test_report_says_when_the_metric_is_missing_instead_of_failing():
    planned, found = sweep_records()
    runs = report.collect_runs(planned, found, "fid_typo")
    text = report.render_markdown("T", runs, ["train.strategy"], "fid_typo", False, {}, None)
    assert "No finished run has the metric `fid_typo`" in text
    assert "nothing is ranked" in text
    assert "| — | `s-a-0` | `a` | `0` | — | 1,000 | success |" in text


def test_report_shows_step_time_and_memory_and_failures():
    planned, found = sweep_records()
    for i, record in enumerate(found.values()):
        record["metrics"]["measurements/train/metrics.json"]["perf"].update(
            step_ms=10.0 + i, peak_memory_mb=100.0
        )
    found["s-a-1"] = exp({}, "failed")
    runs = report.collect_runs(planned, found, "fid", {"s-a-1": "error: boom"})
    text = report.render_markdown("T", runs, ["train.strategy"], "fid", False, {}, None)
    assert "step ms mean" in text and "peak memory MB mean" in text
    assert "| 2 | `a` | 30 | — | 10 | 100 | 1,000 | 1/2 |" in text
    assert "`s-a-1` failed: `error: boom`" in text
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


def with_ruler(found: dict, name: str, extractor: str, val: str = "f" * 64) -> None:
    record = found[name]["metrics"]["metrics/eval/metrics.json"]
    record["ruler"] = {"extractor": "featurenet", "extractor_sha256": extractor, "val_sha256": val}


def test_a_run_measured_with_another_ruler_is_shown_but_never_ranked_or_averaged():
    planned, found = sweep_records()
    for name in found:
        with_ruler(found, name, "a" * 64)
    # s-b-0's FID (the best number) was measured in another feature network
    with_ruler(found, "s-b-0", "b" * 64)
    runs = report.collect_runs(planned, found, "fid")
    assert [r.name for r in runs if r.other_ruler] == ["s-b-0"]
    assert [r.name for r in report.rank_runs(runs)][:3] == ["s-b-1", "s-a-0", "s-a-1"]
    groups = report.group_runs(runs, ["train.strategy"])
    assert groups[0].mean("metric") == 22.0  # s-b-1 alone, not (20 + 22) / 2
    text = report.render_markdown("T", runs, ["train.strategy"], "fid", False, {}, None)
    assert "| — | `s-b-0` | `b` | `0` | 20 (other ruler) |" in text
    assert "Not ranked: `s-b-0` (bbbbbbbbbbbb/ffffffffffff)" in text
    assert "(aaaaaaaaaaaa/ffffffffffff)" in text
    # a forged ruler record cannot add lines or markup: it is shown as hex digits only
    with_ruler(found, "s-b-0", "\n## injected <b>" + "b" * 60)
    runs = report.collect_runs(planned, found, "fid")
    text = report.render_markdown("T", runs, ["train.strategy"], "fid", False, {}, None)
    assert "(???????ec?ed/ffffffffffff)" in text and "injected" not in text


def test_one_ruler_is_named_and_a_run_without_one_is_flagged():
    planned, found = sweep_records()
    for name in found:
        with_ruler(found, name, "a" * 64)
    del found["s-a-1"]["metrics"]["metrics/eval/metrics.json"]["ruler"]
    runs = report.collect_runs(planned, found, "fid")
    assert not any(r.other_ruler for r in runs)
    text = report.render_markdown("T", runs, ["train.strategy"], "fid", False, {}, None)
    assert "Every run was measured with one ruler (feature network / val split: " in text
    assert "`s-a-1` record no ruler" in text


def test_a_runs_table_reads_back_as_its_metrics_and_where_it_ran():
    files = {"metrics/eval/metrics.json": {"fid": 3.5, "ruler": {"featurenet": "a" * 64}}}
    params = {"seed": 1, "train": {"kimg": 2.0, "gpus": [0, 1]}}
    ran_on = {"host": "h", "worker": "w", "cuda_visible_devices": None}
    rows = report.run_rows(files, params, {"seed": 1}, ran_on)
    kinds = {row["key"]: row["kind"] for row in rows}
    assert kinds["seed"] == "param (override)" and kinds["train.kimg"] == "param"
    assert {
        "key": "train.gpus",
        "kind": "param",
        "source": "params.yaml",
        "value": "[0, 1]",
    } in rows
    metrics, where = report.read_run_rows(rows)
    assert metrics == {"metrics/eval/metrics.json": {"fid": 3.5, "ruler.featurenet": "a" * 64}}
    assert where == ran_on


def test_make_serve_s_options_reach_the_service(monkeypatch):
    import sys

    given = {}

    def start(state_dir, **kwargs):
        given.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(service, "start", start)
    argv = ["service", "start", "--crash-after", "120", "--start-within", "900", "--no-worker"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as info:
        service.main()
    assert info.value.code == 2  # the RuntimeError as one error line
    assert given["crash_after_s"] == 120 and given["start_within_s"] == 900
    assert given["local_worker"] is False and given["port"] == 4200 and given["gpu"] is None


def test_an_automation_bound_under_ten_seconds_is_refused_before_anything_starts(
    monkeypatch, capsys
):
    import sys

    monkeypatch.setattr(service, "start", lambda *a, **k: pytest.fail("started"))
    monkeypatch.setattr(sys, "argv", ["service", "start", "--start-within", "5"])
    with pytest.raises(SystemExit) as info:
        service.main()
    assert (
        info.value.code == 2 and "5 s is under the 10 s Prefect allows" in capsys.readouterr().err
    )
