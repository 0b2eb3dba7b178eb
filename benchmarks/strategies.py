"""Strategies benchmark: step time, throughput, peak memory and pass counts per strategy
and precision, and ganpipe's training loop against a classic reference loop.

Part 1 runs each configuration (strategy x precision, plus activation checkpointing) in
its own process, so that the peak resident memory belongs to that configuration alone;
configurations are interleaved run by run and the table shows medians. Part 2 times
ganpipe's ``loop.train`` (determinism and dvclive logging on) against a loop written the
way the PyTorch DCGAN example writes it (64x64 RGB, batch 64, widths 64, D first with
detach, BCE), alternating the two in one process; the ratio is taken within each run.

Part 1b times the three strategies against each other step by step in one process
(64x64x3, widths 64), which shows their differences through this machine's noise.

    python -m benchmarks.strategies [--runs 3] [--steps 30] [--paired-steps 20]
        [--reference-steps 16] [--only strategies|paired|versus] [--arch dcgan|resnet]

Writes benchmarks/results/strategies.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
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

from ganpipe import cpu
from ganpipe.params import DeterminismParams, DevicesParams

#: The benchmark times the fastest CPU path (as its recorded results): the native mode,
#: pinned before torch loads (configure_runtime checks it).
NATIVE = {"cpu_isa": "native"}
cpu.pin(DeterminismParams(**NATIVE), DevicesParams())

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

RESULTS = Path(__file__).parent / "results" / "strategies.json"
STRATEGY_NAMES = ("d_first_retain", "d_first_detach", "g_first_detach")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# --- part 1: one configuration, in a worker process --------------------------------------


def run_config(config: dict) -> dict:
    """Time ``steps`` training steps of one configuration; called in a fresh process."""
    from ganpipe import build, runtime, stream
    from ganpipe.instrument import PassCounter
    from ganpipe.params import parse_params
    from ganpipe.strategies import STRATEGIES, Batch

    size, channels, width = config["size"], 1 if config["size"] == 32 else 3, config["size"]
    model = {"g_width": width, "d_width": width, "norm": "batch"}
    if config.get("arch", "dcgan") == "resnet":  # the default widths per resolution
        model = {"arch": "resnet", "norm": "batch"}
    params = parse_params(
        {
            "seed": 0,
            "precision": config["precision"],
            "data": {"image_size": size, "channels": channels},
            "devices": {"cpu_threads": config["threads"]},
            "determinism": NATIVE,
            "model": model,
            "train": {
                "metrics_kimg": 0,  # this benchmark measures what it needs itself
                "strategy": config["strategy"],
                "batch_size": 64,
                "activation_checkpointing": config["checkpointing"],
            },
        }
    )
    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    device = torch.device("cpu")
    gan, _ = build.build_gan(params, device)
    strategy = STRATEGIES[params.train.strategy]
    gen = torch.Generator().manual_seed(0)
    reals = [torch.rand(64, channels, size, size, generator=gen) * 2 - 1 for _ in range(4)]
    baseline = rss_mb()

    counter = PassCounter(gan.g, gan.d)
    counter.watch_real(reals[0])
    strategy(gan, Batch.many([reals[0]], [stream.latents(0, 0, 64, 100)]))
    passes = dict(counter.counts)
    param_grads = dict(counter.param_grads)

    times = []
    for step in range(config["warmup"] + config["steps"]):
        real = reals[step % len(reals)]
        z = stream.latents(0, step, 64, 100)
        start = time.perf_counter()
        strategy(gan, Batch.many([real], [z]))
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[config["warmup"] :])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    return {
        "step_ms": step_s * 1000,
        "images_per_s": 64 / step_s,
        "peak_rss_over_baseline_mb": peak - baseline,
        "passes": passes,
        "param_grad_computations": param_grads,
    }


def part1(runs: int, steps: int, threads: int, archs=("dcgan", "resnet")) -> list[dict]:
    configs = [
        {"arch": a, "strategy": s, "precision": p, "checkpointing": False, "size": 32}
        for a in archs
        for s in STRATEGY_NAMES
        # fp16 autocast on CPU is ~20x slower for DCGAN; resnet's 5 fp16 steps had not ended
        # after 8 minutes (longer than all its other configurations together): left out
        for p in ("fp32", "bf16", "fp16")
        if not (a == "resnet" and p == "fp16")
    ] + [  # activation memory only stands out of the allocator's noise at 64 px, widths 64
        {
            "arch": "dcgan",
            "strategy": "d_first_detach",
            "precision": "fp32",
            "checkpointing": c,
            "size": 64,
        }
        for c in (False, True)
        if "dcgan" in archs
    ]
    for config in configs:
        # fp16 autocast is ~20x slower on CPU, and 64 px ~20x heavier: fewer steps.
        slow = config["precision"] == "fp16" or config["size"] == 64
        config.update(
            threads=threads, warmup=2 if slow else 5, steps=max(3, steps // 6) if slow else steps
        )
    measured: dict[int, list[dict]] = {i: [] for i in range(len(configs))}
    for run in range(runs):
        for i, config in enumerate(configs):
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.strategies", "--worker", json.dumps(config)],
                capture_output=True,
                text=True,
                check=True,
            )
            measured[i].append(json.loads(out.stdout.splitlines()[-1]))
            m = measured[i][-1]
            print(
                f"run {run}: {config['arch']:6s} {config['strategy']:15s} {config['precision']} "
                f"{config['size']}px "
                f"ckpt={config['checkpointing']!s:5s} {m['step_ms']:8.1f} ms/step "
                f"{m['peak_rss_over_baseline_mb']:6.1f} MB",
                flush=True,
            )
    rows = []
    for i, config in enumerate(configs):
        runs_i = measured[i]
        rows.append(
            {
                **{k: config[k] for k in ("arch", "strategy", "precision", "checkpointing")},
                "size": config["size"],
                "step_ms": statistics.median(r["step_ms"] for r in runs_i),
                "images_per_s": statistics.median(r["images_per_s"] for r in runs_i),
                "peak_rss_over_baseline_mb": statistics.median(
                    r["peak_rss_over_baseline_mb"] for r in runs_i
                ),
                "passes": runs_i[0]["passes"],
                "param_grad_computations": runs_i[0]["param_grad_computations"],
                "runs_step_ms": [r["step_ms"] for r in runs_i],
                "steps": config["steps"],
                "date": time.strftime("%Y-%m-%d"),
            }
        )
    return rows


# --- part 1b: the strategies against each other, step by step in one process ------------


def paired(steps: int, threads: int, warmup: int = 2) -> dict:
    """Step time of each strategy relative to ``d_first_detach``, 64x64x3 DCGAN (widths 64).

    The three strategies take turns step by step in one process (the order rotating every
    step), and each ratio is taken between neighbouring steps: load and drift on this shared
    machine hit the three alike, which separate processes (part 1) cannot promise.
    """
    from ganpipe import build, runtime, stream
    from ganpipe.params import parse_params
    from ganpipe.strategies import STRATEGIES, Batch

    results = {}
    for precision in ("fp32", "bf16"):
        gans = {}
        for name in STRATEGY_NAMES:
            params = parse_params(
                {
                    "seed": 0,
                    "precision": precision,
                    "data": {"image_size": 64, "channels": 3},
                    "devices": {"cpu_threads": threads},
                    "determinism": NATIVE,
                    "model": {"g_width": 64, "d_width": 64, "norm": "batch"},
                    "train": {"metrics_kimg": 0, "strategy": name, "batch_size": 64},
                }
            )
            runtime.configure_runtime(params.seed, params.devices, params.determinism)
            gans[name] = build.build_gan(params, torch.device("cpu"))[0]
        gen = torch.Generator().manual_seed(0)
        reals = [torch.rand(64, 3, 64, 64, generator=gen) * 2 - 1 for _ in range(4)]
        times: dict[str, list[float]] = {name: [] for name in STRATEGY_NAMES}
        for step in range(warmup + steps):
            real, z = reals[step % len(reals)], stream.latents(0, step, 64, 100)
            order = STRATEGY_NAMES[step % 3 :] + STRATEGY_NAMES[: step % 3]
            for name in order:
                start = time.perf_counter()
                STRATEGIES[name](gans[name], Batch.many([real], [z]))
                times[name].append(time.perf_counter() - start)
        base = times["d_first_detach"][warmup:]
        results[precision] = {
            name: {
                "step_ms": 1000 * statistics.median(times[name][warmup:]),
                "ratio_to_d_first_detach": statistics.median(
                    t / b for t, b in zip(times[name][warmup:], base, strict=True)
                ),
            }
            for name in STRATEGY_NAMES
        }
        print(
            f"paired {precision}: "
            + ", ".join(
                f"{n} {r['step_ms']:.0f} ms ({r['ratio_to_d_first_detach']:.3f}x)"
                for n, r in results[precision].items()
            ),
            flush=True,
        )
    return {"steps": steps, "warmup": warmup, "precisions": results}


# --- part 2: ganpipe's loop vs the classic reference loop -------------------------------


class RefGenerator(nn.Module):
    """The DCGAN example's generator (nz=100, ngf=64, nc=3)."""

    def __init__(self, nz: int = 100, ngf: int = 64, nc: int = 3):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 8),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 4),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


class RefDiscriminator(nn.Module):
    """The DCGAN example's discriminator (ndf=64, nc=3), ending in a sigmoid."""

    def __init__(self, ndf: int = 64, nc: int = 3):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 4),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 8),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False),
            nn.Sigmoid(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


def reference_run(dataset, steps: int) -> float:
    """The example's training loop for ``steps`` iterations; returns seconds."""
    start = time.perf_counter()
    device = torch.device("cpu")
    loader = DataLoader(dataset, batch_size=64, shuffle=True, num_workers=0)
    net_g, net_d = RefGenerator().to(device), RefDiscriminator().to(device)
    criterion = nn.BCELoss()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=0.0002, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=0.0002, betas=(0.5, 0.999))
    g_losses, d_losses, done = [], [], 0
    while done < steps:
        for data in loader:
            net_d.zero_grad()
            real = data[0].to(device)
            label = torch.full((real.size(0),), 1.0, dtype=torch.float, device=device)
            output = net_d(real).view(-1)
            err_d_real = criterion(output, label)
            err_d_real.backward()
            noise = torch.randn(real.size(0), 100, 1, 1, device=device)
            fake = net_g(noise)
            label.fill_(0.0)
            output = net_d(fake.detach()).view(-1)
            err_d_fake = criterion(output, label)
            err_d_fake.backward()
            opt_d.step()
            net_g.zero_grad()
            label.fill_(1.0)
            output = net_d(fake).view(-1)
            err_g = criterion(output, label)
            err_g.backward()
            opt_g.step()
            g_losses.append(err_g.item())
            d_losses.append((err_d_real + err_d_fake).item())
            done += 1
            if done == steps:
                break
    return time.perf_counter() - start


def ganpipe_run(db: Path, steps: int, log_dir: Path) -> float:
    """ganpipe's loop.train, determinism and dvclive logging on; returns seconds."""
    from dvclive import Live

    from ganpipe import loop, runtime
    from ganpipe.data.dataset import LmdbImageDataset
    from ganpipe.params import parse_params
    from stages.train import DvcliveLogger

    start = time.perf_counter()
    params = parse_params(
        {
            "seed": 0,
            "data": {"image_size": 64, "channels": 3},
            "devices": {"cpu_threads": torch.get_num_threads()},
            "determinism": NATIVE,
            "model": {"g_width": 64, "d_width": 64},
            "train": {
                "metrics_kimg": 0,  # this benchmark measures what it needs itself
                "batch_size": 64,
                "kimg": steps * 64 / 1000,
                "log_every_kimg": 0.128,
                "snapshot_kimg": 1000,
            },
        }
    )
    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    with Live(str(log_dir), dvcyaml=None, save_dvc_exp=False) as live:
        loop.train(
            params,
            LmdbImageDataset(db, as_uint8=True),
            torch.device("cpu"),
            DvcliveLogger(live),
            progress=False,
        )
    elapsed = time.perf_counter() - start
    torch.use_deterministic_algorithms(False)  # the reference runs as the example does
    return elapsed


def part2(runs: int, steps: int, threads: int) -> dict:
    from ganpipe.data.dataset import LmdbImageDataset
    from ganpipe.data.store import FORMAT, FORMAT_VERSION, LmdbWriter

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "train.lmdb"
        writer = LmdbWriter(db, map_size=1 << 30)
        rng = np.random.default_rng(0)
        for i in range(1024):
            writer.add(i % 10, rng.integers(0, 256, 64 * 64 * 3, dtype=np.uint8).tobytes())
        writer.finish(
            {
                "format": FORMAT,
                "version": FORMAT_VERSION,
                "shape": [64, 64, 3],
                "classes": [str(i) for i in range(10)],
            }
        )
        reference_data = LmdbImageDataset(db)
        ours, ref = [], []
        for run in range(runs):
            ref.append(reference_run(reference_data, steps))
            ours.append(ganpipe_run(db, steps, Path(tmp) / f"live{run}"))
            print(
                f"run {run}: reference {steps / ref[-1]:.2f} it/s, "
                f"ganpipe {steps / ours[-1]:.2f} it/s",
                flush=True,
            )
    ratios = [r / o for o, r in zip(ours, ref, strict=True)]
    return {
        "steps": steps,
        "runs": runs,
        "reference_images_per_s": statistics.median(steps * 64 / t for t in ref),
        "ganpipe_images_per_s": statistics.median(steps * 64 / t for t in ours),
        "throughput_ratio_median": statistics.median(ratios),
        "throughput_ratios": ratios,
        "target": 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reference-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--paired-steps", type=int, default=20)
    parser.add_argument(
        "--only",
        choices=["strategies", "paired", "versus"],
        help="run one part and update that part of the existing results",
    )
    parser.add_argument(
        "--arch",
        choices=["dcgan", "resnet"],
        help="time this family's rows only and keep the other family's from the results",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_config(json.loads(args.worker))))
        return

    previous = json.loads(args.out.read_text()) if args.only and args.out.exists() else {}
    wanted = {args.only} if args.only else {"strategies", "paired", "versus"}
    if "strategies" in wanted and args.arch:
        kept = [
            r for r in previous.get("configurations", []) if r.get("arch", "dcgan") != args.arch
        ]
        rows = kept + part1(args.runs, args.steps, args.threads, (args.arch,))
    elif "strategies" in wanted:
        rows = part1(args.runs, args.steps, args.threads)
    else:
        rows = previous["configurations"]
    if "paired" in wanted:
        torch.set_num_threads(args.threads)
        pairs = paired(args.paired_steps, args.threads)
    else:
        pairs = previous.get("paired")
    if "versus" in wanted:
        versus = part2(args.runs, args.reference_steps, args.threads)
    else:
        versus = previous["versus_reference"]
    print()
    print(
        "| arch | strategy | precision | size | act. ckpt | ms/step | images/s | peak RSS (MB) "
        "| G / D(fake) / D(real) fwd | G / D bwd |"
    )
    print("|---|---|---|---|---|---:|---:|---:|---|---|")
    for r in rows:
        p = r["passes"]
        print(  # rows measured before resnet existed have no arch: dcgan
            f"| {r.get('arch', 'dcgan')} | {r['strategy']} | {r['precision']} | {r['size']} "
            f"| {'yes' if r['checkpointing'] else 'no'} "
            f"| {r['step_ms']:.1f} | {r['images_per_s']:,.0f} "
            f"| {r['peak_rss_over_baseline_mb']:.1f} "
            f"| {p['G']} / {p['D(fake)']} / {p['D(real)']} "
            f"| {p['G backward']} / {p['D backward']} |"
        )
    print(
        f"\nganpipe loop vs classic DCGAN loop (64x64x3, batch 64): "
        f"{versus['throughput_ratio_median']:.2f}x (target >= 1.0), "
        f"{versus['ganpipe_images_per_s']:.1f} vs {versus['reference_images_per_s']:.1f} "
        "images/s"
    )
    if pairs:
        print(
            "\n| strategy | "
            + " | ".join(f"{p} ms/step (÷ d_first_detach)" for p in pairs["precisions"])
            + " |"
        )
        print("|---|" + "---:|" * len(pairs["precisions"]))
        for name in STRATEGY_NAMES:
            cells = [
                f"{r[name]['step_ms']:.0f} ({r[name]['ratio_to_d_first_detach']:.3f}×)"
                for r in pairs["precisions"].values()
            ]
            print(f"| {name} | " + " | ".join(cells) + " |")
    result = {
        "configurations": rows,
        "paired": pairs,
        "versus_reference": versus,
        "setup": {
            "model": "DCGAN 32x32x1 widths 32 or 64x64x3 widths 64, resnet 32x32x1 default "
            "widths, batch 64 (part 1); 64x64x3, widths 64, batch 64 (part 2)",
            "threads": args.threads,
            "runs": "per configuration: runs_step_ms (and steps, date where recorded)",
            "peak_memory": "ru_maxrss minus RSS before the first step, per process",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "torch": torch.__version__,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
