"""Helpers for tests that run the pipeline's stages as real processes."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


def stage_env() -> dict[str, str]:
    """The environment of a stage subprocess: this repo importable, the venv's tools first.

    ``src`` comes first so that the subprocess imports this tree's ``ganpipe`` even where the
    venv's editable install points at another checkout (a git worktree).
    """
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }


def free_port() -> int:
    """A loopback port nobody listens on (the kernel's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_stage(root: Path, stage: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m stages.STAGE`` in the project ``root``, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", f"stages.{stage}"],
        cwd=root,
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_stage(root: Path, stage: str = "train") -> subprocess.Popen:
    """``python -m stages.STAGE`` started in the project ``root``, output piped as text."""
    return subprocess.Popen(
        [sys.executable, "-m", f"stages.{stage}"],
        cwd=root,
        env=stage_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def sh(args: list[str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command with the venv's tools first, DVC analytics off and a git identity."""
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "DVC_NO_ANALYTICS": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(
            f"{args} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def clone_working_tree(root: Path, params_update: dict) -> Path:
    """This working tree's tracked and unignored files, committed in a fresh repository.

    ``params_update`` updates params.yaml per section (a dict value updates that section,
    any other value replaces the key); ``dvc.lock`` is dropped so every stage runs.
    """
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = REPO / os.fsdecode(name)
        if source.is_file():
            (root / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / os.fsdecode(name))
    params = yaml.safe_load((root / "params.yaml").read_text())
    for section, values in params_update.items():
        if isinstance(values, dict):
            params[section].update(values)
        else:
            params[section] = values
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "dvc.lock").unlink(missing_ok=True)
    sh(["git", "init", "-q", "-b", "main"], root)
    sh(["git", "add", "-A"], root)
    sh(["git", "commit", "-qm", "tiny"], root)
    return root


def experiments(project: Path) -> dict[str, dict]:
    """Named experiments of ``dvc exp show --json`` in ``project``: name -> ``params``
    (params.yaml, nested), ``metrics`` (file -> nested values), ``rev``."""
    found = {}
    for commit in json.loads(sh(["dvc", "exp", "show", "--json"], project).stdout):
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs") or []:
                data = rev.get("data") or {}
                found[rev.get("name") or exp.get("name")] = {
                    "params": ((data.get("params") or {}).get("params.yaml") or {}).get("data"),
                    "metrics": {p: e.get("data") for p, e in (data.get("metrics") or {}).items()},
                    "rev": rev.get("rev"),
                }
    return found


#: The tiny run every test starts from (:func:`tiny_params`): the digits at 16 px, half of
#: them in val (the ``digits16`` fixture's data), small networks on one CPU thread, a few
#: iterations, no FID while training (it needs a feature network).
TINY = {
    "seed": 0,
    "data": {"image_size": 16, "val_fraction": 0.5},
    "devices": {"cpu_threads": 1},
    "model": {"z_dim": 8, "g_width": 4, "d_width": 4},
    "train": {"batch_size": 16, "kimg": 0.16, "log_every_kimg": 0.032, "metrics_kimg": 0},
    "generate": {"grid_rows": 2},
}

#: ``model`` keys of the resnet family at its smallest size, 32 px, with a few channels per
#: resolution (the ``digits32`` fixture's data).
TINY_RESNET = {
    "arch": "resnet",
    "g_channels": {4: 8, 8: 8, 16: 4, 32: 4},
    "d_channels": {4: 8, 8: 4, 16: 4},
}


def updated(base: dict, sections: dict) -> dict:
    """A copy of the params ``base`` with ``sections`` applied: a dict value updates that
    section, any other value replaces the key."""
    params = json.loads(json.dumps(base))
    for name, values in sections.items():
        if isinstance(values, dict):
            params.setdefault(name, {}).update(values)
        else:
            params[name] = values
    return params


def tiny_params(**sections) -> dict:
    """:data:`TINY` with ``sections`` applied (:func:`updated`), e.g.
    ``tiny_params(seed=3, train={"kimg": 0.32})``: params.yaml's content as a dict."""
    return updated(TINY, sections)


def write_project(root: Path, base: dict, data_dir: Path | None = None, **sections) -> Path:
    """A project folder: ``base`` params updated per section (:func:`updated`), ``data``
    linked to ``data_dir``."""
    params = updated(base, sections)
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
    """A training logger that keeps what the loop reports (``trainlog.TrainLogger``)."""

    def __init__(self):
        self.scalars, self.grids = [], []

    def log_scalars(self, images_seen, scalars):
        self.scalars.append((images_seen, scalars))

    def log_grid(self, images_seen, grid):
        self.grids.append((images_seen, grid.shape))


def graph_features(channels: int) -> dict[str, dict]:
    """The configurations a captured training step must handle besides the plain one
    (params sections to update; resnet at 32 px with ``channels`` per resolution), for the
    tests of ganpipe.graphed on CPU and on a GPU."""
    widths = dict.fromkeys((4, 8, 16, 32), channels)
    return {
        "plain": {},
        "r1_augment_ada": {
            "model": {"norm": "instance"},
            "train": {
                "r1_gamma": 1.0,
                "augment": "color+translation+cutout",
                "augment_p": 0.5,
                "augment_target": 0.6,
            },
        },
        "wgan_gp_n_critic_accum": {
            "model": {"norm": "layer"},
            "train": {"loss": "wgan_gp", "n_critic": 2, "grad_accum": 2},
        },
        "resnet_conditional": {
            "data": {"image_size": 32},
            "model": {
                "arch": "resnet",
                "conditional": True,
                "g_channels": widths,
                "d_channels": widths,
            },
        },
    }


def debian_program(
    program: str, package: str, unavailable: Callable[[str], NoReturn] = pytest.fail
) -> Path:
    """``program`` (a path, or a name on PATH), installing Debian's ``package`` with apt-get
    (as root) when it is missing; ``unavailable(reason)`` when it cannot be had."""
    found = shutil.which(program)
    if found:
        return Path(found)
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        unavailable(
            f"{program} is missing and this test cannot install it (needs apt-get as root): "
            f"install Debian's `{package}` package"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for args in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "-o", "DPkg::Lock::Timeout=300", package],
    ):
        result = subprocess.run(args, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.fail(
                f"`{' '.join(args)}` failed ({result.returncode}); install Debian's `{package}` "
                f"package by hand:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
            )
    found = shutil.which(program)
    assert found, f"apt-get installed {package} but {program} is missing"
    return Path(found)
