"""What every stage entry point shares: logging, params loading, clean user errors."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from ganpipe import cpu
from ganpipe.errors import USER_ERRORS
from ganpipe.params import Params, load_params

#: The splits the prepare stage writes (dvc.yaml outs), read by featurenet, train, evaluate.
TRAIN_LMDB = Path("data/train.lmdb")
VAL_LMDB = Path("data/val.lmdb")


def _parser(description: str | None = None, add_help: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description, add_help=add_help)
    parser.add_argument(
        "--params",
        type=Path,
        default=Path("params.yaml"),
        help="params file (default: params.yaml)",
    )
    return parser


def pin_cpu() -> None:
    """Pin the CPU numerics of ``determinism.cpu_isa`` (:func:`ganpipe.cpu.pin`) and select
    the GPUs of ``devices.gpus`` (:func:`ganpipe.cpu.pin_gpus`).

    A stage calls this when run as a program, before its imports load torch: the libraries
    under torch, and CUDA, read the pinned variables once, when they load. Invalid params,
    a CPU that cannot run the mode or a GPU list the environment contradicts exit with
    status 2 and one ``error:`` message, as :func:`run`.
    """
    if {"-h", "--help"} & set(sys.argv[1:]):
        return  # run() prints the help; nothing is computed, nothing needs pinning
    args, _ = _parser(add_help=False).parse_known_args()
    try:
        params = load_params(args.params)
        cpu.pin(params.determinism, params.devices)
        cpu.pin_gpus(params.devices)
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


def run(main: Callable[[Params], None], description: str) -> None:
    """Parse ``--params``, load and validate them, then call ``main``.

    User errors (bad params, unreadable data, a diverged run) print one message without a
    traceback and exit with status 2, so DVC and Prefect show the cause.
    """
    args = _parser(description).parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        main(load_params(args.params))
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
