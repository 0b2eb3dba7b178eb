"""What each training iteration consumes: real batches and latents, functions of the step.

Global batch ``k`` of a run and its latents depend on ``(seed, k)`` only, whatever the
world size: rank ``r`` of ``w`` takes its ``r``-th contiguous ``1/w`` of each. So one
process with the whole batch and ``w`` processes with a share each see the same global
batches (what makes DDP equal to one process), and a run can start at any step (resume).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ganpipe import augment, runtime
from ganpipe.data.dataset import LmdbImageDataset, uint8_to_float
from ganpipe.dist import DistContext
from ganpipe.files import size_text
from ganpipe.params import Params
from ganpipe.strategies import Batch

log = logging.getLogger(__name__)


class EpochBatchSampler(Sampler[list[int]]):
    """This rank's part of global batches: epoch ``e`` is a permutation seeded by ``(seed, e)``.

    This replaces ``DistributedSampler``, whose batches depend on the world size and which
    can only restart at an epoch boundary. The incomplete last batch of each epoch is
    dropped.
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


def fake_labels(seed: int, step: int, batch_size: int, num_classes: int) -> torch.Tensor:
    """The classes the fakes of global batch ``step`` are drawn for (conditional models):
    uniform over ``num_classes``, a function of the seed and the step only."""
    generator = runtime.seeded_generator(seed, "labels", step)
    return torch.randint(num_classes, (batch_size,), generator=generator)


def data_position(batches_done: int, num_items: int, batch_size: int) -> dict[str, int]:
    """Where the data stream stands after ``batches_done`` global batches."""
    per_epoch = num_items // batch_size
    return {"epoch": batches_done // per_epoch, "offset": batches_done % per_epoch}


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; to a GPU through pinned memory, without waiting: a copy
    from pageable memory would wait for the GPU to finish its queue (the previous step),
    and the host could not prepare the next step while the GPU runs this one."""
    if device.type != "cuda" or tensor.device == device:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def to_device_images(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a batch to the device; uint8 batches (a quarter of the bytes) convert there."""
    batch = batch.to(device, non_blocking=True)
    return uint8_to_float(batch) if batch.dtype == torch.uint8 else batch


def resident_bytes(dataset: Dataset) -> int | None:
    """The bytes of ``dataset``'s images as uint8, or None when it cannot be held resident
    (only an LMDB training set read as uint8 can)."""
    if not (isinstance(dataset, LmdbImageDataset) and dataset.as_uint8):
        return None
    channels, height, width = dataset.shape
    return len(dataset) * channels * height * width


def read_all(dataset: LmdbImageDataset, device: torch.device, chunk: int = 4096):
    """All images (uint8, NCHW) and labels (int64) of ``dataset``, on ``device``."""
    images = torch.empty((len(dataset), *dataset.shape), dtype=torch.uint8, device=device)
    labels = torch.empty(len(dataset), dtype=torch.int64, device=device)
    for first in range(0, len(dataset), chunk):
        items = dataset.__getitems__(list(range(first, min(first + chunk, len(dataset)))))
        images[first : first + len(items)] = torch.stack([image for image, _ in items])
        labels[first : first + len(items)] = torch.tensor([label for _, label in items])
    return images, labels


class Stream:
    """The inputs of iterations ``start, start + 1, ...`` of a run, on this rank's device.

    Iteration ``i`` makes ``train.n_critic`` D updates, each on its own global batch
    ``i * n_critic + k``; :meth:`next` returns this rank's share of those batches, with
    their latents and (train.augment) augmentation draws, in order, the reals mirrored
    where :func:`ganpipe.augment.flips` says (train.xflip). Iterations must be asked for one
    after another from ``start``.
    """

    def __init__(
        self,
        params: Params,
        dataset: Dataset,
        context: DistContext,
        start: int,
        iterations: int,
        num_classes: int | None = None,
    ):
        cfg = params.train
        self.seed, self.n_critic, self.batch_size = params.seed, cfg.n_critic, cfg.batch_size
        self.z_dim, self.device = params.model.z_dim, context.device
        self.augments, self.mirrors = bool(cfg.augment_policy), cfg.xflip
        self.num_classes = num_classes
        """Classes of a conditional model (labels go with each batch); None: unconditional."""
        self.mine = context.local_slice(cfg.batch_size)
        self.expected = min(start, iterations)
        sampler = EpochBatchSampler(
            len(dataset),
            cfg.batch_size,
            params.seed,
            self.expected * cfg.n_critic,
            iterations * cfg.n_critic,
            context.rank,
            context.world_size,
        )
        size = resident_bytes(dataset)
        if size is not None and size <= cfg.resident_mb * 2**20:
            images, labels = read_all(dataset, self.device)
            log.info("training set on %s: %s as uint8", self.device, size_text(size))
            self.batches = (
                (images.index_select(0, index), labels.index_select(0, index))
                for index in (to_device(torch.tensor(ix), self.device) for ix in sampler)
            )
            return
        # Workers hold no random state the run uses (decoding is deterministic), so seeding
        # them from the start-of-run generator again after a resume changes no bits.
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=cfg.num_workers,
            worker_init_fn=runtime.seed_worker,
            generator=runtime.seeded_generator(params.seed, "workers", context.rank),
            pin_memory=self.device.type == "cuda",
            persistent_workers=cfg.num_workers > 0,
        )
        self.batches = iter(loader)

    def next(self, iteration: int) -> list[Batch]:
        """This rank's share of ``iteration``'s ``n_critic`` global batches."""
        if iteration != self.expected:
            raise RuntimeError(f"stream at iteration {self.expected}, asked for {iteration}")
        self.expected += 1
        return [self._batch(iteration * self.n_critic + k) for k in range(self.n_critic)]

    def _batch(self, index: int) -> Batch:
        """Global batch ``index``: its images from the loader, the rest from the seed."""
        images, labels = next(self.batches)
        z = latents(self.seed, index, self.batch_size, self.z_dim)[self.mine]
        real_labels = fake = None
        if self.num_classes is not None:
            real_labels = to_device(labels, self.device)
            fake = fake_labels(self.seed, index, self.batch_size, self.num_classes)[self.mine]
            fake = to_device(fake, self.device)
        draws = None
        if self.augments:
            draws = {
                which: to_device(
                    augment.draws(self.seed, index, which, self.batch_size)[self.mine],
                    self.device,
                )
                for which in augment.PASSES
            }
        real = to_device_images(images, self.device)
        if self.mirrors:
            flip = augment.flips(self.seed, index, self.batch_size)[self.mine]
            real = augment.xflip(real, to_device(flip, self.device))
        return Batch(real, to_device(z, self.device), real_labels, fake, draws)
