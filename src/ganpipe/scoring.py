"""Scoring a generator file against a val split: the computation of the evaluate stage and of
``ganpipe evaluate``, one function for both.

:func:`open_inputs` reads the generator, the feature extractor and the val split's meta
record and checks that they fit (:func:`ganpipe.modelfile.check_fits`) before any sample is
drawn; :func:`score` computes the metrics record (:mod:`ganpipe.evaluation`), sharing the
generated samples among the processes of a distributed run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ganpipe import evaluation
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.store import check_val_not_empty, read_meta
from ganpipe.dist import DistContext
from ganpipe.featurenet import Embedding
from ganpipe.modelfile import GeneratorFile, check_fits, read_generator
from ganpipe.params import EvalParams
from ganpipe.sampling import sample_labels

log = logging.getLogger(__name__)


@dataclass
class EvalInputs:
    """What a generator is scored with: checked against each other by :func:`open_inputs`."""

    generator: GeneratorFile
    extractor: nn.Module
    """The feature network (:class:`~ganpipe.featurenet.Embedding`) or the Inception."""
    classifier: Embedding | None
    """The feature network, for a conditional generator's class accuracy (else None)."""
    val_path: Path
    val_meta: dict[str, Any]


def load_extractor(cfg: EvalParams, featurenet: Path) -> nn.Module:
    """The extractor of ``eval.feature_extractor``: the feature network of the file
    ``featurenet``, or the Inception of ``eval.inception_weights`` (hash-checked).

    Raises:
        ExtractorError: the file is missing, damaged, altered or foreign.
    """
    if cfg.feature_extractor == "inception":
        return evaluation.load_inception(cfg.inception_weights, cfg.inception_sha256)
    return evaluation.load_featurenet(featurenet)


def open_inputs(model: Path, val: Path, featurenet: Path, cfg: EvalParams) -> EvalInputs:
    """Load the generator of ``model``, the extractor of ``eval.feature_extractor`` (the
    feature network of ``featurenet``, or the Inception of ``eval.inception_weights``) and
    the meta record of ``val``, and check that they fit.

    Raises:
        ExtractorError, ModelFileError, DatasetError: a file is missing, damaged or foreign
            (the message names it and the stage that writes it).
        ModelMismatchError: the generator's images or classes do not fit the data or the
            feature network (:func:`ganpipe.modelfile.check_fits`).
    """
    val_meta = read_meta(val)
    check_val_not_empty(val_meta, val)
    extractor = load_extractor(cfg, featurenet)
    generator = read_generator(model)
    own = extractor if isinstance(extractor, Embedding) else None  # the feature network's
    classifier = None
    if generator.num_classes is not None:
        # Class accuracy needs the feature network's classifier, whatever the extractor.
        classifier = own if own is not None else evaluation.load_featurenet(featurenet)
    check_fits(generator, val, val_meta, featurenet, classifier if own is None else own)
    return EvalInputs(generator, extractor, classifier, val, val_meta)


def score(
    inputs: EvalInputs,
    cfg: EvalParams,
    context: DistContext,
    cache_dir: Path | None,
    numerics: dict[str, Any],
) -> dict[str, Any] | None:
    """The metrics record of ``inputs.generator`` (on rank 0; None on the other ranks).

    Each process generates its share of ``eval.num_samples`` samples (sample ``i``'s latent
    from ``(eval.seed, i)``); rank 0 gathers their features, extracts (or reads from
    ``cache_dir``) the val split's, and computes ``fid``, ``kid``, ``kid_std``, ``precision``,
    ``recall`` (and for a conditional generator ``class_accuracy``, ``fid_per_class``,
    ``fid_per_class_mean``). The record names what the metrics were measured with: the
    sample counts and the ``ruler`` (the extractor, its sha256 and the val split's content
    sha256), so that only records of one ruler are compared.
    """
    began = time.perf_counter()
    g, extractor, classifier = inputs.generator, inputs.extractor, inputs.classifier
    n, world = cfg.num_samples, context.world_size
    mine = range(context.rank * n // world, (context.rank + 1) * n // world)

    def features(net: nn.Module) -> torch.Tensor:
        local = evaluation.generated_features(
            g.net,
            net,
            cfg.seed,
            mine,
            g.model.z_dim,
            cfg.batch_size,
            context.device,
            progress=context.is_main,
            num_classes=g.num_classes,
        )
        shards = context.gather_objects(local)  # a collective: every rank calls it
        return torch.cat(shards) if context.is_main else local

    fake = features(extractor)
    classified = None
    if classifier is not None:
        classified = fake if classifier.digest == extractor.digest else features(classifier)
    if not context.is_main:
        return None
    val = LmdbImageDataset(inputs.val_path)
    real = evaluation.real_features(
        extractor,
        val,
        val.meta["content_sha256"],
        cfg.batch_size,
        context.device,
        cache_dir,
        numerics=json.dumps(numerics, sort_keys=True),
    )
    metrics = evaluation.all_metrics(
        real, fake, cfg.kid_subsets, cfg.kid_subset_size, cfg.pr_k, cfg.seed
    )
    if g.num_classes is not None:
        labels = sample_labels(range(n), g.num_classes)
        per_class = evaluation.fid_per_class(real, torch.from_numpy(val.labels()), fake, labels)
        metrics["class_accuracy"] = evaluation.class_accuracy(classifier, classified, labels)
        metrics["fid_per_class"] = per_class
        metrics["fid_per_class_mean"] = sum(per_class.values()) / max(1, len(per_class))
        log.info(
            "class accuracy %.4f, FID per class %s",
            metrics["class_accuracy"],
            ", ".join(f"{k}: {v:.3f}" for k, v in metrics["fid_per_class"].items()),
        )
    log.info(
        "fid %.4f  kid %.5f ± %.5f  precision %.4f  recall %.4f (%.1f s)",
        metrics["fid"],
        metrics["kid"],
        metrics["kid_std"],
        metrics["precision"],
        metrics["recall"],
        time.perf_counter() - began,
    )
    return {
        **metrics,
        "num_real": len(real),
        "num_generated": cfg.num_samples,
        # What the metrics were measured with: experiments compare only with the same.
        "ruler": {
            "extractor": cfg.feature_extractor,
            "extractor_sha256": extractor.digest,
            "val_sha256": val.meta["content_sha256"],
        },
    }


def record_bytes(record: dict[str, Any]) -> bytes:
    """The bytes of ``metrics/eval/metrics.json`` for a metrics record of :func:`score`."""
    return (json.dumps(record, indent=2) + "\n").encode()
