"""DDP on CPU with gloo, through real torchrun processes launched by the train stage."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ganpipe.checkpoint import load
from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import DataParams, parse_params
from tests import helpers
from tests.helpers import (
    TINY_RESNET,
    descendants,
    free_port,
    stage_env,
    start_stage,
    tiny_params,
    updated,
    write_project,
)

pytestmark = pytest.mark.slow

TINY = tiny_params(
    seed=3,
    devices={"timeout_s": 30},
    model={"norm": "instance"},
    train={
        "kimg": 0.32,
        "log_every_kimg": 0.016,
        "snapshot_kimg": 1,
        "optimizer": "sgd",
        "lr_g": 0.01,
        "lr_d": 0.01,
        # metrics_kimg 0: FID while training needs a feature network (see below)
    },
)


#: The resnet family at its smallest size (32 px), a few channels per resolution; G with a
#: per-sample norm (as TINY), D with spectral norm (as always for resnet).
RESNET = {"data": {"image_size": 32}, "model": TINY_RESNET}


#: Largest weight difference that float32 summation order explains (two ranks' all-reduce
#: vs one process). resnet's residual additions and sum pooling make larger sums (measured
#: ~1.2e-6 after 20 steps); a structural difference shows far above it (a spectral norm
#: iterating per micro-batch: ~6e-3).
FLOAT_NOISE = {"dcgan": 1e-6, "resnet": 1e-5}


@pytest.fixture(scope="module")
def data16(tmp_path_factory) -> Path:
    """The digits at 16 px with split seed 3, not the shared ``digits16`` (split seed 4): the
    bounds of FLOAT_NOISE were measured on this split, and on that one the case
    d_first_detach-2-none-dcgan differs by about 1e-4."""
    out = tmp_path_factory.mktemp("data16")
    prepare_dataset(DataParams(image_size=16, val_fraction=0.5), 3, out, progress=False)
    return out


@pytest.fixture(scope="module")
def data32(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data32")
    prepare_dataset(DataParams(image_size=32, val_fraction=0.5), 3, out, progress=False)
    return out


def project(root: Path, data_dir: Path, **sections) -> Path:
    return write_project(root, TINY, data_dir, **sections)


def env() -> dict[str, str]:
    return stage_env()


def train(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stages.train"],
        cwd=root,
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


#: The cases of test_two_processes_equal_one_process_with_the_whole_batch: strategy,
#: grad_accum, augment policy, architecture.
CASES = [
    *[
        (strategy, accum, "none", arch)
        for arch in ("dcgan", "resnet")
        for strategy, accum in (
            ("d_first_retain", 1),
            ("d_first_detach", 1),
            ("g_first_detach", 1),
            ("d_first_detach", 2),
        )
    ],
    # each rank augments its share of the global batch with that share's draws, and
    # ADA's p moves by the signs counted over both ranks
    ("g_first_detach", 2, "color+translation+cutout", "resnet"),
]


def case_runs(strategy: str, accum: int, policy: str, arch: str) -> tuple[str, dict, dict]:
    """The data (``data16`` or ``data32``) and the sections of a case's one-process run and
    of its two-process run. One process does not depend on ``accum``: the cases that differ
    by it alone share its run."""
    family = RESNET if arch == "resnet" else {}
    model = {**TINY["model"], **family.get("model", {})}
    sections = {"data": family.get("data", {}), "model": model}
    augmented = {"augment": policy}
    if policy != "none":
        augmented.update(augment_p=0.5, augment_target=0.6, augment_speed_kimg=1)
    one = {"train": {"strategy": strategy, **augmented}, **sections}
    two = {
        "train": {"strategy": strategy, "grad_accum": accum, **augmented},
        "devices": {"nproc_per_node": 2},
        **sections,
    }
    return ("data32" if arch == "resnet" else "data16"), one, two


#: train.xflip with gradient accumulation (test_mirrored_two_processes_equal_one_process).
MIRRORED = {"strategy": "d_first_detach", "n_critic": 2, "xflip": True}

#: FID/KID while training at every 0.16 kimg (2 points) on few samples, in a small feature
#: network.
MEASURED = {
    "train": {"metrics_kimg": 0.16, "metrics_num_samples": 64},
    "featurenet": {"width": 8, "epochs": 1},
    "eval": {"num_samples": 64, "kid_subsets": 5, "kid_subset_size": 32, "batch_size": 32},
}

TWO = {"nproc_per_node": 2}

#: Every run that ``trained`` makes: (data, sections).
RUNS = [
    *[(data, s) for data, one, two in (case_runs(*c) for c in CASES) for s in (one, two)],
    ("data16", {"train": MIRRORED}),
    ("data16", {"train": {**MIRRORED, "grad_accum": 2}, "devices": TWO}),
    ("data16", {"train": {**MIRRORED, "xflip": False}}),
    ("data16", MEASURED),
    ("data16", {"devices": TWO, **MEASURED}),
    ("data16", {"devices": TWO, "model": {"norm": "batch"}}),  # one of two bit-identical runs
]


def run_key(data: Path, sections: dict) -> str:
    """What identifies a run: its data and its validated params."""
    config = parse_params(updated(TINY, sections)).model_dump(mode="json")
    return json.dumps([str(data), config], sort_keys=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data16, data32):
    """``trained(data, **sections)``: the folder of a project of TINY with ``sections`` where
    the train stage ran (one of :data:`RUNS`), and what it logged; tests only read it.

    Every run trains on first use, in two launches instead of one per run
    (tests.integration.train_projects): the one-process runs one after another in one
    process, the two-process runs in one torchrun of two ranks. The runs that measure FID
    while training start with the models/ of one featurenet stage.
    """
    datas = {"data16": data16, "data32": data32}
    projects: dict[str, Path] = {}
    launches: dict[int, list[Path]] = {}  # world size -> projects
    measuring = []
    for data, sections in RUNS:
        key = run_key(datas[data], sections)
        if key not in projects:
            root = project(tmp_path_factory.mktemp("run") / "p", datas[data], **sections)
            projects[key] = root
            params = parse_params(updated(TINY, sections))
            launches.setdefault(params.devices.world_size, []).append(root)
            if params.train.metrics_kimg > 0:
                measuring.append(root)
    if measuring:
        featurenet = helpers.run_stage(measuring[0], "featurenet")
        assert featurenet.returncode == 0, featurenet.stderr[-3000:]
        for root in measuring[1:]:
            shutil.copytree(measuring[0] / "models", root / "models")
    for size, roots in sorted(launches.items()):
        torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={size}"]
        result = subprocess.run(
            [sys.executable, *(torchrun if size > 1 else []), "-m",
             "tests.integration.train_projects", *map(str, roots)],
            env={**env(), "OMP_NUM_THREADS": str(TINY["devices"]["cpu_threads"])},
            capture_output=True,
            text=True,
            timeout=600,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]

    def run(data: Path, /, **sections) -> tuple[Path, str]:
        root = projects[run_key(data, sections)]
        return root, "".join(log.read_text() for log in sorted(root.glob("stage-rank*.log")))

    return run


def states(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {
        n: load(root / "models" / f"{n}.pt")["state_dict"]
        for n in ("generator", "discriminator", "g_ema")
    }


def max_difference(a, b) -> float:
    return max((a[n][k].double() - b[n][k].double()).abs().max().item() for n in a for k in a[n])


@pytest.mark.xdist_group("ddp_runs")  # one worker trains every run once (trained)
@pytest.mark.parametrize(("strategy", "accum", "policy", "arch"), CASES)
def test_two_processes_equal_one_process_with_the_whole_batch(
    trained, data16, data32, strategy, accum, policy, arch
):
    """resnet: spectral norm's power iteration depends on D's weights only, which DDP keeps
    equal on every rank, so D's σ is one process's too."""
    data, one_sections, two_sections = case_runs(strategy, accum, policy, arch)
    data = {"data16": data16, "data32": data32}[data]
    one, one_log = trained(data, **one_sections)
    two, two_log = trained(data, **two_sections)
    logs = [one_log, two_log]
    assert "rank 1/2 joined (gloo on cpu)" in logs[1]
    assert max_difference(states(one), states(two)) < FLOAT_NOISE[arch]
    # logged losses are means over ranks: the same curve within float noise
    curves = [
        (root / "metrics/train/plots/metrics/loss/d.tsv").read_text().splitlines()[1:]
        for root in (one, two)
    ]
    for row_one, row_two in zip(*curves, strict=True):
        assert abs(float(row_one.split("\t")[1]) - float(row_two.split("\t")[1])) < 1e-5
    if policy != "none":  # the same p at every record, to the bit
        p_tsv = "metrics/train/plots/metrics/augment/p.tsv"
        ps = [(root / p_tsv).read_text() for root in (one, two)]
        values = {line.split("\t")[1] for line in ps[0].splitlines()[1:]}
        assert ps[0] == ps[1] and len(values) > 1, ps


@pytest.mark.xdist_group("ddp_runs")
def test_mirrored_two_processes_equal_one_process(trained, data16):
    """train.xflip: each rank mirrors its share of the global batch where that batch's
    flips say, so two processes (with gradient accumulation) train as one does, and
    differently from the same run unmirrored."""
    one, _ = trained(data16, train=MIRRORED)
    two, _ = trained(data16, train={**MIRRORED, "grad_accum": 2}, devices=TWO)
    plain, _ = trained(data16, train={**MIRRORED, "xflip": False})
    assert max_difference(states(one), states(two)) < FLOAT_NOISE["dcgan"]
    assert max_difference(states(one), states(plain)) > 100 * FLOAT_NOISE["dcgan"]


@pytest.mark.xdist_group("ddp_runs")
def test_fid_while_training_under_two_processes_equals_one_process(trained, data16):
    """Rank 0 measures while rank 1 waits: the curve, the best point and its snapshot are
    one process's (the weights agree within float noise, so the values do too)."""
    one, _ = trained(data16, **MEASURED)
    two, _ = trained(data16, devices=TWO, **MEASURED)
    records = [json.loads((root / "metrics/train/metrics.json").read_text()) for root in (one, two)]
    for name in ("fid", "kid"):
        tsv = f"metrics/train/plots/metrics/metrics/{name}.tsv"
        rows = [
            [line.split("\t") for line in (r / tsv).read_text().splitlines()[1:]]
            for r in (one, two)
        ]
        assert [row[0] for row in rows[0]] == [row[0] for row in rows[1]] == ["160", "320"]
        for row_one, row_two in zip(*rows, strict=True):
            assert float(row_two[1]) == pytest.approx(float(row_one[1]), rel=1e-6, abs=1e-9)
    assert records[0]["best"]["kimg"] == records[1]["best"]["kimg"]
    bests = [load(root / "models/g_ema_best.pt")["state_dict"] for root in (one, two)]
    assert max_difference({"best": bests[0]}, {"best": bests[1]}) < FLOAT_NOISE["dcgan"]


@pytest.mark.xdist_group("ddp_runs")
def test_two_process_runs_are_bit_identical(tmp_path, trained, data16):
    """Run a is one of the torchrun of ``trained``, run b the stage's own launch."""
    sections = {"devices": TWO, "model": {"norm": "batch"}}
    a, _ = trained(data16, **sections)
    b = project(tmp_path / "b", data16, **sections)
    assert train(b).returncode == 0
    runs = [
        (root / "models" / n).read_bytes()
        for root in (a, b)
        for n in ("g_ema.pt", "discriminator.pt")
    ]
    assert runs[0] == runs[2] and runs[1] == runs[3]


ALLREDUCE_WORKER = """
import itertools, json, torch, torch.distributed as dist
from ganpipe import build
from ganpipe.dist import DistContext, unwrap, wrap
from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import DataParams, parse_params
from ganpipe.strategies import STRATEGIES, Batch

dist.init_process_group("gloo")
rank = dist.get_rank()
context = DistContext(rank, rank, 2, torch.device("cpu"))
counts, differences = {}, {}
MODELS = {
    "dcgan": ({"z_dim": 8, "g_width": 4, "d_width": 4, "norm": "instance"}, 16),
    "resnet": ({"arch": "resnet", "z_dim": 8, "g_channels": {4: 8, 8: 8, 16: 4, 32: 4},
                "d_channels": {4: 8, 8: 4, 16: 4}, "norm": "instance"}, 32),
}
for (arch, (model, size)), accum, name in itertools.product(MODELS.items(), (1, 2), STRATEGIES):
        key = name if arch == "dcgan" else f"{arch}/{name}"
        params = parse_params({"model": model,
                               "data": {"image_size": size},
                               "train": {"batch_size": 16, "grad_accum": accum,
                                         "optimizer": "sgd", "lr_g": 0.01, "lr_d": 0.01}})
        gan, _ = build.build_gan(params, context)
        whole, _ = build.build_gan(params.model_copy(update={"train": params.train.model_copy(
            update={"grad_accum": 1})}), torch.device("cpu"))  # one process, whole batch
        calls = {"G": 0, "D": 0}
        def counting(net):
            def hook(state, bucket):
                calls[net] += 1
                work = dist.all_reduce(bucket.buffer().div_(2), async_op=True)
                return work.get_future().then(lambda f: f.value()[0])
            return hook
        gan.g.register_comm_hook(None, counting("G"))
        gan.d.register_comm_hook(None, counting("D"))
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            real = torch.rand(16, 1, size, size, generator=gen)
            z = torch.randn(16, 8, generator=gen)
            mine = slice(8 * rank, 8 * rank + 8)
            STRATEGIES[name](gan, Batch.many([real[mine]], [z[mine]]))
            STRATEGIES[name](whole, Batch.many([real], [z]))
        counts[f"{key}/{accum}"] = dict(calls)
        differences[f"{key}/{accum}"] = max(
            (a - b).abs().max().item()
            for net, ref in ((gan.g, whole.g), (gan.d, whole.d))
            for a, b in zip(unwrap(net).parameters(), ref.parameters(), strict=True)
        )
if rank == 0:
    print("COUNTS " + json.dumps(counts))
    print("DIFFERENCES " + json.dumps(differences))

class Scaled(torch.nn.Module):  # its backward reads a buffer, as cuDNN's BatchNorm does
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("scale", torch.full((3,), 2.0 + rank))  # rank 0's must win
        self.register_buffer("seen", torch.zeros(()))  # a running statistic, rank-local

    def forward(self, x):
        self.seen.add_(1 + rank)
        return (x * self.weight * self.scale).sum()

net = wrap(Scaled(), context, sync_batch_norm=False)
(net(torch.ones(3)) + net(torch.ones(3))).backward()  # two forwards (reals, fakes), one backward
scaled = unwrap(net)
mine = [scaled.scale.tolist(), scaled.seen.item(), scaled.weight.grad.tolist()]
gathered = [None, None]
dist.all_gather_object(gathered, mine)
if rank == 0:
    print("BUFFERS " + json.dumps(gathered))
dist.destroy_process_group()
"""


def test_frozen_network_triggers_no_all_reduce_and_accumulation_syncs_once(tmp_path):
    """Per step: one all-reduce for G and one for D (one bucket each), for every strategy,
    with or without gradient accumulation.

    A frozen network that synchronised anyway would show two for D (its pass in G's phase);
    accumulation without ``no_sync`` would show one per micro-batch. The same run checks
    that 2 ranks x 2 micro-batches update exactly like one process with the whole batch.
    """
    script = tmp_path / "worker.py"
    script.write_text(ALLREDUCE_WORKER)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(script),
        ],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(x.split(" ", 1) for x in result.stdout.splitlines() if " " in x)
    counts, differences = json.loads(lines["COUNTS"]), json.loads(lines["DIFFERENCES"])
    names = ("d_first_retain", "d_first_detach", "g_first_detach")
    names += tuple(f"resnet/{n}" for n in names)
    assert counts == {f"{n}/{a}": {"G": 3, "D": 3} for n in names for a in (1, 2)}
    assert all(
        diff < FLOAT_NOISE["resnet" if key.startswith("resnet/") else "dcgan"]
        for key, diff in differences.items()
    ), differences
    # The buffers start as rank 0's and are not broadcast again before each forward (rank
    # 1 keeps its own running statistic): with torch 2.11 on CUDA that broadcast overwrote,
    # in place, a buffer the first forward's backward reads (BatchNorm's running statistics).
    rank0, rank1 = json.loads(lines["BUFFERS"])
    assert rank0 == [[2.0] * 3, 2.0, [4.0] * 3] and rank1 == [[2.0] * 3, 4.0, [4.0] * 3]


@pytest.mark.xdist_group("ddp_runs")
def test_two_nodes_on_loopback_equal_one_node(tmp_path, trained, data16):
    """The multi-node recipe of docs/distributed.md: same params on each node but node_rank.
    One node with two processes: the run of the case d_first_detach-1-none-dcgan above."""
    single, _ = trained(data16, devices={"nproc_per_node": 2})
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for rank in (0, 1):
        root = project(
            tmp_path / f"node{rank}",
            data16,
            devices={
                "nnodes": 2,
                "node_rank": rank,
                "nproc_per_node": 1,
                "rdzv_endpoint": endpoint,
            },
        )
        nodes.append(
            (
                root,
                start_stage(root),
            )
        )
    for _root, proc in nodes:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
    written = [root for root, _ in nodes if (root / "models/g_ema.pt").exists()]
    assert len(written) == 1  # global rank 0 alone writes
    assert max_difference(states(single), states(written[0])) == 0.0


def rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def test_a_killed_rank_fails_the_stage_fast_and_writes_nothing(tmp_path, data16):
    root = project(
        tmp_path / "kill",
        data16,
        devices={"nproc_per_node": 2, "timeout_s": 20},
        train={"kimg": 200},
    )
    start = time.monotonic()
    proc = start_stage(root)
    victim = None
    while victim is None and time.monotonic() - start < 120:
        time.sleep(0.5)
        if (root / "metrics/train/metrics.json").exists():  # training has started
            victim = next((p for p in descendants(proc.pid) if rank_of(p) == 1), None)
    assert victim is not None, "rank 1 never started"
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    _, err = proc.communicate(timeout=20 + 30)
    assert proc.returncode != 0
    assert time.monotonic() - killed < 20 + 30
    assert "rank: 1" in err or "rank 1" in err, err[-3000:]
    assert "distributed train failed" in err
    assert not (root / "models").exists() or not list((root / "models").iterdir())


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_sigkilled_launcher_takes_torchrun_and_every_rank_with_it(tmp_path, data16):
    root = project(tmp_path / "orphans", data16, devices={"nproc_per_node": 2}, train={"kimg": 200})
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.train"],
        cwd=root,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    start, ranks = time.monotonic(), []
    while len(ranks) < 2 and time.monotonic() - start < 120:
        time.sleep(0.5)
        if (root / "metrics/train/metrics.json").exists():  # both ranks are training
            tree = descendants(proc.pid)
            ranks = [p for p in tree if rank_of(p) is not None]
    assert len(ranks) == 2, "the ranks never started"
    tree = descendants(proc.pid)  # torchrun and the two ranks
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    while any(alive(p) for p in tree) and time.monotonic() - killed < 10:
        time.sleep(0.2)
    left = [p for p in tree if alive(p)]
    for pid in left:  # never leave them training on the test machine
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running 10 s after the launcher's SIGKILL: {left}"


def test_more_processes_than_cores_are_refused_before_launch(tmp_path, data16):
    cores = len(os.sched_getaffinity(0))
    root = project(
        tmp_path / "many",
        data16,
        devices={"nproc_per_node": cores + 1},
        train={"batch_size": 8 * (cores + 1)},  # divisible: the launch is what is refused
    )
    result = train(root)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"devices.nproc_per_node={cores + 1} processes on CPU" in result.stderr
    assert "devices.oversubscribe: true" in result.stderr
    assert "Traceback" not in result.stderr and "torch.distributed.run" not in result.stderr
    assert not (root / "checkpoints").exists() or not list((root / "checkpoints").iterdir())


def test_cuda_request_without_cuda_fails_before_launch(tmp_path, data16):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    root = project(tmp_path / "cuda", data16, devices={"accelerator": "cuda", "nproc_per_node": 2})
    result = train(root)
    assert result.returncode == 2
    assert "CUDA is not available" in result.stderr
    assert "torch.distributed.run" not in result.stderr
