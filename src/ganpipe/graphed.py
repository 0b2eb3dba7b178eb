"""One training iteration as a CUDA graph: captured once, then replayed every step.

A small GAN's eager iteration on a GPU spends much of its time launching kernels: a step is
hundreds of small kernels, each a host call, while a replay launches the whole captured
iteration at once (what it gains is measured by ``python -m benchmarks.gpu``). Here the
strategy's whole iteration — every D and G update, micro-batch, penalty, GradScaler and
optimizer step and its statistics — is captured with ``torch.cuda.graph`` and replayed with
each iteration's batches copied into the captured input buffers. EMA, ADA's ``p`` and the
log sums stay eager: a handful of kernels after each replay.

A replay runs the captured kernels on the captured memory, so it is bitwise the eager
iteration as long as the iteration is *graph-safe*: every state it changes is changed in
place (parameters, optimizer and scaler state, BatchNorm and spectral-norm buffers, the
fp16 skip counters, ``augment.p``), nothing reads a value back to the host, and nothing
copies from the host. The eager path is the same function, and stays the reference.

The first :data:`WARMUP` iterations after every (re)start run eagerly, on a side stream,
as the PyTorch notes on CUDA graphs ask: they are real iterations (they create the
optimizer and scaler state, cuBLAS workspaces and autocast caches that capture must find
in place). A checkpoint is loaded before them, so a resumed run captures its restored state.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ganpipe.dist import DistContext
from ganpipe.params import Params
from ganpipe.strategies import Batch, Gan, Stats, Strategy

log = logging.getLogger(__name__)

WARMUP = 11
"""Eager iterations before capture (the PyTorch notes ask for 11 with DDP; plain capture
needs a few)."""


def eager_reason(params: Params, context: DistContext) -> str | None:
    """Why this run's iterations are not captured on CUDA, or None when they are."""
    if context.device.type != "cuda":
        return f"device {context.device.type}: CUDA graphs need a GPU"
    if not params.train.cuda_graph:
        return "train.cuda_graph is false"
    if context.world_size > 1:
        return (
            "DDP: its gradient all-reduces are not captured here (StyleGAN3's flat-buffer "
            "all-reduce is not built yet); set devices.nproc_per_node 1 for the graphed step"
        )
    if params.train.activation_checkpointing:
        return (
            "train.activation_checkpointing: its recomputation reads the RNG state, which "
            "a capture refuses"
        )
    return None


def iteration(
    strategy: Strategy, gan: Gan, params: Params, context: DistContext
) -> GraphedIteration | EagerIteration:
    """The callable that runs one iteration of ``strategy`` on a list of batches: captured
    in a CUDA graph when it can be (:func:`eager_reason` says why not, in the log)."""
    reason = eager_reason(params, context)
    if reason is None:
        log.info("training step: CUDA graph (captured after %d eager iterations)", WARMUP)
        return GraphedIteration(strategy, gan)
    if context.device.type == "cuda":
        log.info("training step: eager (%s)", reason)
    return EagerIteration(strategy, gan)


class EagerIteration:
    """The strategy's iteration, run op by op."""

    def __init__(self, strategy: Strategy, gan: Gan):
        self.strategy, self.gan = strategy, gan

    def __call__(self, batches: Sequence[Batch]) -> Stats:
        return self.strategy(self.gan, batches)


class GraphedIteration:
    """The strategy's iteration captured in one CUDA graph after :data:`WARMUP` eager ones.

    The statistics it returns after capture live in the graph's memory: the next call
    overwrites them, so they are consumed (logged, summed) before it. A capture that fails
    is logged with its error and the run goes on eagerly: capturing executes nothing, so the
    state is still that of the last eager iteration, and graph and eager give the same bits.
    """

    def __init__(self, strategy: Strategy, gan: Gan, warmup: int = WARMUP):
        if warmup < 1:  # state made lazily inside a capture would be made anew every replay
            raise ValueError(f"warmup={warmup}: a first eager step makes the optimizers' state")
        self.strategy, self.gan, self.warmup = strategy, gan, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed = False
        """A capture failed: every iteration from then on is eager."""
        self.inputs: list[Batch] = []
        self.outputs: Stats = {}
        self.side = torch.cuda.Stream()

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self, batches: Sequence[Batch]) -> Stats:
        if self.failed:
            return self.strategy(self.gan, batches)
        if self.graph is None and self.warmup > 0:
            self.warmup -= 1
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                stats = self.strategy(self.gan, batches)
            torch.cuda.current_stream().wait_stream(self.side)
            return stats
        if self.graph is None:
            self._capture(batches)
            if self.failed:
                return self.strategy(self.gan, batches)
        else:
            for static, batch in zip(self.inputs, batches, strict=True):
                _copy(static, batch)
        self.graph.replay()
        return self.outputs

    def _capture(self, batches: Sequence[Batch]) -> None:
        """Record the iteration on copies of ``batches`` (capture runs nothing: the caller
        replays it next), or set :attr:`failed` and log why."""
        self.inputs = [batch.map(torch.Tensor.clone) for batch in batches]  # own memory
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: a DataLoader's pin-memory thread may use CUDA meanwhile.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.outputs = self.strategy(self.gan, self.inputs)
        except RuntimeError as error:
            # The aborted capture may have bound gradients to its memory pool: drop them
            # (every update sets them to None first anyway).
            self.gan.opt_g.zero_grad(set_to_none=True)
            self.gan.opt_d.zero_grad(set_to_none=True)
            self.failed, self.inputs, self.outputs = True, [], {}
            log.warning(
                "capturing the training step in a CUDA graph failed; training on eagerly "
                "(the same bits, without the graph's speed-up): %s",
                error,
            )
            return
        self.graph = graph
        log.info("training step captured in a CUDA graph")


def _copy(static: Batch, batch: Batch) -> None:
    """Refill the captured input buffers with ``batch``."""
    for into, value in zip(static.tensors(), batch.tensors(), strict=True):
        into.copy_(value, non_blocking=True)
