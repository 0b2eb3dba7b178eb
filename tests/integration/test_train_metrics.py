"""FID and KID while training (train.metrics_kimg): the curve, the best snapshot, exact resume."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from ganpipe import checkpoint, loop, runtime
from ganpipe.checkpoint import load
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.store import read_meta
from ganpipe.params import parse_params
from ganpipe.trainmetrics import BEST_FID, BEST_KIMG, FID, KID, Ruler
from tests.helpers import Recorder, run_stage, write_project
from tests.integration import test_resume
from tests.integration.test_resume import finish, kill_group, logged_values, newest, start

# One worker runs the feature network and the measured run once (module fixtures).
pytestmark = pytest.mark.xdist_group("train_metrics")

#: test_resume's tiny DCGAN on the digits at 16 px, trained for 9.6 kimg at a high learning
#: rate (its FID falls within seconds of training), measured every 0.96 kimg (10 points) on
#: 200 samples against the 898 val images; a checkpoint at every second point.
RUN = {
    **test_resume.RUN,
    "train": {
        **test_resume.RUN["train"],
        "kimg": 9.6,
        "lr_g": 1e-3,
        "lr_d": 1e-3,
        "checkpoint_kimg": 1.92,
        "keep_checkpoints": 100,
        "log_every_kimg": 0.96,
        "metrics_kimg": 0.96,
        "metrics_num_samples": 200,
    },
    "featurenet": {"width": 16, "epochs": 3},
    "eval": {"num_samples": 200, "kid_subsets": 10, "kid_subset_size": 50, "batch_size": 100},
}
MODELS = ("generator", "discriminator", "g_ema", "g_ema_best")
POINTS = [960 * i for i in range(1, 11)]


@pytest.fixture(scope="module")
def featurenet(tmp_path_factory, digits16) -> Path:
    """models/ of a project where the featurenet stage ran (the ruler of every test here)."""
    root = write_project(tmp_path_factory.mktemp("featurenet"), RUN, digits16)
    result = run_stage(root, "featurenet")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "models"


@pytest.fixture(scope="module")
def measured_run(tmp_path_factory, digits16, featurenet) -> tuple[Path, float]:
    """A project where the train stage ran RUN to the end, measuring as it went, and how
    long that took (s): read-only for the tests that share it."""
    root = project(tmp_path_factory.mktemp("measured") / "p", digits16, featurenet)
    began = time.monotonic()
    finish(start(root))
    return root, time.monotonic() - began


def project(root: Path, data_dir: Path, featurenet: Path, **sections) -> Path:
    write_project(root, RUN, data_dir, **sections)
    (root / "models").mkdir(exist_ok=True)
    for name in ("featurenet.pt", "featurenet.sha256"):
        shutil.copy2(featurenet / name, root / "models" / name)
    return root


def curve(root: Path, name: str) -> list[tuple[int, float]]:
    """``(images seen, value)`` rows of a logged curve."""
    tsv = root / "metrics" / "train" / "plots" / "metrics" / f"{name}.tsv"
    header, *rows = [line.split("\t") for line in tsv.read_text().splitlines()]
    step, value = header.index("step"), header.index(Path(name).name)
    return [(int(row[step]), float(row[value])) for row in rows]


def summary(root: Path) -> dict:
    return json.loads((root / "metrics" / "train" / "metrics.json").read_text())


def tensors_digest(state_dict: dict) -> str:
    h = hashlib.sha256()
    for key, tensor in state_dict.items():
        h.update(key.encode() + tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


def digest(root: Path) -> dict[str, str]:
    return {n: tensors_digest(load(root / "models" / f"{n}.pt")["state_dict"]) for n in MODELS}


def test_the_fid_curve_falls_and_the_best_snapshot_is_its_lowest_point(
    tmp_path, digits16, featurenet, measured_run
):
    root = shutil.copytree(measured_run[0], tmp_path / "on", symlinks=True)
    fid, kid = curve(root, "metrics/fid"), curve(root, "metrics/kid")
    assert [seen for seen, _ in fid] == [seen for seen, _ in kid] == POINTS
    assert fid[0][1] > fid[-1][1], fid  # 0.96 kimg of training against 9.6
    best_seen, best_fid = min(fid, key=lambda point: point[1])  # the earlier point on a tie
    record = summary(root)
    assert record["best"] == {"kimg": best_seen / 1000, "fid": best_fid}
    assert record["metrics"] == {"fid": fid[-1][1], "kid": kid[-1][1]}
    val_sha256 = read_meta(digits16 / "val.lmdb")["content_sha256"]
    extractor_sha256 = (featurenet / "featurenet.sha256").read_text().split()[0]
    assert record["ruler"] == {
        "extractor": "featurenet",
        "extractor_sha256": extractor_sha256,
        "val_sha256": val_sha256,
    }
    assert not (root / "metrics/train/plots/metrics/best").exists()  # values, not curves

    # models/g_ema_best.pt: the EMA of the checkpoint taken at the lowest point, in the
    # model-file format of g_ema.pt
    (run_dir,) = (root / "checkpoints").iterdir()
    at_best = checkpoint.read_checkpoint(run_dir / checkpoint.checkpoint_name(best_seen))
    ema = {k.removeprefix("module."): v for k, v in at_best["g_ema"].items()}
    best, final = load(root / "models/g_ema_best.pt"), load(root / "models/g_ema.pt")
    assert tensors_digest(best.pop("state_dict")) == tensors_digest(ema)
    final.pop("state_dict")
    assert best == final

    # Measured as the evaluate stage measures: with as many samples, the last point is its FID.
    result = run_stage(root, "evaluate")
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = json.loads((root / "metrics/eval/metrics.json").read_text())
    assert (evaluated["fid"], evaluated["kid"]) == (fid[-1][1], kid[-1][1])

    # The metrics draw from no training RNG: without them, the same trained bytes and log.
    off = project(tmp_path / "off", digits16, featurenet, train={"metrics_kimg": 0})
    finish(start(off))
    without = digest(off)
    assert without["g_ema_best"] == without["g_ema"]  # nothing measured: the final EMA
    assert {n: without[n] for n in MODELS[:3]} == {n: digest(root)[n] for n in MODELS[:3]}
    logged = logged_values(root)
    assert {k: v for k, v in logged.items() if not k.startswith("metrics/")} == logged_values(off)
    assert "best" not in summary(off) and "ruler" not in summary(off)


@pytest.mark.slow
def test_killed_and_resumed_it_ends_with_the_bytes_of_an_uninterrupted_run(
    tmp_path, digits16, featurenet, measured_run
):
    """Checkpoints every second point: a kill between them measures a point again."""
    reference, duration = measured_run
    root = project(tmp_path / "killed", digits16, featurenet)
    rng = random.Random(26)
    for attempt in range(3):
        before = newest(root)
        proc = start(root)
        while proc.poll() is None and newest(root) == before:
            time.sleep(0.005)
        assert proc.poll() is None, f"the run finished before kill {attempt + 1}"
        # Within about half a checkpoint interval (5 intervals and a start make `duration`):
        # each kill falls before the next checkpoint, so the run is never over by the third.
        time.sleep(rng.uniform(0.0, duration / 10))
        kill_group(proc)
    err = finish(start(root))
    assert "resumed from" in err
    assert digest(root) == digest(reference)
    assert logged_values(root) == logged_values(reference)  # the FID/KID curves among them
    assert summary(root)["best"] == summary(reference)["best"]


@pytest.mark.slow
def test_a_resumed_run_measured_with_another_ruler_drops_the_old_points(
    tmp_path, digits16, featurenet
):
    """Extended with another eval.seed, the curve restarts: two samplings in one curve
    would not be comparable, and the best snapshot would be chosen across them."""
    root = project(tmp_path / "p", digits16, featurenet, train={"kimg": 0.96})
    finish(start(root))
    assert [seen for seen, _ in curve(root, "metrics/fid")] == POINTS[:1]
    project(root, digits16, featurenet, train={"kimg": 1.92}, eval={"seed": 7})
    err = finish(start(root))
    assert "resumed from" in err and "the curve and the best snapshot start again" in err
    assert [seen for seen, _ in curve(root, "metrics/fid")] == POINTS[1:2]
    assert summary(root)["best"]["kimg"] == 1.92
    assert [seen for seen, _ in curve(root, "loss/g")] == POINTS[:2]  # the rest of the log stays


def test_without_a_feature_network_the_stage_says_what_to_run_before_training(tmp_path, digits16):
    root = write_project(tmp_path / "p", RUN, digits16)
    result = run_stage(root, "train")
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "models/featurenet.pt" in line and "dvc repro featurenet" in line, line
    assert "train.metrics_kimg 0" in line, line
    assert not (root / "models").exists() and not list(root.glob("checkpoints/*/"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_measuring_draws_from_no_random_stream_of_training(digits16, device):
    """wgan_gp draws its interpolation weights from the device's global RNG every step (on a
    GPU, CUDA's, which torch.manual_seed would reseed): a run that measures trains the bytes
    of one that does not. The ruler here is a random projection: any extractor will do."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as the train stage
    raw = {
        **RUN,
        "devices": {"accelerator": device, "cpu_threads": 1},
        "model": {**RUN["model"], "norm": "layer"},
        "train": {**RUN["train"], "loss": "wgan_gp", "kimg": 0.64, "metrics_kimg": 0.32},
        "eval": {"num_samples": 64, "kid_subsets": 2, "kid_subset_size": 32, "batch_size": 32},
    }
    raw["train"]["metrics_num_samples"] = 64
    params = parse_params(raw)
    extractor = nn.Sequential(nn.Flatten(), nn.Linear(16 * 16, 8))
    extractor.digest = "a random projection"
    real = torch.randn(100, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ruler = Ruler(Ruler.describe(params, extractor.digest, "none", ""), extractor, real)
    dataset = LmdbImageDataset(digits16 / "train.lmdb", as_uint8=True)
    results = []
    for measured_with in (None, ruler):
        runtime.configure_runtime(params.seed, params.devices, params.determinism)
        on = runtime.resolve_device(params.devices)
        assert on.type == device
        results.append(loop.train(params, dataset, on, progress=False, ruler=measured_with))
    plain, measured = results
    assert plain.best is None and measured.best["images_seen"] in (320, 640)
    for a, b in ((plain.g, measured.g), (plain.d, measured.d), (plain.g_ema, measured.g_ema)):
        ours, theirs = a.state_dict(), b.state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)


class ScriptedRuler(Ruler):
    """A ruler whose FIDs come from a script: the bookkeeping, whatever the measurement."""

    def __init__(self, fids: list[float]):
        super().__init__({"scripted": True})
        self.fids = iter(fids)

    def measure(self, g_ema, context, z_dim, num_classes):
        return {FID: next(self.fids), KID: 0.0}


def test_the_best_snapshot_is_the_ema_of_the_lowest_finite_point(tmp_path, digits16):
    """Not the last point, not a NaN (a diverged G), the earlier of two equal ones."""
    raw = {**RUN, "train": {**RUN["train"], "kimg": 0.8, "metrics_kimg": 0.16}}
    raw["train"].update(checkpoint_kimg=0.16, log_every_kimg=0.16)
    params = parse_params(raw)
    logger = Recorder()
    result = loop.train(
        params,
        LmdbImageDataset(digits16 / "train.lmdb", as_uint8=True),
        torch.device("cpu"),
        logger,
        progress=False,
        run_dir=tmp_path,
        ruler=ScriptedRuler([math.nan, 3.0, 1.0, 2.0, 1.0]),
    )
    assert (result.best["images_seen"], result.best["fid"]) == (480, 1.0)
    at_best = checkpoint.read_checkpoint(tmp_path / checkpoint.checkpoint_name(480))
    ema = {k.removeprefix("module."): v for k, v in at_best["g_ema"].items()}
    assert tensors_digest(result.best["state_dict"]) == tensors_digest(ema)
    assert tensors_digest(result.best["state_dict"]) != tensors_digest(
        result.g_ema.module.state_dict()
    )
    measured = [(seen, s) for seen, s in logger.scalars if FID in s]
    assert [seen for seen, _ in measured] == [160, 320, 480, 640, 800]
    assert [s.get(BEST_KIMG) for _, s in measured] == [None, 0.32, 0.48, 0.48, 0.48]
    assert [s.get(BEST_FID) for _, s in measured][1:] == [3.0, 1.0, 1.0, 1.0]
