"""The CPU ops of the pipeline, op by op: a digest of each result, to compare across CPUs.

Run it natively and under ``qemu-x86_64 -cpu MODEL`` (user-mode emulation of another
processor, e.g. ``Haswell`` or ``EPYC-Rome``) and compare the lines: an op whose digest
differs between CPUs reaches an instruction whose result is the processor's choice
(``rcpps``/``rsqrtps`` tables), not IEEE 754's, in that mode.

    python -m tools.isa_ops portable > native.txt
    qemu-x86_64 -cpu EPYC-Rome .venv/bin/python -m tools.isa_ops portable > rome.txt
    diff native.txt rome.txt

The first argument is ``determinism.cpu_isa`` (``portable`` or ``native``); the process
pins it as the stages do, one thread. Inputs are built from integers (no RNG), 100k values
per op, so that a 1-ulp difference on a few percent of them shows.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable

from ganpipe import cpu
from ganpipe.params import DeterminismParams, DevicesParams


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "portable"
    cpu.pin(DeterminismParams(cpu_isa=mode), DevicesParams(cpu_threads=1))
    import torch

    from ganpipe import evaluation, exact, runtime, sampling

    runtime.configure_runtime(0, DevicesParams(cpu_threads=1), DeterminismParams(cpu_isa=mode))

    def digest(value) -> str:
        tensors = value if isinstance(value, (list, tuple)) else [value]
        h = hashlib.sha256()
        for t in tensors:
            t = torch.as_tensor(t)
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]

    n = 100_000
    ints = torch.arange(n, dtype=torch.int64) * 2654435761 % (1 << 24)
    pos = ints.float() / (1 << 16) + 1e-3  # (0, 256]
    sym = (ints.float() - (1 << 23)) / (1 << 20)  # [-8, 8)
    unit = (ints.float() / (1 << 23) - 1).clamp(-1, 1)  # [-1, 1]
    strided = sym.view(-1, 4)[:, 1]

    def net_grads(net: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
        net.zero_grad()
        out = net(x)
        out.square().mean().backward()
        return [out.detach(), *(p.grad for p in net.parameters())]

    def adam(**options) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(300, 100, generator=gen)) for _ in range(3)]
        opt = torch.optim.Adam(params, lr=1e-3, **options)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = sym[: p.numel()].view_as(p) * (step + i + 1) * 1e-3
            opt.step()
        return [p.detach() for p in params]

    def ema() -> list[torch.Tensor]:
        avg = [pos[:1000].clone(), sym[:5000].clone()]
        torch._foreach_lerp_(avg, [sym[:1000], pos[:5000]], 1 - 0.5 ** (64 / 10_000))
        return avg

    torch.manual_seed(0)
    conv = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 4, 2, 1),
        torch.nn.BatchNorm2d(8),
        torch.nn.LeakyReLU(0.2),
        torch.nn.ConvTranspose2d(8, 3, 4, 2, 1),
        torch.nn.Tanh(),
    )
    images = sym[: 16 * 3 * 16 * 16].view(16, 3, 16, 16) / 8
    feats_a = sym[: 400 * 32].view(400, 32)
    feats_b = (pos[: 300 * 32].view(300, 32) / 64) - 2
    gen = torch.Generator().manual_seed(1)
    lat_a, lat_b = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)

    ops: dict[str, Callable[[], object]] = {
        "randn": lambda: torch.randn(n, generator=torch.Generator().manual_seed(3)),
        "rand": lambda: torch.rand(n, generator=torch.Generator().manual_seed(3)),
        "sqrt": lambda: torch.sqrt(pos),
        "sqrt strided": lambda: torch.sqrt(strided.abs()),
        "sqrt float64": lambda: torch.sqrt(pos.double()),
        "sqrt complex64": lambda: torch.sqrt(sym.to(torch.complex64)),
        "pow 0.5": lambda: pos**0.5,
        "rsqrt": lambda: torch.rsqrt(pos),
        "exact.sqrt": lambda: exact.sqrt(pos),
        "exp": lambda: torch.exp(sym),
        "exp float64": lambda: torch.exp(sym.double()),
        "log": lambda: torch.log(pos),
        "log float64": lambda: torch.log(pos.double()),
        "log1p": lambda: torch.log1p(pos),
        "expm1": lambda: torch.expm1(sym),
        "log2": lambda: torch.log2(pos),
        "log10": lambda: torch.log10(pos),
        "tanh": lambda: torch.tanh(sym),
        "tanh strided": lambda: torch.tanh(strided),
        "sigmoid": lambda: torch.sigmoid(sym),
        "softplus": lambda: torch.nn.functional.softplus(sym),
        "logsigmoid": lambda: torch.nn.functional.logsigmoid(sym),
        "leaky_relu": lambda: torch.nn.functional.leaky_relu(sym, 0.2),
        "erf": lambda: torch.erf(sym),
        "sin": lambda: torch.sin(sym),
        "cos": lambda: torch.cos(sym),
        "tan": lambda: torch.tan(unit),
        "acos": lambda: torch.arccos(unit),
        "exact.arccos": lambda: exact.arccos(unit),
        "asin": lambda: torch.arcsin(unit),
        "atan": lambda: torch.arctan(sym),
        "pow tensor": lambda: torch.pow(pos, unit),
        "pow 3": lambda: sym**3,
        "reciprocal": lambda: torch.reciprocal(pos),
        "div": lambda: sym / pos,
        "round": lambda: torch.round(sym * 100),
        "norm dim": lambda: sym.view(-1, 100).norm(dim=1),
        "std var": lambda: (sym.view(-1, 100).std(dim=1), sym.double().std()),
        "foreach lerp (EMA)": ema,
        "adam single-tensor": lambda: adam(foreach=False),
        "adam for-each": lambda: adam(foreach=True),
        "adam fused": lambda: adam(fused=True),
        "conv/bn/tanh fwd+bwd": lambda: net_grads(conv, images),
        "mm": lambda: feats_a @ feats_a.T,
        "mm float64": lambda: feats_a.double().T @ feats_a.double(),
        "cdist mm": lambda: torch.cdist(feats_a, feats_b),
        "cdist direct": lambda: torch.cdist(
            feats_a, feats_b, compute_mode="donot_use_mm_for_euclid_dist"
        ),
        "exact.cdist": lambda: exact.cdist(feats_a, feats_b),
        "eigvals float64": lambda: torch.linalg.eigvals(
            (feats_a.double().T @ feats_a.double()) @ (feats_b.double().T @ feats_b.double())
        ),
        "fid": lambda: torch.tensor(evaluation.fid(feats_a, feats_b)),
        "kid": lambda: torch.tensor(evaluation.kid(feats_a, feats_b, 5, 100, 0)),
        "precision/recall": lambda: torch.tensor(evaluation.precision_recall(feats_a, feats_b, 3)),
        "slerp": lambda: sampling.slerp(lat_a, lat_b, torch.linspace(0, 1, 8)),
    }
    for name, op in ops.items():
        print(f"{name}: {digest(op())}", flush=True)


if __name__ == "__main__":
    main()
