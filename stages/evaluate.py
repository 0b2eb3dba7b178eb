"""evaluate: FID, KID and precision/recall of the EMA generator against the real val split.

Inputs: params ``seed``, ``devices``, ``determinism``, ``eval``; ``models/g_ema.pt``,
``data/val.lmdb``, and ``models/featurenet.pt`` (or the local Inception weights file of
``eval.inception_weights``). Where ``data/train.lmdb`` is present, its meta record must name
the same train/val pair as val's (both written by one prepare run). Both databases are
verified against the checksums prepare wrote (:func:`ganpipe.data.store.verify_lmdb`) first.
Outputs: ``metrics/eval/metrics.json`` (``fid``, ``kid``, ``kid_std``, ``precision``,
``recall`` and what they were computed from, with ``ruler``: the feature extractor's and the
val split's sha256, which every comparable experiment shares; written atomically). Real-image
features are cached in ``.state/feature-cache/``. While it runs, the stage holds a lock on
``metrics/eval/`` (covering the cache too): a second evaluate fails at once, naming the pid
of the first.
Command: ``python -m stages.evaluate`` (with ``devices.nproc_per_node > 1`` it runs under
torchrun and each process generates its share of the samples).
"""

from __future__ import annotations

from stages import _cli

if __name__ == "__main__":
    _cli.pin_cpu()  # before the imports below load torch: its libraries read the pins once

import json
import logging
import time
from pathlib import Path

import torch

from ganpipe import dist, evaluation, runtime
from ganpipe.checkpoint import write_bytes_atomic
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.store import check_pair, check_val_not_empty, read_meta
from ganpipe.params import Params
from ganpipe.sampling import num_classes_of, sample_labels
from stages._cli import TRAIN_LMDB, VAL_LMDB
from stages._launch import join, lock_outputs, verify_data
from stages.generate import load_generator

log = logging.getLogger("stages.evaluate")
OUT = Path("metrics/eval/metrics.json")
CACHE = Path(".state/feature-cache")


def extractor_for(params: Params) -> torch.nn.Module:
    cfg = params.eval
    if cfg.feature_extractor == "inception":
        return evaluation.load_inception(cfg.inception_weights, cfg.inception_sha256)
    return evaluation.load_featurenet(Path("models/featurenet.pt"))


def check_val_split(train_verified: bool = False) -> None:
    """Refuse a val split that is damaged, empty or not the pair of the train split beside
    it, if any.

    Only val's records are read, but the generator was trained on train: the two must come
    from one prepare run (see :func:`ganpipe.data.store.check_pair`). Each database read
    here is verified first (:func:`stages._launch.verify_data`), train's unless the caller
    has just done so (``train_verified``).
    """
    verify_data(VAL_LMDB)
    val_meta = read_meta(VAL_LMDB)
    check_val_not_empty(val_meta, VAL_LMDB)
    if (TRAIN_LMDB / "data.mdb").exists():
        if not train_verified:
            verify_data(TRAIN_LMDB)
        check_pair(read_meta(TRAIN_LMDB), val_meta, TRAIN_LMDB, VAL_LMDB)


def main(params: Params) -> None:
    with lock_outputs(OUT.parent, "evaluate"):
        evaluate(params)


def evaluate(params: Params) -> None:
    """Compute the metrics and write them (and the feature cache)."""
    cfg = params.eval
    check_val_split()  # before any process starts or any sample is generated
    context = join(params, "stages.evaluate")
    try:
        began = time.perf_counter()
        numerics = runtime.numerics_record(params.determinism, params.devices, context.device)
        extractor = extractor_for(params)
        g, model = load_generator(Path("models/g_ema.pt"))
        num_classes = num_classes_of(g)
        n, world = cfg.num_samples, context.world_size
        mine = range(context.rank * n // world, (context.rank + 1) * n // world)

        def features(net: torch.nn.Module) -> torch.Tensor:
            local = evaluation.generated_features(
                g,
                net,
                cfg.seed,
                mine,
                model.z_dim,
                cfg.batch_size,
                context.device,
                progress=context.is_main,
                num_classes=num_classes,
            )
            shards = context.gather_objects(local)  # a collective: every rank calls it
            return torch.cat(shards) if context.is_main else local

        fake = features(extractor)
        classifier = classified = None
        if num_classes is not None:
            # Class accuracy needs the feature network's classifier, whatever the extractor.
            classifier = evaluation.load_featurenet(Path("models/featurenet.pt"))
            classified = fake if classifier.digest == extractor.digest else features(classifier)
        if context.is_main:
            val = LmdbImageDataset(VAL_LMDB)
            real = evaluation.real_features(
                extractor,
                val,
                val.meta["content_sha256"],
                cfg.batch_size,
                context.device,
                CACHE,
                numerics=json.dumps(numerics, sort_keys=True),
            )
            metrics = evaluation.all_metrics(
                real, fake, cfg.kid_subsets, cfg.kid_subset_size, cfg.pr_k, cfg.seed
            )
            if num_classes is not None:
                labels = sample_labels(range(n), num_classes)
                per_class = evaluation.fid_per_class(
                    real, torch.from_numpy(val.labels()), fake, labels
                )
                metrics["class_accuracy"] = evaluation.class_accuracy(
                    classifier, classified, labels
                )
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
            record = {
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
            write_bytes_atomic((json.dumps(record, indent=2) + "\n").encode(), OUT)
        context.barrier()
    finally:
        dist.teardown(context)


if __name__ == "__main__":
    _cli.run(main, __doc__)
