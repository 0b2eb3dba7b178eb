"""The LMDB image dataset read by training and evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ganpipe.data.store import LABEL, open_readonly, read_meta, record_key


class LmdbImageDataset(Dataset):
    """Images in ``[-1, 1]`` (float32, CHW) with their integer label, read from LMDB.

    The environment is opened lazily in whichever process reads first (read-only, no lock
    file, no readahead; see :func:`~ganpipe.data.store.open_readonly`) and is dropped when
    the dataset is pickled, so spawned DataLoader workers and DistributedSampler ranks each
    open their own handle. Reading never writes to the database folder.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
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

    def _txn(self):
        if self._env is None:
            self._env = open_readonly(self.path)
        return self._env.begin(buffers=True)

    def _decode(self, value: memoryview) -> tuple[torch.Tensor, int]:
        if len(value) != self._record_size:
            raise ValueError(
                f"{self.path}: record of {len(value)} bytes, expected "
                f"{self._record_size}; rebuild with `dvc repro prepare`"
            )
        (label,) = LABEL.unpack_from(value)
        pixels = np.frombuffer(value, dtype=np.uint8, offset=LABEL.size).reshape(self._hwc)
        image = torch.from_numpy(pixels.transpose(2, 0, 1).astype(np.float32))
        return image.div_(127.5).sub_(1.0), label

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        """Read a whole batch in one read transaction (DataLoader calls this when present)."""
        if not all(0 <= i < len(self) for i in indices):
            raise IndexError(f"index out of range for {len(self)} records in {self.path}")
        with self._txn() as txn:
            return [self._decode(txn.get(record_key(i))) for i in indices]

    def uint8_array(self) -> np.ndarray:
        """All images as one ``(N, H, W, C)`` uint8 array (for metrics and tests)."""
        out = np.empty((len(self), *self._hwc), dtype=np.uint8)
        with self._txn() as txn:
            for i in range(len(self)):
                out[i] = np.frombuffer(txn.get(record_key(i)), np.uint8, offset=LABEL.size).reshape(
                    self._hwc
                )
        return out

    def labels(self) -> np.ndarray:
        """All labels as an int64 array."""
        with self._txn() as txn:
            return np.array(
                [LABEL.unpack_from(txn.get(record_key(i)))[0] for i in range(len(self))],
                dtype=np.int64,
            )
