"""CUDA checks (marked gpu: skipped without CUDA; run them whenever a GPU is lent)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from ganpipe import loop, runtime
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import DataParams, parse_params

pytestmark = pytest.mark.gpu

RAW = {
    "seed": 2,
    "data": {"image_size": 32},
    "devices": {"accelerator": "cuda"},
    "model": {"g_width": 16, "d_width": 16},
    "train": {"batch_size": 32, "kimg": 0.64, "log_every_kimg": 0.32},
}


def digest(result) -> str:
    h = hashlib.sha256()
    for net in (result.g, result.d, result.g_ema):
        for name, tensor in net.state_dict().items():
            h.update(name.encode() + tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["d_first_retain", "d_first_detach", "g_first_detach"])
def test_cuda_training_is_deterministic(tmp_path, strategy, precision):
    prepare_dataset(DataParams(), 0, tmp_path, progress=False)
    raw = json.loads(json.dumps(RAW))
    raw["train"]["strategy"], raw["precision"] = strategy, precision
    params = parse_params(raw)
    digests = []
    for _ in range(2):
        runtime.configure_runtime(params.seed, params.devices, params.determinism)
        device = runtime.resolve_device(params.devices)
        assert device.type == "cuda"
        result = loop.train(
            params, LmdbImageDataset(tmp_path / "train.lmdb", as_uint8=True), device, progress=False
        )
        digests.append(digest(result))
    assert digests[0] == digests[1]
    assert torch.cuda.max_memory_allocated() > 0


def run_stage(root, **sections):
    from tests.helpers import stage_env, write_project

    write_project(root, RAW, **sections)
    return subprocess.run(
        [sys.executable, "-m", "stages.train"],
        cwd=root,
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_single_gpu_stage(tmp_path, precision):
    prepare_dataset(DataParams(), 0, tmp_path / "data", progress=False)
    result = run_stage(tmp_path, precision=precision)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "models/g_ema.pt").exists()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("norm", ["batch", "sync_batch"])
def test_nccl_two_gpus_is_deterministic(tmp_path, norm):
    digests = []
    for name in ("a", "b"):
        root = tmp_path / name
        prepare_dataset(DataParams(), 0, root / "data", progress=False)
        result = run_stage(
            root,
            precision="bf16",
            model={"norm": norm},
            devices={"nproc_per_node": 2, "backend": "nccl", "gpus": [0, 1]},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert "rank 1/2 joined (nccl on cuda:1)" in result.stderr
        digests.append(hashlib.sha256((root / "models/g_ema.pt").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


NORM_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from ganpipe import build, dist
    from ganpipe.params import parse_params

    raw, counts = json.loads(sys.argv[1]), {}
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    params = parse_params(raw)
    context = dist.setup(
        params.devices, rank, int(os.environ["LOCAL_RANK"]), world, torch.device("cuda")
    )
    for norm in ("batch", "sync_batch"):
        raw["model"]["norm"] = norm
        gan, _ = build.build_gan(parse_params(raw), context)
        for name, net in (("g", gan.g), ("d", gan.d)):
            modules = list(dist.unwrap(net).modules())
            counts[f"{norm}/{name}"] = {
                "ddp": net is not dist.unwrap(net),
                "sync": sum(isinstance(m, torch.nn.SyncBatchNorm) for m in modules),
                "batch": sum(type(m) is torch.nn.BatchNorm2d for m in modules),
            }
    dist.teardown(context)
    if rank == 0:
        print(json.dumps(counts))
    """
)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sync_batch_wraps_syncbatchnorm_and_batch_does_not(tmp_path):
    """Under DDP, norm sync_batch has every BatchNorm of norm batch as SyncBatchNorm."""
    from tests.helpers import stage_env

    script = tmp_path / "worker.py"
    script.write_text(NORM_WORKER)
    raw = json.loads(json.dumps(RAW))
    raw["devices"].update({"nproc_per_node": 2, "backend": "nccl", "gpus": [0, 1]})
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    out = subprocess.run(
        [*launcher, str(script), json.dumps(raw)],
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(out.stdout.splitlines()[-1])
    # 32 pixels: three BatchNorms in G, two in D (no norm on D's first layer)
    for name, num in (("g", 3), ("d", 2)):
        assert counts[f"batch/{name}"] == {"ddp": True, "sync": 0, "batch": num}
        assert counts[f"sync_batch/{name}"] == {"ddp": True, "sync": num, "batch": 0}
