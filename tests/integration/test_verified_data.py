"""Data verified where it is read: a flipped byte in a record or in a header page,
or a truncated data.mdb, stops train, featurenet and evaluate with one `error:` line naming
the database and its fixes, exit status 2, before any output is created or changed. Real
stage subprocesses: a truncated file used to end the process with SIGBUS.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import yaml

from ganpipe.data.prepare import prepare_dataset
from ganpipe.data.store import (
    CHECKSUMS_FILE,
    PAGE_BYTES,
    DamagedDatasetError,
    record_key,
    verify_lmdb,
)
from ganpipe.params import DataParams
from tests.conftest import dir_digest, random_image
from tests.helpers import run_stage, sh, stage_env
from tests.integration.test_stage_errors import stage_outputs

DATA = {"source": "folder", "path": "images", "image_size": 16, "channels": 1}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A project whose data/ holds a complete train/val pair of tiny images."""
    root = tmp_path_factory.mktemp("pristine")
    for i in range(12):
        random_image(root / "images" / f"c{i % 2}" / f"{i}.png", seed=i)
    data = DataParams(**DATA, val_fraction=0.25)
    prepare_dataset(data, 0, root / "data", root=root, progress=False)
    # Params train and featurenet would run with (tiny), were the data intact.
    params = {
        "data": {**DATA, "val_fraction": 0.25},
        "devices": {"accelerator": "cpu", "cpu_threads": 1},
        "model": {"z_dim": 4, "g_width": 4, "d_width": 4},
        "train": {"batch_size": 4, "kimg": 0.008, "ema_kimg": 0},
        "featurenet": {"epochs": 1, "batch_size": 4},
    }
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return root


def flip_in_record(db: Path) -> str:
    """Flip a byte in the pixels of record 1, found in the file by its bytes (in each copy:
    LMDB's copy-on-write leaves earlier versions of a leaf page in its free pages)."""
    env = lmdb.open(str(db), readonly=True, lock=False, subdir=True)
    with env.begin() as txn:
        value = txn.get(record_key(1))
    env.close()
    data = bytearray((db / "data.mdb").read_bytes())
    at = data.find(value)
    assert at > 2 * PAGE_BYTES  # not in LMDB's meta pages
    while at != -1:
        data[at + len(value) // 2] ^= 0x40
        at = data.find(value, at + 1)
    (db / "data.mdb").write_bytes(bytes(data))
    return "data.mdb differs from what prepare wrote in 1 of its 1 blocks"


def flip_in_header(db: Path) -> str:
    """Flip a byte of the second LMDB meta page (its map size field)."""
    data = bytearray((db / "data.mdb").read_bytes())
    data[PAGE_BYTES + 16 + 16] ^= 0x01
    (db / "data.mdb").write_bytes(bytes(data))
    return "data.mdb differs from what prepare wrote in 1 of its 1 blocks"


def truncate(db: Path) -> str:
    size = (db / "data.mdb").stat().st_size
    os.truncate(db / "data.mdb", size // 2)
    return f"data.mdb has {size // 2:,} bytes but prepare wrote {size:,} (truncated)"


DAMAGE = {"record": flip_in_record, "header": flip_in_header, "truncated": truncate}
#: The split each stage's case damages: featurenet verifies train first, so val shows that
#: the second database is verified too.
SPLIT = {"train": "train", "featurenet": "val", "evaluate": "val"}


def project_with_previous_outputs(pristine: Path, root: Path, stage: str) -> Path:
    shutil.copytree(pristine, root)
    for output in [*stage_outputs(stage), "checkpoints/abc/ckpt-000001.pt"]:
        (root / output).parent.mkdir(parents=True, exist_ok=True)
        if not (root / output).exists():
            (root / output).write_text("previous output\n")
    return root


def check_refused(result: subprocess.CompletedProcess, db: str, words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: {db}: {words}"), errors
    assert errors[0].endswith(
        f"; restore it with `dvc checkout --force {db}`, or rebuild it with `dvc repro -f prepare`"
    ), errors


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("stage", sorted(SPLIT))
def test_damaged_data_stops_the_stage_before_any_output(tmp_path, pristine, stage, damage):
    root = project_with_previous_outputs(pristine, tmp_path / "project", stage)
    db = f"data/{SPLIT[stage]}.lmdb"
    words = DAMAGE[damage](root / db)
    before = dir_digest(root)
    result = run_stage(root, stage, timeout=300)
    check_refused(result, db, words)
    assert dir_digest(root) == before  # nothing created, nothing changed (data/ included)


def test_evaluate_verifies_the_train_split_beside_val(tmp_path, pristine):
    """evaluate reads train's meta record (the pair check): train is verified too."""
    root = project_with_previous_outputs(pristine, tmp_path / "project", "evaluate")
    words = flip_in_record(root / "data/train.lmdb")
    before = dir_digest(root)
    check_refused(run_stage(root, "evaluate", timeout=300), "data/train.lmdb", words)
    assert dir_digest(root) == before


def test_distributed_train_verifies_before_launching_workers(tmp_path, pristine):
    root = project_with_previous_outputs(pristine, tmp_path / "project", "train")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["devices"].update(nproc_per_node=2, cpu_threads=1)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    words = truncate(root / "data/train.lmdb")
    before = dir_digest(root)
    result = run_stage(root, "train", timeout=300)
    check_refused(result, "data/train.lmdb", words)
    assert "launching" not in result.stderr  # no torchrun started
    assert dir_digest(root) == before


def test_a_database_made_before_verification_says_to_rebuild_it(tmp_path, pristine):
    root = project_with_previous_outputs(pristine, tmp_path / "project", "featurenet")
    (root / "data/train.lmdb" / CHECKSUMS_FILE).unlink()
    before = dir_digest(root)
    result = run_stage(root, "featurenet", timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (
        "error: data/train.lmdb has no checksums.json: it was written before ganpipe verified "
        "its data (rebuild it with `dvc repro -f prepare`), or the file was removed (restore "
        "it with `dvc checkout --force data/train.lmdb`)"
    )
    assert dir_digest(root) == before


TRUNCATED_READER = """
import os, sys
from pathlib import Path
from ganpipe.data.dataset import LmdbImageDataset
from ganpipe.data.store import DatasetError
path = Path(sys.argv[1])
os.truncate(path / "data.mdb", (path / "data.mdb").stat().st_size // 2)
try:
    LmdbImageDataset(path).uint8_array()
except DatasetError as exc:
    print(exc)
    sys.exit(2)
"""


def test_opening_a_truncated_database_unverified_is_an_error_not_sigbus(tmp_path, pristine):
    # Without verify_lmdb, reading a mapped page beyond the end of the file would kill the
    # process (SIGBUS): the reader checks the file's size against LMDB's last page first.
    db = shutil.copytree(pristine / "data/train.lmdb", tmp_path / "train.lmdb")
    size = json.loads((db / CHECKSUMS_FILE).read_text())["bytes"]
    result = subprocess.run(
        [sys.executable, "-c", TRUNCATED_READER, str(db)],
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout.strip() == (
        f"{db}: data.mdb has {size // 2:,} bytes but its pages reach byte {size:,} (truncated); "
        f"restore it with `dvc checkout --force {db}`, or rebuild it with `dvc repro -f prepare`"
    )


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["record", "truncated"])
def test_the_dvc_command_the_error_names_restores_the_data(tmp_path, monkeypatch, pristine, damage):
    """DVC refuses to overwrite a modified output without --force: the command the message
    gives must be the one that works, run as given."""
    root = tmp_path / "project"
    shutil.copytree(pristine / "data", root / "data")
    sh(["git", "init", "-q"], root)
    sh(["dvc", "init", "-q"], root)
    sh(["dvc", "add", "-q", "data/train.lmdb"], root)
    DAMAGE[damage](root / "data/train.lmdb")
    monkeypatch.chdir(root)
    with pytest.raises(DamagedDatasetError) as info:
        verify_lmdb(Path("data/train.lmdb"))
    command = re.search(r"restore it with `([^`]+)`", str(info.value)).group(1)
    sh(command.split(), root)
    verify_lmdb(Path("data/train.lmdb"))
