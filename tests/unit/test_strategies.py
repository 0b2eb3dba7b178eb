"""The update strategies against hand-written references (tiny MLPs, float64, SGD)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import fields

import pytest
import torch
from torch import nn
from torch.func import functional_call

from ganpipe import nets
from ganpipe.instrument import PassCounter
from ganpipe.losses import bce_d, bce_g, build_loss
from ganpipe.params import ModelParams, TrainParams
from ganpipe.strategies import STRATEGIES, Batch, Gan

LR = 0.1
NAMES = list(STRATEGIES)


def tiny_nets(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    g = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    d = nn.Sequential(nn.Linear(3, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1), nn.Flatten(0)).double()
    return g, d


def make_gan(g: nn.Module, d: nn.Module) -> Gan:
    return Gan(
        g=g,
        d=d,
        opt_g=torch.optim.SGD(g.parameters(), lr=LR),
        opt_d=torch.optim.SGD(d.parameters(), lr=LR),
        loss=build_loss(TrainParams()),
        scaler_g=torch.amp.GradScaler("cpu", enabled=False),
        scaler_d=torch.amp.GradScaler("cpu", enabled=False),
        autocast=contextlib.nullcontext,
    )


def batches(n_critic: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    reals = [torch.randn(5, 3, generator=gen, dtype=torch.float64) for _ in range(n_critic)]
    zs = [torch.randn(5, 4, generator=gen, dtype=torch.float64) for _ in range(n_critic)]
    return reals, zs


# --- the references: explicit torch.autograd.grad on explicit parameter dicts ------------


def params_of(net):
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def d_update(g, d, gp, dp, real, z):
    """One SGD step of D on BCE, fakes from G with parameters gp. Returns (new dp, grads)."""
    dp = {n: p.clone().requires_grad_(True) for n, p in dp.items()}
    fake = functional_call(g, gp, (z,)).detach()
    loss = bce_d(functional_call(d, dp, (real,)), functional_call(d, dp, (fake,)))
    grads = dict(zip(dp, torch.autograd.grad(loss, list(dp.values())), strict=True))
    return {n: (p - LR * grads[n]).detach() for n, p in dp.items()}, grads


def g_grads(g, d, gp, dp, z):
    """G's BCE gradient against D with parameters dp."""
    gp = {n: p.clone().requires_grad_(True) for n, p in gp.items()}
    loss = bce_g(functional_call(d, dp, (functional_call(g, gp, (z,)),)))
    return dict(zip(gp, torch.autograd.grad(loss, list(gp.values())), strict=True))


def sgd(params, grads):
    return {n: p - LR * grads[n] for n, p in params.items()}


def reference(name, g, d, reals, zs):
    """Returns (G params, D params, G grads, D grads of the last D update)."""
    gp, dp = params_of(g), params_of(d)
    if name == "d_first_detach":
        for real, z in zip(reals, zs, strict=True):
            dp, gd = d_update(g, d, gp, dp, real, z)
        gg = g_grads(g, d, gp, dp, zs[-1])  # against the D updated this iteration
        return sgd(gp, gg), dp, gg, gd
    if name == "d_first_retain":
        for real, z in zip(reals[:-1], zs[:-1], strict=True):
            dp, _ = d_update(g, d, gp, dp, real, z)
        gg = g_grads(g, d, gp, dp, zs[-1])  # against the D before the last update
        dp, gd = d_update(g, d, gp, dp, reals[-1], zs[-1])
        return sgd(gp, gg), dp, gg, gd
    if name == "g_first_detach":
        gg = g_grads(g, d, gp, dp, zs[0])
        new_gp = sgd(gp, gg)
        dp, gd = d_update(g, d, gp, dp, reals[0], zs[0])  # fakes of the pre-update G
        first_gd = gd
        for real, z in zip(reals[1:], zs[1:], strict=True):
            dp, gd = d_update(g, d, new_gp, dp, real, z)
        return new_gp, dp, gg, first_gd if len(reals) == 1 else gd
    raise AssertionError(name)


#: The two families at their smallest: float64, G with a per-sample norm.
FAMILIES = {
    "dcgan": (ModelParams(z_dim=4, g_width=2, d_width=2, norm="instance"), 16),
    "resnet": (
        ModelParams(
            arch="resnet",
            z_dim=4,
            g_channels={4: 4, 8: 4, 16: 2, 32: 2},
            d_channels={4: 4, 8: 2, 16: 2},
            norm="layer",
        ),
        32,
    ),
}


def family_nets(arch: str) -> tuple[nn.Module, nn.Module]:
    """Tiny G and D of ``arch`` in float64, in training mode. resnet's spectral norm divides
    by the same σ however often and in whatever order D is called between two steps (the
    reference calls D(real) before D(fake), the strategies the other way round)."""
    model, size = FAMILIES[arch]
    g, d = nets.build_models(model, size, 1, torch.Generator().manual_seed(0))
    return g.double(), d.double()


def family_batches(arch: str, n_critic: int, seed: int = 1, n: int = 4):
    size = FAMILIES[arch][1]
    gen = torch.Generator().manual_seed(seed)
    reals = [
        torch.rand(n, 1, size, size, generator=gen, dtype=torch.float64) * 2 - 1
        for _ in range(n_critic)
    ]
    zs = [torch.randn(n, 4, generator=gen, dtype=torch.float64) for _ in range(n_critic)]
    return reals, zs


@pytest.mark.parametrize("n_critic", [1, 3])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("arch", ["mlp", "dcgan", "resnet"])
def test_strategy_equals_its_reference(name, n_critic, arch):
    if arch == "mlp":
        g, d = tiny_nets()
        reals, zs = batches(n_critic)
    else:
        g, d = family_nets(arch)
        reals, zs = family_batches(arch, n_critic)
    ref_gp, ref_dp, ref_gg, ref_gd = reference(name, copy.deepcopy(g), copy.deepcopy(d), reals, zs)
    gan = make_gan(g, d)
    stats = STRATEGIES[name](gan, Batch.many(reals, zs))
    for n, p in g.named_parameters():
        torch.testing.assert_close(p.detach(), ref_gp[n], rtol=0, atol=1e-12)
        # G's gradient is exactly its own loss's: D's loss leaked nothing into it
        torch.testing.assert_close(p.grad, ref_gg[n], rtol=0, atol=1e-12)
    for n, p in d.named_parameters():
        torch.testing.assert_close(p.detach(), ref_dp[n], rtol=0, atol=1e-12)
        if n_critic == 1:
            torch.testing.assert_close(p.grad, ref_gd[n], rtol=0, atol=1e-12)
    assert set(stats) >= {"loss/d", "loss/g", "d/real", "d/fake", "grad_norm/d", "grad_norm/g"}


def test_literal_retain_graph_code_raises_and_ours_does_not():
    g, d = tiny_nets()
    gan = make_gan(g, d)
    reals, zs = batches(1)
    fake_scores = d(g(zs[0]))
    d_loss = bce_d(d(reals[0]), fake_scores)
    g_loss = bce_g(fake_scores)
    gan.opt_d.zero_grad()
    gan.opt_g.zero_grad()
    d_loss.backward(retain_graph=True)
    gan.opt_d.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        g_loss.backward()
    g, d = tiny_nets()
    STRATEGIES["d_first_retain"](make_gan(g, d), Batch.many(reals, zs))  # the well-defined version


def simultaneous_mistake(g, d, reals, zs):
    """Zero both, two overlapping backwards, step both: each loss leaks into the other net."""
    opt_g = torch.optim.SGD(g.parameters(), lr=LR)
    opt_d = torch.optim.SGD(d.parameters(), lr=LR)
    opt_g.zero_grad()
    opt_d.zero_grad()
    fake_scores = d(g(zs[0]))
    bce_d(d(reals[0]), fake_scores).backward(retain_graph=True)
    bce_g(fake_scores).backward()
    opt_d.step()
    opt_g.step()


def test_the_simultaneous_mistake_differs_from_every_strategy():
    reals, zs = batches(1)
    g0, d0 = tiny_nets()
    simultaneous_mistake(g0, d0, reals, zs)
    mistake = torch.cat([p.detach().flatten() for p in [*g0.parameters(), *d0.parameters()]])
    for name in NAMES:
        g, d = tiny_nets()
        STRATEGIES[name](make_gan(g, d), Batch.many(reals, zs))
        ours = torch.cat([p.detach().flatten() for p in [*g.parameters(), *d.parameters()]])
        assert (ours - mistake).abs().max() > 1e-4, name


EXPECTED_FORWARDS = {  # DESIGN.md's table
    "d_first_retain": {"G": 1, "D(fake)": 1, "D(real)": 1},
    "d_first_detach": {"G": 1, "D(fake)": 2, "D(real)": 1},
    "g_first_detach": {"G": 1, "D(fake)": 2, "D(real)": 1},
}


@pytest.mark.parametrize("name", NAMES)
def test_pass_counts_match_the_design_table(name):
    g, d = tiny_nets()
    reals, zs = batches(1)
    counter = PassCounter(g, d)
    counter.watch_real(reals[0])
    STRATEGIES[name](make_gan(g, d), Batch.many(reals, zs))
    forwards = {k: counter.counts[k] for k in ("G", "D(fake)", "D(real)")}
    assert forwards == EXPECTED_FORWARDS[name]
    # backward reaches G once (its own loss only) and D three times: D(real) and D(fake)
    # for D's loss, D(fake) again for G's loss (to reach G, not D's weights).
    assert counter.counts["G backward"] == 1
    assert counter.counts["D backward"] == 3
    # every parameter's gradient is computed exactly once per step: none is wasted
    num_g, num_d = len(list(g.parameters())), len(list(d.parameters()))
    assert counter.param_grads == {"G": num_g, "D": num_d}


def test_pass_counter_sees_the_wasted_gradients_of_the_mistake():
    g, d = tiny_nets()
    reals, zs = batches(1)
    counter = PassCounter(g, d)
    counter.watch_real(reals[0])
    simultaneous_mistake(g, d, reals, zs)
    assert counter.param_grads["G"] == 2 * len(list(g.parameters()))
    assert counter.param_grads["D"] == 2 * len(list(d.parameters()))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("n_critic", "arch"), [(1, "mlp"), (2, "mlp"), (2, "resnet")])
def test_gradient_accumulation_equals_the_whole_batch(name, n_critic, arch):
    """Micro-batches of 4 or 2 give the update of the whole batch of 8 (float64, SGD)."""
    if arch == "mlp":
        gen = torch.Generator().manual_seed(2)
        reals = [torch.randn(8, 3, generator=gen, dtype=torch.float64) for _ in range(n_critic)]
        zs = [torch.randn(8, 4, generator=gen, dtype=torch.float64) for _ in range(n_critic)]
    else:
        reals, zs = family_batches(arch, n_critic, seed=2, n=8)
    results = {}
    for accum in (1, 2, 4):
        g, d = tiny_nets() if arch == "mlp" else family_nets(arch)
        gan = make_gan(g, d)
        gan.grad_accum = accum
        # two steps: the second from different weights
        stats = STRATEGIES[name](gan, Batch.many(reals, zs))
        stats = STRATEGIES[name](gan, Batch.many(reals, zs))
        flat = torch.cat([p.detach().flatten() for p in [*g.parameters(), *d.parameters()]])
        results[accum] = (flat, stats)
    whole, whole_stats = results[1]
    scale = max(1.0, whole.abs().max().item())  # resnet's D weights reach ~3e4 here
    for accum in (2, 4):
        flat, stats = results[accum]
        assert (flat - whole).abs().max() < 1e-12 * scale, accum
        for key, value in whole_stats.items():
            assert torch.allclose(stats[key].double(), value.double(), atol=1e-12), key


def test_gradient_accumulation_differs_from_stepping_per_micro_batch():
    """The check above can fail: stepping after each half batch is a different update."""
    gen = torch.Generator().manual_seed(2)
    reals, zs = (
        [torch.randn(8, 3, generator=gen, dtype=torch.float64)],
        [torch.randn(8, 4, generator=gen, dtype=torch.float64)],
    )
    g, d = tiny_nets()
    STRATEGIES["d_first_detach"](make_gan(g, d), Batch.many(reals, zs))
    whole = torch.cat([p.detach().flatten() for p in [*g.parameters(), *d.parameters()]])
    g, d = tiny_nets()
    gan = make_gan(g, d)
    for half in range(2):
        STRATEGIES["d_first_detach"](
            gan, Batch.many([reals[0][half * 4 : half * 4 + 4]], [zs[0][half * 4 : half * 4 + 4]])
        )
    stepped = torch.cat([p.detach().flatten() for p in [*g.parameters(), *d.parameters()]])
    assert (stepped - whole).abs().max() > 1e-4


# --- what each optimizer step sees: gradients computed since the previous step ------------


def expected_steps(name, g, d, reals, zs):
    """The optimizer steps of one iteration in order, as (network, its reference gradients)."""
    gp, dp = params_of(g), params_of(d)
    steps = []
    if name == "g_first_detach":
        gg = g_grads(g, d, gp, dp, zs[0])
        steps.append(("G", gg))
        new_gp = sgd(gp, gg)
        for k, (real, z) in enumerate(zip(reals, zs, strict=True)):
            dp, gd = d_update(g, d, gp if k == 0 else new_gp, dp, real, z)
            steps.append(("D", gd))
        return steps
    for real, z in zip(reals[:-1], zs[:-1], strict=True):
        dp, gd = d_update(g, d, gp, dp, real, z)
        steps.append(("D", gd))
    if name == "d_first_retain":
        gg = g_grads(g, d, gp, dp, zs[-1])  # against the D before the last update
        dp, gd = d_update(g, d, gp, dp, reals[-1], zs[-1])
        return [*steps, ("D", gd), ("G", gg)]
    dp, gd = d_update(g, d, gp, dp, reals[-1], zs[-1])
    return [*steps, ("D", gd), ("G", g_grads(g, d, gp, dp, zs[-1]))]


def clone_grad(p: torch.Tensor) -> torch.Tensor | None:
    return None if p.grad is None else p.grad.clone()


def watch_steps(gan: Gan) -> list[dict]:
    """At each optimizer step: which network steps, how many parameter gradients of G and D
    were computed since the previous step, and every parameter's ``.grad`` at that moment."""
    counter = PassCounter(gan.g, gan.d)
    seen = []

    def before_step(name):
        def hook(optimizer, args, kwargs):
            seen.append(
                {
                    "net": name,
                    "computed": dict(counter.param_grads),
                    "G": {n: clone_grad(p) for n, p in gan.g.named_parameters()},
                    "D": {n: clone_grad(p) for n, p in gan.d.named_parameters()},
                }
            )
            counter.reset()

        return hook

    gan.opt_g.register_step_pre_hook(before_step("G"))
    gan.opt_d.register_step_pre_hook(before_step("D"))
    return seen


def check_steps(name: str, n_critic: int, gan: Gan) -> None:
    """Two iterations; every step matches its reference and saw no foreign gradient."""
    g, d = gan.g, gan.d
    num = {"G": len(list(g.parameters())), "D": len(list(d.parameters()))}
    seen = watch_steps(gan)
    for seed in (1, 2):
        reals, zs = batches(n_critic, seed)
        want = expected_steps(name, copy.deepcopy(g), copy.deepcopy(d), reals, zs)
        del seen[:]
        STRATEGIES[name](gan, Batch.many(reals, zs))
        assert [s["net"] for s in seen] == [net for net, _ in want]
        for i, (step, (net, grads)) in enumerate(zip(seen, want, strict=True)):
            # Since the previous step, only the stepping network's parameters got gradients,
            # each exactly once ...
            computed = {"G": 0, "D": 0, net: num[net]}
            if name == "d_first_retain" and i >= len(want) - 2:
                # ... except in d_first_retain's shared forward: both gradients come before
                # the last D step, none before G's step.
                computed = {"G": num["G"], "D": num["D"]} if net == "D" else {"G": 0, "D": 0}
            assert step["computed"] == computed, f"step {i} of {net}: {step['computed']}"
            if name == "d_first_retain" and net == "D" and i == len(want) - 2:
                # the G gradients computed with D's are exactly G's own loss's
                for n, grad in want[-1][1].items():
                    torch.testing.assert_close(step["G"][n], grad, rtol=0, atol=1e-12)
            for n, grad in grads.items():
                torch.testing.assert_close(step[net][n], grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n_critic", [1, 3])
@pytest.mark.parametrize("name", NAMES)
def test_each_optimizer_step_sees_only_its_own_networks_gradients(name, n_critic):
    check_steps(name, n_critic, make_gan(*tiny_nets()))


class UnrestrictedGan(Gan):
    """The leak the restriction prevents: backward into every parameter it reaches."""

    def backward(self, loss, net, retain_graph=False):
        self.scaler_g.scale(loss).backward(retain_graph=retain_graph)  # disabled: fp32


@pytest.mark.parametrize("name", NAMES)
def test_the_step_check_catches_a_backward_into_both_networks(name):
    gan = make_gan(*tiny_nets())
    leaky = UnrestrictedGan(**{f.name: getattr(gan, f.name) for f in fields(gan) if f.init})
    with pytest.raises(AssertionError, match=r"step \d of [GD]: "):
        check_steps(name, 1, leaky)


@pytest.mark.parametrize(
    ("arch", "norm"), [("dcgan", "instance"), ("dcgan", "none"), ("resnet", "layer")]
)
def test_activation_checkpointing_keeps_d_first_retain_exact(arch, norm, monkeypatch):
    """retain_graph through non-reentrant checkpointed blocks: D's loss backward keeps the
    shared graph for G's, and three steps end with the weights of the unchecked run. resnet:
    D's spectral norm must not iterate again in the recomputations."""
    calls = {"n": 0}
    real_checkpoint = nets.checkpoint

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real_checkpoint(*args, **kwargs)

    monkeypatch.setattr(nets, "checkpoint", counting)
    model, size = FAMILIES[arch]
    model = model.model_copy(update={"z_dim": 8, "norm": norm})
    gen = torch.Generator().manual_seed(3)
    reals = [
        torch.rand(6, 1, size, size, generator=gen, dtype=torch.float64) * 2 - 1 for _ in range(3)
    ]
    zs = [torch.randn(6, 8, generator=gen, dtype=torch.float64) for _ in range(3)]
    weights = {}
    for checkpointing in (False, True):
        g, d = nets.build_models(
            model if arch == "resnet" else ModelParams(z_dim=8, g_width=4, d_width=4, norm=norm),
            size,
            1,
            torch.Generator().manual_seed(0),
            checkpointing,
        )
        g, d = g.double(), d.double()
        start = [p.detach().clone() for p in [*g.parameters(), *d.parameters()]]
        gan = make_gan(g, d)
        for real, z in zip(reals, zs, strict=True):
            STRATEGIES["d_first_retain"](gan, Batch.many([real], [z]))
        weights[checkpointing] = [p.detach() for p in [*g.parameters(), *d.parameters()]]
        moved = [(w - w0).abs().max() for w, w0 in zip(weights[checkpointing], start, strict=True)]
        assert min(moved) > 0  # every parameter trained
    # per step: G's 3 blocks, D's 3 blocks on fake and real (16 px dcgan, 32 px resnet)
    assert calls["n"] == 3 * (3 + 3 * 2)
    for without, with_ in zip(weights[False], weights[True], strict=True):
        torch.testing.assert_close(with_, without, rtol=0, atol=1e-12)
