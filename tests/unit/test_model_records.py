"""What a model file records of where its weights started (train.init_from), and what
``ganpipe info`` shows of it; a run from the seed records exactly what it did before."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ganpipe_cli
from ganpipe import runtime
from ganpipe.checkpoint import load
from ganpipe.ema import EmaGenerator
from ganpipe.files import file_sha256
from ganpipe.loop import TrainResult
from ganpipe.nets import build_models
from ganpipe.params import Params
from stages import train as train_stage

PARAMS = Params.model_validate(
    {"data": {"image_size": 16}, "model": {"z_dim": 8, "g_width": 4, "d_width": 4}}
)
NUMERICS = runtime.numerics_record(PARAMS.determinism, PARAMS.devices, torch.device("cpu"))


def trained(seed: int) -> TrainResult:
    """Untrained tiny networks as the loop hands them to the stage."""
    g, d = build_models(PARAMS.model, 16, 1, torch.Generator().manual_seed(seed))
    return TrainResult(g, d, EmaGenerator(g, 0.0), None, 160, 10, {"g": 0, "d": 0})


def test_a_model_trained_from_the_seed_records_what_it_did_before(tmp_path, monkeypatch):
    """No init_from: the record's keys, hence the bytes of a default run's models/, are as
    before the record of init_from existed."""
    monkeypatch.chdir(tmp_path)
    train_stage.save_models(PARAMS, trained(0), NUMERICS, train_stage.init_sources(None))
    for name in ("generator", "discriminator", "g_ema", "g_ema_best"):
        record = load(Path("models") / f"{name}.pt")
        assert set(record) == {
            "net",
            "model",
            "image_size",
            "channels",
            "numerics",
            "state_dict",
            "images_seen",
        }, name


def test_a_fine_tuned_model_records_the_file_it_started_from_and_info_shows_it(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    train_stage.save_models(PARAMS, trained(1), NUMERICS)
    Path("init").mkdir()
    Path("models").rename("init/pre")  # an earlier run's models, to fine-tune
    sources = train_stage.init_sources("init/pre")
    train_stage.save_models(PARAMS, trained(2), NUMERICS, sources)
    started = {name: f"{name}.pt" for name in ("generator", "discriminator", "g_ema")}
    started["g_ema_best"] = "g_ema.pt"  # the best snapshot is an EMA
    for name, file in started.items():
        assert load(Path("models") / f"{name}.pt")["init_from"] == {
            "path": f"init/pre/{file}",
            "sha256": file_sha256(Path("init/pre") / file),
        }, name

    ganpipe_cli.main(["info", "models/g_ema_best.pt"])
    shown = capsys.readouterr().out.splitlines()
    at = shown.index("init_from:")
    assert shown[at + 1].split() == ["path:", "init/pre/g_ema.pt"]
    assert shown[at + 2].split() == ["sha256:", file_sha256(Path("init/pre/g_ema.pt"))]
    ganpipe_cli.main(["info", "--json", "models/discriminator.pt"])
    described = json.loads(capsys.readouterr().out)
    assert described["init_from"]["path"] == "init/pre/discriminator.pt"
