"""Devices, seeds, determinism and precision: everything that decides the bits of a run."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import random
import resource
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import torch

from ganpipe import cpu, exact
from ganpipe.params import DeterminismParams, DevicesParams

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def derive_seed(base_seed: int, *purpose: object) -> int:
    """A 63-bit seed for one purpose (``"latents", step``), independent of any RNG state.

    Hashing keeps streams for different purposes uncorrelated and lets any of them be
    recreated on its own (e.g. the latents of step N after a resume).
    """
    text = ":".join(map(str, (base_seed, *purpose))).encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def seeded_generator(base_seed: int, *purpose: object) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive_seed`."""
    return torch.Generator().manual_seed(derive_seed(base_seed, *purpose))


def wants_cuda(devices: DevicesParams) -> bool:
    """Whether the run uses CUDA: accelerator cuda, or auto with a GPU present or listed.

    A list in ``devices.gpus`` asks for those GPUs: with auto, a listed GPU that does not
    exist is an error (:func:`check_gpus`), not a silent run on the CPU.
    """
    if devices.accelerator == "auto" and isinstance(devices.gpus, list) and devices.gpus:
        return True
    return devices.accelerator == "cuda" or (
        devices.accelerator == "auto" and torch.cuda.is_available()
    )


def check_gpus(devices: DevicesParams) -> None:
    """Fail before any work when the selected GPUs cannot host the processes.

    CUDA sees only the GPUs of ``devices.gpus`` (:func:`ganpipe.cpu.pin_gpus` made them
    ``CUDA_VISIBLE_DEVICES`` before torch loaded) and numbers them from 0. A listed GPU that
    does not exist hides itself and every one listed after it, so fewer visible GPUs than
    listed means the first missing one is at that position in the list.

    Raises:
        GpuSelectionError: this process was not pinned to ``devices.gpus``, CUDA sees no GPU, a
            listed GPU does not exist, or there are more processes than GPUs.
    """
    gpus = devices.gpus
    if isinstance(gpus, list) and cpu.pinned_gpus() != gpus:
        raise cpu.GpuSelectionError(
            f"devices.gpus={gpus} but this process did not select them before torch was "
            "imported (CUDA would number all GPUs); call "
            "ganpipe.cpu.pin_gpus(params.devices) first thing in the entry point (the stages "
            "do), or run the stage as `python -m stages.NAME`"
        )
    if gpus == []:
        raise cpu.GpuSelectionError(
            f"devices.gpus=[] selects no GPU but devices.accelerator={devices.accelerator}; "
            "list GPUs in devices.gpus or use devices.accelerator=cpu"
        )
    available = torch.cuda.device_count()
    if isinstance(gpus, list) and available < len(gpus):
        fix = "list this machine's GPUs with `nvidia-smi -L` and name existing ones"
        if available == 0:
            raise cpu.GpuSelectionError(
                f"devices.gpus={gpus} but CUDA sees none of them: this machine has no GPU "
                f"{gpus[0]} (or no CUDA); {fix}, or use devices.accelerator=cpu"
            )
        raise cpu.GpuSelectionError(
            f"devices.gpus={gpus} names GPU {gpus[available]}, which this machine lacks "
            f"(CUDA sees {available} of the {len(gpus)} listed); {fix}"
        )
    if available == 0:
        raise cpu.GpuSelectionError(
            "devices.accelerator=cuda but CUDA is not available on this machine; "
            "use devices.accelerator=auto or cpu"
        )
    selected = len(gpus) if isinstance(gpus, list) else available
    if devices.nproc_per_node > selected:
        raise cpu.GpuSelectionError(
            f"devices.nproc_per_node={devices.nproc_per_node} is more than the "
            f"{selected} GPU(s) selected by devices.gpus={gpus}; lower it"
        )


def resolve_device(devices: DevicesParams) -> torch.device:
    """The torch device for ``devices`` (auto: CUDA when available or GPUs are listed).

    Raises:
        ValueError: CUDA is wanted but the selected GPUs are missing (:func:`check_gpus`).
    """
    if wants_cuda(devices):
        check_gpus(devices)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def configure_runtime(
    seed: int, devices: DevicesParams, determinism: DeterminismParams, rank: int = 0
) -> None:
    """Set CPU numerics, thread count, global seeds (per rank) and determinism flags.

    Everything that must agree across ranks (initial weights, data order, latents) uses
    its own seeded generator; the global RNGs, seeded per rank, only feed per-rank noise
    (WGAN-GP's mixing weights, dropout-like randomness).

    ``CUBLAS_WORKSPACE_CONFIG`` must be in the environment before CUDA initialises; the
    stage entry point sets it (this library reads no environment variables).

    Raises:
        ValueError: this process was not pinned (:func:`ganpipe.cpu.pin`) to
            ``determinism.cpu_isa`` before torch was imported, or the pin did not take.
    """
    apply_cpu_numerics(determinism)
    torch.set_num_threads(devices.cpu_threads)
    random.seed(derive_seed(seed, "python", rank))
    np.random.seed(derive_seed(seed, "numpy", rank) % 2**32)
    torch.manual_seed(derive_seed(seed, "torch", rank))
    use_deterministic_algorithms(determinism.deterministic)
    torch.backends.cudnn.deterministic = determinism.deterministic
    torch.backends.cudnn.benchmark = determinism.cudnn_benchmark


def use_deterministic_algorithms(mode: bool) -> None:
    """``torch.use_deterministic_algorithms(mode)`` without loading torch's compiler.

    The public call also sets ``torch._inductor.config.deterministic`` and so imports
    torch._inductor and torch._dynamo, the compiler's start-up in every stage process that
    builds no optimizer (generate, evaluate), for a flag ganpipe never reads: it compiles
    nothing with inductor. Where something has loaded inductor already, its flag is set as
    the public call sets it.
    """
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode)
    else:
        torch._C._set_deterministic_algorithms(mode, warn_only=False)


def apply_cpu_numerics(determinism: DeterminismParams) -> None:
    """Switch torch to the CPU code paths of ``determinism.cpu_isa`` and check the pins.

    The environment part was set by :func:`ganpipe.cpu.pin` before torch loaded; what
    torch decides at run time is set here: oneDNN off in the portable mode (its
    convolutions choose blocking by cache size and core count, not only by instruction
    set), NNPACK off too (with oneDNN off torch would run forward convolutions through
    it: a third library with its own kernels, and 2x slower here than ATen's im2col +
    GEMM), and denormals kept (a library loaded with flush-to-zero would change results).
    """
    mode, pinned = determinism.cpu_isa, cpu.pinned_mode()
    if pinned != mode:
        how = "never pinned" if pinned is None else f"pinned to determinism.cpu_isa={pinned}"
        raise cpu.CpuError(
            f"determinism.cpu_isa={mode} but this process was {how} before torch was "
            "imported; call ganpipe.cpu.pin(params.determinism, params.devices) first thing "
            "in the entry point (the stages do), or run the stage as `python -m stages.NAME`"
        )
    torch.set_flush_denormal(False)
    torch.backends.mkldnn.enabled = mode == "native"
    torch.backends.nnpack.set_flags(mode == "native")
    if mode == "native":
        return
    capability, mkl = torch.backends.cpu.get_cpu_capability(), mkl_cbwr()
    if capability != "AVX2" or mkl not in (None, cpu.PORTABLE_ENV["MKL_CBWR"]):
        raise cpu.CpuError(
            f"determinism.cpu_isa=portable but ATen runs its {capability} kernels and MKL's "
            f"reproducibility mode is {mkl}: the libraries read their settings before "
            "ganpipe.cpu.pin() set them"
        )


#: MKL's conditional-numerical-reproducibility branches (``mkl_cbwr_get``'s values,
#: mkl_service.h) and its strict flag.
MKL_CBWR_BRANCHES = {
    1: "OFF",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    12: "AVX512",
    14: "AVX512_E1",
}
MKL_CBWR_STRICT = 0x10000


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    """torch's statically linked MKL, where its service functions are visible (x86 Linux)."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        lib.mkl_serv_cbwr_get.restype = ctypes.c_int
        lib.mkl_serv_cbwr_get.argtypes = [ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return lib


def mkl_cbwr() -> str | None:
    """MKL's reproducibility mode as MKL itself reports it (``COMPATIBLE``; ``OFF``: none),
    or None where torch carries no MKL whose state can be read."""
    lib = _mkl()
    if lib is None:
        return None
    value = lib.mkl_serv_cbwr_get(-1)  # MKL_CBWR_ALL
    branch = MKL_CBWR_BRANCHES.get(value & 0xFFFF, str(value & 0xFFFF))
    return f"{branch},STRICT" if value & MKL_CBWR_STRICT else branch


def mkl_version() -> str | None:
    """MKL's version string, or None (see :func:`mkl_cbwr`)."""
    lib = _mkl()
    if lib is None or not hasattr(lib, "MKL_Get_Version_String"):
        return None
    buffer = ctypes.create_string_buffer(256)
    lib.MKL_Get_Version_String(buffer, len(buffer))
    return buffer.value.decode(errors="replace").strip()


def numerics_record(
    determinism: DeterminismParams, devices: DevicesParams, device: torch.device
) -> dict[str, object]:
    """What decides the bits of this process's results besides params, data and code.

    Kept with the model files and in the run fingerprint: a checkpoint is resumed only
    under the same numerics. In the portable mode it holds nothing machine-specific, so
    the model files of two machines stay byte-identical, and names the ops computed in
    IEEE-defined form (:data:`ganpipe.exact.PORTABLE_OPS`); ``native`` adds the CPU
    model and flags (its bits depend on them), a CUDA run the GPU model and library versions.
    """
    record: dict[str, object] = {
        "cpu_isa": determinism.cpu_isa,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.enabled,
        "mkl_cbwr": mkl_cbwr(),
        "env": cpu.env_in_effect(),
        "cpu_threads": devices.cpu_threads,
        "torch": str(torch.__version__),  # a str subclass torch.load(weights_only) refuses
        "device": device.type,
    }
    if determinism.cpu_isa == "native":
        record["cpu"] = cpu.cpu_info()
    else:  # the ops the portable mode computes its own way (the CPU's approximations out)
        record["exact_ops"] = exact.PORTABLE_OPS
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
        record["cuda"] = torch.version.cuda
        record["cudnn"] = torch.backends.cudnn.version()
        # ganpipe.build on a GPU: fused optimizers (not for-each), NHWC convolutions
        record["gpu_step"] = "fused optimizers, channels_last"
    return record


def machine_record() -> dict[str, object]:
    """Where this process runs: CPU, C library and versions (a record, not part of the bits)."""
    return {
        "cpu": cpu.cpu_info(),
        "cpu_count": os.cpu_count(),
        "libc": cpu.libc_version(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": str(torch.__version__),  # a str subclass torch.load(weights_only) refuses
        "mkl": mkl_version(),
        "cuda": torch.version.cuda,
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def autocast_factory(precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """A callable returning the autocast context for ``precision`` (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = PRECISION_DTYPES[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is active for fp16 only (bf16 has fp32's exponent range)."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: seed numpy and random from the worker's torch seed."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def rng_state() -> dict:
    """Every RNG state of this process, in types ``torch.load(weights_only=True)`` accepts."""
    numpy_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            **numpy_state,
            "state": {
                "key": numpy_state["state"]["key"].tolist(),
                "pos": int(numpy_state["state"]["pos"]),
            },
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = dict(state["numpy"])
    numpy_state["state"] = {
        "key": np.asarray(numpy_state["state"]["key"], dtype=np.uint32),
        "pos": numpy_state["state"]["pos"],
    }
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB: allocated CUDA memory on a GPU, resident
    set size (``ru_maxrss``, everything the process touched) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
