"""Every stage entry point reports bad params in one message, before touching any output."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import REPO, dir_digest
from tests.helpers import run_stage

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
