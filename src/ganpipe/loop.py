"""The training loop. Progress is counted in images shown to D, not in steps."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm

from ganpipe import runtime
from ganpipe.data.dataset import uint8_to_float
from ganpipe.ema import EmaGenerator
from ganpipe.losses import LOSSES
from ganpipe.nets import build_models
from ganpipe.params import Params
from ganpipe.sampling import image_grid
from ganpipe.strategies import STRATEGIES, Gan

log = logging.getLogger(__name__)


class TrainLogger(Protocol):
    """Where the loop reports; the train stage implements it with dvclive."""

    def log_scalars(self, images_seen: int, scalars: dict[str, float]) -> None: ...

    def log_grid(self, images_seen: int, grid: np.ndarray) -> None: ...


class EpochBatchSampler(Sampler[list[int]]):
    """Global batches of indices: epoch ``e`` is a permutation seeded by ``(seed, e)``.

    Batch ``k`` of the run is a pure function of ``(seed, k)``, so a run can start at any
    step (resume) and see exactly the batches an uninterrupted run would. The incomplete
    last batch of each epoch is dropped.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int, start_step: int, steps: int):
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.start_step, self.steps = start_step, steps
        self.steps_per_epoch = num_items // batch_size

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
            yield order[first : first + self.batch_size].tolist()


def latents(seed: int, step: int, batch_size: int, z_dim: int) -> torch.Tensor:
    """The latents of step ``step``: a function of the seed and the step only."""
    return torch.randn(batch_size, z_dim, generator=runtime.seeded_generator(seed, "z", step))


@dataclass
class TrainResult:
    """The trained networks (on CPU) and how far training went."""

    g: torch.nn.Module
    d: torch.nn.Module
    g_ema: EmaGenerator
    images_seen: int
    steps: int


def train(
    params: Params,
    dataset: Dataset,
    device: torch.device,
    logger: TrainLogger | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train G and D on ``dataset`` as ``params`` says.

    Raises:
        ValueError: the batch does not fit the dataset.
        FloatingPointError: a loss became NaN or infinite (the message names the steps,
            the strategy and the loss).
    """
    cfg, seed = params.train, params.seed
    if len(dataset) < cfg.batch_size:
        raise ValueError(
            f"train.batch_size={cfg.batch_size} is larger than the training set "
            f"({len(dataset)} images); lower it or add data"
        )
    channels, size = params.data.channels, params.data.image_size
    g, d = build_models(params.model, size, channels, runtime.seeded_generator(seed, "init"))
    g, d = g.to(device), d.to(device)
    g_ema = EmaGenerator(g, cfg.ema_kimg)
    gan = Gan(
        g=g,
        d=d,
        opt_g=torch.optim.Adam(g.parameters(), lr=cfg.lr_g, betas=cfg.betas),
        opt_d=torch.optim.Adam(d.parameters(), lr=cfg.lr_d, betas=cfg.betas),
        loss=LOSSES[cfg.loss],
        scaler=runtime.grad_scaler(params.precision, device),
        autocast=runtime.autocast_factory(params.precision, device),
    )
    step_fn = STRATEGIES[cfg.strategy]

    total_steps = math.ceil(cfg.kimg * 1000 / cfg.batch_size)
    log_every = max(1, round(cfg.log_every_kimg * 1000 / cfg.batch_size))
    snapshot_every = max(1, round(cfg.snapshot_kimg * 1000 / cfg.batch_size))
    sampler = EpochBatchSampler(len(dataset), cfg.batch_size, seed, 0, total_steps)
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.num_workers,
        worker_init_fn=runtime.seed_worker,
        generator=runtime.seeded_generator(seed, "workers"),
        pin_memory=device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
    fixed_z = latents(seed, -1, params.generate.grid_rows**2, params.model.z_dim).to(device)

    g.train()
    d.train()
    sums: dict[str, torch.Tensor] = {}
    since, last_log_step = time.perf_counter(), 0
    bar = tqdm(
        total=total_steps * cfg.batch_size,
        unit="img",
        unit_scale=True,
        desc="train",
        disable=not progress,
        mininterval=1.0,
        dynamic_ncols=True,
    )
    with bar:
        for step, (real, _labels) in enumerate(loader):
            # uint8 batches (LmdbImageDataset(as_uint8=True)) cross to the device at a
            # quarter of the bytes and are converted there.
            real = real.to(device, non_blocking=True)
            if real.dtype == torch.uint8:
                real = uint8_to_float(real)
            z = latents(seed, step, cfg.batch_size, params.model.z_dim).to(device)
            stats = step_fn(gan, real, z)
            gan.scaler.update()
            g_ema.update(g, cfg.batch_size)
            for key, value in stats.items():
                sums[key] = sums.get(key, 0) + value
            bar.update(cfg.batch_size)

            done = step + 1
            images_seen = done * cfg.batch_size
            if done % log_every == 0 or done == total_steps:
                # .item() is a host-device sync: only here, once per logging interval.
                means = {k: v.item() / (done - last_log_step) for k, v in sums.items()}
                bad = [k for k, v in means.items() if not math.isfinite(v)]
                if bad:
                    raise FloatingPointError(
                        f"non-finite {', '.join(bad)} between steps {last_log_step + 1} and "
                        f"{done} (train.strategy={cfg.strategy}, train.loss={cfg.loss}, "
                        f"precision={params.precision}); lower the learning rates or use fp32"
                    )
                now = time.perf_counter()
                means["perf/images_per_s"] = (done - last_log_step) * cfg.batch_size / (now - since)
                means["kimg"] = images_seen / 1000
                means["lr/g"] = gan.opt_g.param_groups[0]["lr"]
                means["lr/d"] = gan.opt_d.param_groups[0]["lr"]
                if logger is not None:
                    logger.log_scalars(images_seen, means)
                bar.set_postfix(
                    {"loss/d": f"{means['loss/d']:.3f}", "loss/g": f"{means['loss/g']:.3f}"},
                    refresh=False,
                )
                sums, since, last_log_step = {}, now, done
            if logger is not None and (done % snapshot_every == 0 or done == total_steps):
                logger.log_grid(images_seen, snapshot(g_ema, fixed_z, params.generate.grid_rows))
    log.info("trained %d steps, %.1f kimg", total_steps, total_steps * cfg.batch_size / 1000)
    return TrainResult(g.cpu(), d.cpu(), g_ema.cpu(), total_steps * cfg.batch_size, total_steps)


@torch.no_grad()
def snapshot(generator: torch.nn.Module, z: torch.Tensor, rows: int) -> np.ndarray:
    """A ``rows x rows`` grid (HWC uint8) from fixed latents, with G in eval mode."""
    was_training = generator.training
    generator.eval()
    images = generator(z).float().cpu()
    generator.train(was_training)
    return image_grid(images, rows)
