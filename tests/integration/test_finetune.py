"""Fine-tuning (train.init_from): a run starts G, D and the EMA from an earlier run's model
files, or stops before any work naming the first layer that does not fit."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from ganpipe import dist, ema, loop, strategies
from ganpipe.build import build_gan
from ganpipe.checkpoint import MODEL_FILES, ModelFileError, load, run_fingerprint
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.params import INIT_DIR, parse_params
from tests.helpers import REPO, run_stage, sh, tiny_params, write_project

RUN = tiny_params(
    seed=5,
    model={"z_dim": 16, "g_width": 8, "d_width": 8, "norm": "batch"},
    train={
        "batch_size": 32,
        "kimg": 0.32,
        "checkpoint_kimg": 0.064,
        "keep_checkpoints": 10,
        "log_every_kimg": 0.064,
        "snapshot_kimg": 100,
        "ema_kimg": 0.1,
    },
)
INIT = f"{INIT_DIR}/pre"
RUN_TRAIN = parse_params(RUN).train
"""The same run without init_from."""


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, digits16) -> Path:
    """The models/ folder of a short run of the real train stage."""
    root = write_project(tmp_path_factory.mktemp("pre"), RUN, digits16, seed=1)
    done = run_stage(root, "train")
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "models"


def fine_tune_project(root: Path, data_dir: Path, models: Path, **sections) -> Path:
    """A project whose init/pre holds ``models``' three files, params naming it."""
    train = {**RUN["train"], "init_from": INIT, **sections.pop("train", {})}
    root = write_project(root, RUN, data_dir, train=train, **sections)
    (root / INIT).mkdir(parents=True)
    for name in MODEL_FILES.values():
        shutil.copy(models / name, root / INIT / name)
    return root


def params_of(root: Path):
    return parse_params(yaml.safe_load((root / "params.yaml").read_text()))


def file_states(models: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {role: load(models / name)["state_dict"] for role, name in MODEL_FILES.items()}


def test_a_file_of_other_shapes_stops_the_stage_naming_the_first_layer(
    tmp_path, digits16, pretrained
):
    """d_width 4 against a file made with 8: G fits, D's first convolution does not."""
    root = fine_tune_project(tmp_path, digits16, pretrained, model={"d_width": 4})
    done = run_stage(root, "train")
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: train.init_from={INIT}: {INIT}/discriminator.pt does not fit the networks of "
        "these params: layer main.0.0.weight is [8, 1, 4, 4] in the file, [4, 1, 4, 4] in "
        "these params (the file was made with model.d_width=8; these params say "
        "model.d_width=4); set those params as the file was made, or start from a model of "
        "this shape"
    ]
    assert not (root / "models").exists()


def test_misfits_are_found_past_the_first_layer_and_load_nothing(
    tmp_path, monkeypatch, digits16, pretrained
):
    """A file made with BatchNorm against layer norm: every tensor of these params is in it,
    with its shape, but it has running statistics they do not make."""
    root = fine_tune_project(tmp_path, digits16, pretrained, model={"norm": "layer"})
    monkeypatch.chdir(root)
    with pytest.raises(ModelFileError) as info:
        build_gan(params_of(root), torch.device("cpu"))
    assert f"{INIT}/generator.pt does not fit" in str(info.value)
    assert "the file has layer main.0.1.running_mean, which these params do not make" in str(
        info.value
    )
    assert "model.norm=batch; these params say model.norm=layer" in str(info.value)


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("no folder", f"there is no folder {INIT}; it needs all of generator.pt"),
        ("missing", "g_ema.pt missing (the folder holds ['discriminator.pt', 'generator.pt'])"),
        ("swapped", "discriminator.pt holds a generator, not a discriminator"),
        ("truncated", "generator.pt is not a file torch.save writes"),
    ],
)
def test_a_missing_or_foreign_file_is_named(
    tmp_path, monkeypatch, digits16, pretrained, damage, words
):
    root = fine_tune_project(tmp_path, digits16, pretrained)
    init = root / INIT
    if damage == "no folder":
        shutil.rmtree(init)
    elif damage == "missing":
        (init / "g_ema.pt").unlink()
    elif damage == "swapped":
        shutil.copy(init / "generator.pt", init / "discriminator.pt")
    else:
        data = (init / "generator.pt").read_bytes()
        (init / "generator.pt").write_bytes(data[: len(data) // 2])
    monkeypatch.chdir(root)
    with pytest.raises(ModelFileError) as info:
        build_gan(params_of(root), torch.device("cpu"))
    assert words in str(info.value) and f"train.init_from={INIT}" in str(info.value)
    assert "dvc repro train" not in str(info.value)  # rerunning train would not rewrite init/


def test_the_first_step_starts_from_exactly_the_files_weights(
    tmp_path, monkeypatch, digits16, pretrained
):
    """The strategy's first call sees G, D and the EMA holding the files' tensors, and
    optimizers without state (they start afresh)."""
    root = fine_tune_project(tmp_path, digits16, pretrained, train={"kimg": 0.064})
    monkeypatch.chdir(root)
    params = params_of(root)
    seen = []
    real_step = strategies.STRATEGIES[params.train.strategy]

    def recording_step(gan, batches):
        if not seen:
            nets = {"g": dist.unwrap(gan.g), "d": dist.unwrap(gan.d)}
            seen.append(
                {k: {n: t.clone() for n, t in v.state_dict().items()} for k, v in nets.items()}
            )
            seen.append(len(gan.opt_g.state) + len(gan.opt_d.state))
        return real_step(gan, batches)

    monkeypatch.setitem(strategies.STRATEGIES, params.train.strategy, recording_step)
    ema_before = []
    real_update = ema.EmaGenerator.update

    def recording_update(self, generator, num_images):
        if not ema_before:
            ema_before.append({n: t.clone() for n, t in self.module.state_dict().items()})
        return real_update(self, generator, num_images)

    monkeypatch.setattr(ema.EmaGenerator, "update", recording_update)
    dataset = LmdbImageDataset(root / "data/train.lmdb", as_uint8=True)
    result = loop.train(params, dataset, torch.device("cpu"), progress=False)
    expected = file_states(pretrained)
    states, optimizer_entries = seen
    states["g_ema"] = ema_before[0]
    for role, state in states.items():
        assert state.keys() == expected[role].keys()
        for name, tensor in state.items():
            assert torch.equal(tensor, expected[role][name]), (role, name)
    assert optimizer_entries == 0
    trained = result.g.state_dict()
    assert any(not torch.equal(trained[k], expected["g"][k]) for k in trained)
    # and not the weights the seed alone makes
    scratch = build_gan(params.model_copy(update={"train": RUN_TRAIN}), torch.device("cpu"))[0]
    ours = dist.unwrap(scratch.g).state_dict()
    assert not torch.equal(ours["main.0.0.weight"], expected["g"]["main.0.0.weight"])


def test_a_fine_tune_resumes_its_own_checkpoint_to_the_same_bytes(
    tmp_path, monkeypatch, digits16, pretrained, caplog
):
    """A checkpoint of the fine-tune wins over init_from: stopped and resumed, the run ends
    with the bytes of one never stopped."""
    root = fine_tune_project(tmp_path, digits16, pretrained)
    monkeypatch.chdir(root)
    params = params_of(root)
    dataset = LmdbImageDataset(root / "data/train.lmdb", as_uint8=True)
    cpu = torch.device("cpu")
    whole = loop.train(params, dataset, cpu, None, False, tmp_path / "a", fingerprint="f")
    polls = {"n": 0}

    def stop_after_5() -> bool:
        polls["n"] += 1
        return polls["n"] == 5

    with pytest.raises(loop.TrainingInterrupted):
        loop.train(params, dataset, cpu, None, False, tmp_path / "b", stop_after_5, "f")
    with caplog.at_level(logging.INFO, logger="ganpipe.runstate"):
        resumed = loop.train(params, dataset, cpu, None, False, tmp_path / "b", fingerprint="f")
    assert "(160 images seen)" in caplog.text
    for name in ("g", "d", "g_ema"):
        ours, theirs = getattr(whole, name).state_dict(), getattr(resumed, name).state_dict()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), name


def test_the_init_files_content_is_part_of_the_run_fingerprint(
    tmp_path, monkeypatch, digits16, pretrained
):
    root = fine_tune_project(tmp_path, digits16, pretrained)
    monkeypatch.chdir(root)
    params = params_of(root)
    numerics = {"device": "cpu"}
    first, relevant = run_fingerprint(params, "data", numerics)
    assert relevant["init_sha256"].keys() == set(MODEL_FILES.values())
    assert run_fingerprint(params, "data", numerics)[0] == first
    ema = root / INIT / "g_ema.pt"
    record = load(ema)
    record["state_dict"]["main.2.0.weight"][0, 0, 0, 0] += 1
    torch.save(record, ema)
    assert run_fingerprint(params, "data", numerics)[0] != first
    plain = params.model_copy(update={"train": RUN_TRAIN})
    assert "init_sha256" not in run_fingerprint(plain, "data", numerics)[1]


@pytest.mark.slow
def test_dvc_reruns_train_for_a_model_put_in_init_but_not_for_its_readme(tmp_path):
    """dvc.yaml's train stage depends on the whole init/ folder (a dependency cannot be
    conditional); its README is in .dvcignore."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert INIT_DIR in stages["train"]["deps"]
    sh(["git", "init", "-q"], tmp_path)
    sh(["dvc", "init", "-q"], tmp_path)
    shutil.copy(REPO / ".dvcignore", tmp_path / ".dvcignore")
    ignored = sh(["dvc", "check-ignore", f"{INIT_DIR}/README.md"], tmp_path, check=False)
    assert ignored.returncode == 0 and f"{INIT_DIR}/README.md" in ignored.stdout
    model = sh(["dvc", "check-ignore", f"{INIT_DIR}/pre/generator.pt"], tmp_path, check=False)
    assert model.returncode == 1
