"""The train/val pair check on meta records (no database needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ganpipe.data.store import DatasetError, check_pair


def metas(train_sha: str, val_sha: str, pair_train: str, pair_val: str):
    pair = {"train_sha256": pair_train, "val_sha256": pair_val}
    return {"content_sha256": train_sha, "pair": pair}, {"content_sha256": val_sha, "pair": pair}


def test_a_pair_from_one_run_passes():
    check_pair(*metas("t1", "v1", "t1", "v1"))


def test_a_new_train_beside_an_old_val_is_refused():
    new_train, _ = metas("t2", "v2", "t2", "v2")
    _, old_val = metas("t1", "v1", "t1", "v1")
    with pytest.raises(DatasetError) as info:
        check_pair(new_train, old_val, Path("d/train.lmdb"), Path("d/val.lmdb"))
    assert str(info.value) == (
        "d/train.lmdb and d/val.lmdb come from different prepare runs (an interrupted "
        "prepare?); run `dvc repro prepare`"
    )


def test_a_pair_record_that_names_other_content_is_refused():
    # Both records agree with each other but not with the data they sit in.
    with pytest.raises(DatasetError, match="different prepare runs"):
        check_pair(*metas("t1", "v9", "t1", "v1"))


def test_meta_without_a_pair_record_is_refused():
    train, val = metas("t1", "v1", "t1", "v1")
    del val["pair"]
    with pytest.raises(DatasetError, match="without the train/val pair record.*dvc repro prepare"):
        check_pair(train, val)
