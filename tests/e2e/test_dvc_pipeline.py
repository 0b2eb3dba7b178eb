"""Real `dvc repro` and `dvc exp run` in a temporary git clone of this working tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from ganpipe.data.dataset import LmdbImageDataset
from tests.e2e.conftest import NO_TRAIN_METRICS_ARGS, TINY
from tests.helpers import TINY_RESNET, clone_working_tree, sh

pytestmark = pytest.mark.slow

STAGES = {"prepare", "featurenet", "train", "generate", "evaluate"}
#: The resnet family with a few channels per resolution (at the default widths its training
#: costs more than the rest of the module): ``-S`` overrides of the int-keyed maps, merged
#: into params.yaml's.
TINY_RESNET_CHANNELS = tuple(
    arg
    for key in ("g_channels", "d_channels")
    for arg in (
        "-S",
        f"model.{key}={yaml.safe_dump(TINY_RESNET[key], default_flow_style=True)}".strip(),
    )
)


@pytest.fixture
def clone(tmp_path) -> Path:
    """The working tree's tracked and unignored files, committed in a fresh repository."""
    return clone_working_tree(tmp_path / "clone", TINY)


def test_repro_then_nothing_to_do_then_experiment(tiny_baseline, built):
    first = (tiny_baseline.parent / "first-repro.txt").read_text()
    for stage in STAGES:
        assert f"Running stage '{stage}'" in first
    assert len(LmdbImageDataset(tiny_baseline / "data/train.lmdb")) == 1617
    grid, strip = tiny_baseline / "samples/grid.png", tiny_baseline / "samples/interpolation.png"
    assert Image.open(grid).size == (2 * 34 + 2, 2 * 34 + 2)
    assert Image.open(strip).size == (3 * 34 + 2, 2 * 34 + 2)
    assert sorted(p.name for p in (tiny_baseline / "samples/images").iterdir()) == [
        f"{i:06d}.png" for i in range(4)
    ]
    assert json.loads((tiny_baseline / "metrics/train/metrics.json").read_text())["step"] == 128
    lock = yaml.safe_load((tiny_baseline / "dvc.lock").read_text())
    assert set(lock["stages"]) == STAGES

    clone = built  # a copy, without DVC's state database: every file is hashed again
    again = sh(["dvc", "repro"], clone)
    assert "Running stage" not in again.stdout
    assert "Data and pipelines are up to date" in again.stdout
    assert "up to date" in sh(["dvc", "status"], clone).stdout

    # a narrower feature network: every stage runs again at 16 px, for less
    small = ["-S", "data.image_size=16", "-S", "featurenet.width=4", *NO_TRAIN_METRICS_ARGS]
    sh(["dvc", "exp", "run", *small, "--name", "small"], clone)
    shown = json.loads(sh(["dvc", "exp", "show", "--json"], clone).stdout)
    sizes, scores = {}, {}
    for commit in shown:
        for exp in commit.get("experiments") or []:
            for revision in exp["revs"]:
                params = revision["data"]["params"]["params.yaml"]["data"]
                sizes[revision.get("name")] = params["data"]["image_size"]
                metrics = revision["data"]["metrics"]
                scores[revision.get("name")] = metrics["metrics/eval/metrics.json"]["data"]
    assert sizes.get("small") == 16, shown
    assert {"fid", "kid", "precision", "recall"} <= scores["small"].keys()
    assert all(isinstance(scores["small"][k], float) for k in ("fid", "kid", "recall"))
    assert Image.open(clone / "samples/grid.png").size == (2 * 18 + 2, 2 * 18 + 2)


def test_experiment_with_bad_value_fails_naming_the_key(clone):
    result = sh(
        ["dvc", "exp", "run", "-S", "train.batch_size=0", "-S", "model.norm=group"],
        clone,
        check=False,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "train.batch_size" in output and "model.norm" in output
    # every stage validates the whole file first: prepare already refused, nothing was built
    assert "Traceback" not in output
    assert not (clone / "data/train.lmdb").exists()
    assert not list(clone.glob("models/*.pt"))


def test_experiments_for_every_strategy_and_loss(built):
    clone = built
    # Another training seed and strategy: the same ruler (split and feature network), so
    # only the stages downstream of training run, and both evaluations name the same ruler.
    # (The seed rides along with the first strategy: one `dvc exp run` fewer.)
    before = json.loads((clone / "metrics/eval/metrics.json").read_text())
    first = ("s-retain", ["-S", "seed=2", "-S", "train.strategy=d_first_retain"])
    result = sh(["dvc", "exp", "run", "--name", first[0], *first[1], *NO_TRAIN_METRICS_ARGS], clone)
    ran = {stage for stage in STAGES if f"Running stage '{stage}'" in result.stdout}
    assert ran == {"train", "generate", "evaluate"}, result.stdout
    after = json.loads((clone / "metrics/eval/metrics.json").read_text())
    assert after["ruler"] == before["ruler"]
    assert set(after["ruler"]) == {"extractor", "extractor_sha256", "val_sha256"}
    assert after["fid"] != before["fid"]  # another generator, measured in the same space
    runs = [
        ("s-gfirst", ["-S", "seed=2", "-S", "train.strategy=g_first_detach"]),
        (
            "l-hinge-r1",
            [
                *("-S", "train.loss=hinge", "-S", "train.r1_gamma=1.0"),
                *("-S", "model.norm=spectral", "-S", "precision=bf16"),
            ],
        ),
        (
            "l-wgan",
            ["-S", "train.loss=wgan_gp", "-S", "train.n_critic=2", "-S", "model.norm=layer"],
        ),
        (
            "c-resnet",
            [
                *("-S", "model.arch=resnet", "-S", "model.conditional=true"),
                *("-S", "train.augment=color+translation+cutout"),
                *TINY_RESNET_CHANNELS,
            ],
        ),
    ]
    for name, overrides in runs:
        result = sh(
            ["dvc", "exp", "run", "--name", name, *overrides, *NO_TRAIN_METRICS_ARGS], clone
        )
        assert "Running stage 'train'" in result.stdout
        assert "Running stage 'prepare'" not in result.stdout  # data unchanged: cached
        assert "Running stage 'featurenet'" not in result.stdout  # same feature space
    # the workspace holds the last experiment's outputs: a conditional model's samples are
    # exported per class and its evaluation judges them per class
    evaluated = json.loads((clone / "metrics/eval/metrics.json").read_text())
    assert 0 <= evaluated["class_accuracy"] <= 1
    assert sorted(evaluated["fid_per_class"], key=int) == [str(c) for c in range(10)]
    exported = sorted(
        p.relative_to(clone / "samples/images") for p in clone.glob("samples/images/*/*.png")
    )
    assert [str(p.parent) for p in exported] == sorted(str(i % 10) for i in range(len(exported)))
    shown = json.loads(sh(["dvc", "exp", "show", "--json"], clone).stdout)
    found = {}
    for commit in shown:
        for exp in commit.get("experiments") or []:
            for revision in exp["revs"]:
                metrics = revision["data"]["metrics"]
                found[revision.get("name")] = {
                    **metrics["metrics/train/metrics.json"]["data"]["loss"],
                    "fid": metrics["metrics/eval/metrics.json"]["data"]["fid"],
                }
    assert set(found) >= {name for name, _ in [first, *runs]}
    assert all(all(isinstance(v, float) for v in row.values()) for row in found.values())
    # d_first_retain and g_first_detach make the same G updates (README), so the second of
    # them finds g_ema.pt unchanged and DVC reuses the evaluation; the others differ.
    fids = {name: row["fid"] for name, row in found.items()}
    assert fids["s-retain"] == fids["s-gfirst"]
    assert len({fids[name] for name in ("s-retain", "l-hinge-r1", "l-wgan")}) == 3


def test_experiment_with_two_processes(built):
    """Two training processes: featurenet and generate run one process and depend on the
    device keys alone, so featurenet does not run again (the stages DVC ran say so) and the
    evaluation names the same ruler."""
    clone = built
    before = json.loads((clone / "metrics/eval/metrics.json").read_text())
    result = sh(
        [
            "dvc",
            "exp",
            "run",
            "--name",
            "ddp",
            "-S",
            "devices.nproc_per_node=2",
            "-S",
            "model.norm=instance",
            *NO_TRAIN_METRICS_ARGS,
        ],
        clone,
    )
    assert "rank 1/2 joined (gloo on cpu)" in result.stdout + result.stderr
    ran = {stage for stage in STAGES if f"Running stage '{stage}'" in result.stdout}
    assert ran == {"train", "generate", "evaluate"}, result.stdout  # generate: a new g_ema
    after = json.loads((clone / "metrics/eval/metrics.json").read_text())
    assert after["ruler"] == before["ruler"]
    assert (clone / "models/g_ema.pt").exists()
    assert "up to date" in sh(["dvc", "status"], clone).stdout


def test_dvc_repro_after_a_kill_resumes(built):
    import shutil
    import signal
    import time

    # From the built pipeline: only train and what follows it run. Without the baseline's
    # checkpoints (not outputs: a longer run would resume from its last one).
    clone = built
    shutil.rmtree(clone / "checkpoints")
    params = yaml.safe_load((clone / "params.yaml").read_text())
    # killed at the first checkpoint, two thirds of the training still to run
    params["train"].update(kimg=0.96, checkpoint_kimg=0.32, log_every_kimg=0.32)
    (clone / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen(
        ["dvc", "repro"],
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not list(clone.glob("checkpoints/*/ckpt-*.pt")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert not (clone / "models/g_ema.pt").exists()
    again = sh(["dvc", "repro"], clone)
    output = again.stdout + again.stderr
    assert "resumed from checkpoints/" in output, output[-3000:]
    assert (clone / "models/g_ema.pt").exists()
