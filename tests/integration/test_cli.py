"""The ``ganpipe`` command (src/ganpipe_cli) on a model the stages trained: the same images and
metrics as the generate and evaluate stages, and a generator that does not fit the data or the
feature network it is evaluated with is refused before any work, by the stage and the command.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import ganpipe
from ganpipe import runtime
from ganpipe.checkpoint import save_atomic, torch_bytes
from ganpipe.featurenet import FeatureNet, FeaturenetResult, record
from ganpipe.nets import build_models
from ganpipe.params import FeaturenetParams, Params, parse_params
from ganpipe.sampling import generate, sample_latents, to_uint8
from ganpipe_cli import build_parser, parse_seeds, parse_truncation
from stages.train import model_record
from tests.conftest import REPO, dir_digest
from tests.helpers import run_stage, stage_env, tiny_params, write_project

# One worker trains the module's project once (a module fixture).
pytestmark = pytest.mark.xdist_group("cli")
#: A tiny run: the stages take a few seconds each.
TINY = tiny_params(
    seed=2,
    devices={"accelerator": "cpu", "cpu_threads": 2},
    model={"g_width": 8, "d_width": 8},
    train={
        "batch_size": 32,
        "kimg": 0.32,
        "snapshot_kimg": 1,
        "log_every_kimg": 0.16,
        "metrics_kimg": 10,  # as by default: one FID point, at the end
    },
    featurenet={"epochs": 1},
    eval={"num_samples": 200, "kid_subset_size": 50, "kid_subsets": 5},
    generate={"num_images": 20, "interpolation_rows": 1},
)


def python_m(
    root: Path, module: str, *args: str, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in ``root`` with the stages' environment, output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=root,
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ganpipe_cmd(root: Path, *args: str) -> subprocess.CompletedProcess:
    """``ganpipe ARGS`` in ``root``, as ``python -m ganpipe_cli`` (the console script of the
    shared venv points at another checkout)."""
    return python_m(root, "ganpipe_cli", *args)


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a failed command (log lines may come before it)."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and result.stderr.count("error:") == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project the stages ran in: data, feature network, a trained model, samples, metrics.

    The five stages run in one process (tests.integration.stages_in_one, one start-up of
    torch instead of five): the tests compare the command's processes with what they wrote.
    """
    root = write_project(tmp_path_factory.mktemp("cli") / "p", TINY)
    stages = ("prepare", "featurenet", "train", "generate", "evaluate")
    result = python_m(root, "tests.integration.stages_in_one", *stages, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_generate_writes_the_generate_stages_images(project, tmp_path):
    out = tmp_path / "images"
    result = ganpipe_cmd(
        project, "generate", "--model", "models/g_ema.pt", "--seeds", "0-19",
        "--out", str(out), "--params", "params.yaml",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert dir_digest(out) == dir_digest(project / "samples/images")  # 20 files, same bytes
    # A few seeds into a folder that holds other files: those are added, the rest stay.
    (out / "000003.png").unlink()
    (out / "notes.txt").write_text("mine")
    again = ganpipe_cmd(
        project, "generate", "--model", "models/g_ema.pt", "--seeds", "3,17-18",
        "--out", str(out), "--params", "params.yaml",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert dir_digest(out) == {**dir_digest(project / "samples/images"), "notes.txt": b"mine"}
    # Another truncation draws other latents: other pictures.
    other = ganpipe_cmd(
        project, "generate", "--model", "models/g_ema.pt", "--seeds", "0-3",
        "--out", str(tmp_path / "t"), "--params", "params.yaml", "--truncation", "0.5",
    )  # fmt: skip
    assert other.returncode == 0, other.stderr
    truncated = dir_digest(tmp_path / "t")
    assert sorted(truncated) == [f"{i:06d}.png" for i in range(4)]
    assert all(truncated[name] != (out / name).read_bytes() for name in truncated)


def test_evaluate_prints_and_writes_the_evaluate_stages_metrics(project, tmp_path):
    out = tmp_path / "m" / "metrics.json"
    result = ganpipe_cmd(
        project, "evaluate", "--model", "models/g_ema.pt", "--out", str(out),
        "--params", "params.yaml",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    stage_bytes = (project / "metrics/eval/metrics.json").read_bytes()
    assert out.read_bytes() == stage_bytes  # every metric to the bit, the ruler too
    assert result.stdout.encode() == stage_bytes
    ruler = json.loads(stage_bytes)["ruler"]
    assert ruler["extractor_sha256"] == (project / "models/featurenet.sha256").read_text()[:64]


def test_info_shows_architecture_resolution_kimg_parameters_and_numerics(project):
    result = ganpipe_cmd(project, "info", "models/g_ema.pt", "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    g = ganpipe.load_generator(project / "models/g_ema.pt")
    assert info["net"] == "generator" and info["arch"] == "dcgan"
    assert (info["image_size"], info["channels"], info["num_classes"]) == (16, 1, None)
    assert info["kimg"] == TINY["train"]["kimg"]  # the run's length, from images_seen
    assert info["num_parameters"] == sum(p.numel() for p in g.parameters()) > 0
    assert info["model"] == parse_params(TINY).model.model_dump(mode="json")
    assert info["numerics"]["cpu_isa"] == "portable" and info["numerics"]["cpu_threads"] == 2
    text = ganpipe_cmd(project, "info", "models/discriminator.pt")
    assert text.returncode == 0, text.stderr
    assert "net:            discriminator" in text.stdout
    assert "resolution:     16x16 px" in text.stdout and "kimg:           0.32" in text.stdout


def test_load_generator_draws_the_stages_pixels_in_a_notebook(project):
    g = ganpipe.load_generator(project / "models/g_ema.pt", device="cpu")
    assert not g.training and g.z_dim == TINY["model"]["z_dim"]
    # This process is pinned to the portable defaults (conftest), the params' cpu_threads too.
    z = sample_latents(Params().generate.seed, range(20), g.z_dim)
    pixels = to_uint8(generate(g, z))[7, 0].numpy()
    assert np.array_equal(pixels, np.asarray(Image.open(project / "samples/images/000007.png")))


def test_user_errors_are_one_line_and_exit_2(project, tmp_path):
    cases = {
        ("generate", "--model", "models/g_ema.pt", "--seeds", "0-1", "--out", "x", "--class",
         "1"): "error: --class 1: models/g_ema.pt is unconditional",
        ("generate", "--model", "nothere.pt", "--seeds", "0", "--out", "x"): (
            "error: nothere.pt is missing"
        ),
        ("evaluate", "--model", "models/g_ema.pt", "--featurenet", "models/g_ema.pt"): (
            "error: models/g_ema.pt or models/g_ema.sha256 is missing"
        ),
        ("info", "params.yaml"): "error: params.yaml is not a file torch.save writes",
        ("generate", "--model", "models/discriminator.pt", "--seeds", "0", "--out", "x"): (
            "error: models/discriminator.pt is not a model file of the train stage (TypeError: "
            "it holds a 'discriminator' network, not a generator)"
        ),
    }  # fmt: skip
    for args, start in cases.items():
        result = ganpipe_cmd(project, *args)
        assert error_line(result).startswith(start), (args, result.stderr)
    assert not (project / "x").exists()
    bad = ganpipe_cmd(project, "generate", "--model", "m.pt", "--seeds", "9-2", "--out", "x")
    assert bad.returncode == 2 and "'9-2': the range ends before it starts" in bad.stderr


def test_seeds_are_indices_in_order_each_once():
    assert parse_seeds("0-3") == [0, 1, 2, 3]
    assert parse_seeds("7,0-2, 5,1") == [7, 0, 1, 2, 5]
    for bad in ("", "a", "1-", "-3", "3-1", "0-2000000"):
        with pytest.raises(Exception, match="expected sample indices|ends before|more than"):
            parse_seeds(bad)


def test_truncation_has_the_range_of_generate_truncation():
    assert parse_truncation("0.7") == 0.7
    for bad, reason in (
        ("0", "greater than 0"),
        ("11", "less than or equal to 10"),
        ("x", "a number"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=reason):
            parse_truncation(bad)  # 0 would redraw every latent value forever


def test_the_console_script_names_an_importable_callable():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["ganpipe"].partition(":")
    main = getattr(importlib.import_module(module), name)
    assert callable(main)
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0


def test_readme_shows_the_three_commands_and_they_parse():
    readme = (REPO / "README.md").read_text()
    lines = [line.split("#")[0].split() for line in readme.splitlines()]
    lines = [words for words in lines if words[:1] == ["ganpipe"]]
    assert {words[1] for words in lines} == {"generate", "evaluate", "info"}, lines
    for words in lines:
        build_parser().parse_args(words[1:])  # exits with status 2 if one is wrong


# --- generators that do not fit what they meet ------------------------------------------


def write_generator(path: Path, image_size: int, channels: int, **model) -> None:
    """An untrained generator's model file, as the train stage writes one."""
    params = Params.model_validate(
        {"data": {"image_size": image_size, "channels": channels}, "model": model}
    )
    g, _ = build_models(params.model, image_size, channels, torch.Generator().manual_seed(0))
    numerics = runtime.numerics_record(params.determinism, params.devices, torch.device("cpu"))
    save_atomic(model_record(params, "generator", g.state_dict(), numerics), path)


def mismatched_project(project: Path, root: Path, g_ema: Path) -> Path:
    """``project``'s data and feature network, with ``g_ema`` as models/g_ema.pt."""
    (root / "models").mkdir(parents=True)
    shutil.copytree(project / "data", root / "data")
    for name in ("featurenet.pt", "featurenet.sha256"):
        shutil.copy(project / "models" / name, root / "models" / name)
    shutil.copy(g_ema, root / "models/g_ema.pt")
    shutil.copy(project / "params.yaml", root / "params.yaml")
    return root


@pytest.mark.parametrize(
    ("image_size", "channels", "words"),
    [
        (32, 1, "models/g_ema.pt makes 32x32 px, 1 channel(s) images but data/val.lmdb holds "
         "16x16 px, 1 channel(s); models/g_ema.pt makes 32x32 px, 1 channel(s) images but "
         "models/featurenet.pt was trained on 16x16 px, 1 channel(s)."),
        (16, 3, "models/g_ema.pt makes 16x16 px, 3 channel(s) images but data/val.lmdb holds "
         "16x16 px, 1 channel(s); models/g_ema.pt makes 16x16 px, 3 channel(s) images but "
         "models/featurenet.pt was trained on 16x16 px, 1 channel(s)."),
    ],
)  # fmt: skip
def test_a_generator_of_other_images_is_refused_before_any_work(
    project, tmp_path, image_size, channels, words
):
    write_generator(tmp_path / "g.pt", image_size, channels, z_dim=8, g_width=8)
    root = mismatched_project(project, tmp_path / "p", tmp_path / "g.pt")
    before = dir_digest(root)
    stage = run_stage(root, "evaluate")
    assert error_line(stage).startswith(f"error: {words} They do not come from one run")
    assert "features" not in stage.stderr  # no work began
    command = ganpipe_cmd(
        root, "evaluate", "--model", "models/g_ema.pt", "--out", "m.json",
        "--params", "params.yaml",
    )  # fmt: skip
    assert error_line(command) == error_line(stage) and command.stdout == ""
    assert dir_digest(root) == before  # no metrics written, nothing else either


RESNET = {
    "arch": "resnet",
    "conditional": True,
    "z_dim": 4,
    "g_channels": {4: 4, 8: 4, 16: 4, 32: 4},
    "d_channels": {4: 4, 8: 4, 16: 4, 32: 4},
}


def featurenet_file(models: Path, task: str, num_classes: int) -> None:
    """models/featurenet.pt (an untrained network of 32 px) and its .sha256 record."""
    net = FeatureNet(1, 32, 4, num_classes)
    result = FeaturenetResult(net, task, num_classes, 0.0, 0.0)
    data = torch_bytes(record(result, FeaturenetParams(width=4), (32, 32, 1)))
    models.mkdir(parents=True, exist_ok=True)
    (models / "featurenet.pt").write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    (models / "featurenet.sha256").write_text(f"{digest}  featurenet.pt\n")


@pytest.mark.parametrize(
    ("g_classes", "task", "net_classes", "words"),
    [
        (12, "classification", 10, "models/g_ema.pt draws 12 classes but data/val.lmdb holds "
         "labels 0..9 of 10 class(es); models/g_ema.pt draws 12 classes but "
         "models/featurenet.pt classifies 10."),
        (5, "classification", 10, "models/g_ema.pt draws 5 classes but data/val.lmdb holds "
         "labels 0..9 of 10 class(es); models/g_ema.pt draws 5 classes but "
         "models/featurenet.pt classifies 10."),
        (10, "classification", 5, "models/g_ema.pt draws 10 classes but models/featurenet.pt "
         "classifies 5."),
        (10, "rotation", 4, "models/g_ema.pt draws 10 classes but models/featurenet.pt was "
         "trained for rotation prediction"),
    ],
)  # fmt: skip
def test_a_generator_of_other_classes_is_refused_before_any_work(
    tmp_path, digits32, g_classes, task, net_classes, words
):
    root = tmp_path / "p"
    root.mkdir()
    (root / "data").symlink_to(digits32)
    featurenet_file(root / "models", task, net_classes)
    params = Params.model_validate({"data": {"image_size": 32}, "model": RESNET})
    g, _ = build_models(
        params.model, 32, 1, torch.Generator().manual_seed(0), num_classes=g_classes
    )
    numerics = runtime.numerics_record(params.determinism, params.devices, torch.device("cpu"))
    record_ = model_record(params, "generator", g.state_dict(), numerics, g_classes)
    save_atomic(record_, root / "models/g_ema.pt")
    (root / "params.yaml").write_text("{}\n")  # the defaults: nothing runs anyway
    before = dir_digest(root / "models")
    stage = run_stage(root, "evaluate")
    assert error_line(stage).startswith(f"error: {words}")
    assert dir_digest(root / "models") == before
    assert not (root / "metrics/eval/metrics.json").exists() and not (root / ".state").exists()
