"""GAN losses as pure functions of D's logits. Each returns a scalar float32 tensor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def bce_d(real_logits: torch.Tensor, fake_logits: torch.Tensor) -> torch.Tensor:
    """D's binary cross-entropy: ``-log sigmoid(D(x)) - log(1 - sigmoid(D(G(z))))``."""
    real, fake = real_logits.float(), fake_logits.float()
    return F.softplus(-real).mean() + F.softplus(fake).mean()


def bce_g(fake_logits: torch.Tensor) -> torch.Tensor:
    """G's non-saturating loss (Goodfellow et al. 2014): ``-log sigmoid(D(G(z)))``."""
    return F.softplus(-fake_logits.float()).mean()


@dataclass(frozen=True)
class GanLoss:
    """A pair of loss functions: ``d(real_logits, fake_logits)`` and ``g(fake_logits)``."""

    d: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    g: Callable[[torch.Tensor], torch.Tensor]


LOSSES = {"bce": GanLoss(d=bce_d, g=bce_g)}
