"""train: train G and D on data/train.lmdb.

Inputs: params ``seed``, ``precision``, ``data``, ``devices``, ``determinism``, ``model``,
``train``, ``generate.grid_rows``; ``data/train.lmdb`` (verified against the checksums prepare
wrote, :func:`ganpipe.data.store.verify_lmdb`, before anything else); with ``train.init_from``,
the three model files of that folder in ``init/`` (fine-tuning; dvc.yaml depends on all of
``init/``). With ``train.metrics_kimg`` > 0 (FID and KID while training, measured as the
evaluate stage measures) also the ``eval`` keys of the measurement, ``data/val.lmdb`` and
``models/featurenet.pt`` (or the Inception weights of ``eval.inception_weights``); the real
features are cached in ``.state/feature-cache/``.
Outputs: ``models/generator.pt``, ``models/discriminator.pt``, ``models/g_ema.pt`` and
``models/g_ema_best.pt`` (the EMA at the lowest FID measured while training; the final EMA
without metrics), each written atomically, with the numerics they were computed with (and with
``train.init_from``, the path and sha256 of the file each started from); the
training log ``metrics/train`` (dvclive: metrics.json with ``best/kimg`` and ``best/fid``,
loss and FID/KID curves, progress grids).
Beside the outputs (git-ignored, not in dvc.lock: they are not reproducible bytes): the
measured curves ``perf/*`` and where the run ran (``machine.json``) in
``measurements/train``; full-state checkpoints in ``checkpoints/<run>/`` (a rerun resumes
from the newest valid one of its run).
While it runs, the stage holds a lock on ``checkpoints/`` (its run state; the lock covers
every file above): a second train fails at once, naming the pid of the first.
Command: ``python -m stages.train``
"""

from __future__ import annotations

import os

from stages import _cli

# cuBLAS reads this when CUDA initialises; it must be set before torch touches the GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
if __name__ == "__main__":
    _cli.pin_cpu()  # before the imports below load torch: its libraries read the pins once

import contextlib
import json
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ganpipe import dist, runtime
from ganpipe.checkpoint import (
    MODEL_FILES,
    init_files,
    init_sha256,
    run_fingerprint,
    save_atomic,
    write_bytes_atomic,
)
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.store import DatasetError
from ganpipe.dist import DistContext
from ganpipe.errors import UserError
from ganpipe.files import kept_on_no_space, reported_as_no_space
from ganpipe.loop import TrainingInterrupted, TrainResult, train
from ganpipe.params import Params
from ganpipe.trainmetrics import BEST_PREFIX, Ruler
from stages._cli import TRAIN_LMDB, VAL_LMDB
from stages._launch import join, lock_outputs, verify_data

if TYPE_CHECKING:
    from dvclive import Live

log = logging.getLogger("stages.train")
MODELS = Path("models")
CHECKPOINTS = Path("checkpoints")
LOG_DIR = "metrics/train"
#: What the run measured rather than computed (timings, memory) and where it ran: outside
#: the stage's outputs (git-ignored), so that dvc.lock holds only reproducible bytes.
MEASUREMENTS_DIR = "measurements/train"
MEASURED_PREFIX = "perf/"


class MetricsError(UserError):
    """FID/KID while training cannot be measured with these params and this val split."""


@contextlib.contextmanager
def open_log(directory: str) -> Iterator[Live]:
    """A dvclive log in ``directory``, cleared first (no dvc.yaml edits, no experiments),
    ended (its summary written) on leaving. dvclive writes in place and raises a bare
    ``OSError`` when the disk is full: that is a :class:`~ganpipe.files.NoSpaceError`
    naming ``directory``."""
    # Imported here: only the main rank logs, and dvclive brings requests and dvc's modules
    # into every process that imports it (the launcher, each rank).
    from dvclive import Live

    with reported_as_no_space(Path(directory)):
        live = Live(directory, dvcyaml=None, save_dvc_exp=False, report=None)
    try:
        yield live
    finally:
        with reported_as_no_space(Path(directory)):
            live.end()


@contextlib.contextmanager
def logs_kept_on_no_space(context: DistContext) -> Iterator[None]:
    """On the main rank, ``metrics/train`` and ``measurements/train`` as they were before
    the run when the block fails for lack of space (:func:`ganpipe.files.kept_on_no_space`).

    dvclive rewrites them in place, so that ``dvc exp show``, ``dvc plots`` and the user see
    the run's log while it trains; a full disk must not leave half a log beside the previous
    models. The block includes writing the models: the log changes with them or not at all.
    """
    if not context.is_main:
        yield
        return
    with kept_on_no_space(Path(LOG_DIR)), kept_on_no_space(Path(MEASUREMENTS_DIR)):
        yield


@contextlib.contextmanager
def open_logs(context: DistContext) -> Iterator[DvcliveLogger | None]:
    """The main rank's logger, on the dvclive logs ``metrics/train`` and
    ``measurements/train`` (:func:`open_log`); None on the other ranks."""
    if not context.is_main:
        yield None
        return
    with open_log(LOG_DIR) as live, open_log(MEASUREMENTS_DIR) as measured:
        yield DvcliveLogger(live, measured)


class DvcliveLogger:
    """The loop's logger, writing dvclive files: the computed curves to ``live``, the
    measured ``perf/*`` ones to ``measured``; a write that fails for lack of space is a
    :class:`~ganpipe.files.NoSpaceError` naming the log's folder."""

    def __init__(self, live: Live, measured: Live):
        self.live, self.measured = live, measured

    def log_scalars(self, images_seen: int, scalars: dict[str, float]) -> None:
        for log_, keep in ((self.live, False), (self.measured, True)):
            with reported_as_no_space(Path(log_.dir)):
                log_.step = images_seen
                for name, value in scalars.items():
                    if name.startswith(MEASURED_PREFIX) == keep:
                        # best/*: logged at every measurement, a value of the run, not a curve
                        log_.log_metric(name, value, plot=not name.startswith(BEST_PREFIX))
                log_.make_summary()

    def log_grid(self, images_seen: int, grid: np.ndarray) -> None:
        with reported_as_no_space(Path(self.live.dir)):
            self.live.log_image(f"progress/{images_seen:09d}.png", grid)


def model_record(
    params: Params,
    net: str,
    state_dict: dict,
    numerics: dict,
    num_classes: int | None = None,
    images_seen: int | None = None,
    init_from: dict[str, str] | None = None,
) -> dict:
    """What a model file holds (:mod:`ganpipe.modelfile`): enough to rebuild the network
    without params.yaml, the numerics it was computed with
    (:func:`ganpipe.runtime.numerics_record`) and ``images_seen``, how far training went;
    ``num_classes`` for a class-conditional model only, ``init_from`` (the ``path`` and
    ``sha256`` of the train.init_from file its weights started from) for a fine-tuned one
    only: the record of an unconditional model trained from the seed is as before."""
    record = {
        "net": net,
        "model": params.model.model_dump(mode="json"),
        "image_size": params.data.image_size,
        "channels": params.data.channels,
        "numerics": numerics,
        "state_dict": state_dict,
    }
    if num_classes is not None:
        record["num_classes"] = num_classes
    if images_seen is not None:
        record["images_seen"] = images_seen
    if init_from is not None:
        record["init_from"] = init_from
    return record


#: The file of a train.init_from folder each model file starts from: the best snapshot is an
#: EMA, it starts from the EMA's file.
STARTS_FROM = {
    "generator": MODEL_FILES["g"],
    "discriminator": MODEL_FILES["d"],
    "g_ema": MODEL_FILES["g_ema"],
    "g_ema_best": MODEL_FILES["g_ema"],
}


def init_sources(init_from: str | None) -> dict[str, dict[str, str]] | None:
    """For each model file (by name, as :data:`STARTS_FROM`), the ``path`` and ``sha256`` of
    the train.init_from file it starts from; None without train.init_from."""
    if init_from is None:
        return None
    sha256 = init_sha256(Path(init_from))
    return {
        name: {"path": f"{init_from}/{file}", "sha256": sha256[file]}
        for name, file in STARTS_FROM.items()
    }


def _numerics_part(relevant: dict) -> dict:
    return {**(relevant.get("numerics") or {}), "libc": relevant.get("libc")}


def _params_part(relevant: dict) -> dict:
    rest = {k: v for k, v in relevant.items() if k not in ("numerics", "libc")}
    rest["determinism"] = {
        k: v for k, v in (rest.get("determinism") or {}).items() if k != "cpu_isa"
    }
    return rest


def other_numerics(relevant: dict, run_dir: Path) -> list[tuple[str, str]]:
    """``(run, what differs)`` for each run in checkpoints/ that is this run (same params,
    data and code) but for its numerics: made in the other ``determinism.cpu_isa``, with
    another torch or C library, or natively on another kind of CPU or GPU."""
    found = []
    mine = _numerics_part(relevant)
    for path in sorted(CHECKPOINTS.glob("*/run.json")):
        try:
            theirs = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if path.parent == run_dir or _params_part(theirs) != _params_part(relevant):
            continue
        old = _numerics_part(theirs)
        changes = [
            f"{key}: {old.get(key)!r} -> {mine.get(key)!r}"
            for key in sorted(set(old) | set(mine))
            if old.get(key) != mine.get(key)
        ]
        found.append((path.parent.name, "; ".join(changes)))
    return found


def checkpoint_dir(params: Params, dataset_sha256: str, numerics: dict) -> tuple[Path, str]:
    """``(checkpoints/<fingerprint>, fingerprint)``: each set of result-changing params,
    training set, numerics and code has its own run.

    A checkpoint is therefore never reused by different training params, data or CPU
    numerics, and switching back to earlier params resumes their run. ``run.json`` says
    which params a folder is for. A run of the same params under other numerics is not
    resumed (it would continue with other bits than it started with): the log says so.
    """
    fingerprint, relevant = run_fingerprint(params, dataset_sha256, numerics)
    run_dir = CHECKPOINTS / fingerprint[:16]
    others = [p.name for p in CHECKPOINTS.glob("*") if p.is_dir() and p != run_dir]
    if others and not list(run_dir.glob("ckpt-*.pt")):
        log.info(
            "no checkpoint for these params (run %s); checkpoints of other params in %s "
            "are left alone: %s",
            run_dir.name,
            CHECKPOINTS,
            ", ".join(sorted(others)),
        )
        for other, changes in other_numerics(relevant, run_dir):
            log.warning(
                "checkpoints/%s holds a run of these same params made with other CPU/GPU "
                "numerics (%s); it is not resumed, since its bits would differ from what this "
                "machine computes: training starts from the beginning. To continue that run, "
                "use the numerics it records (determinism.cpu_isa, the same torch, and for "
                "native the same CPU model); or delete checkpoints/%s",
                other,
                changes,
                other,
            )
    run_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(
        json.dumps(relevant, indent=2, sort_keys=True).encode(), run_dir / "run.json"
    )
    return run_dir, fingerprint


def metrics_ruler(params: Params, context: DistContext, numerics: dict) -> Ruler | None:
    """What FID/KID while training measure with (None with ``train.metrics_kimg`` 0): the
    evaluate stage's extractor and val split, the real features from its cache; on the
    main rank, the other ranks get the identity only.

    Raises:
        MetricsError: the extractor is missing or altered, or the val split has fewer images
            than ``eval.kid_subset_size``.
        WaitTimeoutError: on a rank other than 0, the val features took rank 0 longer than
            devices.timeout_s (gloo).
    """
    if params.train.metrics_kimg == 0:
        return None
    # torchmetrics loads torchvision and torch._dynamo (seconds of start-up): only in runs
    # that measure.
    from ganpipe import evaluation
    from ganpipe.scoring import load_extractor
    from stages.evaluate import CACHE, FEATURENET, check_val_split

    identity = extractor = real = None
    if context.is_main:
        check_val_split(train_verified=True)  # main() verified it before training
        try:
            extractor = load_extractor(params.eval, FEATURENET)
        except evaluation.ExtractorError as exc:
            raise MetricsError(
                f"{exc} (FID while training, train.metrics_kimg={params.train.metrics_kimg}; "
                "or set train.metrics_kimg 0)"
            ) from None
        val = LmdbImageDataset(VAL_LMDB)
        if len(val) < params.eval.kid_subset_size:
            raise MetricsError(
                f"eval.kid_subset_size={params.eval.kid_subset_size} is more than the "
                f"{len(val)} images of {VAL_LMDB} (KID while training, train.metrics_kimg="
                f"{params.train.metrics_kimg}); lower it, raise data.val_fraction, or set "
                "train.metrics_kimg 0"
            )
        text = json.dumps(numerics, sort_keys=True)
        sha256 = val.meta["content_sha256"]
        real = evaluation.real_features(
            extractor, val, sha256, params.eval.batch_size, context.device, CACHE, numerics=text
        )
        identity = Ruler.describe(params, extractor.digest, sha256, text)
    identity = context.wait_for_main(
        identity,
        f"the features of {VAL_LMDB} for FID while training (train.metrics_kimg="
        f"{params.train.metrics_kimg}, eval.feature_extractor={params.eval.feature_extractor}, "
        f"eval.batch_size={params.eval.batch_size}; cached in {CACHE} once computed)",
        "raise devices.timeout_s above what rank 0 takes to pass the val split through the "
        "extractor, or set train.metrics_kimg 0",
    )
    return Ruler(identity, extractor, real)


class StopRequest:
    """SIGTERM / SIGINT set a flag; the loop saves a checkpoint and stops cleanly."""

    def __init__(self):
        self.signal: int | None = None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        self.signal = signum

    def __call__(self) -> bool:
        return self.signal is not None


def write_machine_record(run: str, numerics: dict, context: DistContext) -> None:
    """``measurements/train/machine.json``: where the run ran (not a stage output)."""
    manifest = {
        "run": run,
        "numerics": numerics,
        "machine": runtime.machine_record(),
        "world_size": context.world_size,
    }
    write_bytes_atomic(
        (json.dumps(manifest, indent=2) + "\n").encode(), Path(MEASUREMENTS_DIR) / "machine.json"
    )


def save_models(
    params: Params,
    result: TrainResult,
    numerics: dict,
    init: dict[str, dict[str, str]] | None = None,
) -> None:
    """The four model files of ``models/`` (:func:`model_record`), each written atomically;
    ``init``: what each started from (:func:`init_sources`)."""
    final = result.g_ema.module.state_dict()
    best = final if result.best is None else result.best["state_dict"]
    seen = result.images_seen
    best_seen = seen if result.best is None else result.best["images_seen"]
    for name, kind, state_dict, images_seen in (
        ("generator", "generator", result.g.state_dict(), seen),
        ("discriminator", "discriminator", result.d.state_dict(), seen),
        ("g_ema", "generator", final, seen),
        ("g_ema_best", "generator", best, best_seen),
    ):
        started = None if init is None else init[name]
        record = model_record(
            params, kind, state_dict, numerics, result.num_classes, images_seen, started
        )
        save_atomic(record, MODELS / f"{name}.pt")


def main(params: Params) -> None:
    with lock_outputs(CHECKPOINTS, "train"):
        verify_data(TRAIN_LMDB)  # before any worker starts and any output is opened
        train_and_save(params)


def train_and_save(params: Params) -> None:
    """Train (resuming this run's newest checkpoint) and write the models and the logs."""
    if params.train.init_from is not None:  # before torchrun: one error line, not one per rank
        init_files(Path(params.train.init_from))
    context = join(params, "stages.train")
    try:
        dataset = LmdbImageDataset(TRAIN_LMDB, as_uint8=True)
        if list(dataset.meta["shape"]) != [params.data.image_size] * 2 + [params.data.channels]:
            raise DatasetError(
                f"data/train.lmdb holds {dataset.meta['shape']} images but params say "
                f"data.image_size={params.data.image_size}, "
                f"data.channels={params.data.channels}; run `dvc repro prepare`"
            )
        numerics = runtime.numerics_record(params.determinism, params.devices, context.device)
        ruler = metrics_ruler(params, context, numerics)  # before anything is written
        # Only rank 0 writes: logs, images and models. The others wait at the barrier.
        run = (
            checkpoint_dir(params, dataset.meta["content_sha256"], numerics)
            if context.is_main
            else None
        )
        run_dir, fingerprint = context.broadcast_object(run)
        # what the weights start from (hashed just before training loads them): the records
        init = init_sources(params.train.init_from) if context.is_main else None
        # The log starts afresh and the loop writes the resumed run's records again from
        # its checkpoint: dvclive's own files are not written atomically, a killed run can
        # leave a truncated metrics.json, and DVC clears the log before rerunning the stage.
        stop = StopRequest()
        with logs_kept_on_no_space(context):
            with open_logs(context) as logger:
                if logger is not None:
                    if ruler is not None:  # what the FIDs are measured in
                        logger.live.summary["ruler"] = ruler.identity["ruler"]
                    write_machine_record(Path(run_dir).name, numerics, context)
                try:
                    result = train(
                        params,
                        dataset,
                        context,
                        logger,
                        run_dir=Path(run_dir),
                        should_stop=stop,
                        fingerprint=fingerprint,
                        ruler=ruler,
                    )
                except TrainingInterrupted as exc:
                    if context.is_main:
                        print(
                            f"stopped by signal {stop.signal} after {exc.images_seen} images; "
                            f"checkpoint {exc.checkpoint}; run the stage again to resume",
                            file=sys.stderr,
                        )
                    sys.exit(128 + (stop.signal or signal.SIGTERM))
            if context.is_main:
                save_models(params, result, numerics, init)
        context.barrier()
    finally:
        dist.teardown(context)


if __name__ == "__main__":
    _cli.run(main, __doc__)
