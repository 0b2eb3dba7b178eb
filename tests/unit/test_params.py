"""The params schema: defaults, every error path, and one report for all problems."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from ganpipe.params import Params, ParamsError, load_params, parse_params

REPO = Path(__file__).resolve().parents[2]


def flat(values: dict, prefix: str = "") -> dict:
    """``{"train": {"kimg": 100}}`` as ``{"train.kimg": 100}``."""
    out = {}
    for name, value in values.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def every_field(section: BaseModel) -> dict:
    """Every field's value, sections as dicts; unlike ``model_dump``, which leaves out the
    keys of the model families that ``model.arch`` does not choose."""
    return {k: every_field(v) if isinstance(v, BaseModel) else v for k, v in section}


def test_schema_defaults_are_the_committed_params_yaml():
    """One source of defaults: a key left out of params.yaml means the committed value."""
    committed = flat(every_field(load_params(REPO / "params.yaml")))
    defaults = flat(every_field(Params()))
    assert "model.g_channels.256" in committed
    assert committed.keys() == defaults.keys()
    differ = {k: (committed[k], defaults[k]) for k in committed if committed[k] != defaults[k]}
    assert not differ, f"params.yaml vs schema default in src/ganpipe/params.py: {differ}"


def test_repo_params_yaml_spells_out_every_key():
    """`dvc exp run -S key=value` can only set keys that params.yaml already has."""

    def keys(model, prefix=""):
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, Params.__mro__[1]):
                yield from keys(sub, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"

    def flatten(raw, prefix=""):
        for name, value in raw.items():
            if isinstance(value, dict) and not prefix:  # a section (not a mapping value)
                yield from flatten(value, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}"

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    assert set(flatten(raw)) == set(keys(Params))


def test_empty_file_means_all_defaults(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("")
    assert load_params(path) == Params()


# (yaml text, dotted key that must be named, words the message must contain)
BAD_PARAMS = [
    ("data: {imagesize: 32}", "data.imagesize", "Did you mean data.image_size?"),
    ("trian: {kimg: 1}", "trian", "Did you mean train?"),
    ("data: {image_size: thirty}", "data.image_size", "valid integer"),
    ("data: {image_size: 4}", "data.image_size", "greater than or equal to 8"),
    ("data: {image_size: 48}", "(top level)", "data.image_size=48 is not supported"),
    ("data: {channels: 2}", "data.channels", "1 or 3"),
    ("data: {val_fraction: 1.0}", "data.val_fraction", "less than 1"),
    ("data: {val_fraction: -0.1}", "data.val_fraction", "greater than 0 (got -0.1)"),
    ("data: {val_fraction: 0.0}", "data.val_fraction", "evaluate stage compares samples on"),
    ("train: {kimg: 1e308}", "train.kimg", "less than or equal to 1000000 (got 1e+308)"),
    ("devices: {rdzv_endpoint: 'a:99999'}", "devices", "port above 65535"),
    ("data: {source: imagenet}", "data.source", "'digits', 'folder', 'cifar10' or 'mnist'"),
    ("data: {source: folder}", "data", "data.source=folder needs data.path"),
    ("data: {path: /tmp/x}", "data", "data.source=digits reads no files"),
    ("data: {on_bad_image: ignore}", "data.on_bad_image", "'error' or 'skip'"),
    ("train: {strategy: simultaneous}", "train.strategy", "'d_first_detach'"),
    ("train: {batch_size: 0}", "train.batch_size", "greater than or equal to 1"),
    ("train: {kimg: -5}", "train.kimg", "greater than 0"),
    ("train: {kimg: .nan}", "train.kimg", "finite number"),
    ("train: {lr_g: .inf}", "train.lr_g", "finite number"),
    ("train: {betas: [0.5]}", "train.betas", "too few items"),
    ("train: {betas: [0.5, 0.9, 0.9]}", "train.betas", "at most 2 items"),
    ("train: {betas: [0.5, 1.0]}", "train.betas.1", "less than 1"),
    ("precision: fp8", "precision", "'fp32', 'bf16' or 'fp16'"),
    ("seed: -1", "seed", "greater than or equal to 0"),
    ("seed: 1.5", "seed", "valid integer"),
    # Strict types: YAML quoting or a stray .0 is an error, not a silent conversion.
    ('data: {image_size: "32"}', "data.image_size", "(got '32'); write the number without"),
    ("train: {kimg: '5'}", "train.kimg", "valid number (got '5'); write the number without"),
    ("train: {activation_checkpointing: 'yes'}", "train.activation_checkpointing", "true or false"),
    ("seed: 2.0", "seed", "valid integer (got 2.0); write a whole number, e.g. 2"),
    ("train: {betas: ['0.5', 0.9]}", "train.betas.0", "valid number"),
    ("data: {channels: '3'}", "data.channels", "1 or 3"),
    ("model: {norm: weird}", "model.norm", "'batch'"),
    ("model: {z_dim: 0}", "model.z_dim", "greater than or equal to 1"),
    ("devices: {cpu_threads: 0}", "devices.cpu_threads", "greater than or equal to 1"),
    ("devices: {accelerator: tpu}", "devices.accelerator", "'auto', 'cpu' or 'cuda'"),
    ("determinism: {cudnn_benchmark: true}", "determinism", "contradicts"),
    ("train: {loss: wgan_gp}", "(top level)", "BatchNorm (model.norm=batch) mixes"),
    ("train: {r1_gamma: 1}\nmodel: {norm: batch}", "(top level)", "train.r1_gamma=1.0"),
    ("train: {r1_gamma: 1}\nmodel: {norm: sync_batch}", "(top level)", "(model.norm=sync_batch)"),
    (
        "train: {activation_checkpointing: true}\nmodel: {norm: spectral}",
        "(top level)",
        "power iteration",
    ),
    ("train: {n_critic: 0}", "train.n_critic", "greater than or equal to 1"),
    ("train: {loss: lsgan}", "train.loss", "'bce', 'hinge' or 'wgan_gp'"),
    (
        "train: {batch_size: 48}\ndevices: {nproc_per_node: 5}",
        "(top level)",
        "train.batch_size=48 is not divisible by world size 5",
    ),
    (
        "train: {batch_size: 64, grad_accum: 3}",
        "(top level)",
        "x train.grad_accum=3; use a multiple of 3",
    ),
    (
        "train: {batch_size: 64}\ndevices: {nproc_per_node: 2, nnodes: 3}",
        "(top level)",
        "use a multiple of 6",
    ),
    ("devices: {node_rank: 2, nnodes: 2}", "devices", "must be below devices.nnodes=2"),
    ("devices: {accelerator: cpu, backend: nccl}", "devices", "nccl needs CUDA"),
    (
        "devices: {accelerator: cpu}\nmodel: {norm: sync_batch}",
        "(top level)",
        "SyncBatchNorm only works with GPU modules",
    ),
    ("devices: {gpus: [0, 1], nproc_per_node: 3}", "devices", "more than the 2 GPU(s)"),
    ("devices: {rdzv_endpoint: nohost}", "devices.rdzv_endpoint", "expected host:port"),
    ("devices: {timeout_s: 1}", "devices.timeout_s", "greater than or equal to 5"),
    ("train: {lr_scaling: cubic}", "train.lr_scaling", "'none', 'linear' or 'sqrt'"),
    ("generate: {grid_rows: 0}", "generate.grid_rows", "greater than or equal to 1"),
    ("data: 5", "data", "valid dictionary"),
    ("determinism: {deterministic: yes}", "determinism.deterministic", "write true or false"),
    ("seed: 1\nseed: 2", "(file)", "duplicate key"),
    # train.init_from: a folder inside init/, the folder dvc.yaml's train stage depends on
    ("train: {init_from: models}", "train.init_from", "is not a folder inside init/"),
    ("train: {init_from: /tmp/m}", "train.init_from", "cp models/{generator,discriminator,g_"),
    ("train: {init_from: init/../models}", "train.init_from", "set train.init_from: init/NAME"),
    ("train: {init_from: init}", "train.init_from", "is not a folder inside init/"),
    ("train: {xflip: 1}", "train.xflip", "valid boolean"),
    ("- a\n- b", "(top level)", "expected a mapping"),
]


@pytest.mark.parametrize(("text", "key", "words"), BAD_PARAMS, ids=[b[0] for b in BAD_PARAMS])
def test_bad_params_name_the_key_and_the_fix(tmp_path, text, key, words):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError) as info:
        load_params(path)
    keys = [k for k, _ in info.value.problems]
    assert key in keys, info.value
    assert words in str(info.value)
    assert str(path) in str(info.value)


def test_every_problem_is_reported_at_once():
    raw = {
        "seed": -3,
        "data": {"image_size": 4, "chanels": 1},
        "train": {"batch_size": 0, "strategy": "both"},
        "model": {"norm": "weird"},
        "determinism": {"cudnn_benchmark": True},
    }
    with pytest.raises(ParamsError) as info:
        parse_params(raw)
    keys = {k for k, _ in info.value.problems}
    assert keys == {
        "seed",
        "data.image_size",
        "data.chanels",
        "train.batch_size",
        "train.strategy",
        "model.norm",
        "determinism",
    }
    assert "7 problem(s)" in str(info.value)


def test_cross_section_rules_are_reported_beside_other_problems():
    raw = {"data": {"image_size": 48}, "train": {"batch_size": 0}}
    with pytest.raises(ParamsError) as info:
        parse_params(raw)
    assert [k for k, _ in info.value.problems] == ["train.batch_size", "(top level)"]
    assert "data.image_size=48 is not supported" in str(info.value)


def test_every_number_has_an_upper_bound():
    """Without one, 1e308 validates and overflows where the value is used (train.kimg)."""

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, Params.__mro__[1]):
                yield from walk(sub, f"{prefix}{name}.")
            else:
                yield f"{prefix}{name}", field

    def bounded(metadata):
        return any(hasattr(m, "le") or hasattr(m, "lt") for m in metadata)

    unbounded = [
        key
        for key, field in walk(Params)
        if field.annotation in (int, float, float | None) and not bounded(field.metadata)
    ]
    assert not unbounded


HUGE = [
    "train.kimg",
    "train.checkpoint_kimg",
    "train.snapshot_kimg",
    "train.log_every_kimg",
    "train.ema_kimg",
    "train.gp_weight",
    "train.r1_gamma",
    "train.reference_batch",
    "devices.node_rank",
]


@pytest.mark.parametrize("key", HUGE)
def test_huge_numbers_are_refused_naming_the_key(key):
    section, name = key.split(".")
    value = 10**308 if isinstance(getattr(getattr(Params(), section), name), int) else 1e308
    with pytest.raises(ParamsError) as info:
        parse_params({section: {name: value}})
    assert [k for k, _ in info.value.problems] == [key]
    assert "less than or equal to" in str(info.value)


def alias_bomb(levels: int = 9, width: int = 9) -> str:
    """ "Billion laughs": each anchor holds ``width`` aliases of the one before."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join([*lines, f"data: *a{levels - 1}"]) + "\n"


# (file content, words of the one-line error)
BAD_FILES = {
    "alias_bomb": (alias_bomb(), "more than 10,000 keys and values once its aliases"),
    "recursive_alias": ("data: &d {path: *d}\n", "alias *d is inside the node &d"),
    "deep_nesting": ("data: " + "[" * 5000 + "]" * 5000, "nested deeper than 16 levels"),
    "many_values": ("seed: [" + "0, " * 20000 + "0]\n", "more than 10,000 keys and values;"),
    "too_large": ("#" * (256 * 1024) + "\n", "larger than 256 KiB"),
    "latin1": ("seed: 0\ndata: {path: caf\xe9}\n".encode("latin-1"), "not UTF-8 text"),
    "utf16": ("seed: 0\n".encode("utf-16"), "not UTF-8 text (byte 0xff on line 1)"),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_hostile_params_files_are_refused_in_a_second(tmp_path, case):
    content, words = BAD_FILES[case]
    path = tmp_path / "params.yaml"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    start = time.process_time()
    with pytest.raises(ParamsError) as info:
        load_params(path)
    # CPU time, not wall time: the bound is about the work (an unchecked bomb takes minutes
    # and gigabytes), not about what else the machine runs; ~0.2 s here when quiet.
    assert time.process_time() - start < 1.0
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert words in message, message


def test_aliases_within_the_budget_still_work(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("train: &t {kimg: 5, betas: &b [0.5, 0.9]}\nfeaturenet: {lr: 1.0e-3}\n")
    assert load_params(path).train.kimg == 5.0
    path.write_text(alias_bomb(levels=3, width=9).replace("data: *a2", "seed: 1"))
    with pytest.raises(ParamsError, match="a0: unknown key"):  # 819 nodes: read, then validated
        load_params(path)


@pytest.mark.timeout(10)
def test_a_fifo_or_folder_as_params_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "folder.yaml").mkdir()
    for name in ("fifo.yaml", "folder.yaml"):
        with pytest.raises(ParamsError, match=f"{name}: not a regular file"):
            load_params(tmp_path / name)


def test_invalid_yaml_and_missing_file_are_params_errors(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("data: [unclosed")
    with pytest.raises(ParamsError, match="not valid YAML"):
        load_params(path)
    with pytest.raises(ParamsError, match="not found"):
        load_params(tmp_path / "missing.yaml")


def test_params_are_frozen():
    params = Params()
    with pytest.raises(Exception, match="frozen"):
        params.data.image_size = 64  # type: ignore[misc]


def test_every_field_has_a_docstring():
    def walk(model):
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, type(Params()).__mro__[1]):
                yield from walk(sub)
            else:
                yield f"{model.__name__}.{name}", field.description

    missing = [name for name, doc in walk(Params) if not doc]
    assert not missing


def test_what_yaml_and_dvc_write_still_validates():
    """Strict types keep the conversions YAML and `dvc exp run -S` legitimately need."""
    params = parse_params(
        yaml.safe_load(
            "train: {lr_g: 1, kimg: 5, betas: [0, 0.9]}\n"
            "generate: {truncation: 2}\n"
            "eval: {inception_weights: null}\n"
            "devices: {gpus: [0, 1], nproc_per_node: 2}\n"
        )
    )
    assert params.train.lr_g == 1.0 and isinstance(params.train.lr_g, float)
    assert params.train.kimg == 5.0 and params.train.betas == (0.0, 0.9)
    assert params.generate.truncation == 2.0 and params.eval.inception_weights is None
    assert params.devices.gpus == [0, 1]
    assert parse_params({"devices": {"gpus": "all"}}).devices.gpus == "all"


def test_yaml_round_trip_of_defaults_validates():
    dumped = yaml.safe_dump(Params().model_dump(mode="json"))
    assert parse_params(yaml.safe_load(dumped)) == Params()


def test_numbers_are_read_as_dvc_reads_them(tmp_path):
    """params.yaml is parsed as DVC parses it (YAML 1.2): an exponent without a dot is a
    number (PyYAML's YAML 1.1 reads ``1e-3`` as a string, which strict types refuse)."""
    path = tmp_path / "params.yaml"
    path.write_text("train: {lr_g: 1e-3, lr_d: 2.0e-4, kimg: 5}\n")
    params = load_params(path)
    assert params.train.lr_g == 0.001 and params.train.lr_d == 0.0002
    assert params.train.kimg == 5.0


@pytest.mark.parametrize(
    ("section", "value", "expected"),
    [
        ({"devices": {"rdzv_endpoint": "no-port"}}, "no-port", "expected host:port"),
        ({"eval": {"inception_sha256": "ABC"}}, "ABC", "64 lowercase hex digits"),
    ],
)
def test_each_pattern_mismatch_says_what_its_key_expects(tmp_path, section, value, expected):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(section))
    with pytest.raises(ParamsError) as caught:
        load_params(path)
    message = str(caught.value)
    assert expected in message and repr(value) in message
    other = "64 lowercase hex" if expected == "expected host:port" else "host:port"
    assert other not in message


def test_init_from_is_kept_as_a_normalised_path():
    assert parse_params({"train": {"init_from": "init//a/./b/"}}).train.init_from == "init/a/b"
    assert Params().train.init_from is None
