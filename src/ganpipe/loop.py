"""The training loop. Progress is counted in images shown to D, not in steps."""

from __future__ import annotations

import io
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm

from ganpipe import checkpoint, dist, runtime
from ganpipe.data.dataset import uint8_to_float
from ganpipe.dist import DistContext
from ganpipe.ema import EmaGenerator
from ganpipe.losses import build_loss
from ganpipe.nets import build_models
from ganpipe.params import Params, TrainParams
from ganpipe.sampling import image_grid
from ganpipe.strategies import STRATEGIES, Gan

log = logging.getLogger(__name__)


class TrainLogger(Protocol):
    """Where the loop reports; the train stage implements it with dvclive."""

    def log_scalars(self, images_seen: int, scalars: dict[str, float]) -> None: ...

    def log_grid(self, images_seen: int, grid: np.ndarray) -> None: ...


class EpochBatchSampler(Sampler[list[int]]):
    """This rank's part of global batches: epoch ``e`` is a permutation seeded by ``(seed, e)``.

    Global batch ``k`` of the run is a pure function of ``(seed, k)``, whatever the world
    size: rank ``r`` of ``w`` takes its ``r``-th contiguous ``1/w`` of it. So one process
    with the whole batch and ``w`` processes with a share each see the same global batches
    (what makes DDP equal to one process), and a run can start at any step (resume). This
    replaces ``DistributedSampler``, whose batches depend on the world size and which can
    only restart at an epoch boundary. The incomplete last batch of each epoch is dropped.
    """

    def __init__(
        self,
        num_items: int,
        batch_size: int,
        seed: int,
        start_step: int,
        steps: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.start_step, self.steps = start_step, steps
        self.steps_per_epoch = num_items // batch_size
        share = batch_size // world_size
        self.share = slice(rank * share, (rank + 1) * share)

    def __len__(self) -> int:
        return self.steps - self.start_step

    def __iter__(self) -> Iterator[list[int]]:
        epoch, order = -1, None
        for step in range(self.start_step, self.steps):
            if step // self.steps_per_epoch != epoch:
                epoch = step // self.steps_per_epoch
                order = torch.randperm(
                    self.num_items, generator=runtime.seeded_generator(self.seed, "epoch", epoch)
                )
            first = (step % self.steps_per_epoch) * self.batch_size
            yield order[first : first + self.batch_size][self.share].tolist()


def latents(seed: int, step: int, batch_size: int, z_dim: int) -> torch.Tensor:
    """The latents of global batch ``step``: a function of the seed and the step only."""
    return torch.randn(batch_size, z_dim, generator=runtime.seeded_generator(seed, "z", step))


@dataclass
class TrainResult:
    """The trained networks (on CPU, unwrapped) and how far training went."""

    g: torch.nn.Module
    d: torch.nn.Module
    g_ema: EmaGenerator
    images_seen: int
    iterations: int
    skipped_steps: dict[str, int]
    """Optimizer steps the fp16 GradScalers skipped, per network (``g``, ``d``)."""


def scaled_lr(lr: float, train: TrainParams) -> float:
    """``lr`` at ``train.batch_size`` under ``train.lr_scaling`` from ``reference_batch``."""
    ratio = train.batch_size / train.reference_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[train.lr_scaling]


def build_gan(params: Params, context: DistContext | torch.device) -> tuple[Gan, EmaGenerator]:
    """G, D (DDP-wrapped when distributed), optimizers, loss, precision tools, EMA of G."""
    if isinstance(context, torch.device):
        context = DistContext(device=context)
    cfg, device = params.train, context.device
    g, d = build_models(
        params.model,
        params.data.image_size,
        params.data.channels,
        runtime.seeded_generator(params.seed, "init"),
        cfg.activation_checkpointing,
    )
    g_ema = EmaGenerator(g, cfg.ema_kimg).to(device)
    sync_bn = params.model.norm == "sync_batch"
    g, d = dist.wrap(g.to(device), context, sync_bn), dist.wrap(d.to(device), context, sync_bn)

    def optimizer(net: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(net.parameters(), lr=scaled_lr(lr, cfg))
        return torch.optim.Adam(net.parameters(), lr=scaled_lr(lr, cfg), betas=cfg.betas)

    gan = Gan(
        g=g,
        d=d,
        opt_g=optimizer(g, cfg.lr_g),
        opt_d=optimizer(d, cfg.lr_d),
        loss=build_loss(cfg),
        scaler_g=runtime.grad_scaler(params.precision, device),
        scaler_d=runtime.grad_scaler(params.precision, device),
        autocast=runtime.autocast_factory(params.precision, device),
        grad_accum=cfg.grad_accum,
    )
    return gan, g_ema


def to_device_images(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a batch to the device; uint8 batches (a quarter of the bytes) convert there."""
    batch = batch.to(device, non_blocking=True)
    return uint8_to_float(batch) if batch.dtype == torch.uint8 else batch


class TrainingInterrupted(Exception):
    """Training stopped on request (SIGTERM / SIGINT) after saving a checkpoint."""

    def __init__(self, images_seen: int, checkpoint: Path | None):
        super().__init__(f"interrupted after {images_seen} images; checkpoint {checkpoint}")
        self.images_seen = images_seen
        self.checkpoint = checkpoint


@dataclass
class _Progress:
    """What the loop carries from iteration to iteration besides the networks."""

    iteration: int = 0
    history: list = field(default_factory=list)
    """Every logged record so far, ``[images_seen, scalars]``: replayed into the log on resume."""
    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-step statistics summed since the last logged record (on the device)."""
    last_log: int = 0
    """The iteration of the last logged record."""


def data_position(batches_done: int, num_items: int, batch_size: int) -> dict[str, int]:
    """Where the data stream stands after ``batches_done`` global batches."""
    per_epoch = num_items // batch_size
    return {"epoch": batches_done // per_epoch, "offset": batches_done % per_epoch}


def _save_grid(run_dir: Path, images_seen: int, grid: np.ndarray) -> None:
    """Keep a progress grid beside the checkpoints (the log may be cleared before a resume)."""
    buffer = io.BytesIO()
    Image.fromarray(grid.squeeze(-1) if grid.shape[-1] == 1 else grid).save(buffer, "PNG")
    path = run_dir / "grids" / f"{images_seen:012d}.png"
    checkpoint.write_bytes_atomic(buffer.getvalue(), path)


def _replay(logger: TrainLogger | None, run_dir: Path, state: dict) -> None:
    """Write the log of the run up to the checkpoint ``state`` again: scalars and grids."""
    if logger is None:
        return
    for seen, scalars in state["log"]:
        logger.log_scalars(seen, scalars)
    for path in sorted((run_dir / "grids").glob("*.png")):
        if int(path.stem) <= state["images_seen"]:
            grid = np.asarray(Image.open(path))
            logger.log_grid(int(path.stem), grid[..., None] if grid.ndim == 2 else grid)


def _resume(
    gan: Gan,
    g_ema: EmaGenerator,
    context: DistContext,
    run_dir: Path,
    fingerprint: str,
    num_items: int,
    batch_size: int,
    n_critic: int,
) -> tuple[_Progress, dict | None]:
    """Load the newest valid checkpoint of this run (rank 0 reads, all ranks receive it).

    Returns the progress to continue from and the checkpoint (None without one).
    """
    state = None
    if context.is_main:
        for stale in checkpoint.remove_stale_temporaries(run_dir):
            log.info("removed %s, left by an interrupted checkpoint write", stale.name)
        state = checkpoint.load_newest_checkpoint(
            run_dir, fingerprint, check=lambda state: _check_fits(state, gan, g_ema)
        )
    state = context.broadcast_object(state)
    if state is None:
        log.info("no checkpoint in %s: training from the start", run_dir)
        return _Progress(), None
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
    gan.skipped.update(state["skipped_steps"])
    runtime.set_rng_state(state["rng"][context.rank])
    log.info("resumed from %s (%d images seen)", state["path"], state["images_seen"])
    mine = state["unlogged"]["sums"][context.rank]
    sums = {k: v.to(context.device) for k, v in mine.items()}
    return _Progress(iteration, list(state["log"]), sums, state["unlogged"]["since"]), state


#: What :func:`_resume` reads from a checkpoint besides what every checkpoint holds.
RESUME_KEYS = {
    "data",
    "opt_g",
    "opt_d",
    "scaler_g",
    "scaler_d",
    "skipped_steps",
    "rng",
    "log",
    "unlogged",
}


def _check_fits(state: dict, gan: Gan, g_ema: EmaGenerator) -> None:
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


def _weights_are_finite(gan: Gan, g_ema: EmaGenerator, context: DistContext) -> bool:
    """All weights of G, D and the EMA finite, on every rank (one host sync)."""
    tensors = [*gan.g.parameters(), *gan.d.parameters(), *g_ema.parameters()]
    bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).any().float()
    return context.all_max(bad).item() == 0


def _save(
    gan: Gan,
    g_ema: EmaGenerator,
    context: DistContext,
    run_dir: Path,
    keep: int,
    fingerprint: str,
    progress: _Progress,
    images_seen: int,
    data: dict[str, int],
) -> Path | None:
    """Write a full-state checkpoint (rank 0), with every rank's RNG states and sums."""
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
    cfg, seed, device = params.train, params.seed, context.device
    if len(dataset) < cfg.batch_size:
        raise ValueError(
            f"train.batch_size={cfg.batch_size} is larger than the training set "
            f"({len(dataset)} images); lower it or add data"
        )
    gan, g_ema = build_gan(params, context)
    logger = logger if context.is_main else None
    run, resumed = _Progress(), None
    if run_dir is not None:
        run, resumed = _resume(
            gan, g_ema, context, run_dir, fingerprint, len(dataset), cfg.batch_size, cfg.n_critic
        )
        if resumed is not None:
            _replay(logger, run_dir, resumed)
    start = run.iteration
    strategy = STRATEGIES[cfg.strategy]
    z_dim, per_iteration = params.model.z_dim, cfg.batch_size * cfg.n_critic
    mine = context.local_slice(cfg.batch_size)

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
    sampler = EpochBatchSampler(
        len(dataset),
        cfg.batch_size,
        seed,
        min(start, iterations) * cfg.n_critic,
        iterations * cfg.n_critic,
        context.rank,
        context.world_size,
    )
    # Workers hold no random state the run uses (decoding is deterministic), so seeding
    # them from the start-of-run generator again after a resume changes no bits.
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.num_workers,
        worker_init_fn=runtime.seed_worker,
        generator=runtime.seeded_generator(seed, "workers", context.rank),
        pin_memory=device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
    batches = iter(loader)
    fixed_z = latents(seed, -1, params.generate.grid_rows**2, z_dim).to(device)
    keeps_grids = context.is_main and (logger is not None or run_dir is not None)
    track_finite = params.precision != "fp16"

    gan.g.train()
    gan.d.train()
    # The first non-finite step, tracked on the device: no host sync per step.
    first_bad = torch.full((), -1.0, device=device)
    since, timed_from = time.perf_counter(), start

    def check_finite(done: int, stats: dict[str, torch.Tensor]) -> None:
        bad_step = context.all_max(first_bad.clone()).item()  # -1: all finite
        if bad_step >= 0:
            raise FloatingPointError(
                f"non-finite loss at step {int(bad_step) + 1} "
                f"(train.strategy={cfg.strategy}, train.loss={cfg.loss}, "
                f"precision={params.precision}, loss/d={stats['loss/d'].item():.4g}, "
                f"loss/g={stats['loss/g'].item():.4g} at step {done}); lower "
                "train.lr_g / train.lr_d, or use precision fp32"
            )

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
            first_batch = it * cfg.n_critic
            reals = [to_device_images(next(batches)[0], device) for _ in range(cfg.n_critic)]
            zs = [
                latents(seed, first_batch + k, cfg.batch_size, z_dim)[mine].to(device)
                for k in range(cfg.n_critic)
            ]
            stats = strategy(gan, reals, zs)
            g_ema.update(dist.unwrap(gan.g), per_iteration)
            if track_finite:
                finite = torch.isfinite(stats["loss/d"]) & torch.isfinite(stats["loss/g"])
                first_bad = torch.where((first_bad < 0) & ~finite, float(it), first_bad)
            for key, value in stats.items():
                run.sums[key] = run.sums.get(key, 0) + value.float()
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
                check_finite(done, stats)
                keys = sorted(run.sums)
                totals = context.all_sum(torch.stack([run.sums[k] for k in keys])).tolist()
                now = time.perf_counter()
                count = (done - run.last_log) * context.world_size
                means = {k: v / count for k, v in zip(keys, totals, strict=False)}
                means["perf/images_per_s"] = (done - timed_from) * per_iteration / (now - since)
                means["perf/step_ms"] = 1000 * (now - since) / (done - timed_from)
                means["perf/peak_memory_mb"] = runtime.peak_memory_mb(device)
                means["kimg"] = images_seen / 1000
                means["lr/g"] = gan.opt_g.param_groups[0]["lr"]
                means["lr/d"] = gan.opt_d.param_groups[0]["lr"]
                if gan.scaler_g.is_enabled():
                    skipped = gan.skipped_steps()
                    for net, scaler in (("g", gan.scaler_g), ("d", gan.scaler_d)):
                        means[f"amp/skipped_steps/{net}"] = float(skipped[net])
                        means[f"amp/scale/{net}"] = scaler.get_scale()
                if logger is not None:
                    logger.log_scalars(images_seen, means)
                run.history.append([images_seen, means])
                bar.set_postfix(
                    {"loss/d": f"{means['loss/d']:.3f}", "loss/g": f"{means['loss/g']:.3f}"},
                    refresh=False,
                )
                run.sums, run.last_log, since, timed_from = {}, done, now, done
            if keeps_grids and (done % snapshot_every == 0 or done == iterations):
                grid = snapshot(g_ema, fixed_z, params.generate.grid_rows)
                if logger is not None:
                    logger.log_grid(images_seen, grid)
                if run_dir is not None:
                    _save_grid(run_dir, images_seen, grid)
            if at_checkpoint or (run_dir is not None and stop):
                check_finite(done, stats)  # never checkpoint a diverged state
                if not _weights_are_finite(gan, g_ema, context):
                    raise FloatingPointError(
                        f"non-finite weights after step {done} (train.strategy="
                        f"{cfg.strategy}, train.loss={cfg.loss}, precision={params.precision});"
                        " the last good checkpoint is kept; lower train.lr_g / train.lr_d"
                    )
                path = _save(
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
        g.cpu(), d.cpu(), g_ema.cpu(), iterations * per_iteration, iterations, skipped
    )


@torch.no_grad()
def snapshot(generator: torch.nn.Module, z: torch.Tensor, rows: int) -> np.ndarray:
    """A ``rows x rows`` grid (HWC uint8) from fixed latents, with G in eval mode."""
    was_training = generator.training
    generator.eval()
    images = generator(z).float().cpu()
    generator.train(was_training)
    return image_grid(images, rows)
