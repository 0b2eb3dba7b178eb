"""Both families: shapes, sizes, initialisation, conditioning and activation checkpointing."""

from __future__ import annotations

import itertools

import pytest
import torch

from ganpipe import nets
from ganpipe.ema import EmaGenerator
from ganpipe.nets import build_generator, build_models
from ganpipe.params import ModelParams, ParamsError, parse_params

#: Tiny ResNet widths: G 8, 8, 4, 4 channels at 4, 8, 16, 32 px; D 4, 8, 8 at 16, 8, 4.
TINY_RESNET = {
    "arch": "resnet",
    "z_dim": 8,
    "g_channels": {4: 8, 8: 8, 16: 4, 32: 4, 64: 4, 128: 2, 256: 2},
    "d_channels": {4: 8, 8: 8, 16: 4, 32: 4, 64: 2, 128: 2},
}


def tiny_model(arch: str, **model) -> ModelParams:
    """Tiny networks of either family (dcgan: widths 8)."""
    base = TINY_RESNET if arch == "resnet" else {"z_dim": 8, "g_width": 8, "d_width": 8}
    return ModelParams(**{**base, **model})


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


def checkpointed_step(arch: str, norm: str, checkpointing: bool, **model) -> dict[str, object]:
    """One forward of D(G(z)) and D(real), and two backwards through the retained graph (as
    d_first_retain does): D's scores, the gradients and every buffer afterwards."""
    conditional = model.get("conditional", False)
    g, d = build_models(
        tiny_model(arch, norm=norm, **model),
        32,
        3,
        torch.Generator().manual_seed(0),
        checkpointing,
        num_classes=3 if conditional else None,
    )
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(4, 8, generator=gen)
    real = torch.rand(4, 3, 32, 32, generator=gen) * 2 - 1
    y = torch.tensor([0, 2, 1, 2]) if conditional else None
    scores = torch.cat([d(g(z, y), y), d(real, y)])  # D twice: spectral norm iterates twice
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


#: BatchNorm layers at 32 px: dcgan G 3, D 2 (none on its first layer); resnet G 2 per
#: block and 1 before the output conv, D none.
NUM_BATCH_NORMS = {"dcgan": (3, 2), "resnet": (7, 0)}


@pytest.mark.parametrize(
    ("arch", "norm", "model"),
    [
        *[("dcgan", norm, {}) for norm in ("batch", "instance", "layer", "none")],
        *[("resnet", norm, {}) for norm in ("batch", "layer", "spectral")],
        ("resnet", "batch", {"conditional": True}),
    ],
)
def test_activation_checkpointing_is_the_same_step_bit_for_bit(arch, norm, model):
    without = checkpointed_step(arch, norm, False, **model)
    with_ = checkpointed_step(arch, norm, True, **model)
    assert torch.equal(without["scores"], with_["scores"])
    for a, b in zip(without["grads"], with_["grads"], strict=True):
        assert torch.equal(a, b)
    assert without["buffers"].keys() == with_["buffers"].keys()
    for name, value in without["buffers"].items():
        # BatchNorm's running statistics: the recomputation in backward used to update them
        # again (num_batches_tracked 2, running_mean off by ~2e-3), and g_ema copied them.
        # Spectral norm's u, v: a recomputation that iterated again would change them.
        assert torch.equal(value, with_["buffers"][name]), name
    tracked = {k: int(v) for k, v in with_["buffers"].items() if k.endswith("num_batches_tracked")}
    num_g, num_d = NUM_BATCH_NORMS[arch] if norm == "batch" else (0, 0)
    # one update per forward: G ran once, D twice (fake and real)
    assert sorted(tracked.values()) == [1] * num_g + [2] * num_d, tracked
    if arch == "resnet":
        assert any(k.endswith("_u") for k in with_["buffers"])  # D's spectral norm vectors


def test_the_checkpointing_check_catches_a_spectral_norm_that_iterates_per_call(monkeypatch):
    """With PyTorch's own spectral norm (a power iteration per call) the recomputation in
    backward iterates again and its W/σ differs: the check above can fail."""
    monkeypatch.setattr(nets, "_SpectralNormPerWeight", nets._SpectralNorm)
    without = checkpointed_step("resnet", "layer", False)
    with_ = checkpointed_step("resnet", "layer", True)
    assert torch.equal(without["scores"], with_["scores"])  # the forward is the same ...
    assert not all(
        torch.equal(a, b) for a, b in zip(without["grads"], with_["grads"], strict=True)
    )  # ... its gradients are not


def test_spectral_norm_iterates_once_per_weight_value():
    """Every call between two steps divides by the same σ (whatever their number and
    order); a changed weight iterates once more, on its first call."""
    _, d = build_models(tiny_model("resnet"), 32, 1, torch.Generator().manual_seed(0))
    layer = d.blocks[-1].conv2
    norm = layer.parametrizations.weight[0]
    x = torch.rand(3, 1, 32, 32, generator=torch.Generator().manual_seed(4))
    first = d(x)
    u = norm._u.clone()
    assert not torch.equal(u, torch.zeros_like(u))
    assert torch.equal(d(x), first) and torch.equal(d(x[:2]), first[:2])  # no iteration
    assert torch.equal(norm._u, u)
    with torch.no_grad():
        layer.parametrizations.weight.original.mul_(1.5).add_(0.1)
    d(x)
    moved = norm._u.clone()
    assert not torch.equal(moved, u)  # the new weight iterated ...
    d(x)
    assert torch.equal(norm._u, moved)  # ... once


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


# --- ResNet ------------------------------------------------------------------------------


def conv_params(c_in: int, c_out: int, k: int) -> int:
    return c_in * c_out * k * k + c_out


def resnet_counts(z: int, g: list[int], d: list[int], channels: int, classes: int = 0):
    """Parameter counts of G and D by hand: G's widths from 4 px up, D's from its first
    block's output down to 4 px; BatchNorm in G (2 per channel, or 2 embeddings of
    ``classes`` rows when conditional)."""

    def norm(c):
        return 2 * c * (classes or 1)

    count_g = z * 16 * g[0] + 16 * g[0]  # linear to the 4x4 core
    for c_in, c_out in itertools.pairwise(g):
        count_g += norm(c_in) + conv_params(c_in, c_out, 3) + norm(c_out)
        count_g += conv_params(c_out, c_out, 3) + conv_params(c_in, c_out, 1)
    count_g += 2 * g[-1] + conv_params(g[-1], channels, 3)  # plain BatchNorm, output conv
    count_d = 0
    for c_in, c_out in zip([channels, *d], d, strict=False):
        count_d += conv_params(c_in, c_out, 3) + conv_params(c_out, c_out, 3)
        count_d += conv_params(c_in, c_out, 1)
    count_d += d[-1] + 1 + classes * d[-1]  # linear head, projection embedding
    return count_g, count_d


def test_resnet_parameter_count_at_32_pixels_by_hand():
    g, d = build_models(tiny_model("resnet"), 32, 1, torch.Generator())
    # G: linear 8*16*8+128 = 1152; block 8->8: BN 16, conv 584, BN 16, conv 584, 1x1 72
    # = 1272; 8->4: 16 + 292 + 8 + 148 + 36 = 500; 4->4: 8 + 148 + 8 + 148 + 20 = 332;
    # BN 8 + output conv 37 = 45.  D: 1->4: 40 + 148 + 8 = 196; 4->8: 296 + 584 + 40 = 920;
    # 8->8: 584 + 584 + 72 = 1240; head 9.
    assert (count(g), count(d)) == (3301, 2365)
    assert resnet_counts(8, [8, 8, 4, 4], [4, 8, 8], 1) == (3301, 2365)
    g, d = build_models(
        tiny_model("resnet", conditional=True), 32, 1, torch.Generator(), num_classes=10
    )
    # 6 conditional norms over 8+8+8+4+4+4 = 36 channels: 2*10*36 instead of 2*36; D: 10*8
    assert (count(g), count(d)) == (3301 - 72 + 720, 2365 + 80)


@pytest.mark.parametrize("size", [32, 64, 128, 256])
def test_resnet_shapes_and_sizes_for_every_resolution(size):
    model = tiny_model("resnet", conditional=True)
    g, d = build_models(model, size, 3, torch.Generator().manual_seed(0), num_classes=4)
    y = torch.tensor([0, 3])
    images = g(torch.randn(2, 8), y)
    assert images.shape == (2, 3, size, size) and images.abs().max() <= 1
    assert d(images, y).shape == (2,)
    resolutions = [r for r in (4, 8, 16, 32, 64, 128, 256) if r <= size]
    g_widths = [TINY_RESNET["g_channels"][r] for r in resolutions]
    d_widths = [TINY_RESNET["d_channels"][r] for r in resolutions[:-1][::-1]]
    assert (count(g), count(d)) == resnet_counts(8, g_widths, d_widths, 3, classes=4)
    assert len(g.blocks) == len(d.blocks) == len(resolutions) - 1


@pytest.mark.parametrize("norm", ["batch", "instance", "layer", "spectral", "none"])
def test_resnet_norm_is_gs_and_d_is_spectral_everywhere(norm):
    g, d = build_models(tiny_model("resnet", norm=norm), 32, 1, torch.Generator().manual_seed(0))
    weighted = [m for m in d.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert weighted and all(hasattr(m, "parametrizations") for m in weighted)
    assert not any(isinstance(m, (torch.nn.BatchNorm2d, torch.nn.GroupNorm)) for m in d.modules())
    g_layers = [m for m in g.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert all(hasattr(m, "parametrizations") == (norm == "spectral") for m in g_layers)
    kinds = {type(m).__name__ for m in g.modules()}
    expected = {
        "batch": "BatchNorm2d",
        "instance": "InstanceNorm2d",
        "layer": "GroupNorm",
    }.get(norm)
    assert (expected in kinds) if expected else not kinds & {"BatchNorm2d", "GroupNorm"}
    assert g(torch.randn(2, 8)).shape == (2, 1, 32, 32)


def test_resnet_initialisation_is_seeded():
    a = build_models(tiny_model("resnet"), 32, 1, torch.Generator().manual_seed(0))
    b = build_models(tiny_model("resnet"), 32, 1, torch.Generator().manual_seed(0))
    c = build_models(tiny_model("resnet"), 32, 1, torch.Generator().manual_seed(1))
    for net_a, net_b, net_c in zip(a, b, c, strict=True):
        sa, sb, sc = net_a.state_dict(), net_b.state_dict(), net_c.state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa)  # spectral norm's u, v included
        assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def conditional_pair(classes: int = 3):
    return build_models(
        tiny_model("resnet", conditional=True),
        32,
        1,
        torch.Generator().manual_seed(0),
        num_classes=classes,
    )


def test_the_projection_term_is_the_embedding_times_the_pooled_features():
    """D(x, y) = head(φ(x)) + <embed(y), φ(x)>, computed here by hand from D's layers."""
    _, d = conditional_pair()
    d.eval()  # spectral norm does not iterate: every call sees the same weights
    x = torch.rand(4, 1, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    y = torch.tensor([0, 1, 2, 1])
    h = x
    for block in d.blocks:
        h = block(h)
    features = torch.relu(h).sum(dim=(2, 3))
    by_hand = d.head(features).flatten() + (d.embed.weight[y] * features).sum(dim=1)
    torch.testing.assert_close(d(x, y), by_hand, rtol=0, atol=1e-6)
    assert not torch.equal(d(x, y), d(x, (y + 1) % 3))  # another label, another score


def test_conditional_g_and_d_use_the_label_and_train_its_embeddings():
    g, d = conditional_pair()
    z = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 1, 2, 0])
    # Gains 1 and biases 0 at the start: the conditional G starts as the unconditional one.
    assert torch.equal(g(z, y), g(z, (y + 1) % 3))
    loss = d(g(z, y), y).mean()
    loss.backward()
    embeddings = [m for m in g.modules() if isinstance(m, torch.nn.Embedding)]
    assert len(embeddings) == 12  # gain and bias of the 6 conditional norms
    assert all(m.weight.grad[[0, 1, 2]].abs().sum(1).min() > 0 for m in embeddings)
    assert d.embed.parametrizations.weight.original.grad.abs().sum() > 0
    with torch.no_grad():
        for m in embeddings:
            m.weight.sub_(0.5 * m.weight.grad)
    assert (g(z, y) - g(z, (y + 1) % 3)).abs().max() > 1e-3  # now the label changes G


def test_a_conditional_network_without_labels_and_labels_for_an_unconditional_one_fail():
    g, d = conditional_pair()
    with pytest.raises(ValueError, match=r"class-conditional \(model.conditional=true\)"):
        g(torch.randn(2, 8))
    with pytest.raises(ValueError, match="discriminator is class-conditional"):
        d(torch.randn(2, 1, 32, 32))
    for arch in ("dcgan", "resnet"):
        g, d = build_models(tiny_model(arch), 32, 1, torch.Generator())
        with pytest.raises(ValueError, match="unconditional .* given labels"):
            g(torch.randn(2, 8), torch.tensor([0, 1]))
        with pytest.raises(ValueError, match="unconditional .* given labels"):
            d(torch.randn(2, 1, 32, 32), torch.tensor([0, 1]))


@pytest.mark.parametrize("classes", [None, 0, 1])
def test_conditional_with_fewer_than_two_classes_names_the_key(classes):
    with pytest.raises(ValueError, match="model.conditional=true needs .* at least 2 classes"):
        conditional_pair(classes)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"model": {"arch": "resnet"}, "data": {"image_size": 16}},
            "data.image_size=16 is not supported by model.arch=resnet; use one of 32, 64, "
            "128, 256 (or model.arch dcgan: 16, 32, 64)",
        ),
        (
            {"data": {"image_size": 128}},
            "data.image_size=128 is not supported by model.arch=dcgan; use one of 16, 32, 64 "
            "(or model.arch resnet: 32, 64, 128, 256)",
        ),
        (
            {"model": {"conditional": True}},
            "model.conditional=true is not supported by model.arch=dcgan",
        ),
        (
            {"model": {"arch": "resnet", "conditional": True, "norm": "none"}},
            "model.conditional=true conditions G through its normalisation layers, which "
            "model.norm=none has none of",
        ),
        (
            {"model": {"arch": "resnet", "g_channels": {4: 8, 8: 8, 16: 8}}},
            "model.g_channels has no channels for resolution(s) 32; data.image_size=32 "
            "needs 4, 8, 16, 32",
        ),
        (
            {"model": {"arch": "resnet", "d_channels": {4: 8, 12: 8}}},
            "model.d_channels has resolution(s) 12",
        ),
    ],
)
def test_bad_combinations_name_their_keys(raw, message):
    with pytest.raises(ParamsError) as info:
        parse_params(raw)
    assert message in str(info.value)


def test_resnet_allows_what_only_dcgans_d_norm_forbids():
    """resnet's D has no BatchNorm (penalties are per sample) and replays spectral norm in
    checkpointing, so these combinations are valid for it, and still refused for dcgan."""
    raw = {
        "model": {"arch": "resnet", "norm": "spectral"},
        "train": {"loss": "wgan_gp", "activation_checkpointing": True},
    }
    parse_params(raw)
    parse_params({"model": {"arch": "resnet"}, "train": {"r1_gamma": 1.0}})
    with pytest.raises(ParamsError, match="power iteration"):
        parse_params({**raw, "model": {"norm": "spectral"}})


def test_model_records_hold_the_chosen_familys_keys_only():
    """A model file records ``model`` as below: dcgan's record (the bytes of models/*.pt) is
    what it was before resnet existed, and a resnet record rebuilds its network."""
    assert ModelParams().model_dump(mode="json") == {
        "arch": "dcgan",
        "z_dim": 100,
        "g_width": 32,
        "d_width": 32,
        "norm": "batch",
    }
    model = tiny_model("resnet", conditional=True)
    record = model.model_dump(mode="json")
    assert "g_width" not in record and record["conditional"] is True
    assert record["g_channels"]["32"] == 4  # JSON keys are strings ...
    assert ModelParams(**record) == model  # ... and read back as resolutions
    g, _ = build_models(model, 32, 1, torch.Generator().manual_seed(0), num_classes=3)
    again = build_generator(ModelParams(**record), 32, 1, num_classes=3)
    again.load_state_dict(g.state_dict())
    z, y = torch.randn(2, 8), torch.tensor([0, 2])
    assert torch.equal(again.eval()(z, y), g.eval()(z, y))


@pytest.mark.parametrize("norm", ["batch", "spectral"])
def test_ema_of_a_resnet_averages_weights_and_copies_norm_and_spectral_buffers(norm):
    g, _ = build_models(
        tiny_model("resnet", norm=norm, conditional=norm == "batch"),
        32,
        1,
        torch.Generator().manual_seed(0),
        num_classes=3 if norm == "batch" else None,
    )
    ema = EmaGenerator(g, half_life_kimg=0.064)
    start = {k: v.clone() for k, v in ema.module.state_dict().items()}
    y = torch.tensor([0, 1, 2, 1]) if norm == "batch" else None
    g(torch.randn(4, 8), y)  # training mode: running statistics / power iteration move
    with torch.no_grad():
        for p in g.parameters():
            p.add_(1.0)
    ema.update(g, 64)
    params = {n for n, _ in g.named_parameters()}
    buffers = dict(g.named_buffers())
    kinds = {"running_mean"} if norm == "batch" else {"_u", "_v"}
    assert any(k.endswith(tuple(kinds)) for k in buffers)
    for name, value in ema.module.state_dict().items():
        if name in params:  # half way to G's new weights
            torch.testing.assert_close(value, start[name] + 0.5)
        else:  # a buffer: G's, as G left it
            assert torch.equal(value, buffers[name]), name
            if name.endswith(tuple(kinds)):
                assert not torch.equal(value, start[name]), name
    ema_out = ema(torch.randn(2, 8), None if y is None else y[:2])
    assert ema_out.shape == (2, 1, 32, 32)
