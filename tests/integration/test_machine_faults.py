"""What the user's machine brings: a full disk or a file-size limit (``ulimit -f``).

Each write a stage makes ends in one ``error:`` line saying what was needed and what is free
where, with the previous file untouched; an optional cache that cannot be written is skipped.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ganpipe import evaluation, runtime
from ganpipe.checkpoint import save_atomic
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.featurenet import Embedding, FeatureNet
from ganpipe.files import NoSpaceError, kept_on_no_space, reported_as_no_space
from ganpipe.nets import build_generator, build_models
from ganpipe.params import ModelParams, Params
from ganpipe.sampling import export_pngs
from stages.train import model_record
from tests.conftest import dir_digest
from tests.helpers import run_stage, stage_env, tiny_params, write_project

LIMIT = 64 * 1024  # bytes a file may grow to under the test's `ulimit -f`


def limited_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, LIMIT))


def test_an_atomic_write_past_the_file_size_limit_keeps_the_old_file(tmp_path):
    target = tmp_path / "models" / "g_ema.pt"
    target.parent.mkdir()
    target.write_bytes(b"previous model")
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from ganpipe.checkpoint import write_bytes_atomic
        from ganpipe.files import NoSpaceError
        try:
            write_bytes_atomic(b"x" * {4 * LIMIT}, Path({str(target)!r}))
        except NoSpaceError as exc:
            print(exc)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=stage_env(),
        capture_output=True,
        text=True,
        preexec_fn=limited_file_size,
    )
    assert result.returncode == 0, result.stderr
    assert f"writing {target} failed (File too large): it needs 0.2 MiB" in result.stdout
    assert f"{target} is unchanged" in result.stdout and "ulimit -f" in result.stdout
    assert target.read_bytes() == b"previous model"
    assert [p.name for p in target.parent.iterdir()] == ["g_ema.pt"]  # no temporary left


def test_train_past_the_file_size_limit_ends_in_one_error_line(tmp_path, digits16):
    root = write_project(
        tmp_path / "project",
        tiny_params(model={"g_width": 16, "d_width": 16}, train={"kimg": 0.064}),
        digits16,
    )
    result = subprocess.run(
        [sys.executable, "-m", "stages.train"],
        cwd=root,
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limited_file_size,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "File too large" in errors[0], result.stderr[-3000:]
    assert "checkpoint needs" in errors[0] and "free there now" in errors[0]
    assert not (root / "models").exists()


@pytest.fixture
def val_split(digits16) -> LmdbImageDataset:
    return LmdbImageDataset(digits16 / "val.lmdb")


def test_a_feature_cache_past_the_file_size_limit_is_skipped_with_a_warning(
    tmp_path, val_split, caplog
):
    extractor = Embedding(FeatureNet(channels=1, image_size=16, width=4, num_classes=10), "x")
    sha = val_split.meta["content_sha256"]
    args = (extractor, val_split, sha, 256, torch.device("cpu"), tmp_path / "cache")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))  # the features need ~30 KB
    try:
        with caplog.at_level("WARNING", logger="ganpipe.evaluation"):
            features = evaluation.real_features(*args, progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "the real features are not cached" in caplog.text and "File too large" in caplog.text
    assert not list((tmp_path / "cache").iterdir())
    assert torch.equal(features, evaluation.real_features(*args[:5], None, progress=False))


@contextmanager
def tmpfs(disk: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``mount -o size=``) at the new folder ``disk``, unmounted after."""
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)])
    if mounted.returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


@pytest.fixture
def small_disk(tmp_path) -> Iterator[Path]:
    """A 64 KiB tmpfs (room for 16 small files: each takes a 4 KiB page)."""
    with tmpfs(tmp_path / "disk", "64k") as disk:
        yield disk


def test_exported_images_on_a_full_disk_end_in_one_error_and_keep_the_old_set(small_disk):
    g = build_generator(ModelParams(z_dim=8, g_width=4), 16, 1).eval()
    images = small_disk / "images"
    export_pngs(g, 8, 3, 0, images, progress=False)
    before = {p.name: p.read_bytes() for p in images.iterdir()}
    with pytest.raises(NoSpaceError) as caught:
        export_pngs(g, 8, 40, 0, images, progress=False)
    message = str(caught.value)
    assert f"writing {images} failed (No space left on device)" in message
    assert "free there now" in message and f"{images} is unchanged" in message
    assert {p.name: p.read_bytes() for p in images.iterdir()} == before
    assert os.listdir(small_disk) == ["images"]  # the partial new set is gone


def fill(disk: Path) -> None:
    """Write ``disk/filler`` until the filesystem has no room left."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_a_train_log_on_a_full_disk_ends_in_one_error_and_keeps_the_previous_log(
    tmp_path, digits16
):
    # metrics/train moved to another disk (a link), which fills up while dvclive writes the
    # log again: dvclive's own writes are not atomic, and it clears the old log first.
    root = write_project(tmp_path / "project", tiny_params(), digits16)
    with tmpfs(tmp_path / "disk", "1m") as disk:
        (disk / "train").mkdir()
        (root / "metrics").mkdir()
        (root / "metrics/train").symlink_to(disk / "train")
        first = run_stage(root, "train", timeout=300)
        assert first.returncode == 0, first.stderr[-3000:]
        log_before, models_before = dir_digest(disk / "train"), dir_digest(root / "models")
        assert "metrics.json" in log_before and len(log_before) > 5
        fill(disk)
        # the same params: the run resumes at its end and writes its log again
        result = run_stage(root, "train", timeout=300)
        assert result.returncode == 2, result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.stderr[-3000:]
        assert "writing metrics/train failed (No space left on device)" in errors[0]
        assert "free there now" in errors[0] and "metrics/train is unchanged" in errors[0]
        assert dir_digest(disk / "train") == log_before
        assert (root / "metrics/train").is_symlink()
        assert sorted(os.listdir(disk)) == ["filler", "train"]  # no kept copy left behind
        assert dir_digest(root / "models") == models_before


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["text", "json"])
def test_ganpipe_info_into_a_closed_pipe_stops_quietly(tmp_path, json_flag):
    """`ganpipe info models/g_ema.pt | head -1`: the reader goes away before all is written
    (here before anything is: the pipe's read end is closed), as `head` does."""
    params = Params.model_validate({"data": {"image_size": 16}, "model": {"z_dim": 8}})
    g, _ = build_models(params.model, 16, 1, torch.Generator().manual_seed(0))
    numerics = runtime.numerics_record(params.determinism, params.devices, torch.device("cpu"))
    model = tmp_path / "g_ema.pt"
    save_atomic(model_record(params, "generator", g.state_dict(), numerics, None, 160), model)
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "ganpipe_cli", "info", str(model), *json_flag],
            env=stage_env(),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert result.returncode == 128 + signal.SIGPIPE, result.stderr
    assert result.stderr == ""


SLOW_MEASUREMENT = """
import os, sys, time, torch
from ganpipe import dist
from ganpipe.errors import UserError
from ganpipe.params import DevicesParams
from ganpipe.trainmetrics import Ruler

rank = int(os.environ["RANK"])
devices = DevicesParams(nproc_per_node=2, timeout_s=5)
context = dist.setup(devices, rank, rank, 2, torch.device("cpu"))
if rank == 0:  # a measurement that takes longer than devices.timeout_s (the test ends it)
    time.sleep(300)
identity = {"ruler": {"extractor": "featurenet"}, "num_samples": 50000, "batch_size": 256}
try:
    Ruler(identity).measure(None, context, 8, None)  # rank 1 only waits for rank 0's
except UserError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
"""


def test_a_measurement_longer_than_the_ddp_timeout_names_the_keys_not_a_gloo_traceback():
    """Under DDP rank 0 measures FID while the other ranks wait in a broadcast: one that
    outlasts devices.timeout_s fails there, and says which keys make it long."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**stage_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", SLOW_MEASUREMENT],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        waiting = ranks[1].communicate(timeout=60)[1]
    finally:
        ranks[0].kill()
        ranks[0].communicate()
    assert ranks[1].returncode == 2, waiting[-3000:]
    assert "Traceback" not in waiting
    errors = [line for line in waiting.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, waiting[-3000:]
    assert (
        "rank 1 waited devices.timeout_s=5 s for rank 0 to finish a FID/KID measurement"
        in (errors[0])
    )
    assert "train.metrics_num_samples=50000" in errors[0]
    assert "raise devices.timeout_s" in errors[0] and "train.metrics_kimg 0" in errors[0]


def write_in_place(folder: Path, size: int) -> None:
    """What dvclive does to its log: clear it, then write new files into it."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with open(folder / "metrics.json", "wb") as handle:
        handle.write(b"x" * size)


@pytest.mark.parametrize("reported", [False, True], ids=["bare", "reported"])
def test_a_log_that_did_not_exist_before_a_full_disk_is_not_left_half_written(tmp_path, reported):
    """The error says "was not written" once the half-written log is gone, whether the
    writer's OSError arrives bare or already as a NoSpaceError (the train stage's logger)."""
    log = tmp_path / "metrics" / "train"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
    writer = reported_as_no_space(log) if reported else contextlib.nullcontext()
    try:
        with pytest.raises(NoSpaceError) as caught, kept_on_no_space(log), writer:
            write_in_place(log, 2 * LIMIT)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert f"writing {log} failed (File too large)" in str(caught.value)
    assert f"{log} was not written" in str(caught.value)
    assert not log.exists() and os.listdir(log.parent) == []


def test_a_log_whose_run_fails_otherwise_keeps_what_the_run_wrote(tmp_path):
    """A diverged or interrupted run's partial log stays, for its curves; the copy goes."""
    log = tmp_path / "train"
    write_in_place(log, 10)
    with pytest.raises(RuntimeError), kept_on_no_space(log):
        write_in_place(log, 20)
        raise RuntimeError("diverged")
    assert (log / "metrics.json").read_bytes() == b"x" * 20
    assert os.listdir(tmp_path) == ["train"]
