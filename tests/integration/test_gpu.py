"""CUDA checks (marked gpu: skipped without CUDA; run them whenever a GPU is lent)."""

from __future__ import annotations

import hashlib
import json

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
    import subprocess
    import sys

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
