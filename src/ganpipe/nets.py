"""Generator and discriminator families (``model.arch``).

DCGAN (Radford et al., 2016, arXiv:1511.06434): a 4x4 core doubled by strided
(transposed) convolutions up to the image size. At 64 pixels with ``z_dim=100`` and widths
64 it is the paper's layout (and the PyTorch DCGAN example's). D ends in a raw logit; the
sigmoid lives in the loss, where it is numerically safe under autocast.

ResNet (SNGAN, Miyato et al. 2018, arXiv:1802.05957; BigGAN, Brock et al. 2019,
arXiv:1809.11096), for 32 to 256 pixels: G maps z to a 4x4 core and doubles it with residual
up-blocks (norm, ReLU, nearest upsampling, 3x3 conv, twice; a 1x1 conv on the upsampled
shortcut); D halves the image with residual down-blocks (3x3 convs, ReLU, 2x2 average
pooling) down to 4x4, then ReLU, a sum over positions and a linear head. Every conv and
linear layer of D is spectrally normalised; ``model.norm`` is G's normalisation. Widths come
per resolution from ``model.g_channels`` / ``model.d_channels``.

Why this family and not a StyleGAN2-style generator: it is a plain stack of convolutions
that trains at small widths on a 2-core CPU (StyleGAN2's modulated convolutions, mapping
network, path-length and lazy regularisation cost several times the compute for the same
width, and are tuned for its own non-saturating loss with R1), it is stable with the hinge
and BCE losses every strategy here uses, and its class conditioning is the standard one:
class-conditional BatchNorm in G and a projection discriminator (Miyato & Koyama 2018,
arXiv:1802.05637), as in BigGAN. DCGAN has no conditional form here: its D ends in a 4x4
convolution, with no feature vector to project a label on.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import _SpectralNorm, spectral_norm
from torch.utils.checkpoint import checkpoint

from ganpipe.errors import UserError
from ganpipe.params import (
    DCGAN_IMAGE_SIZES,
    RESNET_IMAGE_SIZES,
    RESNET_RESOLUTIONS,
    ModelParams,
)


def _norm(kind: str, channels: int, affine: bool = True) -> nn.Module:
    if kind in ("batch", "sync_batch"):
        # sync_batch builds plain BatchNorm: dist.wrap converts it to SyncBatchNorm under DDP.
        return nn.BatchNorm2d(channels, affine=affine)
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=affine)
    if kind == "layer":
        # GroupNorm with one group normalises over (C, H, W) per sample: LayerNorm for images.
        return nn.GroupNorm(1, channels, affine=affine)
    assert not _has_norm(kind), kind
    return nn.Identity()


def _has_norm(kind: str) -> bool:
    """Whether ``_norm(kind, ...)`` is a normalisation layer (not the identity)."""
    return kind in ("batch", "sync_batch", "instance", "layer")


def _check_labels(y: torch.Tensor | None, num_classes: int, net: str) -> None:
    if num_classes and y is None:
        raise ValueError(
            f"this {net} is class-conditional (model.conditional=true): call it with the "
            "labels, e.g. net(x, y) with y of shape (N,)"
        )
    if not num_classes and y is not None:
        raise ValueError(
            f"this {net} is unconditional (model.conditional=false) but was given labels; "
            "call it without y, or build it with model.conditional true"
        )


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

    def forward(self, z: torch.Tensor, y: None = None) -> torch.Tensor:
        _check_labels(y, 0, "generator")
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

    def forward(self, image: torch.Tensor, y: None = None) -> torch.Tensor:
        _check_labels(y, 0, "discriminator")
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


# --- ResNet (SNGAN / BigGAN) -----------------------------------------------------------------


class _SpectralNormPerWeight(_SpectralNorm):
    """PyTorch's spectral norm parametrization, whose power iteration runs once per value of
    the weight instead of once per call.

    PyTorch iterates on every training-mode call, so ``σ`` depended on how often and in
    which order D was called between two optimizer steps: gradient accumulation (one call
    per micro-batch) and DDP with it did not equal one process with the whole batch, the
    same step gave other bits when D saw reals before fakes, and a recomputation in
    backward (activation checkpointing) iterated again. Here a call iterates only when the
    weight differs from the one of the last iteration (``_seen``, a buffer: exact resume
    keeps it, and every DDP rank computes it alike), so every call between two steps
    divides by the same ``σ``. The test and the select run on the device, without a host
    sync. Costs one copy of each spectrally normalised weight.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__(weight)
        # Zeros: any weight worth normalising differs from it, so the first call iterates.
        self.register_buffer("_seen", torch.zeros_like(weight))

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        weight_mat = self._reshape_weight_to_matrix(weight)
        if self.training:
            with torch.no_grad():
                changed = (weight != self._seen).any()
                u, v = self._u.clone(), self._v.clone()
                self._power_method(weight_mat, 1)
                self._u.copy_(torch.where(changed, self._u, u))
                self._v.copy_(torch.where(changed, self._v, v))
                self._seen.copy_(weight)
        u = self._u.clone(memory_format=torch.contiguous_format)
        v = self._v.clone(memory_format=torch.contiguous_format)
        return weight / torch.vdot(u, torch.mv(weight_mat, v))


def _resnet_conv(kind: str, layer: nn.Module) -> nn.Module:
    return _spectral_norm(layer) if kind == "spectral" else layer


def _spectral_norm(layer: nn.Module) -> nn.Module:
    """``layer`` with its weight spectrally normalised, iterating once per weight value."""
    parametrize.register_parametrization(layer, "weight", _SpectralNormPerWeight(layer.weight))
    return layer


def _call_block(block: nn.Module, checkpointing: bool, *inputs: torch.Tensor | None):
    """``block(*inputs)``, with non-reentrant activation checkpointing when asked (and
    gradients are on). The recomputation restores the buffers it changes (as in
    :class:`_Blocks`); spectral norm does not iterate again there (the weight is the same)."""
    if not (checkpointing and torch.is_grad_enabled()):
        return block(*inputs)
    return checkpoint(
        block,
        *inputs,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _KeepBuffers(block)),
    )


def _upsample(x: torch.Tensor) -> torch.Tensor:
    """Nearest-neighbour 2x upsampling as a broadcast: its backward is a plain sum, which is
    deterministic on every device (no scatter-add)."""
    n, c, h, w = x.shape
    return x[:, :, :, None, :, None].expand(n, c, h, 2, w, 2).reshape(n, c, 2 * h, 2 * w)


def _resolutions(low: int, high: int) -> list[int]:
    return [r for r in RESNET_RESOLUTIONS if low <= r <= high]


def _widths(channels_at: dict[int, int], resolutions: list[int], key: str, size: int) -> list[int]:
    missing = [r for r in resolutions if r not in channels_at]
    if size not in RESNET_IMAGE_SIZES or missing:
        raise UserError(
            f"model.arch=resnet supports data.image_size "
            f"{', '.join(map(str, RESNET_IMAGE_SIZES))} with model.{key} "
            f"entries for {', '.join(map(str, resolutions))}; got image size {size} and "
            f"{sorted(channels_at)}"
        )
    return [channels_at[r] for r in resolutions]


class _GeneratorNorm(nn.Module):
    """G's normalisation: ``model.norm``'s layer; when conditional, that layer without its
    own affine followed by a gain and bias per class, looked up from embeddings
    (class-conditional BatchNorm, de Vries et al. 2017; Miyato & Koyama 2018). The gains
    start at 1 and the biases at 0: the layer starts as the unconditional one."""

    def __init__(self, kind: str, channels: int, num_classes: int):
        super().__init__()
        self.norm = _norm(kind, channels, affine=not num_classes)
        self.gain = nn.Embedding(num_classes, channels) if num_classes else None
        self.bias = nn.Embedding(num_classes, channels) if num_classes else None

    def forward(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        x = self.norm(x)
        if self.gain is None:
            return x
        return x * self.gain(y)[:, :, None, None] + self.bias(y)[:, :, None, None]


class _UpBlock(nn.Module):
    """Residual block that doubles the resolution: ``c_in`` -> ``c_out`` channels."""

    def __init__(self, c_in: int, c_out: int, norm: str, num_classes: int):
        super().__init__()
        self.norm1 = _GeneratorNorm(norm, c_in, num_classes)
        self.conv1 = _resnet_conv(norm, nn.Conv2d(c_in, c_out, 3, 1, 1))
        self.norm2 = _GeneratorNorm(norm, c_out, num_classes)
        self.conv2 = _resnet_conv(norm, nn.Conv2d(c_out, c_out, 3, 1, 1))
        self.shortcut = _resnet_conv(norm, nn.Conv2d(c_in, c_out, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        h = self.conv1(_upsample(F.relu(self.norm1(x, y))))
        h = self.conv2(F.relu(self.norm2(h, y)))
        return h + self.shortcut(_upsample(x))


class ResnetGenerator(nn.Module):
    """z ``(N, z_dim)`` (and labels ``y`` ``(N,)`` when conditional) -> image
    ``(N, channels, size, size)`` in [-1, 1]."""

    def __init__(
        self,
        z_dim: int,
        channels_at: dict[int, int],
        channels: int,
        image_size: int,
        norm: str,
        num_classes: int = 0,
        checkpointing: bool = False,
    ):
        super().__init__()
        widths = _widths(channels_at, _resolutions(4, image_size), "g_channels", image_size)
        self.z_dim, self.num_classes, self.checkpointing = z_dim, num_classes, checkpointing
        self.core = _resnet_conv(norm, nn.Linear(z_dim, 4 * 4 * widths[0]))
        self.blocks = nn.ModuleList(
            _UpBlock(c_in, c_out, norm, num_classes) for c_in, c_out in itertools.pairwise(widths)
        )
        self.out = nn.Sequential(
            _norm(norm, widths[-1]),
            nn.ReLU(),
            _resnet_conv(norm, nn.Conv2d(widths[-1], channels, 3, 1, 1)),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        _check_labels(y, self.num_classes, "generator")
        h = self.core(z).view(z.shape[0], -1, 4, 4)
        for block in self.blocks:
            h = _call_block(block, self.checkpointing, h, y)
        return self.out(h)


class _DownBlock(nn.Module):
    """Residual block that halves the resolution: ``c_in`` -> ``c_out`` channels, every
    layer spectrally normalised. The first block of D (``first``) is SNGAN's "optimized"
    one: no activation on the image, and the shortcut pools before its 1x1 conv."""

    def __init__(self, c_in: int, c_out: int, first: bool):
        super().__init__()
        self.first = first
        self.conv1 = _spectral_norm(nn.Conv2d(c_in, c_out, 3, 1, 1))
        self.conv2 = _spectral_norm(nn.Conv2d(c_out, c_out, 3, 1, 1))
        self.shortcut = _spectral_norm(nn.Conv2d(c_in, c_out, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            h = self.conv2(F.relu(self.conv1(x)))
            return F.avg_pool2d(h, 2) + self.shortcut(F.avg_pool2d(x, 2))
        h = self.conv2(F.relu(self.conv1(F.relu(x))))
        return F.avg_pool2d(h, 2) + F.avg_pool2d(self.shortcut(x), 2)


class ResnetDiscriminator(nn.Module):
    """image ``(N, channels, size, size)`` (and labels ``y`` ``(N,)`` when conditional) ->
    score (logit) ``(N,)``.

    Conditional: the score adds the projection ``<embed(y), φ(x)>`` of the pooled features
    ``φ(x)`` on a learned class embedding (Miyato & Koyama 2018), spectrally normalised as
    the rest of D (as in BigGAN).
    """

    def __init__(
        self,
        channels_at: dict[int, int],
        channels: int,
        image_size: int,
        num_classes: int = 0,
        checkpointing: bool = False,
    ):
        super().__init__()
        resolutions = _resolutions(4, image_size // 2)[::-1]  # e.g. 16, 8, 4
        widths = _widths(channels_at, resolutions, "d_channels", image_size)
        self.num_classes, self.checkpointing = num_classes, checkpointing
        self.blocks = nn.ModuleList(
            [_DownBlock(channels, widths[0], first=True)]
            + [_DownBlock(c_in, c_out, first=False) for c_in, c_out in itertools.pairwise(widths)]
        )
        self.head = _spectral_norm(nn.Linear(widths[-1], 1))
        self.embed = _spectral_norm(nn.Embedding(num_classes, widths[-1])) if num_classes else None

    def forward(self, image: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        _check_labels(y, self.num_classes, "discriminator")
        h = image
        for block in self.blocks:
            h = _call_block(block, self.checkpointing, h)
        features = F.relu(h).sum(dim=(2, 3))  # global sum pooling (SNGAN, BigGAN)
        score = self.head(features).flatten()
        if self.embed is not None:
            score = score + (self.embed(y) * features).sum(dim=1)
        return score


def init_resnet_weights(module: nn.Module) -> None:
    """Xavier-uniform weights and zero biases for every conv, linear and projection
    embedding (SNGAN's initialisation); norm layers at gain 1, bias 0, and the class-
    conditional gains at 1 and biases at 0 (the conditional layer starts unconditional)."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear, nn.Embedding)):
            spectral = hasattr(m, "parametrizations")
            weight = m.parametrizations.weight.original if spectral else m.weight
            nn.init.xavier_uniform_(weight)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.BatchNorm2d, nn.InstanceNorm2d, nn.GroupNorm)) and m.affine:
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
    for m in module.modules():  # after the loop above, which also reaches their embeddings
        if isinstance(m, _GeneratorNorm) and m.gain is not None:
            nn.init.ones_(m.gain.weight)
            nn.init.zeros_(m.bias.weight)


def _num_classes_for(model: ModelParams, num_classes: int | None) -> int:
    """Classes the networks condition on: 0 (unconditional), or at least 2."""
    if not model.conditional:
        return 0
    if num_classes is None or num_classes < 2:
        raise UserError(
            f"model.conditional=true needs a dataset with at least 2 classes, but it has "
            f"{num_classes or 1} (the labels in data/train.lmdb's metadata); set "
            "model.conditional false or use labelled data (class folders, cifar10, mnist, digits)"
        )
    return num_classes


def build_generator(
    model: ModelParams,
    image_size: int,
    channels: int,
    checkpointing: bool = False,
    num_classes: int | None = None,
) -> nn.Module:
    """G of ``model.arch``, with PyTorch's default initial weights (for loading a state dict).

    Raises:
        ValueError: ``model.conditional`` with fewer than 2 classes, or an image size or
            channel mapping the family does not support.
    """
    classes = _num_classes_for(model, num_classes)
    if model.arch == "resnet":
        return ResnetGenerator(
            model.z_dim, model.g_channels, channels, image_size, model.norm, classes, checkpointing
        )
    return DcganGenerator(
        model.z_dim, model.g_width, channels, image_size, model.norm, checkpointing
    )


def build_models(
    model: ModelParams,
    image_size: int,
    channels: int,
    generator: torch.Generator,
    checkpointing: bool = False,
    num_classes: int | None = None,
) -> tuple[nn.Module, nn.Module]:
    """Build and initialise G and D; ``generator`` alone decides the initial weights.

    Args:
        model: The architecture (``model.arch`` picks the family).
        image_size: Side length of the images, in pixels.
        channels: Image channels (1 or 3).
        generator: Seeds the initial weights (and spectral norm's first vectors).
        checkpointing: Activation checkpointing per block.
        num_classes: Classes of the dataset; needed (at least 2) when ``model.conditional``,
            ignored otherwise. G is then called ``G(z, y)`` and D ``D(x, y)`` with integer
            labels ``y`` of shape ``(N,)``.

    Raises:
        ValueError: ``model.conditional`` with fewer than 2 classes, or an image size or
            channel mapping the family does not support; the message names the keys.
    """
    classes = _num_classes_for(model, num_classes)
    # Spectral norm draws its power-iteration vector at construction: seed that too.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
        if model.arch == "resnet":
            g = ResnetGenerator(
                model.z_dim,
                model.g_channels,
                channels,
                image_size,
                model.norm,
                classes,
                checkpointing,
            )
            d = ResnetDiscriminator(model.d_channels, channels, image_size, classes, checkpointing)
            init_resnet_weights(g)
            init_resnet_weights(d)
            return g, d
        g = DcganGenerator(
            model.z_dim, model.g_width, channels, image_size, model.norm, checkpointing
        )
        d = DcganDiscriminator(model.d_width, channels, image_size, model.norm, checkpointing)
        init_weights(g)
        init_weights(d)
    return g, d
