"""The CPU code paths that decide the bits, pinned before torch is imported.

The same params give the same bits on one machine, but on CPU the libraries under torch
choose their code by the processor they find: ATen's vector kernels by instruction set
(``ATEN_CPU_CAPABILITY``), oneDNN's convolutions by instruction set *and* cache sizes and
core count, MKL's BLAS and LAPACK by processor (and its thread count by the problem). A
model trained on an AVX-512 machine therefore differs in every bit from one trained on an
AVX2 machine (measured, see docs/reproducibility.md). ``determinism.cpu_isa`` chooses:

- ``portable``: convolutions run as ATen's own im2col + GEMM instead of oneDNN or NNPACK
  (both switched off by :func:`ganpipe.runtime.configure_runtime`);
  MKL uses its conditional-numerical-reproducibility branch ``COMPATIBLE`` (SSE2 code, the
  one branch meant for Intel and AMD alike: MKL's AVX2 branch exists for Intel processors
  only and falls back to per-CPU dispatch elsewhere) with exactly the threads it is given
  (``MKL_DYNAMIC=FALSE``, ``OMP_DYNAMIC=FALSE``). Some of that branch's vector-math kernels
  (``sqrt``, ``acos``...) still start from the approximate ``rcpps``/``rsqrtps``, whose
  tables are the processor's: the ops that reach them take IEEE-defined forms instead
  (:mod:`ganpipe.exact`). ATen's
  kernels, Sleef transcendentals included, use their AVX2 build
  (``ATEN_CPU_CAPABILITY=avx2``); oneDNN, for anything that still reaches it, stops at AVX2
  (``ONEDNN_MAX_CPU_ISA=AVX2``). Every x86-64 CPU with AVX2 and FMA then computes the same
  bits.
- ``native``: whatever this machine and its environment give (the fastest path, oneDNN's
  convolutions); the bits hold for this CPU model only.

These libraries read their variables once, when they initialise, so :func:`pin` must run
before anything imports torch; it refuses to run after. The same holds for the GPUs a
process may use: CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it initialises, so
:func:`pin_gpus` sets it from ``devices.gpus`` at the same moment. This module imports
nothing that imports torch. It is the one place of the library that reads and writes
environment variables: the process environment is what it manages (the stages call it
first thing).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

from ganpipe.errors import UserError
from ganpipe.params import DeterminismParams, DevicesParams

#: The environment of the portable mode (``determinism.cpu_isa: portable``).
PORTABLE_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "COMPATIBLE",
    "MKL_DYNAMIC": "FALSE",
    "OMP_DYNAMIC": "FALSE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
#: Variables :func:`pin` may set. The thread count is recorded as ``devices.cpu_threads``
#: (torch.set_num_threads decides it); the others are recorded as they are, whatever the mode.
NUMERICS_ENV = (*PORTABLE_ENV, "OMP_NUM_THREADS")
#: CPU flags the portable mode needs: ATen's AVX2 kernels use FMA too.
REQUIRED_FLAGS = ("avx2", "fma")
#: The flags worth recording: the x86 vector levels that libraries dispatch on.
SUMMARY_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)

_pinned: str | None = None
_pinned_gpus: list[int] | None = None


class CpuError(UserError):
    """This CPU cannot run the requested mode (a user error: the message names the fix)."""


class GpuSelectionError(UserError):
    """``devices.gpus`` contradicts the GPUs the environment already selects."""


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, object]:
    """The processor: architecture, model name and its vector flags (:data:`SUMMARY_FLAGS`).

    ``flags`` is None where the system does not say (no /proc/cpuinfo).
    """
    model, flags = None, None
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags" and flags is None:
            present = set(value.split())
            flags = [flag for flag in SUMMARY_FLAGS if flag in present]
    return {"arch": platform.machine(), "model": model or platform.processor(), "flags": flags}


def check_cpu(cpu_isa: str, info: dict[str, object] | None = None) -> None:
    """Raise :class:`CpuError` unless this CPU can run ``determinism.cpu_isa``."""
    if cpu_isa == "native":
        return
    info = info or cpu_info()
    fix = "set determinism.cpu_isa: native in params.yaml (bits then hold for this CPU only)"
    if info["arch"] not in ("x86_64", "AMD64"):
        raise CpuError(
            f"determinism.cpu_isa={cpu_isa} needs an x86-64 CPU with AVX2, but this machine "
            f"is {info['arch']}; {fix}"
        )
    flags = info["flags"]
    if flags is None:
        raise CpuError(
            f"determinism.cpu_isa={cpu_isa}: cannot read this CPU's flags (no /proc/cpuinfo) "
            f"to check for AVX2 and FMA; {fix}"
        )
    missing = [flag for flag in REQUIRED_FLAGS if flag not in flags]
    if missing:
        raise CpuError(
            f"determinism.cpu_isa={cpu_isa} needs a CPU with {' and '.join(REQUIRED_FLAGS)}, "
            f"but this one ({info['model']}) lacks {', '.join(missing)}; {fix}"
        )


def numerics_env(cpu_isa: str, cpu_threads: int) -> dict[str, str]:
    """The variables :func:`pin` sets for ``cpu_isa`` and ``cpu_threads``.

    ``native`` sets the thread count only and leaves the rest to the environment: a
    variable set by the user (e.g. ``ONEDNN_MAX_CPU_ISA``) still applies, and is recorded.
    """
    env = {"OMP_NUM_THREADS": str(cpu_threads)}
    if cpu_isa == "portable":
        env.update(PORTABLE_ENV)
    return env


def pin(determinism: DeterminismParams, devices: DevicesParams) -> None:
    """Fix this process's CPU numerics for ``determinism.cpu_isa``; call before importing torch.

    Child processes (torchrun's workers) inherit the variables, and pin again themselves.

    Raises:
        RuntimeError: torch is imported already (a programming error: the pins would be
            ignored, or half applied).
        CpuError: this CPU cannot run the mode.
    """
    global _pinned
    wanted = numerics_env(determinism.cpu_isa, devices.cpu_threads)
    if _pinned == determinism.cpu_isa and all(os.environ.get(k) == v for k, v in wanted.items()):
        return  # pinned so already (a second entry point in the same process)
    if "torch" in sys.modules:
        raise RuntimeError(
            "ganpipe.cpu.pin() called after torch was imported: torch's libraries read "
            "their CPU settings when they load; call it first thing in the entry point"
        )
    check_cpu(determinism.cpu_isa)
    os.environ.update(wanted)
    _pinned = determinism.cpu_isa


def gpu_env(devices: DevicesParams, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables :func:`pin_gpus` sets for ``devices`` in the environment ``environ``.

    A list in ``devices.gpus`` becomes ``CUDA_VISIBLE_DEVICES``, so that CUDA numbers the
    selected GPUs 0, 1, ... in every process, the only one as well as torchrun's workers
    (which inherit it). The indices are nvidia-smi's: ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    unless the environment chooses an order. ``all`` (or ``devices.accelerator: cpu``)
    sets nothing: whatever the environment selects stays selected.

    Raises:
        GpuSelectionError: the environment selects other GPUs already (a scheduler's
            ``CUDA_VISIBLE_DEVICES``); silently overriding it could take another job's GPU.
    """
    if devices.accelerator == "cpu" or not isinstance(devices.gpus, list):
        return {}
    wanted = ",".join(map(str, devices.gpus))
    current = environ.get("CUDA_VISIBLE_DEVICES")
    if current is not None and current.replace(" ", "") != wanted:
        raise GpuSelectionError(
            f"devices.gpus={devices.gpus} but the environment already selects "
            f"CUDA_VISIBLE_DEVICES={current!r} (set by you or a job scheduler); set "
            "devices.gpus: all to use the GPUs the environment gives, or unset "
            "CUDA_VISIBLE_DEVICES to use devices.gpus"
        )
    env = {"CUDA_VISIBLE_DEVICES": wanted}
    if "CUDA_DEVICE_ORDER" not in environ:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return env


def pin_gpus(devices: DevicesParams) -> None:
    """Make ``devices.gpus`` the GPUs of this process; call before importing torch.

    Child processes (torchrun's workers) inherit the variables, and pin again themselves
    (to the same values).

    Raises:
        RuntimeError: torch is imported already (CUDA may have read the variable).
        GpuSelectionError: see :func:`gpu_env`.
    """
    global _pinned_gpus
    if "torch" in sys.modules:
        raise RuntimeError(
            "ganpipe.cpu.pin_gpus() called after torch was imported: CUDA reads "
            "CUDA_VISIBLE_DEVICES when it initialises; call it first thing in the entry point"
        )
    os.environ.update(gpu_env(devices, os.environ))
    _pinned_gpus = list(devices.gpus) if isinstance(devices.gpus, list) else None


def pinned_gpus() -> list[int] | None:
    """The ``devices.gpus`` list this process was pinned to, or None (``all``, or never)."""
    return _pinned_gpus


def pinned_mode() -> str | None:
    """The ``cpu_isa`` this process was pinned to, or None if :func:`pin` never ran."""
    return _pinned


def env_in_effect() -> dict[str, str | None]:
    """The values of the :data:`PORTABLE_ENV` variables in this process (None: unset)."""
    return {name: os.environ.get(name) for name in PORTABLE_ENV}


def libc_version() -> str:
    """The C library (its libm serves Python's float math and ATen's scalar code)."""
    name, version = platform.libc_ver()
    return f"{name} {version}".strip() or "unknown"


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask (taskset, cgroup cpusets), where the
    platform has one, rather than every core of the machine."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
