"""The LMDB image dataset read by training and evaluation."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import torch
from torch.utils.data import Dataset

from ganpipe.data.store import (
    LABEL,
    DatasetError,
    damaged,
    open_readonly,
    read_meta,
    reading,
    record_key,
)


def uint8_to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in ``[-1, 1]``: ``x / 127.5 - 1`` (exactly invertible)."""
    return images.to(torch.float32, memory_format=torch.contiguous_format).div_(127.5).sub_(1.0)


class LmdbImageDataset(Dataset):
    """Images in ``[-1, 1]`` (float32, CHW) with their integer label, read from LMDB.

    With ``as_uint8=True`` the images stay uint8 (CHW) and the consumer converts whole
    batches with :func:`uint8_to_float`, ideally on the GPU: a DataLoader worker then moves
    a quarter of the bytes through shared memory, which is what limits throughput with
    worker processes (benchmarks/loader.py).

    The environment is opened lazily in whichever process reads first (read-only, no lock
    file, no readahead; see :func:`~ganpipe.data.store.open_readonly`) and is dropped when
    the dataset is pickled, so spawned DataLoader workers and DistributedSampler ranks each
    open their own handle. Reading never writes to the database folder.
    """

    def __init__(self, path: str | Path, as_uint8: bool = False):
        self.path = Path(path)
        self.as_uint8 = as_uint8
        self.meta: dict[str, Any] = read_meta(self.path)
        height, width, channels = self.meta["shape"]
        self.shape = (channels, height, width)
        self._hwc = (height, width, channels)
        self._record_size = LABEL.size + height * width * channels
        self._env = None

    def __len__(self) -> int:
        return int(self.meta["count"])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_env"] = None
        return state

    @contextmanager
    def _txn(self) -> Iterator[lmdb.Transaction]:
        """A read transaction; LMDB's errors (a damaged page) become one user error."""
        if self._env is None:
            self._env = open_readonly(self.path)
        with reading(self.path), self._env.begin(buffers=True) as txn:
            yield txn

    def _value(self, txn: lmdb.Transaction, index: int) -> memoryview:
        value = txn.get(record_key(index))
        if value is None:
            raise damaged(self.path, f"record {index} of {len(self)} is missing")
        return value

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        """Read and convert a whole batch at once (DataLoader calls this when present).

        One read transaction and one vectorised uint8 -> float conversion per batch instead
        of one per image: per-image tensor operations cost more than the reading itself.
        """
        if not all(0 <= i < len(self) for i in indices):
            raise IndexError(f"index out of range for {len(self)} records in {self.path}")
        records = np.empty((len(indices), self._record_size), dtype=np.uint8)
        with self._txn() as txn:
            for row, index in enumerate(indices):
                value = self._value(txn, index)
                if len(value) != self._record_size:
                    raise damaged(
                        self.path,
                        f"record {index} has {len(value)} bytes, expected {self._record_size}",
                    )
                records[row] = np.frombuffer(value, dtype=np.uint8)
        labels = records[:, : LABEL.size].copy().view("<i4")[:, 0].tolist()
        pixels = torch.from_numpy(records[:, LABEL.size :].reshape(len(indices), *self._hwc))
        images = pixels.permute(0, 3, 1, 2)
        images = images.contiguous() if self.as_uint8 else uint8_to_float(images)
        return list(zip(images.unbind(0), labels, strict=True))

    def uint8_array(self) -> np.ndarray:
        """All images as one ``(N, H, W, C)`` uint8 array (for metrics and tests)."""
        out = np.empty((len(self), *self._hwc), dtype=np.uint8)
        with self._txn() as txn:
            for i in range(len(self)):
                out[i] = np.frombuffer(self._value(txn, i), np.uint8, offset=LABEL.size).reshape(
                    self._hwc
                )
        return out

    def class_counts(self) -> list[int]:
        """Images per label (label ``i`` at index ``i``), as the meta record says and every
        record confirms.

        Raises:
            DatasetError: the meta record has no ``class_counts``, or the records' labels
                disagree with it (a label outside ``0..len(class_counts)-1``, or other counts).
        """
        fix = "rebuild it with `dvc repro prepare`"
        counts = self.meta.get("class_counts")
        if counts is None:
            raise DatasetError(f"{self.path}: the meta record has no class_counts; {fix}")
        labels = self.labels()
        outside = labels[(labels < 0) | (labels >= len(counts))]
        if outside.size:
            raise DatasetError(
                f"{self.path}: {outside.size} record(s) have labels outside "
                f"0..{len(counts) - 1} (e.g. {outside[0]}), the {len(counts)} classes of the "
                f"meta record's class_counts; {fix}"
            )
        found = np.bincount(labels, minlength=len(counts)).tolist()
        if found != counts:
            raise DatasetError(
                f"{self.path}: the records hold {found} images per label but the meta record's "
                f"class_counts says {counts}; {fix}"
            )
        return counts

    def labels(self) -> np.ndarray:
        """All labels as an int64 array."""
        with self._txn() as txn:
            return np.array(
                [LABEL.unpack_from(self._value(txn, i))[0] for i in range(len(self))],
                dtype=np.int64,
            )
