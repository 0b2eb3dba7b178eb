"""The train and generate stages on tiny data, in-process and in separate processes."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from ganpipe.checkpoint import load
from ganpipe.params import load_params
from stages import generate as generate_stage
from stages import train as train_stage
from tests.helpers import stage_env, tiny_params, write_project

TINY = tiny_params(
    seed=3,
    train={"kimg": 0.16, "snapshot_kimg": 0.08, "ema_kimg": 0.05},
    generate={"grid_rows": 3},
)


def make_project(path: Path, data: Path, **overrides) -> Path:
    """A folder with a tiny params.yaml and ``data`` linked (read-only)."""
    return write_project(path, TINY, data, **overrides)


def state_digest(path: Path) -> str:
    """sha256 over the tensors of a model file (names and bytes, in order)."""
    digest = hashlib.sha256()
    for name, tensor in load(path)["state_dict"].items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_train_then_generate_in_process(tmp_path, digits16, monkeypatch):
    project = make_project(tmp_path / "p", digits16)
    monkeypatch.chdir(project)
    params = load_params()
    train_stage.main(params)
    for name in ("generator", "discriminator", "g_ema"):
        record = load(project / "models" / f"{name}.pt")
        assert record["image_size"] == 16 and record["channels"] == 1
        assert record["numerics"]["cpu_isa"] == "portable" and record["numerics"]["mkldnn"] is False
    metrics = json.loads((project / "metrics/train/metrics.json").read_text())
    assert set(metrics["loss"]) == {"d", "g"} and metrics["step"] == 160
    assert np.isfinite(metrics["loss"]["d"])
    # measured, not computed: outside the stage's outputs, where the plots and flows read it
    assert "perf" not in metrics and not (project / "metrics/train/plots/metrics/perf").exists()
    measured = json.loads((project / "measurements/train/metrics.json").read_text())
    assert set(measured["perf"]) == {"images_per_s", "step_ms", "peak_memory_mb"}
    assert (project / "measurements/train/plots/metrics/perf/step_ms.tsv").is_file()
    machine = json.loads((project / "measurements/train/machine.json").read_text())
    assert machine["numerics"]["aten_cpu_capability"] == "AVX2"
    assert machine["machine"]["cpu"]["arch"] and machine["machine"]["torch"] == torch.__version__
    progress = sorted((project / "metrics/train/plots/images/progress").iterdir())
    assert [p.name for p in progress] == ["000000080.png", "000000160.png"]
    tsv = (project / "metrics/train/plots/metrics/loss/g.tsv").read_text().splitlines()
    assert tsv[0].split("\t")[0] == "step" and len(tsv) == 1 + 5

    generate_stage.main(params)
    grid = Image.open(project / "samples" / "grid.png")
    assert grid.size == (3 * 18 + 2, 3 * 18 + 2)
    # the EMA differs from G (half-life 50 images over 160) but not wildly
    g = load(project / "models/generator.pt")["state_dict"]
    ema = load(project / "models/g_ema.pt")["state_dict"]
    key = "main.0.0.weight"
    assert not torch.equal(g[key], ema[key])


def test_training_is_bit_identical_across_processes(tmp_path, digits16):
    digests = []
    for run in ("a", "b"):
        project = make_project(tmp_path / run, digits16)
        env = stage_env()
        subprocess.run(
            [sys.executable, "-m", "stages.train"],
            cwd=project,
            env=env,
            check=True,
            capture_output=True,
        )
        digests.append(
            {
                n: state_digest(project / "models" / f"{n}.pt")
                for n in ("generator", "discriminator", "g_ema")
            }
        )
        digests[-1]["file"] = hashlib.sha256((project / "models/g_ema.pt").read_bytes()).hexdigest()
    assert digests[0] == digests[1]


def test_strategies_d_first_detach_differs_retain_equals_g_first(tmp_path, digits16, monkeypatch):
    """d_first_retain and g_first_detach make the same weight updates (both gradients against
    the pre-update D, D on the pre-update G's fakes); g_first_detach runs D(fake) once more,
    which only shows in BatchNorm's running statistics. d_first_detach is another algorithm.
    """
    g, d = {}, {}
    for strategy in ("d_first_retain", "d_first_detach", "g_first_detach"):
        project = make_project(
            tmp_path / strategy, digits16, train={"strategy": strategy, "kimg": 0.048}
        )
        monkeypatch.chdir(project)
        train_stage.main(load_params())
        g[strategy] = load(project / "models/generator.pt")["state_dict"]
        d[strategy] = load(project / "models/discriminator.pt")["state_dict"]
    assert not torch.equal(
        g["d_first_detach"]["main.0.0.weight"], g["d_first_retain"]["main.0.0.weight"]
    )
    for name, tensor in g["d_first_retain"].items():
        assert torch.equal(tensor, g["g_first_detach"][name]), name
    for name, tensor in d["d_first_retain"].items():
        is_bn_stat = name.endswith(("running_mean", "running_var", "num_batches_tracked"))
        assert torch.equal(tensor, d["g_first_detach"][name]) != is_bn_stat, name


def test_wrong_shape_database_is_refused(tmp_path, digits16, monkeypatch):
    project = make_project(tmp_path / "p", digits16)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["data"]["image_size"] = 32
    (project / "params.yaml").write_text(yaml.safe_dump(params))
    monkeypatch.chdir(project)
    with pytest.raises(ValueError, match="run `dvc repro prepare`"):
        train_stage.main(load_params())
