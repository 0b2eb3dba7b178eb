"""Exact resume: kill training at any moment, run it again, get the same bytes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ganpipe import checkpoint, loop
from ganpipe.checkpoint import load, load_newest_checkpoint, run_fingerprint, save_checkpoint
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import DataParams, parse_params
from tests.helpers import Recorder, descendants, stage_env, write_project

RUN = {
    "seed": 4,
    "data": {"image_size": 16, "val_fraction": 0.5},
    "devices": {"cpu_threads": 1, "timeout_s": 30},
    "model": {"z_dim": 16, "g_width": 8, "d_width": 8, "norm": "batch"},
    "train": {
        "batch_size": 32,
        "kimg": 3.2,
        "checkpoint_kimg": 0.32,
        "keep_checkpoints": 3,
        "log_every_kimg": 0.32,
        "snapshot_kimg": 100,
        "ema_kimg": 0.5,
    },
    "generate": {"grid_rows": 2},
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    prepare_dataset(DataParams(image_size=16, val_fraction=0.5), 4, out, progress=False)
    return out


def project(root: Path, data_dir: Path, **sections) -> Path:
    return write_project(root, RUN, data_dir, **sections)


def start(root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "stages.train"],
        cwd=root,
        env=stage_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen) -> str:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return err


def digest(root: Path) -> dict[str, str]:
    out = {}
    for name in ("generator", "discriminator", "g_ema"):
        h = hashlib.sha256()
        for key, tensor in load(root / "models" / f"{name}.pt")["state_dict"].items():
            h.update(key.encode() + tensor.contiguous().numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def newest(root: Path) -> str | None:
    found = sorted((root / "checkpoints").glob("*/ckpt-*.pt"))
    return found[-1].name if found else None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the stage and every process under it (torchrun's workers run in sessions
    of their own), like a machine going down."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.communicate()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "precision"), [(1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")]
)
def test_sigkill_at_random_moments_then_resume_gives_the_same_bytes(
    tmp_path, data_dir, world, precision
):
    # 20 checkpoints: room for 5 kills, each after one new checkpoint plus a random delay,
    # even when the machine runs faster than while the reference was timed.
    sections = {
        "precision": precision,
        "devices": {"nproc_per_node": world},
        "train": {"checkpoint_kimg": 0.16},
    }
    reference = project(tmp_path / "reference", data_dir, **sections)
    proc = start(reference)
    while proc.poll() is None and newest(reference) is None:
        time.sleep(0.005)
    first_checkpoint = time.monotonic()
    finish(proc)
    window = time.monotonic() - first_checkpoint  # training time after the first checkpoint
    expected = digest(reference)

    root = project(tmp_path / "killed", data_dir, **sections)
    rng = random.Random(world * 10 + len(precision))
    resumed = 0
    for _ in range(5):
        # Wait for the run to make progress (a new checkpoint), then kill it at a random
        # moment within about one checkpoint interval: the kill lands mid-training.
        before = newest(root)
        proc = start(root)
        while proc.poll() is None and newest(root) == before:
            time.sleep(0.005)
        if proc.poll() is not None:  # finished: nothing left to interrupt
            break
        time.sleep(rng.uniform(0.0, window / 10))
        kill_group(proc)
        resumed += 1
    checkpoints = sorted((root / "checkpoints").glob("*/ckpt-*.pt"))
    assert checkpoints, "no checkpoint was written before the kills"
    checkpoints[-1].write_bytes(checkpoints[-1].read_bytes()[:1000])  # corrupt the newest
    err = finish(start(root))
    assert "cannot be loaded" in err and "trying the previous one" in err, (
        [c.name for c in checkpoints],
        err,
    )
    assert "resumed from" in err
    assert resumed >= 3
    assert digest(root) == expected


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write(tmp_path):
    """A 64 px DCGAN checkpointed every iteration: writes take long enough to land in."""
    data64 = tmp_path / "data64"
    prepare_dataset(DataParams(image_size=64), 4, data64, progress=False)
    sections = {
        "data": {"image_size": 64},
        "model": {"g_width": 32, "d_width": 32},
        "train": {"batch_size": 16, "kimg": 0.128, "checkpoint_kimg": 0.016},
    }
    reference = project(tmp_path / "reference", data64, **sections)
    finish(start(reference))
    root = project(tmp_path / "killed", data64, **sections)
    caught = False
    for _ in range(6):
        proc = start(root)
        while proc.poll() is None:
            if list((root / "checkpoints").glob("*/.ckpt-*.tmp-*")):
                kill_group(proc)
                break
            time.sleep(0.001)
        proc.communicate()
        if list((root / "checkpoints").glob("*/.ckpt-*.tmp-*")):
            caught = True  # the kill left a half-written temporary file behind
            for ckpt in (root / "checkpoints").glob("*/ckpt-*.pt"):
                load(ckpt)  # every complete checkpoint still loads
            break
    assert caught, "never killed inside a checkpoint write"
    finish(start(root))
    assert digest(root) == digest(reference)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_non_zero(tmp_path, data_dir):
    # Long enough that the signal, sent once the first checkpoint exists, lands mid-training
    # (a fixed delay once landed after training, in the interpreter's exit).
    longer = {"kimg": 16}
    reference = project(tmp_path / "reference", data_dir, train=longer)
    finish(start(reference))
    root = project(tmp_path / "stopped", data_dir, train=longer)
    proc = start(root)
    while not list((root / "checkpoints").glob("*/ckpt-*.pt")):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by signal 15" in err
    assert not (root / "models").exists() or not list((root / "models").iterdir())
    finish(start(root))
    assert digest(root) == digest(reference)


def test_a_different_training_config_gets_its_own_run(tmp_path):
    base = parse_params(RUN)
    longer = parse_params({**RUN, "train": {**RUN["train"], "kimg": 10, "log_every_kimg": 1}})
    other = parse_params({**RUN, "train": {**RUN["train"], "lr_g": 1e-3}})
    threads = parse_params({**RUN, "devices": {**RUN["devices"], "cpu_threads": 2}})
    assert run_fingerprint(base)[0] == run_fingerprint(longer)[0]  # extend training: resume
    assert run_fingerprint(base)[0] != run_fingerprint(other)[0]
    assert run_fingerprint(base)[0] != run_fingerprint(threads)[0]  # threads change the bits


@pytest.mark.slow
def test_changed_params_start_fresh_and_leave_the_old_run_alone(tmp_path, data_dir):
    root = project(tmp_path / "p", data_dir, train={"kimg": 0.64})
    finish(start(root))
    first_runs = sorted(p.name for p in (root / "checkpoints").iterdir())
    project(root, data_dir, train={"kimg": 0.64, "lr_d": 1e-3})
    err = finish(start(root))
    assert "no checkpoint for these params" in err and first_runs[0] in err
    assert len(list((root / "checkpoints").iterdir())) == 2
    project(root, data_dir, train={"kimg": 0.96, "lr_d": 1e-3})  # longer: resumes
    err = finish(start(root))
    assert "resumed from" in err and "000000000640" in err


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_carrying_code_is_refused(tmp_path, caplog):
    run_dir = tmp_path / "run"
    save_checkpoint({"iteration": 1, "images_seen": 32}, run_dir, 32, keep=5)
    evil = Payload()
    evil.marker = tmp_path / "pwned"
    with open(run_dir / checkpoint.checkpoint_name(64), "wb") as f:
        pickle.dump({"format": 1, "evil": evil}, f)
    torch_file = run_dir / checkpoint.checkpoint_name(96)
    torch.save({"format": 1, "evil": evil}, torch_file)
    with pytest.raises(pickle.UnpicklingError):
        load(torch_file)
    state = load_newest_checkpoint(run_dir)
    assert state is not None and state["images_seen"] == 32
    assert not evil.marker.exists(), "the payload ran"
    assert caplog.text.count("cannot be loaded") == 2


def test_a_diverged_run_keeps_the_last_good_checkpoint(tmp_path, data_dir, monkeypatch):
    calls = {"n": 0}
    move = loop.to_device_images

    def poisoned(batch, device):
        calls["n"] += 1
        images = move(batch, device)
        return images * float("nan") if calls["n"] == 15 else images

    monkeypatch.setattr(loop, "to_device_images", poisoned)
    params = parse_params(RUN)  # checkpoints every 10 iterations
    run_dir = tmp_path / "run"
    with pytest.raises(FloatingPointError, match="non-finite loss at step 15"):
        loop.train(
            params,
            LmdbImageDataset(data_dir / "train.lmdb", as_uint8=True),
            torch.device("cpu"),
            progress=False,
            run_dir=run_dir,
        )
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == [
        checkpoint.checkpoint_name(320)
    ]


def test_a_full_disk_during_a_save_leaves_the_previous_checkpoints_intact(tmp_path, monkeypatch):
    import errno

    run_dir = tmp_path / "run"
    for images in (32, 64):
        save_checkpoint({"iteration": images // 32, "images_seen": images}, run_dir, images, 5)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint({"iteration": 3, "images_seen": 96}, run_dir, 96, 5)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before  # no leftovers
    assert load_newest_checkpoint(run_dir)["images_seen"] == 64


def test_resuming_a_finished_run_logs_its_final_record(tmp_path, data_dir):
    params = parse_params({**RUN, "train": {**RUN["train"], "kimg": 0.64}})
    dataset = LmdbImageDataset(data_dir / "train.lmdb", as_uint8=True)

    first, again = Recorder(), Recorder()
    loop.train(params, dataset, torch.device("cpu"), first, progress=False, run_dir=tmp_path)
    result = loop.train(
        params, dataset, torch.device("cpu"), again, progress=False, run_dir=tmp_path
    )
    assert again.scalars == [first.scalars[-1]] and [g[0] for g in again.grids] == [640]
    assert result.images_seen == 640


def test_new_code_does_not_resume_an_old_run(monkeypatch):
    params = parse_params(RUN)
    before = run_fingerprint(params)[0]
    monkeypatch.setattr(checkpoint, "code_digest", lambda: "0" * 64)
    assert run_fingerprint(params)[0] != before
