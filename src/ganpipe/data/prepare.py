"""Build the train and val LMDB databases from a source, atomically.

Both databases are built in temporary folders beside their final paths and renamed into
place only when both are complete (meta record written and synced). An interrupted run
(even SIGKILL) leaves each previous output either untouched or replaced by its complete
new version; its leftovers are temporary folders, which readers refuse (no meta record) and
the next run deletes. The two renames are not one atomic step: a kill between them leaves a
new train beside the previous val. Both meta records name the pair's content hashes
(``pair``), and readers of both splits refuse a mismatch (:func:`store.check_pair`).

A run holds a lock on the output folder from start to end (:func:`files.locked_dir`): a
second run at the same time fails at once, naming the pid of the first, instead of deleting
the first run's temporaries as leftovers.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from ganpipe.cpu import usable_cpus
from ganpipe.data import convert
from ganpipe.data.sources import Listing, list_source
from ganpipe.data.store import (
    FORMAT,
    FORMAT_VERSION,
    LABEL,
    DatasetError,
    LmdbWriter,
    WriteFailedError,
    estimate_bytes,
)
from ganpipe.files import (
    TMP_MARK,
    build_dir_for,
    clear_leftovers,
    free_bytes,
    free_space_text,
    locked_dir,
    replace_dir,
    size_text,
)
from ganpipe.params import DataParams

log = logging.getLogger(__name__)

SPLITS = ("train", "val")
#: Databases from this size up are announced in the log before they are written.
LARGE_DATABASE_BYTES = 1 << 30
#: Below this many files the process pool costs more than it saves.
PARALLEL_MIN_FILES = 512


@dataclass
class PrepareReport:
    """What a prepare run produced."""

    counts: dict[str, int]
    skipped: list[dict[str, str]]
    images_per_s: float
    meta: dict[str, dict[str, Any]]


def split_indices(num_items: int, val_fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the items that go to val: ``round(n * val_fraction)`` chosen by seed.

    The split is drawn over the listed items before decoding, so a skipped bad image does
    not move any other image between splits.
    """
    num_val = round(num_items * val_fraction)
    order = np.random.default_rng(seed).permutation(num_items)
    is_val = np.zeros(num_items, dtype=bool)
    is_val[order[:num_val]] = True
    return is_val


def _decode_or_reason(item, image_size: int, channels: int):
    try:
        return convert.decode(item, image_size, channels), None
    except convert.BadImageError as exc:
        return None, exc.reason


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _born_with_default_sigterm() -> Iterator[None]:
    """SIGTERM's default action while the pool forks its workers (main thread only: where
    Python allows it), restored once they exist. A worker stuck before its initializer ran
    (a lock another thread of the parent held at fork time) would otherwise carry the
    parent's flag-only handler, ignore the pool's SIGTERM at exit, and the exit would wait
    for it forever (seen once in CI, with the other worker having done all the work)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _decoded(listing: Listing, image_size: int, channels: int, workers: int) -> Iterator:
    """Yield ``(pixels or None, reason)`` per item, in listing order."""
    items = zip(listing.names, listing.payloads, strict=True)
    work = partial(_decode_or_reason, image_size=image_size, channels=channels)
    files = sum(1 for p in listing.payloads if isinstance(p, Path))
    if workers > 1 and files >= PARALLEL_MIN_FILES:
        # fork: workers only need Pillow and numpy, and start in milliseconds. They start
        # with the default SIGTERM action: a forked worker inherits the parent's Python
        # handlers (a stage's stop request only sets a flag), and Pool's exit, which
        # terminates its workers with SIGTERM, then waited forever for one blocked on its queue.
        context = multiprocessing.get_context("fork")
        with _born_with_default_sigterm():  # the workers are forked here
            pool = context.Pool(workers, initializer=_default_sigterm)
        with pool:
            yield from pool.imap(work, items, chunksize=32)
    else:
        yield from map(work, items)


def _write_failed(
    exc: WriteFailedError, out_dir: Path, listing: Listing, value_bytes: int, written: int
) -> DatasetError:
    """The error for a failed write (disk full...), said in space: needed, written, free."""
    needed = estimate_bytes(len(listing), value_bytes)
    free = free_space_text(out_dir)
    return DatasetError(
        f"writing {exc.path} failed ({exc.cause}); is the disk full? The new train and val "
        f"databases need about {size_text(needed)} in {out_dir}/ beside the previous ones "
        f"({size_text(written)} were written before the failure; {free}). Free some space or "
        f"raise the quota, then rerun prepare; the previous {out_dir}/train.lmdb and "
        f"{out_dir}/val.lmdb were not touched"
    )


def check_room(listing: Listing, data: DataParams, out_dir: Path) -> int:
    """Say what the databases will take before writing them; refuse when it does not fit.

    Images are stored raw (``count x channels x size²`` bytes plus a label each, and LMDB's
    pages): 50,000 RGB images take about 2.5 GiB at 128 px and 9.4 GiB at 256 px.

    Returns:
        The estimated bytes of train and val together.

    Raises:
        DatasetError: the filesystem of ``out_dir`` has less free space than that.
    """
    pixels = data.channels * data.image_size**2
    needed = estimate_bytes(len(listing), LABEL.size + pixels)
    what = (
        f"{len(listing):,} images x {data.channels} channel(s) x {data.image_size}² px = "
        f"{size_text(len(listing) * pixels)} of pixels; the train and val databases take about "
        f"{size_text(needed)} ({needed:,} bytes) in {out_dir}/"
    )
    free = free_bytes(out_dir)
    if free is not None and needed > free:
        raise DatasetError(
            f"{what}, but only {size_text(free)} ({free:,} bytes) are free there (beside the "
            "previous databases, which stay until the new ones are complete); free some space, "
            "or lower data.image_size or data.channels"
        )
    if needed >= LARGE_DATABASE_BYTES:
        log.info("%s (%s)", what, free_space_text(out_dir))
    return needed


def _swap_into_place(built: dict[str, Path], out_dir: Path) -> None:
    """Move the finished databases to their final names (see :func:`files.replace_dir`)."""
    for split, tmp in built.items():
        replace_dir(tmp, out_dir / f"{split}.lmdb")


def prepare_dataset(
    data: DataParams,
    seed: int,
    out_dir: Path,
    root: Path = Path("."),
    workers: int | None = None,
    initial_map_size: int | None = None,
    progress: bool = True,
) -> PrepareReport:
    """Read ``data.source``, convert every image and write ``train.lmdb`` and ``val.lmdb``.

    Args:
        data: The ``data`` section of params.
        seed: The split seed (``data.split_seed``); it alone chooses the train/val split.
        out_dir: Folder receiving ``train.lmdb`` and ``val.lmdb``.
        root: Folder that relative ``data.path`` values are resolved against.
        workers: Decoding processes for image folders (default: the CPUs this process may
            use, see :func:`ganpipe.cpu.usable_cpus`).
        initial_map_size: LMDB map size to start from (grows on demand); default estimated.
        progress: Show a progress bar.

    Raises:
        SourceError: the source cannot be read, or holds labels outside its classes.
        BadImageError: images cannot be decoded and ``data.on_bad_image`` is ``error``; the
            whole source is scanned first, so it names every bad file (up to a cap).
        DatasetError: writing failed (disk full...); it says how much space is needed.
        OutputsBusyError: another prepare is writing to ``out_dir``.
    """
    with locked_dir(out_dir, "prepare"):
        for split in SPLITS:  # beside each split, or beside what it links to
            final = out_dir / f"{split}.lmdb"
            clear_leftovers(build_dir_for(final), [final.name])
        return _prepare_locked(data, seed, out_dir, root, workers, initial_map_size, progress)


def _prepare_locked(
    data: DataParams,
    seed: int,
    out_dir: Path,
    root: Path,
    workers: int | None,
    initial_map_size: int | None,
    progress: bool,
) -> PrepareReport:
    path = None if data.path is None else (root / data.path)
    listing = list_source(data.source, path, allow_empty_classes=data.on_bad_image == "skip")
    is_val = split_indices(len(listing), data.val_fraction, seed)
    if data.val_fraction > 0 and not is_val.any():
        log.warning(
            "data.val_fraction=%s of %d images rounds to 0 val images",
            data.val_fraction,
            len(listing),
        )
    if is_val.all():
        raise DatasetError(
            f"data.val_fraction={data.val_fraction} leaves no training image out of "
            f"{len(listing)}; lower it"
        )
    check_room(listing, data, out_dir)
    workers = workers or usable_cpus()
    # Each record takes at least one 4 KiB page; the map grows if this guess is short.
    record_bytes = data.image_size**2 * data.channels
    map_size = initial_map_size or max(1 << 20, 2 * len(listing) * (record_bytes + 4096))

    # Built beside each final folder, or beside what it links to (files.build_dir_for).
    tmp = {
        s: build_dir_for(out_dir / f"{s}.lmdb") / f".{s}.lmdb{TMP_MARK}{os.getpid()}"
        for s in SPLITS
    }
    writers: dict[str, LmdbWriter] = {}
    skipped: dict[str, list[dict[str, str]]] = {s: [] for s in SPLITS}
    bad: list[tuple[str, str]] = []
    class_counts = {s: [0] * len(listing.classes) for s in SPLITS}
    start = time.perf_counter()
    try:
        for split in SPLITS:
            writers[split] = LmdbWriter(tmp[split], map_size=map_size)
        bar = tqdm(
            total=len(listing),
            unit="img",
            desc="prepare",
            disable=not progress,
            mininterval=0.5,
            dynamic_ncols=True,
        )
        with bar:
            decoded = _decoded(listing, data.image_size, data.channels, workers)
            for index, (pixels, reason) in enumerate(decoded):
                split = "val" if is_val[index] else "train"
                name, label = listing.names[index], listing.labels[index]
                if pixels is None and data.on_bad_image == "error":
                    # Go on decoding (writing nothing more): one error lists every bad file.
                    bad.append((name, reason))
                elif pixels is None:
                    skipped[split].append({"file": name, "reason": reason})
                elif not bad:
                    writers[split].add(label, pixels.tobytes())
                    class_counts[split][label] += 1
                bar.update()
        if bad:
            where = f"data.path={str(data.path)!r}" if data.path else f"data.source={data.source}"
            fix = (
                f"Fix or remove {'it' if len(bad) == 1 else 'them'}, or set "
                "data.on_bad_image=skip to leave unreadable images out"
            )
            raise convert.BadImageError.listing(bad, where, fix)
        elapsed = time.perf_counter() - start
        base = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "shape": [data.image_size, data.image_size, data.channels],
            "dtype": "uint8",
            "layout": "HWC",
            "encoding": "raw",
            "record": "int32 little-endian label, then H*W*C uint8 pixels",
            "classes": listing.classes,
            "empty_classes": listing.empty_classes,
            "source": {"name": data.source, "path": data.path, "listed": len(listing)},
            "preprocessing": {
                "resize": "short side to image_size (Pillow bicubic), center crop",
                "alpha": "composited on black",
                "high_bit_depth": "scaled by 255/65535",
                "grayscale": "Pillow L (ITU-R 601-2 luma)",
                "image_size": data.image_size,
                "channels": data.channels,
            },
            "split_rule": {"seed": seed, "val_fraction": data.val_fraction},
        }
        # Every record is written, so the hashes are final: both metas name the pair.
        pair = {f"{s}_sha256": writers[s].content_sha256 for s in SPLITS}
        metas = {}
        for split in SPLITS:
            metas[split] = {
                **base,
                "split": split,
                "pair": pair,
                "class_counts": class_counts[split],
                "skipped": skipped[split],
            }
            writers[split].finish(metas[split])
            metas[split].update(
                count=writers[split].count, content_sha256=writers[split].content_sha256
            )
        _swap_into_place(tmp, out_dir)
    except BaseException as exc:
        written = sum(writer.disk_bytes() for writer in writers.values())
        for writer in writers.values():
            writer.abort()
        for folder in tmp.values():  # a writer that failed to open is not in `writers`
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(exc, WriteFailedError):
            raise _write_failed(exc, out_dir, listing, LABEL.size + record_bytes, written) from exc
        raise
    all_skipped = skipped["train"] + skipped["val"]
    if all_skipped:
        log.warning(
            "skipped %d unreadable image(s) (listed in the meta records), e.g. %s: %s",
            len(all_skipped),
            all_skipped[0]["file"],
            all_skipped[0]["reason"],
        )
    counts = {s: writers[s].count for s in SPLITS}
    log.info("wrote %s in %.1f s (%.0f images/s)", counts, elapsed, len(listing) / elapsed)
    return PrepareReport(counts, all_skipped, len(listing) / max(elapsed, 1e-9), metas)
