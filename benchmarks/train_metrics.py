"""Cost of FID/KID while training: the default train stage with and without train.metrics_kimg.

Prepares the built-in digits and trains the feature network as the pipeline does (the
stages, with this repository's params.yaml), then runs the train stage from scratch with
the params as they are (metrics every ``train.metrics_kimg``) and with ``train.metrics_kimg:
0``, alternating, each in a fresh process without checkpoints. Reports the median wall
time of each, the overhead ``(with - without) / without`` and the time the measurements
themselves took (the sum of the ``measured in ... s`` log lines) as a share of the run.
The issue's budget is 10% of the train stage's time.

    python -m benchmarks.train_metrics [--runs 2] [--kimg 100] [--params params.yaml]

Writes benchmarks/results/train_metrics.json.
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
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "train_metrics.json"


def stage(root: Path, name: str) -> tuple[float, str]:
    """Run ``python -m stages.NAME`` in ``root``; (wall seconds, its stderr)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    began = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", f"stages.{name}"], cwd=root, env=env, capture_output=True, text=True
    )
    took = time.perf_counter() - began
    if result.returncode != 0:
        raise SystemExit(f"stages.{name} failed:\n{result.stderr[-3000:]}")
    return took, result.stderr


def train(root: Path, params: dict, metrics_kimg: float) -> tuple[float, float, int]:
    """One train stage from scratch: (wall s, seconds spent measuring, points measured)."""
    params = json.loads(json.dumps(params))
    params["train"]["metrics_kimg"] = metrics_kimg
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.rmtree(root / "checkpoints", ignore_errors=True)
    wall, log = stage(root, "train")
    spent = [float(s) for s in re.findall(r"measured in ([0-9.]+) s", log)]
    return wall, sum(spent), len(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--kimg", type=float, default=None, help="train.kimg (default: params)")
    parser.add_argument("--params", type=Path, default=REPO / "params.yaml")
    args = parser.parse_args()
    params = yaml.safe_load(args.params.read_text())
    if args.kimg is not None:
        params["train"]["kimg"] = args.kimg
    every = params["train"]["metrics_kimg"]
    assert every > 0, "params.yaml has train.metrics_kimg 0: nothing to measure"
    runs: dict[str, list] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        stage(root, "prepare")
        stage(root, "featurenet")
        train(root, params, every)  # fills the real-feature cache, as evaluate would have
        for i in range(args.runs):
            for name, kimg in (("with", every), ("without", 0)):
                wall, spent, points = train(root, params, kimg)
                runs[name].append({"wall_s": wall, "measuring_s": spent, "points": points})
                print(f"run {i + 1} {name} metrics: {wall:.1f} s ({points} points, {spent:.1f} s)")
    with_s = statistics.median(r["wall_s"] for r in runs["with"])
    without_s = statistics.median(r["wall_s"] for r in runs["without"])
    measuring_s = statistics.median(r["measuring_s"] for r in runs["with"])
    summary = {
        "train_with_metrics_s": with_s,
        "train_without_metrics_s": without_s,
        "overhead": (with_s - without_s) / without_s,
        "measuring_share": measuring_s / with_s,
        "points": runs["with"][0]["points"],
    }
    print(
        f"\ntrain stage: {with_s:.1f} s with metrics every {every} kimg, {without_s:.1f} s "
        f"without: overhead {100 * summary['overhead']:.1f}% (measuring "
        f"{100 * summary['measuring_share']:.1f}% of the run, {summary['points']} points)"
    )
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "train_metrics",
                "setup": f"{args.params.name}, train.kimg {params['train']['kimg']}, "
                f"metrics_kimg {every}, metrics_num_samples "
                f"{params['train']['metrics_num_samples']}",
                "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                "torch": torch.__version__,
                "runs": runs,
                "results": summary,
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
