"""A training run's bookkeeping around the step: exact resume, progress grids, FID/KID while
training with the best EMA so far, and full-state checkpoints, in one :class:`Checkpointer`.

:mod:`ganpipe.checkpoint` writes and verifies the files; this module decides what a
training run puts in them and how it continues from one: networks, optimizers, scalers,
every rank's RNG states, the data position, the log so far (the metric history among it),
the statistics not yet logged and the best EMA, so that a resumed run ends with the same
bytes as one never stopped.
"""

from __future__ import annotations

import io
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ganpipe import checkpoint, dist, runtime, trainmetrics
from ganpipe.dist import DistContext
from ganpipe.ema import EmaGenerator
from ganpipe.errors import TrainingDivergedError
from ganpipe.params import Params
from ganpipe.sampling import grid_labels, snapshot
from ganpipe.strategies import Gan, Stats
from ganpipe.stream import data_position, latents
from ganpipe.trainlog import Meter, Progress, TrainLogger
from ganpipe.trainmetrics import Ruler

log = logging.getLogger(__name__)

#: What :meth:`Checkpointer.resume` reads from a checkpoint besides what every one holds.
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
    "best",
    "measured_with",
}


class Checkpointer:
    """One run's state across intervals and restarts, beside the training step.

    At the intervals of ``params.train`` (and after the last iteration) it logs progress
    grids of fixed latents (``snapshot_kimg``), measures FID/KID of the EMA with ``ruler``
    (``metrics_kimg``; the lowest FID's EMA is kept as ``progress.best``) and, with
    ``run_dir``, writes full-state checkpoints (``checkpoint_kimg``). :meth:`resume`
    continues from the newest valid checkpoint made with the same ``fingerprint`` (see
    :func:`checkpoint.run_fingerprint`): batches and latents are functions of the step, RNG
    states are restored per rank, so a resumed run ends with the same bytes as one never
    stopped, and the log up to the checkpoint (metric history included) is written again.
    Only the main rank writes; the others take part in the collectives.
    """

    def __init__(
        self,
        params: Params,
        gan: Gan,
        g_ema: EmaGenerator,
        context: DistContext,
        num_items: int,
        num_classes: int | None,
        logger: TrainLogger | None = None,
        run_dir: Path | None = None,
        fingerprint: str = "",
        ruler: Ruler | None = None,
    ):
        cfg = params.train
        self.params, self.gan, self.g_ema, self.context = params, gan, g_ema, context
        self.num_items, self.num_classes = num_items, num_classes
        self.logger, self.run_dir, self.fingerprint = logger, run_dir, fingerprint
        self.ruler = ruler if cfg.metrics_kimg > 0 else None
        self.per_iteration = cfg.batch_size * cfg.n_critic
        self.iterations = math.ceil(cfg.kimg * 1000 / self.per_iteration)
        self.progress = Progress()
        keeps_grids = context.is_main and (logger is not None or run_dir is not None)
        intervals = {
            "log": cfg.log_every_kimg,
            "grid": cfg.snapshot_kimg if keeps_grids else 0,
            "metrics": cfg.metrics_kimg if self.ruler is not None else 0,
            "checkpoint": cfg.checkpoint_kimg if run_dir is not None else 0,
        }
        self.every = {
            name: max(1, round(kimg * 1000 / self.per_iteration)) if kimg > 0 else None
            for name, kimg in intervals.items()
        }
        rows = params.generate.grid_rows
        self.fixed_z = latents(params.seed, -1, rows**2, params.model.z_dim).to(context.device)
        self.fixed_y = None  # a conditional grid shows one class per row
        if num_classes is not None:
            self.fixed_y = grid_labels(rows, rows, num_classes).to(context.device)

    def due(self, name: str, done: int) -> bool:
        """Whether the ``name`` interval (log, grid, metrics, checkpoint) ends at ``done``
        iterations; every one that is on ends after the last iteration too."""
        every = self.every[name]
        return every is not None and (done % every == 0 or done == self.iterations)

    def resume(self) -> Progress:
        """Load this run's newest valid checkpoint (rank 0 reads, all ranks receive it) into
        the networks, write its log again and return the progress to continue from."""
        context, gan, run_dir = self.context, self.gan, self.run_dir
        if run_dir is None:
            return self.progress
        state = None
        if context.is_main:
            for stale in checkpoint.remove_stale_temporaries(run_dir):
                log.info("removed %s, left by an interrupted checkpoint write", stale.name)
            state = checkpoint.load_newest_checkpoint(
                run_dir, self.fingerprint, check=lambda state: check_fits(state, gan, self.g_ema)
            )
        state = context.broadcast_object(state)
        if state is None:
            log.info("no checkpoint in %s: training from the start", run_dir)
            return self.progress
        iteration = state["iteration"]
        batch_size, n_critic = self.params.train.batch_size, self.params.train.n_critic
        expected = data_position(iteration * n_critic, self.num_items, batch_size)
        if state["data"] != expected:
            raise checkpoint.CheckpointError(
                f"checkpoint {state['path']} stopped at data position {state['data']}, but "
                f"{iteration} iterations over {self.num_items} images in batches of "
                f"{batch_size} end at {expected}; the training set changed: delete {run_dir} "
                "to start afresh"
            )
        dist.unwrap(gan.g).load_state_dict(state["g"])
        dist.unwrap(gan.d).load_state_dict(state["d"])
        self.g_ema.load_state_dict(state["g_ema"])
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
        history, best = self._metric_history(state)
        self.progress = Progress(iteration, history, sums, state["unlogged"]["since"], best)
        self._replay(state["images_seen"])
        if iteration > self.iterations:
            log.warning(
                "the checkpoint has %d images, more than train.kimg=%s asks for; its "
                "weights are used as they are",
                state["images_seen"],
                self.params.train.kimg,
            )
        return self.progress

    def _metric_history(self, state: dict) -> tuple[list, dict | None]:
        """The checkpoint's log and best point; its measurements only if this run measures
        with the same ruler (a different one would mix two scales in one curve)."""
        history, best = list(state["log"]), state["best"]
        mine = None if self.ruler is None else self.ruler.identity
        if state["measured_with"] == mine:
            return history, best
        kept = []
        for seen, scalars in history:
            measured = (trainmetrics.CURVE_PREFIX, trainmetrics.BEST_PREFIX)
            rest = {k: v for k, v in scalars.items() if not k.startswith(measured)}
            if rest:
                kept.append([seen, rest])
        if best is not None:
            log.warning(
                "the FID/KID history of checkpoint %s was measured with other settings or "
                "another feature network / val split (%s, now %s); it is dropped, and the "
                "curve and the best snapshot start again from here",
                state["path"],
                state["measured_with"],
                mine,
            )
        return kept, None

    def _replay(self, images_seen: int) -> None:
        """Write the log of the run up to ``images_seen`` again: scalars and grids."""
        if self.logger is None:
            return
        for seen, scalars in self.progress.history:
            self.logger.log_scalars(seen, scalars)
        for path in sorted((self.run_dir / "grids").glob("*.png")):
            if int(path.stem) <= images_seen:
                grid = np.asarray(Image.open(path))
                self.logger.log_grid(int(path.stem), grid[..., None] if grid.ndim == 2 else grid)

    def snapshot(self, done: int) -> None:
        """The progress grid and the metrics, where their intervals end at ``done``."""
        images_seen = done * self.per_iteration
        if self.due("grid", done):
            rows = self.params.generate.grid_rows
            grid = snapshot(self.g_ema, self.fixed_z, rows, self.fixed_y)
            if self.logger is not None:
                self.logger.log_grid(images_seen, grid)
            if self.run_dir is not None:
                save_grid(self.run_dir, images_seen, grid)
        if self.due("metrics", done):
            self.measure(images_seen)

    def measure(self, images_seen: int) -> dict[str, float]:
        """FID and KID of the EMA now, logged with the best point so far (kept with the
        EMA's weights when it is this one)."""
        z_dim, began = self.params.model.z_dim, time.perf_counter()
        scores = self.ruler.measure(self.g_ema.module, self.context, z_dim, self.num_classes)
        progress, fid, kid = self.progress, scores[trainmetrics.FID], scores[trainmetrics.KID]
        if trainmetrics.is_better(fid, progress.best):
            progress.best = {"images_seen": images_seen, "fid": fid, "kid": kid}
            if self.context.is_main:  # the weights that become models/g_ema_best.pt
                weights = self.g_ema.module.state_dict().items()
                progress.best["state_dict"] = {k: v.detach().cpu().clone() for k, v in weights}
        record = dict(scores)
        if progress.best is not None:
            record[trainmetrics.BEST_FID] = progress.best["fid"]
            record[trainmetrics.BEST_KIMG] = progress.best["images_seen"] / 1000
        took = time.perf_counter() - began  # benchmarks/train_metrics.py adds these up
        log.info(
            "%.1f kimg: FID %.4f, KID %.5f (measured in %.2f s)", images_seen / 1000, fid, kid, took
        )
        progress.history.append([images_seen, record])
        if self.logger is not None:
            self.logger.log_scalars(images_seen, record)
        return record

    def save(self, done: int, meter: Meter, stats: Stats) -> Path | None:
        """Write a full-state checkpoint (rank 0), with every rank's RNG states and sums,
        after checking that nothing diverged; its path on rank 0, else None (and without
        ``run_dir``).

        Raises:
            TrainingDivergedError: a loss or a weight is not finite; the last good checkpoint
                is kept.
        """
        if self.run_dir is None:
            return None
        gan, g_ema, context, progress = self.gan, self.g_ema, self.context, self.progress
        meter.check_finite(done, stats)  # never checkpoint a diverged state
        if not weights_are_finite(gan, g_ema, context):
            cfg = self.params.train
            raise TrainingDivergedError(
                f"non-finite weights after step {done} (train.strategy={cfg.strategy}, "
                f"train.loss={cfg.loss}, precision={self.params.precision}); the last good "
                "checkpoint is kept; lower train.lr_g / train.lr_d"
            )
        rngs = context.gather_objects(runtime.rng_state())
        sums = context.gather_objects({k: v.cpu() for k, v in progress.sums.items()})
        path = None
        if context.is_main:
            cfg = self.params.train
            images_seen = done * self.per_iteration
            state = {
                "fingerprint": self.fingerprint,
                "iteration": progress.iteration,
                "images_seen": images_seen,
                "data": data_position(done * cfg.n_critic, self.num_items, cfg.batch_size),
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
                # A checkpoint between two log records: the next record must average the
                # same iterations as in a run that was never stopped.
                "unlogged": {"sums": sums, "since": progress.last_log},
                "best": progress.best,
                "measured_with": None if self.ruler is None else self.ruler.identity,
            }
            keep = cfg.keep_checkpoints
            path = checkpoint.save_checkpoint(state, self.run_dir, images_seen, keep)
        context.barrier()
        return path


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


def save_grid(run_dir: Path, images_seen: int, grid: np.ndarray) -> None:
    """Keep a progress grid beside the checkpoints (the log may be cleared before a resume)."""
    buffer = io.BytesIO()
    Image.fromarray(grid.squeeze(-1) if grid.shape[-1] == 1 else grid).save(buffer, "PNG")
    path = run_dir / "grids" / f"{images_seen:012d}.png"
    checkpoint.write_bytes_atomic(buffer.getvalue(), path)
