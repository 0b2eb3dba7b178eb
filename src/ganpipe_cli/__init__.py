"""The ``ganpipe`` command: sample, score and inspect a model file outside the pipeline.

::

    ganpipe generate --model models/g_ema.pt --seeds 0-999 --out DIR [--truncation T] [--class C]
    ganpipe evaluate --model models/g_ema.pt [--data data/val.lmdb]
                     [--featurenet models/featurenet.pt] [--out metrics.json]
    ganpipe info models/g_ema.pt [--json]

A package beside the library rather than inside it: ``ganpipe`` reads no argv and prints
nothing (STYLE.md), this is the thin layer that does, as ``stages/`` is for the pipeline.
It calls the library functions the stages call (:func:`ganpipe.sampling.sample_pngs`,
:func:`ganpipe.scoring.score`, :func:`ganpipe.modelfile.describe`), pins the CPU numerics
before torch loads as the stages do (the params of ``--params FILE``, else the defaults, so
the bits are the stages'), and reports user errors as they do: one ``error:`` line and exit
status 2 (:data:`ganpipe.errors.USER_ERRORS`). Output into a pipe whose reader has gone
(``| head -1``) ends quietly, with status 141 as SIGPIPE gives other commands. Nothing here
imports torch at module level.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from ganpipe import cpu
from ganpipe.errors import USER_ERRORS, UserError
from ganpipe.params import GenerateParams, Params, load_params

#: Most images one ``ganpipe generate`` draws (as ``generate.num_images``).
MAX_IMAGES = 1_000_000


class UsageError(UserError):
    """A command-line value does not fit the model file (``--class`` of an unconditional
    generator, say): the message names the option, the value and the fix."""


def parse_seeds(text: str) -> list[int]:
    """``0-999`` or ``0,5,10-19``: the sample indices, in order, each once.

    Raises:
        argparse.ArgumentTypeError: not such a list, or more than :data:`MAX_IMAGES`.
    """
    indices: dict[int, None] = {}
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected sample indices such as 0-999 or 0,5,10-19"
            )
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise argparse.ArgumentTypeError(f"{part.strip()!r}: the range ends before it starts")
        if len(indices) + high - low + 1 > MAX_IMAGES:
            raise argparse.ArgumentTypeError(f"{text!r}: more than {MAX_IMAGES:,} images")
        indices.update(dict.fromkeys(range(low, high + 1)))
    return list(indices)


def parse_truncation(text: str) -> float:
    """``--truncation``: a number in the range of ``generate.truncation``.

    Raises:
        argparse.ArgumentTypeError: not a number, or out of that range (0 would never end:
            every latent value would be redrawn forever).
    """
    try:
        return GenerateParams(truncation=float(text)).truncation
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].lower()
        raise argparse.ArgumentTypeError(f"{text!r}: {reason} (as generate.truncation)") from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None


def _pinned_params(path: Path | None) -> Params:
    """The params of ``--params`` (or the defaults), with the CPU numerics and GPUs they
    choose pinned before torch loads (:func:`ganpipe.cpu.pin`, as ``stages._cli.pin_cpu``)."""
    params = Params() if path is None else load_params(path)
    cpu.pin(params.determinism, params.devices)
    cpu.pin_gpus(params.devices)
    return params


def _device(params: Params):
    """Configure the runtime as a stage's only process does; return its device."""
    from ganpipe import runtime

    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    return runtime.resolve_device(params.devices)


def generate(args: argparse.Namespace) -> None:
    """Write samples ``--seeds`` of ``--model`` into ``--out``."""
    params = _pinned_params(args.params)
    # Imported here, after the pins: these load torch, whose libraries read them once.
    from ganpipe.checkpoint import write_bytes_atomic
    from ganpipe.modelfile import read_generator
    from ganpipe.sampling import sample_pngs

    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} is a file; name a folder for the images")
    device = _device(params)
    generator = read_generator(args.model)
    if args.class_ is not None:
        if generator.num_classes is None:
            raise UsageError(
                f"--class {args.class_}: {args.model} is unconditional (trained without "
                "model.conditional); leave --class out"
            )
        if not 0 <= args.class_ < generator.num_classes:
            raise UsageError(
                f"--class {args.class_}: {args.model} draws classes 0..{generator.num_classes - 1}"
                "; choose one of them"
            )
    truncation = params.generate.truncation if args.truncation is None else args.truncation
    pngs = sample_pngs(
        generator.net.to(device),
        generator.model.z_dim,
        args.seeds,
        params.generate.seed,
        truncation,
        label=args.class_,
    )
    for name, data in pngs:
        write_bytes_atomic(data, args.out / name)
    print(f"wrote {len(args.seeds)} images to {args.out}/")


def evaluate(args: argparse.Namespace) -> None:
    """Score ``--model`` against ``--data`` in ``--featurenet``'s space; print the record."""
    params = _pinned_params(args.params)
    from ganpipe import runtime, scoring  # after the pins, as in generate()
    from ganpipe.checkpoint import write_bytes_atomic
    from ganpipe.data.store import verify_lmdb
    from ganpipe.dist import DistContext

    verify_lmdb(args.data)  # as the stage does: damaged data is an error, never a score
    inputs = scoring.open_inputs(args.model, args.data, args.featurenet, params.eval)
    device = _device(params)
    numerics = runtime.numerics_record(params.determinism, params.devices, device)
    record = scoring.score(inputs, params.eval, DistContext(device=device), args.cache, numerics)
    data = scoring.record_bytes(record)
    if args.out is not None:
        write_bytes_atomic(data, args.out)
    sys.stdout.write(data.decode())


def info(args: argparse.Namespace) -> None:
    """Print what a model file says about itself (no numerics pinned: nothing is computed)."""
    from ganpipe.modelfile import describe

    described = describe(args.path)
    if args.json:
        print(json.dumps(described, indent=2))
        return
    shown: dict[str, object] = {}
    for key, value in described.items():
        if key == "image_size":
            shown["resolution"] = f"{value}x{value} px"
        elif key == "num_classes" and value is None:
            shown[key] = "none (unconditional)"
        elif key == "kimg" and value is None:
            shown[key] = "not recorded (a file from before ganpipe recorded it)"
        elif key == "num_parameters":
            shown[key] = f"{value:,}"
        else:
            shown[key] = value
    for key, value in shown.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for inner, item in value.items():
                print(f"  {inner + ':':<22}{json.dumps(item) if isinstance(item, dict) else item}")
        else:
            print(f"{key + ':':<16}{value}")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``ganpipe``: one sub-command per function above."""
    parser = argparse.ArgumentParser(
        prog="ganpipe", description="Sample, score and inspect ganpipe model files."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, run: Callable[[argparse.Namespace], None], text: str):
        sub = commands.add_parser(name, help=text, description=text)
        sub.set_defaults(run=run)
        return sub

    def params_option(sub: argparse.ArgumentParser, what: str) -> None:
        sub.add_argument(
            "--params",
            type=Path,
            help=f"params file whose determinism, devices and {what} sections apply "
            "(default: ganpipe's defaults; the stages' params.yaml gives the stages' bits)",
        )

    gen = command(
        "generate",
        generate,
        "Write samples of a generator as PNG files: sample N is NNNNNN.png (a conditional "
        "generator's <class>/NNNNNN.png), its latent drawn from (generate.seed, N) as in the "
        "generate stage's samples/images/.",
    )
    gen.add_argument("--model", type=Path, required=True, help="model file (models/g_ema.pt)")
    gen.add_argument(
        "--seeds", type=parse_seeds, required=True, help="sample indices: 0-999 or 0,5,10-19"
    )
    gen.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder for the images (created; files of other names in it are left alone)",
    )
    gen.add_argument(
        "--truncation",
        type=parse_truncation,
        help="redraw latent values beyond +-T (default: generate.truncation)",
    )
    gen.add_argument(
        "--class",
        dest="class_",
        type=int,
        help="draw every sample for this class (conditional generators only)",
    )
    params_option(gen, "generate")

    ev = command(
        "evaluate",
        evaluate,
        "FID, KID, precision and recall of a generator against a val split, computed as the "
        "evaluate stage computes them (in one process); prints the metrics record as JSON.",
    )
    ev.add_argument("--model", type=Path, required=True, help="model file (models/g_ema.pt)")
    ev.add_argument(
        "--data", type=Path, default=Path("data/val.lmdb"), help="default: data/val.lmdb"
    )
    ev.add_argument(
        "--featurenet",
        type=Path,
        default=Path("models/featurenet.pt"),
        help="feature network (default: models/featurenet.pt, beside its .sha256)",
    )
    ev.add_argument("--out", type=Path, help="also write the record to this JSON file")
    ev.add_argument(
        "--cache",
        type=Path,
        help="folder caching the real images' features (the stage's: .state/feature-cache)",
    )
    params_option(ev, "eval")

    inf = command(
        "info",
        info,
        "Show what a model file holds: network, architecture, resolution, kimg, number of "
        "parameters and the numerics it was computed with.",
    )
    inf.add_argument("path", type=Path, help="a model file (models/g_ema.pt, featurenet.pt...)")
    inf.add_argument("--json", action="store_true", help="print it as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``ganpipe COMMAND ...``; user errors exit with status 2 and one ``error:`` line."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        args.run(args)
        sys.stdout.flush()  # here, where a reader that has gone is caught below
    except USER_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:
        # The reader of the output has closed it (`ganpipe info FILE | head -1`): stop
        # quietly with the status of a Unix tool that SIGPIPE ended. stdout goes to
        # /dev/null first, or Python's own flush at exit would fail again and say so.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)
