"""The LMDB format and dataset: exact round trip, workers, refusal of incomplete databases."""

from __future__ import annotations

import pickle

import lmdb
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.store import FORMAT, FORMAT_VERSION, DatasetError, LmdbWriter
from tests.conftest import dir_digest


def write_db(path, images, labels, map_size=1 << 22):
    writer = LmdbWriter(path, map_size=map_size, commit_every=7)
    for image, label in zip(images, labels, strict=True):
        writer.add(int(label), image.tobytes())
    writer.finish(
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "shape": list(images.shape[1:]),
            "classes": ["a", "b", "c"],
        }
    )
    return writer


@pytest.fixture
def db(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (50, 6, 5, 3), dtype=np.uint8)
    labels = rng.integers(0, 3, 50)
    write_db(tmp_path / "db", images, labels)
    return tmp_path / "db", images, labels


def test_pixel_exact_round_trip(db):
    path, images, labels = db
    ds = LmdbImageDataset(path)
    assert len(ds) == 50 and ds.shape == (3, 6, 5)
    for i in (0, 17, 49):
        image, label = ds[i]
        assert image.dtype == torch.float32 and image.shape == (3, 6, 5)
        assert image.min() >= -1 and image.max() <= 1
        back = image.add(1).mul(127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        np.testing.assert_array_equal(back, images[i])
        assert label == labels[i]
    assert ds[0][0][0, 0, 0].item() == pytest.approx(images[0, 0, 0, 0] / 127.5 - 1)
    np.testing.assert_array_equal(ds.uint8_array(), images)
    with pytest.raises(IndexError):
        ds[50]


def test_map_grows_on_map_full(tmp_path):
    images = np.zeros((300, 32, 32, 3), dtype=np.uint8)
    images[:, 0, 0, 0] = np.arange(300) % 256
    writer = write_db(tmp_path / "small", images, np.zeros(300), map_size=64 * 1024)
    assert writer.map_growths > 0
    np.testing.assert_array_equal(LmdbImageDataset(tmp_path / "small").uint8_array(), images)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_with_two_workers_reads_everything(db, context):
    path, images, labels = db
    ds = LmdbImageDataset(path)
    ds[0]  # the parent holds an open handle before the workers start
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=context)
    got = torch.cat([x for x, _ in loader])
    got_labels = torch.cat([y for _, y in loader])
    expected = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    np.testing.assert_array_equal(got_labels.numpy(), labels)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_distributed_sampler_ranks_split_the_data_exactly(db, context):
    path, images, labels = db
    ds = LmdbImageDataset(path)
    ds[0]  # the parent holds an open handle before the workers start
    seen = {}
    for rank in (0, 1):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=7)
        sampler.set_epoch(3)
        loader = DataLoader(
            ds, batch_size=8, sampler=sampler, num_workers=2, multiprocessing_context=context
        )
        batches = list(loader)
        seen[rank] = list(sampler)
        got = torch.cat([x for x, _ in batches])
        got_labels = torch.cat([y for _, y in batches])
        direct = torch.stack([ds[i][0] for i in seen[rank]])
        torch.testing.assert_close(got, direct, rtol=0, atol=0)
        expected = torch.from_numpy(images[seen[rank]]).permute(0, 3, 1, 2).float() / 127.5 - 1
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        np.testing.assert_array_equal(got_labels.numpy(), labels[seen[rank]])
    assert len(seen[0]) == len(seen[1]) == 25
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(50))
    assert seen[0] != sorted(seen[0])  # shuffled


def test_pickling_drops_the_handle(db):
    ds = LmdbImageDataset(db[0])
    ds[0]
    assert ds._env is not None
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._env is None
    torch.testing.assert_close(clone[3][0], ds[3][0])


def test_reading_never_writes_to_the_database_folder(db):
    path = db[0]
    before = dir_digest(path)
    loader = DataLoader(LmdbImageDataset(path), batch_size=4, num_workers=2, shuffle=True)
    for _ in loader:
        pass
    assert dir_digest(path) == before
    assert sorted(p.name for p in path.iterdir()) == ["checksums.json", "data.mdb"]


def test_database_without_meta_is_refused(tmp_path):
    env = lmdb.open(str(tmp_path / "partial"), map_size=1 << 20, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"00000000", b"\0" * 20)
    env.close()
    with pytest.raises(DatasetError, match="no ganpipe meta record.*dvc repro prepare"):
        LmdbImageDataset(tmp_path / "partial")


def test_missing_database_is_refused(tmp_path):
    with pytest.raises(DatasetError, match="run `dvc repro prepare` first"):
        LmdbImageDataset(tmp_path / "nothing.lmdb")


def test_count_mismatch_is_refused(tmp_path, db):
    path = db[0]
    env = lmdb.open(str(path), map_size=1 << 22, lock=False)
    with env.begin(write=True) as txn:
        txn.delete(b"00000003")
    env.close()
    with pytest.raises(DatasetError, match="meta says 50 records but the database holds 49"):
        LmdbImageDataset(path)
