"""train: train G and D on data/train.lmdb.

Inputs: params ``seed``, ``precision``, ``data``, ``devices``, ``determinism``, ``model``,
``train``, ``generate.grid_rows``; ``data/train.lmdb``.
Outputs: ``models/generator.pt``, ``models/discriminator.pt``, ``models/g_ema.pt`` (each
written atomically); the training log ``metrics/train`` (dvclive: metrics.json, loss
curves, progress grids).
Command: ``python -m stages.train``
"""

from __future__ import annotations

import os

# cuBLAS reads this when CUDA initialises; it must be set before torch touches the GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

from pathlib import Path

import numpy as np
from dvclive import Live

from ganpipe import runtime
from ganpipe.checkpoint import save_atomic
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.loop import train
from ganpipe.params import Params
from stages import _cli

MODELS = Path("models")
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


def main(params: Params) -> None:
    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    device = runtime.resolve_device(params.devices)
    dataset = LmdbImageDataset("data/train.lmdb", as_uint8=True)
    if list(dataset.meta["shape"]) != [params.data.image_size] * 2 + [params.data.channels]:
        raise ValueError(
            f"data/train.lmdb holds {dataset.meta['shape']} images but params say "
            f"data.image_size={params.data.image_size}, data.channels={params.data.channels}; "
            "run `dvc repro prepare`"
        )
    with Live(LOG_DIR, dvcyaml=None, save_dvc_exp=False, report=None) as live:
        result = train(params, dataset, device, DvcliveLogger(live))
    save_atomic(model_record(params, "generator", result.g.state_dict()), MODELS / "generator.pt")
    save_atomic(
        model_record(params, "discriminator", result.d.state_dict()), MODELS / "discriminator.pt"
    )
    save_atomic(
        model_record(params, "generator", result.g_ema.module.state_dict()), MODELS / "g_ema.pt"
    )


if __name__ == "__main__":
    _cli.run(main, __doc__)
