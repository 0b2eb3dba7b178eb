"""Atomic saving and safe loading of model files."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch


def write_bytes_atomic(data: bytes, path: Path) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename over ``path``.

    A reader (or a crash) sees the old file or the new one, never a partial one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` atomically.

    The object is serialised to memory first: ``torch.save`` embeds the file name in the
    archive, so saving to a temporary name would make identical weights hash differently.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    write_bytes_atomic(buffer.getvalue(), path)


def load(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load`` with ``weights_only=True``: tensors and plain containers only, no code."""
    return torch.load(path, map_location=map_location, weights_only=True)
