"""The LMDB layout: one environment per split, raw pixels, a JSON meta record written last.

Record ``i`` has the key ``b"%08d" % i`` and the value ``label (int32, little-endian)``
followed by the ``H*W*C`` uint8 pixels in HWC order. Nothing is pickled. The meta record
(:data:`META_KEY`) is JSON and is written in the last commit: a database without it is
incomplete and is refused by readers. The meta records of a train/val pair both hold the
pair's content hashes (``pair``), so a reader of both splits can tell that they were
written by the same prepare run (:func:`check_pair`).

Beside ``data.mdb``, the writer leaves ``checksums.json``: the sha256 of every block of the
finished file. :func:`verify_lmdb` compares the file with it, so a reader can refuse a
database whose bytes changed after prepare wrote them (a flipped bit, a truncated copy)
before it reads a record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import lmdb

from ganpipe.cpu import usable_cpus
from ganpipe.errors import UserError

log = logging.getLogger(__name__)

META_KEY = b"__meta__"
FORMAT = "ganpipe-lmdb"
FORMAT_VERSION = 1
LABEL = struct.Struct("<i")
KEY_DIGITS = 8


class DatasetError(UserError):
    """An LMDB database is missing, incomplete or not ours; the message says what to run."""


class DamagedDatasetError(DatasetError):
    """A database's bytes differ from what prepare wrote (a flipped bit, a truncated or
    overwritten file, a missing checksum file), or LMDB cannot read them. The message names
    the database and both fixes: restore it from the DVC cache (``--force``: DVC does not
    overwrite a modified output without it), or rebuild it."""


def damaged(path: Path, what: str) -> DamagedDatasetError:
    """The error for the database at ``path``, ``what`` saying what is wrong with it."""
    return DamagedDatasetError(
        f"{path}: {what}; restore it with `dvc checkout --force {path}`, or rebuild it with "
        "`dvc repro -f prepare`"
    )


class WriteFailedError(DatasetError):
    """Writing the database at ``path`` failed: disk full, quota, an I/O error."""

    def __init__(self, path: Path, cause: Exception):
        super().__init__(f"writing {path} failed: {cause}")
        self.path = path
        self.cause = cause


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    # LMDB reports a full disk as lmdb.Error (often "Input/output error": the error of the
    # flush or sync, not ENOSPC), creating the folder as OSError.
    try:
        yield
    except (lmdb.Error, OSError) as exc:
        raise WriteFailedError(path, exc) from exc


#: LMDB's page size here, and the largest value stored inside a leaf page (``mdb_env_open``:
#: ``(page - 16) / 2`` minus the node header); longer values take overflow pages of their own.
PAGE_BYTES = 4096
MAX_INLINE_VALUE_BYTES = (PAGE_BYTES - 16) // 2 - 8


def estimate_bytes(num_records: int, value_bytes: int) -> int:
    """About how many bytes a database of ``num_records`` values of ``value_bytes`` takes."""
    node_bytes = 8 + KEY_DIGITS + 2  # node header, key, the page's pointer to the node
    if value_bytes + KEY_DIGITS > MAX_INLINE_VALUE_BYTES:
        pages = num_records * math.ceil((value_bytes + 16) / PAGE_BYTES)  # overflow pages
        pages += math.ceil(num_records * (node_bytes + 8) / (PAGE_BYTES - 16))  # leaf pages
    else:
        per_page = (PAGE_BYTES - 16) // (node_bytes + value_bytes)  # nodes are never split
        pages = math.ceil(num_records / per_page)
    return (pages + pages // 100 + 4) * PAGE_BYTES  # + branch pages, meta pages


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
        self._env = None
        with _writing(path):
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
        """Write the pending records in one transaction.

        Raises:
            WriteFailedError: the disk is full, or another write error.
        """
        while True:
            try:
                with _writing(self.path), self._env.begin(write=True) as txn:
                    for key, value in self._pending:
                        txn.put(key, value, overwrite=False, append=True)
                break
            except WriteFailedError as exc:
                if not isinstance(exc.cause, lmdb.MapFullError):
                    raise
                # The transaction was aborted; grow the map and write the same batch again.
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
                self.map_growths += 1
        self._pending.clear()

    @property
    def content_sha256(self) -> str:
        """sha256 over every key and value written so far, in order."""
        return self._hash.hexdigest()

    def finish(self, meta: dict[str, Any]) -> None:
        """Flush the records, write ``meta`` (plus count and hash) as the last commit, then
        the checksums of the closed file (:func:`write_checksums`)."""
        self._commit()
        meta = {**meta, "count": self.count, "content_sha256": self.content_sha256}
        self._pending.append((META_KEY, json.dumps(meta, sort_keys=True).encode()))
        self._commit()
        with _writing(self.path):
            self._env.sync(True)
            self._env.close()
            write_checksums(self.path)

    def disk_bytes(self) -> int:
        """Bytes the database takes on disk so far (allocated blocks)."""
        return sum(f.stat().st_blocks * 512 for f in self.path.glob("*.mdb") if f.is_file())

    def abort(self) -> None:
        """Close and delete the unfinished database."""
        if self._env is not None:
            with suppress(lmdb.Error):  # closing after a failed write: the folder goes anyway
                self._env.close()
        shutil.rmtree(self.path, ignore_errors=True)


# --- checksums: the bytes prepare wrote, verified where they are read ---------------------

#: The file beside ``data.mdb`` that holds its checksums.
CHECKSUMS_FILE = "checksums.json"
CHECKSUMS_FORMAT = "ganpipe-lmdb-checksums"
#: ``data.mdb`` is hashed in blocks of this size: blocks are hashed in parallel threads
#: (hashlib and reads release the GIL), and a mismatch says where in the file it is.
CHECKSUM_BLOCK_BYTES = 1 << 23


def _data_file(path: Path) -> os.stat_result:
    """``stat`` of ``path/data.mdb``; a missing one is a :class:`DatasetError`."""
    try:
        return (path / "data.mdb").stat()
    except FileNotFoundError:
        raise DatasetError(
            f"{path} is not an LMDB database (no data.mdb); run `dvc repro prepare` first"
        ) from None


def _block_sha256(data_file: Path, size: int, block_bytes: int, workers: int) -> list[str]:
    """The sha256 of each ``block_bytes`` block of the first ``size`` bytes of ``data_file``.

    Plain reads (``pread``), never a memory map: reading a mapped page beyond the end of a
    truncated file kills the process with SIGBUS, where a read just returns fewer bytes.
    """
    fd = os.open(data_file, os.O_RDONLY)
    try:

        def block(offset: int) -> str:
            return hashlib.sha256(os.pread(fd, min(block_bytes, size - offset), offset)).hexdigest()

        offsets = range(0, size, block_bytes)
        with ThreadPoolExecutor(max(1, min(workers, len(offsets)))) as pool:
            return list(pool.map(block, offsets))
    finally:
        os.close(fd)


def write_checksums(path: Path, workers: int | None = None) -> None:
    """Write ``checksums.json`` for the finished database at ``path`` (its file must no longer
    change): the size of ``data.mdb`` and the sha256 of each of its blocks.

    LMDB writes the same file for the same records, so the checksums are reproducible too.
    """
    size = _data_file(path).st_size
    record = {
        "format": CHECKSUMS_FORMAT,
        "version": 1,
        "file": "data.mdb",
        "bytes": size,
        "block_bytes": CHECKSUM_BLOCK_BYTES,
        "sha256": _block_sha256(
            path / "data.mdb", size, CHECKSUM_BLOCK_BYTES, workers or usable_cpus()
        ),
    }
    with open(path / CHECKSUMS_FILE, "wb") as f:
        f.write((json.dumps(record, indent=1) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _read_checksums(path: Path) -> dict[str, Any]:
    """The checksum record of the database at ``path``, its fields checked."""
    try:
        raw = (path / CHECKSUMS_FILE).read_bytes()
    except FileNotFoundError:
        raise DamagedDatasetError(
            f"{path} has no {CHECKSUMS_FILE}: it was written before ganpipe verified its data "
            f"(rebuild it with `dvc repro -f prepare`), or the file was removed (restore it "
            f"with `dvc checkout --force {path}`)"
        ) from None
    try:
        record = json.loads(raw)
    except ValueError as exc:
        raise damaged(path, f"{CHECKSUMS_FILE} is not valid JSON ({exc})") from exc
    fields_ok = (
        isinstance(record, dict)
        and record.get("format") == CHECKSUMS_FORMAT
        and record.get("version") == 1
        and record.get("file") == "data.mdb"
        and _is_count(record.get("bytes"))
        and _is_count(record.get("block_bytes"))
        and record["block_bytes"] > 0
        and isinstance(record.get("sha256"), list)
        and len(record["sha256"]) == -(-record["bytes"] // record["block_bytes"])
    )
    if not fields_ok:
        raise damaged(path, f"{CHECKSUMS_FILE} is not a {CHECKSUMS_FORMAT} version 1 record")
    return record


def verify_lmdb(path: Path, workers: int | None = None) -> None:
    """Check that ``path/data.mdb`` holds exactly the bytes prepare wrote.

    Every byte of the file counts (records, the meta record, LMDB's own meta and tree pages,
    unused space), so a damage LMDB would not notice, or would meet with an error or a
    crash, is found before any record is read. Reads are plain reads in blocks, hashed by
    ``workers`` threads (default: :func:`ganpipe.cpu.usable_cpus`); a truncated file is an
    error, never a SIGBUS. Nothing is written to the folder (DVC tracks it).

    Args:
        path: The database folder (``data/train.lmdb``).
        workers: Threads hashing blocks.

    Raises:
        DatasetError: no database at ``path``.
        DamagedDatasetError: no or unreadable ``checksums.json`` (a database written before
            data verification), a size that differs, or blocks whose sha256 differs. The
            message names the database, where it differs, and the fixes
            (``dvc checkout --force PATH``, ``dvc repro -f prepare``).
    """
    began = time.perf_counter()
    size = _data_file(path).st_size
    record = _read_checksums(path)
    if size != record["bytes"]:
        how = "truncated" if size < record["bytes"] else "longer than it was"
        raise damaged(
            path, f"data.mdb has {size:,} bytes but prepare wrote {record['bytes']:,} ({how})"
        )
    block_bytes = record["block_bytes"]
    found = _block_sha256(path / "data.mdb", size, block_bytes, workers or usable_cpus())
    bad = [i for i, (a, b) in enumerate(zip(found, record["sha256"], strict=True)) if a != b]
    if bad:
        first = bad[0] * block_bytes
        raise damaged(
            path,
            f"data.mdb differs from what prepare wrote in {len(bad)} of its {len(found)} "
            f"blocks of {block_bytes:,} bytes (the first at bytes {first:,} to "
            f"{min(first + block_bytes, size) - 1:,})",
        )
    log.info("verified %s (%s bytes) in %.2f s", path, f"{size:,}", time.perf_counter() - began)


# --- reading ---------------------------------------------------------------------------------


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Turn an LMDB error while opening or reading the database at ``path`` into a
    :class:`DamagedDatasetError`: a damaged page LMDB meets (one that :func:`verify_lmdb`
    was not asked to look at) ends in the same one-line error as a failed verification."""
    try:
        yield
    except lmdb.Error as exc:
        text = str(exc).removeprefix(f"{path}: ")
        raise damaged(path, f"LMDB cannot read it ({type(exc).__name__}: {text})") from exc


#: Read-only environments of this process, by the identity of their data file.
_READERS: dict[tuple[int, int], lmdb.Environment] = {}


def open_readonly(path: Path) -> lmdb.Environment:
    """A shared read-only handle on the database at ``path``, never writing to its folder.

    ``lock=False``: a locking reader would rewrite ``lock.mdb`` inside a DVC-tracked output.
    LMDB refuses to open one environment twice in a process, so handles are shared per data
    file. A child forked after the parent opened one inherits the handle and keeps using it:
    without a lock table, reading a read-only map of a file that is never written again
    shares no state with the parent (py-lmdb would refuse a second open in the child).

    Raises:
        DatasetError: no ``data.mdb`` at ``path``.
        DamagedDatasetError: LMDB refuses the file, or the file ends before its last page
            (a truncated file: reading its map beyond the end would kill the process with
            SIGBUS).
    """
    stat = _data_file(path)
    key = (stat.st_dev, stat.st_ino)
    if key not in _READERS:
        with reading(path):
            env = lmdb.open(
                str(path), readonly=True, lock=False, readahead=False, meminit=False, subdir=True
            )
            # LMDB reads its meta pages with plain reads; every other page through the map.
            end = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        if stat.st_size < end:
            env.close()
            raise damaged(
                path,
                f"data.mdb has {stat.st_size:,} bytes but its pages reach byte {end:,} (truncated)",
            )
        _READERS[key] = env
    return _READERS[key]


def read_meta(path: Path) -> dict[str, Any]:
    """Read and check the meta record of the database at ``path``.

    Raises:
        DatasetError: missing folder, no meta record (an interrupted prepare), another
            format, or a record count that does not match the meta.
        DamagedDatasetError: LMDB cannot read the file (see :func:`open_readonly`).
    """
    env = open_readonly(path)
    with reading(path), env.begin() as txn:
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
    if not isinstance(meta, dict):
        raise DatasetError(
            f"{path}: the meta record is a JSON {type(meta).__name__}, not an object; "
            "rebuild it with `dvc repro prepare`"
        )
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise DatasetError(
            f"{path}: meta record has format {meta.get('format')!r} version "
            f"{meta.get('version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}. "
            "Rebuild it with `dvc repro prepare`"
        )
    _check_meta_fields(path, meta)
    if entries != meta["count"] + 1:
        raise DatasetError(
            f"{path}: meta says {meta['count']} records but the database holds {entries - 1}; "
            "rebuild it with `dvc repro prepare`"
        )
    return meta


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: The meta fields that readers use, each with its rule and the rule in words.
_META_FIELDS: dict[str, tuple[Any, str]] = {
    "count": (_is_count, "an integer >= 0"),
    "shape": (
        lambda v: (
            isinstance(v, list)
            and len(v) == 3
            and all(_is_count(n) and n > 0 for n in v)
            and v[2] in (1, 3)
        ),
        "[height, width, channels] with positive sizes and 1 or 3 channels",
    ),
    "content_sha256": (lambda v: isinstance(v, str), "a string"),
}
_OPTIONAL_META_FIELDS: dict[str, tuple[Any, str]] = {
    "dtype": (lambda v: v == "uint8", '"uint8"'),
    "classes": (
        lambda v: isinstance(v, list) and all(isinstance(c, str) for c in v),
        "a list of strings",
    ),
    "class_counts": (
        lambda v: isinstance(v, list) and all(_is_count(n) for n in v),
        "a list of integers >= 0",
    ),
    "pair": (
        lambda v: isinstance(v, dict) and all(isinstance(h, str) for h in v.values()),
        "an object of strings",
    ),
}


def _check_meta_fields(path: Path, meta: dict[str, Any]) -> None:
    """Refuse a meta record whose fields readers would trip over (a hand-edited record)."""

    def show(value: Any) -> str:
        text = json.dumps(value)
        return text if len(text) <= 60 else text[:57] + "..."

    problems = [
        f"{key}={show(meta[key]) if key in meta else 'missing'} (expected {words})"
        for key, (valid, words) in _META_FIELDS.items()
        if key not in meta or not valid(meta[key])
    ]
    problems += [
        f"{key}={show(meta[key])} (expected {words})"
        for key, (valid, words) in _OPTIONAL_META_FIELDS.items()
        if key in meta and not valid(meta[key])
    ]
    if not problems and "class_counts" in meta:
        counts = meta["class_counts"]
        if sum(counts) != meta["count"]:
            problems.append(
                f"class_counts={show(counts)} add up to {sum(counts)}, not count={meta['count']}"
            )
        if "classes" in meta and len(meta["classes"]) != len(counts):
            problems.append(
                f"class_counts has {len(counts)} entries but classes names {len(meta['classes'])}"
            )
    if problems:
        raise DatasetError(
            f"{path}: the meta record has bad field(s): {'; '.join(problems)}; "
            "rebuild it with `dvc repro prepare`"
        )


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


def check_val_not_empty(val_meta: dict[str, Any], val_path: Path = Path("data/val.lmdb")) -> None:
    """Refuse an empty val split before a stage that measures on it starts.

    ``data.val_fraction`` is above 0, but ``round(n * val_fraction)`` is 0 for few images;
    prepare then only warns (training needs no val split), and featurenet's accuracy would
    divide by zero and evaluate's feature concatenation fail.

    Raises:
        DatasetError: ``val_path`` holds no image.
    """
    if val_meta["count"] == 0:
        rule = val_meta.get("split_rule")
        fraction = rule.get("val_fraction") if isinstance(rule, dict) else None
        raise DatasetError(
            f"{val_path} holds no images (data.val_fraction={fraction} rounds to 0 images); "
            "the featurenet and evaluate stages measure on the validation split: raise "
            "data.val_fraction so that it holds at least one image, then `dvc repro`"
        )
