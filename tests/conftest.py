"""Shared helpers: tiny images made on the fly (tests never download anything)."""

from __future__ import annotations

import atexit
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path

from ganpipe import cpu
from ganpipe.params import DataParams, Params

# OpenMP's idle threads spin before they sleep (libgomp's default, read when torch loads).
# With two xdist workers and their stages on two cores, the spinning threads take the cores
# from the ones that compute: a 2-thread training costs several times its CPU (measured in
# the commit that added this). Passive waits change no result, only how a thread waits; the
# stage processes the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# In-process tests compute in the default (portable) CPU mode, like the stages: pinned
# before anything loads torch (configure_runtime refuses a process that was not).
cpu.pin(Params().determinism, Params().devices)

import numpy as np
import pytest
import torch
from PIL import Image

from ganpipe import runtime

# ... and with oneDNN off from the start, whatever order the tests run in.
runtime.apply_cpu_numerics(Params().determinism)

REPO = Path(__file__).resolve().parents[1]
# `import prefect` (the flows) creates ~/.prefect unless PREFECT_HOME is set. The tests get a
# home of their own, outside the repository (`make` points PREFECT_HOME at the user's
# .state/prefect, which holds their server's database): removed when the session ends.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="ganpipe-tests-prefect-")
atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], ignore_errors=True)


#: Where a test's start is kept: CPU seconds of this process and of the children it reaped.
_CPU_AT_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    """User + system CPU of this process and of every child process it has waited for."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's CPU seconds, setup to teardown, as the JUnit property ``cpu_s`` (the machine
    is CPU-bound under two xdist workers, so CPU, not wall time, says what a test costs;
    ``python -m tools.testtimes`` sums it per module). It counts the processes the test
    waited for: a server a module fixture started is counted in the test that stops it."""
    outcome = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        cpu_s = _cpu_seconds() - item.stash[_CPU_AT_START]
        outcome.get_result().user_properties.append(("cpu_s", f"{cpu_s:.2f}"))


@pytest.hookimpl(trylast=True)  # after pytest-xdist has tagged the groups
def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    check_xdist_groups(config, items)


def check_xdist_groups(config, items) -> None:
    """Under ``--dist loadgroup`` every ``xdist_group`` test must carry its group in its node
    id (how pytest-xdist routes a group to one worker). When it does not, xdist hands the
    tests of a shared server to both workers and they break each other, so stop at once.
    pytest 9.2 with pytest-xdist 3.8 loses the groups silently (pytest-xdist#1386)."""
    if not getattr(config.option, "loadgroup", False):  # set in xdist's workers only
        return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        message = (
            f"pytest-xdist ignored the xdist_group of {len(lost)} tests (e.g. {lost[0]}): this "
            "pytest/pytest-xdist pair breaks --dist loadgroup; use the versions in constraints.txt"
        )
        print(f"error: {message}", file=sys.__stderr__, flush=True)  # a worker's only way out
        pytest.exit(message, returncode=pytest.ExitCode.USAGE_ERROR)


def data_params(**data) -> DataParams:
    """``DataParams(**data)``; ``val_fraction=0`` (every image in train, which prepare_dataset
    allows) is set past the schema, which refuses it for the pipeline: featurenet and evaluate
    need a val split."""
    if data.get("val_fraction") == 0:
        return DataParams(**{**data, "val_fraction": 0.5}).model_copy(update={"val_fraction": 0.0})
    return DataParams(**data)


def solid_image(path: Path, color, size=(12, 10), mode="RGB", fmt=None) -> Path:
    """Write a one-colour image and return its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path, format=fmt)
    return path


def random_image(path: Path, seed: int, size=(12, 10)) -> Path:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture
def class_folder(tmp_path: Path) -> Path:
    """Two classes, three solid-colour images each."""
    root = tmp_path / "images"
    for i in range(3):
        solid_image(root / "cats" / f"c{i}.png", (10 * i, 20, 30))
        solid_image(root / "dogs" / f"d{i}.PNG", (200, 10 * i, 40))
    return root


@pytest.fixture(scope="session")
def digits16(tmp_path_factory) -> Path:
    """The digits at 16 px, half of them in val (split seed 4), prepared once per test
    process: read-only for the tests that share it."""
    from ganpipe.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("digits16")
    prepare_dataset(DataParams(image_size=16, val_fraction=0.5), 4, out, progress=False)
    return out


@pytest.fixture(scope="session")
def digits32(tmp_path_factory) -> Path:
    """``digits16`` at 32 px (the resnet family's smallest size), read-only as well."""
    from ganpipe.data.prepare import prepare_dataset

    out = tmp_path_factory.mktemp("digits32")
    prepare_dataset(DataParams(image_size=32, val_fraction=0.5), 4, out, progress=False)
    return out


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def dir_digest(path: Path) -> dict[str, bytes]:
    """File name -> bytes for every file under ``path`` (to prove nothing changed)."""
    return {
        os.path.relpath(p, path): Path(p).read_bytes()
        for p in sorted(path.rglob("*"))
        if Path(p).is_file()
    }
