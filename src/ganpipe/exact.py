"""The few CPU ops whose torch kernel leaves bits to the processor, in IEEE-defined form.

On CPU, ATen hands ``float32``/``float64`` ``sqrt`` (and ``acos``, ``asin``, ``atan``,
``tan``, ``log2``, ``log10``, ``float64`` ``log``) to MKL's vector math (VML). In
``MKL_CBWR=COMPATIBLE``, the branch the portable mode pins, those VML kernels start from
the ``rsqrtps``/``rcpps`` approximations, whose tables are the processor's own (Intel's
differ from AMD's, an emulator computes them exactly): ``torch.sqrt`` is 1 ulp apart
between CPUs on about one input in eight (docs/reproducibility.md, ``tools/isa_ops.py``).
So in the portable mode (``determinism.cpu_isa: portable``, on CPU) the pipeline takes,
for the ops it reaches:

- :func:`sqrt`: the correctly rounded square root (what IEEE 754 defines, whatever the
  kernel that approximated it);
- :func:`cdist`: ATen's direct distance kernel, whose square root is the ``sqrtps``
  instruction (correctly rounded), instead of the matrix-product kernel that ends in VML;
- :func:`arccos`: ``atan2`` (ATen's Sleef kernel, pinned to its AVX2 build) of
  correctly rounded operands;
- Adam: torch's fused CPU kernel (:func:`fused_adam`), whose square root is ``sqrtps``,
  instead of the single-tensor step that calls ``torch.sqrt``.

In the native mode, and on a GPU, each is the plain torch op: its bits do not change.
"""

from __future__ import annotations

import math

import torch

from ganpipe import cpu

#: What the portable mode computes its own way (the numerics record names it, so a
#: checkpoint made before is not resumed under it).
PORTABLE_OPS = "fused Adam; correctly rounded sqrt; direct cdist; arccos via atan2"


def _portable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and cpu.pinned_mode() == "portable"


def correctly_rounded_sqrt(x: torch.Tensor) -> torch.Tensor:
    """``sqrt`` of a ``float32`` CPU tensor, correctly rounded (IEEE 754's result).

    ``torch.sqrt`` is within 1 ulp of the square root on any CPU (MKL's HA accuracy);
    of it and its two neighbours, the right one is the one whose rounding interval holds
    ``sqrt(x)``, i.e. ``lo² < x < hi²`` for the midpoints ``lo``, ``hi`` to the neighbours.
    The midpoints have 25 significant bits and their squares 50: in ``float64`` the test is
    exact, and a square root never falls on a midpoint, so the result is a function of
    ``x`` alone.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"correctly_rounded_sqrt takes float32, not {x.dtype}")
    y = torch.sqrt(x)
    up, down = torch.nextafter(y, y.new_tensor(math.inf)), torch.nextafter(y, y.new_tensor(0.0))
    wide, y64 = x.double(), y.double()
    hi, lo = (y64 + up.double()) * 0.5, (y64 + down.double()) * 0.5
    y = torch.where(wide > hi * hi, up, y)
    return torch.where((wide < lo * lo) & (lo > 0), down, y)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """``torch.sqrt``; on CPU in the portable mode correctly rounded (``float32``, the
    pipeline's type; ``float64`` has no such path here and is refused there)."""
    if not _portable(x) or x.dtype not in (torch.float32, torch.float64):
        return torch.sqrt(x)
    if x.dtype == torch.float64:
        raise TypeError("ganpipe.exact.sqrt has no correctly rounded float64 path; use float32")
    return correctly_rounded_sqrt(x)


def fused_adam(device: torch.device) -> bool | None:
    """Adam's ``fused`` argument on ``device``: True on CPU in the portable mode, None (torch's
    default) otherwise. The fused CPU kernel is ATen's, pinned to its AVX2 build like the
    rest, and takes one pass over each parameter where the default takes several."""
    return True if device.type == "cpu" and cpu.pinned_mode() == "portable" else None


def cdist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Euclidean distances between the rows of ``a`` and ``b`` (``torch.cdist``)."""
    if not _portable(a):
        return torch.cdist(a, b)
    return torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist")


def arccos(x: torch.Tensor) -> torch.Tensor:
    """``torch.arccos`` of values in [-1, 1]; in the portable mode
    ``atan2(sqrt((1 - x)(1 + x)), x)`` (the factored form keeps the ends accurate)."""
    if not _portable(x) or x.dtype != torch.float32:
        return torch.arccos(x)
    return torch.atan2(correctly_rounded_sqrt((1 - x) * (1 + x)), x)
