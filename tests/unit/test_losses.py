"""Losses and penalties against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ganpipe.losses import (
    bce_d,
    bce_g,
    build_loss,
    gradient_penalty,
    hinge_d,
    mean_score_g,
    r1_penalty,
    wasserstein_d,
)
from ganpipe.params import TrainParams

REAL = torch.tensor([2.0, -1.0])
FAKE = torch.tensor([0.0, 3.0])


def test_bce():
    # -log σ(2), -log σ(-1); -log(1 - σ(0)), -log(1 - σ(3))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected_d = (-math.log(sig(2)) - math.log(sig(-1))) / 2 + (
        -math.log(1 - sig(0)) - math.log(1 - sig(3))
    ) / 2
    assert bce_d(REAL, FAKE).item() == pytest.approx(expected_d, rel=1e-6)
    expected_g = (-math.log(sig(0)) - math.log(sig(3))) / 2
    assert bce_g(FAKE).item() == pytest.approx(expected_g, rel=1e-6)


def test_bce_is_finite_for_huge_logits():
    assert torch.isfinite(bce_d(torch.tensor([1e4]), torch.tensor([-1e4])))
    assert bce_g(torch.tensor([-200.0])).item() == pytest.approx(200.0)


def test_hinge_and_wasserstein():
    # relu(1-2)=0, relu(1+1)=2 -> 1; relu(1+0)=1, relu(1+3)=4 -> 2.5
    assert hinge_d(REAL, FAKE).item() == pytest.approx(3.5)
    assert wasserstein_d(REAL, FAKE).item() == pytest.approx(1.5 - 0.5)
    assert mean_score_g(FAKE).item() == pytest.approx(-1.5)


class Linear(nn.Module):
    """D(x) = w · x: its input gradient is w everywhere."""

    def __init__(self, w):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w))

    def forward(self, x):
        return (x.flatten(1) * self.w).sum(1)


def test_gradient_penalty_and_r1_on_a_linear_critic():
    d = Linear([3.0, 4.0])  # ||w|| = 5
    real, fake = torch.randn(6, 2, 1, 1), torch.randn(6, 2, 1, 1)
    assert gradient_penalty(d, real, fake, 10.0).item() == pytest.approx(10 * (5 - 1) ** 2)
    assert r1_penalty(d, real, 0.2).item() == pytest.approx(0.1 * 25)
    # the penalties are differentiable w.r.t. D's weights: d/dw of γ/2 ||w||² = γ w
    r1_penalty(d, real, 0.2).backward()
    torch.testing.assert_close(d.w.grad, torch.tensor([0.6, 0.8]))


def test_build_loss_adds_the_configured_penalties():
    d = Linear([3.0, 4.0])
    x = torch.randn(4, 2, 1, 1)
    assert build_loss(TrainParams()).penalty is None
    wgan = build_loss(TrainParams(loss="wgan_gp", gp_weight=2.0))
    assert wgan.penalty(d, x, x).item() == pytest.approx(2 * 16)
    both = build_loss(TrainParams(loss="hinge", r1_gamma=1.0))
    assert both.penalty(d, x, x).item() == pytest.approx(12.5)
