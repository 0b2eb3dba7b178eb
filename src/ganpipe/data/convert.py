"""Turn one image (a file or an array) into fixed-size uint8 pixels.

Rules, applied in this order (docs/data.md, "Conversion rules" and "Bad input", documents them
for users):

1. Files are opened with Pillow by content, not extension; the first frame of an animation
   is used; EXIF orientation is applied.
2. 16-bit and 32-bit integer images (modes I;16*, I) are scaled by 255/65535 and rounded;
   float images (mode F) are clipped to 0..255. Bilevel (1) becomes 0/255.
3. Transparency (RGBA, LA, PA, P with a transparent index) is composited on black:
   ``out = colour * alpha / 255``. The alpha channel is then gone.
4. The image becomes grayscale (Pillow "L": ITU-R 601-2 luma) or RGB.
5. Resize so the short side equals ``image_size`` and center-crop the long side
   (``ImageOps.fit``) with bicubic resampling, which is antialiased when shrinking.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ganpipe.errors import UserError

RESAMPLE = Image.Resampling.BICUBIC
IMAGE_EXTENSIONS = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm"}
)


#: How many unreadable files one error lists by name (the rest are counted).
MAX_LISTED_BAD = 20


class BadImageError(UserError):
    """Images that cannot be read or converted.

    ``name`` and ``reason`` are the first bad image's; ``bad`` lists every ``(name, reason)``.
    """

    def __init__(self, name: str, reason: str, message: str | None = None):
        super().__init__(message or f"{name}: {reason}")
        self.name = name
        self.reason = reason
        self.bad = [(name, reason)]

    @classmethod
    def listing(cls, bad: list[tuple[str, str]], where: str, fix: str) -> BadImageError:
        """One error for every unreadable image of a scan, listed up to
        :data:`MAX_LISTED_BAD` (then counted), so they can all be fixed before one rerun."""
        if len(bad) == 1:
            name, reason = bad[0]
            error = cls(name, reason, f"{name} (in {where}): {reason}. {fix}")
        else:
            lines = [f"  - {name}: {reason}" for name, reason in bad[:MAX_LISTED_BAD]]
            if len(bad) > MAX_LISTED_BAD:
                lines.append(f"  ... and {len(bad) - MAX_LISTED_BAD} more")
            message = f"{len(bad)} unreadable images in {where}. {fix}:\n" + "\n".join(lines)
            error = cls(*bad[0], message)
        error.bad = list(bad)
        return error


def is_image_name(name: str) -> bool:
    """True when the file name has an image extension (case-insensitive)."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _to_8bit(image: Image.Image) -> Image.Image:
    """Bring high bit-depth and bilevel images to 8 bits per channel."""
    if image.mode.startswith("I"):
        wide = np.asarray(image, dtype=np.float64)
        return Image.fromarray(np.clip(np.rint(wide * (255 / 65535)), 0, 255).astype(np.uint8))
    if image.mode == "F":
        return Image.fromarray(np.clip(np.rint(np.asarray(image)), 0, 255).astype(np.uint8))
    if image.mode == "1":
        return image.convert("L")
    return image


def _drop_alpha(image: Image.Image) -> Image.Image:
    """Composite any transparency on black, returning an L or RGB image."""
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("LA", "La", "PA", "RGBa", "RGBA"):
        rgba = image.convert("RGBA")
        black = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        return Image.alpha_composite(black, rgba).convert("RGB")
    if image.mode in ("L", "RGB"):
        return image
    return image.convert("RGB")


def convert_image(image: Image.Image, image_size: int, channels: int) -> np.ndarray:
    """Convert a decoded image to ``(image_size, image_size, channels)`` uint8 pixels."""
    image = _drop_alpha(_to_8bit(image))
    image = image.convert("L" if channels == 1 else "RGB")
    image = ImageOps.fit(image, (image_size, image_size), method=RESAMPLE)
    pixels = np.asarray(image, dtype=np.uint8)
    return pixels.reshape(image_size, image_size, channels)


def _open_nonblocking(path: str, flags: int) -> int:
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


def open_image(path: Path) -> Image.Image:
    """Decode an image file fully (so truncation is detected here, not later).

    Only regular files are read: a FIFO named ``x.png`` would block the reader forever, and a
    device would be read without end. The file is opened non-blocking (which changes nothing
    for a regular file) and checked after opening, so a file swapped for a FIFO after the
    folder was listed cannot hang either.
    """
    with open(path, "rb", opener=_open_nonblocking) as file:
        mode = os.fstat(file.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"not a regular file ({file_kind(mode)})")
        try:
            handle = Image.open(file)
        except UnidentifiedImageError:
            # Pillow names a file object by its repr; say the path, as for Image.open(path).
            raise UnidentifiedImageError(f"cannot identify image file {str(path)!r}") from None
        with handle:
            handle.seek(0)
            image = ImageOps.exif_transpose(handle)
            image.load()
            return image


def file_kind(mode: int) -> str:
    """What kind of file a ``st_mode`` describes, in words (for messages)."""
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((word for test, word in kinds if test(mode)), "not a regular file")


def decode(item: tuple[str, Path | np.ndarray], image_size: int, channels: int) -> np.ndarray:
    """Decode and convert one ``(name, file path or uint8 array)`` item.

    Raises:
        BadImageError: the file cannot be decoded or converted (the reason is kept).
    """
    name, payload = item
    try:
        image = Image.fromarray(payload) if isinstance(payload, np.ndarray) else open_image(payload)
        return convert_image(image, image_size, channels)
    except Exception as exc:  # untrusted files fail in many ways (OSError, SyntaxError, ...)
        reason = str(exc) or type(exc).__name__
        raise BadImageError(name, f"{type(exc).__name__}: {reason}") from exc
