"""The model files of the train stage: a generator read back from one, what a file says about
itself, and whether a generator fits the feature network and the data it is evaluated with.

A model file is a ``torch.save`` record of plain values (loaded with ``weights_only=True``):
``net`` (``generator`` or ``discriminator``), ``model`` (the params section that shapes the
network), ``image_size``, ``channels``, ``num_classes`` (conditional models only),
``images_seen`` (how far training went; files written before it was recorded lack it),
``init_from`` (fine-tuned models only: ``path`` and ``sha256`` of the train.init_from file
the weights started from), ``numerics`` (:func:`ganpipe.runtime.numerics_record`) and
``state_dict``. The feature
network's file (:func:`ganpipe.featurenet.record`) is read here too, for :func:`describe`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ganpipe.checkpoint import ModelFileError, read_model_file
from ganpipe.featurenet import Embedding, classes_for, from_record
from ganpipe.nets import build_generator, build_models
from ganpipe.params import ModelParams


class ModelMismatchError(ModelFileError):
    """A generator does not fit the feature network or the data it meets (image size,
    channels, classes); the message names both files and their values."""


@dataclass
class GeneratorFile:
    """A generator rebuilt from a model file (eval mode, on the CPU), and what the file says."""

    path: Path
    net: nn.Module
    model: ModelParams
    image_size: int
    channels: int
    num_classes: int | None
    """Classes of a conditional generator; None for an unconditional one."""
    images_seen: int | None
    """Real images shown to D when the file was written; None in files older than the key."""
    numerics: dict[str, Any] = field(default_factory=dict)

    def shape_text(self) -> str:
        """``32x32 px, 1 channel(s)``: what the generator makes."""
        return f"{self.image_size}x{self.image_size} px, {self.channels} channel(s)"


def read_generator(path: Path) -> GeneratorFile:
    """Rebuild the generator of a model file written by the train stage (``g_ema.pt`` or
    ``generator.pt``).

    Raises:
        ModelFileError: there is no file at ``path``, or it is not one the train stage wrote
            (replaced, damaged, foreign, a discriminator's); the message names it and the fix.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(
            f"{path} is missing; run `dvc repro train` first (or name another model file)"
        )
    return read_model_file(path, lambda record: _build_generator(path, record), "train")


def _build_generator(path: Path, record: dict) -> GeneratorFile:
    if record.get("net", "generator") != "generator":  # a discriminator's file, say
        raise TypeError(f"it holds a {record['net']!r} network, not a generator")
    model = ModelParams(**record["model"])
    num_classes = record.get("num_classes")
    g = build_generator(model, record["image_size"], record["channels"], num_classes=num_classes)
    g.load_state_dict(record["state_dict"])
    return GeneratorFile(
        path=path,
        net=g.eval(),
        model=model,
        image_size=record["image_size"],
        channels=record["channels"],
        num_classes=num_classes,
        images_seen=record.get("images_seen"),
        numerics=record.get("numerics") or {},
    )


def load_generator(path: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The generator of a model file, in eval mode on ``device``: for notebooks and scripts.

    Call it as ``G(z)`` (``G(z, labels)`` for a conditional one) with latents of
    ``G.z_dim``; images come out in ``[-1, 1]``. Outside the stages and the ``ganpipe``
    command the CPU numerics are not pinned (:mod:`ganpipe.cpu`), so pixels can differ from
    theirs in the last bits.

    Raises:
        ModelFileError: see :func:`read_generator`.
    """
    return read_generator(Path(path)).net.to(device)


def check_fits(
    generator: GeneratorFile,
    data_path: Path,
    data_meta: dict[str, Any],
    featurenet_path: Path | None = None,
    featurenet: Embedding | None = None,
) -> None:
    """Refuse a generator whose images or classes the data or the feature network do not
    share, before any sample is drawn.

    The feature network pools its last feature maps, so it takes images of any size without
    an error, and the metrics would be computed (and near zero) in a space that means
    nothing; other channels fail deep inside torch. ``featurenet`` (with its file
    ``featurenet_path``) is checked when given: the one that extracts the features, or the
    classifier of a conditional generator's class accuracy. A conditional generator must
    draw the classes the data has (labels up to its last one present, at most the classes
    of its meta record) and, where a feature network classifies, its classes.

    Raises:
        ModelMismatchError: every mismatch found, with both files and their values.
    """
    height, width, channels = data_meta["shape"]
    size = generator.image_size
    problems = []
    if (height, width, channels) != (size, size, generator.channels):
        problems.append(
            f"{generator.path} makes {generator.shape_text()} images but {data_path} holds "
            f"{height}x{width} px, {channels} channel(s)"
        )
    if featurenet is not None:
        net = featurenet.net
        if (net.image_size, net.channels) != (generator.image_size, generator.channels):
            problems.append(
                f"{generator.path} makes {generator.shape_text()} images but {featurenet_path} "
                f"was trained on {net.image_size}x{net.image_size} px, {net.channels} channel(s)"
            )
    if generator.num_classes is not None:
        counts = data_meta.get("class_counts") or []
        present = classes_for(counts)
        if not present <= generator.num_classes <= len(counts):
            problems.append(
                f"{generator.path} draws {generator.num_classes} classes but {data_path} holds "
                f"labels 0..{present - 1} of {len(counts)} class(es)"
            )
        if featurenet is not None and featurenet.task != "classification":
            problems.append(
                f"{generator.path} draws {generator.num_classes} classes but {featurenet_path} "
                f"was trained for {featurenet.task} prediction (its data had fewer than 2 "
                "classes), so it cannot tell them apart"
            )
        elif featurenet is not None and net.head.out_features != generator.num_classes:
            problems.append(
                f"{generator.path} draws {generator.num_classes} classes but {featurenet_path} "
                f"classifies {net.head.out_features}"
            )
    if problems:
        raise ModelMismatchError(
            "; ".join(problems) + ". They do not come from one run: evaluate a generator with "
            "the data and feature network of its own run (`dvc repro` rebuilds them from "
            "params.yaml), or name matching files"
        )


def describe(path: Path) -> dict[str, Any]:
    """What a model file says about itself, for ``ganpipe info``: its network (``net``,
    ``arch``, ``image_size``, ``channels``, ``num_classes``: None when unconditional), how far
    it was trained (``kimg``: None in files older than the record of it), its number of
    parameters, then the rest of the record (``model``, ``numerics``, a fine-tuned model's
    ``init_from``...) but the weights. The network is rebuilt from the file, so a file
    described here is one the pipeline can use.

    Raises:
        ModelFileError: there is no file at ``path``, or it is not a model file of the train
            or featurenet stage.
    """
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path} is missing; name a model file (models/g_ema.pt...)")
    stage = "featurenet" if path.name.startswith("featurenet") else "train"
    record, net = read_model_file(path, lambda record: (record, _build_any(record)), stage)
    info: dict[str, Any] = {"file": str(path), "net": record["net"]}
    if "model" in record:
        info["arch"] = record["model"]["arch"]
    info["image_size"], info["channels"] = record["image_size"], record["channels"]
    info["num_classes"] = record.get("num_classes")
    if record["net"] != "featurenet":  # trained in epochs of its own, not in kimg
        info["kimg"] = None if record.get("images_seen") is None else record["images_seen"] / 1000
    info["num_parameters"] = sum(p.numel() for p in net.parameters())
    rest = {key: value for key, value in record.items() if key not in {*info, "state_dict"}}
    return {**info, **rest}


def _build_any(record: dict) -> nn.Module:
    kind = record.get("net")
    if kind == "featurenet":
        return from_record(record, "")
    model = ModelParams(**record["model"])
    size, channels, classes = record["image_size"], record["channels"], record.get("num_classes")
    if kind == "generator":
        net = build_generator(model, size, channels, num_classes=classes)
    elif kind == "discriminator":
        _, net = build_models(model, size, channels, torch.Generator(), num_classes=classes)
    else:
        raise TypeError(f"it holds a {kind!r} network")
    net.load_state_dict(record["state_dict"])
    return net
