"""Image sources: list what a dataset holds before anything is decoded.

Each source returns a :class:`Listing`: class names and an ordered list of items
``(name, label, payload)`` where the payload is a file path (decoded later, in parallel)
or an in-memory uint8 array. The order is deterministic (sorted paths, file order), so
the split and the content hash only depend on the data and the seed.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import pickle
import stat
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ganpipe.data.convert import file_kind, is_image_name
from ganpipe.errors import UserError

log = logging.getLogger(__name__)

#: The most bytes an IDX payload may hold. MNIST's training images are 47 MB; the bound keeps
#: a forged header (or a small gzip stream that inflates to gigabytes) from being read whole.
MAX_IDX_BYTES = 1 << 31


class SourceError(UserError):
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


def _folder_key(path: Path | os.DirEntry) -> tuple[int, int]:
    info = path.stat()  # follows links: a link and its target are the same folder
    return info.st_dev, info.st_ino


def _image_files(folder: Path, visited: dict[tuple[int, int], Path]) -> list[Path]:
    """Image files under ``folder`` (recursive, hidden entries skipped), sorted by path.

    Links are followed, but each folder is read once: ``visited`` maps the (device, inode) of
    every folder read so far (this listing's, across classes) to the path it was read as, and
    a link back to one of them is skipped, so a link loop neither repeats images nor runs
    forever. Only regular files are listed: FIFOs, sockets and devices with an image name are
    skipped (a FIFO would block the decoder). Entries that cannot be examined (a dangling
    link) are listed, and decoding reports them as bad images.

    Raises:
        SourceError: a folder under ``folder`` cannot be listed.
    """
    found = []
    pending = [folder]
    while pending:
        directory = pending.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError as exc:
            _unreadable(exc)
        subfolders = []
        for entry in entries:
            if entry.name.startswith("."):
                continue
            path = Path(entry.path)
            if entry.is_dir():
                try:
                    key = _folder_key(entry)
                except OSError as exc:
                    _unreadable(exc)
                if key in visited:
                    log.warning(
                        "skipping %s: it is %s again (a link?); each folder is read once",
                        path,
                        visited[key],
                    )
                    continue
                visited[key] = path
                subfolders.append(path)
            elif is_image_name(entry.name):
                try:
                    mode = entry.stat().st_mode
                except OSError:
                    found.append(path)
                    continue
                if stat.S_ISREG(mode):
                    found.append(path)
                else:
                    log.warning("skipping %s: %s, not an image file", path, file_kind(mode))
        pending += reversed(subfolders)
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
    visited = {_folder_key(root): root}
    if loose:
        groups = [(root.name or "images", _image_files(root, visited))]
    else:
        groups = []
        for folder in class_dirs:
            key = _folder_key(folder)
            if key in visited:
                raise SourceError(
                    f"data.path={str(root)!r}: class folder {folder.name!r} is the folder "
                    f"{str(visited[key])!r} again (a link?); remove one of the two, so that no "
                    "image is listed twice"
                )
            visited[key] = folder
            groups.append((folder.name, _image_files(folder, visited)))
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
    except Exception as exc:  # an untrusted pickle fails in many ways (TypeError, IndexError...)
        raise SourceError(f"data.source=cifar10: {path} is not a CIFAR-10 batch: {exc}") from exc
    if not isinstance(batch, dict):
        raise SourceError(f"data.source=cifar10: {path} is not a CIFAR-10 batch (not a dict)")
    return batch


def _cifar_class_names(path: Path) -> list[str]:
    meta = _read_cifar_batch(path)
    names = meta.get("label_names")
    if (
        not isinstance(names, list | tuple)
        or not names
        or not all(isinstance(name, str) for name in names)
    ):
        raise SourceError(
            f"data.source=cifar10: {path} has no 'label_names' list of class names; it is not "
            "the batches.meta of CIFAR-10's python version: replace it with that file"
        )
    return list(names)


def _cifar_arrays(path: Path, batch: dict, num_classes: int) -> tuple[np.ndarray, list[int]]:
    """A batch's images (N, 32, 32, 3) and labels, checked: values are never cast or wrapped."""

    def refuse(problem: str) -> SourceError:
        return SourceError(
            f"data.source=cifar10: {path}: {problem}; the file is damaged or not a CIFAR-10 "
            "batch: replace it with the one from CIFAR-10's python version"
        )

    if "data" not in batch or "labels" not in batch:
        missing = [key for key in ("data", "labels") if key not in batch]
        raise refuse(f"no {' and '.join(repr(k) for k in missing)} entry")
    data, labels = batch["data"], batch["labels"]
    if not (
        isinstance(data, np.ndarray)
        and data.dtype == np.uint8
        and data.ndim == 2
        and data.shape[1] == 3 * 32 * 32
    ):
        found = (
            f"a {data.dtype} array of shape {data.shape}"
            if isinstance(data, np.ndarray)
            else f"a {type(data).__name__}"
        )
        raise refuse(f"'data' must be a uint8 array of shape (N, 3072), found {found}")
    values = np.asarray(labels) if isinstance(labels, list | tuple | np.ndarray) else None
    if values is not None and values.size == 0:
        values = values.astype(np.int64)  # [] reads as float64
    if values is None or values.ndim != 1 or values.dtype.kind not in "iu":
        found = type(labels).__name__
        if values is not None:
            found += f" of {values.dtype} values, shape {values.shape}"
        raise refuse(f"'labels' must be a list of integers, found {found}")
    if len(values) != len(data):
        raise refuse(f"{len(data)} images but {len(values)} labels")
    outside = np.flatnonzero((values < 0) | (values >= num_classes))
    if outside.size:
        raise refuse(
            f"{outside.size} label(s) outside 0..{num_classes - 1} (e.g. {values[outside[0]]} "
            f"at index {outside[0]}; batches.meta names {num_classes} classes)"
        )
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), values.tolist()


def list_cifar10(root: Path) -> Listing:
    """The CIFAR-10 python batches: the five training batches (50,000 images)."""
    if (root / "cifar-10-batches-py").is_dir():
        root = root / "cifar-10-batches-py"
    classes = _cifar_class_names(root / "batches.meta")
    images, labels = [], []
    for i in range(1, 6):
        path = root / f"data_batch_{i}"
        data, batch_labels = _cifar_arrays(path, _read_cifar_batch(path), len(classes))
        images.append(data)
        labels += batch_labels
    pixels = np.concatenate(images)
    return Listing(
        classes=classes,
        names=[f"cifar10[{i}]" for i in range(len(pixels))],
        labels=labels,
        payloads=list(pixels),
    )


def read_idx(path: Path, max_bytes: int = MAX_IDX_BYTES) -> np.ndarray:
    """Read an IDX file (the MNIST format: big-endian header, uint8 payload), gzipped or not.

    Reads the header, then exactly the payload it announces (at most ``max_bytes``) and one
    byte more to tell a longer file: memory stays bounded by the header, whatever the file
    (or a gzip stream) holds.
    """

    def refuse(problem: str) -> SourceError:
        return SourceError(
            f"data.source=mnist: {path} {problem}; replace it with the MNIST IDX file"
        )

    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            zero, dtype_code, ndim = struct.unpack(">HBB", handle.read(4))
            if zero != 0 or dtype_code != 0x08:
                raise refuse("is not a uint8 IDX file (wrong magic number)")
            shape = struct.unpack(f">{ndim}I", handle.read(4 * ndim))
            size = math.prod(shape)
            if size > max_bytes:
                raise refuse(
                    f"announces shape {shape}: {size:,} bytes, more than the {max_bytes:,} "
                    "read at most"
                )
            payload = handle.read(size)
            longer = handle.read(1)
    except (OSError, EOFError, struct.error, zlib.error) as exc:
        raise refuse(f"cannot be read as an IDX file ({exc})") from exc
    if len(payload) < size:
        raise refuse(
            f"is truncated: its header announces shape {shape} but it holds "
            f"{len(payload):,} of {size:,} bytes"
        )
    if longer:
        raise refuse(f"holds more data than its header announces (shape {shape})")
    return np.frombuffer(payload, dtype=np.uint8).reshape(shape)


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
    images_path = _find_idx(root, "train-images-idx3-ubyte")
    labels_path = _find_idx(root, "train-labels-idx1-ubyte")
    images, labels = read_idx(images_path), read_idx(labels_path)
    fix = "replace it with the MNIST IDX file"
    if images.ndim != 3 or 0 in images.shape:
        raise SourceError(
            f"data.source=mnist: {images_path} holds images of shape {images.shape}, not "
            f"(count >= 1, rows >= 1, columns >= 1); {fix}"
        )
    if labels.ndim != 1 or len(images) != len(labels):
        raise SourceError(
            f"data.source=mnist: {images_path} ({len(images)} images) and {labels_path} "
            f"(shape {labels.shape}) do not match: each image needs one label; replace them with "
            "the MNIST IDX files"
        )
    outside = np.flatnonzero(labels > 9)
    if outside.size:
        raise SourceError(
            f"data.source=mnist: {labels_path} holds {outside.size} label(s) outside 0..9 "
            f"(e.g. {labels[outside[0]]} at index {outside[0]}); {fix}"
        )
    return Listing(
        classes=[str(c) for c in range(10)],
        names=[f"mnist[{i}]" for i in range(len(images))],
        labels=labels.tolist(),
        payloads=list(images),
    )


def check_labels(listing: Listing, where: str) -> None:
    """Every label must name one of the listing's classes (a record never holds another).

    Raises:
        SourceError: a label outside ``0 .. len(classes) - 1``.
    """
    labels = np.asarray(listing.labels, dtype=np.int64)
    outside = np.flatnonzero((labels < 0) | (labels >= len(listing.classes)))
    if outside.size:
        first = outside[0]
        raise SourceError(
            f"{where}: {outside.size} label(s) outside 0..{len(listing.classes) - 1}, e.g. "
            f"{listing.labels[first]} for {listing.names[first]}; fix the labels of the source"
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
        listing = list_cifar10(path)
    elif source == "mnist":
        listing = list_mnist(path)
    else:
        raise AssertionError(f"unknown source {source}")
    check_labels(listing, f"data.source={source} (data.path={str(path)!r})")
    return listing
