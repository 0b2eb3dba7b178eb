"""Image grids: the same pixels as torchvision's make_grid, which they replace."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torchvision.utils import make_grid

from ganpipe.nets import build_generator
from ganpipe.params import ModelParams
from ganpipe.sampling import export_pngs, image_grid, to_uint8
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("num", "channels", "per_row"), [(1, 1, 4), (6, 1, 4), (8, 3, 4), (5, 3, 8), (9, 1, 3)]
)
def test_grid_equals_torchvision_make_grid(num, channels, per_row):
    images = torch.rand(num, channels, 5, 7, generator=torch.Generator().manual_seed(num)) * 2 - 1
    expected = make_grid(to_uint8(images), nrow=per_row, padding=2, pad_value=0)
    grid = image_grid(images, per_row)
    assert grid.dtype == expected.numpy().dtype
    assert (grid == expected.permute(1, 2, 0).numpy()).all()
    assert grid.shape == tuple(expected.permute(1, 2, 0).shape)


def test_stage_imports_leave_torchvision_and_dynamo_out():
    """torchmetrics pulls both in (seconds of start-up): only a computed FID/KID imports it,
    so a stage that refuses its inputs (evaluate too) stops at once. dvclive (requests,
    dvc's modules) likewise: only the training rank that logs opens it, not the launcher nor
    the other ranks."""
    code = (
        "import sys, stages.train, stages.generate, stages.prepare, stages.featurenet, "
        "stages.evaluate, ganpipe_cli; "
        "print(sorted(m for m in ('torchvision', 'torch._dynamo', 'dvclive') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_exported_images_are_written_through_a_folder_link(tmp_path):
    """samples/images moved to a bigger disk and linked: the new set is built beside the
    link's target and swapped in there; the link stays a link."""
    g = build_generator(ModelParams(z_dim=8, g_width=4), 16, 1).eval()
    target, link = tmp_path / "disk" / "images", tmp_path / "samples" / "images"
    export_pngs(g, 8, 3, 0, target, progress=False)
    link.parent.mkdir()
    link.symlink_to(target)
    export_pngs(g, 8, 5, 0, link, progress=False)
    assert link.is_symlink()
    assert sorted(p.name for p in target.iterdir()) == [f"{i:06d}.png" for i in range(5)]
    assert [p.name for p in link.parent.iterdir()] == ["images"]
    assert [p.name for p in target.parent.iterdir()] == ["images"]
