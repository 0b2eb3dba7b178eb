"""DDP benchmark: training images/s with 1 process vs 2 DDP processes, same total threads.

Runs the real train stage (torchrun, gloo on CPU) on the built-in digits: world size 1
with ``cpu_threads`` T, and world size 2 with T/2 threads each, so both use the same
cores. Throughput is read from the run's own log (``perf/images_per_s`` per logging
interval, the first interval dropped as warm-up); runs alternate and the table shows
medians. Scaling efficiency = images/s(2) / images/s(1): 1.0 means DDP costs nothing on
the same cores; on several machines or GPUs the ideal would be 2.0.

    python -m benchmarks.ddp [--runs 3] [--kimg 6] [--threads 2]

Writes benchmarks/results/ddp.json.
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
RESULTS = Path(__file__).parent / "results" / "ddp.json"


def run(root: Path, world: int, threads: int, kimg: float, norm: str) -> float:
    """Train once; the median logged images/s after the first interval."""
    params = {
        "seed": 0,
        "data": {"image_size": 32},
        "devices": {"nproc_per_node": world, "cpu_threads": threads},
        "determinism": {"cpu_isa": "native"},  # the fastest path, as the recorded results
        "model": {"g_width": 32, "d_width": 32, "norm": norm},
        "train": {
            "metrics_kimg": 0,
            "batch_size": 64,
            "kimg": kimg,
            "log_every_kimg": 0.64,
            "snapshot_kimg": 1000,
        },
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "stages.train"], cwd=root, env=env, check=True, capture_output=True
    )
    log = root / "measurements/train/plots/metrics/perf"
    rows = (log / "images_per_s.tsv").read_text().splitlines()
    rates = [float(line.split("\t")[1]) for line in rows[1:]]
    return statistics.median(rates[1:] if len(rates) > 2 else rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kimg", type=float, default=6.4)
    parser.add_argument("--threads", type=int, default=2, help="total threads per configuration")
    parser.add_argument("--norm", default="batch")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_dataset(DataParams(image_size=32), 0, root / "data", progress=False)
        rates: dict[int, list[float]] = {1: [], 2: []}
        for i in range(args.runs):
            for world in (1, 2):
                threads = max(1, args.threads // world)
                rates[world].append(run(root, world, threads, args.kimg, args.norm))
                print(
                    f"run {i}: world size {world} x {threads} thread(s): "
                    f"{rates[world][-1]:,.0f} images/s",
                    flush=True,
                )
    efficiency = [b / a for a, b in zip(rates[1], rates[2], strict=True)]
    result = {
        "images_per_s": {
            "world_1": statistics.median(rates[1]),
            "world_2": statistics.median(rates[2]),
        },
        "runs": {"world_1": rates[1], "world_2": rates[2]},
        "scaling_efficiency_median": statistics.median(efficiency),
        "scaling_efficiency_runs": efficiency,
        "setup": {
            "model": f"DCGAN 32x32x1, widths 32, batch 64 (global), norm {args.norm}",
            "total_threads": args.threads,
            "kimg": args.kimg,
            "backend": "gloo",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__,
        },
    }
    print(f"\n| world size | threads each | images/s (median of {args.runs}) |")
    print("|---:|---:|---:|")
    for world in (1, 2):
        print(
            f"| {world} | {max(1, args.threads // world)} "
            f"| {result['images_per_s'][f'world_{world}']:,.0f} |"
        )
    print(f"\nscaling efficiency (same cores): {result['scaling_efficiency_median']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
