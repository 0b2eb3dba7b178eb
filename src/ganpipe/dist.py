"""Process group, devices, DDP wrapping and rank-0 helpers: parallelism lives here.

The launcher (the train stage, through torchrun) starts one process per device; this
module turns that process into a member of the group. Everything else asks a
:class:`DistContext` whether it is the main process and what slice of the global batch it
owns, and never branches on the backend.
"""

from __future__ import annotations

import datetime
import inspect
import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ganpipe.errors import UserError
from ganpipe.params import DevicesParams

log = logging.getLogger(__name__)


class WaitTimeoutError(UserError):
    """A rank waited longer than ``devices.timeout_s`` for work that rank 0 does alone; the
    message names the work, the keys that size it and the fix."""


@dataclass(frozen=True)
class DistContext:
    """This process's place in the run."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = 0.0
    """How long a collective waits before the run fails (``devices.timeout_s``; 0: one
    process, or not known)."""

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes models, checkpoints, logs and images."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def local_slice(self, global_batch: int) -> slice:
        """The part of a global batch this rank computes (contiguous, by rank)."""
        size = global_batch // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks (in place; a no-op in one process)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        if not self.distributed:
            return flag
        return bool(self.all_max(torch.tensor([float(flag)], device=self.device)).item())

    def broadcast_object(self, obj: object) -> object:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=0, device=self.device)
        return holder[0]

    def wait_for_main(self, obj: object, work: str, fix: str) -> object:
        """Rank 0's ``obj`` on every rank, once rank 0 has done ``work`` alone: the other
        ranks wait for it in the broadcast, as long as ``devices.timeout_s`` allows.

        Raises:
            WaitTimeoutError: on a rank other than 0, the wait outlasted devices.timeout_s
                (gloo gives up then); the message names ``work`` and says ``fix``. NCCL's
                watchdog ends the waiting process instead, with its own message (see
                docs/distributed.md).
        """
        start = time.monotonic()
        try:
            return self.broadcast_object(obj)
        except RuntimeError as exc:
            # gloo's "Timed out waiting ...ms for recv": only a wait as long as the timeout
            # is the user's to fix. Earlier failures (rank 0 died) keep their traceback.
            waited = time.monotonic() - start
            if self.is_main or not self.timeout_s or waited < self.timeout_s:
                raise
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise WaitTimeoutError(
                f"rank {self.rank} waited devices.timeout_s={self.timeout_s:g} s for rank 0 to "
                f"finish {work} and gave up ({reason}); {fix}"
            ) from None

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's ``obj``, in rank order (on every rank)."""
        if not self.distributed:
            return [obj]
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Maximum of ``tensor`` over ranks (in place; a no-op in one process)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor


def setup(
    devices: DevicesParams, rank: int, local_rank: int, world_size: int, device: torch.device
) -> DistContext:
    """Join the process group (when ``world_size > 1``) and pick this rank's device.

    ``rank``, ``local_rank`` and ``world_size`` come from the launcher (torchrun's
    environment, read by the stage). On CUDA each process takes GPU ``local_rank`` of the
    GPUs the launcher made visible.
    """
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    timeout_s = devices.timeout_s if world_size > 1 else 0.0
    context = DistContext(rank, local_rank, world_size, device, timeout_s)
    if world_size > 1:
        backend = devices.backend
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=devices.timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
        log.info("rank %d/%d joined (%s on %s)", rank, world_size, backend, device)
    return context


def teardown(context: DistContext) -> None:
    """Leave the process group."""
    if context.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap(net: nn.Module, context: DistContext, sync_batch_norm: bool) -> nn.Module:
    """DDP-wrap one network (G and D are wrapped separately).

    Strategies restrict every backward to the parameters of the network about to step, so
    a frozen network's DDP reducer sees no gradients and starts no all-reduce (counted in
    tests/integration/test_ddp.py). ``sync_batch_norm`` converts BatchNorm to
    SyncBatchNorm, which PyTorch supports on CUDA only.
    """
    if not context.distributed:
        return net
    if sync_batch_norm:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    # The buffers start as rank 0's (DDP's start-up sync), but DDP does not broadcast them
    # again before every forward. On CUDA, cuDNN's BatchNorm keeps the running statistics
    # for its backward, and a strategy runs D twice before one backward: with torch 2.11
    # (the H100's build) the second forward's broadcast overwrote them in place on the
    # other ranks and autograd's version check failed (tests/integration/test_gpu.py);
    # torch 2.14 hides that write from autograd. No trained byte changes: training reads
    # batch statistics, every rank updates spectral norm's vectors and ``_seen``
    # identically, and rank 0, the broadcast's source, is the one that saves its buffers
    # and copies them into the EMA.
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return DistributedDataParallel(net, device_ids=device_ids, forward_sync_buffers=False)
    for buffer in net.buffers():  # an older torch (2.11): the start-up sync by hand
        dist.broadcast(buffer, src=0)
    return DistributedDataParallel(net, device_ids=device_ids, broadcast_buffers=False)


def unwrap(net: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the module itself)."""
    return net.module if isinstance(net, DistributedDataParallel) else net
