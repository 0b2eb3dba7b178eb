"""The training loop. Progress is counted in images shown to D, not in steps.

The loop only sequences one job each of: :mod:`ganpipe.build` (the GAN from the params),
:mod:`ganpipe.stream` (each iteration's batches and latents), :mod:`ganpipe.strategies`
(one iteration's updates), :mod:`ganpipe.graphed` (that iteration captured in a CUDA graph
on a GPU), :mod:`ganpipe.trainlog` (statistics and log records) and :mod:`ganpipe.runstate`
(grids, metrics and the best snapshot, checkpoints and exact resume).
"""

from __future__ import annotations

import logging
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
from ganpipe.errors import UserError
from ganpipe.params import Params
from ganpipe.strategies import STRATEGIES, Gan
from ganpipe.stream import Stream
from ganpipe.trainlog import Meter, TrainLogger
from ganpipe.trainmetrics import Ruler

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
    best: dict | None = None
    """The lowest FID measured while training (``images_seen``, ``fid``, ``kid`` and the
    EMA's ``state_dict`` then); None without metrics."""


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
    ruler: Ruler | None = None,
) -> TrainResult:
    """Train G and D on ``dataset`` as ``params`` says, on one process or as one DDP rank.

    One iteration makes ``train.n_critic`` D updates (each on its own global batch) and one
    G update; training stops once ``train.kimg`` thousand real images have been shown to D
    (counted over all ranks). Only the main rank logs; logged values are means over ranks.
    Grids, FID/KID with ``ruler`` (every ``train.metrics_kimg``; under DDP every rank passes
    one, the main rank's with the extractor), checkpoints in ``run_dir`` and exact resume
    from them: see :class:`runstate.Checkpointer`. ``should_stop``
    (SIGTERM / SIGINT) is polled every iteration by one process, at every log and
    checkpoint interval under DDP: the run saves a checkpoint and raises
    :class:`TrainingInterrupted`.

    Raises:
        UserError: the batch does not fit the dataset.
        TrainingDivergedError: a loss (or, before a checkpoint, a weight) became NaN or
            infinite in fp32/bf16 (the message names the step, the strategy and the loss);
            the last good checkpoint is kept. fp16 leaves inf/NaN to the GradScalers, which
            skip those steps; they are counted in ``amp/skipped_steps/{g,d}``.
        TrainingInterrupted: ``should_stop`` turned true; a checkpoint was saved.
    """
    if isinstance(context, torch.device):
        context = DistContext(device=context)
    cfg = params.train
    if len(dataset) < cfg.batch_size:
        raise UserError(
            f"train.batch_size={cfg.batch_size} is larger than the training set "
            f"({len(dataset)} images); lower it or add data"
        )
    num_classes = conditional_classes(params, dataset)
    gan, g_ema = build_gan(params, context, num_classes)
    ada = adaptive_p(params, gan, context)
    logger = logger if context.is_main else None
    keeper = runstate.Checkpointer(
        params, gan, g_ema, context, len(dataset), num_classes, logger, run_dir, fingerprint, ruler
    )
    run = keeper.resume()
    # after resume: a CUDA graph captures the restored state, in place
    step = graphed.iteration(STRATEGIES[cfg.strategy], gan, params, context)
    start, iterations, per_iteration = run.iteration, keeper.iterations, keeper.per_iteration
    stream = Stream(params, dataset, context, start, iterations, num_classes)
    meter = Meter(params, context, run)
    gan.g.train()
    gan.d.train()
    with _progress_bar(iterations, start, per_iteration, progress and context.is_main) as bar:
        for it in range(start, iterations):
            stats = step(stream.next(it))
            if ada is not None:
                ada.update(stats["d/real_sign"], context.all_sum)
            g_ema.update(dist.unwrap(gan.g), per_iteration)
            meter.add(it, stats)
            bar.update(per_iteration)

            done = run.iteration = it + 1
            at_log, at_checkpoint = keeper.due("log", done), keeper.due("checkpoint", done)
            stop = _stop_requested(should_stop, context, at_log or at_checkpoint)
            if at_log:
                # Two small all-reduces and one host sync per logging interval, none per step.
                meter.check_finite(done, stats)
                means = meter.record(done, gan)
                if logger is not None:
                    logger.log_scalars(done * per_iteration, means)
                bar.set_postfix(
                    {"loss/d": f"{means['loss/d']:.3f}", "loss/g": f"{means['loss/g']:.3f}"},
                    refresh=False,
                )
            keeper.snapshot(done)  # grids and metrics, before a checkpoint that keeps them
            if at_checkpoint or stop:
                path = keeper.save(done, meter, stats)
            if stop:
                raise TrainingInterrupted(done * per_iteration, path)
    return _result(gan, g_ema, num_classes, iterations, per_iteration, run.best)


def _progress_bar(iterations: int, start: int, per_iteration: int, show: bool) -> tqdm:
    return tqdm(
        total=iterations * per_iteration,
        initial=min(start, iterations) * per_iteration,
        unit="img",
        unit_scale=True,
        desc="train",
        disable=not show,
        mininterval=1.0,
        dynamic_ncols=True,
    )


def _stop_requested(
    should_stop: Callable[[], bool] | None, context: DistContext, at_interval: bool
) -> bool:
    """One process reads its own flag every step. Under DDP a read is an all-reduce (a wait
    for the slowest rank), so the ranks agree at log and checkpoint intervals only."""
    if should_stop is None:
        return False
    if context.world_size == 1:
        return should_stop()
    return at_interval and context.any(should_stop())


def _result(
    gan: Gan,
    g_ema: EmaGenerator,
    num_classes: int | None,
    iterations: int,
    per_iteration: int,
    best: dict | None,
) -> TrainResult:
    skipped = gan.skipped_steps()
    if any(skipped.values()):
        log.warning(
            "the fp16 GradScalers skipped %d G and %d D optimizer steps",
            skipped["g"],
            skipped["d"],
        )
    log.info("trained %d iterations, %.1f kimg", iterations, iterations * per_iteration / 1000)
    g, d = dist.unwrap(gan.g), dist.unwrap(gan.d)
    images_seen = iterations * per_iteration
    return TrainResult(
        g.cpu(), d.cpu(), g_ema.cpu(), num_classes, images_seen, iterations, skipped, best
    )
