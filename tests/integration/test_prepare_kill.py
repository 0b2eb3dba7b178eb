"""SIGKILL the prepare stage at random moments: never a database a later stage would accept
other than the previous good one or the complete new one, and never a train/val pair of two
runs that the pair check would accept."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from ganpipe.data.store import DatasetError, check_pair, read_meta, verify_lmdb
from tests.conftest import dir_digest
from tests.helpers import stage_env


def run_prepare(project: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "stages.prepare"],
        cwd=project,
        env=stage_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def write_params(project: Path, seed: int) -> None:
    """Params whose split is chosen by ``seed`` (data.split_seed: the training seed plays no
    part in prepare)."""
    params = {
        "data": {
            "source": "folder",
            "path": "images",
            "image_size": 32,
            "channels": 3,
            "split_seed": seed,
        },
    }
    (project / "params.yaml").write_text(yaml.safe_dump(params))


@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_a_bad_database(tmp_path):
    rng = np.random.default_rng(0)
    project = tmp_path / "project"
    for i in range(1500):
        pixels = rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)
        path = project / "images" / f"class{i % 3}" / f"{i:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(path)

    write_params(project, seed=0)
    assert run_prepare(project).wait() == 0
    old = {s: dir_digest(project / "data" / f"{s}.lmdb") for s in ("train", "val")}

    # The complete new result, built elsewhere, to compare against.
    reference = tmp_path / "reference"
    reference.mkdir()
    (reference / "images").symlink_to(project / "images")
    write_params(reference, seed=1)
    start = time.perf_counter()
    assert run_prepare(reference).wait() == 0
    duration = time.perf_counter() - start
    new = {s: dir_digest(reference / "data" / f"{s}.lmdb") for s in ("train", "val")}
    assert new != old

    write_params(project, seed=1)
    delays = [random.Random(k).uniform(0.05, duration) for k in range(6)]
    outcomes = []
    for delay in delays:
        proc = run_prepare(project)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        states = {}
        for split in ("train", "val"):
            final = project / "data" / f"{split}.lmdb"
            if final.exists():
                state = dir_digest(final)
                assert state in (old[split], new[split]), f"{split} after kill at {delay:.2f}s"
                states[split] = "new" if state == new[split] else "old"
                read_meta(final)  # a present database is always complete
            outcomes.append(states.get(split, "missing"))
        if len(states) == 2:
            metas = [read_meta(project / "data" / f"{s}.lmdb") for s in ("train", "val")]
            if states["train"] == states["val"]:
                check_pair(*metas)
            else:  # killed between the two swaps: the readers of both splits refuse it
                with pytest.raises(DatasetError, match="different prepare runs"):
                    check_pair(*metas)
        for leftover in (project / "data").iterdir():
            if leftover.name in ("train.lmdb", "val.lmdb"):
                continue
            assert leftover.name.startswith("."), leftover  # hidden temporaries only
            try:
                read_meta(leftover)
                verify_lmdb(leftover)  # its checksums are written last of all
            except DatasetError:
                continue  # unfinished: refused by every reader
            # A complete leftover is the previous database, killed between swap and delete.
            assert dir_digest(leftover) in (*old.values(), *new.values())
        # Go back to the old output for the next round, as a user rerunning would not need.
        if "new" in outcomes[-2:]:
            write_params(project, seed=0)
            assert run_prepare(project).wait() == 0
            write_params(project, seed=1)
    assert "missing" not in outcomes  # the swap is atomic: the path never goes missing
    assert "old" in outcomes  # some kills landed before the swap
    assert run_prepare(project).wait() == 0
    assert {s: dir_digest(project / "data" / f"{s}.lmdb") for s in ("train", "val")} == new
    assert sorted(p.name for p in (project / "data").iterdir()) == ["train.lmdb", "val.lmdb"]
