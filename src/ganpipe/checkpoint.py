"""Atomic saving and safe loading of model files."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch


def write_bytes_atomic(data: bytes, path: Path) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename over ``path``.

    A reader (or a crash) sees the old file or the new one, never a partial one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


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


# --- full-state training checkpoints ---------------------------------------------------

#: Params that do not change the trained bits; a checkpoint survives changes to them.
NEUTRAL_KEYS = {
    "train": {
        "kimg",
        "checkpoint_kimg",
        "keep_checkpoints",
        "snapshot_kimg",
        "log_every_kimg",
        "num_workers",
    },
    "devices": {"gpus", "node_rank", "rdzv_endpoint", "backend", "timeout_s"},
    "generate": {"seed"},
}
CHECKPOINT_FORMAT = 1


def code_digest() -> str:
    """sha256 of the ganpipe package's source: new code must not resume old runs."""
    import hashlib

    package = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def run_fingerprint(params: Any) -> tuple[str, dict[str, Any]]:
    """``(sha256, what it covers)`` of everything that changes the trained bits.

    That is the params (training length, intervals, worker counts and addresses left out:
    a run extended with a larger ``train.kimg`` resumes from its last checkpoint) and the
    library's source code (after a code change DVC reruns the stage, and it must train
    with the new code rather than resume the old run).
    """
    import hashlib
    import json

    relevant = params.model_dump(mode="json")
    for section, keys in NEUTRAL_KEYS.items():
        relevant[section] = {k: v for k, v in relevant[section].items() if k not in keys}
    relevant["devices"]["world_size"] = params.devices.world_size
    relevant["code_sha256"] = code_digest()
    text = json.dumps(relevant, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest(), relevant


def checkpoint_name(images_seen: int) -> str:
    """File name of the checkpoint taken after ``images_seen`` images (survives resizing)."""
    return f"ckpt-{images_seen:012d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoints, newest first."""
    return sorted(run_dir.glob("ckpt-*.pt"), reverse=True)


def save_checkpoint(state: dict[str, Any], run_dir: Path, images_seen: int, keep: int) -> Path:
    """Write a checkpoint atomically, then delete all but the newest ``keep``."""
    path = run_dir / checkpoint_name(images_seen)
    save_atomic({"format": CHECKPOINT_FORMAT, **state}, path)
    for old in list_checkpoints(run_dir)[keep:]:
        old.unlink(missing_ok=True)
    return path


def load_newest_checkpoint(run_dir: Path, map_location: Any = "cpu") -> dict[str, Any] | None:
    """The newest checkpoint of the run that loads, or None.

    A checkpoint that fails to load (truncated, corrupt, foreign) is skipped with a
    warning naming it, and the previous one is tried. Loading is ``weights_only``: a file
    carrying pickled code is refused, never executed.
    """
    import logging

    log = logging.getLogger(__name__)
    for path in list_checkpoints(run_dir):
        try:
            state = load(path, map_location=map_location)
        except Exception as exc:  # a bad file must not stop the run from using an older one
            log.warning(
                "checkpoint %s cannot be loaded (%s: %s); trying the previous one",
                path,
                type(exc).__name__,
                str(exc).splitlines()[0][:200],
            )
            continue
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            log.warning("checkpoint %s is not a ganpipe checkpoint; trying the previous one", path)
            continue
        state["path"] = str(path)
        return state
    return None
