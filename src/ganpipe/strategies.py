"""The three update strategies of one GAN training step, side by side.

Each takes the same arguments and returns the same statistics; they differ only in the
order of the updates and in which D the generator's gradient sees (DESIGN.md, README
"Update strategies"). Every backward is restricted with ``inputs=`` to the parameters of
the network that is about to step, so no gradient is computed that no optimizer uses and
no loss leaks into the other network's update.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from ganpipe.losses import GanLoss


@dataclass
class Gan:
    """Everything a strategy touches."""

    g: nn.Module
    d: nn.Module
    opt_g: torch.optim.Optimizer
    opt_d: torch.optim.Optimizer
    loss: GanLoss
    scaler: torch.amp.GradScaler
    autocast: Callable[[], AbstractContextManager]

    def params(self, net: nn.Module) -> list[torch.Tensor]:
        return [p for p in net.parameters() if p.requires_grad]

    def backward(self, loss: torch.Tensor, net: nn.Module, retain_graph: bool = False) -> None:
        self.scaler.scale(loss).backward(inputs=self.params(net), retain_graph=retain_graph)


Stats = dict[str, torch.Tensor]


def _stats(loss_d, loss_g, real_logits, fake_logits) -> Stats:
    return {
        "loss/d": loss_d.detach(),
        "loss/g": loss_g.detach(),
        "d/real": real_logits.detach().float().mean(),
        "d/fake": fake_logits.detach().float().mean(),
    }


def d_first_retain(gan: Gan, real: torch.Tensor, z: torch.Tensor) -> Stats:
    """One shared forward; both gradients against the pre-update D, then both steps."""
    gan.opt_d.zero_grad(set_to_none=True)
    gan.opt_g.zero_grad(set_to_none=True)
    with gan.autocast():
        fake = gan.g(z)
        fake_logits = gan.d(fake)
        real_logits = gan.d(real)
    loss_d = gan.loss.d(real_logits, fake_logits)
    loss_g = gan.loss.g(fake_logits)
    gan.backward(loss_d, gan.d, retain_graph=True)
    gan.backward(loss_g, gan.g)
    gan.scaler.step(gan.opt_d)
    gan.scaler.step(gan.opt_g)
    return _stats(loss_d, loss_g, real_logits, fake_logits)


def d_first_detach(gan: Gan, real: torch.Tensor, z: torch.Tensor) -> Stats:
    """D on detached fakes and steps; then G through a fresh pass of the updated D."""
    gan.opt_d.zero_grad(set_to_none=True)
    with gan.autocast():
        fake = gan.g(z)
        fake_logits = gan.d(fake.detach())
        real_logits = gan.d(real)
    loss_d = gan.loss.d(real_logits, fake_logits)
    gan.backward(loss_d, gan.d)
    gan.scaler.step(gan.opt_d)

    gan.opt_g.zero_grad(set_to_none=True)
    with gan.autocast():
        loss_g = gan.loss.g(gan.d(fake))
    gan.backward(loss_g, gan.g)
    gan.scaler.step(gan.opt_g)
    return _stats(loss_d, loss_g, real_logits, fake_logits)


def g_first_detach(gan: Gan, real: torch.Tensor, z: torch.Tensor) -> Stats:
    """G through the current D and steps; then D on the detached pre-update fakes."""
    gan.opt_g.zero_grad(set_to_none=True)
    with gan.autocast():
        fake = gan.g(z)
        loss_g = gan.loss.g(gan.d(fake))
    gan.backward(loss_g, gan.g)
    gan.scaler.step(gan.opt_g)

    gan.opt_d.zero_grad(set_to_none=True)
    with gan.autocast():
        fake_logits = gan.d(fake.detach())
        real_logits = gan.d(real)
    loss_d = gan.loss.d(real_logits, fake_logits)
    gan.backward(loss_d, gan.d)
    gan.scaler.step(gan.opt_d)
    return _stats(loss_d, loss_g, real_logits, fake_logits)


STRATEGIES: dict[str, Callable[[Gan, torch.Tensor, torch.Tensor], Stats]] = {
    "d_first_retain": d_first_retain,
    "d_first_detach": d_first_detach,
    "g_first_detach": g_first_detach,
}
