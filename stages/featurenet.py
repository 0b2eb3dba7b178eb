"""featurenet: train the feature network of the evaluation metrics on the real data.

Inputs: params ``determinism``, ``featurenet`` (``featurenet.seed``, not the training
``seed``: the feature network is part of the dataset's ruler) and of ``devices`` what chooses
the device and threads (``accelerator``, ``gpus``, ``cpu_threads``: one process, so a change
of the process count of the other stages keeps the ruler); ``data/train.lmdb``,
``data/val.lmdb`` (both verified against the checksums prepare wrote first,
:func:`ganpipe.data.store.verify_lmdb`).
Outputs: ``models/featurenet.pt`` (frozen weights), ``models/featurenet.sha256`` (their
hash, ``sha256sum`` format), ``metrics/featurenet.json`` (held-out accuracy). All written
atomically, under a lock on ``models/``: a second featurenet fails at once, naming the pid of
the first.
Command: ``python -m stages.featurenet``
"""

from __future__ import annotations

from stages import _cli

if __name__ == "__main__":
    _cli.pin_cpu()  # before the imports below load torch: its libraries read the pins once

import hashlib
import json
from pathlib import Path

from ganpipe import runtime
from ganpipe.checkpoint import torch_bytes, write_bytes_atomic
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.store import check_pair, check_val_not_empty, verify_lmdb
from ganpipe.featurenet import classes_for, record, train_featurenet
from ganpipe.files import locked_dir
from ganpipe.params import Params
from stages._cli import TRAIN_LMDB, VAL_LMDB

WEIGHTS = Path("models/featurenet.pt")
METRICS = Path("metrics/featurenet.json")


def main(params: Params) -> None:
    with locked_dir(WEIGHTS.parent, "featurenet"):
        train_and_save(params)


def train_and_save(params: Params) -> None:
    """Train the feature network and write its weights, their hash and its accuracy."""
    runtime.configure_runtime(params.featurenet.seed, params.devices, params.determinism)
    device = runtime.resolve_device(params.devices)
    for path in (TRAIN_LMDB, VAL_LMDB):
        verify_lmdb(path)
    train_set = LmdbImageDataset(TRAIN_LMDB)
    val_set = LmdbImageDataset(VAL_LMDB)
    check_pair(train_set.meta, val_set.meta, TRAIN_LMDB, VAL_LMDB)
    check_val_not_empty(val_set.meta, VAL_LMDB)
    val_set.class_counts()  # checked too: held-out accuracy compares its labels
    classes = classes_for(train_set.class_counts())
    shape = tuple(train_set.meta["shape"])
    result = train_featurenet(
        params.featurenet, params.featurenet.seed, train_set, val_set, classes, shape, device
    )
    data = torch_bytes(record(result, params.featurenet, shape))
    digest = hashlib.sha256(data).hexdigest()
    write_bytes_atomic(data, WEIGHTS)
    write_bytes_atomic(f"{digest}  {WEIGHTS.name}\n".encode(), WEIGHTS.with_suffix(".sha256"))
    metrics = {
        "task": result.task,
        "classes": result.num_classes,
        "features": result.net.num_features,
        "val_accuracy": result.val_accuracy,
        "train_accuracy": result.train_accuracy,
    }
    write_bytes_atomic((json.dumps(metrics, indent=2) + "\n").encode(), METRICS)


if __name__ == "__main__":
    _cli.run(main, __doc__)
