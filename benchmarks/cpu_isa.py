"""CPU-mode benchmark: training images/s with ``determinism.cpu_isa`` portable vs native.

Runs the real train stage on the built-in digits with the default pipeline's model (32x32x1,
widths 32, batch 64, 2 threads), alternating the two modes run by run. Throughput is read
from each run's own measurements (``measurements/train``: ``perf/images_per_s`` per logging
interval, the first one dropped as warm-up); the stage's wall time, start-up included, is
reported too, and the CPU seconds the stage process used per trained image (user + system,
``getrusage`` of the finished child, start-up included: steadier than wall time on a shared
machine, best at ``--threads 1``). The cost of the portable mode is the median over runs of
native ÷ portable images/s, each ratio taken within one pair of consecutive runs (this
shared machine is noisy).

    python -m benchmarks.cpu_isa [--runs 5] [--kimg 6.4] [--threads 2]

Writes benchmarks/results/cpu_isa.json.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from ganpipe import cpu
from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import DataParams

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "cpu_isa.json"
MODES = ("native", "portable")


def run(root: Path, mode: str, kimg: float, threads: int) -> tuple[float, float, float]:
    """Train once in ``mode``; (median images/s after the first interval, wall seconds,
    CPU seconds per image)."""
    params = {
        "seed": 0,
        "devices": {"cpu_threads": threads},
        "determinism": {"cpu_isa": mode},
        "model": {"g_width": 32, "d_width": 32},
        "train": {
            "metrics_kimg": 0,
            "kimg": kimg,
            "log_every_kimg": 0.64,
            "snapshot_kimg": 1000,
            "ema_kimg": 5,
        },
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    for old in (root / "checkpoints").glob("*/ckpt-*.pt"):
        old.unlink()  # each run trains from the start
    # The stage pins its own mode; nothing of this process's environment may leak in.
    env = {k: v for k, v in os.environ.items() if k not in cpu.NUMERICS_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "stages.train"], cwd=root, env=env, check=True, capture_output=True
    )
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rows = (root / "measurements/train/plots/metrics/perf/images_per_s.tsv").read_text()
    rates = [float(line.split("\t")[1]) for line in rows.splitlines()[1:]]
    return statistics.median(rates[1:] if len(rates) > 2 else rates), wall, cpu_s / (kimg * 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kimg", type=float, default=6.4)
    parser.add_argument("--threads", type=int, default=2, help="devices.cpu_threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    cpu_per_image: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_dataset(DataParams(), 0, root / "data", progress=False)
        for i in range(args.runs):
            for mode in MODES:
                rate, wall, cpu_s = run(root, mode, args.kimg, args.threads)
                rates[mode].append(rate)
                walls[mode].append(wall)
                cpu_per_image[mode].append(cpu_s)
                print(
                    f"run {i}: {mode}: {rate:,.0f} images/s, {wall:.1f} s, "
                    f"{cpu_s * 1000:.2f} CPU ms/image",
                    flush=True,
                )
    ratios = [n / p for n, p in zip(rates["native"], rates["portable"], strict=True)]
    result = {
        "images_per_s": {m: statistics.median(rates[m]) for m in MODES},
        "wall_s": {m: statistics.median(walls[m]) for m in MODES},
        "cpu_s_per_image": {m: statistics.median(cpu_per_image[m]) for m in MODES},
        "runs": {"images_per_s": rates, "wall_s": walls, "cpu_s_per_image": cpu_per_image},
        "slowdown_median": statistics.median(ratios),
        "slowdown_runs": ratios,
        "setup": {
            "model": "DCGAN 32x32x1 (digits), widths 32, batch 64, BatchNorm, fp32",
            "threads": args.threads,
            "kimg": args.kimg,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {cpu.cpu_info()['model']}",
            "flags": cpu.cpu_info()["flags"],
            "torch": importlib.metadata.version("torch"),
        },
    }
    print(f"\n| determinism.cpu_isa | images/s (median of {args.runs}) | stage wall time |")
    print("|---|---:|---:|")
    for mode in MODES:
        print(f"| {mode} | {result['images_per_s'][mode]:,.0f} | {result['wall_s'][mode]:.1f} s |")
    print(
        f"\nnative ÷ portable images/s (median of per-pair ratios): {result['slowdown_median']:.2f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
