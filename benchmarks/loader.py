"""Loader benchmark: images/s through a DataLoader for LMDB vs PNG ImageFolder vs memory.

All read the same images (32x32 RGB, made here, smooth like photos rather than noise) and
deliver float batches in [-1, 1] with labels to the consuming loop:

- ``lmdb``: the pipeline's way. Workers read uint8 batches (``as_uint8=True``), the loop
  converts each batch (as the training loop does, on the device);
- ``lmdb_float``: the same dataset converting to float inside the workers;
- ``imagefolder``: torchvision ImageFolder over PNG files, ToTensor + Normalize in workers;
- ``memory``: a uint8 tensor in RAM, handled like ``lmdb`` (the upper bound);
- ``lmdb_in_process``: ``lmdb`` with no worker processes (``train.num_workers: 0``, the
  default), for comparison: on 2 cores the workers' per-batch hand-over costs more than
  reading.

Each run measures all of them side by side; the table reports medians over runs and the
ratios are taken within each run. Also measures the prepare step (PNG folder -> LMDB).

    python -m benchmarks.loader [--num-images 50000] [--runs 5] [--workers 2]

Writes benchmarks/results/loader.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets, transforms
from tqdm import tqdm

from ganpipe.data.dataset import LmdbImageDataset, uint8_to_float
from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import DataParams

RESULTS = Path(__file__).parent / "results" / "loader.json"


class MemoryDataset(Dataset):
    """The reference: a uint8 tensor in RAM."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
        self.labels = torch.from_numpy(labels)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.images[i], int(self.labels[i])


def make_images(root: Path, num_images: int, seed: int = 0) -> None:
    """Smooth random 32x32 RGB PNGs in 10 class folders (bicubic-upsampled 8x8 noise)."""
    rng = np.random.default_rng(seed)
    for i in tqdm(range(num_images), desc="writing PNGs", unit="img", mininterval=1):
        small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
        path = root / f"class{i % 10}" / f"{i:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        small.resize((32, 32), Image.Resampling.BICUBIC).save(path)


def images_per_s(
    dataset: Dataset, convert: bool, workers: int, batch_size: int, seed: int
) -> float:
    """One shuffled epoch through a DataLoader, ending in float batches; images per second."""
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(seed),
        drop_last=False,
    )
    start = time.perf_counter()
    count = 0
    for images, _ in loader:
        if convert:
            images = uint8_to_float(images)
        assert images.dtype == torch.float32
        count += len(images)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-images", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "png"
        make_images(folder, args.num_images)
        # Every image in train: the schema refuses val_fraction 0 for the pipeline (featurenet
        # and evaluate need a val split); prepare_dataset itself writes an empty val split.
        data = DataParams(source="folder", path=str(folder), image_size=32, channels=3)
        data = data.model_copy(update={"val_fraction": 0.0})
        prepare_rates = []
        for run in range(args.runs):
            report = prepare_dataset(data, 0, Path(tmp) / f"lmdb{run}", progress=False)
            prepare_rates.append(report.images_per_s)
        lmdb_path = Path(tmp) / "lmdb0" / "train.lmdb"
        lmdb = LmdbImageDataset(lmdb_path, as_uint8=True)
        memory = MemoryDataset(lmdb.uint8_array(), lmdb.labels())
        normalize = transforms.Compose(
            [transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.5,) * 3)]
        )
        # name: (dataset, batches are uint8 and converted by the loop, worker processes)
        candidates = {
            "lmdb": (lmdb, True, args.workers),
            "lmdb_float": (LmdbImageDataset(lmdb_path), False, args.workers),
            "imagefolder": (
                datasets.ImageFolder(str(folder), transform=normalize),
                False,
                args.workers,
            ),
            "memory": (memory, True, args.workers),
            "lmdb_in_process": (lmdb, True, 0),
        }
        rates: dict[str, list[float]] = {name: [] for name in candidates}
        for run in range(args.runs):
            for name, (dataset, convert, workers) in candidates.items():
                rate = images_per_s(dataset, convert, workers, args.batch_size, run)
                rates[name].append(rate)
                print(f"run {run}: {name:12s} {rates[name][-1]:>10,.0f} images/s", flush=True)

    ratio = {
        "lmdb_vs_imagefolder": [
            a / b for a, b in zip(rates["lmdb"], rates["imagefolder"], strict=True)
        ],
        "lmdb_vs_memory": [a / b for a, b in zip(rates["lmdb"], rates["memory"], strict=True)],
    }
    result = {
        "images_per_s": {name: statistics.median(v) for name, v in rates.items()},
        "runs": rates,
        "ratio_median": {name: statistics.median(v) for name, v in ratio.items()},
        "targets": {"lmdb_vs_imagefolder": 5.0, "lmdb_vs_memory": 0.5},
        "prepare_images_per_s": statistics.median(prepare_rates),
        "prepare_runs": prepare_rates,
        "setup": {
            "num_images": args.num_images,
            "image": "32x32x3",
            "batch_size": args.batch_size,
            "num_workers": args.workers,
            "runs": args.runs,
            "shuffle": True,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
    }
    print()
    print(f"| loader | images/s (median of {args.runs}) | LMDB / this |")
    print("|---|---:|---:|")
    lmdb_rate = result["images_per_s"]["lmdb"]
    for name, rate in result["images_per_s"].items():
        print(f"| {name} | {rate:,.0f} | {lmdb_rate / rate:.2f}x |")
    print(
        f"\nLMDB / ImageFolder: {result['ratio_median']['lmdb_vs_imagefolder']:.2f}x (target >= 5)"
    )
    print(f"LMDB / memory:      {result['ratio_median']['lmdb_vs_memory']:.2f}x (target >= 0.5)")
    print(f"prepare: {result['prepare_images_per_s']:,.0f} images/s on {args.num_images} PNGs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
