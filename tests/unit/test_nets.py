"""DCGAN shapes, sizes, initialisation and activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from ganpipe.ema import EmaGenerator
from ganpipe.nets import build_models
from ganpipe.params import ModelParams


def count(net):
    return sum(p.numel() for p in net.parameters())


def test_paper_layout_at_64_pixels_matches_the_pytorch_example():
    g, d = build_models(ModelParams(g_width=64, d_width=64), 64, 3, torch.Generator())
    assert count(g) == 3_576_704 and count(d) == 2_765_568


@pytest.mark.parametrize("size", [16, 32, 64])
@pytest.mark.parametrize("norm", ["batch", "instance", "layer", "spectral", "none"])
def test_shapes_for_every_size_and_norm(size, norm):
    g, d = build_models(
        ModelParams(z_dim=8, g_width=4, d_width=4, norm=norm),
        size,
        1,
        torch.Generator().manual_seed(0),
    )
    images = g(torch.randn(3, 8))
    assert images.shape == (3, 1, size, size) and images.abs().max() <= 1
    assert d(images).shape == (3,)


def test_initialisation_is_the_papers_and_seeded():
    g, _ = build_models(ModelParams(), 64, 3, torch.Generator().manual_seed(0))
    weight = g.main[1][0].weight
    assert abs(weight.std().item() - 0.02) < 0.002 and abs(weight.mean().item()) < 0.002
    bn = g.main[1][1]
    assert abs(bn.weight.mean().item() - 1) < 0.01
    again, _ = build_models(ModelParams(), 64, 3, torch.Generator().manual_seed(0))
    assert torch.equal(weight, again.main[1][0].weight)


def checkpointed_step(norm: str, checkpointing: bool) -> dict[str, object]:
    """One forward of D(G(z)) and two backwards through the retained graph (as
    d_first_retain does): D's scores, the gradients and every buffer afterwards."""
    g, d = build_models(
        ModelParams(z_dim=8, g_width=8, d_width=8, norm=norm),
        32,
        3,
        torch.Generator().manual_seed(0),
        checkpointing,
    )
    z = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    scores = d(g(z))
    loss = scores.square().mean()
    loss.backward(retain_graph=True)  # recomputes every block ...
    loss.backward()  # ... and again, with the same recomputation contexts
    return {
        "scores": scores.detach(),
        "grads": [p.grad for p in [*g.parameters(), *d.parameters()]],
        "buffers": {
            **{f"g.{k}": v for k, v in g.named_buffers()},
            **{f"d.{k}": v for k, v in d.named_buffers()},
        },
    }


@pytest.mark.parametrize("norm", ["batch", "instance", "layer", "none"])
def test_activation_checkpointing_is_the_same_step_bit_for_bit(norm):
    without, with_ = checkpointed_step(norm, False), checkpointed_step(norm, True)
    assert torch.equal(without["scores"], with_["scores"])
    for a, b in zip(without["grads"], with_["grads"], strict=True):
        assert torch.equal(a, b)
    assert without["buffers"].keys() == with_["buffers"].keys()
    for name, value in without["buffers"].items():
        # BatchNorm's running statistics: the recomputation in backward used to update them
        # again (num_batches_tracked 2, running_mean off by ~2e-3), and g_ema copied them.
        assert torch.equal(value, with_["buffers"][name]), name
    tracked = [v for k, v in with_["buffers"].items() if k.endswith("num_batches_tracked")]
    assert len(tracked) == (5 if norm == "batch" else 0)  # G: 3, D: 2 (none on its first)
    assert all(int(v) == 1 for v in tracked)


def test_ema_follows_the_half_life():
    g, _ = build_models(ModelParams(z_dim=4, g_width=2), 16, 1, torch.Generator())
    ema = EmaGenerator(g, half_life_kimg=0.064)  # 64 images
    start = next(ema.parameters()).detach().clone()
    with torch.no_grad():
        for p in g.parameters():
            p.add_(1.0)
    ema.update(g, 64)  # one half-life: half way to the new weights
    torch.testing.assert_close(next(ema.parameters()), start + 0.5)
    assert not any(p.requires_grad for p in ema.parameters())
    assert "module.main.0.0.weight" in ema.state_dict()
    off = EmaGenerator(g, half_life_kimg=0)
    off.update(g, 64)
    torch.testing.assert_close(next(off.parameters()), next(g.parameters()))


def test_sync_batch_builds_the_batch_norm_layers_of_batch():
    """sync_batch is BatchNorm (converted to SyncBatchNorm by dist.wrap under DDP): same
    parameters, buffers and initial values as batch, from the same seed."""
    built = {}
    for norm in ("batch", "sync_batch"):
        g, d = build_models(
            ModelParams(z_dim=8, g_width=4, d_width=4, norm=norm),
            32,
            3,
            torch.Generator().manual_seed(0),
        )
        built[norm] = (g, d)
    for batch, sync in zip(built["batch"], built["sync_batch"], strict=True):
        want, got = batch.state_dict(), sync.state_dict()
        assert list(got) == list(want)
        assert any(k.endswith("running_var") for k in got)
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), key
        num_bn = sum(isinstance(m, torch.nn.BatchNorm2d) for m in batch.modules())
        converted = torch.nn.SyncBatchNorm.convert_sync_batchnorm(sync)
        assert sum(isinstance(m, torch.nn.SyncBatchNorm) for m in converted.modules()) == num_bn
        assert not any(type(m) is torch.nn.BatchNorm2d for m in converted.modules())
    g, d = built["batch"]
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in g.modules()) == 3  # 32 px: 3 blocks
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in d.modules()) == 2
