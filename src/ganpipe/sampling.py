"""Sample images from a generator: latents, grids, interpolations and exported files."""

from __future__ import annotations

import io
import math
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from ganpipe import exact, runtime
from ganpipe.checkpoint import write_bytes_atomic
from ganpipe.files import NO_SPACE_ERRNOS, TMP_MARK, build_dir_for, no_space_error, replace_dir


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """``[-1, 1]`` float images -> uint8 (round to nearest, clamp)."""
    return images.float().add(1).mul(127.5).round().clamp(0, 255).to(torch.uint8)


def image_grid(images: torch.Tensor, images_per_row: int) -> np.ndarray:
    """A grid (HWC uint8, 2-pixel black padding) of ``[-1, 1]`` images.

    The layout of ``torchvision.utils.make_grid(padding=2, pad_value=0)``, grayscale repeated
    to RGB (a test holds the two equal), written here because importing torchvision pulls in
    torch._dynamo: about a second of start-up in every stage process, for a dozen lines.
    """
    pixels = to_uint8(images.cpu())
    if pixels.shape[1] == 1:
        pixels = pixels.expand(-1, 3, -1, -1)
    num, channels, height, width = pixels.shape
    if num == 1:  # make_grid returns a lone image as it is, unpadded
        return pixels[0].permute(1, 2, 0).numpy()
    cols = min(images_per_row, num)
    lines = math.ceil(num / cols)
    pad = 2
    grid = torch.zeros(
        channels, lines * (height + pad) + pad, cols * (width + pad) + pad, dtype=torch.uint8
    )
    for index, image in enumerate(pixels):
        row, col = divmod(index, cols)
        top, left = pad + row * (height + pad), pad + col * (width + pad)
        grid[:, top : top + height, left : left + width] = image
    return grid.permute(1, 2, 0).numpy()


def png_bytes(pixels: np.ndarray) -> bytes:
    """Encode HWC uint8 pixels (1 or 3 channels) as PNG, without timestamps."""
    image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def save_png(pixels: np.ndarray, path: Path) -> None:
    """Write a PNG atomically."""
    write_bytes_atomic(png_bytes(pixels), path)


def sample_latents(
    seed: int, indices: Sequence[int], z_dim: int, truncation: float | None = None
) -> torch.Tensor:
    """Latents of samples ``indices``: sample i's comes from (seed, i) alone.

    So a sample is the same whichever process or batch makes it. With ``truncation``, values
    beyond ±truncation are redrawn from the same stream (the truncation trick of BigGAN).
    """
    out = torch.empty(len(indices), z_dim)
    for row, i in enumerate(indices):
        gen = runtime.seeded_generator(seed, "sample", i)
        z = torch.randn(z_dim, generator=gen)
        if truncation is not None:
            while (outside := z.abs() > truncation).any():
                z[outside] = torch.randn(int(outside.sum()), generator=gen)
        out[row] = z
    return out


def sample_labels(indices: Sequence[int], num_classes: int) -> torch.Tensor:
    """Classes of samples ``indices`` of a conditional generator: sample ``i`` is class
    ``i mod num_classes`` (every class equally often, whichever process or batch makes it)."""
    return torch.tensor([i % num_classes for i in indices], dtype=torch.int64)


def num_classes_of(generator: torch.nn.Module) -> int | None:
    """The classes of a class-conditional generator (or of the one an EMA or DDP wrapper
    holds in ``.module``); None for an unconditional one."""
    return getattr(getattr(generator, "module", generator), "num_classes", 0) or None


def slerp(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Spherical interpolation between rows of ``a`` and ``b`` at fractions ``t``.

    Gaussian latents live near a sphere; a straight line between two of them passes through
    improbable low-norm points, the great circle does not.
    """
    a_n, b_n = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    omega = exact.arccos((a_n * b_n).sum(-1, keepdim=True).clamp(-1.0, 1.0))
    so = torch.sin(omega)
    t = t.reshape(-1, 1)
    linear = (1 - t) * a + t * b
    spherical = (torch.sin((1 - t) * omega) * a + torch.sin(t * omega) * b) / so.clamp_min(1e-12)
    return torch.where(so.abs() < 1e-6, linear, spherical)


@torch.no_grad()
def generate(
    generator: torch.nn.Module,
    z: torch.Tensor,
    batch_size: int = 256,
    labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """Images (CPU, [-1, 1]) of latents ``z`` (and ``labels`` for a conditional generator),
    generator in eval mode, in batches."""
    device = next(generator.parameters()).device
    generator.eval()
    chunks = z.split(batch_size)
    classes = [None] * len(chunks) if labels is None else labels.split(batch_size)
    out = []
    for chunk, y in zip(chunks, classes, strict=True):
        inputs = (chunk.to(device),) if y is None else (chunk.to(device), y.to(device))
        out.append(generator(*inputs).clamp(-1, 1).cpu())
    return torch.cat(out)


def sample_grid(
    generator: torch.nn.Module, z_dim: int, rows: int, seed: int, truncation: float | None = None
) -> np.ndarray:
    """A ``rows x rows`` grid of samples ``0 .. rows² - 1`` of ``seed``; for a conditional
    generator one row of ``rows`` samples per class (samples ``0 ..`` in row order)."""
    num_classes = num_classes_of(generator)
    lines = rows if num_classes is None else num_classes
    z = sample_latents(seed, range(lines * rows), z_dim, truncation)
    labels = None if num_classes is None else grid_labels(num_classes, rows, num_classes)
    return image_grid(generate(generator, z, labels=labels), rows)


def interpolation_strips(
    generator: torch.nn.Module,
    z_dim: int,
    rows: int,
    steps: int,
    seed: int,
    truncation: float | None = None,
) -> np.ndarray:
    """``rows`` strips of ``steps`` images, each along the great circle between two latents."""
    ends = sample_latents(
        runtime.derive_seed(seed, "interpolation"), range(2 * rows), z_dim, truncation
    )
    t = torch.linspace(0, 1, steps)
    z = torch.cat(
        [
            slerp(ends[2 * r].expand(steps, -1), ends[2 * r + 1].expand(steps, -1), t)
            for r in range(rows)
        ]
    )
    num_classes = num_classes_of(generator)  # strip r: class r mod num_classes
    labels = None if num_classes is None else grid_labels(rows, steps, num_classes)
    return image_grid(generate(generator, z, labels=labels), steps)


def sample_pngs(
    generator: torch.nn.Module,
    z_dim: int,
    indices: Sequence[int],
    seed: int,
    truncation: float | None = None,
    batch_size: int = 256,
    progress: bool = True,
    label: int | None = None,
) -> Iterator[tuple[Path, bytes]]:
    """``(file name, PNG bytes)`` of samples ``indices`` of ``seed``, in their order.

    Sample ``i`` is ``NNNNNN.png`` (its index, 6 digits); a conditional generator's is
    ``<class>/NNNNNN.png``, drawn for class ``label``, or for class ``i mod classes``
    without one. The samples are generated ``batch_size`` at a time, in the order given.
    """
    num_classes = num_classes_of(generator)
    with tqdm(
        total=len(indices), desc="export", unit="img", disable=not progress, mininterval=1.0
    ) as bar:
        for start in range(0, len(indices), batch_size):
            chunk = indices[start : start + batch_size]
            z = sample_latents(seed, chunk, z_dim, truncation)
            labels = None
            if num_classes is not None:
                labels = sample_labels(chunk, num_classes)
                if label is not None:
                    labels = torch.full_like(labels, label)
            images = generate(generator, z, labels=labels)
            for row, (i, image) in enumerate(zip(chunk, images, strict=True)):
                name = Path(f"{i:06d}.png")
                if labels is not None:
                    name = str(int(labels[row])) / name
                yield name, png_bytes(to_uint8(image).permute(1, 2, 0).numpy())
            bar.update(len(chunk))


def export_pngs(
    generator: torch.nn.Module,
    z_dim: int,
    count: int,
    seed: int,
    out_dir: Path,
    truncation: float | None = None,
    batch_size: int = 256,
    progress: bool = True,
) -> None:
    """Write samples ``0 .. count - 1`` as ``out_dir/000000.png`` ... (a conditional
    generator's as ``out_dir/<class>/000000.png``, sample ``i`` of class ``i mod classes``;
    see :func:`sample_pngs`); the folder is built beside ``out_dir`` and swapped in when
    complete, so it never holds a partial set."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    beside = build_dir_for(out_dir)  # out_dir may link to another disk: built there
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}{TMP_MARK}", dir=beside))
    try:
        pngs = sample_pngs(generator, z_dim, range(count), seed, truncation, batch_size, progress)
        for name, data in pngs:
            (tmp / name).parent.mkdir(exist_ok=True)
            (tmp / name).write_bytes(data)
        replace_dir(tmp, out_dir)
    except OSError as exc:
        done = list(tmp.rglob("*.png"))
        written = sum(p.stat().st_size for p in done)
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno not in NO_SPACE_ERRNOS:
            raise
        # the images written so far, scaled to the whole set: about what the folder needs
        raise no_space_error(exc, out_dir, written * count // len(done) if done else None) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def grid_labels(rows: int, columns: int, num_classes: int) -> torch.Tensor:
    """Labels of a ``rows x columns`` grid of a conditional model: row ``r`` is class
    ``r % num_classes``."""
    return (torch.arange(rows * columns) // columns) % num_classes


@torch.no_grad()
def snapshot(
    generator: torch.nn.Module, z: torch.Tensor, rows: int, labels: torch.Tensor | None = None
) -> np.ndarray:
    """A ``rows x rows`` grid (HWC uint8) from fixed latents (and labels of a conditional
    G), with G in eval mode."""
    was_training = generator.training
    generator.eval()
    images = (generator(z) if labels is None else generator(z, labels)).float().cpu()
    generator.train(was_training)
    return image_grid(images, rows)
