"""Image grids: the same pixels as torchvision's make_grid, which they replace."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torchvision.utils import make_grid

from ganpipe.sampling import image_grid, to_uint8
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
    code = (
        "import sys, stages.train, stages.generate, stages.prepare; "
        "print(sorted(m for m in ('torchvision', 'torch._dynamo') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
