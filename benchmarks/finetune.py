"""Fine-tuning benchmark: does a model trained on digits 0–4, fine-tuned on digits 5–9
(``train.init_from``), reach a given FID in fewer kimg than training on 5–9 from scratch?

Two image folders are made from scikit-learn's digits (the 8x8 images as PNGs, one
sub-folder per class): 0–4 and 5–9. Each run is the real prepare and train stages
(``data.source: folder``) in a directory of its own, the default model and params otherwise:

- ``pretrain``: digits 0–4 for ``--pretrain-kimg``;
- ``finetune``: digits 5–9 for ``--kimg``, from pretrain's three model files (copied to
  ``init/digits04``, ``train.init_from: init/digits04``);
- ``scratch``: digits 5–9 for ``--kimg`` from random weights.

Both 5–9 runs keep a checkpoint every ``--every`` kimg. FID of 2,000 samples of the EMA
generator of each checkpoint (and of the pretrained model itself, fine-tune's kimg 0) is
measured in one fixed feature space: the feature network of the small-data benchmark
(trained by the featurenet stage on the full digits, seed 0) against the features of every
digit 5–9 of the full set (:func:`benchmarks.smalldata.reference`). Reported per seed: FID by
kimg of both runs, and the kimg at which each first reaches each threshold (``--thresholds``;
by default the scratch run's final FID, and 1.5 and 2 times it).

    python -m benchmarks.finetune [--seeds 0 1 2] [--pretrain-kimg 200] [--kimg 200]
        [--every 10] [--thresholds ...] [--jobs 2 --threads 1]
        [--results benchmarks/results/finetune.json]
    python -m benchmarks.finetune --table        # the results as markdown

With ``--jobs 2`` the scratch run trains beside the pretrain → fine-tune chain of the same
seed. Results are written after every seed (a partial file is a usable partial result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from PIL import Image

from benchmarks.smalldata import (
    add_run_arguments,
    curve,
    measure,
    reference,
    short_commit,
    stage,
)
from ganpipe.checkpoint import MODEL_FILES
from ganpipe.data.sources import list_digits
from ganpipe.modelfile import read_generator

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "finetune.json"
PRETRAIN, TARGET = range(0, 5), range(5, 10)
INIT = "init/digits04"


def digit_folder(root: Path, classes: range) -> Path:
    """The digits of ``classes`` as 8x8 PNGs in one sub-folder per class, under ``root``."""
    listing = list_digits()
    for index, (label, pixels) in enumerate(zip(listing.labels, listing.payloads, strict=True)):
        if label in classes:
            folder = root / str(label)
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(folder / f"{index:04d}.png")
    return root


def run(root: Path, folder: Path, seed: int, kimg: float, every: float, threads: int, **train):
    """Prepare ``folder`` and train on it in ``root``, a checkpoint every ``every`` kimg
    (all kept); the wall time in seconds."""
    params = {
        "seed": seed,
        "data": {"source": "folder", "path": str(folder)},
        "determinism": {"cpu_isa": "native"},
        "devices": {"cpu_threads": threads},
        "train": {
            "metrics_kimg": 0,  # this benchmark measures what it needs itself
            "kimg": kimg,
            "checkpoint_kimg": every,
            "keep_checkpoints": int(kimg // every) + 2,
            "snapshot_kimg": every,
            **train,
        },
    }
    began = time.perf_counter()
    stage(root, "prepare", params)
    stage(root, "train", params)
    return time.perf_counter() - began


def reached(fids: dict[str, float], threshold: float) -> float | None:
    """The first kimg at which FID is at most ``threshold`` (None: never)."""
    for kimg, fid in sorted(fids.items(), key=lambda item: float(item[0])):
        if fid <= threshold:
            return float(kimg)
    return None


def summary(runs: list[dict]) -> dict:
    """Per seed and threshold, the kimg each 5–9 run needed; how many seeds fine-tuning won."""
    out = {"per_seed": {}, "finetune_faster_on": 0, "pairs": 0}
    for seed in sorted({r["seed"] for r in runs}):
        ours = {r["run"]: r for r in runs if r["seed"] == seed}
        if not {"finetune", "scratch"} <= ours.keys():
            continue
        thresholds = ours["scratch"]["thresholds"]
        rows = {}
        for t in thresholds:
            pair = {name: reached(ours[name]["fid_by_kimg"], t) for name in ("finetune", "scratch")}
            rows[f"{t:.4g}"] = pair
            out["pairs"] += 1
            if pair["finetune"] is not None and (
                pair["scratch"] is None or pair["finetune"] < pair["scratch"]
            ):
                out["finetune_faster_on"] += 1
        out["per_seed"][str(seed)] = rows
    return out


def table(result: dict) -> str:
    """Markdown: per seed, the kimg each run needed to reach each threshold, then FID by kimg."""
    lines = ["| seed | FID threshold | fine-tune kimg | scratch kimg |", "|---:|---:|---:|---:|"]
    for seed, rows in result["summary"]["per_seed"].items():
        for threshold, pair in rows.items():
            cells = [f"{v:g}" if v is not None else "not reached" for v in pair.values()]
            lines.append(f"| {seed} | {threshold} | {cells[0]} | {cells[1]} |")
    runs = [r for r in result["runs"] if r["run"] != "pretrain"]
    points = sorted({k for r in runs for k in r["fid_by_kimg"]}, key=float)
    lines += [
        "",
        "| run | seed | " + " | ".join(f"{float(k):g} kimg" for k in points) + " |",
        "|---|---:|" + "---:|" * len(points),
    ]
    for r in sorted(runs, key=lambda r: (r["seed"], r["run"])):
        fids = " | ".join(
            f"{r['fid_by_kimg'][k]:.3f}" if k in r["fid_by_kimg"] else "" for k in points
        )
        lines.append(f"| {r['run']} | {r['seed']} | {fids} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--pretrain-kimg", type=float, default=200)
    parser.add_argument("--kimg", type=float, default=200, help="length of the 5-9 runs")
    parser.add_argument("--every", type=float, default=10, help="FID interval, kimg")
    parser.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        help="FIDs to reach (default: the scratch run's final FID, 1.5 and 2 times it)",
    )
    add_run_arguments(parser, RESULTS)
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.results.read_text())))
        return
    torch.set_num_threads(args.threads)
    commit = short_commit()
    runs: list[dict] = []

    with tempfile.TemporaryDirectory() as tmp_name, ThreadPoolExecutor(args.jobs) as pool:
        tmp = Path(tmp_name)
        (tmp / "reference").mkdir()
        extractor, real = reference(tmp / "reference", TARGET)
        source, target = (
            digit_folder(tmp / "digits04", PRETRAIN),
            digit_folder(tmp / "digits59", TARGET),
        )

        def scratch(seed: int) -> dict:
            root = tmp / f"scratch-{seed}"
            root.mkdir()
            wall = run(root, target, seed, args.kimg, args.every, args.threads)
            final, fids = curve(root, extractor, real)
            return {"run": "scratch", "seed": seed, **final, "fid_by_kimg": fids, "wall_s": wall}

        def fine_tune(seed: int) -> list[dict]:
            pre = tmp / f"pretrain-{seed}"
            pre.mkdir()
            wall = run(pre, source, seed, args.pretrain_kimg, args.pretrain_kimg, args.threads)
            root = tmp / f"finetune-{seed}"
            (root / INIT).mkdir(parents=True)
            for name in MODEL_FILES.values():
                shutil.copy(pre / "models" / name, root / INIT / name)
            generator = read_generator(root / INIT / "g_ema.pt")
            start = measure(generator.net, generator.model.z_dim, extractor, real)["fid"]
            tuned = run(root, target, seed, args.kimg, args.every, args.threads, init_from=INIT)
            final, fids = curve(root, extractor, real)
            return [
                {"run": "pretrain", "seed": seed, "kimg": args.pretrain_kimg, "wall_s": wall},
                {
                    "run": "finetune",
                    "seed": seed,
                    **final,
                    "fid_by_kimg": {"0": start, **fids},
                    "wall_s": tuned,
                },
            ]

        for seed in args.seeds:
            jobs = pool.submit(scratch, seed), pool.submit(fine_tune, seed)
            from_scratch, (pretrained, tuned) = (job.result() for job in jobs)
            last = from_scratch["fid"]
            from_scratch["thresholds"] = args.thresholds or [last, 1.5 * last, 2 * last]
            runs += [pretrained, tuned, from_scratch]
            result = {
                "what": "DCGAN (default model) on the digits 5-9 (about 900 images, a 90% "
                "train split): fine-tuned from a model trained on the digits 0-4 "
                "(train.init_from) vs from scratch; FID of 2,000 EMA samples against every "
                "digit 5-9 in one feature network trained on the full digits",
                "commit": commit,
                "date": time.strftime("%Y-%m-%d"),
                "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, CPU",
                "params": {
                    "pretrain kimg": args.pretrain_kimg,
                    "train.kimg": args.kimg,
                    "FID every kimg": args.every,
                    "determinism.cpu_isa": "native",
                    "devices.cpu_threads": args.threads,
                    "jobs": args.jobs,
                },
                "summary": summary(runs),
                "runs": runs,
            }
            args.results.write_text(json.dumps(result, indent=2) + "\n")
            print(table(result), flush=True)


if __name__ == "__main__":
    main()
