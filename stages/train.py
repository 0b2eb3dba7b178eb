"""train: train G and D on data/train.lmdb.

Inputs: params ``seed``, ``precision``, ``data``, ``devices``, ``determinism``, ``model``,
``train``, ``generate.grid_rows``; ``data/train.lmdb``.
Outputs: ``models/generator.pt``, ``models/discriminator.pt``, ``models/g_ema.pt`` (each
written atomically); the training log ``metrics/train`` (dvclive: metrics.json, loss
curves, progress grids); full-state checkpoints in ``checkpoints/<run>/`` (a persistent
output: a rerun resumes from the newest valid one).
Command: ``python -m stages.train``
"""

from __future__ import annotations

import os

# cuBLAS reads this when CUDA initialises; it must be set before torch touches the GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import contextlib
import json
import logging
import signal
import sys
from pathlib import Path

import numpy as np
from dvclive import Live

from ganpipe import dist
from ganpipe.checkpoint import run_fingerprint, save_atomic, write_bytes_atomic
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.loop import TrainingInterrupted, train
from ganpipe.params import Params
from stages import _cli
from stages._cli import TRAIN_LMDB
from stages._launch import join

log = logging.getLogger("stages.train")
MODELS = Path("models")
CHECKPOINTS = Path("checkpoints")
LOG_DIR = "metrics/train"


class DvcliveLogger:
    """The loop's logger, writing dvclive files (no dvc.yaml edits, no experiment saving)."""

    def __init__(self, live: Live):
        self.live = live

    def log_scalars(self, images_seen: int, scalars: dict[str, float]) -> None:
        self.live.step = images_seen
        for name, value in scalars.items():
            self.live.log_metric(name, value)
        self.live.make_summary()

    def log_grid(self, images_seen: int, grid: np.ndarray) -> None:
        self.live.log_image(f"progress/{images_seen:09d}.png", grid)


def model_record(params: Params, net: str, state_dict: dict) -> dict:
    """What a model file holds: enough to rebuild the network without params.yaml."""
    return {
        "net": net,
        "model": params.model.model_dump(mode="json"),
        "image_size": params.data.image_size,
        "channels": params.data.channels,
        "state_dict": state_dict,
    }


def checkpoint_dir(params: Params, dataset_sha256: str) -> tuple[Path, str]:
    """``(checkpoints/<fingerprint>, fingerprint)``: each set of result-changing params,
    training set and code has its own run.

    A checkpoint is therefore never reused by different training params or data, and
    switching back to earlier params resumes their run. ``run.json`` says which params a
    folder is for.
    """
    fingerprint, relevant = run_fingerprint(params, dataset_sha256)
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
    run_dir.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(
        json.dumps(relevant, indent=2, sort_keys=True).encode(), run_dir / "run.json"
    )
    return run_dir, fingerprint


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


def main(params: Params) -> None:
    context = join(params, "stages.train")
    try:
        dataset = LmdbImageDataset(TRAIN_LMDB, as_uint8=True)
        if list(dataset.meta["shape"]) != [params.data.image_size] * 2 + [params.data.channels]:
            raise ValueError(
                f"data/train.lmdb holds {dataset.meta['shape']} images but params say "
                f"data.image_size={params.data.image_size}, "
                f"data.channels={params.data.channels}; run `dvc repro prepare`"
            )
        # Only rank 0 writes: logs, images and models. The others wait at the barrier.
        run = checkpoint_dir(params, dataset.meta["content_sha256"]) if context.is_main else None
        run_dir, fingerprint = context.broadcast_object(run)
        # The log starts afresh and the loop writes the resumed run's records again from
        # its checkpoint: dvclive's own files are not written atomically, a killed run can
        # leave a truncated metrics.json, and DVC clears the log before rerunning the stage.
        live = (
            Live(LOG_DIR, dvcyaml=None, save_dvc_exp=False, report=None)
            if context.is_main
            else contextlib.nullcontext()
        )
        stop = StopRequest()
        with live:
            logger = DvcliveLogger(live) if context.is_main else None
            try:
                result = train(
                    params,
                    dataset,
                    context,
                    logger,
                    run_dir=Path(run_dir),
                    should_stop=stop,
                    fingerprint=fingerprint,
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
            for name, net in (
                ("generator", result.g),
                ("discriminator", result.d),
                ("g_ema", result.g_ema.module),
            ):
                kind = "discriminator" if name == "discriminator" else "generator"
                save_atomic(model_record(params, kind, net.state_dict()), MODELS / f"{name}.pt")
        context.barrier()
    finally:
        dist.teardown(context)


if __name__ == "__main__":
    _cli.run(main, __doc__)
