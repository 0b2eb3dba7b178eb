"""GAN losses as pure functions of D's outputs, plus the gradient penalties.

Adversarial losses take D's raw outputs (logits / critic scores) and return a float32
scalar. Penalties take D and images and run their own D forward in float32 (outside
autocast: the double backward is the numerically delicate part).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ganpipe import exact
from ganpipe.params import TrainParams

Critic = Callable[[torch.Tensor], torch.Tensor]
"""D as the penalties call it: images -> scores (a network, or a closure that adds the
labels of a conditional D and the augmentation of its pass)."""


def bce_d(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """D's binary cross-entropy: ``E[-log σ(D(x))] + E[-log(1 - σ(D(G(z))))]``."""
    return F.softplus(-real.float()).mean() + F.softplus(fake.float()).mean()


def bce_g(fake: torch.Tensor) -> torch.Tensor:
    """G's non-saturating loss (Goodfellow et al. 2014): ``E[-log σ(D(G(z)))]``."""
    return F.softplus(-fake.float()).mean()


def hinge_d(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """Hinge loss (Lim & Ye 2017): ``E[max(0, 1 - D(x))] + E[max(0, 1 + D(G(z)))]``."""
    return F.relu(1.0 - real.float()).mean() + F.relu(1.0 + fake.float()).mean()


def wasserstein_d(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    """The critic's Wasserstein loss (Arjovsky et al. 2017): ``E[D(G(z))] - E[D(x)]``."""
    return fake.float().mean() - real.float().mean()


def mean_score_g(fake: torch.Tensor) -> torch.Tensor:
    """G's loss for hinge and WGAN: ``-E[D(G(z))]``."""
    return -fake.float().mean()


def _input_grad_sq_norm(d: Critic, images: torch.Tensor) -> torch.Tensor:
    """Per-sample ``||∇_x D(x)||²``, keeping the graph for the double backward."""
    images = images.detach().float().requires_grad_(True)
    with torch.autocast(images.device.type, enabled=False):
        scores = d(images)
    (grad,) = torch.autograd.grad(scores.sum(), images, create_graph=True)
    return grad.square().flatten(1).sum(1)


def gradient_penalty(
    d: Critic, real: torch.Tensor, fake: torch.Tensor, weight: float
) -> torch.Tensor:
    """WGAN-GP (Gulrajani et al. 2017): ``λ E[(||∇D(x̂)||₂ - 1)²]``, x̂ between real and fake.

    The mixing weights come from the global torch RNG, seeded per run (and saved in
    checkpoints).
    """
    eps = torch.rand(real.shape[0], 1, 1, 1, device=real.device)
    mixed = eps * real.detach().float() + (1 - eps) * fake.detach().float()
    return weight * (exact.sqrt(_input_grad_sq_norm(d, mixed)) - 1).square().mean()


def r1_penalty(d: Critic, real: torch.Tensor, gamma: float) -> torch.Tensor:
    """R1 (Mescheder et al. 2018): ``γ/2 E[||∇_x D(x)||²]`` on real images."""
    return gamma / 2 * _input_grad_sq_norm(d, real).mean()


Penalty = Callable[[Critic, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GanLoss:
    """``d(real_scores, fake_scores)``, ``g(fake_scores)`` and D's optional penalty."""

    d: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    g: Callable[[torch.Tensor], torch.Tensor]
    penalty: Penalty | None = None


def build_loss(train: TrainParams) -> GanLoss:
    """The loss named by ``train.loss``, with WGAN-GP's penalty and R1 when configured."""
    adversarial = {
        "bce": (bce_d, bce_g),
        "hinge": (hinge_d, mean_score_g),
        "wgan_gp": (wasserstein_d, mean_score_g),
    }
    d_loss, g_loss = adversarial[train.loss]
    terms: list[Penalty] = []
    if train.loss == "wgan_gp":
        terms.append(lambda d, real, fake: gradient_penalty(d, real, fake, train.gp_weight))
    if train.r1_gamma > 0:
        terms.append(lambda d, real, fake: r1_penalty(d, real, train.r1_gamma))
    if not terms:
        return GanLoss(d_loss, g_loss)
    return GanLoss(d_loss, g_loss, lambda d, real, fake: sum(t(d, real, fake) for t in terms))
