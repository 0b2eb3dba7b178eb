"""Differentiable augmentation: the operations by hand, the draws, and every strategy's use."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from ganpipe import augment, runtime
from ganpipe.augment import Augment, color, cutout, translate
from ganpipe.losses import bce_d, bce_g, build_loss
from ganpipe.params import TrainParams, parse_params
from ganpipe.strategies import STRATEGIES, Batch, Gan

POLICY = ("color", "translation", "cutout")


def test_translation_shifts_whole_pixels_and_fills_zeros():
    x = torch.arange(2 * 8 * 8, dtype=torch.float64).view(2, 1, 8, 8)
    # s = round(8 / 8) = 1: u * 3 floored, minus 1: 0.99 -> +1, 0.0 -> -1, 0.5 -> 0
    out = translate(x, torch.tensor([0.99, 0.0]), torch.tensor([0.5, 0.99]))
    down = torch.zeros(8, 8, dtype=torch.float64)
    down[1:] = x[0, 0, :-1]
    up_right = torch.zeros(8, 8, dtype=torch.float64)
    up_right[:-1, 1:] = x[1, 0, 1:, :-1]
    assert torch.equal(out[0, 0], down) and torch.equal(out[1, 0], up_right)


def test_cutout_zeroes_a_square_of_half_the_side_around_its_centre():
    out = cutout(torch.ones(1, 2, 8, 8), torch.tensor([0.5]), torch.tensor([0.0]))
    expected = torch.ones(8, 8)
    expected[2:6, 0:2] = 0  # centre row 4 -> rows 2..5; centre column 0 -> columns -2..1
    assert torch.equal(out[0, 0], expected) and torch.equal(out[0, 1], expected)


def test_color_by_hand():
    x = torch.tensor([[[[0.2]], [[0.4]], [[0.9]]]], dtype=torch.float64)  # one RGB pixel
    u = torch.tensor([0.7, 0.25, 0.5], dtype=torch.float64)
    out = color(x, u[:1], u[1:2], u[2:])
    bright = x + 0.2
    mean = bright.mean(dim=1, keepdim=True)
    saturated = (bright - mean) * 0.5 + mean
    contrast = (saturated - saturated.mean()) * 1.0 + saturated.mean()
    assert torch.allclose(out, contrast, atol=1e-15, rtol=0)
    assert torch.allclose(out.flatten(), torch.tensor([0.55, 0.65, 0.9], dtype=torch.float64))


def test_strength_is_a_per_image_probability():
    images = torch.randn(4, 3, 8, 8)
    u = augment.draws(0, 0, "real", 4)
    u[:, 0] = torch.tensor([0.1, 0.9, 0.3, 0.7])
    out = Augment(POLICY, torch.tensor(0.5))(images, u)
    changed = [not torch.equal(out[i], images[i]) for i in range(4)]
    assert changed == [True, False, True, False]
    assert torch.equal(Augment(POLICY, torch.tensor(0.0))(images, u), images)


def test_draws_are_a_function_of_seed_batch_and_pass():
    same = augment.draws(5, 7, "fake", 16)
    assert torch.equal(same, augment.draws(5, 7, "fake", 16))
    for other in (augment.draws(6, 7, "fake", 16), augment.draws(5, 8, "fake", 16)):
        assert not torch.equal(same, other)
    assert not torch.equal(same, augment.draws(5, 7, "real", 16))
    assert same.shape == (16, augment.DRAWS) and same.min() >= 0 and same.max() < 1


def test_xflip_mirrors_exactly_the_chosen_images_left_to_right():
    x = torch.arange(3 * 2 * 2 * 3, dtype=torch.float32).view(3, 2, 2, 3)
    out = augment.xflip(x, torch.tensor([True, False, True]))
    # image 0, channel 1 is [[6, 7, 8], [9, 10, 11]]: its columns reversed
    assert out[0, 1].tolist() == [[8.0, 7.0, 6.0], [11.0, 10.0, 9.0]]
    assert out[2, 0].tolist() == [[26.0, 25.0, 24.0], [29.0, 28.0, 27.0]]
    assert torch.equal(out[1], x[1])
    assert torch.equal(augment.xflip(out, torch.tensor([True, False, True])), x)


def test_flips_are_a_function_of_seed_batch_and_place():
    """The flips define a mirrored run's data: pinned, so that a change to how they are
    drawn (which would change every mirrored result) shows here."""
    assert augment.flips(0, 0, 8).tolist() == [False, True, True, True, True, True, True, True]
    assert augment.flips(3, 5, 8).tolist() == [False, True, False, True, False, False, False, False]
    # what the draws are: uniforms below 1/2, from their own stream (not the augmentation's)
    u = torch.rand(8, generator=runtime.seeded_generator(3, "xflip", 5))
    assert torch.equal(augment.flips(3, 5, 8), u < 0.5)
    assert not torch.equal(u, augment.draws(3, 5, "real", 8)[:, 0])
    share = torch.cat([augment.flips(0, b, 64) for b in range(100)]).float().mean()
    assert 0.45 < share < 0.55


def test_gradients_flow_back_through_every_operation():
    """The gradient of a translated image is the upstream gradient shifted back; cutout
    passes none where it zeroed; colour scales it by the contrast and saturation factors."""
    x = torch.randn(1, 1, 8, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(1, 1, 8, 8, dtype=torch.float64)
    (translate(x, torch.tensor([0.99]), torch.tensor([0.5])) * weight).sum().backward()
    expected = torch.zeros(8, 8, dtype=torch.float64)
    expected[:-1] = weight[0, 0, 1:]  # pixel i went to i + 1
    assert torch.equal(x.grad[0, 0], expected)
    x.grad = None
    cutout(x, torch.tensor([0.5]), torch.tensor([0.0])).sum().backward()
    assert x.grad[0, 0, 2:6, 0:2].abs().sum() == 0 and x.grad[0, 0, 0, 0] == 1


def tiny_conv_nets(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    g = nn.Sequential(
        nn.Linear(4, 3 * 8 * 8),
        nn.Tanh(),
        nn.Unflatten(1, (3, 8, 8)),
        nn.Conv2d(3, 3, 3, padding=1),
    ).double()
    d = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.LeakyReLU(0.2), nn.Flatten(), nn.Linear(64, 1)
    ).double()
    return g, d


def make_gan(g, d, grad_accum=1) -> Gan:
    return Gan(
        g=g,
        d=d,
        opt_g=torch.optim.SGD(g.parameters(), lr=0.1),
        opt_d=torch.optim.SGD(d.parameters(), lr=0.1),
        loss=build_loss(TrainParams()),
        scaler_g=torch.amp.GradScaler("cpu", enabled=False),
        scaler_d=torch.amp.GradScaler("cpu", enabled=False),
        autocast=contextlib.nullcontext,
        grad_accum=grad_accum,
        augment=Augment(POLICY, torch.tensor(1.0, dtype=torch.float64)),
    )


def batch(seed: int = 1) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    real = torch.rand(6, 3, 8, 8, generator=gen, dtype=torch.float64) * 2 - 1
    z = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    draws = {which: augment.draws(seed, 0, which, 6).double() for which in augment.PASSES}
    return Batch(real, z, draws=draws)


def reference_d_first_detach(g, d, b: Batch):
    """d_first_detach by hand: D on T(real) and T(fake) with their draws, then G through the
    updated D on T(fake) with the draws of G's pass."""
    t = Augment(POLICY, torch.tensor(1.0, dtype=torch.float64))
    gp = {n: p.detach().clone().requires_grad_(True) for n, p in g.named_parameters()}
    dp = {n: p.detach().clone().requires_grad_(True) for n, p in d.named_parameters()}
    fake = functional_call(g, gp, (b.z,)).detach()
    loss_d = bce_d(
        functional_call(d, dp, (t(b.real, b.draws["real"]),)),
        functional_call(d, dp, (t(fake, b.draws["fake"]),)),
    )
    grads = torch.autograd.grad(loss_d, list(dp.values()))
    dp = {n: (p - 0.1 * gr).detach() for (n, p), gr in zip(dp.items(), grads, strict=True)}
    fake = functional_call(g, gp, (b.z,))
    loss_g = bce_g(functional_call(d, dp, (t(fake, b.draws["g"]),)))
    grads = torch.autograd.grad(loss_g, list(gp.values()))
    gp = {n: (p - 0.1 * gr).detach() for (n, p), gr in zip(gp.items(), grads, strict=True)}
    return gp, dp


def test_every_d_pass_sees_augmented_images_with_its_own_draws():
    g, d = tiny_conv_nets()
    ref_gp, ref_dp = reference_d_first_detach(copy.deepcopy(g), copy.deepcopy(d), batch())
    STRATEGIES["d_first_detach"](make_gan(g, d), [batch()])
    for net, ref in ((g, ref_gp), (d, ref_dp)):
        for name, p in net.named_parameters():
            assert torch.allclose(p, ref[name], atol=1e-12, rtol=0), name


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_micro_batches_keep_each_image_s_draws(name):
    """grad_accum 2 equals the whole batch: the draws are split with their images."""
    results = []
    for accum in (1, 2):
        g, d = tiny_conv_nets()
        STRATEGIES[name](make_gan(g, d, accum), [batch(), batch(2)])
        results.append(
            torch.cat([p.detach().flatten() for p in [*g.parameters(), *d.parameters()]])
        )
    assert torch.allclose(results[0], results[1], atol=1e-12, rtol=0)
    g, d = tiny_conv_nets()
    plain = make_gan(g, d)
    plain.augment = None
    STRATEGIES[name](plain, [batch(), batch(2)])
    unaugmented = torch.cat([p.detach().flatten() for p in [*g.parameters(), *d.parameters()]])
    assert (unaugmented - results[0]).abs().max() > 1e-6


@pytest.mark.parametrize(
    ("value", "message"),
    [("flip", "train.augment='flip'"), ("color+color", "without repeats"), ("", "train.augment")],
)
def test_an_unknown_policy_names_the_key(value, message):
    with pytest.raises(ValueError, match=message):
        parse_params({"train": {"augment": value}})


def test_a_policy_is_normalised():
    params = parse_params({"train": {"augment": "cutout, color"}})
    assert params.train.augment == "cutout+color"
    assert parse_params({"train": {"augment": ["color", "cutout"]}}).train.augment == "color+cutout"
    assert params.train.augment_policy == ("cutout", "color")


def test_adaptive_p_by_hand():
    """ADA: p += sign(r_t - target) * step, clamped to [0, 1]; r_t equal to the target
    leaves p alone."""
    p = torch.tensor(0.5)
    ada = augment.AdaptiveP(p, target=0.6, step=0.25, reals=10, per_rank=10)

    def same(t):  # all_sum of one process
        return t

    ada.update(torch.tensor(0.8), same)  # 8 of 10 reals scored positive: D too sure
    assert p.item() == 0.75
    ada.update(torch.tensor(0.6), same)  # exactly the target
    assert p.item() == 0.75
    ada.update(torch.tensor(1.0), same)
    ada.update(torch.tensor(1.0), same)
    assert p.item() == 1.0  # clamped
    for _ in range(5):
        ada.update(torch.tensor(-0.2), same)
    assert p.item() == 0.0


def test_adaptive_p_counts_signs_exactly_over_ranks():
    """r_t is compared as a count summed over ranks: two ranks of 3 reals with mean signs
    1/3 and 1 (a sum of 4, not a float mean) decide as one process of the 6."""
    target = 2 / 3  # 6 * 2/3 = 4: the sum of signs 4 sits exactly on the target
    one = torch.tensor(0.5)
    augment.AdaptiveP(one, target, 0.125, reals=6, per_rank=6).update(
        torch.tensor([1.0, 1, -1, 1, 1, 1]).sign().mean(), lambda t: t
    )
    two = torch.tensor(0.5)
    other_rank = torch.tensor(3.0)  # the second rank's sum of signs: 1 + 1 + 1
    augment.AdaptiveP(two, target, 0.125, reals=6, per_rank=3).update(
        torch.tensor([1.0, 1, -1]).sign().mean(), lambda t: t + other_rank
    )
    assert one.item() == two.item() == 0.5  # on the target: no move, in both


def test_adaptive_target_needs_a_policy():
    with pytest.raises(ValueError, match=r"train.augment_target=0.6.*train.augment"):
        parse_params({"train": {"augment_target": 0.6}})
    params = parse_params({"train": {"augment": "translation", "augment_target": 0.6}})
    assert params.train.augment_target == 0.6


def test_adaptive_p_ignores_a_nan_score():
    p = torch.tensor(0.5)
    augment.AdaptiveP(p, 0.6, 0.25, reals=4, per_rank=4).update(
        torch.tensor(float("nan")), lambda t: t
    )
    assert p.item() == 0.5
