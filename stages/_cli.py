"""What every stage entry point shares: logging, params loading, clean user errors."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from ganpipe.data.convert import BadImageError
from ganpipe.data.sources import SourceError
from ganpipe.data.store import DatasetError
from ganpipe.params import Params, ParamsError, load_params

#: The splits the prepare stage writes (dvc.yaml outs), read by featurenet, train, evaluate.
TRAIN_LMDB = Path("data/train.lmdb")
VAL_LMDB = Path("data/val.lmdb")

#: Errors caused by the user's params or files: reported in one message, exit status 2.
USER_ERRORS = (
    ParamsError,
    SourceError,
    DatasetError,
    BadImageError,
    ValueError,
    FileNotFoundError,
    FloatingPointError,
)


def run(main: Callable[[Params], None], description: str) -> None:
    """Parse ``--params``, load and validate them, then call ``main``.

    User errors (bad params, unreadable data, a diverged run) print one message without a
    traceback and exit with status 2, so DVC and Prefect show the cause.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--params",
        type=Path,
        default=Path("params.yaml"),
        help="params file (default: params.yaml)",
    )
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        main(load_params(args.params))
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
