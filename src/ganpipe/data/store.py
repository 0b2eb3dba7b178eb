"""The LMDB layout: one environment per split, raw pixels, a JSON meta record written last.

Record ``i`` has the key ``b"%08d" % i`` and the value ``label (int32, little-endian)``
followed by the ``H*W*C`` uint8 pixels in HWC order. Nothing is pickled. The meta record
(:data:`META_KEY`) is JSON and is written in the last commit: a database without it is
incomplete and is refused by readers. The meta records of a train/val pair both hold the
pair's content hashes (``pair``), so a reader of both splits can tell that they were
written by the same prepare run (:func:`check_pair`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path
from typing import Any

import lmdb

META_KEY = b"__meta__"
FORMAT = "ganpipe-lmdb"
FORMAT_VERSION = 1
LABEL = struct.Struct("<i")
KEY_DIGITS = 8


class DatasetError(ValueError):
    """An LMDB database is missing, incomplete or not ours; the message says what to run."""


def record_key(index: int) -> bytes:
    """The zero-padded ASCII key of record ``index``."""
    return b"%0*d" % (KEY_DIGITS, index)


def encode_record(label: int, pixels: bytes) -> bytes:
    """The value of one record: int32 label then the raw pixels."""
    return LABEL.pack(label) + pixels


class LmdbWriter:
    """Append records to a new LMDB environment in batched commits.

    The map grows (doubling) whenever a commit hits ``MDB_MAP_FULL``. :meth:`finish` writes
    the meta record, with the sha256 of every key and value in order, in the last commit.
    The writer opens without a lock file: it is the only user of a private temporary folder,
    and a ``lock.mdb`` would hold process ids, making the output differ from run to run.
    """

    def __init__(self, path: Path, map_size: int = 1 << 26, commit_every: int = 1024):
        self.path = path
        self.commit_every = commit_every
        self.count = 0
        self.map_growths = 0
        self._hash = hashlib.sha256()
        self._pending: list[tuple[bytes, bytes]] = []
        path.mkdir(parents=True, exist_ok=False)
        # meminit (the default) zeroes unused page bytes; without it they hold stale heap
        # memory and two identical runs write different files.
        self._env = lmdb.open(
            str(path), map_size=map_size, lock=False, subdir=True, meminit=True, max_dbs=0
        )

    def add(self, label: int, pixels: bytes) -> None:
        """Queue one record; commits every ``commit_every`` records."""
        key, value = record_key(self.count), encode_record(label, pixels)
        self._hash.update(key)
        self._hash.update(value)
        self._pending.append((key, value))
        self.count += 1
        if len(self._pending) >= self.commit_every:
            self._commit()

    def _commit(self) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value, overwrite=False, append=True)
                break
            except lmdb.MapFullError:
                # The transaction was aborted; grow the map and write the same batch again.
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
                self.map_growths += 1
        self._pending.clear()

    @property
    def content_sha256(self) -> str:
        """sha256 over every key and value written so far, in order."""
        return self._hash.hexdigest()

    def finish(self, meta: dict[str, Any]) -> None:
        """Flush the records, then write ``meta`` (plus count and hash) as the last commit."""
        self._commit()
        meta = {**meta, "count": self.count, "content_sha256": self.content_sha256}
        self._pending.append((META_KEY, json.dumps(meta, sort_keys=True).encode()))
        self._commit()
        self._env.sync(True)
        self._env.close()

    def abort(self) -> None:
        """Close and delete the unfinished database."""
        self._env.close()
        shutil.rmtree(self.path, ignore_errors=True)


#: Read-only environments of this process, by the identity of their data file.
_READERS: dict[tuple[int, int], lmdb.Environment] = {}


def open_readonly(path: Path) -> lmdb.Environment:
    """A shared read-only handle on the database at ``path``, never writing to its folder.

    ``lock=False``: a locking reader would rewrite ``lock.mdb`` inside a DVC-tracked output.
    LMDB refuses to open one environment twice in a process, so handles are shared per data
    file. A child forked after the parent opened one inherits the handle and keeps using it:
    without a lock table, reading a read-only map of a file that is never written again
    shares no state with the parent (py-lmdb would refuse a second open in the child).
    """
    data_file = path / "data.mdb"
    try:
        stat = data_file.stat()
    except FileNotFoundError:
        raise DatasetError(
            f"{path} is not an LMDB database (no data.mdb); run `dvc repro prepare` first"
        ) from None
    key = (stat.st_dev, stat.st_ino)
    if key not in _READERS:
        _READERS[key] = lmdb.open(
            str(path), readonly=True, lock=False, readahead=False, meminit=False, subdir=True
        )
    return _READERS[key]


def read_meta(path: Path) -> dict[str, Any]:
    """Read and check the meta record of the database at ``path``.

    Raises:
        DatasetError: missing folder, no meta record (an interrupted prepare), another
            format, or a record count that does not match the meta.
    """
    with open_readonly(path).begin() as txn:
        raw = txn.get(META_KEY)
        entries = txn.stat()["entries"]
    if raw is None:
        raise DatasetError(
            f"{path} has no ganpipe meta record: it is incomplete (an interrupted prepare?) "
            "or not made by ganpipe; run `dvc repro prepare` to rebuild it"
        )
    try:
        meta = json.loads(raw)
    except ValueError as exc:
        raise DatasetError(f"{path}: the meta record is not valid JSON ({exc})") from exc
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DatasetError(
            f"{path}: meta record has format {meta.get('format')!r} version "
            f"{meta.get('version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}. "
            "Rebuild it with `dvc repro prepare`"
        )
    if entries != meta["count"] + 1:
        raise DatasetError(
            f"{path}: meta says {meta['count']} records but the database holds {entries - 1}; "
            "rebuild it with `dvc repro prepare`"
        )
    return meta


def check_pair(
    train_meta: dict[str, Any],
    val_meta: dict[str, Any],
    train_path: Path = Path("data/train.lmdb"),
    val_path: Path = Path("data/val.lmdb"),
) -> None:
    """Check that two splits were written by the same prepare run.

    prepare moves train into place, then val; a run killed between the two leaves a new
    train beside the previous val, each complete by itself. Both meta records name the
    content hashes of the pair they were written with (``pair``), so a mismatch is seen here.

    Raises:
        DatasetError: the splits do not belong together (or predate the ``pair`` record).
    """
    expected = {
        "train_sha256": train_meta["content_sha256"],
        "val_sha256": val_meta["content_sha256"],
    }
    if train_meta.get("pair") == expected == val_meta.get("pair"):
        return
    if "pair" not in train_meta or "pair" not in val_meta:
        cause = "were written by a ganpipe without the train/val pair record"
    else:
        cause = "come from different prepare runs (an interrupted prepare?)"
    raise DatasetError(f"{train_path} and {val_path} {cause}; run `dvc repro prepare`")
