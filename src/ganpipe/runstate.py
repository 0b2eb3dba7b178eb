"""A training run's state on disk: full-state checkpoints, and resuming from them exactly.

:mod:`ganpipe.checkpoint` writes and verifies the files; this module decides what a
training run puts in them and how it continues from one: networks, optimizers, scalers,
every rank's RNG states, the data position, the log so far and the statistics not yet
logged, so that a resumed run ends with the same bytes as one never stopped.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from ganpipe import checkpoint, dist, runtime
from ganpipe.dist import DistContext
from ganpipe.ema import EmaGenerator
from ganpipe.strategies import Gan
from ganpipe.stream import data_position

if TYPE_CHECKING:
    from ganpipe.trainlog import TrainLogger

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What a run carries from iteration to iteration besides the networks."""

    iteration: int = 0
    history: list = field(default_factory=list)
    """Every logged record so far, ``[images_seen, scalars]``: replayed into the log on resume."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-step statistics summed since the last logged record (on the device)."""
    last_log: int = 0
    """The iteration of the last logged record."""


#: What :func:`resume` reads from a checkpoint besides what every checkpoint holds.
RESUME_KEYS = {
    "data",
    "opt_g",
    "opt_d",
    "scaler_g",
    "scaler_d",
    "skipped_steps",
    "augment_p",
    "rng",
    "log",
    "unlogged",
}


def resume(
    gan: Gan,
    g_ema: EmaGenerator,
    context: DistContext,
    run_dir: Path,
    fingerprint: str,
    num_items: int,
    batch_size: int,
    n_critic: int,
) -> tuple[Progress, dict | None]:
    """Load the newest valid checkpoint of this run (rank 0 reads, all ranks receive it).

    Returns the progress to continue from and the checkpoint (None without one).
    """
    state = None
    if context.is_main:
        for stale in checkpoint.remove_stale_temporaries(run_dir):
            log.info("removed %s, left by an interrupted checkpoint write", stale.name)
        state = checkpoint.load_newest_checkpoint(
            run_dir, fingerprint, check=lambda state: check_fits(state, gan, g_ema)
        )
    state = context.broadcast_object(state)
    if state is None:
        log.info("no checkpoint in %s: training from the start", run_dir)
        return Progress(), None
    iteration = state["iteration"]
    expected = data_position(iteration * n_critic, num_items, batch_size)
    if state["data"] != expected:
        raise ValueError(
            f"checkpoint {state['path']} stopped at data position {state['data']}, but "
            f"{iteration} iterations over {num_items} images in batches of {batch_size} "
            f"end at {expected}; the training set changed: delete {run_dir} to start afresh"
        )
    dist.unwrap(gan.g).load_state_dict(state["g"])
    dist.unwrap(gan.d).load_state_dict(state["d"])
    g_ema.load_state_dict(state["g_ema"])
    gan.opt_g.load_state_dict(state["opt_g"])
    gan.opt_d.load_state_dict(state["opt_d"])
    gan.scaler_g.load_state_dict(state["scaler_g"])
    gan.scaler_d.load_state_dict(state["scaler_d"])
    for net, count in state["skipped_steps"].items():
        gan.skipped[net].fill_(count)  # in place: a captured iteration adds to this memory
    if gan.augment is not None and state["augment_p"] is not None:
        gan.augment.p.copy_(state["augment_p"])  # tuned by train.augment_target
    runtime.set_rng_state(state["rng"][context.rank])
    log.info("resumed from %s (%d images seen)", state["path"], state["images_seen"])
    mine = state["unlogged"]["sums"][context.rank]
    sums = {k: v.to(context.device) for k, v in mine.items()}
    return Progress(iteration, list(state["log"]), sums, state["unlogged"]["since"]), state


def check_fits(state: dict, gan: Gan, g_ema: EmaGenerator) -> None:
    """Raise ``ValueError`` unless ``state`` loads into this run's networks and optimizers.

    A checkpoint with a valid hash may still not fit (edited by hand, written by other code):
    ``load_state_dict`` would then fail half-way, with some networks already overwritten,
    so the check compares names and shapes before anything is loaded.
    """
    missing = RESUME_KEYS - state.keys()
    if missing:
        raise ValueError(f"lacks {sorted(missing)}")
    nets = {"g": dist.unwrap(gan.g), "d": dist.unwrap(gan.d), "g_ema": g_ema}
    for key, net in nets.items():
        ours, theirs = net.state_dict(), state[key]
        if ours.keys() != theirs.keys():
            odd = sorted(ours.keys() ^ theirs.keys())
            raise ValueError(f"{key}: the checkpoint and the model differ in tensors {odd[:3]}")
        for name, tensor in ours.items():
            if tuple(theirs[name].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{key}: {name} has shape {list(theirs[name].shape)}, the model's "
                    f"{list(tensor.shape)}"
                )
    for key, opt in (("opt_g", gan.opt_g), ("opt_d", gan.opt_d)):
        params = [p for group in opt.param_groups for p in group["params"]]
        groups = state[key]["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.param_groups]:
            raise ValueError(f"{key}: its parameter groups differ from the optimizer's")
        for index, entry in state[key]["state"].items():
            for name, value in entry.items():
                # Adam's moments have their parameter's shape; its step count is a scalar.
                shaped = isinstance(value, torch.Tensor) and value.ndim > 0
                if shaped and tuple(value.shape) != tuple(params[index].shape):
                    raise ValueError(
                        f"{key}: {name} of parameter {index} has shape {list(value.shape)}, "
                        f"the parameter's {list(params[index].shape)}"
                    )


def weights_are_finite(gan: Gan, g_ema: EmaGenerator, context: DistContext) -> bool:
    """All weights of G, D and the EMA finite, on every rank (one host sync)."""
    tensors = [*gan.g.parameters(), *gan.d.parameters(), *g_ema.parameters()]
    bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).any().float()
    return context.all_max(bad).item() == 0


def save(
    gan: Gan,
    g_ema: EmaGenerator,
    context: DistContext,
    run_dir: Path,
    keep: int,
    fingerprint: str,
    progress: Progress,
    images_seen: int,
    data: dict[str, int],
) -> Path | None:
    """Write a full-state checkpoint (rank 0), with every rank's RNG states and sums.

    Returns its path on rank 0, None on the other ranks.
    """
    rngs = context.gather_objects(runtime.rng_state())
    sums = context.gather_objects({k: v.cpu() for k, v in progress.sums.items()})
    path = None
    if context.is_main:
        state = {
            "fingerprint": fingerprint,
            "iteration": progress.iteration,
            "images_seen": images_seen,
            "data": data,
            "skipped_steps": gan.skipped_steps(),
            "augment_p": None if gan.augment is None else gan.augment.p.detach().cpu().clone(),
            "g": dist.unwrap(gan.g).state_dict(),
            "d": dist.unwrap(gan.d).state_dict(),
            "g_ema": g_ema.state_dict(),
            "opt_g": gan.opt_g.state_dict(),
            "opt_d": gan.opt_d.state_dict(),
            "scaler_g": gan.scaler_g.state_dict(),
            "scaler_d": gan.scaler_d.state_dict(),
            "rng": rngs,
            "log": progress.history,
            # A checkpoint between two log records: the next record must average the same
            # iterations as in a run that was never stopped.
            "unlogged": {"sums": sums, "since": progress.last_log},
        }
        path = checkpoint.save_checkpoint(state, run_dir, images_seen, keep)
    context.barrier()
    return path


def save_grid(run_dir: Path, images_seen: int, grid: np.ndarray) -> None:
    """Keep a progress grid beside the checkpoints (the log may be cleared before a resume)."""
    buffer = io.BytesIO()
    Image.fromarray(grid.squeeze(-1) if grid.shape[-1] == 1 else grid).save(buffer, "PNG")
    path = run_dir / "grids" / f"{images_seen:012d}.png"
    checkpoint.write_bytes_atomic(buffer.getvalue(), path)


def replay(logger: TrainLogger | None, run_dir: Path, state: dict) -> None:
    """Write the log of the run up to the checkpoint ``state`` again: scalars and grids."""
    if logger is None:
        return
    for seen, scalars in state["log"]:
        logger.log_scalars(seen, scalars)
    for path in sorted((run_dir / "grids").glob("*.png")):
        if int(path.stem) <= state["images_seen"]:
            grid = np.asarray(Image.open(path))
            logger.log_grid(int(path.stem), grid[..., None] if grid.ndim == 2 else grid)
