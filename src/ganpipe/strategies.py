"""The three update strategies of one GAN training iteration, side by side.

Each takes ``n_critic`` real batches and latent batches and makes ``n_critic`` D updates
and one G update. They differ only in the order of the updates and in which D the
generator's gradient sees (DESIGN.md, README "Update strategies"):

- ``d_first_retain``: one shared forward; G's gradient against the pre-update D.
- ``d_first_detach``: D steps on detached fakes, then G through a fresh pass of the new D.
- ``g_first_detach``: G steps through the current D, then D on the pre-update G's fakes.

Every backward is restricted with ``inputs=`` to the parameters of the network that is
about to step: no gradient is computed that no optimizer uses, and no loss leaks into the
other network's update. With ``n_critic > 1`` the extra D updates come first for the two
D-first strategies and last for ``g_first_detach``; they use fakes drawn without a graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from ganpipe.losses import GanLoss

Stats = dict[str, torch.Tensor]


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

    def d_loss(self, real_scores, fake_scores, real, fake) -> torch.Tensor:
        """D's loss, plus its penalty (which runs its own D forward) when configured."""
        loss = self.loss.d(real_scores, fake_scores)
        if self.loss.penalty is not None:
            loss = loss + self.loss.penalty(self.d, real, fake.detach())
        return loss

    def backward(self, loss: torch.Tensor, net: nn.Module, retain_graph: bool = False) -> None:
        """Backward into ``net``'s parameters only."""
        params = [p for p in net.parameters() if p.requires_grad]
        self.scaler.scale(loss).backward(inputs=params, retain_graph=retain_graph)

    def step(self, opt: torch.optim.Optimizer) -> torch.Tensor:
        """Unscale, measure the gradient norm, step (skipped by the scaler on inf/NaN)."""
        self.scaler.unscale_(opt)
        grads = [
            p.grad for group in opt.param_groups for p in group["params"] if p.grad is not None
        ]
        norm = torch.nn.utils.get_total_norm(grads)
        self.scaler.step(opt)
        return norm


def _stats(loss_d, loss_g, real_scores, fake_scores, norm_d, norm_g) -> Stats:
    return {
        "loss/d": loss_d.detach(),
        "loss/g": loss_g.detach(),
        "d/real": real_scores.detach().float().mean(),
        "d/fake": fake_scores.detach().float().mean(),
        "grad_norm/d": norm_d.detach(),
        "grad_norm/g": norm_g.detach(),
    }


def _critic_update(gan: Gan, real: torch.Tensor, z: torch.Tensor) -> None:
    """An extra D update (n_critic > 1) on fakes made without a graph."""
    gan.opt_d.zero_grad(set_to_none=True)
    with gan.autocast():
        with torch.no_grad():
            fake = gan.g(z)
        loss_d = gan.d_loss(gan.d(real), gan.d(fake), real, fake)
    gan.backward(loss_d, gan.d)
    gan.step(gan.opt_d)


def d_first_retain(gan: Gan, reals: Sequence[torch.Tensor], zs: Sequence[torch.Tensor]) -> Stats:
    """One shared forward; both gradients against the pre-update D, then both steps."""
    for real, z in zip(reals[:-1], zs[:-1], strict=True):
        _critic_update(gan, real, z)
    real, z = reals[-1], zs[-1]
    gan.opt_d.zero_grad(set_to_none=True)
    gan.opt_g.zero_grad(set_to_none=True)
    with gan.autocast():
        fake = gan.g(z)
        fake_scores = gan.d(fake)
        real_scores = gan.d(real)
    loss_d = gan.d_loss(real_scores, fake_scores, real, fake)
    loss_g = gan.loss.g(fake_scores)
    gan.backward(loss_d, gan.d, retain_graph=True)
    gan.backward(loss_g, gan.g)
    norm_d = gan.step(gan.opt_d)
    norm_g = gan.step(gan.opt_g)
    return _stats(loss_d, loss_g, real_scores, fake_scores, norm_d, norm_g)


def d_first_detach(gan: Gan, reals: Sequence[torch.Tensor], zs: Sequence[torch.Tensor]) -> Stats:
    """D on detached fakes and steps; then G through a fresh pass of the updated D."""
    for real, z in zip(reals[:-1], zs[:-1], strict=True):
        _critic_update(gan, real, z)
    real, z = reals[-1], zs[-1]
    gan.opt_d.zero_grad(set_to_none=True)
    with gan.autocast():
        fake = gan.g(z)
        fake_scores = gan.d(fake.detach())
        real_scores = gan.d(real)
    loss_d = gan.d_loss(real_scores, fake_scores, real, fake)
    gan.backward(loss_d, gan.d)
    norm_d = gan.step(gan.opt_d)

    gan.opt_g.zero_grad(set_to_none=True)
    with gan.autocast():
        loss_g = gan.loss.g(gan.d(fake))
    gan.backward(loss_g, gan.g)
    norm_g = gan.step(gan.opt_g)
    return _stats(loss_d, loss_g, real_scores, fake_scores, norm_d, norm_g)


def g_first_detach(gan: Gan, reals: Sequence[torch.Tensor], zs: Sequence[torch.Tensor]) -> Stats:
    """G through the current D and steps; then D on the detached pre-update fakes."""
    gan.opt_g.zero_grad(set_to_none=True)
    with gan.autocast():
        fake = gan.g(zs[0])
        loss_g = gan.loss.g(gan.d(fake))
    gan.backward(loss_g, gan.g)
    norm_g = gan.step(gan.opt_g)

    gan.opt_d.zero_grad(set_to_none=True)
    with gan.autocast():
        fake_scores = gan.d(fake.detach())
        real_scores = gan.d(reals[0])
    loss_d = gan.d_loss(real_scores, fake_scores, reals[0], fake)
    gan.backward(loss_d, gan.d)
    norm_d = gan.step(gan.opt_d)
    for real, z in zip(reals[1:], zs[1:], strict=True):
        _critic_update(gan, real, z)
    return _stats(loss_d, loss_g, real_scores, fake_scores, norm_d, norm_g)


Strategy = Callable[[Gan, Sequence[torch.Tensor], Sequence[torch.Tensor]], Stats]

STRATEGIES: dict[str, Strategy] = {
    "d_first_retain": d_first_retain,
    "d_first_detach": d_first_detach,
    "g_first_detach": g_first_detach,
}
