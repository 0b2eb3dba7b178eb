"""Gradient accumulation benchmark: peak memory and images/s for train.grad_accum 1, 4, 16.

Runs the real train stage (one process, CPU) on the built-in digits at 64x64 with a
global batch of 512, so activations dominate memory. Each configuration runs in a fresh
process; peak memory is the run's own ``perf/peak_memory_mb`` (peak RSS on CPU, peak
allocated on CUDA) and throughput its median logged ``perf/images_per_s``. Runs alternate
between configurations and the table shows medians and ratios to ``grad_accum: 1``.

    python -m benchmarks.accum [--runs 3] [--kimg 5]

Writes benchmarks/results/accum.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import DataParams

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "accum.json"
ACCUMS = (1, 4, 16)


def run(root: Path, accum: int, kimg: float) -> tuple[float, float]:
    """Train once; (peak memory MiB, median images/s after the first interval)."""
    params = {
        "seed": 0,
        "data": {"image_size": 64},
        "devices": {"cpu_threads": 2},
        "determinism": {"cpu_isa": "native"},  # the fastest path, as the recorded results
        "model": {"g_width": 32, "d_width": 32, "norm": "instance"},
        "train": {
            "metrics_kimg": 0,  # this benchmark measures what it needs itself
            "batch_size": 512,
            "grad_accum": accum,
            "kimg": kimg,
            "log_every_kimg": 1.024,
            "snapshot_kimg": 1000,
            "ema_kimg": 0,
        },
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "stages.train"], cwd=root, env=env, check=True, capture_output=True
    )
    log = root / "measurements/train/plots/metrics/perf"
    peak = float((log / "peak_memory_mb.tsv").read_text().splitlines()[-1].split("\t")[1])
    rates = [
        float(line.split("\t")[1])
        for line in (log / "images_per_s.tsv").read_text().splitlines()[1:]
    ]
    return peak, statistics.median(rates[1:] if len(rates) > 2 else rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kimg", type=float, default=5.12)
    args = parser.parse_args()
    samples: dict[int, list[tuple[float, float]]] = {a: [] for a in ACCUMS}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_dataset(DataParams(image_size=64), 0, root / "data", progress=False)
        for i in range(args.runs):
            for accum in ACCUMS:
                peak, rate = run(root, accum, args.kimg)
                samples[accum].append((peak, rate))
                print(f"run {i + 1} grad_accum {accum}: peak {peak:.0f} MiB, {rate:.0f} img/s")
    table = {}
    base_peak = statistics.median(p for p, _ in samples[1])
    base_rate = statistics.median(r for _, r in samples[1])
    for accum in ACCUMS:
        peak = statistics.median(p for p, _ in samples[accum])
        rate = statistics.median(r for _, r in samples[accum])
        table[accum] = {
            "peak_memory_mb": peak,
            "images_per_s": rate,
            "memory_vs_accum_1": peak / base_peak,
            "speed_vs_accum_1": rate / base_rate,
            "runs": samples[accum],
        }
    print(f"\n{'grad_accum':>10} {'peak MiB':>9} {'x mem':>6} {'img/s':>7} {'x speed':>8}")
    for accum, row in table.items():
        print(
            f"{accum:>10} {row['peak_memory_mb']:>9.0f} {row['memory_vs_accum_1']:>6.2f} "
            f"{row['images_per_s']:>7.0f} {row['speed_vs_accum_1']:>8.2f}"
        )
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "grad_accum",
                "setup": "digits 64x64, batch 512, dcgan widths 32, instance norm, 1 CPU process",
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "torch": torch.__version__,
                "runs": args.runs,
                "kimg": args.kimg,
                "results": table,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
