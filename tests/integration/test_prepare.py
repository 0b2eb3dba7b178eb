"""The prepare step on tiny generated data: every source, bad input, atomicity, determinism."""

from __future__ import annotations

import builtins
import gzip
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import struct

import numpy as np
import pytest
from PIL import Image

from ganpipe import runtime
from ganpipe.data import prepare
from ganpipe.data.convert import BadImageError
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.prepare import prepare_dataset, split_indices
from ganpipe.data.sources import SourceError
from ganpipe.data.store import DatasetError, check_pair, read_meta
from ganpipe.params import DataParams, Params
from stages import evaluate as evaluate_stage
from stages import featurenet as featurenet_stage
from tests.conftest import data_params, random_image, solid_image


def prep(tmp_path, seed=0, **data):
    out = tmp_path / "out"
    report = prepare_dataset(data_params(**data), seed, out, root=tmp_path, progress=False)
    return out, report


def all_pixels(path):
    ds = LmdbImageDataset(path)
    return ds.uint8_array(), ds.labels(), ds.meta


def test_digits_pixels_are_the_bundled_images(tmp_path):
    from sklearn.datasets import load_digits

    out, report = prep(tmp_path, image_size=8, val_fraction=0.1)
    assert report.counts == {"train": 1617, "val": 180}
    digits = load_digits()
    expected = np.rint(digits.images * 255 / 16).astype(np.uint8)
    is_val = split_indices(1797, 0.1, 0)
    train, labels, meta = all_pixels(out / "train.lmdb")
    np.testing.assert_array_equal(train[..., 0], expected[~is_val])
    np.testing.assert_array_equal(labels, digits.target[~is_val])
    assert meta["classes"] == [str(i) for i in range(10)]
    assert meta["shape"] == [8, 8, 1] and meta["source"]["name"] == "digits"
    assert sum(meta["class_counts"]) == 1617


def test_class_folder_labels_and_pixels(tmp_path, class_folder):
    out, report = prep(
        tmp_path, source="folder", path="images", image_size=8, channels=3, val_fraction=0.0
    )
    pixels, labels, meta = all_pixels(out / "train.lmdb")
    assert meta["classes"] == ["cats", "dogs"]
    np.testing.assert_array_equal(labels, [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(pixels[1, 3, 3], [10, 20, 30])
    np.testing.assert_array_equal(pixels[5, 0, 0], [200, 20, 40])
    assert report.counts["val"] == 0


def test_flat_folder_is_one_class_and_non_images_are_ignored(tmp_path):
    for i in range(4):
        solid_image(tmp_path / "flat" / f"{i}.jpg", (i, i, i))
    (tmp_path / "flat" / "README.txt").write_text("not an image")
    (tmp_path / "flat" / ".DS_Store").write_bytes(b"\0\1")
    out, report = prep(tmp_path, source="folder", path="flat", image_size=8, val_fraction=0.25)
    assert report.counts == {"train": 3, "val": 1}
    assert read_meta(out / "train.lmdb")["classes"] == ["flat"]


def test_cifar10_python_batches(tmp_path):
    root = tmp_path / "cifar" / "cifar-10-batches-py"
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    batches = []
    for i in range(1, 6):
        data = rng.integers(0, 256, (4, 3072), dtype=np.uint8)
        labels = [int(x) for x in rng.integers(0, 10, 4)]
        batches.append((data, labels))
        with open(root / f"data_batch_{i}", "wb") as f:
            pickle.dump({"data": data, "labels": labels}, f)
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    out, _ = prep(
        tmp_path, source="cifar10", path="cifar", image_size=32, channels=3, val_fraction=0.0
    )
    pixels, labels, meta = all_pixels(out / "train.lmdb")
    expected = np.concatenate([d for d, _ in batches]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(pixels, expected)
    np.testing.assert_array_equal(labels, [y for _, lab in batches for y in lab])
    assert meta["classes"][3] == "class3"


def test_cifar10_refuses_pickled_code(tmp_path):
    root = tmp_path / "cifar"
    root.mkdir()
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({"label_names": ["a"], "evil": print}, f)
    with pytest.raises(SourceError, match="refusing to load builtins.print"):
        prep(tmp_path, source="cifar10", path="cifar", image_size=32, channels=3)


def write_idx(path, array, compress):
    header = struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    opener = gzip.open if compress else open
    with opener(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_files(tmp_path, compress):
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (6, 28, 28), dtype=np.uint8)
    labels = np.array([3, 1, 4, 1, 5, 9], dtype=np.uint8)
    (tmp_path / "mnist").mkdir()
    suffix = ".gz" if compress else ""
    write_idx(tmp_path / "mnist" / f"train-images-idx3-ubyte{suffix}", images, compress)
    write_idx(tmp_path / "mnist" / f"train-labels-idx1-ubyte{suffix}", labels, compress)
    out, _ = prep(tmp_path, source="mnist", path="mnist", image_size=28, val_fraction=0.0)
    pixels, got_labels, _ = all_pixels(out / "train.lmdb")
    np.testing.assert_array_equal(pixels[..., 0], images)
    np.testing.assert_array_equal(got_labels, labels)


def test_mnist_missing_files_say_what_is_missing(tmp_path):
    (tmp_path / "mnist").mkdir()
    with pytest.raises(SourceError, match="train-images-idx3-ubyte"):
        prep(tmp_path, source="mnist", path="mnist", image_size=28)


# --- bad input -------------------------------------------------------------------------


def make_bad_files(root):
    """One of each bad file, and what error mode must report for it."""
    good = solid_image(root / "ok" / "good.png", (1, 2, 3))
    truncated = root / "ok" / "truncated.png"
    solid_image(truncated, (5, 5, 5), size=(64, 64))
    truncated.write_bytes(truncated.read_bytes()[:60])
    (root / "ok" / "zero.png").write_bytes(b"")
    (root / "ok" / "text.jpg").write_text("hello, I am not a JPEG")
    (root / "ok" / "dangling.png").symlink_to(root / "nowhere.png")
    return good, {"truncated.png", "zero.png", "text.jpg", "dangling.png"}


def test_bad_images_error_names_the_file_and_reason(tmp_path):
    make_bad_files(tmp_path / "imgs")
    with pytest.raises(BadImageError) as info:
        prep(tmp_path, source="folder", path="imgs", image_size=8)
    assert info.value.name in {
        f"ok/{n}" for n in ("truncated.png", "zero.png", "text.jpg", "dangling.png")
    }
    assert "data.on_bad_image=skip" in str(info.value)
    assert not (tmp_path / "out" / "train.lmdb").exists()
    assert not list((tmp_path / "out").iterdir()), "no temporary leftovers"


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("truncated.png", "truncated"),
        ("zero.png", "cannot identify"),
        ("text.jpg", "cannot identify"),
        ("dangling.png", "No such file"),
    ],
)
def test_each_bad_file_alone_is_reported(tmp_path, name, reason):
    make_bad_files(tmp_path / "all")
    root = tmp_path / "one" / "ok"
    root.mkdir(parents=True)
    (tmp_path / "all" / "ok" / "good.png").rename(root / "good.png")
    (tmp_path / "all" / "ok" / name).rename(root / name)
    with pytest.raises(BadImageError, match=reason) as info:
        prep(tmp_path, source="folder", path="one", image_size=8)
    assert info.value.name == f"ok/{name}"


def test_skip_mode_skips_counts_and_records(tmp_path, caplog):
    _, bad = make_bad_files(tmp_path / "imgs")
    out, report = prep(
        tmp_path, source="folder", path="imgs", image_size=8, on_bad_image="skip", val_fraction=0.0
    )
    assert report.counts["train"] == 1
    assert {s["file"].split("/")[-1] for s in report.skipped} == bad
    meta = read_meta(out / "train.lmdb")
    assert {s["file"].split("/")[-1] for s in meta["skipped"]} == bad
    assert all(s["reason"] for s in meta["skipped"])
    assert "skipped 4 unreadable image(s)" in caplog.text


def test_convertible_modes_sizes_and_names(tmp_path):
    root = tmp_path / "mixed" / "all"
    solid_image(root / "grey.png", 80, mode="L")
    solid_image(root / "la.png", (255, 128), mode="LA")
    solid_image(root / "rgba.png", (255, 0, 0, 0), mode="RGBA")
    Image.new("P", (9, 9), 3).save(root / "palette.gif")
    Image.fromarray(np.full((5, 7), 65535, np.uint16)).save(root / "sixteen.png")
    solid_image(root / "tiny.png", (7, 7, 7), size=(1, 1))
    solid_image(root / "huge.png", (9, 9, 9), size=(4000, 3000))
    solid_image(root / "ñandú_猫.png", (11, 12, 13))
    solid_image(root / "png_named.JPG", (1, 1, 1), fmt="PNG")  # fake extension, real image
    out, report = prep(
        tmp_path, source="folder", path="mixed", image_size=8, channels=3, val_fraction=0.0
    )
    assert report.counts["train"] == 9 and not report.skipped
    pixels, _, _ = all_pixels(out / "train.lmdb")
    by_name = dict(
        zip(sorted(p.relative_to(root).as_posix() for p in root.iterdir()), pixels, strict=True)
    )
    np.testing.assert_array_equal(by_name["rgba.png"][0, 0], [0, 0, 0])  # transparent -> black
    np.testing.assert_array_equal(by_name["sixteen.png"][0, 0], [255, 255, 255])
    np.testing.assert_array_equal(by_name["huge.png"][4, 4], [9, 9, 9])
    np.testing.assert_array_equal(by_name["ñandú_猫.png"][0, 0], [11, 12, 13])
    assert abs(int(by_name["la.png"][0, 0, 0]) - 128) <= 1


def test_empty_class_folder(tmp_path, class_folder):
    (class_folder / "empty").mkdir()
    with pytest.raises(SourceError, match="class folder.*without images: empty"):
        prep(tmp_path, source="folder", path="images", image_size=8)
    out, _ = prep(tmp_path, source="folder", path="images", image_size=8, on_bad_image="skip")
    meta = read_meta(out / "train.lmdb")
    assert meta["classes"] == ["cats", "dogs", "empty"] and meta["empty_classes"] == ["empty"]


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda root: None, "does not exist"),
        (lambda root: root.write_text("file"), "is not a folder"),
        (lambda root: root.mkdir(), "holds no image files"),
    ],
)
def test_missing_or_unusable_path(tmp_path, make, words):
    make(tmp_path / "data_dir")
    with pytest.raises(SourceError, match=words):
        prep(tmp_path, source="folder", path="data_dir", image_size=8)


def test_loose_images_beside_class_folders_are_ambiguous(tmp_path, class_folder):
    solid_image(class_folder / "loose.png", (0, 0, 0))
    with pytest.raises(SourceError, match="both images"):
        prep(tmp_path, source="folder", path="images", image_size=8)


def test_unreadable_class_folder_is_a_source_error_naming_it(tmp_path, class_folder, monkeypatch):
    # Tests run as root, where chmod does not stop reading: refuse the listing instead.
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path) == str(class_folder / "dogs"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    for mode in ("error", "skip"):  # never mistaken for an empty class
        with pytest.raises(SourceError) as info:
            prep(tmp_path, source="folder", path="images", image_size=8, on_bad_image=mode)
        message = str(info.value)
        assert str(class_folder / "dogs") in message
        assert "Permission denied" in message and "fix its permissions" in message
    assert not (tmp_path / "out" / "train.lmdb").exists()


def deny_reading(monkeypatch, path):
    """Make ``open(path)`` fail as an unreadable file does (chmod has no effect on root)."""
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.fspath(file) == str(path):
            raise PermissionError(13, "Permission denied", os.fspath(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded)


def test_unreadable_image_file_is_a_bad_image(tmp_path, class_folder, monkeypatch):
    deny_reading(monkeypatch, class_folder / "dogs" / "d1.PNG")
    with pytest.raises(BadImageError, match="PermissionError.*Permission denied") as info:
        prep(tmp_path, source="folder", path="images", image_size=8)
    assert info.value.name == "dogs/d1.PNG"
    assert "data.on_bad_image=skip" in str(info.value)
    out, report = prep(tmp_path, source="folder", path="images", image_size=8, on_bad_image="skip")
    assert sum(report.counts.values()) == 5
    assert [s["file"] for s in report.skipped] == ["dogs/d1.PNG"]
    assert "Permission denied" in report.skipped[0]["reason"]
    recorded = [
        s for split in ("train", "val") for s in read_meta(out / f"{split}.lmdb")["skipped"]
    ]
    assert recorded == report.skipped


# --- determinism and atomicity ---------------------------------------------------------


def test_same_inputs_give_identical_files_and_hashes(tmp_path):
    a = prepare_dataset(DataParams(image_size=16), 5, tmp_path / "a", progress=False)
    b = prepare_dataset(DataParams(image_size=16), 5, tmp_path / "b", progress=False)
    c = prepare_dataset(DataParams(image_size=16), 6, tmp_path / "c", progress=False)
    for split in ("train", "val"):
        assert (tmp_path / "a" / f"{split}.lmdb" / "data.mdb").read_bytes() == (
            tmp_path / "b" / f"{split}.lmdb" / "data.mdb"
        ).read_bytes()
        assert a.meta[split]["content_sha256"] == b.meta[split]["content_sha256"]
        assert a.meta[split]["content_sha256"] != c.meta[split]["content_sha256"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["train.lmdb", "val.lmdb"]


def test_process_pool_and_serial_decoding_write_identical_files(tmp_path, monkeypatch):
    for i in range(40):
        random_image(tmp_path / "imgs" / f"class{i % 2}" / f"{i:03d}.png", seed=i, size=(13, 11))
    monkeypatch.setattr(prepare, "PARALLEL_MIN_FILES", 1)
    pools = []
    real_get_context = multiprocessing.get_context

    def get_context(method=None):
        pools.append(method)
        return real_get_context(method)

    monkeypatch.setattr(multiprocessing, "get_context", get_context)
    data = DataParams(source="folder", path="imgs", image_size=8, channels=3)
    reports = {}
    for workers in (2, 1):
        out = tmp_path / f"w{workers}"
        reports[workers] = prepare_dataset(
            data, 0, out, root=tmp_path, workers=workers, progress=False
        )
        assert pools == ["fork"], f"workers={workers}: the pool is used only with 2 workers"
    for split in ("train", "val"):
        assert (tmp_path / "w2" / f"{split}.lmdb" / "data.mdb").read_bytes() == (
            tmp_path / "w1" / f"{split}.lmdb" / "data.mdb"
        ).read_bytes()
        assert read_meta(tmp_path / "w2" / f"{split}.lmdb") == read_meta(
            tmp_path / "w1" / f"{split}.lmdb"
        )
    assert reports[2].counts == reports[1].counts == {"train": 36, "val": 4}


def test_default_workers_follow_the_cpu_affinity(monkeypatch):
    if hasattr(os, "sched_getaffinity"):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
        assert prepare.usable_cpus() == 3
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 7)
    assert prepare.usable_cpus() == 7


def test_progress_bar_shows_rate_and_eta(tmp_path, class_folder, capsys):
    data = DataParams(source="folder", path="images", image_size=8)
    prepare_dataset(data, 0, tmp_path / "out", root=tmp_path, progress=True)
    err = capsys.readouterr().err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.search(r"prepare: 100%.* 6/6 ", final), final
    # [elapsed<remaining, rate]
    assert re.search(r"\[\d{2}:\d{2}<\d{2}:\d{2}, \d+(\.\d+)?img/s\]", final), final


def test_split_is_deterministic_and_sized():
    mask = split_indices(1000, 0.1, 3)
    assert mask.sum() == 100
    np.testing.assert_array_equal(mask, split_indices(1000, 0.1, 3))
    assert (mask != split_indices(1000, 0.1, 4)).any()


def test_failed_prepare_keeps_the_previous_output(tmp_path, class_folder):
    out, _ = prep(tmp_path, source="folder", path="images", image_size=8)
    before = (out / "train.lmdb" / "data.mdb").read_bytes()
    (class_folder / "cats" / "c0.png").write_bytes(b"broken")
    with pytest.raises(BadImageError):
        prep(tmp_path, source="folder", path="images", image_size=8)
    assert (out / "train.lmdb" / "data.mdb").read_bytes() == before
    assert sorted(p.name for p in out.iterdir()) == ["train.lmdb", "val.lmdb"]


def test_both_metas_name_the_pair(tmp_path, class_folder):
    out, report = prep(tmp_path, source="folder", path="images", image_size=8, val_fraction=0.5)
    train, val = read_meta(out / "train.lmdb"), read_meta(out / "val.lmdb")
    expected = {"train_sha256": train["content_sha256"], "val_sha256": val["content_sha256"]}
    assert train["pair"] == val["pair"] == expected
    assert report.meta["train"]["pair"] == expected
    check_pair(train, val)


def test_a_kill_between_the_two_swaps_leaves_a_pair_that_readers_refuse(
    tmp_path, class_folder, monkeypatch
):
    data = tmp_path / "data"
    params = DataParams(source="folder", path="images", image_size=8, val_fraction=0.5)
    prepare_dataset(params, 0, data, root=tmp_path, progress=False)
    old = {s: read_meta(data / f"{s}.lmdb")["content_sha256"] for s in ("train", "val")}
    real_replace_dir = prepare.replace_dir

    def replace_then_die(built, final):
        real_replace_dir(built, final)
        raise KeyboardInterrupt("killed between the swaps")

    monkeypatch.setattr(prepare, "replace_dir", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(params, 1, data, root=tmp_path, progress=False)
    train, val = read_meta(data / "train.lmdb"), read_meta(data / "val.lmdb")
    assert train["content_sha256"] != old["train"] and val["content_sha256"] == old["val"]
    with pytest.raises(DatasetError, match="come from different prepare runs"):
        check_pair(train, val)

    # The stages reading both splits refuse it before any work.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runtime, "configure_runtime", lambda *args, **kwargs: None)
    with pytest.raises(DatasetError, match="data/train.lmdb and data/val.lmdb come from"):
        featurenet_stage.main(Params())
    with pytest.raises(DatasetError, match="data/train.lmdb and data/val.lmdb come from"):
        evaluate_stage.check_val_split()

    monkeypatch.setattr(prepare, "replace_dir", real_replace_dir)
    prepare_dataset(params, 1, data, root=tmp_path, progress=False)
    check_pair(read_meta(data / "train.lmdb"), read_meta(data / "val.lmdb"))
    evaluate_stage.check_val_split()
    shutil.rmtree(data / "train.lmdb")  # evaluate reads only val: no train, nothing to check
    evaluate_stage.check_val_split()


def test_val_fraction_that_leaves_no_training_data(tmp_path):
    solid_image(tmp_path / "one" / "a.png", (1, 1, 1))
    with pytest.raises(ValueError, match="leaves no training image"):
        prep(tmp_path, source="folder", path="one", image_size=8, val_fraction=0.6)


def test_decompression_bomb_is_a_bad_image(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # anything over 2000 pixels refused
    solid_image(tmp_path / "imgs" / "ok.png", (1, 1, 1))
    solid_image(tmp_path / "imgs" / "bomb.png", (1, 1, 1), size=(100, 100))
    with pytest.raises(BadImageError, match="DecompressionBombError") as info:
        prep(tmp_path, source="folder", path="imgs", image_size=8)
    assert info.value.name == "bomb.png"


# --- large images: sizes per model.arch, and the space the databases take ------------------


@pytest.mark.parametrize("size", [128, 256])
def test_resnet_sizes_are_prepared_and_dcgan_refuses_them(tmp_path, class_folder, size):
    raw = {"data": {"source": "folder", "path": str(class_folder), "image_size": size}}
    with pytest.raises(ValueError, match=f"data.image_size={size} is not supported by model.arch"):
        Params.model_validate(raw)
    params = Params.model_validate({**raw, "model": {"arch": "resnet"}})
    prepare_dataset(params.data, 0, tmp_path / "out", progress=False)
    meta = read_meta(tmp_path / "out" / "train.lmdb")
    assert meta["shape"] == [size, size, 1]
    images = LmdbImageDataset(tmp_path / "out" / "train.lmdb", as_uint8=True)
    assert tuple(images[0][0].shape) == (1, size, size)


def test_a_database_that_does_not_fit_is_refused_before_writing(
    tmp_path, class_folder, monkeypatch
):
    monkeypatch.setattr(prepare, "free_bytes", lambda folder: 1_000_000)
    data = DataParams(source="folder", path=str(class_folder), image_size=256, channels=3)
    with pytest.raises(DatasetError) as info:
        prepare_dataset(data, 0, tmp_path / "out", progress=False)
    # By hand: 6 records of a 4-byte label + 3 x 256² pixels take 49 overflow pages of 4 KiB
    # each, 1 leaf page, no branch page, 4 meta pages: 301 pages = 1,232,896 bytes.
    message = str(info.value)
    assert "6 images x 3 channel(s) x 256² px = 1.1 MiB of pixels" in message
    assert "take about 1.2 MiB (1,232,896 bytes)" in message
    assert "only 1.0 MiB (1,000,000 bytes) are free" in message
    assert "lower data.image_size or data.channels" in message
    assert not list((tmp_path / "out").glob("*.lmdb*"))  # nothing written


def test_a_large_database_is_announced_with_its_size_and_the_free_space(
    tmp_path, class_folder, monkeypatch, caplog
):
    monkeypatch.setattr(prepare, "LARGE_DATABASE_BYTES", 1_000_000)
    data = DataParams(source="folder", path=str(class_folder), image_size=256, channels=3)
    with caplog.at_level("INFO", logger="ganpipe.data.prepare"):
        prepare_dataset(data, 0, tmp_path / "out", progress=False)
    announced = [r.getMessage() for r in caplog.records if "databases take about" in r.message]
    assert len(announced) == 1 and "(1,232,896 bytes)" in announced[0]
    assert "free there now" in announced[0]
    written = sum(f.stat().st_size for f in (tmp_path / "out").rglob("*.mdb"))
    assert written <= 2 * 1_232_896  # the estimate is of the right size (data.mdb files)


def _decode_with_default_sigterm(item, image_size, channels):
    """prepare's per-item work, in a decoding worker, refusing a non-default SIGTERM."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        raise RuntimeError("a decoding worker kept its parent's SIGTERM handler")
    return _REAL_DECODE(item, image_size, channels)


_REAL_DECODE = prepare._decode_or_reason


@pytest.mark.timeout(120)
def test_decoding_workers_die_at_sigterm_whatever_the_parent_handles(tmp_path, monkeypatch):
    """A process with a Python SIGTERM handler (a stage's stop request only sets a flag) forks
    the decoding pool: its workers must still die at the SIGTERM with which the pool's exit
    ends them, or the exit can wait forever for one blocked on the task queue's lock (a hang
    seen in CI after an earlier test left such a handler installed)."""
    for i in range(40):
        random_image(tmp_path / "imgs" / f"class{i % 2}" / f"{i:03d}.png", seed=i, size=(13, 11))
    monkeypatch.setattr(prepare, "PARALLEL_MIN_FILES", 1)
    monkeypatch.setattr(prepare, "_decode_or_reason", _decode_with_default_sigterm)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        data = DataParams(source="folder", path="imgs", image_size=8, channels=3)
        prepare_dataset(data, 0, tmp_path / "out", root=tmp_path, workers=2, progress=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (tmp_path / "out" / "train.lmdb" / "data.mdb").exists()


def test_splits_that_link_to_another_disk_are_replaced_there_and_stay_links(tmp_path):
    """A user moved data/train.lmdb and data/val.lmdb elsewhere and left links: prepare
    writes through them (the new folders built and swapped in beside their targets), and
    a second prepare gives a matching pair again, the links intact."""
    out, elsewhere = tmp_path / "data", tmp_path / "bigger-disk"
    prepare_dataset(DataParams(image_size=8), 0, out, progress=False)
    elsewhere.mkdir()
    for split in ("train", "val"):
        (out / f"{split}.lmdb").rename(elsewhere / f"{split}.lmdb")
        (out / f"{split}.lmdb").symlink_to(elsewhere / f"{split}.lmdb")
    prepare_dataset(DataParams(image_size=8, val_fraction=0.2), 0, out, progress=False)
    for split in ("train", "val"):
        link = out / f"{split}.lmdb"
        assert link.is_symlink() and link.resolve() == elsewhere / f"{split}.lmdb"
    assert sorted(p.name for p in out.iterdir()) == ["train.lmdb", "val.lmdb"]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["train.lmdb", "val.lmdb"]
    train, val = read_meta(out / "train.lmdb"), read_meta(out / "val.lmdb")
    check_pair(train, val, out / "train.lmdb", out / "val.lmdb")
    assert val["count"] == round(1797 * 0.2)


def test_a_dangling_split_link_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "data"
    out.mkdir()
    (out / "train.lmdb").symlink_to(tmp_path / "unmounted" / "train.lmdb")
    with pytest.raises(ValueError, match="create .*unmounted, or remove the link"):
        prepare_dataset(DataParams(image_size=8), 0, out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["train.lmdb"]
    assert (out / "train.lmdb").is_symlink()
