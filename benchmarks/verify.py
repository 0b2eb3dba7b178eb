"""Data verification benchmark: what :func:`ganpipe.data.store.verify_lmdb` costs, against the
time the train stage takes to reach its first step.

Builds a database of random 32x32x3 images with the project's own writer
(:class:`~ganpipe.data.store.LmdbWriter`, which also writes the checksums, as prepare does)
in a temporary project, then measures:

- ``verify``: :func:`verify_lmdb` in this process, with the file in the page cache (``warm``),
  after asking the kernel to drop it (``cold``: ``posix_fadvise(DONTNEED)``, which drops the
  clean pages of this file, no root needed), and with one thread instead of one per usable
  CPU (``warm_one_thread``);
- ``write_checksums``: what prepare spends writing them (a warm read of the finished file);
- ``stage``: ``python -m stages.train`` as a subprocess on that project (default model,
  ``train.batch_size`` 64, two steps, a log after the first), warm and cold. ``first_step_s``
  is the time from starting the process until the first log record
  (``metrics/train/metrics.json``) appears; ``verify_in_stage_s`` is the stage's own
  ``verified ... in X s`` log line. ``overhead`` = verify / (first step - verify): the share
  verification adds to the time to the first step without it (the target: below 1, i.e.
  verification must not double it).

Medians over ``--runs``. The train stage holds the whole set in memory when it fits
(``train.resident_mb``), so its first step already includes one read of the database.

    python -m benchmarks.verify [--images 100000] [--runs 3] [--accelerator auto]

Writes benchmarks/results/verify.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import yaml

from ganpipe.cpu import usable_cpus
from ganpipe.data.store import (
    CHECKSUMS_FILE,
    FORMAT,
    FORMAT_VERSION,
    LABEL,
    LmdbWriter,
    estimate_bytes,
    verify_lmdb,
    write_checksums,
)
from ganpipe.files import size_text

RESULTS = Path(__file__).parent / "results" / "verify.json"
REPO = Path(__file__).resolve().parents[1]
SIDE, CHANNELS, BATCH = 32, 3, 64


def build(path: Path, num_images: int, seed: int = 0) -> None:
    """A complete database of ``num_images`` random images, ten classes, as prepare writes."""
    rng = np.random.default_rng(seed)
    pixels = SIDE * SIDE * CHANNELS
    writer = LmdbWriter(path, map_size=estimate_bytes(num_images, LABEL.size + pixels) * 2)
    chunk = 1024
    for first in range(0, num_images, chunk):
        images = rng.integers(0, 256, (min(chunk, num_images - first), pixels), dtype=np.uint8)
        for i, image in enumerate(images, start=first):
            writer.add(i % 10, image.tobytes())
    counts = [len(range(c, num_images, 10)) for c in range(10)]
    writer.finish(
        {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "shape": [SIDE, SIDE, CHANNELS],
            "dtype": "uint8",
            "classes": [f"class{c}" for c in range(10)],
            "class_counts": counts,
        }
    )


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def stage_run(project: Path, cold: bool) -> dict[str, float]:
    """One train stage from scratch: time to its first log record, its verification, total."""
    for folder in ("checkpoints", "metrics", "models", "measurements"):
        shutil.rmtree(project / folder, ignore_errors=True)
    if cold:
        drop_from_page_cache(project / "data" / "train.lmdb" / "data.mdb")
    first_log = project / "metrics" / "train" / "metrics.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    seen: list[float] = []
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.train"],
        cwd=project,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )

    def watch() -> None:
        while proc.poll() is None and not first_log.exists():
            time.sleep(0.002)
        if first_log.exists():
            seen.append(time.perf_counter())

    watcher = threading.Thread(target=watch)
    watcher.start()
    _, err = proc.communicate()
    total = time.perf_counter() - start
    watcher.join()
    if proc.returncode != 0 or not seen:
        raise SystemExit(f"the train stage failed ({proc.returncode}):\n{err[-3000:]}")
    verified = re.search(r"verified data/train\.lmdb \([\d,]+ bytes\) in ([\d.]+) s", err)
    assert verified, err[-3000:]
    first_step = seen[0] - start
    verify = float(verified.group(1))
    return {
        "first_step_s": first_step,
        "verify_in_stage_s": verify,
        "overhead": verify / (first_step - verify),
        "total_s": total,
    }


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        db = project / "data" / "train.lmdb"
        print(f"writing {args.images:,} images of {SIDE}x{SIDE}x{CHANNELS} to {db}", flush=True)
        build_s = timed(build, db, args.images)
        size = (db / "data.mdb").stat().st_size
        blocks = len(json.loads((db / CHECKSUMS_FILE).read_text())["sha256"])
        params = {
            "data": {"image_size": SIDE, "channels": CHANNELS},
            "devices": {"accelerator": args.accelerator},
            "train": {
                "metrics_kimg": 0,  # this benchmark measures what it needs itself
                "batch_size": BATCH,
                "kimg": 2 * BATCH / 1000,
                "log_every_kimg": BATCH / 1000,
            },
        }
        (project / "params.yaml").write_text(yaml.safe_dump(params))

        verify: dict[str, list[float]] = {"warm": [], "cold": [], "warm_one_thread": []}
        checksums = []
        for run in range(args.runs):
            verify["warm"].append(timed(verify_lmdb, db))
            verify["warm_one_thread"].append(timed(verify_lmdb, db, workers=1))
            drop_from_page_cache(db / "data.mdb")
            verify["cold"].append(timed(verify_lmdb, db))
            checksums.append(timed(write_checksums, db))
            print(
                f"run {run}: verify warm {verify['warm'][-1]:.3f} s, cold "
                f"{verify['cold'][-1]:.3f} s, one thread {verify['warm_one_thread'][-1]:.3f} s",
                flush=True,
            )
        stage: dict[str, list[dict[str, float]]] = {"warm": [], "cold": []}
        for run in range(args.runs):
            for cache in ("warm", "cold"):
                if cache == "warm":
                    verify_lmdb(db)  # the file in the page cache, as after prepare
                stage[cache].append(stage_run(project, cold=cache == "cold"))
                last = stage[cache][-1]
                print(
                    f"run {run}: stage ({cache}) first step {last['first_step_s']:.2f} s, of "
                    f"which verify {last['verify_in_stage_s']:.2f} s",
                    flush=True,
                )

    result = {
        "verify_s": {name: statistics.median(v) for name, v in verify.items()},
        "write_checksums_s": statistics.median(checksums),
        "stage": {cache: median_of(runs) for cache, runs in stage.items()},
        "target": {"overhead_below": 1.0},
        "runs": {"verify_s": verify, "write_checksums_s": checksums, "stage": stage},
        "setup": {
            "num_images": args.images,
            "image": f"{SIDE}x{SIDE}x{CHANNELS}",
            "data_mdb_bytes": size,
            "blocks": blocks,
            "threads": usable_cpus(),
            "build_s": build_s,
            "train": params["train"],
            "accelerator": args.accelerator,
            "runs": args.runs,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "python": platform.python_version(),
        },
    }
    print()
    print(f"{args.images:,} images, data.mdb {size_text(size)}, {blocks} blocks")
    print(f"| what | median of {args.runs} |")
    print("|---|---:|")
    for name, value in result["verify_s"].items():
        print(f"| verify_lmdb, {name.replace('_', ' ')} | {value:.3f} s |")
    print(f"| write_checksums (prepare) | {result['write_checksums_s']:.3f} s |")
    for cache, row in result["stage"].items():
        print(f"| train stage ({cache}): time to first step | {row['first_step_s']:.2f} s |")
        print(
            f"| train stage ({cache}): of which verification | {row['verify_in_stage_s']:.2f} s |"
        )
        print(f"| train stage ({cache}): overhead (target < 100%) | {row['overhead']:.1%} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
