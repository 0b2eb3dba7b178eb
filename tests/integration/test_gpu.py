"""CUDA checks (marked gpu: skipped without CUDA; run them whenever a GPU is lent)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ganpipe import loop, runtime
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import DataParams, parse_params
from tests.helpers import free_port, graph_features, stage_env, start_stage, write_project

pytestmark = pytest.mark.gpu
# as the train stage does: cuBLAS reads it when CUDA first uses it (deterministic matmuls)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

RAW = {
    "seed": 2,
    "data": {"image_size": 32},
    "devices": {"accelerator": "cuda"},
    "model": {"g_width": 16, "d_width": 16},
    "train": {"batch_size": 32, "kimg": 0.64, "log_every_kimg": 0.32, "metrics_kimg": 0},
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


def two_nodes_on_one_gpu(root, data, **sections):
    """The multi-node recipe of docs/distributed.md on one GPU: two stages on loopback, one
    process each (devices.nnodes 2), both on cuda:0, gloo between them.

    Returns (the folder of the node that got global rank 0, its stderr, the other's stderr):
    the c10d rendezvous numbers the nodes in the order they arrive, not by node_rank.
    """
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = []
    for rank in (0, 1):
        devices = {
            "nnodes": 2,
            "node_rank": rank,
            "nproc_per_node": 1,
            "rdzv_endpoint": endpoint,
            "backend": "gloo",
            "timeout_s": 120,
        }
        node = write_project(root / f"node{rank}", RAW, data, **sections, devices=devices)
        nodes.append((node, start_stage(node)))
    errs = {}
    for node, proc in nodes:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        errs[node] = err
    first = [node for node, err in errs.items() if "rank 0/2 joined (gloo on cuda:0)" in err]
    other = [node for node, err in errs.items() if "rank 1/2 joined (gloo on cuda:0)" in err]
    assert len(first) == len(other) == 1, list(errs.values())
    return first[0], errs[first[0]], errs[other[0]]


@pytest.mark.parametrize(("precision", "norm"), [("bf16", "batch"), ("fp16", "instance")])
def test_ddp_on_cuda_two_ranks_sharing_one_gpu_over_gloo(tmp_path, precision, norm):
    """DDP on CUDA tensors where one GPU is all there is (NCCL needs a GPU per rank): two
    ranks on cuda:0 joined by gloo train, rank 0 alone writes, and a rerun gives the same
    bytes. batch: cuDNN's BatchNorm under DDP (the buffers once broke its backward); fp16:
    the GradScalers' found_inf all-reduced on the GPU."""
    prepare_dataset(DataParams(), 0, tmp_path / "data", progress=False)
    sections = {"precision": precision, "model": {"norm": norm}}
    digests = []
    for name in ("a", "b"):
        main, main_err, _ = two_nodes_on_one_gpu(tmp_path / name, tmp_path / "data", **sections)
        assert "training step: eager (DDP" in main_err, main_err[-3000:]  # not captured
        assert [p.parent.name for p in (tmp_path / name).glob("*/models")] == [main.name]
        digests.append(hashlib.sha256((main / "models/g_ema.pt").read_bytes()).hexdigest())
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


# --- the training step replayed from a CUDA graph (ganpipe.graphed) ------------------------

GRAPH_FEATURES = {**graph_features(16), "sgd": {"train": {"optimizer": "sgd"}}}


def graph_params(strategy: str, precision: str, feature: str, cuda_graph: bool, kimg: float):
    raw = json.loads(json.dumps(RAW))
    for section, values in GRAPH_FEATURES[feature].items():
        raw.setdefault(section, {}).update(values)
    raw["train"].update(strategy=strategy, cuda_graph=cuda_graph, kimg=kimg)
    raw["precision"] = precision
    return parse_params(raw)


def train_on_gpu(params, data, caplog, **kwargs):
    """loop.train on CUDA; also whether the step was captured."""
    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    device = runtime.resolve_device(params.devices)
    caplog.clear()
    with caplog.at_level("INFO", logger="ganpipe.graphed"):
        result = loop.train(
            params,
            LmdbImageDataset(data / "train.lmdb", as_uint8=True),
            device,
            progress=False,
            **kwargs,
        )
    return result, "training step captured in a CUDA graph" in caplog.text


STRATEGY_NAMES = ("d_first_retain", "d_first_detach", "g_first_detach")
GRAPH_CASES = [  # every strategy x precision; each feature once, R1 + ADA under fp16 too
    *[("plain", s, p) for s in STRATEGY_NAMES for p in ("fp32", "bf16", "fp16")],
    *[(f, "d_first_detach", "bf16") for f in GRAPH_FEATURES if f != "plain"],
    ("r1_augment_ada", "g_first_detach", "fp16"),
    ("wgan_gp_n_critic_accum", "d_first_retain", "fp32"),
]


@pytest.mark.parametrize(("feature", "strategy", "precision"), GRAPH_CASES)
def test_graphed_step_equals_eager(tmp_path, caplog, feature, strategy, precision):
    """Replays after capture give the bytes of the eager run (13 replayed iterations)."""
    prepare_dataset(DataParams(), 0, tmp_path, progress=False)
    per_iteration = 32 * GRAPH_FEATURES[feature].get("train", {}).get("n_critic", 1)
    kimg = 24 * per_iteration / 1000  # 11 eager iterations, a capture, 12 replays
    digests = {}
    for cuda_graph in (False, True):
        params = graph_params(strategy, precision, feature, cuda_graph, kimg)
        result, captured = train_on_gpu(params, tmp_path, caplog)
        assert captured == cuda_graph
        digests[cuda_graph] = digest(result)
    assert digests[True] == digests[False]


def test_a_failed_capture_is_logged_and_training_goes_on_eagerly_with_the_same_bits(
    tmp_path, caplog, monkeypatch
):
    prepare_dataset(DataParams(), 0, tmp_path, progress=False)
    kimg = 24 * 32 / 1000
    eager, _ = train_on_gpu(
        graph_params("d_first_detach", "fp32", "plain", False, kimg), tmp_path, caplog
    )
    strategy = loop.STRATEGIES["d_first_detach"]

    def host_sync_when_captured(gan, batches):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted while capturing: the capture fails
        return strategy(gan, batches)

    monkeypatch.setitem(loop.STRATEGIES, "d_first_detach", host_sync_when_captured)
    params = graph_params("d_first_detach", "fp32", "plain", True, kimg)
    fallen_back, captured = train_on_gpu(params, tmp_path, caplog)
    assert not captured
    assert "failed; training on eagerly" in caplog.text
    assert digest(fallen_back) == digest(eager)


def test_graphed_step_resumes_exactly(tmp_path, caplog):
    """Stopped after capture and resumed (eager again for 11 iterations, then a new
    capture of the restored state) equals a run never stopped."""
    prepare_dataset(DataParams(), 0, tmp_path, progress=False)
    params = graph_params("d_first_retain", "fp16", "plain", True, 40 * 32 / 1000)
    whole, captured = train_on_gpu(params, tmp_path, caplog)
    assert captured
    polls = {"n": 0}

    def stop_at_15() -> bool:
        polls["n"] += 1
        return polls["n"] == 15

    run_dir = tmp_path / "run"
    with pytest.raises(loop.TrainingInterrupted):
        train_on_gpu(params, tmp_path, caplog, run_dir=run_dir, should_stop=stop_at_15)
    resumed, captured = train_on_gpu(params, tmp_path, caplog, run_dir=run_dir)
    assert captured  # 15 + 11 eager, then replays up to 40
    assert digest(resumed) == digest(whole)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_graphed_iterations_never_wait_for_the_host(tmp_path, precision):
    """The data stream, eager warm-up, capture and replays, ADA and EMA under sync-debug
    "error": any host sync in an iteration (an .item(), a copy from pageable memory,
    GradScaler's get_scale) raises."""
    from ganpipe import graphed
    from ganpipe.build import adaptive_p, build_gan
    from ganpipe.dist import DistContext
    from ganpipe.strategies import STRATEGIES
    from ganpipe.stream import Stream

    prepare_dataset(DataParams(), 0, tmp_path, progress=False)
    params = graph_params("d_first_retain", precision, "r1_augment_ada", True, 1.0)
    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    context = DistContext(device=torch.device("cuda"))
    gan, g_ema = build_gan(params, context)
    ada = adaptive_p(params, gan, context)
    step = graphed.iteration(STRATEGIES["d_first_retain"], gan, params, context)
    iterations = graphed.WARMUP + 4
    dataset = LmdbImageDataset(tmp_path / "train.lmdb", as_uint8=True)
    stream = Stream(params, dataset, context, 0, iterations)  # reads the set to the GPU
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for it in range(iterations):
            stats = step(stream.next(it))
            ada.update(stats["d/real_sign"], context.all_sum)
            g_ema.update(gan.g, params.train.batch_size)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert step.captured
    assert torch.isfinite(stats["loss/d"]).item()
