"""Differentiable augmentation of D's inputs (DiffAugment, Zhao et al. 2020, arXiv:2006.10738).

With few training images D memorises them and G's gradient degrades. Augmenting every
image D sees, real and generated, in every pass (D's updates and G's), with operations
that gradients flow through, keeps D from memorising without leaking the augmentation
into G's outputs: G never sees an augmented target, only D's judgement of augmented
images. Karras et al. 2020 (ADA, arXiv:2006.06676) add a strength ``p``, the probability
that an image is augmented, tuned while training from how sure D is on real images.

The operations are DiffAugment's three policies, written here for images in ``[-1, 1]``:

- ``color``: brightness ``x + (u - 0.5)``, saturation (the distance from the mean over
  channels times ``2u``) and contrast (the distance from the image mean times ``u + 0.5``).
- ``translation``: an integer shift of up to 1/8 of the side in each direction, zeros
  shifted in. Done with one-hot shift matrices (``S_y @ x @ S_x^T``): plain matrix products
  are deterministic on every device, where a gather's backward is not on CUDA.
- ``cutout``: a square of half the side, anywhere its centre falls, set to zero.

Every random number comes from the caller as a ``(batch, DRAWS)`` tensor of uniforms
(:func:`draws`), a function of the seed, the global batch and the pass, sliced per rank like
the latents: the same images get the same augmentation whatever the world size, micro-batch
split or restart. Mirroring (train.xflip, :func:`xflip`) is drawn the same way (:func:`flips`)
but applies to the real images only, before D sees them: it changes the data, not D's view.
"""

from __future__ import annotations

import torch

from ganpipe import runtime
from ganpipe.params import AUGMENT_POLICIES

DRAWS = 8
"""Uniforms per image: apply, brightness, saturation, contrast, shift y/x, cutout y/x."""
PASSES = ("real", "fake", "g")
"""D's passes of one global batch: D on reals, D on fakes, and G's own pass through D."""


def draws(seed: int, batch: int, which: str, batch_size: int) -> torch.Tensor:
    """The uniforms of pass ``which`` of global batch ``batch`` (all ``batch_size`` images)."""
    generator = runtime.seeded_generator(seed, "augment", which, batch)
    return torch.rand(batch_size, DRAWS, generator=generator)


def flips(seed: int, batch: int, batch_size: int) -> torch.Tensor:
    """Which reals of global batch ``batch`` train.xflip mirrors: ``(batch_size,)`` booleans,
    each true with probability 1/2, a function of the seed, the batch and the place in it."""
    generator = runtime.seeded_generator(seed, "xflip", batch)
    return torch.rand(batch_size, generator=generator) < 0.5


def xflip(images: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """``images`` (N, C, H, W) with those where ``flip`` (N booleans) is true mirrored left
    to right. Reals only (StyleGAN2-ADA's --mirror): the mirrored set is the target."""
    return torch.where(flip.view(-1, 1, 1, 1), images.flip(-1), images)


class Augment:
    """``policy`` applied with probability ``p`` per image (``p`` is a 0-dim tensor)."""

    def __init__(self, policy: tuple[str, ...], p: torch.Tensor):
        unknown = set(policy) - set(AUGMENT_POLICIES)
        if unknown or not policy:
            raise ValueError(f"augmentation policy {policy}: choose from {AUGMENT_POLICIES}")
        self.policy, self.p = policy, p

    def __call__(self, images: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Augment ``images`` (N, C, H, W) with uniforms ``u`` (N, DRAWS), at least in
        float32 (outside autocast: the shift matrices must move pixels exactly)."""
        with torch.autocast(images.device.type, enabled=False):
            x = images.to(torch.promote_types(images.dtype, torch.float32))
            u = u.to(x.device, x.dtype)
            out = x
            if "color" in self.policy:
                out = color(out, u[:, 1], u[:, 2], u[:, 3])
            if "translation" in self.policy:
                out = translate(out, u[:, 4], u[:, 5])
            if "cutout" in self.policy:
                out = cutout(out, u[:, 6], u[:, 7])
            apply = (u[:, 0] < self.p).view(-1, 1, 1, 1)
            return torch.where(apply, out, x)


class AdaptiveP:
    """ADA's tuning of the strength ``p`` (Karras et al. 2020), once per iteration.

    ``r_t``, the mean of ``sign(D(x))`` over one batch of reals per iteration (that of the
    D update paired with G's; with ``n_critic > 1`` the others are not counted), all ranks, tells
    how sure D is of the reals: near 1 it has memorised them. After each iteration
    ``p += sign(r_t - target) * step`` (clamped to [0, 1]), ``step`` being the iteration's
    images over ``train.augment_speed_kimg`` thousand. ``r_t`` is compared as an exact
    count: each rank's sum of signs is an integer, summed over ranks by one small
    all-reduce, so any world size, micro-batch split or restart takes the same decisions.
    Nothing is read back to the host: ``p`` stays on the device.
    """

    def __init__(self, p: torch.Tensor, target: float, step: float, reals: int, per_rank: int):
        self.p, self.target, self.step = p, target, step
        self.reals, self.per_rank = reals, per_rank

    def update(self, real_sign: torch.Tensor, all_sum) -> None:
        """Move ``p`` after an iteration whose reals on this rank had mean sign ``real_sign``
        (``all_sum`` sums a tensor over ranks)."""
        # The mean of per_rank values of ±1 (or 0) times per_rank, rounded: their exact sum.
        signs = all_sum(torch.round(real_sign.float() * self.per_rank))
        # A NaN score (fp16 leaves overflows to its GradScalers) leaves p where it is.
        direction = torch.sign(signs - self.target * self.reals).nan_to_num(0.0)
        self.p.copy_((self.p + direction * self.step).clamp(0.0, 1.0))


def _per_image(u: torch.Tensor) -> torch.Tensor:
    return u.view(-1, 1, 1, 1)


def color(x: torch.Tensor, bright: torch.Tensor, sat: torch.Tensor, con: torch.Tensor):
    """Brightness, saturation and contrast, each from one uniform per image."""
    x = x + (_per_image(bright) - 0.5)
    mean = x.mean(dim=1, keepdim=True)
    x = (x - mean) * (_per_image(sat) * 2) + mean
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    return (x - mean) * (_per_image(con) + 0.5) + mean


def _shifts(u: torch.Tensor, side: int, ratio: float) -> torch.Tensor:
    """Integer shifts uniform in ``[-s, s]``, ``s = round(side * ratio)``."""
    s = round(side * ratio)
    return (u * (2 * s + 1)).floor().clamp(max=2 * s) - s


def _shift_matrices(shift: torch.Tensor, side: int) -> torch.Tensor:
    """``(N, side, side)`` one-hot matrices ``S`` with ``(S @ v)[i] = v[i - shift]`` (or 0)."""
    index = torch.arange(side, device=shift.device, dtype=shift.dtype)
    return (index.view(1, -1, 1) - shift.view(-1, 1, 1) == index.view(1, 1, -1)).to(shift.dtype)


def translate(x: torch.Tensor, uy: torch.Tensor, ux: torch.Tensor, ratio: float = 0.125):
    """Shift each image by up to ``ratio`` of its side, zeros shifted in."""
    _, _, height, width = x.shape
    rows = _shift_matrices(_shifts(uy.to(x.dtype), height, ratio), height)
    cols = _shift_matrices(_shifts(ux.to(x.dtype), width, ratio), width)
    return rows.unsqueeze(1) @ x @ cols.transpose(1, 2).unsqueeze(1)


def cutout(x: torch.Tensor, uy: torch.Tensor, ux: torch.Tensor, ratio: float = 0.5):
    """Zero a square of ``ratio`` of the side whose centre is uniform over the image."""
    _, _, height, width = x.shape

    def band(u: torch.Tensor, side: int) -> torch.Tensor:
        size = round(side * ratio)
        centre = (u * side).floor().clamp(max=side - 1)
        first = centre - size // 2
        index = torch.arange(side, device=u.device, dtype=u.dtype).view(1, -1)
        inside = (index >= first.view(-1, 1)) & (index < (first + size).view(-1, 1))
        return inside

    hole = band(uy, height).unsqueeze(2) & band(ux, width).unsqueeze(1)
    return x * (~hole).unsqueeze(1).to(x.dtype)
