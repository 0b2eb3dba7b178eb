"""The training loop. Progress is counted in images shown to D, not in steps.

The loop only sequences one job each of: :mod:`ganpipe.build` (the GAN from the params),
:mod:`ganpipe.stream` (each iteration's batches and latents), :mod:`ganpipe.strategies`
(one iteration's updates), :mod:`ganpipe.graphed` (that iteration captured in a CUDA graph
on a GPU), :mod:`ganpipe.trainlog` (statistics and log records) and :mod:`ganpipe.runstate`
(checkpoints and exact resume).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from ganpipe import dist, graphed, runstate
from ganpipe.build import adaptive_p, build_gan, conditional_classes
from ganpipe.dist import DistContext
from ganpipe.ema import EmaGenerator
from ganpipe.params import Params
from ganpipe.sampling import grid_labels, snapshot
from ganpipe.strategies import STRATEGIES
from ganpipe.stream import Stream, data_position, latents
from ganpipe.trainlog import Meter, TrainLogger

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """The trained networks (on CPU, unwrapped) and how far training went."""

    g: torch.nn.Module
    d: torch.nn.Module
    g_ema: EmaGenerator
    num_classes: int | None
    """Classes of a conditional model (None: unconditional)."""
    images_seen: int
    iterations: int
    skipped_steps: dict[str, int]
    """Optimizer steps the fp16 GradScalers skipped, per network (``g``, ``d``)."""


class TrainingInterrupted(Exception):
    """Training stopped on request (SIGTERM / SIGINT) after saving a checkpoint."""

    def __init__(self, images_seen: int, checkpoint: Path | None):
        super().__init__(f"interrupted after {images_seen} images; checkpoint {checkpoint}")
        self.images_seen = images_seen
        self.checkpoint = checkpoint


def train(
    params: Params,
    dataset: Dataset,
    context: DistContext | torch.device,
    logger: TrainLogger | None = None,
    progress: bool = True,
    run_dir: Path | None = None,
    should_stop: Callable[[], bool] | None = None,
    fingerprint: str = "",
) -> TrainResult:
    """Train G and D on ``dataset`` as ``params`` says, on one process or as one DDP rank.

    One iteration makes ``train.n_critic`` D updates (each on its own global batch) and one
    G update; training stops once ``train.kimg`` thousand real images have been shown to D
    (counted over all ranks). Only the main rank logs; logged values are means over ranks.

    With ``run_dir``, a full-state checkpoint is written there every
    ``train.checkpoint_kimg`` and at the end, and training resumes from the newest valid
    one made with the same ``fingerprint`` (see :func:`checkpoint.run_fingerprint`):
    batches and latents are functions of the step, RNG states are restored per rank, so a
    resumed run ends with the same bytes as one never stopped, and the log up to the
    checkpoint is written again before training goes on. ``should_stop`` (SIGTERM /
    SIGINT) is polled every iteration by one process, at every log and checkpoint interval
    under DDP: the run saves a checkpoint and raises :class:`TrainingInterrupted`.

    Raises:
        ValueError: the batch does not fit the dataset.
        FloatingPointError: a loss (or, before a checkpoint, a weight) became NaN or
            infinite in fp32/bf16 (the message names the step, the strategy and the loss);
            the last good checkpoint is kept. fp16 leaves inf/NaN to the GradScalers, which
            skip those steps; they are counted in ``amp/skipped_steps/{g,d}``.
        TrainingInterrupted: ``should_stop`` turned true; a checkpoint was saved.
    """
    if isinstance(context, torch.device):
        context = DistContext(device=context)
    cfg, device = params.train, context.device
    if len(dataset) < cfg.batch_size:
        raise ValueError(
            f"train.batch_size={cfg.batch_size} is larger than the training set "
            f"({len(dataset)} images); lower it or add data"
        )
    num_classes = conditional_classes(params, dataset)
    gan, g_ema = build_gan(params, context, num_classes)
    ada = adaptive_p(params, gan, context)
    logger = logger if context.is_main else None
    run, resumed = runstate.Progress(), None
    if run_dir is not None:
        run, resumed = runstate.resume(
            gan, g_ema, context, run_dir, fingerprint, len(dataset), cfg.batch_size, cfg.n_critic
        )
        if resumed is not None:
            runstate.replay(logger, run_dir, resumed)
    start = run.iteration
    # after resume: a CUDA graph captures the restored state, in place
    step = graphed.iteration(STRATEGIES[cfg.strategy], gan, params, context)
    per_iteration = cfg.batch_size * cfg.n_critic

    iterations = math.ceil(cfg.kimg * 1000 / per_iteration)
    if start > iterations:
        log.warning(
            "the checkpoint has %d images, more than train.kimg=%s asks for; its "
            "weights are used as they are",
            start * per_iteration,
            cfg.kimg,
        )
    log_every = max(1, round(cfg.log_every_kimg * 1000 / per_iteration))
    snapshot_every = max(1, round(cfg.snapshot_kimg * 1000 / per_iteration))
    checkpoint_every = max(1, round(cfg.checkpoint_kimg * 1000 / per_iteration))
    stream = Stream(params, dataset, context, start, iterations, num_classes)
    meter = Meter(params, context, run)
    fixed_z = latents(params.seed, -1, params.generate.grid_rows**2, params.model.z_dim)
    fixed_z = fixed_z.to(device)
    fixed_y = None  # a conditional grid shows one class per row
    if num_classes is not None:
        fixed_y = grid_labels(params.generate.grid_rows, params.generate.grid_rows, num_classes)
        fixed_y = fixed_y.to(device)
    keeps_grids = context.is_main and (logger is not None or run_dir is not None)

    gan.g.train()
    gan.d.train()
    bar = tqdm(
        total=iterations * per_iteration,
        initial=min(start, iterations) * per_iteration,
        unit="img",
        unit_scale=True,
        desc="train",
        disable=not (progress and context.is_main),
        mininterval=1.0,
        dynamic_ncols=True,
    )
    with bar:
        for it in range(start, iterations):
            stats = step(stream.next(it))
            if ada is not None:
                ada.update(stats["d/real_sign"], context.all_sum)
            g_ema.update(dist.unwrap(gan.g), per_iteration)
            meter.add(it, stats)
            bar.update(per_iteration)

            done = run.iteration = it + 1
            images_seen = done * per_iteration
            at_log = done % log_every == 0 or done == iterations
            at_checkpoint = run_dir is not None and (
                done % checkpoint_every == 0 or done == iterations
            )
            # One process reads its own flag every step. Under DDP a read is an all-reduce
            # (a wait for the slowest rank), so the ranks agree at log and checkpoint
            # intervals only.
            if should_stop is None:
                stop = False
            elif context.world_size == 1:
                stop = should_stop()
            else:
                stop = (at_log or at_checkpoint) and context.any(should_stop())
            if at_log:
                # Two small all-reduces and one host sync per logging interval, none per step.
                meter.check_finite(done, stats)
                means = meter.record(done, gan)
                if logger is not None:
                    logger.log_scalars(images_seen, means)
                bar.set_postfix(
                    {"loss/d": f"{means['loss/d']:.3f}", "loss/g": f"{means['loss/g']:.3f}"},
                    refresh=False,
                )
            if keeps_grids and (done % snapshot_every == 0 or done == iterations):
                grid = snapshot(g_ema, fixed_z, params.generate.grid_rows, fixed_y)
                if logger is not None:
                    logger.log_grid(images_seen, grid)
                if run_dir is not None:
                    runstate.save_grid(run_dir, images_seen, grid)
            if at_checkpoint or (run_dir is not None and stop):
                meter.check_finite(done, stats)  # never checkpoint a diverged state
                if not runstate.weights_are_finite(gan, g_ema, context):
                    raise FloatingPointError(
                        f"non-finite weights after step {done} (train.strategy="
                        f"{cfg.strategy}, train.loss={cfg.loss}, precision={params.precision});"
                        " the last good checkpoint is kept; lower train.lr_g / train.lr_d"
                    )
                path = runstate.save(
                    gan,
                    g_ema,
                    context,
                    run_dir,
                    cfg.keep_checkpoints,
                    fingerprint,
                    run,
                    images_seen,
                    data_position(done * cfg.n_critic, len(dataset), cfg.batch_size),
                )
            if stop:
                raise TrainingInterrupted(images_seen, path if run_dir is not None else None)
    skipped = gan.skipped_steps()
    if any(skipped.values()):
        log.warning(
            "the fp16 GradScalers skipped %d G and %d D optimizer steps",
            skipped["g"],
            skipped["d"],
        )
    log.info("trained %d iterations, %.1f kimg", iterations, iterations * per_iteration / 1000)
    g, d = dist.unwrap(gan.g), dist.unwrap(gan.d)
    return TrainResult(
        g.cpu(), d.cpu(), g_ema.cpu(), num_classes, iterations * per_iteration, iterations, skipped
    )
