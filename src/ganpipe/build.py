"""Assembling a run's GAN from the params: networks, optimizers, loss, precision, EMA."""

from __future__ import annotations

import math
import warnings

import torch
from torch.utils.data import Dataset

from ganpipe import dist, runtime
from ganpipe.augment import AdaptiveP, Augment
from ganpipe.dist import DistContext
from ganpipe.ema import EmaGenerator
from ganpipe.featurenet import classes_for
from ganpipe.losses import build_loss
from ganpipe.nets import build_models
from ganpipe.params import Params, TrainParams
from ganpipe.strategies import Gan


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
        raise ValueError(
            f"model.conditional=true needs at least 2 classes, but the training set has "
            f"{classes}; set model.conditional false, or use labelled data (data.source "
            "folder with one subfolder per class, digits, mnist or cifar10)"
        )
    return classes


def build_gan(
    params: Params, context: DistContext | torch.device, num_classes: int | None = None
) -> tuple[Gan, EmaGenerator]:
    """G, D (DDP-wrapped when distributed), optimizers, loss, precision tools, EMA of G.

    The weights are a function of ``params.seed`` only (the same on every rank);
    ``num_classes`` (:func:`conditional_classes`) sizes a conditional model's embeddings.
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
    g, d, g_ema = g.to(device), d.to(device), g_ema.to(device)
    on_gpu = device.type == "cuda"
    if on_gpu:  # NHWC convolutions: cuDNN's faster kernels (benchmarks/gpu.py measures them);
        # in the numerics record, as they change the GPU bits
        g, d, g_ema = (net.to(memory_format=torch.channels_last) for net in (g, d, g_ema))
    sync_bn = params.model.norm == "sync_batch"
    g, d = dist.wrap(g, context, sync_bn), dist.wrap(d, context, sync_bn)

    # On a GPU: one kernel per step, its state on the device, and no host read under fp16
    # (the GradScaler hands a fused optimizer its inf test as a tensor): what a CUDA graph
    # needs (ganpipe.graphed). On CPU, the default kernels, as the CPU bits were (fused=None:
    # False would also turn the default for-each kernels off).
    fused = True if on_gpu else None
    if on_gpu:  # capturable optimizers warn on every step outside a capture; the warm-up
        # steps (and eager GPU runs) take those on purpose, with the same bits
        warnings.filterwarnings("ignore", "This instance was constructed with capturable=True")

    def optimizer(net: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(net.parameters(), lr=scaled_lr(lr, cfg), fused=fused)
        return torch.optim.Adam(
            net.parameters(), lr=scaled_lr(lr, cfg), betas=cfg.betas, fused=fused, capturable=on_gpu
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
