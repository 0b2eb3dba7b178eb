"""Small-data benchmark: FID of DCGAN trained on 10% of the digits, with and without
augmentation (``train.augment``, ADA's ``train.augment_target``), over several seeds,
measured in one fixed feature space.

Each run is the real prepare and train stages in a directory of its own (``data.val_fraction
0.9``: about 180 training images, a different 10% per seed since the split derives from
``seed``). Every run is then measured the same way: 2,000 samples of its EMA generator
(``eval.seed`` latents) against **all 1,797 digits**, in the features of one feature network
trained by the featurenet stage on the full data (seed 0, 90% split). The pipeline's own
evaluate would use a feature network trained on each run's 180 images — a weak one whose
FIDs (~0.1) hardly separate settings — so this benchmark does not.

FID is measured along training too, from the EMA generator of checkpoints kept every
``--every`` kimg: where D memorises the small set, FID turns back up without augmentation;
the question is whether augmentation keeps it going down.

Settings: ``none``, ``augment`` (DiffAugment color+translation+cutout at p = 1) and ``ada``
(the same policy, p tuned from 0 towards r_t = 0.6).

    python -m benchmarks.smalldata [--seeds 0 1 2] [--kimg 1000] [--every 100]
        [--settings none augment ada] [--merge]   # --merge: add to the runs on file
        [--jobs 2 --threads 1]                    # two runs at a time, one thread each
        [--results benchmarks/results/smalldata_1000kimg.json]
    python -m benchmarks.smalldata --table        # the results as markdown

Runs alternate between settings, seed by seed; results are written after every run to the
results file (a partial file is a usable partial result). ``--threads`` is
``devices.cpu_threads`` of every run (it changes the bits, not the result's meaning); with
``--jobs 2 --threads 1`` two runs share this 2-core machine about 1.3x faster than one after
the other.
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
import threading
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.utils.data import Subset

from ganpipe import evaluation
from ganpipe.checkpoint import read_checkpoint
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.modelfile import read_generator

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "smalldata_1000kimg.json"
POLICY = "color+translation+cutout"
#: train.* overrides of each setting: none, DiffAugment (p = 1), ADA (p tuned from 0)
SETTINGS = {
    "none": {"augment": "none"},
    "augment": {"augment": POLICY},
    "ada": {"augment": POLICY, "augment_p": 0.0, "augment_target": 0.6},
}
EVAL_SEED, NUM_SAMPLES = 2024, 2000


def stage(root: Path, name: str, params: dict) -> None:
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    # src first: this checkout's ganpipe, where the venv's editable install is another's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-m", f"stages.{name}"], cwd=root, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise RuntimeError(f"stages.{name} failed in {root}:\n{done.stderr[-3000:]}")


def reference(
    root: Path, classes: Collection[int] | None = None
) -> tuple[torch.nn.Module, torch.Tensor]:
    """The fixed feature network (trained on the full digits) and all digits' features, or
    those of the digits of ``classes`` only."""
    params = {"seed": 0, "determinism": {"cpu_isa": "native"}}
    stage(root, "prepare", params)
    stage(root, "featurenet", params)
    extractor = evaluation.load_featurenet(root / "models/featurenet.pt")
    real = []
    for split in ("train", "val"):
        dataset = LmdbImageDataset(root / f"data/{split}.lmdb")
        if classes is not None:
            chosen = np.flatnonzero(np.isin(dataset.labels(), list(classes)))
            dataset = Subset(dataset, chosen.tolist())
        device = torch.device("cpu")
        real.append(
            evaluation.real_features(extractor, dataset, "", 250, device, None, progress=False)
        )
    return extractor, torch.cat(real)


def train(root: Path, seed: int, setting: dict, kimg: float, every: float, threads: int) -> float:
    """Prepare 10% of the digits and train, keeping a checkpoint every ``every`` kimg; the
    wall time in seconds."""
    keep = int(kimg // every) + 1
    params = {
        "seed": seed,
        "data": {"val_fraction": 0.9},
        "determinism": {"cpu_isa": "native"},
        "devices": {"cpu_threads": threads},
        "train": {
            "metrics_kimg": 0,  # this benchmark measures what it needs itself
            "kimg": kimg,
            **setting,
            "checkpoint_kimg": every,
            "keep_checkpoints": keep,
            "snapshot_kimg": every,
        },
    }
    began = time.perf_counter()
    stage(root, "prepare", params)
    stage(root, "train", params)
    return time.perf_counter() - began


def measure(g: torch.nn.Module, z_dim: int, extractor, real: torch.Tensor) -> dict:
    fake = evaluation.generated_features(
        g,
        extractor,
        EVAL_SEED,
        range(NUM_SAMPLES),
        z_dim,
        250,
        torch.device("cpu"),
        progress=False,
    )
    metrics = evaluation.all_metrics(real, fake, 50, 100, 3, EVAL_SEED)
    return {k: metrics[k] for k in ("fid", "kid", "precision", "recall")}


def curve(root: Path, extractor, real: torch.Tensor) -> tuple[dict, dict]:
    """The final model's metrics, and FID per kept checkpoint (kimg -> FID)."""
    generator = read_generator(root / "models/g_ema.pt")
    g, model = generator.net, generator.model
    final = measure(g, model.z_dim, extractor, real)
    fids = {}
    for path in sorted((root / "checkpoints").glob("*/ckpt-*.pt")):
        state = read_checkpoint(path)
        g.load_state_dict({k.removeprefix("module."): v for k, v in state["g_ema"].items()})
        fids[f"{state['images_seen'] / 1000:g}"] = measure(g, model.z_dim, extractor, real)["fid"]
    return final, fids


def logged(root: Path, name: str, at: list[str]) -> dict:
    """A logged train scalar (``d/real_sign``, ``augment/p``) at the kept checkpoints' kimg:
    the last value logged at or before each."""
    path = root / "metrics/train/plots/metrics" / f"{name}.tsv"
    if not path.exists():
        return {}
    rows = [line.split("\t") for line in path.read_text().splitlines()[1:]]
    points = [(int(row[0]), float(row[-1])) for row in rows]
    out = {}
    for kimg in at:
        before = [value for step, value in points if step <= float(kimg) * 1000]
        if before:
            out[kimg] = before[-1]
    return out


def summary(runs: list[dict], chosen: list[str]) -> dict:
    out = {}
    for setting in chosen:
        ours = [r for r in runs if r["setting"] == setting]
        if ours:
            fids = [r["fid"] for r in ours]
            best = [min(r["fid_by_kimg"].values(), default=r["fid"]) for r in ours]
            out[setting] = {
                "fid_mean": statistics.fmean(fids),
                "fid_min": min(fids),
                "fid_max": max(fids),
                "best_along_training_mean": statistics.fmean(best),
                "runs": len(fids),
            }
    pairs = {}
    for r in runs:
        pairs.setdefault(r["seed"], {})[r["setting"]] = r["fid"]
    for setting in chosen:  # each setting against none, over the seeds that ran both
        paired = {s: p for s, p in sorted(pairs.items()) if {setting, "none"} <= p.keys()}
        if setting != "none" and paired:
            ratios = {str(s): p[setting] / p["none"] for s, p in paired.items()}
            out[f"{setting}_vs_none"] = {
                "seeds": len(paired),
                "better_on_seeds": sum(r < 1 for r in ratios.values()),
                "fid_ratio_per_seed": ratios,
            }
    return out


def table(result: dict) -> str:
    """Markdown: FID along training per setting and seed, then the final FIDs."""
    runs = result["runs"]
    points = sorted({k for r in runs for k in r["fid_by_kimg"]}, key=float)
    # the checkpoint a few steps before the final one says nothing new
    points = [
        k
        for k, nxt in zip(points, [*points[1:], None], strict=True)
        if nxt is None or float(nxt) - float(k) > 1
    ]
    lines = [
        "| setting | seed | " + " | ".join(f"{float(k):.0f} kimg" for k in points) + " |",
        "|---|---:|" + "---:|" * len(points),
    ]
    for r in sorted(runs, key=lambda r: (list(SETTINGS).index(r["setting"]), r["seed"])):
        fids = " | ".join(
            f"{r['fid_by_kimg'][k]:.3f}" if k in r["fid_by_kimg"] else "" for k in points
        )
        lines.append(f"| {r['setting']} | {r['seed']} | {fids} |")
    return "\n".join(lines)


def add_run_arguments(parser: argparse.ArgumentParser, results: Path) -> None:
    """``--jobs``, ``--threads``, ``--results`` and ``--table``, as the training benchmarks
    take them."""
    parser.add_argument("--jobs", type=int, default=1, help="runs training at the same time")
    parser.add_argument("--threads", type=int, default=2, help="devices.cpu_threads of each run")
    parser.add_argument("--results", type=Path, default=results, help="the results file")
    parser.add_argument("--table", action="store_true", help="print the results as markdown")


def short_commit() -> str:
    """The checked-out commit, abbreviated, for a results file."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--kimg", type=float, default=1000)
    parser.add_argument("--every", type=float, default=100)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument(
        "--merge", action="store_true", help="add to the runs already in the results file"
    )
    add_run_arguments(parser, RESULTS)
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.results.read_text())))
        return
    torch.set_num_threads(args.threads)
    commit = short_commit()
    runs: list[dict] = json.loads(args.results.read_text())["runs"] if args.merge else []
    chosen = [s for s in SETTINGS if s in args.settings or any(r["setting"] == s for r in runs)]
    saving = threading.Lock()

    def one(tmp: Path, seed: int, setting: str, extractor, real: torch.Tensor) -> None:
        root = tmp / f"{setting}-{seed}"
        root.mkdir()
        wall = train(root, seed, SETTINGS[setting], args.kimg, args.every, args.threads)
        final, fids = curve(root, extractor, real)
        train_keys = {f"train.{k}": v for k, v in SETTINGS[setting].items()}
        run = {"setting": setting, **train_keys, "seed": seed}
        run.update(final, fid_by_kimg=fids, wall_s=round(wall, 1), jobs=args.jobs)
        run["real_sign_by_kimg"] = logged(root, "d/real_sign", list(fids))
        if setting != "none":
            run["p_by_kimg"] = logged(root, "augment/p", list(fids))
        with saving:
            runs.append(run)
            print(json.dumps(run), flush=True)
            result = {
                "what": "DCGAN on 10% of the digits (data.val_fraction 0.9): no augmentation, "
                "DiffAugment color+translation+cutout at p 1, and ADA (the same policy, p "
                "tuned from 0 towards r_t 0.6); FID of 2,000 EMA samples against all 1,797 "
                "digits in one feature network trained on the full data",
                "settings": {k: SETTINGS[k] for k in chosen},
                "commit": commit,
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, CPU",
                "params": {
                    "train.kimg": args.kimg,
                    "checkpoint every kimg": args.every,
                    "determinism.cpu_isa": "native",
                    "devices.cpu_threads": args.threads,
                },
                "summary": summary(runs, chosen),
                "runs": runs,
            }
            args.results.write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "reference"
        ref.mkdir()
        extractor, real = reference(ref)
        order = [(seed, setting) for seed in args.seeds for setting in args.settings]
        with ThreadPoolExecutor(args.jobs) as pool:  # each run trains in its own processes
            for done in [pool.submit(one, Path(tmp), *job, extractor, real) for job in order]:
                done.result()


if __name__ == "__main__":
    main()
