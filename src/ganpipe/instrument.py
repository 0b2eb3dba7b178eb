"""Counting what a training step computes: forwards, backwards, parameter gradients."""

from __future__ import annotations

import torch
from torch import nn


class PassCounter:
    """Counts passes through G and D with hooks.

    - forwards: ``G``, ``D(real)`` (the input is the real batch) and ``D(fake)``;
    - backwards: ``G backward`` / ``D backward``, one per backward pass that computes the
      gradient of the network's output;
    - ``param_grads``: gradient computations per network, one per parameter per backward
      that reaches it (wasted ones show up here).

    Call :meth:`watch_real` with each step's real batch, and :meth:`reset` between steps.
    """

    def __init__(self, g: nn.Module, d: nn.Module):
        self._real: torch.Tensor | None = None
        self.reset()
        g.register_forward_hook(lambda m, args, out: self._forward("G", out))
        d.register_forward_hook(
            lambda m, args, out: self._forward(
                "D(real)" if self._is_real(args[0]) else "D(fake)", out
            )
        )
        for net, name in ((g, "G"), (d, "D")):
            for p in net.parameters():
                p.register_hook(lambda grad, name=name: self._add_grad(name))

    def reset(self) -> None:
        self.counts = {"G": 0, "D(fake)": 0, "D(real)": 0, "G backward": 0, "D backward": 0}
        self.param_grads = {"G": 0, "D": 0}

    def watch_real(self, real: torch.Tensor) -> None:
        """Tell D(real) from D(fake) by the storage of the real batch (micro-batches are views)."""
        self._real = real

    def _is_real(self, x: torch.Tensor) -> bool:
        return self._real is not None and (
            x.untyped_storage().data_ptr() == self._real.untyped_storage().data_ptr()
        )

    def _forward(self, key: str, out: torch.Tensor) -> None:
        self.counts[key] += 1
        if out.requires_grad:
            backward_key = f"{key[0]} backward"
            out.register_hook(lambda grad: self._add(backward_key))

    def _add(self, key: str) -> None:
        self.counts[key] += 1

    def _add_grad(self, name: str) -> None:
        self.param_grads[name] += 1
