"""Assembling a run's GAN from the params: networks, optimizers, loss, precision, EMA."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ganpipe import dist, exact, runtime
from ganpipe.augment import AdaptiveP, Augment
from ganpipe.checkpoint import ModelFileError, init_files, read_model_file
from ganpipe.dist import DistContext
from ganpipe.ema import EmaGenerator
from ganpipe.errors import UserError
from ganpipe.featurenet import classes_for
from ganpipe.losses import build_loss
from ganpipe.nets import build_models
from ganpipe.params import Params, TrainParams
from ganpipe.strategies import Gan

log = logging.getLogger(__name__)
#: The kind of network each model file of a train.init_from folder holds (its record's ``net``).
INIT_KINDS = {"g": "generator", "d": "discriminator", "g_ema": "generator"}


def scaled_lr(lr: float, train: TrainParams) -> float:
    """``lr`` at ``train.batch_size`` under ``train.lr_scaling`` from ``reference_batch``."""
    ratio = train.batch_size / train.reference_batch
    return lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[train.lr_scaling]


def conditional_classes(params: Params, dataset: Dataset) -> int | None:
    """The classes a model.conditional GAN is built for (None when not conditional): every
    label up to the dataset's last one present.

    Raises:
        ValueError: the dataset has fewer than 2 classes.
    """
    if not params.model.conditional:
        return None
    classes = classes_for(dataset.class_counts())  # the feature network's rule: one source
    if classes < 2:
        raise UserError(
            f"model.conditional=true needs at least 2 classes, but the training set has "
            f"{classes}; set model.conditional false, or use labelled data (data.source "
            "folder with one subfolder per class, digits, mnist or cifar10)"
        )
    return classes


def build_gan(
    params: Params, context: DistContext | torch.device, num_classes: int | None = None
) -> tuple[Gan, EmaGenerator]:
    """G, D (DDP-wrapped when distributed), optimizers, loss, precision tools, EMA of G.

    The weights are a function of ``params.seed`` only (the same on every rank), or with
    ``train.init_from`` those of its model files (:func:`start_from`); the optimizers start
    afresh either way. ``num_classes`` (:func:`conditional_classes`) sizes a conditional
    model's embeddings.

    Raises:
        ModelFileError: a ``train.init_from`` file is missing, damaged or of other shapes.
    """
    if isinstance(context, torch.device):
        context = DistContext(device=context)
    cfg, device = params.train, context.device
    g, d = build_models(
        params.model,
        params.data.image_size,
        params.data.channels,
        runtime.seeded_generator(params.seed, "init"),
        cfg.activation_checkpointing,
        num_classes=num_classes,
    )
    g_ema = EmaGenerator(g, cfg.ema_kimg)
    if cfg.init_from is not None:  # before DDP's first broadcast, and the optimizers
        nets = {"g": g, "d": d, "g_ema": g_ema.module}
        start_from(Path(cfg.init_from), nets, _shape_settings(params, num_classes))
    g, d, g_ema = g.to(device), d.to(device), g_ema.to(device)
    on_gpu = device.type == "cuda"
    if on_gpu:  # NHWC convolutions: cuDNN's faster kernels (benchmarks/gpu.py measures them);
        # in the numerics record, as they change the GPU bits
        g, d, g_ema = (net.to(memory_format=torch.channels_last) for net in (g, d, g_ema))
    sync_bn = params.model.norm == "sync_batch"
    g, d = dist.wrap(g, context, sync_bn), dist.wrap(d, context, sync_bn)

    # On a GPU: one kernel per step, its state on the device, and no host read under fp16
    # (the GradScaler hands a fused optimizer its inf test as a tensor): what a CUDA graph
    # needs (ganpipe.graphed). On CPU, the default kernels (fused=None: False would also turn
    # the default for-each kernels off), but Adam in the portable mode (below).
    fused = True if on_gpu else None
    if on_gpu:  # capturable optimizers warn on every step outside a capture; the warm-up
        # steps (and eager GPU runs) take those on purpose, with the same bits
        warnings.filterwarnings("ignore", "This instance was constructed with capturable=True")

    def optimizer(net: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(net.parameters(), lr=scaled_lr(lr, cfg), fused=fused)
        # On CPU in the portable mode Adam is fused too: the default step's torch.sqrt
        # leaves bits to the processor (ganpipe.exact).
        adam_fused = fused or exact.fused_adam(device)
        return torch.optim.Adam(
            net.parameters(),
            lr=scaled_lr(lr, cfg),
            betas=cfg.betas,
            fused=adam_fused,
            capturable=on_gpu,
        )

    gan = Gan(
        g=g,
        d=d,
        opt_g=optimizer(g, cfg.lr_g),
        opt_d=optimizer(d, cfg.lr_d),
        loss=build_loss(cfg),
        scaler_g=runtime.grad_scaler(params.precision, device),
        scaler_d=runtime.grad_scaler(params.precision, device),
        autocast=runtime.autocast_factory(params.precision, device),
        grad_accum=cfg.grad_accum,
        augment=Augment(cfg.augment_policy, torch.tensor(cfg.augment_p, device=device))
        if cfg.augment_policy
        else None,
    )
    return gan, g_ema


def adaptive_p(params: Params, gan: Gan, context: DistContext) -> AdaptiveP | None:
    """ADA's tuner of ``gan.augment.p`` (train.augment_target), or None when p is fixed."""
    cfg = params.train
    if cfg.augment_target is None or gan.augment is None:
        return None
    step = cfg.batch_size * cfg.n_critic / (cfg.augment_speed_kimg * 1000)
    per_rank = cfg.batch_size // context.world_size
    return AdaptiveP(gan.augment.p, cfg.augment_target, step, cfg.batch_size, per_rank)


def _shape_settings(params: Params, num_classes: int | None) -> dict[str, Any]:
    """The settings that shape the networks, as a model file records them (stages/train.py)."""
    settings = {f"model.{k}": v for k, v in params.model.model_dump(mode="json").items()}
    settings.update(
        {
            "data.image_size": params.data.image_size,
            "data.channels": params.data.channels,
            "num_classes": num_classes,
        }
    )
    return settings


def _record_settings(record: dict) -> dict[str, Any]:
    settings = {f"model.{k}": v for k, v in record["model"].items()}
    settings.update(
        {
            "data.image_size": record.get("image_size"),
            "data.channels": record.get("channels"),
            "num_classes": record.get("num_classes"),
        }
    )
    return settings


def _check_record(record: Any) -> dict:
    """``record`` if it has the fields of the train stage's model files."""
    if not isinstance(record, dict):
        raise TypeError(f"it holds a {type(record).__name__}, not a model record")
    missing = [k for k in ("net", "model", "state_dict") if k not in record]
    if missing:
        raise KeyError(f"no {', '.join(missing)}")
    if not isinstance(record["state_dict"], dict) or not isinstance(record["model"], dict):
        raise TypeError("its state_dict or model is not a mapping")
    return record


def first_difference(ours: dict[str, torch.Tensor], theirs: dict[str, Any]) -> str | None:
    """The first tensor, in the network's order, that ``theirs`` lacks or holds in another
    shape (then one it has beyond ``ours``), described; None when all names and shapes agree."""
    for name, tensor in ours.items():
        if name not in theirs:
            return f"layer {name} (shape {list(tensor.shape)}) is not in the file"
        shape = getattr(theirs[name], "shape", None)
        if shape is None or tuple(shape) != tuple(tensor.shape):
            found = list(shape) if shape is not None else type(theirs[name]).__name__
            return f"layer {name} is {found} in the file, {list(tensor.shape)} in these params"
    extra = [name for name in theirs if name not in ours]
    if extra:
        return f"the file has layer {extra[0]}, which these params do not make"
    return None


def start_from(directory: Path, nets: dict[str, nn.Module], settings: dict[str, Any]) -> None:
    """Load ``nets`` (by role: ``g``, ``d``, ``g_ema``) from the train stage's model files in
    the train.init_from folder ``directory`` (fine-tuning).

    Every file is read and compared, name by name and shape by shape, before any weight is
    copied: a misfit names the first layer that differs and leaves the networks as built.
    ``settings`` (model.*, data.image_size, data.channels, num_classes of this run) are set
    against the file's in that message.

    Raises:
        ModelFileError: a file is missing, damaged, of the wrong kind or of other shapes.
    """
    where = f"train.init_from={directory.as_posix()}"
    states = {}
    for role, path in init_files(directory).items():
        fix = f"copy models/{path.name} of a finished run there again, or set train.init_from null"
        record = read_model_file(path, _check_record, "train", fix=f"{where}: {fix}")
        if record["net"] != INIT_KINDS[role]:
            raise ModelFileError(
                f"{where}: {path} holds a {record['net']}, not a {INIT_KINDS[role]}; {fix}"
            )
        difference = first_difference(nets[role].state_dict(), record["state_dict"])
        if difference is not None:
            theirs = _record_settings(record)
            differ = [k for k in settings if settings[k] != theirs.get(k)]
            made = ", ".join(f"{k}={theirs.get(k)}" for k in differ)
            ours = ", ".join(f"{k}={settings[k]}" for k in differ)
            hint = f" (the file was made with {made}; these params say {ours})" if differ else ""
            raise ModelFileError(
                f"{where}: {path} does not fit the networks of these params: {difference}{hint}; "
                "set those params as the file was made, or start from a model of this shape"
            )
        states[role] = record["state_dict"]
    for role, state in states.items():
        nets[role].load_state_dict(state)
    log.info("starting from the model files in %s (fine-tuning)", directory.as_posix())
