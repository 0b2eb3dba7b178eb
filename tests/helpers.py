"""Helpers for tests that run the pipeline's stages as real processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def stage_env() -> dict[str, str]:
    """The environment of a stage subprocess: this repo importable, the venv's tools first."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }


def write_project(root: Path, base: dict, data_dir: Path | None = None, **sections) -> Path:
    """A project folder: ``base`` params updated per section, ``data`` linked to ``data_dir``.

    A dict value updates that section; any other value replaces the key.
    """
    params = json.loads(json.dumps(base))
    for name, values in sections.items():
        if isinstance(values, dict):
            params.setdefault(name, {}).update(values)
        else:
            params[name] = values
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    if data_dir is not None and not (root / "data").exists():
        (root / "data").symlink_to(data_dir)
    return root


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                found += [int(entry.name), *descendants(int(entry.name))]
    return found


class Recorder:
    """A training logger that keeps what the loop reports (``loop.TrainLogger``)."""

    def __init__(self):
        self.scalars, self.grids = [], []

    def log_scalars(self, images_seen, scalars):
        self.scalars.append((images_seen, scalars))

    def log_grid(self, images_seen, grid):
        self.grids.append((images_seen, grid.shape))
