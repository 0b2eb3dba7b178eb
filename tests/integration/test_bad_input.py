"""Hostile and broken input data and params: every case ends in one `error:` naming the file
or key, exit status 2, no traceback and the previous outputs untouched — or in documented behaviour
(link loops read once, FIFOs skipped, leftovers cleared). No case may hang.

Stage subprocesses are used where the exit status and stderr are the point; the rest call the
library in-process.
"""

from __future__ import annotations

import errno
import gzip
import io
import json
import logging
import multiprocessing
import os
import pickle
import resource
import signal
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import lmdb
import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from ganpipe import checkpoint, loop, runtime
from ganpipe.checkpoint import save_atomic
from ganpipe.data import convert
from ganpipe.data.convert import BadImageError
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.prepare import prepare_dataset
from ganpipe.data.sources import SourceError, read_idx
from ganpipe.data.store import (
    FORMAT,
    FORMAT_VERSION,
    LABEL,
    META_KEY,
    DatasetError,
    LmdbWriter,
    estimate_bytes,
    read_meta,
    write_checksums,
)
from ganpipe.files import OutputsBusyError, locked_dir, no_space_error, size_text
from ganpipe.nets import DcganGenerator
from ganpipe.params import DataParams, Params
from tests.conftest import data_params, dir_digest, random_image, solid_image
from tests.helpers import run_stage, stage_env, tiny_params

# --- helpers ------------------------------------------------------------------------------


def prep(tmp_path: Path, **data):
    out = tmp_path / "out"
    return out, prepare_dataset(data_params(**data), 0, out, root=tmp_path, progress=False)


def project_with_previous_outputs(root: Path, image_size: int = 8) -> Path:
    """A project whose data/ holds a complete train/val pair from an earlier prepare."""
    for i in range(4):
        solid_image(root / "previous" / f"{i}.png", (10 * i, 0, 0))
    data = DataParams(source="folder", path="previous", image_size=image_size, val_fraction=0.25)
    prepare_dataset(data, 0, root / "data", root=root, progress=False)
    return root


def write_params(root: Path, data: dict) -> None:
    (root / "params.yaml").write_text(yaml.safe_dump({"seed": 0, "data": data}))


def stage_error(result: subprocess.CompletedProcess) -> str:
    """The stage's `error:` message, after checking it failed as a user error should."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    return result.stderr[result.stderr.index("error: ") :]


def write_idx(path: Path, array: np.ndarray, shape=None, extra: bytes = b"") -> Path:
    """An IDX file of ``array``; ``shape`` overrides the header (a lying header)."""
    shape = array.shape if shape is None else shape
    header = struct.pack(">HBB", 0, 8, len(shape)) + struct.pack(f">{len(shape)}I", *shape)
    path.parent.mkdir(parents=True, exist_ok=True)
    with (gzip.open if path.suffix == ".gz" else open)(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes() + extra)
    return path


def write_mnist(root: Path, images=None, labels=None, image_shape=None) -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (4, 28, 28)) if images is None else images
    labels = np.array([3, 1, 4, 1]) if labels is None else labels
    write_idx(root / "train-images-idx3-ubyte", images, image_shape)
    write_idx(root / "train-labels-idx1-ubyte", labels)


def write_cifar(root: Path, labels=None, meta=None, batch=3) -> None:
    """Five tiny CIFAR-10 batches; ``labels`` replaces the labels of batch ``batch``."""
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(1, 6):
        data = rng.integers(0, 256, (2, 3072), dtype=np.uint8)
        entry = {"data": data, "labels": [int(y) for y in rng.integers(0, 10, 2)]}
        if i == batch and labels is not None:
            entry["labels"] = labels
        (root / f"data_batch_{i}").write_bytes(pickle.dumps(entry))
    meta = {"label_names": [f"class{i}" for i in range(10)]} if meta is None else meta
    (root / "batches.meta").write_bytes(pickle.dumps(meta))


def many_bad_files(root: Path, num_bad: int) -> list[str]:
    solid_image(root / "a" / "good.png", (1, 2, 3))
    names = []
    for i in range(num_bad):
        (root / "a" / f"bad{i:02d}.png").write_bytes(b"not a png")
        names.append(f"a/bad{i:02d}.png")
    return names


# --- the prepare stage: one subprocess per case --------------------------------------------

# case -> (make the hostile source under the project, data params, words the error must hold)
CASES = {
    "cifar_label_minus_one": (
        lambda p: write_cifar(p / "cifar", labels=[0, -1]),
        {"source": "cifar10", "path": "cifar", "channels": 3},
        ["data_batch_3", "outside 0..9", "-1"],
    ),
    "cifar_label_ten": (
        lambda p: write_cifar(p / "cifar", labels=[10, 2]),
        {"source": "cifar10", "path": "cifar", "channels": 3},
        ["data_batch_3", "outside 0..9", "10"],
    ),
    "cifar_labels_an_int": (
        lambda p: write_cifar(p / "cifar", labels=7),
        {"source": "cifar10", "path": "cifar", "channels": 3},
        ["data_batch_3", "'labels' must be a list of integers"],
    ),
    "cifar_meta_without_label_names": (
        lambda p: write_cifar(p / "cifar", meta={"names": ["a"]}),
        {"source": "cifar10", "path": "cifar", "channels": 3},
        ["batches.meta", "label_names"],
    ),
    "mnist_label_255": (
        lambda p: write_mnist(p / "mnist", labels=np.array([3, 255, 4, 1])),
        {"source": "mnist", "path": "mnist"},
        ["train-labels-idx1-ubyte", "outside 0..9", "255"],
    ),
    "mnist_zero_size_images": (
        lambda p: write_mnist(p / "mnist", images=np.zeros(0), image_shape=(4, 0, 28)),
        {"source": "mnist", "path": "mnist"},
        ["train-images-idx3-ubyte", "(4, 0, 28)"],
    ),
    "mnist_gz_longer_than_its_header": (
        lambda p: (
            write_idx(
                p / "mnist" / "train-images-idx3-ubyte.gz",
                np.zeros((4, 28, 28)),
                extra=bytes(4 << 20),
            ),
            write_idx(p / "mnist" / "train-labels-idx1-ubyte", np.array([3, 1, 4, 1])),
        ),
        {"source": "mnist", "path": "mnist"},
        ["train-images-idx3-ubyte.gz", "more data than its header"],
    ),
    "many_bad_images": (
        lambda p: many_bad_files(p / "imgs", 3),
        {"source": "folder", "path": "imgs"},
        ["3 unreadable images", "a/bad00.png", "a/bad01.png", "a/bad02.png", "on_bad_image"],
    ),
    "class_folder_linked_twice": (
        lambda p: (
            solid_image(p / "imgs" / "cats" / "c.png", (1, 2, 3)),
            (p / "imgs" / "kittens").symlink_to("cats"),
        ),
        {"source": "folder", "path": "imgs"},
        ["'kittens'", "cats", "data.path"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prepare_refuses_hostile_source_keeping_previous_outputs(tmp_path, case):
    make, data, words = CASES[case]
    project = project_with_previous_outputs(tmp_path)
    make(project)
    write_params(project, {"image_size": 16, **data})
    before = dir_digest(project / "data")
    message = stage_error(run_stage(project, "prepare", timeout=120))
    for word in words:
        assert word in message, message
    assert dir_digest(project / "data") == before  # no new file, no temporary left


# --- params.yaml itself: stops every stage before any work ------------------------------


def alias_bomb() -> str:
    """ "Billion laughs" in 441 bytes: nine levels of nine aliases, 9**9 values expanded."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    return "\n".join([*lines, "data: *a8", ""])


# case -> (stage, params.yaml bytes, words the error must hold)
PARAMS_CASES = {
    "alias_bomb": ("prepare", alias_bomb().encode(), ["once its aliases (*name) are expanded"]),
    "latin1": (
        "prepare",
        "seed: 0\ndata: {source: folder, path: caf\xe9}\n".encode("latin-1"),
        ["not UTF-8 text (byte 0xe9 on line 2); save it as UTF-8"],
    ),
    "huge_intervals": (
        "train",
        b"train: {kimg: 1e308, checkpoint_kimg: 1e308, snapshot_kimg: 1e308, "
        b"log_every_kimg: 1e308}\n",
        ["4 problem(s)", "train.kimg: Input should be less than or equal to 1000000 (got 1e+308)"]
        + [
            f"train.{k}_kimg: Input should be less than or equal to 1000000"
            for k in ("checkpoint", "snapshot", "log_every")
        ],
    ),
    "no_val_split": (
        "featurenet",
        b"data: {val_fraction: 0.0}\n",
        ["data.val_fraction: Input should be greater than 0 (got 0.0)", "evaluate stage"],
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(PARAMS_CASES))
def test_a_hostile_params_file_stops_the_stage_at_once(tmp_path, case):
    stage, content, words = PARAMS_CASES[case]
    project = project_with_previous_outputs(tmp_path)
    (project / "params.yaml").write_bytes(content)
    before = dir_digest(project / "data")
    start = time.monotonic()
    message = stage_error(run_stage(project, stage, timeout=60))
    assert time.monotonic() - start < 10  # the bomb hung every stage for hours
    assert message.startswith("error: params.yaml"), message
    for word in words:
        assert word in message, message
    assert dir_digest(project / "data") == before


def test_featurenet_and_evaluate_refuse_an_empty_val_split(tmp_path, monkeypatch, capsys):
    # val_fraction above 0 can still round to 0 images: prepare warns, the readers stop.
    from stages import _cli
    from stages import evaluate as evaluate_stage
    from stages import featurenet as featurenet_stage

    for i in range(4):
        solid_image(tmp_path / "few" / f"{i}.png", (10 * i, 0, 0))
    data = {"source": "folder", "path": "few", "image_size": 16, "val_fraction": 0.1}
    report = prepare_dataset(DataParams(**data), 0, tmp_path / "data", tmp_path, progress=False)
    assert report.counts == {"train": 4, "val": 0}  # round(0.4) = 0
    write_params(tmp_path, data)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "featurenet.pt").write_bytes(b"previous")
    before = dir_digest(tmp_path)
    monkeypatch.chdir(tmp_path)
    for name, main in (("featurenet", featurenet_stage.main), ("evaluate", evaluate_stage.main)):
        monkeypatch.setattr(sys, "argv", [name])
        with pytest.raises(SystemExit) as exited:
            _cli.run(main, name)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: data/val.lmdb holds no images (data.val_fraction=0.1"), err
        assert "raise data.val_fraction" in err and "Traceback" not in err
    assert dir_digest(tmp_path) == before


# --- link loops and special files -------------------------------------------------------


@pytest.mark.timeout(60)
def test_link_loops_read_each_folder_once(tmp_path, class_folder, caplog):
    (class_folder / "cats" / "again").symlink_to("../cats")  # a class folder holding itself
    (class_folder / "dogs" / "up").symlink_to("..")  # back to data.path: would list both
    (class_folder / "dogs" / "inner").mkdir()
    (class_folder / "dogs" / "inner" / "loop").symlink_to("../..")
    out, report = prep(tmp_path, source="folder", path="images", image_size=8, val_fraction=0.5)
    assert report.counts == {"train": 3, "val": 3}  # the six images, once each
    ds = [LmdbImageDataset(out / f"{s}.lmdb") for s in ("train", "val")]
    pixels = np.concatenate([d.uint8_array() for d in ds])
    assert len({p.tobytes() for p in pixels}) == 6  # no image twice, in one split or both
    assert "images/cats/again: it is" in caplog.text and "each folder is read once" in caplog.text


@pytest.mark.timeout(60)
def test_fifos_and_devices_named_like_images_are_skipped(tmp_path, class_folder, caplog):
    os.mkfifo(class_folder / "cats" / "x.png")
    (class_folder / "dogs" / "zero.png").symlink_to("/dev/zero")
    _, report = prep(tmp_path, source="folder", path="images", image_size=8, val_fraction=0)
    assert report.counts["train"] == 6 and report.skipped == []
    assert "cats/x.png: a FIFO, not an image file" in caplog.text
    assert "dogs/zero.png: a character device, not an image file" in caplog.text


@pytest.mark.timeout(10)
def test_decoding_refuses_a_fifo_without_blocking(tmp_path):
    # A file swapped for a FIFO after the listing: the decoder itself must not block on it.
    os.mkfifo(tmp_path / "late.png")
    with pytest.raises(BadImageError, match=r"not a regular file \(a FIFO\)"):
        convert.decode(("late.png", tmp_path / "late.png"), 8, 1)


# --- bad images: all listed, in one error ------------------------------------------------


def test_every_bad_image_is_listed_up_to_a_cap(tmp_path):
    names = many_bad_files(tmp_path / "imgs", convert.MAX_LISTED_BAD + 5)
    with pytest.raises(BadImageError) as info:
        prep(tmp_path, source="folder", path="imgs", image_size=8, val_fraction=0)
    message = str(info.value)
    assert [name for name, _ in info.value.bad] == names  # all of them, in listing order
    assert message.startswith(f"{len(names)} unreadable images in data.path='imgs'")
    listed = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(listed) == convert.MAX_LISTED_BAD and names[0] in listed[0]
    assert message.splitlines()[-1] == "  ... and 5 more"
    assert not list((tmp_path / "out").iterdir())


# --- MNIST reads are bounded by the header -----------------------------------------------


def test_idx_reads_only_what_its_header_announces(tmp_path):
    # A small gzip stream that inflates to 64 MB behind a header announcing 10 images.
    path = write_idx(tmp_path / "x.gz", np.zeros((10, 28, 28)), extra=bytes(64 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(SourceError, match="holds more data than its header"):
            read_idx(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"read {peak} bytes for a 7,840-byte payload"


def test_idx_header_beyond_the_bound_is_refused_before_reading(tmp_path):
    path = write_idx(tmp_path / "x", np.zeros(3), shape=(60000, 65535, 65535))
    with pytest.raises(SourceError, match=r"x announces shape .* more than the"):
        read_idx(path)


def test_truncated_idx_names_what_is_missing(tmp_path):
    path = write_idx(tmp_path / "x.gz", np.zeros((5, 28, 28)), shape=(10, 28, 28))
    with pytest.raises(SourceError, match="is truncated.*holds 3,920 of 7,840 bytes"):
        read_idx(path)


# --- meta records a reader trips over ----------------------------------------------------


def write_db_with_meta(path: Path, meta_bytes: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    env = lmdb.open(str(path), map_size=1 << 20, lock=False, subdir=True)
    with env.begin(write=True) as txn:
        txn.put(b"00000000", b"\0" * (4 + 8 * 8))
        txn.put(META_KEY, meta_bytes)
    env.close()
    write_checksums(path)  # as prepare would: the meta record is the bad part here


GOOD_META = {
    "format": FORMAT,
    "version": FORMAT_VERSION,
    "count": 1,
    "shape": [8, 8, 1],
    "content_sha256": "0" * 64,
}


@pytest.mark.parametrize(
    ("meta", "words"),
    [
        ([1, 2], "a JSON list, not an object"),
        ("a string", "a JSON str, not an object"),
        ({**GOOD_META, "count": "1"}, 'count="1" (expected an integer >= 0)'),
        ({**GOOD_META, "shape": [8, 8]}, "shape=[8, 8] (expected [height, width, channels]"),
        ({**GOOD_META, "shape": [8, 0, 1]}, "shape=[8, 0, 1]"),
        ({**GOOD_META, "class_counts": 3}, "class_counts=3 (expected a list"),
        ({**GOOD_META, "class_counts": [2, 0]}, "class_counts=[2, 0] add up to 2, not count=1"),
        (
            {**GOOD_META, "class_counts": [1], "classes": ["a", "b"]},
            "class_counts has 1 entries but classes names 2",
        ),
        ({k: v for k, v in GOOD_META.items() if k != "count"}, "count=missing"),
    ],
)
def test_meta_record_of_the_wrong_type_is_a_dataset_error(tmp_path, meta, words):
    write_db_with_meta(tmp_path / "x.lmdb", json.dumps(meta).encode())
    with pytest.raises(DatasetError) as info:
        read_meta(tmp_path / "x.lmdb")
    assert str(info.value).startswith(str(tmp_path / "x.lmdb")), info.value
    assert words in str(info.value) and "dvc repro prepare" in str(info.value)


def test_a_stage_reading_a_bad_meta_record_exits_cleanly(tmp_path, monkeypatch, capsys):
    # In-process through the stages' own error handling (stages/_cli.py): a featurenet
    # subprocess would spend ~10 s importing torch to show the same thing.
    from stages import featurenet as featurenet_stage

    for split in ("train", "val"):
        write_db_with_meta(tmp_path / "data" / f"{split}.lmdb", b"[1, 2]")
    write_params(tmp_path, {})
    before = dir_digest(tmp_path)
    monkeypatch.chdir(tmp_path)
    err = run_stage_in_process(featurenet_stage, "featurenet", monkeypatch, capsys)
    assert err.startswith("error: data/train.lmdb: the meta record is a JSON list"), err
    assert "Traceback" not in err
    assert dir_digest(tmp_path) == before


def relabel_first(db: Path, old: int, new: int) -> None:
    """Give the first record labelled ``old`` in ``db`` the label ``new``, meta unchanged,
    with checksums of the result (a database a faulty prepare could have written)."""
    env = lmdb.open(str(db), lock=False, subdir=True)
    with env.begin(write=True) as txn:
        for key, value in txn.cursor():
            if key != META_KEY and LABEL.unpack_from(value)[0] == old:
                txn.put(key, LABEL.pack(new) + value[LABEL.size :])
                break
    env.close()
    write_checksums(db)


def featurenet_project(root: Path, classes: dict[str, int], **data) -> Path:
    """root/data/ prepared from class folders of ``n`` tiny images each (0: empty)."""
    for name, n in classes.items():
        (root / "images" / name).mkdir(parents=True)
        for i in range(n):
            solid_image(root / "images" / name / f"{i}.png", (40 * i, 80, 0))
    raw = {"source": "folder", "path": "images", "image_size": 16, "channels": 1, **data}
    prepare_dataset(DataParams(**raw), 0, root / "data", root=root, progress=False)
    (root / "params.yaml").write_text(
        yaml.safe_dump(
            {"data": raw, "devices": {"accelerator": "cpu"}, "featurenet": {"epochs": 1}}
        )
    )
    return root


@pytest.mark.parametrize(
    ("split", "label", "words"),
    [
        ("train", 7, "record(s) have labels outside 0..1 (e.g. 7), the 2 classes of the meta"),
        (
            "val",
            1,
            "hold [1, 3] images per label but the meta record's class_counts says [2, 2]",
        ),
    ],
)
def test_featurenet_checks_the_labels_against_the_meta_record(
    tmp_path, monkeypatch, capsys, split, label, words
):
    from stages import featurenet as featurenet_stage

    project = featurenet_project(tmp_path, {"a": 4, "b": 4}, val_fraction=0.5)
    relabel_first(project / "data" / f"{split}.lmdb", 0, label)
    (project / "models").mkdir()
    (project / "models" / "featurenet.pt").write_bytes(b"previous weights")
    before = dir_digest(project)
    monkeypatch.chdir(project)
    err = run_stage_in_process(featurenet_stage, "featurenet", monkeypatch, capsys)
    assert err.startswith(f"error: data/{split}.lmdb: "), err
    assert words in err and err.rstrip().endswith("rebuild it with `dvc repro prepare`"), err
    assert "Traceback" not in err
    assert dir_digest(project) == before


def test_featurenet_trains_with_an_empty_class_between_others(tmp_path, monkeypatch):
    """on_bad_image: skip keeps an empty class folder's label: labels 0 and 2, no 1. The
    classifier counted the non-empty classes (2) and label 2 was out of its range."""
    from stages import featurenet as featurenet_stage

    project = featurenet_project(
        tmp_path, {"a": 4, "b": 0, "c": 4}, val_fraction=0.25, on_bad_image="skip"
    )
    assert read_meta(project / "data" / "train.lmdb")["class_counts"] == [3, 0, 3]
    monkeypatch.chdir(project)
    featurenet_stage.main(Params.model_validate(yaml.safe_load(Path("params.yaml").read_text())))
    metrics = json.loads(Path("metrics/featurenet.json").read_text())
    assert metrics["task"] == "classification" and metrics["classes"] == 3


# --- disk full ---------------------------------------------------------------------------


def _file_size_limit(limit: int):
    def apply() -> None:
        # Writes past `limit` bytes fail with EFBIG, as they would with ENOSPC on a full disk.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_disk_full_says_how_much_space_and_keeps_previous_outputs(tmp_path):
    project = project_with_previous_outputs(tmp_path)
    for i in range(200):
        random_image(project / "big" / f"{i:03d}.png", i, size=(16, 16))
    write_params(project, {"source": "folder", "path": "big", "image_size": 32, "channels": 3})
    before = dir_digest(project / "data")
    result = subprocess.run(
        [sys.executable, "-m", "stages.prepare"],
        cwd=project,
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_file_size_limit(256 << 10),
    )
    message = stage_error(result)
    assert "writing data/.train.lmdb.tmp-" in message or "writing data/.val.lmdb.tmp-" in message
    assert "need about" in message and "MiB in data/" in message and "free there now" in message
    assert "the previous data/train.lmdb and data/val.lmdb were not touched" in message
    assert dir_digest(project / "data") == before


@pytest.mark.parametrize("pixels", [8 * 8, 32 * 32, 32 * 32 * 3])  # inline; inline; overflow
def test_the_space_estimate_is_near_what_lmdb_writes(tmp_path, pixels):
    writer = LmdbWriter(tmp_path / "db", map_size=1 << 26)
    for i in range(3000):
        writer.add(i % 10, bytes(pixels))
    writer.finish({"format": FORMAT, "version": FORMAT_VERSION, "shape": [1, 1, 1]})
    written = (tmp_path / "db" / "data.mdb").stat().st_size
    estimate = estimate_bytes(3000, LABEL.size + pixels)
    assert 0.8 < estimate / written < 1.25, (estimate, written)


# --- leftovers and concurrency -----------------------------------------------------------


def test_a_second_prepare_fails_at_once_naming_the_first(tmp_path):
    project = project_with_previous_outputs(tmp_path)
    write_params(project, {"source": "folder", "path": "previous", "image_size": 16})
    others = project / "data" / ".train.lmdb.tmp-999999"  # the running one's work
    others.mkdir()
    (others / "data.mdb").write_bytes(b"half written")
    before = dir_digest(project / "data")
    with locked_dir(project / "data", "prepare"):
        start = time.monotonic()
        message = stage_error(run_stage(project, "prepare", timeout=120))
        with pytest.raises(OutputsBusyError, match=f"being written by process {os.getpid()}"):
            prepare_dataset(DataParams(), 0, project / "data", progress=False)
    assert time.monotonic() - start < 60  # it did not wait
    assert f"data/ is being written by process {os.getpid()}" in message
    assert "another `prepare` run?" in message
    assert dir_digest(project / "data") == before  # the first run's temporaries survive
    # Once the first run is gone, the next one clears its leftovers.
    data = DataParams(source="folder", path="previous", image_size=8, val_fraction=0.25)
    report = prepare_dataset(data, 0, project / "data", root=project, progress=False)
    assert report.counts == {"train": 3, "val": 1} and not others.exists()


def _hold_lock(folder: str, ready) -> None:
    with locked_dir(Path(folder), "test"):
        ready.set()
        time.sleep(60)


def _sleep(started) -> None:
    started.set()
    time.sleep(30)


def test_the_lock_goes_with_a_killed_holder_and_is_not_kept_by_forked_children(tmp_path):
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    holder = context.Process(target=_hold_lock, args=(str(tmp_path), ready))
    holder.start()
    assert ready.wait(30)
    with pytest.raises(OutputsBusyError, match=f"process {holder.pid}"), locked_dir(tmp_path, "x"):
        pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    with locked_dir(tmp_path, "test"):  # the kernel dropped the killed holder's lock
        started = context.Event()
        child = context.Process(target=_sleep, args=(started,))
        child.start()  # a forked child (like prepare's decoding pool) ...
        # Until the child runs, it shares the lock (fork copies the descriptor); the at-fork
        # hook closes its copy before any of its own code runs.
        assert started.wait(30)
    try:
        with locked_dir(tmp_path, "test"):  # ... does not keep it after the parent lets go
            pass
    finally:
        child.kill()
        child.join()


def tiny_generator_project(root: Path) -> Params:
    """``root/models/g_ema.pt`` of an untrained tiny generator, written as train writes it."""
    from stages.train import model_record

    params = Params.model_validate(
        {
            "data": {"image_size": 16, "channels": 1},
            "model": {"z_dim": 4, "g_width": 4},
            "devices": {"accelerator": "cpu", "cpu_threads": 1},
            "generate": {
                "grid_rows": 2,
                "num_images": 3,
                "interpolation_rows": 1,
                "interpolation_steps": 2,
            },
        }
    )
    torch.manual_seed(0)
    g = DcganGenerator(4, 4, 1, 16, params.model.norm)
    numerics = runtime.numerics_record(params.determinism, params.devices, torch.device("cpu"))
    record = model_record(params, "generator", g.state_dict(), numerics)
    save_atomic(record, root / "models" / "g_ema.pt")
    return params


def test_generate_clears_what_a_killed_run_left(tmp_path, monkeypatch):
    from stages import generate as generate_stage

    params = tiny_generator_project(tmp_path)
    samples = tmp_path / "samples"
    leftovers = [samples / ".images.tmp-k1llme", samples / ".images.old-4242"]
    for folder in leftovers:
        folder.mkdir(parents=True)
        (folder / "000000.png").write_bytes(b"half")
    leftovers.append(samples / ".grid.png.tmp-4242")
    leftovers[-1].write_bytes(b"half")
    keep = samples / "notes.txt"  # not ours: stays
    keep.write_text("mine")
    monkeypatch.chdir(tmp_path)
    generate_stage.main(params)
    assert not any(p.exists() for p in leftovers)
    assert sorted(p.name for p in samples.iterdir()) == [
        "grid.png",
        "images",
        "interpolation.png",
        "notes.txt",
    ]
    assert sorted(p.name for p in (samples / "images").iterdir()) == [
        "000000.png",
        "000001.png",
        "000002.png",
    ]
    Image.open(samples / "grid.png").verify()


def test_a_second_generate_fails_at_once_leaving_the_first_ones_files(tmp_path, monkeypatch):
    from stages import generate as generate_stage

    params = tiny_generator_project(tmp_path)
    running = tmp_path / "samples" / ".images.tmp-first"
    running.mkdir(parents=True)
    (running / "000000.png").write_bytes(b"being written")
    monkeypatch.chdir(tmp_path)
    busy = pytest.raises(OutputsBusyError, match="samples/ is being written by process")
    with locked_dir(Path("samples"), "generate"), busy:
        generate_stage.main(params)
    assert (running / "000000.png").read_bytes() == b"being written"


@pytest.mark.parametrize(
    ("stage", "folder", "previous"),
    [
        ("train", "checkpoints", ["models/g_ema.pt", "checkpoints/abc/ckpt-000001.pt"]),
        ("featurenet", "models", ["models/featurenet.pt", "metrics/featurenet.json"]),
        ("evaluate", "metrics/eval", ["metrics/eval/metrics.json"]),
    ],
)
def test_a_second_train_featurenet_or_evaluate_fails_at_once(
    tmp_path, monkeypatch, capsys, stage, folder, previous
):
    # In-process through the stages' own error handling: the lock is taken before any data,
    # model or torch work, so a subprocess would only add its ~10 s of imports.
    import importlib

    from stages import _cli

    module = importlib.import_module(f"stages.{stage}")
    write_params(tmp_path, {})
    for name in previous:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"the first run's")
    before = dir_digest(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [stage])
    with locked_dir(Path(folder), stage), pytest.raises(SystemExit) as exited:
        _cli.run(module.main, stage)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: {folder}/ is being written by process {os.getpid()} (another `{stage}` run?); "
        f"wait for it to finish, or stop it, then rerun `{stage}`"
    ), err
    assert "Traceback" not in err
    assert dir_digest(tmp_path) == before


# --- devices.gpus --------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.device_count() > 9, reason="this machine has a GPU 9")
def test_a_listed_gpu_the_machine_lacks_stops_the_stage(tmp_path):
    """The stage selects devices.gpus before torch loads (CUDA then sees none of them) and
    says so, instead of running on GPU 0 or, with accelerator auto, on the CPU."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"devices": {"gpus": [9]}}))
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "featurenet.pt").write_bytes(b"previous weights")
    before = dir_digest(tmp_path)
    message = stage_error(run_stage(tmp_path, "featurenet", timeout=120))
    assert message.startswith(
        "error: devices.gpus=[9] but CUDA sees none of them: this machine has no GPU 9 (or no "
        "CUDA); list this machine's GPUs with `nvidia-smi -L` and name existing ones"
    ), message
    assert dir_digest(tmp_path) == before


# --- the plots page (reports/build.py) ----------------------------------------------------


def test_the_report_build_clears_what_a_killed_build_left(tmp_path):
    from reports.build import ReportError, build_report

    page = tmp_path / "reports" / "plots"
    (page / "vendor").mkdir(parents=True)
    (page / "index.html").write_text("the previous page")
    leftovers = [
        tmp_path / "reports" / ".plots.tmp-4242",  # this module's staging folder
        tmp_path / "reports" / ".plots.old-4242",  # replace_dir's aside, where no exchange
        tmp_path / "reports" / ".plots.k1_ll3d0",  # tempfile's name, before
    ]
    for folder in leftovers:
        (folder / "new").mkdir(parents=True)
        (folder / "new" / "index.html").write_text("half a page")
    keep = [tmp_path / "reports" / ".plots.notes", tmp_path / "reports" / "build.py"]
    for path in keep:  # not a build's: stays
        path.write_text("mine")
    before = dir_digest(page)
    # No vega bundles: the build fails after clearing, before rendering anything.
    with pytest.raises(ReportError, match="make setup"):
        build_report(tmp_path, Path("reports/plots"), node_modules=tmp_path / "none")
    assert not any(p.exists() for p in leftovers)
    assert all(p.read_text() == "mine" for p in keep)
    assert dir_digest(page) == before


def test_a_second_report_build_fails_at_once(tmp_path):
    (tmp_path / "reports" / ".plots.tmp-4242").mkdir(parents=True)  # the running one's
    (tmp_path / "reports" / ".plots.tmp-4242" / "index.html").write_text("being written")
    before = dir_digest(tmp_path)
    with locked_dir(tmp_path / "reports", "reports.build"):
        result = subprocess.run(
            [sys.executable, "-m", "reports.build", "--node-modules", str(tmp_path)],
            cwd=tmp_path,
            env=stage_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    message = stage_error(result)
    assert message.startswith(
        f"error: {tmp_path}/reports/ is being written by process {os.getpid()} (another "
        "`reports.build` run?)"
    ), message
    assert dir_digest(tmp_path) == before


# --- model files, checkpoints and the feature cache --------------------------------------


class Payload:
    """Pickled, it runs ``touch marker`` when loaded without ``weights_only``."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _shrunk_generator(path: Path) -> None:
    record = torch.load(path, weights_only=True)
    name = next(iter(record["state_dict"]))
    record["state_dict"][name] = record["state_dict"][name][:1]
    save_atomic(record, path)


# case -> what replaces models/g_ema.pt, words the reason must hold
BAD_MODEL_FILES = {
    "garbage": (
        lambda p: p.write_bytes(np.random.default_rng(0).bytes(5000)),
        "is not a file torch.save writes",
    ),
    "text": (lambda p: p.write_text("hello\n"), "is not a file torch.save writes"),
    "empty": (lambda p: p.write_bytes(b""), "is not a file torch.save writes"),
    "truncated": (
        lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
        "is not a file torch.save writes",
    ),
    "foreign_pickle": (
        lambda p: p.write_bytes(pickle.dumps({"weights": [1.0, 2.0]})),
        "is not a file torch.save writes",
    ),
    "torch_file_with_code": (
        lambda p: torch.save({"x": Payload(p.parent / "pwned")}, p),
        "holds pickled Python objects besides tensors",
    ),
    "foreign_state_dict": (
        lambda p: torch.save({"weight": torch.ones(3)}, p),
        "is not a model file of the train stage (KeyError: 'model')",
    ),
    "wrong_shapes": (
        _shrunk_generator,
        "is not a model file of the train stage (RuntimeError: Error(s) in loading state_dict "
        "for DcganGenerator: size mismatch for main.0.0.weight",
    ),
}


def run_stage_in_process(stage, argv0: str, monkeypatch, capsys) -> str:
    """``stage.main`` through the stages' error handling (stages/_cli.py); its message.

    In-process: a stage subprocess spends ~10 s importing torch to show the same thing.
    """
    from stages import _cli

    capsys.readouterr()  # what ran before
    monkeypatch.setattr(sys, "argv", [argv0])
    with pytest.raises(SystemExit) as exited:
        _cli.run(stage.main, argv0)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "weights_only" not in err, err
    assert len([line for line in err.splitlines() if line.startswith("error: ")]) == 1, err
    return err[err.index("error: ") :]  # after any progress bar


@pytest.mark.parametrize("case", sorted(BAD_MODEL_FILES))
def test_generate_names_a_bad_model_file_and_the_stage_to_rerun(
    tmp_path, monkeypatch, capsys, case
):
    from stages import generate as generate_stage

    params = tiny_generator_project(tmp_path)
    write_params(tmp_path, {"image_size": 16, "channels": 1})
    monkeypatch.chdir(tmp_path)
    generate_stage.main(params)  # the previous outputs
    replace, words = BAD_MODEL_FILES[case]
    replace(tmp_path / "models" / "g_ema.pt")
    before = dir_digest(tmp_path)
    err = run_stage_in_process(generate_stage, "generate", monkeypatch, capsys)
    assert err.startswith(f"error: models/g_ema.pt {words}"), err
    assert "rewrite it: `dvc repro train` (or `python -m stages.train`)" in err
    assert not (tmp_path / "models" / "pwned").exists(), "the payload ran"
    assert dir_digest(tmp_path) == before


def test_evaluate_names_a_bad_featurenet_file(tmp_path, monkeypatch, capsys):
    """Weights replaced together with their .sha256 record pass the hash check; loading
    them is refused, naming the file and the featurenet stage."""
    import hashlib

    from stages import evaluate as evaluate_stage

    project = project_with_previous_outputs(tmp_path, image_size=16)
    write_params(project, {"image_size": 16})
    weights = project / "models" / "featurenet.pt"
    weights.parent.mkdir()
    torch.save({"x": Payload(project / "pwned")}, weights)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    weights.with_suffix(".sha256").write_text(f"{digest}  featurenet.pt\n")
    metrics = project / "metrics" / "eval" / "metrics.json"
    metrics.parent.mkdir(parents=True)
    metrics.write_text('{"fid": 1.0}\n')
    before = dir_digest(project)
    monkeypatch.chdir(project)
    err = run_stage_in_process(evaluate_stage, "evaluate", monkeypatch, capsys)
    assert err.startswith("error: models/featurenet.pt holds pickled Python objects"), err
    assert "`dvc repro featurenet` (or `python -m stages.featurenet`)" in err
    assert not (project / "pwned").exists(), "the payload ran"
    assert dir_digest(project) == before


@pytest.mark.timeout(120)
def test_a_stage_process_shows_no_torch_text_for_a_foreign_pickle(tmp_path):
    tiny_generator_project(tmp_path)
    write_params(tmp_path, {"image_size": 16, "channels": 1})
    torch.save({"x": Payload(tmp_path / "pwned")}, tmp_path / "models" / "g_ema.pt")
    message = stage_error(run_stage(tmp_path, "generate", timeout=120))
    assert message.startswith("error: models/g_ema.pt holds pickled Python objects"), message
    assert "weights_only" not in message and "dvc repro train" in message
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "samples").exists()


class Projection(torch.nn.Module):
    """A fixed random projection standing in for a feature network; counts its images."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.randn(64, 6, generator=torch.Generator().manual_seed(1))
        )
        self.digest = "e" * 64
        self.num_images = 0

    def forward(self, images):
        self.num_images += len(images)
        return images.flatten(1) @ self.weight


def test_a_flipped_bit_in_the_feature_cache_is_caught_and_the_cache_rebuilt(tmp_path, caplog):
    from ganpipe import evaluation

    images = torch.rand(40, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    dataset = torch.utils.data.TensorDataset(images, torch.zeros(40, dtype=torch.long))
    extractor = Projection()
    fake = torch.randn(40, 6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def real() -> torch.Tensor:
        return evaluation.real_features(
            extractor, dataset, "d" * 64, 16, torch.device("cpu"), tmp_path, progress=False
        )

    features = real()
    fid = evaluation.fid(features, fake)
    (cache,) = tmp_path.glob("*.pt")
    data = bytearray(cache.read_bytes())
    at = bytes(data).index(features[20].numpy().tobytes())
    data[at + 3] ^= 0x10
    cache.write_bytes(bytes(data))
    # torch's zip reader does not check CRCs: without the sha256 the flip would be used.
    payload = bytes(data).partition(b"\n")[2]
    altered = torch.load(io.BytesIO(payload), weights_only=True)["features"]
    assert not torch.equal(altered, features)
    assert evaluation.fid(altered, fake) != fid
    assert extractor.num_images == 40
    again = real()
    assert f"feature cache {cache} cannot be used" in caplog.text
    assert "sha256 mismatch" in caplog.text
    assert extractor.num_images == 80  # extracted again, not read from the damaged file
    assert torch.equal(again, features) and evaluation.fid(again, fake) == fid
    caplog.clear()
    assert torch.equal(real(), features) and extractor.num_images == 80  # the rebuilt cache
    assert "cannot be used" not in caplog.text


TINY_RUN = tiny_params(
    seed=4,
    devices={"accelerator": "cpu"},
    model={"z_dim": 16, "g_width": 8, "d_width": 8},
    train={
        "batch_size": 32,
        "kimg": 0.64,
        "checkpoint_kimg": 0.32,
        "keep_checkpoints": 3,
        "log_every_kimg": 0.32,
        "snapshot_kimg": 100,
    },
)


@pytest.fixture(scope="module")
def tiny_train_set(digits16) -> LmdbImageDataset:
    return LmdbImageDataset(digits16 / "train.lmdb", as_uint8=True)


def train_tiny(run_dir: Path, dataset: LmdbImageDataset, **train) -> dict[str, torch.Tensor]:
    """Train TINY_RUN (``train`` updated) with checkpoints in ``run_dir``; the EMA weights."""
    params = Params.model_validate({**TINY_RUN, "train": {**TINY_RUN["train"], **train}})
    result = loop.train(params, dataset, torch.device("cpu"), progress=False, run_dir=run_dir)
    return result.g_ema.state_dict()


def rewrite_with_valid_hash(path: Path, change) -> None:
    """Apply ``change`` to the checkpoint's state and save it again, hash and all."""
    state = checkpoint.read_checkpoint(path)
    change(state)
    state.pop("format")
    checkpoint.save_checkpoint(state, path.parent, state["images_seen"], keep=99)


def foreign_adam_moment(state: dict) -> None:
    state["opt_d"]["state"][0]["exp_avg"] = torch.ones(2)


def test_a_checkpoint_of_the_wrong_shapes_falls_back_like_a_damaged_one(
    tmp_path, tiny_train_set, caplog
):
    caplog.set_level(logging.INFO, logger="ganpipe.runstate")
    run_dir = tmp_path / "run"
    uninterrupted = train_tiny(run_dir, tiny_train_set)
    newest, previous = checkpoint.list_checkpoints(run_dir)
    assert (newest.name, previous.name) == ("ckpt-000000000640.pt", "ckpt-000000000320.pt")

    def widen(state):
        name = next(iter(state["g"]))
        state["g"][name] = torch.cat([state["g"][name], state["g"][name]])

    rewrite_with_valid_hash(newest, widen)
    assert checkpoint.read_checkpoint(newest)  # its hash is valid
    resumed = train_tiny(run_dir, tiny_train_set)
    assert f"checkpoint {newest} does not fit this run (ValueError: g: " in caplog.text
    assert f"resumed from {previous}" in caplog.text
    assert newest.with_name(newest.name + ".corrupt").exists()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)
    # None fits: training starts over, and ends with the same weights again.
    caplog.clear()
    for path in checkpoint.list_checkpoints(run_dir):
        rewrite_with_valid_hash(path, foreign_adam_moment)
    again = train_tiny(run_dir, tiny_train_set)
    assert caplog.text.count("does not fit this run (ValueError: opt_d: exp_avg") == 2
    assert "training from the start" in caplog.text
    assert all(torch.equal(again[k], uninterrupted[k]) for k in uninterrupted)


def disk_with_room_for(monkeypatch, num_checkpoints: int) -> list[Path]:
    """Checkpoint writes fail with ENOSPC while ``num_checkpoints`` are on disk (as the real
    write reports it: a NoSpaceError); the writes that failed are returned."""
    write = checkpoint.write_bytes_atomic
    failed = []

    def limited(data: bytes, path: Path) -> None:
        if len(checkpoint.list_checkpoints(path.parent)) >= num_checkpoints:
            failed.append(path)
            full = OSError(errno.ENOSPC, "No space left on device", str(path))
            raise no_space_error(full, path, len(data))
        write(data, path)

    monkeypatch.setattr(checkpoint, "write_bytes_atomic", limited)
    return failed


def test_a_disk_with_room_for_keep_checkpoints_makes_progress(
    tmp_path, tiny_train_set, monkeypatch, caplog
):
    run_dir = tmp_path / "run"
    failed = disk_with_room_for(monkeypatch, 2)
    train_tiny(run_dir, tiny_train_set, kimg=0.96, keep_checkpoints=2)
    assert [p.name for p in failed] == ["ckpt-000000000960.pt"]
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == [
        "ckpt-000000000960.pt",
        "ckpt-000000000640.pt",
    ]
    assert "deleted ckpt-000000000320.pt first, which keep_checkpoints=2" in caplog.text


def checkpoint_files(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run_dir.iterdir() if p.name.startswith("ckpt-")}


def test_a_full_disk_during_a_checkpoint_says_how_much_space_is_needed(
    tmp_path, digits16, monkeypatch, capsys
):
    """keep_checkpoints=1 never deletes the only checkpoint before its successor is written:
    the stage stops with one error saying how much is needed, the checkpoint and the models
    of the previous run intact."""
    from stages import train as train_stage

    project = tmp_path
    (project / "data").symlink_to(digits16)
    config = {**TINY_RUN, "train": {**TINY_RUN["train"], "kimg": 0.32}}
    (project / "params.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(project)
    train_stage.main(Params.model_validate(config))
    config["train"].update(kimg=0.64, keep_checkpoints=1)
    (project / "params.yaml").write_text(yaml.safe_dump(config))
    models_before = dir_digest(project / "models")
    (run_dir,) = (project / "checkpoints").iterdir()
    checkpoints_before = checkpoint_files(run_dir)
    assert list(checkpoints_before) == ["ckpt-000000000320.pt"]
    write = checkpoint.write_bytes_atomic
    disk_with_room_for(monkeypatch, 1)
    err = run_stage_in_process(train_stage, "train", monkeypatch, capsys)
    path = f"checkpoints/{run_dir.name}/ckpt-000000000640.pt"
    assert err.startswith(f"error: writing {path} failed (No space left on device)"), err
    size = size_text((run_dir / "ckpt-000000000320.pt").stat().st_size)
    assert f"a checkpoint needs {size} in checkpoints/{run_dir.name}/" in err
    assert "free there now" in err and "the 1 checkpoint(s) kept there use" in err
    assert "train.keep_checkpoints=1, room for 2 checkpoints is needed" in err
    assert dir_digest(project / "models") == models_before
    assert checkpoint_files(run_dir) == checkpoints_before
    monkeypatch.setattr(checkpoint, "write_bytes_atomic", write)  # space was freed
    train_stage.main(Params.model_validate(config))
    assert list(checkpoint_files(run_dir)) == ["ckpt-000000000640.pt"]
