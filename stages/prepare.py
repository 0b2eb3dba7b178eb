"""prepare: turn data.source into data/train.lmdb and data/val.lmdb.

Inputs: params ``data`` (``data.split_seed`` chooses the split); the files under
``data.path`` (if any).
Outputs: ``data/train.lmdb``, ``data/val.lmdb`` (built in temporary folders, renamed when
complete). The stage holds a lock on ``data/`` while it runs: a second prepare fails at once,
naming the pid of the first. Leftovers of a killed run are deleted first.
Command: ``python -m stages.prepare``
"""

from __future__ import annotations

from pathlib import Path

from ganpipe.data.prepare import prepare_dataset
from ganpipe.params import Params
from stages import _cli


def main(params: Params) -> None:
    prepare_dataset(params.data, params.data.split_seed, Path("data"))


if __name__ == "__main__":
    _cli.run(main, __doc__)
