"""Atomic saving and safe loading of model files."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import logging
import pickle
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from ganpipe import cpu
from ganpipe.errors import UserError
from ganpipe.files import (
    TMP_MARK,
    NoSpaceError,
    file_sha256,
    free_space_text,
    size_text,
    write_bytes_atomic,  # where it was first: most callers import it from here
)

log = logging.getLogger(__name__)


def torch_bytes(obj: Any) -> bytes:
    """What ``torch.save`` writes for ``obj``, serialised in memory.

    ``torch.save`` embeds a file's name in the archive, so saving to a temporary name would
    make identical weights hash differently; bytes from memory hash the same everywhere.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save_atomic(obj: Any, path: Path) -> None:
    """``torch.save`` atomically (see :func:`torch_bytes`)."""
    write_bytes_atomic(torch_bytes(obj), path)


def load(path: Path, map_location: str | torch.device = "cpu") -> Any:
    """``torch.load`` with ``weights_only=True``: tensors and plain containers only, no code."""
    return torch.load(path, map_location=map_location, weights_only=True)


class ModelFileError(UserError):
    """A model file cannot be used: replaced, damaged, foreign, or not what its stage writes.

    The message names the file and the stage that writes it again.
    """


Net = TypeVar("Net")


def read_model_file(
    path: Path, build: Callable[[Any], Net], stage: str, fix: str | None = None
) -> Net:
    """Load the model file ``path`` (:func:`load`) and ``build`` the network it describes.

    Whatever fails, torch's own message is not shown: it reads like a bug in ganpipe, and for
    a file holding pickled objects it suggests ``weights_only=False``, which would run them.

    Args:
        path: A file the ``stage`` stage wrote with :func:`save_atomic`.
        build: Makes the network from the loaded record; any exception it raises (a missing
            key, a tensor of the wrong shape) means the file is not what ``stage`` writes.
        stage: The dvc.yaml stage that writes ``path``, named in the fix.
        fix: What the message tells to do instead of rerunning ``stage`` (for a copy of a
            stage's file that rerunning would not rewrite).

    Raises:
        ModelFileError: the file cannot be loaded or built from.
    """
    fix = fix or (
        f"run the {stage} stage again to rewrite it: `dvc repro {stage}` "
        f"(or `python -m stages.{stage}`)"
    )
    if not zipfile.is_zipfile(path):
        reason = "is not a file torch.save writes (replaced, truncated or damaged)"
    else:
        try:
            record = load(path)
        except pickle.UnpicklingError:
            reason = (
                "holds pickled Python objects besides tensors (made by other code?); it was "
                "refused unread, since loading it could run code"
            )
        except Exception as exc:  # torch's reader fails in many ways on a damaged archive
            reason = f"is damaged: torch cannot read it ({type(exc).__name__})"
        else:
            try:
                return build(record)
            except Exception as exc:  # KeyError, TypeError, load_state_dict's RuntimeError...
                reason = f"is not a model file of the {stage} stage ({_describe(exc)})"
    raise ModelFileError(f"{path} {reason}; {fix}")


def _describe(exc: BaseException, limit: int = 200) -> str:
    """``Type: message`` on one line, at most ``limit`` characters of the message."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


#: The train stage's model files (in models/), by role; a train.init_from folder holds them too.
MODEL_FILES = {"g": "generator.pt", "d": "discriminator.pt", "g_ema": "g_ema.pt"}


def init_files(directory: Path) -> dict[str, Path]:
    """The model files of the train.init_from folder ``directory``, by role (:data:`MODEL_FILES`).

    Raises:
        ModelFileError: one is missing; the message names it and what the folder holds.
    """
    files = {role: directory / name for role, name in MODEL_FILES.items()}
    missing = [path.name for path in files.values() if not path.is_file()]
    where, names = directory.as_posix(), " ".join(MODEL_FILES.values())
    fix = (
        f"it needs all of {names} as the train stage writes them to models/ (`mkdir -p {where} "
        f"&& cp models/{{{','.join(MODEL_FILES.values())}}} {where}/`), or set "
        "train.init_from null"
    )
    if not directory.is_dir():
        raise ModelFileError(f"train.init_from={where}: there is no folder {where}; {fix}")
    if missing:
        held = sorted(p.name for p in directory.iterdir()) or "nothing"
        raise ModelFileError(
            f"train.init_from={where}: {', '.join(missing)} missing (the folder holds {held}); "
            f"{fix}"
        )
    return files


def init_sha256(directory: Path) -> dict[str, str]:
    """sha256 of each model file of the train.init_from folder ``directory``, by file name."""
    return {path.name: file_sha256(path) for path in init_files(directory).values()}


# --- files with a sha256 header ---------------------------------------------------------


def hashed_bytes(obj: Any, magic: bytes) -> bytes:
    """``obj`` as ``torch.save`` bytes behind a header line: ``magic``, then their sha256.

    torch's zip reader does not check CRCs, so flipped bits inside tensor data would load
    without an error; :func:`read_hashed` checks the sha256 first.
    """
    payload = torch_bytes(obj)
    return magic + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload


def read_hashed(path: Path, magic: bytes, map_location: Any = "cpu") -> Any:
    """Load a file of :func:`hashed_bytes` after checking its sha256 (``weights_only``).

    Raises:
        CheckpointError: no ``magic`` header, or the bytes do not match their sha256.
        pickle.UnpicklingError: the file holds pickled objects besides tensors.
    """
    raw = path.read_bytes()
    header, _, payload = raw.partition(b"\n")
    if not header.startswith(magic):
        kind = magic.split(b" ")[0].decode()
        raise CheckpointError(f"{path} does not start with a {kind} header")
    expected = header[len(magic) :].decode("ascii", "replace")
    if hashlib.sha256(payload).hexdigest() != expected:
        raise CheckpointError(f"{path} is truncated or altered (sha256 mismatch)")
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)


# --- full-state training checkpoints ---------------------------------------------------

#: Training params that do not change the trained bits; a checkpoint survives changes to
#: them: the length of training (a run extended with a larger ``kimg`` resumes from its last
#: checkpoint), the intervals, worker processes, where the data is held, whether the
#: step is replayed from a CUDA graph, and the metrics measured while training.
NEUTRAL_TRAIN_KEYS = {
    "kimg",
    "checkpoint_kimg",
    "keep_checkpoints",
    "snapshot_kimg",
    "log_every_kimg",
    "num_workers",
    "resident_mb",
    "cuda_graph",  # a replay is the eager iteration's kernels on the same memory
    # measured on the EMA, outside every RNG stream of training
    "metrics_kimg",
    "metrics_num_samples",
}
CHECKPOINT_FORMAT = 2
#: The header of a checkpoint file (see :func:`hashed_bytes`).
MAGIC = b"ganpipe-checkpoint sha256="
REQUIRED_KEYS = {"format", "fingerprint", "iteration", "images_seen", "g", "d", "g_ema"}


class CheckpointError(UserError):
    """A checkpoint (or another file of :func:`hashed_bytes`) is damaged or foreign."""


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def code_digest() -> str:
    """sha256 of the ganpipe package's code and the torch version it runs on.

    The code is hashed as its syntax tree without docstrings: comments, formatting and
    documentation do not count, anything that runs does. New code must not resume a run
    of the old code, whose bits it might not reproduce.
    """
    package = Path(__file__).parent
    digest = hashlib.sha256(f"torch {torch.__version__}\n".encode())
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(source_digest(path.read_text(encoding="utf-8")).encode())
    return digest.hexdigest()


def source_digest(source: str) -> str:
    """sha256 of Python source as code: comments, formatting and docstrings do not count."""
    tree = _without_docstrings(ast.parse(source))
    return hashlib.sha256(ast.dump(tree, annotate_fields=False).encode()).hexdigest()


def run_fingerprint(
    params: Any, dataset_sha256: str, numerics: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """``(sha256, what it covers)`` of everything that changes the trained bits.

    Covered: ``seed``, ``precision``, the training set (its content hash ``dataset_sha256``,
    and ``data.image_size`` / ``data.channels``, which shape the networks), the content of
    the ``train.init_from`` model files (a run never resumes a fine-tune that started from
    other weights), the world size
    and collective backend, ``determinism``, ``model``, ``train`` but
    :data:`NEUTRAL_TRAIN_KEYS`, ``generate.grid_rows`` (the progress grids of the run's log
    are that size: a resumed run must log what an uninterrupted one logs), the
    ``numerics`` of :func:`ganpipe.runtime.numerics_record` (device type, CPU mode and the
    levels in use, threads, torch version; the CPU model in the native mode), the C
    library (its libm computes Python's float math) and the library's code.

    Not covered, so a change resumes the run: the other ``data`` keys (the content hash
    stands for them), GPU indices, node rank, rendezvous address and timeout, and the
    ``generate`` (but ``grid_rows``), ``featurenet`` and ``eval`` sections, which other
    stages read.
    """
    devices = params.devices
    backend = devices.backend
    if backend == "auto":
        backend = "nccl" if numerics["device"] == "cuda" else "gloo"
    train = params.train.model_dump(mode="json")
    relevant = {
        "seed": params.seed,
        "precision": params.precision,
        "data": {"image_size": params.data.image_size, "channels": params.data.channels},
        "dataset_sha256": dataset_sha256,
        "devices": {"world_size": devices.world_size, "backend": backend},
        "determinism": params.determinism.model_dump(mode="json"),
        "model": params.model.model_dump(mode="json"),
        "train": {k: v for k, v in train.items() if k not in NEUTRAL_TRAIN_KEYS},
        "generate": {"grid_rows": params.generate.grid_rows},
        "numerics": numerics,
        "libc": cpu.libc_version(),
        "code_sha256": code_digest(),
    }
    if params.train.init_from is not None:
        relevant["init_sha256"] = init_sha256(Path(params.train.init_from))
    text = json.dumps(relevant, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest(), relevant


def checkpoint_name(images_seen: int) -> str:
    """File name of the checkpoint taken after ``images_seen`` images (survives resizing)."""
    return f"ckpt-{images_seen:012d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints, newest first."""
    return sorted(run_dir.glob("ckpt-*.pt"), reverse=True)


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete the temporary files of writes that a kill interrupted; return them."""
    stale = sorted(run_dir.glob(f".ckpt-*.pt{TMP_MARK}*"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def save_checkpoint(state: dict[str, Any], run_dir: Path, images_seen: int, keep: int) -> Path:
    """Write a checkpoint atomically (with its sha256), then delete all but the newest ``keep``.

    The old checkpoints are deleted after the new one is written, so a crash never leaves
    fewer than ``keep``. Where the disk is too full for one more, those that this save
    would delete anyway are deleted first and the write is tried again, so a disk with room
    for ``keep`` checkpoints makes progress; with ``keep`` 1 the only checkpoint is never
    deleted before its successor is written.

    Raises:
        NoSpaceError: there is no room for the checkpoint even so; the message says how much
            it needs and where. The checkpoints on disk are intact.
    """
    path = run_dir / checkpoint_name(images_seen)
    data = hashed_bytes({"format": CHECKPOINT_FORMAT, **state}, MAGIC)
    try:
        write_bytes_atomic(data, path)
    except NoSpaceError as exc:
        doomed = list_checkpoints(run_dir)[max(keep - 1, 1) :]
        if not doomed:
            raise _no_space(exc, path, len(data), keep) from None
        for old in doomed:
            old.unlink(missing_ok=True)
        log.warning(
            "no room for %s (%s): deleted %s first, which keep_checkpoints=%d would delete "
            "after it, and writing it again",
            path,
            exc.strerror,
            ", ".join(p.name for p in doomed),
            keep,
        )
        try:
            write_bytes_atomic(data, path)
        except NoSpaceError as again:
            raise _no_space(again, path, len(data), keep) from None
    for old in list_checkpoints(run_dir)[keep:]:
        old.unlink(missing_ok=True)
    return path


def _no_space(exc: NoSpaceError, path: Path, size: int, keep: int) -> NoSpaceError:
    run_dir = path.parent
    kept = list_checkpoints(run_dir)
    aside = sorted(run_dir.glob("ckpt-*.pt.corrupt"))
    held = ""
    if kept:
        held = (
            f"; the {len(kept)} checkpoint(s) kept there use "
            f"{size_text(sum(p.stat().st_size for p in kept))} and stay until it is written"
        )
    if aside:
        held += (
            f"; {len(aside)} damaged one(s) set aside as *.corrupt use "
            f"{size_text(sum(p.stat().st_size for p in aside))} and may be deleted"
        )
    return NoSpaceError(
        f"writing {path} failed ({exc.strerror}): a checkpoint needs {size_text(size)} in "
        f"{run_dir}/ ({free_space_text(run_dir)}{held}). Free some space (with "
        f"train.keep_checkpoints={keep}, room for {max(keep, 2)} checkpoints is needed), "
        "then rerun train: it resumes from its newest checkpoint"
    )


def read_checkpoint(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a checkpoint after checking its sha256; ``weights_only``: pickled code is refused.

    Raises:
        CheckpointError: the file is truncated, altered or not a ganpipe checkpoint.
    """
    state = read_hashed(path, MAGIC, map_location)
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a format-{CHECKPOINT_FORMAT} ganpipe checkpoint")
    missing = REQUIRED_KEYS - state.keys()
    if missing:
        raise CheckpointError(f"{path} lacks {sorted(missing)}")
    return state


def load_newest_checkpoint(
    run_dir: Path,
    fingerprint: str | None = None,
    map_location: Any = "cpu",
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any] | None:
    """The newest checkpoint of the run that loads, or None.

    A checkpoint that fails to load (truncated, corrupt, foreign, pickled code) or that
    ``check`` rejects (it raises: tensors of other shapes than the run's networks, say) is
    renamed ``*.corrupt`` (kept for inspection, never pruned in place of a good one) with a
    warning naming it, and the previous one is tried. One made by another run (a different
    ``fingerprint``) is skipped with a warning.
    """
    for path in list_checkpoints(run_dir):
        try:
            state = read_checkpoint(path, map_location=map_location)
        except Exception as exc:  # a bad file must not stop the run from using an older one
            _set_aside(path, "cannot be loaded", exc)
            continue
        if fingerprint is not None and state["fingerprint"] != fingerprint:
            log.warning(
                "checkpoint %s belongs to run %s, not %s; trying the previous one",
                path,
                str(state["fingerprint"])[:16],
                fingerprint[:16],
            )
            continue
        if check is not None:
            try:
                check(state)
            except Exception as exc:  # a valid hash over contents that do not fit this run
                _set_aside(path, "does not fit this run", exc)
                continue
        state["path"] = str(path)
        return state
    return None


def _set_aside(path: Path, problem: str, exc: BaseException) -> None:
    aside = path.with_name(path.name + ".corrupt")
    path.replace(aside)
    log.warning(
        "checkpoint %s %s (%s); moved to %s, trying the previous one",
        path,
        problem,
        _describe(exc),
        aside.name,
    )
