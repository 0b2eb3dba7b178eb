"""GPU speed of the training step (issue 12): ganpipe's loop against a plain PyTorch loop.

One process, one GPU, the same data and networks: DCGAN at 64 px (widths 64, z 100, BCE,
d_first_detach) on 2,700 real 64x64 RGB photos (crops of scikit-learn's two sample photos,
:mod:`benchmarks.photos`; nothing is downloaded), deterministic algorithms on.

- ``ganpipe``: :func:`ganpipe.loop.train` itself (the resident training set, its logging,
  EMA, statistics), eager (``train.cuda_graph: false``) and graphed (``true``). Speed is
  its own log's ``perf/images_per_s`` over the log intervals after the first (which holds
  the warm-up and the capture), median.
- ganpipe's other strategies and features (:data:`VARIANTS`: fp16, accumulation, R1, WGAN-GP
  with n_critic 5, augmentation with ADA) at the first batch size, eager and graphed.
- ``plain``: the PyTorch DCGAN example's step on the same networks: eager with a
  DataLoader (2 workers, pinned memory), and hand-tuned: data resident on the GPU, fused
  capturable Adam, channels_last, the whole D + G step captured in one CUDA graph. Timed
  with CUDA events, median of blocks of iterations.

    python -m benchmarks.gpu [--batches 64 512] [--precisions fp32 bf16]
    python -m benchmarks.gpu --device cpu --quick   # a smoke run of the script on CPU

Prints a table (images/s, ms/step, peak GPU memory) and writes benchmarks/results/gpu.json
with the GPU's name and the torch version. The target: ganpipe graphed within 1.3x of the
hand-tuned step, and >= 20,000 images/s at batch 64 fp32, >= 25,000 bf16, >= 60,000 at 512 bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from ganpipe import cpu
from ganpipe.params import DeterminismParams, DevicesParams

#: the default CPU numerics, pinned before torch loads (only the CPU smoke run uses them)
cpu.pin(DeterminismParams(), DevicesParams())
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # as the train stage does

import torch  # noqa: E402

from benchmarks.gpu_table import RESULTS, table  # noqa: E402
from benchmarks.photos import write_folder  # noqa: E402
from ganpipe import loop, nets, runtime  # noqa: E402
from ganpipe.data.dataset import LmdbImageDataset, uint8_to_float  # noqa: E402
from ganpipe.data.prepare import prepare_dataset  # noqa: E402
from ganpipe.params import DataParams, ModelParams, parse_params  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def photos(root: Path, count: int, size: int) -> Path:
    """``count`` real photos at ``size`` px in an LMDB training set (val: 1%)."""
    write_folder(root / "photos", count, size=size)
    data = DataParams(
        source="folder", path=str(root / "photos"), image_size=size, channels=3, val_fraction=0.01
    )
    prepare_dataset(data, 0, root / "data", progress=False)
    return root / "data" / "train.lmdb"


class _Speeds:
    """A TrainLogger keeping the loop's own speed and memory records."""

    def __init__(self):
        self.records: list[dict[str, float]] = []

    def log_scalars(self, images_seen: int, scalars: dict[str, float]) -> None:
        self.records.append(scalars)

    def log_grid(self, images_seen: int, grid) -> None:
        pass


#: ganpipe's other configurations on the fast path (batch 64, bf16 unless named): rows of
#: their own, eager and graphed
VARIANTS = {
    "d_first_retain": {"train": {"strategy": "d_first_retain"}},
    "g_first_detach": {"train": {"strategy": "g_first_detach"}},
    "fp16": {"precision": "fp16"},
    "grad_accum 4": {"train": {"grad_accum": 4}},
    "R1 (instance norm)": {"model": {"norm": "instance"}, "train": {"r1_gamma": 1.0}},
    "wgan_gp n_critic 5 (layer norm)": {
        "model": {"norm": "layer"},
        "train": {"loss": "wgan_gp", "n_critic": 5},
    },
    "augment + ADA": {
        "train": {"augment": "color+translation+cutout", "augment_p": 0.0, "augment_target": 0.6}
    },
}


def ganpipe_row(
    lmdb: Path,
    device: str,
    batch: int,
    precision: str,
    graph: bool,
    steps: int,
    widths: int,
    variant: dict | None = None,
) -> dict:
    per_log = max(steps // 6, 1)
    raw = {
        "seed": 0,
        "precision": precision,
        "data": {"image_size": 64, "channels": 3},
        "devices": {"accelerator": device},
        "model": {"g_width": widths, "d_width": widths, "z_dim": 100},
        "train": {
            "batch_size": batch,
            "kimg": steps * batch / 1000,
            "log_every_kimg": per_log * batch / 1000,
            "snapshot_kimg": 1e6,
            "ema_kimg": 5,
            "cuda_graph": graph,
        },
    }
    for key, value in (variant or {}).items():
        if isinstance(value, dict):
            raw[key].update(value)
        else:
            raw[key] = value
    n_critic = raw["train"].get("n_critic", 1)
    raw["train"]["kimg"] *= n_critic
    raw["train"]["log_every_kimg"] *= n_critic
    params = parse_params(raw)
    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    where = runtime.resolve_device(params.devices)
    if where.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    speeds = _Speeds()
    loop.train(params, LmdbImageDataset(lmdb, as_uint8=True), where, speeds, progress=False)
    timed = speeds.records[1:] or speeds.records
    return {
        "images_per_s": statistics.median(r["perf/images_per_s"] for r in timed),
        "ms_per_step": statistics.median(r["perf/step_ms"] for r in timed),
        "peak_memory_mb": max(r["perf/peak_memory_mb"] for r in speeds.records),
    }


def plain_row(
    lmdb: Path, device: str, batch: int, precision: str, graph: bool, steps: int, widths: int
) -> dict:
    """The example's step on ganpipe's DCGAN: eager with a DataLoader, or hand-tuned."""
    dev = torch.device(device)
    torch.manual_seed(0)
    model = ModelParams(g_width=widths, d_width=widths, z_dim=100)
    g, d = nets.build_models(model, 64, 3, torch.Generator().manual_seed(0), False)
    g, d = g.to(dev), d.to(dev)
    if graph:
        g, d = g.to(memory_format=torch.channels_last), d.to(memory_format=torch.channels_last)
    fused = {"fused": True, "capturable": True} if dev.type == "cuda" else {}
    opt_g = torch.optim.Adam(g.parameters(), 2e-4, betas=(0.5, 0.999), **fused)
    opt_d = torch.optim.Adam(d.parameters(), 2e-4, betas=(0.5, 0.999), **fused)
    bce = torch.nn.BCEWithLogitsLoss()
    dtype = DTYPES[precision]

    def autocast():
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(dev.type, dtype=dtype)

    dataset = LmdbImageDataset(lmdb, as_uint8=True)
    if graph:  # the whole set on the device, gathered by a static index buffer
        images = torch.stack([dataset[i][0] for i in range(len(dataset))]).to(dev)
        index = torch.zeros(batch, dtype=torch.int64, device=dev)
        z = torch.zeros(batch, 100, device=dev)

        def inputs():
            return uint8_to_float(images.index_select(0, index)), z
    else:
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=batch,
            shuffle=True,
            drop_last=True,
            num_workers=2,
            pin_memory=dev.type == "cuda",
            persistent_workers=True,
        )
        batches = iter(())

    ones = torch.ones(batch, device=dev)
    zeros = torch.zeros(batch, device=dev)

    def step(real, noise):
        opt_d.zero_grad(set_to_none=True)
        with autocast():
            fake = g(noise)
            loss_d = bce(d(real).flatten(), ones) + bce(d(fake.detach()).flatten(), zeros)
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad(set_to_none=True)
        with autocast():
            loss_g = bce(d(fake).flatten(), ones)
        loss_g.backward()
        opt_g.step()
        return loss_d.detach(), loss_g.detach()

    gen = torch.Generator().manual_seed(1)

    def refill():
        nonlocal batches
        if graph:
            index.copy_(torch.randint(len(dataset), (batch,), generator=gen), non_blocking=True)
            z.copy_(torch.randn(batch, 100, generator=gen), non_blocking=True)
            return None
        try:
            real, _ = next(batches)
        except StopIteration:
            batches = iter(loader)
            real, _ = next(batches)
        real = uint8_to_float(real.to(dev, non_blocking=True))
        return real, torch.randn(batch, 100, generator=gen).to(dev, non_blocking=True)

    warm, graph_obj = 11, None
    if graph and dev.type == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warm):
                refill()
                step(*inputs())
        torch.cuda.current_stream().wait_stream(side)
        graph_obj = torch.cuda.CUDAGraph()
        opt_d.zero_grad(set_to_none=True)
        opt_g.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph_obj):
            step(*inputs())

    def one():
        fresh = refill()
        if graph_obj is not None:
            graph_obj.replay()
        else:
            step(*(fresh if fresh is not None else inputs()))

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warm):
        one()
    block = max(steps // 6, 1)
    times = []
    for _ in range(6):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(block):
                one()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / block)
        else:
            began = time.perf_counter()
            for _ in range(block):
                one()
            times.append(1000 * (time.perf_counter() - began) / block)
    ms = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else float("nan")
    return {"images_per_s": batch * 1000 / ms, "ms_per_step": ms, "peak_memory_mb": peak}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--precisions", nargs="+", choices=list(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=300, help="iterations per row")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the script runs")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument(
        "--no-variants", action="store_true", help="skip the other strategies and features"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs a CUDA GPU (--device cpu --quick: a smoke run)")
    count, widths = (2700, 64) if not args.quick else (40, 4)
    batches = args.batches if not args.quick else [8]
    steps = args.steps if not args.quick else 12
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        lmdb = photos(Path(tmp), count, 64)
        for batch in batches:
            for precision in args.precisions:
                for program, row in (("ganpipe", ganpipe_row), ("plain", plain_row)):
                    for graph in (False, True):
                        measured = row(lmdb, args.device, batch, precision, graph, steps, widths)
                        rows.append(
                            {
                                "program": program,
                                "step": "graph" if graph else "eager",
                                "batch": batch,
                                "precision": precision,
                                **measured,
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
        if not args.no_variants:
            for name, variant in VARIANTS.items():
                precision = variant.get("precision", "bf16" if not args.quick else "fp32")
                for graph in (False, True):
                    measured = ganpipe_row(
                        lmdb, args.device, batches[0], precision, graph, steps, widths, variant
                    )
                    rows.append(
                        {
                            "program": f"ganpipe, {name}",
                            "step": "graph" if graph else "eager",
                            "batch": batches[0],
                            "precision": precision,
                            **measured,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "none (CPU smoke run)"
    result = {
        "what": "DCGAN 64 px, widths 64, z 100, BCE, d_first_detach, 2,700 photos; ganpipe's "
        "loop (its log's images/s) and the example's step (CUDA events), eager and graphed",
        "gpu": gpu,
        "torch": str(torch.__version__),
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
        "steps_per_row": steps,
        "rows": rows,
    }
    if not args.quick:
        args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return result


if __name__ == "__main__":
    main()
