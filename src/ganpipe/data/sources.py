"""Image sources: list what a dataset holds before anything is decoded.

Each source returns a :class:`Listing`: class names and an ordered list of items
``(name, label, payload)`` where the payload is a file path (decoded later, in parallel)
or an in-memory uint8 array. The order is deterministic (sorted paths, file order), so
the split and the content hash only depend on the data and the seed.
"""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ganpipe.data.convert import is_image_name


class SourceError(ValueError):
    """The dataset named in params cannot be read; the message names the key and the fix."""


@dataclass
class Listing:
    """What a source holds, in a deterministic order."""

    classes: list[str]
    names: list[str]
    labels: list[int]
    payloads: list[Path | np.ndarray]
    empty_classes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.names)


def list_digits() -> Listing:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images, values 0..16)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype(np.uint8)
    return Listing(
        classes=[str(c) for c in range(10)],
        names=[f"digits[{i}]" for i in range(len(pixels))],
        labels=[int(y) for y in digits.target],
        payloads=list(pixels),
    )


def _unreadable(exc: OSError) -> None:
    """``os.walk``'s error hook: without it, a folder that cannot be listed looks empty."""
    raise SourceError(
        f"folder {exc.filename!r} under data.path cannot be read ({exc.strerror or exc}); "
        "fix its permissions, or move it out of data.path"
    ) from exc


def _image_files(folder: Path) -> list[Path]:
    """Image files under ``folder`` (recursive, hidden entries skipped), sorted by path.

    Raises:
        SourceError: a folder under ``folder`` cannot be listed.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, onerror=_unreadable, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if not f.startswith(".") and is_image_name(f)]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def list_folder(root: Path, allow_empty_classes: bool) -> Listing:
    """An image folder: class sub-folders (ImageFolder layout) or flat (one class).

    Args:
        root: The folder named by ``data.path``.
        allow_empty_classes: Keep a class folder without images (``on_bad_image: skip``)
            instead of failing; it keeps its label and is listed in ``empty_classes``.
    """
    if not root.exists():
        raise SourceError(f"data.path={str(root)!r} does not exist; point it at an image folder")
    if not root.is_dir():
        raise SourceError(f"data.path={str(root)!r} is not a folder; point it at an image folder")
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError as exc:
        raise SourceError(f"data.path={str(root)!r} cannot be read: {exc}") from exc
    loose = [Path(e.path) for e in entries if e.is_file() and is_image_name(e.name)]
    class_dirs = [
        Path(e.path)
        for e in entries
        if e.is_dir(follow_symlinks=True) and not e.name.startswith(".")
    ]
    if loose and class_dirs:
        raise SourceError(
            f"data.path={str(root)!r} holds both images ({loose[0].name}, ...) and sub-folders "
            f"({class_dirs[0].name}, ...); put every image in a class folder, or use a flat folder"
        )
    if loose:
        groups = [(root.name or "images", _image_files(root))]
    else:
        groups = [(d.name, _image_files(d)) for d in class_dirs]
    empty = [name for name, files in groups if not files]
    if all(not files for _, files in groups):
        raise SourceError(
            f"data.path={str(root)!r} holds no image files (extensions are matched "
            "case-insensitively: png, jpg, jpeg, bmp, gif, tif, tiff, webp, ppm, pgm, pbm)"
        )
    if empty and not allow_empty_classes:
        raise SourceError(
            f"data.path={str(root)!r}: class folder(s) without images: {', '.join(empty)}; "
            "remove them, or set data.on_bad_image=skip to keep them as empty classes"
        )
    listing = Listing(
        classes=[name for name, _ in groups], names=[], labels=[], payloads=[], empty_classes=empty
    )
    for label, (_, files) in enumerate(groups):
        for path in files:
            listing.names.append(path.relative_to(root).as_posix())
            listing.labels.append(label)
            listing.payloads.append(path)
    return listing


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """CIFAR-10 batches are pickles; allow only what they hold (numpy arrays, builtins)."""

    _allowed: frozenset[tuple[str, str]] = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("copyreg", "_reconstructor"),
            ("builtins", "object"),
        }
    )

    def find_class(self, module: str, name: str):
        if (module, name) in self._allowed:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR-10 batch")


def _read_cifar_batch(path: Path) -> dict:
    if not path.is_file():
        raise SourceError(
            f"data.source=cifar10: {path} is missing; data.path must be the "
            "'cifar-10-batches-py' folder (or its parent) from the python version of CIFAR-10"
        )
    try:
        with open(path, "rb") as handle:
            batch = _ArraysOnlyUnpickler(handle, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, OSError, ValueError) as exc:
        raise SourceError(f"data.source=cifar10: {path} is not a CIFAR-10 batch: {exc}") from exc
    if not isinstance(batch, dict):
        raise SourceError(f"data.source=cifar10: {path} is not a CIFAR-10 batch (not a dict)")
    return batch


def list_cifar10(root: Path) -> Listing:
    """The CIFAR-10 python batches: the five training batches (50,000 images)."""
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    meta = _read_cifar_batch(root / "batches.meta")
    images, labels = [], []
    for i in range(1, 6):
        batch = _read_cifar_batch(root / f"data_batch_{i}")
        try:
            data = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            labels += [int(y) for y in batch["labels"]]
        except (KeyError, ValueError) as exc:
            raise SourceError(f"data.source=cifar10: {root / f'data_batch_{i}'}: {exc}") from exc
        images.append(data.transpose(0, 2, 3, 1))
    pixels = np.concatenate(images)
    if len(pixels) != len(labels):
        raise SourceError(f"data.source=cifar10: {root}: image and label counts differ")
    return Listing(
        classes=[str(c) for c in meta["label_names"]],
        names=[f"cifar10[{i}]" for i in range(len(pixels))],
        labels=labels,
        payloads=list(pixels),
    )


def read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST format: big-endian header, uint8 payload), gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            data = handle.read()
        zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
        shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    except (OSError, EOFError, struct.error) as exc:
        raise SourceError(f"data.source=mnist: {path} is not an IDX file: {exc}") from exc
    if zero != 0 or dtype_code != 0x08:
        raise SourceError(f"data.source=mnist: {path} is not a uint8 IDX file")
    payload = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if payload.size != int(np.prod(shape)):
        raise SourceError(f"data.source=mnist: {path} is truncated ({payload.size} values)")
    return payload.reshape(shape)


def _find_idx(root: Path, stem: str) -> Path:
    for folder in (root, root / "MNIST" / "raw", root / "raw"):
        for name in (stem, f"{stem}.gz"):
            if (folder / name).is_file():
                return folder / name
    raise SourceError(
        f"data.source=mnist: {stem}[.gz] not found in data.path={str(root)!r}; "
        "point data.path at the folder holding the MNIST IDX files"
    )


def list_mnist(root: Path) -> Listing:
    """MNIST's IDX training files (60,000 images)."""
    if not root.is_dir():
        raise SourceError(f"data.path={str(root)!r} is not a folder holding the MNIST IDX files")
    images = read_idx(_find_idx(root, "train-images-idx3-ubyte"))
    labels = read_idx(_find_idx(root, "train-labels-idx1-ubyte"))
    if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
        raise SourceError(f"data.source=mnist: {root}: image and label files do not match")
    return Listing(
        classes=[str(c) for c in range(10)],
        names=[f"mnist[{i}]" for i in range(len(images))],
        labels=[int(y) for y in labels],
        payloads=list(images),
    )


def list_source(source: str, path: Path | None, allow_empty_classes: bool = False) -> Listing:
    """Dispatch on ``data.source``."""
    if source == "digits":
        return list_digits()
    assert path is not None, "params validation guarantees a path"
    if source == "folder":
        return list_folder(path, allow_empty_classes)
    if not path.exists():
        raise SourceError(f"data.path={str(path)!r} does not exist")
    if source == "cifar10":
        return list_cifar10(path)
    if source == "mnist":
        return list_mnist(path)
    raise AssertionError(f"unknown source {source}")
