"""verify_lmdb: every changed byte of a database is found, with plain reads, as one user error.

Each test writes a tiny real database (a few hundred KiB) with the project's writer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import lmdb
import numpy as np
import pytest

from ganpipe.data import store
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.store import (
    CHECKSUMS_FILE,
    FORMAT,
    FORMAT_VERSION,
    DamagedDatasetError,
    DatasetError,
    LmdbWriter,
    verify_lmdb,
)
from tests.conftest import dir_digest

PAGE = store.PAGE_BYTES


def write_db(path: Path, num_records: int = 40, seed: int = 0) -> Path:
    """A complete database of ``num_records`` random 16x16x3 images (one overflow page each)."""
    rng = np.random.default_rng(seed)
    writer = LmdbWriter(path, map_size=1 << 22, commit_every=16)
    for i in range(num_records):
        writer.add(i % 3, rng.integers(0, 256, 16 * 16 * 3, dtype=np.uint8).tobytes())
    writer.finish({"format": FORMAT, "version": FORMAT_VERSION, "shape": [16, 16, 3]})
    return path


@pytest.fixture
def db(tmp_path) -> Path:
    return write_db(tmp_path / "db.lmdb")


def flip(path: Path, offset: int) -> None:
    data = bytearray((path / "data.mdb").read_bytes())
    data[offset] ^= 0x01
    (path / "data.mdb").write_bytes(bytes(data))


def fixes(path: Path) -> str:
    return (
        f"; restore it with `dvc checkout --force {path}`, or rebuild it with "
        "`dvc repro -f prepare`"
    )


def test_an_intact_database_passes_and_nothing_is_written(db):
    before = dir_digest(db)
    verify_lmdb(db)
    verify_lmdb(db, workers=3)
    assert dir_digest(db) == before
    assert sorted(p.name for p in db.iterdir()) == [CHECKSUMS_FILE, "data.mdb"]


def test_the_checksums_are_the_same_for_the_same_records(tmp_path):
    # The folder is a DVC output: its bytes must not change from run to run.
    one, two = write_db(tmp_path / "one"), write_db(tmp_path / "two")
    assert dir_digest(one) == dir_digest(two)
    record = json.loads((one / CHECKSUMS_FILE).read_text())
    size = (one / "data.mdb").stat().st_size
    assert record["bytes"] == size and len(record["sha256"]) == 1  # one block: < 8 MiB


def test_every_flipped_byte_is_found(db):
    size = (db / "data.mdb").stat().st_size
    pristine = (db / "data.mdb").read_bytes()
    # Both LMDB meta pages byte by byte near their start, then a byte in every 509 up to the end.
    offsets = [*range(0, 64), *range(PAGE, PAGE + 64), *range(2 * PAGE, size, 509), size - 1]
    for offset in offsets:
        flip(db, offset)
        with pytest.raises(DamagedDatasetError, match="differs from what prepare wrote"):
            verify_lmdb(db)
        (db / "data.mdb").write_bytes(pristine)
    verify_lmdb(db)


def test_the_message_names_the_file_the_blocks_and_both_fixes(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "CHECKSUM_BLOCK_BYTES", PAGE)  # one block per page
    db = write_db(tmp_path / "db.lmdb")
    num_blocks = (db / "data.mdb").stat().st_size // PAGE
    flip(db, 5 * PAGE + 100)
    flip(db, 9 * PAGE)
    with pytest.raises(DamagedDatasetError) as info:
        verify_lmdb(db, workers=4)
    assert str(info.value) == (
        f"{db}: data.mdb differs from what prepare wrote in 2 of its {num_blocks} blocks of "
        f"4,096 bytes (the first at bytes 20,480 to 24,575){fixes(db)}"
    )


@pytest.mark.parametrize("keep", [0, 0.5, "one short"])
def test_a_truncated_file_is_an_error_not_a_crash(db, keep):
    size = (db / "data.mdb").stat().st_size
    new_size = size - 1 if keep == "one short" else int(size * keep)
    os.truncate(db / "data.mdb", new_size)
    with pytest.raises(DamagedDatasetError) as info:
        verify_lmdb(db)
    assert str(info.value) == (
        f"{db}: data.mdb has {new_size:,} bytes but prepare wrote {size:,} (truncated)" + fixes(db)
    )


def test_a_longer_file_is_refused(db):
    with open(db / "data.mdb", "ab") as f:
        f.write(b"\0" * PAGE)
    with pytest.raises(DamagedDatasetError, match=r"bytes but prepare wrote .* \(longer than"):
        verify_lmdb(db)


def test_a_database_without_checksums_says_to_rebuild_it(db):
    (db / CHECKSUMS_FILE).unlink()
    with pytest.raises(DamagedDatasetError) as info:
        verify_lmdb(db)
    assert str(info.value) == (
        f"{db} has no checksums.json: it was written before ganpipe verified its data (rebuild "
        f"it with `dvc repro -f prepare`), or the file was removed (restore it with "
        f"`dvc checkout --force {db}`)"
    )


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda r: b"{not json", "checksums.json is not valid JSON"),
        (lambda r: b"[]", "checksums.json is not a ganpipe-lmdb-checksums version 1 record"),
        (lambda r: {**r, "version": 2}, "is not a ganpipe-lmdb-checksums version 1 record"),
        (lambda r: {**r, "sha256": r["sha256"] * 2}, "is not a ganpipe-lmdb-checksums"),
        (lambda r: {**r, "block_bytes": 0}, "is not a ganpipe-lmdb-checksums"),
        (lambda r: {**r, "sha256": ["0" * 64]}, "differs from what prepare wrote in 1 of its 1"),
    ],
)
def test_a_damaged_checksum_file_is_refused(db, change, words):
    changed = change(json.loads((db / CHECKSUMS_FILE).read_text()))
    raw = changed if isinstance(changed, bytes) else json.dumps(changed).encode()
    (db / CHECKSUMS_FILE).write_bytes(raw)
    with pytest.raises(DamagedDatasetError, match=words) as info:
        verify_lmdb(db)
    assert str(info.value).endswith(fixes(db))


def test_no_database_at_all_is_the_usual_error(tmp_path):
    with pytest.raises(DatasetError, match="not an LMDB database .* run `dvc repro prepare`"):
        verify_lmdb(tmp_path / "nothing.lmdb")


# --- a reader that was not told to verify still ends in the same error ---------------------


def test_lmdb_errors_on_opening_a_damaged_header_are_the_same_error(tmp_path, db):
    copy = shutil.copytree(db, tmp_path / "copy.lmdb")  # a new inode: no shared handle
    flip(copy, 16)  # the magic number of the first meta page
    with pytest.raises(DamagedDatasetError) as info:
        LmdbImageDataset(copy)
    assert str(info.value) == (
        f"{copy}: LMDB cannot read it (InvalidError: MDB_INVALID: File is not an LMDB file)"
        + fixes(copy)
    )
    assert isinstance(info.value.__cause__, lmdb.Error)


def test_a_record_lost_from_a_database_is_the_same_error(db):
    # The meta record's count and the entries agree, but record 7's key is gone (renamed).
    env = lmdb.open(str(db), lock=False, subdir=True, map_size=1 << 22)
    with env.begin(write=True) as txn:
        txn.put(b"zz", txn.pop(b"00000007"))
    env.close()
    dataset = LmdbImageDataset(db)
    for read in (lambda: dataset.__getitems__([6, 7]), dataset.uint8_array, dataset.labels):
        with pytest.raises(DamagedDatasetError, match="record 7 of 40 is missing"):
            read()
