"""Exponential moving average of the generator's weights (Karras et al., StyleGAN)."""

from __future__ import annotations

import copy

import torch
from torch import nn


class EmaGenerator(nn.Module):
    """A frozen copy of G whose weights trail G's with a half-life in images.

    The running weights are the parameters and buffers of ``self.module``: they move with
    ``.to()``, live in ``state_dict()`` and cannot pile up outside the module (the
    classic leak of an average kept as a plain attribute, replicated step after step).
    Parameters are averaged (class-conditional gains and biases included); buffers are
    copied from G: BatchNorm's running statistics, and spectral norm's power-iteration
    vectors ``u``, ``v`` (the average runs in eval mode, so it never iterates them itself).
    """

    def __init__(self, generator: nn.Module, half_life_kimg: float):
        super().__init__()
        self.half_life_kimg = half_life_kimg
        self.module = copy.deepcopy(generator).eval().requires_grad_(False)

    def beta(self, num_images: int) -> float:
        """Decay for a step of ``num_images``: ``0.5 ** (num_images / half_life_images)``."""
        if self.half_life_kimg == 0:
            return 0.0
        return 0.5 ** (num_images / (self.half_life_kimg * 1000))

    @torch.no_grad()
    def update(self, generator: nn.Module, num_images: int) -> None:
        """Move the average towards ``generator`` after a step that showed ``num_images``."""
        beta = self.beta(num_images)
        averages, lives = list(self.module.parameters()), list(generator.parameters())
        assert len(averages) == len(lives), "the EMA and G must have the same layout"
        # One fused kernel per device instead of one per parameter.
        torch._foreach_lerp_(averages, [p.detach() for p in lives], 1.0 - beta)
        for avg, live in zip(self.module.buffers(), generator.buffers(), strict=True):
            avg.copy_(live)

    def train(self, mode: bool = True) -> EmaGenerator:
        """The average is for inference only: its module stays in eval mode."""
        super().train(mode)
        self.module.eval()
        return self

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Images of latents ``z`` (and labels ``y`` when G is class-conditional)."""
        return self.module(z, y)
