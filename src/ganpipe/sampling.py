"""Sample images from a generator: grids and exported files."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.utils import make_grid

from ganpipe.checkpoint import write_bytes_atomic


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """``[-1, 1]`` float images -> uint8 (round to nearest, clamp)."""
    return images.float().add(1).mul(127.5).round().clamp(0, 255).to(torch.uint8)


def image_grid(images: torch.Tensor, rows: int) -> np.ndarray:
    """A grid (HWC uint8, 2-pixel black padding) of ``[-1, 1]`` images, ``rows`` per row."""
    grid = make_grid(to_uint8(images.cpu()), nrow=rows, padding=2, pad_value=0)
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


@torch.no_grad()
def generate_grid(generator: torch.nn.Module, z_dim: int, rows: int, seed: int) -> np.ndarray:
    """A ``rows x rows`` grid from latents seeded by ``seed`` (generator in eval mode)."""
    z = torch.randn(rows * rows, z_dim, generator=torch.Generator().manual_seed(seed))
    device = next(generator.parameters()).device
    generator.eval()
    return image_grid(generator(z.to(device)), rows)
