"""The portable CPU mode takes effect: the bits do not depend on what ISA the environment
allows, and a run of other numerics is not resumed, silently or otherwise."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ganpipe import cpu, runtime
from ganpipe.checkpoint import load
from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import DataParams, parse_params
from stages import train as train_stage
from tests.helpers import stage_env, write_project

#: A tiny model trained for 10 steps: a few seconds per run.
TINY = {
    "seed": 2,
    "data": {"image_size": 16, "val_fraction": 0.5},
    "devices": {"cpu_threads": 2},
    "model": {"z_dim": 8, "g_width": 8, "d_width": 8},
    "train": {
        "batch_size": 32,
        "kimg": 0.32,
        "snapshot_kimg": 1,
        "log_every_kimg": 0.16,
        "metrics_kimg": 0,  # FID while training needs a feature network: test_train_metrics
    },
    "generate": {"grid_rows": 2},
}
#: What a hostile environment sets: lower ISAs for oneDNN and ATen, another MKL branch.
CAPPED = {
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "AVX2",
    "MKL_DYNAMIC": "TRUE",
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    prepare_dataset(DataParams(image_size=16, val_fraction=0.5), 2, out, progress=False)
    return out


def train(root: Path, env: dict[str, str]) -> tuple[dict[str, str], str]:
    """Run the train stage in ``root`` with exactly the numerics variables of ``env``;
    return the sha256 of each model file's tensors, and what the stage printed."""
    clean = {k: v for k, v in stage_env().items() if k not in cpu.NUMERICS_ENV}
    result = subprocess.run(
        [sys.executable, "-m", "stages.train"],
        cwd=root,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    digests = {}
    for name in ("generator", "discriminator", "g_ema"):
        h = hashlib.sha256()
        for key, tensor in load(root / "models" / f"{name}.pt")["state_dict"].items():
            h.update(key.encode() + tensor.contiguous().numpy().tobytes())
        digests[name] = h.hexdigest()
    return digests, result.stderr


def intel_cpu() -> bool:
    """Whether this processor is Intel's (MKL honours an ISA branch of MKL_CBWR only there)."""
    return "GenuineIntel" in Path("/proc/cpuinfo").read_text()


@pytest.mark.slow
def test_portable_bits_ignore_the_environment_native_bits_do_not(tmp_path, data_dir):
    portable = {"determinism": {"cpu_isa": "portable"}}
    native = {"determinism": {"cpu_isa": "native"}}
    plain, _ = train(write_project(tmp_path / "p1", TINY, data_dir, **portable), {})
    capped, _ = train(write_project(tmp_path / "p2", TINY, data_dir, **portable), CAPPED)
    assert capped == plain  # the pins override whatever the environment asks for
    record = json.loads((tmp_path / "p2/measurements/train/machine.json").read_text())
    assert record["numerics"]["aten_cpu_capability"] == "AVX2"
    assert record["numerics"]["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert record["numerics"]["mkl_cbwr"] == "COMPATIBLE"

    fast, _ = train(write_project(tmp_path / "n1", TINY, data_dir, **native), {})
    sse, _ = train(write_project(tmp_path / "n2", TINY, data_dir, **native), CAPPED)
    assert sse != fast  # native takes what the environment allows: the pin is what holds
    record = json.loads((tmp_path / "n2/measurements/train/machine.json").read_text())
    # recorded as MKL runs it: the AVX2 branch asked for on an Intel CPU; elsewhere MKL runs
    # its ISA-specific branches as AUTO (on an AMD EPYC: MKL_CBWR=AVX2 reads back AUTO)
    assert record["numerics"]["env"]["MKL_CBWR"] == "AVX2"
    assert record["numerics"]["mkl_cbwr"] == ("AVX2" if intel_cpu() else "AUTO")
    assert record["numerics"]["aten_cpu_capability"] == "DEFAULT"

    # The native run's checkpoints are not resumed in the portable mode: it says so, trains
    # from the start, and ends with the portable bits.
    again, err = train(write_project(tmp_path / "n1", TINY, data_dir, **portable), {})
    assert "holds a run of these same params made with other CPU/GPU numerics" in err, err
    assert "cpu_isa: 'native' -> 'portable'" in err
    assert again == plain


def test_a_run_of_other_numerics_is_named_not_resumed(tmp_path, monkeypatch, caplog):
    """In-process: the same params under numerics recorded by another machine."""
    monkeypatch.chdir(tmp_path)
    params = parse_params(TINY)
    runtime.apply_cpu_numerics(params.determinism)
    mine = runtime.numerics_record(params.determinism, params.devices, torch.device("cpu"))
    elsewhere = {**mine, "torch": "2.13.0", "aten_cpu_capability": "AVX512"}
    old_dir, old = train_stage.checkpoint_dir(params, "d" * 64, elsewhere)
    (old_dir / "ckpt-000000000320.pt").write_bytes(b"a checkpoint")
    with caplog.at_level(logging.INFO):
        run_dir, fingerprint = train_stage.checkpoint_dir(params, "d" * 64, mine)
    assert run_dir != old_dir and fingerprint != old
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"checkpoints/{old_dir.name} holds a run of these same params" in warning
    assert "aten_cpu_capability: 'AVX512' -> 'AVX2'" in warning
    assert "torch: '2.13.0' -> " in warning
    caplog.clear()
    other_params = parse_params({**TINY, "seed": 9})  # another run: nothing to say
    with caplog.at_level(logging.INFO):
        train_stage.checkpoint_dir(other_params, "d" * 64, mine)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(os.listdir(old_dir)) == ["ckpt-000000000320.pt", "run.json"]  # left alone


#: Put first on a stage's PYTHONPATH: this machine's CPU reads as one without AVX2.
OLD_CPU = """
import ganpipe.cpu
ganpipe.cpu.cpu_info = lambda *args: {"arch": "x86_64", "model": "Old Xeon", "flags": ["avx"]}
"""


def test_a_stage_on_a_cpu_without_avx2_stops_with_the_fix(tmp_path, data_dir):
    (tmp_path / "site").mkdir()
    (tmp_path / "site/sitecustomize.py").write_text(OLD_CPU)
    root = write_project(tmp_path / "p", TINY, data_dir)
    env = stage_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
    for stage in ("train", "featurenet", "generate", "evaluate"):
        result = subprocess.run(
            [sys.executable, "-m", f"stages.{stage}"], cwd=root, env=env, capture_output=True
        )
        err = result.stderr.decode()
        assert result.returncode == 2, (stage, err[-2000:])
        assert err.startswith(
            "error: determinism.cpu_isa=portable needs a CPU with avx2 and fma, but this one "
            "(Old Xeon) lacks avx2, fma; set determinism.cpu_isa: native"
        ), (stage, err)
        assert "Traceback" not in err
    native = write_project(tmp_path / "n", TINY, data_dir, determinism={"cpu_isa": "native"})
    result = subprocess.run(
        [sys.executable, "-m", "stages.train"], cwd=native, env=env, capture_output=True
    )
    assert result.returncode == 0, result.stderr.decode()[-2000:]  # native runs anywhere
