"""Every stage entry point reports bad params in one message, before touching any output."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, dir_digest
from tests.helpers import run_stage, stage_env

# stage -> (a bad value in its own section, the key the message must name)
BAD = {
    "prepare": ("data: {image_size: '32'}", "data.image_size"),
    "train": ("train: {strategy: both}", "train.strategy"),
    "featurenet": ("featurenet: {epochs: 0}", "featurenet.epochs"),
    "generate": ("generate: {grid_rows: 0}", "generate.grid_rows"),
    "evaluate": ("eval: {num_samples: 1}", "eval.num_samples"),
}


def stage_outputs(stage: str) -> list[str]:
    """Paths dvc.yaml declares as the stage's outs, metrics and plots."""
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]
    return [
        next(iter(entry)) if isinstance(entry, dict) else entry
        for kind in ("outs", "metrics", "plots")
        for entry in spec.get(kind, [])
    ]


def test_every_stage_is_covered():
    assert set(BAD) == set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])


@pytest.mark.parametrize("stage", sorted(BAD))
def test_stage_reports_bad_params_without_traceback(tmp_path, stage):
    section, key = BAD[stage]
    (tmp_path / "params.yaml").write_text(f"seed: -1\n{section}\n")
    for output in stage_outputs(stage):  # the previous run's outputs must stay as they are
        (tmp_path / output).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / output).write_text("previous output\n")
    before = dir_digest(tmp_path)
    result = run_stage(tmp_path, stage)
    assert result.returncode == 2, result.stderr
    assert "params.yaml: 2 problem(s)" in result.stderr, result.stderr  # all, at once
    assert f"  - {key}: " in result.stderr and "  - seed: " in result.stderr
    assert "Traceback" not in result.stderr
    assert dir_digest(tmp_path) == before  # nothing created, nothing modified


@pytest.mark.parametrize(
    ("raised", "code"),
    [
        ("ganpipe.errors.UserError('data.path=x is missing; fix it')", 2),
        ("ValueError('an internal invariant broke')", 1),
        ("FileNotFoundError(2, 'No such file', 'somewhere')", 1),
    ],
)
def test_only_user_errors_are_one_line_anything_else_keeps_its_traceback(tmp_path, raised, code):
    """A bug inside the library (a plain ValueError, an unanticipated missing file) is not
    the user's mistake: it shows its traceback and exits 1; a UserError is one line, exit 2."""
    (tmp_path / "params.yaml").write_text("{}\n")
    script = (
        "import ganpipe.errors\n"
        "from stages import _cli\n"
        "def main(params):\n"
        f"    raise {raised}\n"
        "_cli.run(main, 'a stage')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=stage_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == code, result.stderr
    if code == 2:
        assert result.stderr.strip() == "error: data.path=x is missing; fix it"
    else:
        assert "Traceback (most recent call last)" in result.stderr
        assert "error:" not in result.stderr
