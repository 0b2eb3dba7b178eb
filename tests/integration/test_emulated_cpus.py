"""The portable CPU mode's promise where it can fail: other processors.

``qemu-x86_64`` (Debian's qemu-user) runs this venv's Python as an Intel Haswell (AVX2, no
AVX-512) and as an AMD EPYC-Rome (vendor AuthenticAMD: MKL dispatches by vendor). It
emulates IEEE arithmetic exactly and computes the approximate ``rcpps``/``rsqrtps``
exactly too, where a real CPU uses its own tables: an op whose result depends on them
differs between the emulated CPUs and this one. The featurenet, train, generate and
evaluate stages (tiny) run on each; in the portable mode every output file is identical
to the native run's, in the native mode they are not.

Under emulation every image and every iteration costs 10-50x its native time, so the runs
are as small as still reach every op: 128 of the digits (``few_digits``), two feature
network steps, four training iterations. Whether bits agree does not depend on how many
images or steps computed them. The emulated processes wait for work passively (libgomp
spins otherwise, and every spin is emulated): that changes when a thread runs, not what
it computes.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ganpipe import cpu
from ganpipe.data.prepare import prepare_dataset
from ganpipe.data.sources import list_digits
from ganpipe.params import DataParams
from tests.helpers import debian_program, stage_env, write_project

pytestmark = pytest.mark.slow

QEMU = "qemu-x86_64"
#: An Intel CPU without AVX-512 and an AMD one (both with AVX2 and FMA).
CPUS = ("Haswell", "EPYC-Rome")
#: Every stage that computes in float, as small as they run: a few seconds natively, the
#: emulation is 10-50x slower.
TINY = {
    "seed": 3,
    "data": {"image_size": 16, "val_fraction": 0.5},
    "devices": {"cpu_threads": 2},
    "model": {"z_dim": 8, "g_width": 8, "d_width": 8},
    "train": {
        "batch_size": 32,
        "kimg": 0.128,
        "snapshot_kimg": 1,
        "log_every_kimg": 0.128,
        "metrics_kimg": 0,
        "ema_kimg": 0.1,
    },
    "featurenet": {"width": 4, "epochs": 1, "batch_size": 32},
    "generate": {"grid_rows": 2, "num_images": 4, "interpolation_rows": 1},
    "eval": {"num_samples": 64, "batch_size": 64, "kid_subsets": 4, "kid_subset_size": 64},
}
#: The stages' outputs (dvc.yaml's outs and metrics; measurements/ is timing, not bits).
OUTPUTS = ("models", "samples", "metrics")
PORTABLE = {"determinism": {"cpu_isa": "portable"}}
#: The native control's stage.
ONE = ("featurenet",)


#: How many of the digits the emulated runs train and measure on (half in val).
NUM_IMAGES = 128


@pytest.fixture(scope="module")
def few_digits(tmp_path_factory) -> Path:
    """The first NUM_IMAGES digits at 16 px, half of them in val (split seed 4): the
    ``digits16`` fixture's images, fewer of them (a class folder of their pixels)."""
    listing = list_digits()
    folder = tmp_path_factory.mktemp("few_digits")
    for name, label, pixels in zip(
        listing.names[:NUM_IMAGES], listing.labels, listing.payloads, strict=False
    ):
        (folder / "images" / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.asarray(pixels)).save(folder / "images" / str(label) / f"{name}.png")
    data = DataParams(source="folder", path="images", image_size=16, val_fraction=0.5)
    prepare_dataset(data, 4, folder / "data", root=folder, progress=False)
    return folder / "data"


@pytest.fixture(scope="session")
def qemu() -> str:
    """Debian's qemu-user, installed with apt-get (as root) when it is missing."""
    return str(debian_program(QEMU, "qemu-user", pytest.skip))


def run_stages(root: Path, emulate: list[str], stages: tuple[str, ...] = ()) -> dict[str, str]:
    """Run ``stages`` (default: featurenet, train, generate, evaluate) in ``root`` under the
    command prefix ``emulate`` (none: this CPU); the sha256 of every output file, by path."""
    env = {k: v for k, v in stage_env().items() if k not in cpu.NUMERICS_ENV}
    # libgomp's idle threads otherwise spin between parallel regions (each spin emulated):
    # waiting passively changes when a thread runs, not what it computes
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    result = subprocess.run(
        [*emulate, sys.executable, "-m", "tests.integration.stages_in_one", *stages],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for folder in OUTPUTS
        for path in sorted((root / folder).rglob("*"))
        if path.is_file()
    }


def differing(a: dict[str, str], b: dict[str, str]) -> list[str]:
    assert a.keys() == b.keys()
    return sorted(name for name in a if a[name] != b[name])


@pytest.fixture(scope="module")
def here(tmp_path_factory, few_digits) -> dict[str, str]:
    """The portable outputs on this CPU, the reference."""
    root = write_project(tmp_path_factory.mktemp("here"), TINY, few_digits, **PORTABLE)
    outputs = run_stages(root, [])
    assert {"models/g_ema.pt", "models/featurenet.pt", "metrics/eval/metrics.json"} <= set(outputs)
    assert any(name.startswith("samples/images/") for name in outputs)
    return outputs


@pytest.mark.parametrize("model", CPUS)
def test_portable_bits_are_the_same_on_an_emulated_cpu(tmp_path, few_digits, qemu, here, model):
    there = run_stages(write_project(tmp_path, TINY, few_digits, **PORTABLE), [qemu, "-cpu", model])
    assert differing(here, there) == []


def test_native_bits_are_not(tmp_path, few_digits, qemu):
    """The control: the native mode takes what each CPU offers (this CPU's widest ISA against the
    emulated AMD's AVX2, oneDNN's convolutions, MKL's per-vendor code), and its bits differ
    from the first trained weights on: the feature network is enough to show it (oneDNN's
    code runs slowly under emulation)."""
    native = {"determinism": {"cpu_isa": "native"}}
    here = run_stages(write_project(tmp_path / "here", TINY, few_digits, **native), [], ONE)
    rome = write_project(tmp_path / "rome", TINY, few_digits, **native)
    there = run_stages(rome, [qemu, "-cpu", "EPYC-Rome"], ONE)
    # the weights differ (their accuracy, metrics/featurenet.json, may round the same)
    assert {"models/featurenet.pt", "models/featurenet.sha256"} <= set(differing(here, there))
