"""ganpipe.exact: the portable mode's IEEE-defined forms of the ops that reach VML."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ganpipe import cpu, exact


def test_sqrt_is_correctly_rounded():
    # A float's square root depends on its mantissa and the parity of its exponent: every
    # 5th float of [1, 4) covers both, plus the ends of the range and the special values.
    bits = torch.arange(0x3F800000, 0x40800000, 5, dtype=torch.int32)
    x = torch.cat(
        [
            bits.view(torch.float32),
            torch.tensor([0.0, -0.0, 1e-45, 1e-40, 1.1754944e-38, 3.4028235e38, -1.0]),
            torch.tensor([float("inf"), float("nan")]),
        ]
    )
    with np.errstate(invalid="ignore"):
        expected = torch.from_numpy(np.sqrt(x.numpy()))  # sqrtps: IEEE 754's result
    for got in (exact.correctly_rounded_sqrt(x), exact.sqrt(x)):  # the process is portable
        nan = expected.isnan()  # sqrt(-1), sqrt(nan): a NaN, its sign bit is no result
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int32), expected[~nan].view(torch.int32))


def test_arccos_and_cdist_stay_accurate():
    c = torch.linspace(-1, 1, 10_001)
    reference = np.arccos(c.double().numpy())
    assert np.abs(exact.arccos(c).double().numpy() - reference).max() < 1e-6
    a, b = torch.randn(50, 16), torch.randn(40, 16)
    assert torch.allclose(exact.cdist(a, b), torch.cdist(a, b), rtol=1e-5, atol=1e-5)


def test_the_native_mode_and_gpus_keep_torch_ops(monkeypatch):
    x = torch.linspace(0.01, 100, 1000)
    monkeypatch.setattr(cpu, "_pinned", "native")
    assert torch.equal(exact.sqrt(x), torch.sqrt(x))
    assert torch.equal(exact.arccos(x / 100), torch.arccos(x / 100))
    assert exact.fused_adam(torch.device("cpu")) is None
    monkeypatch.setattr(cpu, "_pinned", "portable")
    assert exact.fused_adam(torch.device("cpu")) is True
    assert exact.fused_adam(torch.device("cuda")) is None
    with pytest.raises(TypeError, match="float64"):
        exact.sqrt(x.double())
