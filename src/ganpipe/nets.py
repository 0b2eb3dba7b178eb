"""Generator and discriminator families.

DCGAN (Radford et al., 2016, arXiv:1511.06434): a 4x4 core doubled by strided
(transposed) convolutions up to the image size. At 64 pixels with ``z_dim=100`` and widths
64 it is the paper's layout (and the PyTorch DCGAN example's). D ends in a raw logit; the
sigmoid lives in the loss, where it is numerically safe under autocast.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm
from torch.utils.checkpoint import checkpoint

from ganpipe.params import DCGAN_IMAGE_SIZES, ModelParams


def _norm(kind: str, channels: int) -> nn.Module:
    if kind in ("batch", "sync_batch"):
        # sync_batch builds plain BatchNorm: dist.wrap converts it to SyncBatchNorm under DDP.
        return nn.BatchNorm2d(channels)
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=True)
    if kind == "layer":
        # GroupNorm with one group normalises over (C, H, W) per sample: LayerNorm for images.
        return nn.GroupNorm(1, channels)
    assert not _has_norm(kind), kind
    return nn.Identity()


def _has_norm(kind: str) -> bool:
    """Whether ``_norm(kind, ...)`` is a normalisation layer (not the identity)."""
    return kind in ("batch", "sync_batch", "instance", "layer")


def _conv(kind: str, layer: nn.Module) -> nn.Module:
    return spectral_norm(layer) if kind == "spectral" else layer


def _num_doublings(image_size: int) -> int:
    if image_size not in DCGAN_IMAGE_SIZES:
        raise ValueError(f"DCGAN supports image sizes {DCGAN_IMAGE_SIZES}, not {image_size}")
    return int(math.log2(image_size)) - 2


class _KeepBuffers:
    """Recomputation context of :func:`torch.utils.checkpoint`: the buffers of ``block``
    (BatchNorm's running statistics) end as they were before the recomputation.

    In training mode BatchNorm updates ``running_mean``, ``running_var`` and
    ``num_batches_tracked`` on every call, the recomputation in backward included: without
    this a checkpointed step counts each batch twice. Its output does not depend on them
    (training mode normalises with the batch's statistics), so restoring them afterwards
    leaves the step bit-for-bit the step without checkpointing. A class, not a generator:
    a second backward through a retained graph recomputes again with the same context.
    """

    def __init__(self, block: nn.Module):
        self.block = block
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.saved = [(buffer, buffer.clone()) for buffer in self.block.buffers()]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for buffer, value in self.saved:
                buffer.copy_(value)
        self.saved = []


class _Blocks(nn.Module):
    """A chain of blocks, optionally with activation checkpointing per block."""

    def __init__(self, blocks: list[nn.Module], checkpointing: bool):
        super().__init__()
        self.main = nn.Sequential(*blocks)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.main:
            if self.checkpointing and torch.is_grad_enabled():
                # Non-reentrant: works with inputs that need no grad, and with
                # backward(inputs=...). Recomputation replays the RNG state and restores
                # the block's buffers (running statistics) when it is done.
                x = checkpoint(
                    block,
                    x,
                    use_reentrant=False,
                    context_fn=lambda block=block: (contextlib.nullcontext(), _KeepBuffers(block)),
                )
            else:
                x = block(x)
        return x


class DcganGenerator(_Blocks):
    """z ``(N, z_dim)`` -> image ``(N, channels, size, size)`` in [-1, 1]."""

    def __init__(
        self,
        z_dim: int,
        width: int,
        channels: int,
        image_size: int,
        norm: str,
        checkpointing: bool = False,
    ):
        ups = _num_doublings(image_size)
        widths = [width * 2 ** (ups - 1 - i) for i in range(ups)]  # e.g. 512, 256, 128, 64
        bias = not _has_norm(norm)  # a bias before a norm layer is redundant
        blocks: list[nn.Module] = [
            nn.Sequential(
                _conv(norm, nn.ConvTranspose2d(z_dim, widths[0], 4, 1, 0, bias=bias)),
                _norm(norm, widths[0]),
                nn.ReLU(inplace=True),
            )
        ]
        for c_in, c_out in itertools.pairwise(widths):
            blocks.append(
                nn.Sequential(
                    _conv(norm, nn.ConvTranspose2d(c_in, c_out, 4, 2, 1, bias=bias)),
                    _norm(norm, c_out),
                    nn.ReLU(inplace=True),
                )
            )
        blocks.append(
            nn.Sequential(nn.ConvTranspose2d(widths[-1], channels, 4, 2, 1, bias=False), nn.Tanh())
        )
        super().__init__(blocks, checkpointing)
        self.z_dim = z_dim

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return super().forward(z.view(z.shape[0], self.z_dim, 1, 1))


class DcganDiscriminator(_Blocks):
    """image ``(N, channels, size, size)`` -> score (logit) ``(N,)``."""

    def __init__(
        self,
        width: int,
        channels: int,
        image_size: int,
        norm: str,
        checkpointing: bool = False,
    ):
        downs = _num_doublings(image_size)
        widths = [width * 2**i for i in range(downs)]  # e.g. 64, 128, 256, 512
        bias = not _has_norm(norm)
        # No norm on the first layer, as in the paper. Biases only where no norm follows
        # any layer (none, spectral), as in the PyTorch DCGAN example otherwise.
        blocks: list[nn.Module] = [
            nn.Sequential(
                _conv(norm, nn.Conv2d(channels, widths[0], 4, 2, 1, bias=bias)),
                nn.LeakyReLU(0.2, inplace=True),
            )
        ]
        for c_in, c_out in itertools.pairwise(widths):
            blocks.append(
                nn.Sequential(
                    _conv(norm, nn.Conv2d(c_in, c_out, 4, 2, 1, bias=bias)),
                    _norm(norm, c_out),
                    nn.LeakyReLU(0.2, inplace=True),
                )
            )
        blocks.append(_conv(norm, nn.Conv2d(widths[-1], 1, 4, 1, 0, bias=bias)))
        super().__init__(blocks, checkpointing)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return super().forward(image).flatten()


def init_weights(module: nn.Module) -> None:
    """The DCGAN paper's initialisation: conv N(0, 0.02), norm scale N(1, 0.02), bias 0."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)):
            spectral = hasattr(m, "parametrizations")
            weight = m.parametrizations.weight.original if spectral else m.weight
            nn.init.normal_(weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.InstanceNorm2d, nn.GroupNorm)) and m.affine:
            nn.init.normal_(m.weight, 1.0, 0.02)
            nn.init.zeros_(m.bias)


def build_models(
    model: ModelParams,
    image_size: int,
    channels: int,
    generator: torch.Generator,
    checkpointing: bool = False,
) -> tuple[DcganGenerator, DcganDiscriminator]:
    """Build and initialise G and D; ``generator`` alone decides the initial weights."""
    # Spectral norm draws its power-iteration vector at construction: seed that too.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
        g = DcganGenerator(
            model.z_dim, model.g_width, channels, image_size, model.norm, checkpointing
        )
        d = DcganDiscriminator(model.d_width, channels, image_size, model.norm, checkpointing)
        init_weights(g)
        init_weights(d)
    return g, d
