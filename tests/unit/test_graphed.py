"""What a CUDA-graph replay of the training iteration needs, checked on CPU.

A replay reruns the captured kernels on the captured memory; Python does not run. So an
iteration is graph-safe only if every state it changes is changed in place: a tensor
rebound to a new one (``count = count + 1``) would, under replay, be recomputed from the
memory seen at capture every time. Here every state tensor of a run keeps its object and
its storage across iterations, for every strategy, precision and feature that the graph
captures. The capture itself needs a GPU: tests/integration/test_gpu.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from ganpipe import graphed
from ganpipe.build import adaptive_p, build_gan
from ganpipe.dist import DistContext
from ganpipe.params import parse_params
from ganpipe.strategies import STRATEGIES, Batch, Gan
from ganpipe.stream import latents
from tests.helpers import graph_features

BASE = {
    "seed": 3,
    "data": {"image_size": 16},
    "model": {"g_width": 8, "d_width": 8, "z_dim": 8},
    "train": {"batch_size": 8},
}
FEATURES = graph_features(8)
CLASSES = 3


def params_for(feature: str, strategy: str, precision: str):
    raw = json.loads(json.dumps(BASE))
    for section, values in FEATURES[feature].items():
        raw.setdefault(section, {}).update(values)
    raw["train"]["strategy"], raw["precision"] = strategy, precision
    return parse_params(raw)


def batches_for(params, gan: Gan, iteration: int) -> list[Batch]:
    cfg, size = params.train, params.data.image_size
    conditional = params.model.conditional
    out = []
    for k in range(cfg.n_critic):
        gen = torch.Generator().manual_seed(1000 * iteration + k)
        real = torch.rand(cfg.batch_size, 1, size, size, generator=gen) * 2 - 1
        labels = torch.randint(CLASSES, (cfg.batch_size,), generator=gen) if conditional else None
        draws = None
        if gan.augment is not None:
            draws = {w: torch.rand(cfg.batch_size, 8, generator=gen) for w in ("real", "fake", "g")}
        z = latents(params.seed, iteration, cfg.batch_size, params.model.z_dim)
        out.append(Batch(real, z, labels, labels, draws))
    return out


def state_tensors(gan: Gan) -> dict[str, torch.Tensor]:
    """Every tensor an iteration changes (gradients aside: they are set to None and made
    again inside the iteration, so a capture allocates them in the graph's memory)."""
    out = {}
    for net_name, net in (("g", gan.g), ("d", gan.d)):
        for name, t in [*net.named_parameters(), *net.named_buffers()]:
            out[f"{net_name}.{name}"] = t
    for opt_name, opt in (("opt_g", gan.opt_g), ("opt_d", gan.opt_d)):
        for i, state in enumerate(opt.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"{opt_name}.{i}.{key}"] = value
    for name, scaler in (("scaler_g", gan.scaler_g), ("scaler_d", gan.scaler_d)):
        if scaler.is_enabled():
            out[f"{name}.scale"] = scaler._scale
            out[f"{name}.growth"] = scaler._growth_tracker
    for net, count in gan.skipped.items():
        out[f"skipped.{net}"] = count
    if gan.augment is not None:
        out["augment.p"] = gan.augment.p
    return out


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_iteration_changes_its_state_in_place(strategy, precision, feature):
    params = params_for(feature, strategy, precision)
    context = DistContext()
    gan, g_ema = build_gan(params, context, CLASSES if params.model.conditional else None)
    ada = adaptive_p(params, gan, context)
    step = graphed.iteration(STRATEGIES[strategy], gan, params, context)
    assert isinstance(step, graphed.EagerIteration)  # on CPU
    if params.precision == "fp16":  # a skipped step must be counted in place too
        gan.scaler_d._init_scale = gan.scaler_g._init_scale = 2.0**100

    def run(iteration: int):
        stats = step(batches_for(params, gan, iteration))
        if ada is not None:
            ada.update(stats["d/real_sign"], context.all_sum)
        g_ema.update(gan.g, params.train.batch_size)
        return stats

    run(0)  # the first step creates the optimizer and scaler state
    before = {k: (t, t.data_ptr(), t.detach().clone()) for k, t in state_tensors(gan).items()}
    for it in (1, 2):
        run(it)
    after = state_tensors(gan)
    assert after.keys() == before.keys()
    rebound = [k for k, (t, ptr, _) in before.items() if after[k] is not t]
    moved = [k for k, (t, ptr, _) in before.items() if after[k].data_ptr() != ptr]
    assert not rebound and not moved, (rebound, moved)
    # ...and the iterations did change them (the check above is not about frozen state)
    changed = {k for k, (t, _, old) in before.items() if not torch.equal(t, old)}
    if params.precision == "fp16":  # every step skipped: counted, and the scale halved
        assert {"skipped.g", "skipped.d", "scaler_g.scale", "scaler_d.scale"} <= changed
    else:
        weights = {k for k in before if k.startswith(("g.", "d.")) and k.endswith("weight")}
        assert weights & changed
        assert {k for k in before if k.startswith(("opt_g.", "opt_d."))} <= changed
    if ada is not None:
        assert "augment.p" in changed


def test_eager_reason_names_what_keeps_the_step_eager():
    cuda = torch.device("cuda")  # only compared: nothing runs on it
    params = params_for("plain", "d_first_detach", "fp32")
    assert graphed.eager_reason(params, DistContext(device=cuda)) is None
    assert "CUDA graphs need a GPU" in graphed.eager_reason(params, DistContext())
    off = params.model_copy(update={"train": params.train.model_copy(update={"cuda_graph": False})})
    assert graphed.eager_reason(off, DistContext(device=cuda)) == "train.cuda_graph is false"
    ddp = DistContext(rank=0, world_size=2, device=cuda)
    assert "DDP" in graphed.eager_reason(params, ddp)
    ckpt = params.model_copy(
        update={"train": params.train.model_copy(update={"activation_checkpointing": True})}
    )
    assert "activation_checkpointing" in graphed.eager_reason(ckpt, DistContext(device=cuda))


def test_cpu_optimizers_are_not_capturable_and_fused_only_in_the_portable_mode():
    """capturable only on a GPU; on CPU Adam is fused in the portable mode (its kernel's
    square root is correctly rounded on every CPU: issue 29), torch's default otherwise."""
    from ganpipe import cpu

    params = params_for("plain", "d_first_detach", "fp32")
    gan, _ = build_gan(params, DistContext())
    expected = True if cpu.pinned_mode() == "portable" else None
    for opt in (gan.opt_g, gan.opt_d):
        assert opt.defaults["fused"] is expected and opt.defaults["capturable"] is False
