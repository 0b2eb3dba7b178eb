"""evaluate: FID, KID and precision/recall of the EMA generator against the real val split.

Inputs: params ``seed``, ``devices``, ``determinism``, ``eval``; ``models/g_ema.pt``,
``data/val.lmdb``, and ``models/featurenet.pt`` (or the local Inception weights file of
``eval.inception_weights``). Where ``data/train.lmdb`` is present, its meta record must name
the same train/val pair as val's (both written by one prepare run). Both databases are
verified against the checksums prepare wrote (:func:`ganpipe.data.store.verify_lmdb`) first.
The generator must make the images (size, channels) and classes of val and of the feature
network: a mismatch stops the stage before any sample is drawn.
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

from pathlib import Path

from ganpipe import dist, runtime, scoring
from ganpipe.checkpoint import write_bytes_atomic
from ganpipe.data.store import check_pair, check_val_not_empty, read_meta
from ganpipe.params import Params
from stages._cli import TRAIN_LMDB, VAL_LMDB
from stages._launch import join, lock_outputs, verify_data

OUT = Path("metrics/eval/metrics.json")
CACHE = Path(".state/feature-cache")
G_EMA = Path("models/g_ema.pt")
FEATURENET = Path("models/featurenet.pt")


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
    # Before any process starts or any sample is generated: the files and how they fit.
    check_val_split()
    inputs = scoring.open_inputs(G_EMA, VAL_LMDB, FEATURENET, params.eval)
    context = join(params, "stages.evaluate")
    try:
        numerics = runtime.numerics_record(params.determinism, params.devices, context.device)
        record = scoring.score(inputs, params.eval, context, CACHE, numerics)
        if record is not None:
            write_bytes_atomic(scoring.record_bytes(record), OUT)
        context.barrier()
    finally:
        dist.teardown(context)


if __name__ == "__main__":
    _cli.run(main, __doc__)
