"""A run's statistics: summed on the device every step, read and logged at intervals.

Nothing here waits for the device inside a step: per-step losses, scores and gradient
norms add up on the device, and the first non-finite loss is remembered there as a step
number. At a log interval two small all-reduces and one host read turn the sums into the
means over ranks and iterations that the logger receives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from ganpipe import runtime
from ganpipe.dist import DistContext
from ganpipe.errors import TrainingDivergedError
from ganpipe.params import Params
from ganpipe.strategies import Gan, Stats


@dataclass
class Progress:
    """What a run carries from iteration to iteration besides the networks (what a
    checkpoint of :mod:`ganpipe.runstate` keeps of it, to continue the log exactly)."""

    iteration: int = 0
    history: list = field(default_factory=list)
    """Every logged record so far, ``[images_seen, scalars]``: replayed into the log on resume
    (the metrics measured while training among them)."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-step statistics summed since the last logged record (on the device)."""
    last_log: int = 0
    """The iteration of the last logged record."""
    best: dict | None = None
    """The lowest FID measured while training: ``images_seen``, ``fid``, ``kid`` and, on
    the main rank, the EMA's ``state_dict`` (CPU) at that point; None before any."""


class TrainLogger(Protocol):
    """Where training reports; the train stage implements it with dvclive."""

    def log_scalars(self, images_seen: int, scalars: dict[str, float]) -> None: ...

    def log_grid(self, images_seen: int, grid: np.ndarray) -> None: ...


class Meter:
    """Accumulates a run's per-step statistics into ``progress`` and makes its log records."""

    def __init__(self, params: Params, context: DistContext, progress: Progress):
        self.params, self.context, self.progress = params, context, progress
        self.per_iteration = params.train.batch_size * params.train.n_critic
        # fp16 leaves inf/NaN losses to the GradScalers, which skip those steps.
        self.track_finite = params.precision != "fp16"
        # The first non-finite step, tracked on the device: no host sync per step.
        self.first_bad = torch.full((), -1.0, device=context.device)
        self.since, self.timed_from = time.perf_counter(), progress.iteration

    def add(self, iteration: int, stats: Stats) -> None:
        """Add iteration ``iteration``'s statistics (device tensors) to the sums."""
        if self.track_finite:
            finite = torch.isfinite(stats["loss/d"]) & torch.isfinite(stats["loss/g"])
            bad = (self.first_bad < 0) & ~finite
            self.first_bad = torch.where(bad, float(iteration), self.first_bad)
        sums = self.progress.sums
        for key, value in stats.items():
            sums[key] = sums.get(key, 0) + value.float()

    def check_finite(self, done: int, stats: Stats) -> None:
        """Raise :class:`TrainingDivergedError` naming the first non-finite step, on every rank."""
        bad_step = self.context.all_max(self.first_bad.clone()).item()  # -1: all finite
        if bad_step >= 0:
            params = self.params
            raise TrainingDivergedError(
                f"non-finite loss at step {int(bad_step) + 1} "
                f"(train.strategy={params.train.strategy}, train.loss={params.train.loss}, "
                f"precision={params.precision}, loss/d={stats['loss/d'].item():.4g}, "
                f"loss/g={stats['loss/g'].item():.4g} at step {done}); lower "
                "train.lr_g / train.lr_d, or use precision fp32"
            )

    def record(self, done: int, gan: Gan) -> dict[str, float]:
        """The means over ranks and iterations since the last record, with speed, memory,
        learning rates and (fp16) the scalers' state; appended to the run's history."""
        progress, context = self.progress, self.context
        keys = sorted(progress.sums)
        totals = context.all_sum(torch.stack([progress.sums[k] for k in keys])).tolist()
        now = time.perf_counter()
        count = (done - progress.last_log) * context.world_size
        means = {k: v / count for k, v in zip(keys, totals, strict=True)}
        images_seen, per_iteration = done * self.per_iteration, self.per_iteration
        means["perf/images_per_s"] = (done - self.timed_from) * per_iteration / (now - self.since)
        means["perf/step_ms"] = 1000 * (now - self.since) / (done - self.timed_from)
        means["perf/peak_memory_mb"] = runtime.peak_memory_mb(context.device)
        means["kimg"] = images_seen / 1000
        means["lr/g"] = gan.opt_g.param_groups[0]["lr"]
        means["lr/d"] = gan.opt_d.param_groups[0]["lr"]
        if gan.augment is not None:
            means["augment/p"] = gan.augment.p.item()
        if gan.scaler_g.is_enabled():
            skipped = gan.skipped_steps()
            for net, scaler in (("g", gan.scaler_g), ("d", gan.scaler_d)):
                means[f"amp/skipped_steps/{net}"] = float(skipped[net])
                means[f"amp/scale/{net}"] = scaler.get_scale()
        progress.history.append([images_seen, means])
        progress.sums, progress.last_log = {}, done
        self.since, self.timed_from = now, done
        return means
