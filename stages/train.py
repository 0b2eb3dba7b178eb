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

import contextlib
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
from dvclive import Live

from ganpipe import dist, runtime
from ganpipe.checkpoint import save_atomic
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.loop import train
from ganpipe.params import Params
from stages import _cli

log = logging.getLogger("stages.train")
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


def launch(params: Params) -> int:
    """Run this stage again under torchrun, one process per device; return its exit code.

    The workers' environment is fixed here, before any of them imports torch:
    ``CUDA_VISIBLE_DEVICES`` (devices.gpus), ``OMP_NUM_THREADS`` (devices.cpu_threads) and
    ``CUBLAS_WORKSPACE_CONFIG``. One node uses ``--standalone``; several use the c10d
    rendezvous at devices.rdzv_endpoint. ``--max-restarts 0``: a failed rank fails the run.
    """
    devices = params.devices
    env = {**os.environ, "OMP_NUM_THREADS": str(devices.cpu_threads)}
    if runtime.wants_cuda(devices):
        runtime.check_gpus(devices)
        if isinstance(devices.gpus, list):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices.gpus))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={devices.nproc_per_node}",
        "--max-restarts=0",
    ]
    if devices.nnodes == 1:
        command.append("--standalone")
    else:
        command += [
            f"--nnodes={devices.nnodes}",
            f"--node-rank={devices.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={devices.rdzv_endpoint}",
            "--rdzv-id=ganpipe-train",
            f"--rdzv-conf=timeout={devices.timeout_s}",
        ]
    command += ["-m", "stages.train", *sys.argv[1:]]
    log.info(
        "launching %d x %d processes: %s", devices.nnodes, devices.nproc_per_node, " ".join(command)
    )
    code = subprocess.call(command, env=env)
    if code != 0:
        print(
            f"error: distributed training failed (torchrun exit status {code}); the "
            "failed rank and its error are reported above",
            file=sys.stderr,
        )
    return code


def main(params: Params) -> None:
    devices = params.devices
    if devices.world_size > 1 and "LOCAL_RANK" not in os.environ:
        sys.exit(launch(params))
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size != devices.world_size:
        raise ValueError(
            f"{world_size} processes were started but devices.nproc_per_node x devices.nnodes "
            f"= {devices.world_size}; let the stage launch torchrun itself"
        )
    runtime.configure_runtime(params.seed, devices, params.determinism, rank)
    context = dist.setup(
        devices,
        rank,
        int(os.environ.get("LOCAL_RANK", 0)),
        world_size,
        runtime.resolve_device(devices),
    )
    try:
        dataset = LmdbImageDataset("data/train.lmdb", as_uint8=True)
        if list(dataset.meta["shape"]) != [params.data.image_size] * 2 + [params.data.channels]:
            raise ValueError(
                f"data/train.lmdb holds {dataset.meta['shape']} images but params say "
                f"data.image_size={params.data.image_size}, "
                f"data.channels={params.data.channels}; run `dvc repro prepare`"
            )
        # Only rank 0 writes: logs, images and models. The others wait at the barrier.
        live = (
            Live(LOG_DIR, dvcyaml=None, save_dvc_exp=False, report=None)
            if context.is_main
            else contextlib.nullcontext()
        )
        with live:
            logger = DvcliveLogger(live) if context.is_main else None
            result = train(params, dataset, context, logger)
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
