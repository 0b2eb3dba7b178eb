"""One tiny DVC project, reproduced once per test run and copied by the tests that start
from a built pipeline (each `dvc repro` of it costs half a minute here). Under pytest-xdist
the first worker that needs it builds it, under a file lock, and the others wait and share it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from filelock import FileLock

from tests.helpers import clone_working_tree, sh

#: params.yaml updates of the e2e projects: every stage runs in seconds on 1 CPU thread.
TINY = {
    "seed": 1,
    "data": {"image_size": 32},
    "devices": {"cpu_threads": 1},
    "model": {"z_dim": 8, "g_width": 4, "d_width": 4},
    "train": {
        "batch_size": 16,
        "kimg": 0.128,
        "snapshot_kimg": 0.064,
        "log_every_kimg": 0.032,
        "metrics_kimg": 0.064,
        "metrics_num_samples": 64,
    },
    "generate": {
        "grid_rows": 2,
        "num_images": 4,
        "interpolation_steps": 3,
        "interpolation_rows": 2,
    },
    "featurenet": {"epochs": 1},
    "eval": {"num_samples": 64, "kid_subset_size": 32, "kid_subsets": 5, "batch_size": 32},
}
#: Overrides of every experiment the e2e tests make: FID while training (train.metrics_kimg)
#: is measured by the baseline's `dvc repro` (test_report reads its curves); in an experiment
#: it would only cost time (at TINY's 0.064 a 6-kimg run measures FID 94 times).
NO_TRAIN_METRICS = {"train.metrics_kimg": 0}
#: The same as ``dvc exp run -S`` arguments.
NO_TRAIN_METRICS_ARGS = tuple(a for k, v in NO_TRAIN_METRICS.items() for a in ("-S", f"{k}={v}"))


@pytest.fixture(scope="session")
def tiny_baseline(tmp_path_factory, worker_id) -> Path:
    """A TINY clone after `dvc repro`, with dvc.lock and the outputs' cache committed.

    Tests only read it (or copy it); what that `dvc repro` printed is ``../first-repro.txt``.
    """
    if worker_id == "master":  # no xdist: this session's own folder
        return build_baseline(tmp_path_factory.mktemp("baseline"))
    shared = tmp_path_factory.getbasetemp().parent / "baseline"  # common to this run's workers
    with FileLock(f"{shared}.lock"):
        if not (shared / "built").exists():
            build_baseline(shared)
            (shared / "built").touch()
    return shared / "clone"


def build_baseline(folder: Path) -> Path:
    root = clone_working_tree(folder / "clone", TINY)
    first = sh(["dvc", "repro"], root)
    (folder / "first-repro.txt").write_text(first.stdout)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "baseline"], root)
    return root


@pytest.fixture
def built(tiny_baseline, tmp_path) -> Path:
    """A copy of the reproduced baseline of this test's own (git, DVC cache, outputs)."""
    return copy_project(tiny_baseline, tmp_path / "clone")


def copy_project(source: Path, destination: Path) -> Path:
    """Copy a DVC project but its ``.dvc/tmp`` (locks, and a state database keyed by path)."""
    dvc_dir = source / ".dvc"

    def ignore(folder: str, names: list[str]) -> list[str]:
        return ["tmp"] if Path(folder) == dvc_dir else []

    shutil.copytree(source, destination, symlinks=True, ignore=ignore)
    return destination
