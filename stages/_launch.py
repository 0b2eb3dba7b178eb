"""Launching a stage as several processes through torchrun (``python -m torch.distributed.run``).

The processes are bounded and owned: a launch that the machine cannot hold is refused before
anything starts (:func:`check_capacity`), and torchrun and its ranks die with the process that
started them, even when it is killed with SIGKILL (:func:`die_with_parent`): nothing is left
training on, orphaned, after the stage is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import runpy
import signal
import subprocess
import sys
from contextlib import AbstractContextManager
from pathlib import Path

from ganpipe import dist, runtime
from ganpipe.data.store import verify_lmdb
from ganpipe.errors import UserError
from ganpipe.files import locked_dir
from ganpipe.params import Params

log = logging.getLogger("stages.launch")
#: prctl(2)'s option: the signal this process gets when the thread that forked it ends.
PR_SET_PDEATHSIG = 1
#: Set by the torchrun this module starts, for its ranks: the pid they must die with.
PARENT_PID_VAR = "GANPIPE_TORCHRUN_PID"


class LaunchError(UserError):
    """A launch this machine cannot hold (too many processes for its cores or memory)."""


def die_with_parent(expected_parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent ends (Linux's PR_SET_PDEATHSIG),
    and exit at once if the parent ``expected_parent`` has already gone.

    SIGKILL, not a polite signal: the parent is the launcher (for torchrun) or torchrun (for a
    rank), and either one ending without stopping its children first means it was killed
    itself; its children could only train on unowned. Exact resume makes the kill safe.
    Elsewhere than Linux this does nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != expected_parent:  # it died before the line above took effect
        os._exit(128 + signal.SIGKILL)


def _proc_kib(path: str, field: str) -> int | None:
    """The ``field:`` line of a /proc file in bytes (given in kB there); None where absent."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    return _proc_kib("/proc/meminfo", "MemAvailable")


def resident_bytes() -> int | None:
    """This process's resident set (VmRSS), None where /proc has none."""
    return _proc_kib("/proc/self/status", "VmRSS")


def check_capacity(
    nproc: int,
    on_cpu: bool,
    cores: int,
    per_process_bytes: int | None,
    available_bytes: int | None,
) -> None:
    """Refuse ``nproc`` processes on one machine that has ``cores`` CPU cores (counted on CPU
    only: on CUDA the GPUs bound them, :func:`ganpipe.runtime.check_gpus`) or whose
    ``available_bytes`` of memory cannot hold ``nproc`` of ``per_process_bytes`` (a lower
    bound: each rank holds at least what the launcher holds, torch and the stage loaded).

    Raises:
        LaunchError: naming the key, what the machine has, and the two fixes.
    """
    fix = "lower devices.nproc_per_node, or set devices.oversubscribe: true to launch anyway"
    if on_cpu and nproc > cores:
        raise LaunchError(
            f"devices.nproc_per_node={nproc} processes on CPU, but this machine lets the stage "
            f"use {cores} CPU core(s); {fix}"
        )
    if per_process_bytes and available_bytes is not None:
        needed = nproc * per_process_bytes
        if needed > available_bytes:
            raise LaunchError(
                f"devices.nproc_per_node={nproc} processes need at least {needed / 2**30:.1f} "
                f"GiB of memory ({per_process_bytes / 2**20:.0f} MiB each, the launcher's own "
                f"size), but {available_bytes / 2**30:.1f} GiB is available; {fix}"
            )


def launch(params: Params, module: str) -> int:
    """Run stage ``module`` again under torchrun, one process per device; return its exit code.

    The workers' environment is fixed here, before any of them imports torch:
    ``OMP_NUM_THREADS`` (devices.cpu_threads) and ``CUBLAS_WORKSPACE_CONFIG``; they inherit
    the CPU pins and the GPU selection of this process (:func:`ganpipe.cpu.pin`,
    :func:`ganpipe.cpu.pin_gpus`: ``CUDA_VISIBLE_DEVICES`` from devices.gpus) and pin again
    themselves. One node uses ``--standalone``;
    several use the c10d rendezvous at devices.rdzv_endpoint. ``--max-restarts 0``: a failed
    rank fails the run.
    """
    devices = params.devices
    env = {**os.environ, "OMP_NUM_THREADS": str(devices.cpu_threads)}
    on_cuda = runtime.wants_cuda(devices)
    if on_cuda:
        runtime.check_gpus(devices)
    if not devices.oversubscribe:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        check_capacity(
            devices.nproc_per_node,
            not on_cuda,
            cores or os.cpu_count() or 1,
            resident_bytes(),
            memory_available_bytes(),
        )
    # torchrun runs through this module's __main__, which ties its life to this process's.
    command = [
        sys.executable,
        "-m",
        "stages._launch",
        str(os.getpid()),
        f"--nproc-per-node={devices.nproc_per_node}",
        "--max-restarts=0",
    ]
    if devices.nnodes == 1:
        command.append("--standalone")
    else:
        command += [
            f"--nnodes={devices.nnodes}",
            f"--node-rank={devices.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={devices.rdzv_endpoint}",
            f"--rdzv-id=ganpipe-{module.rsplit('.', 1)[-1]}",
            f"--rdzv-conf=timeout={devices.timeout_s}",
        ]
    command += ["-m", module, *sys.argv[1:]]
    log.info(
        "launching %d x %d processes: %s", devices.nnodes, devices.nproc_per_node, " ".join(command)
    )
    # torchrun gets a session of its own, so that a signal for the stage's process group
    # (Ctrl-C in a terminal) reaches it once, through the handler below, not twice: a second
    # signal during torchrun's shutdown would abandon the workers mid-checkpoint. Its own
    # session does not outlive this process: die_with_parent.
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        # torchrun passes it to the workers, which save a checkpoint and stop.
        if not received:
            proc.send_signal(signum)
        received.append(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    code = proc.wait()
    if received and code != 0:  # (0: the workers had finished before the signal came)
        print(
            f"stopped by signal {received[0]}; the workers saved a checkpoint (torchrun exit "
            f"status {code}); run the stage again to resume",
            file=sys.stderr,
        )
        return 128 + received[0]
    if code != 0:
        print(
            f"error: distributed {module.rsplit('.', 1)[-1]} failed (torchrun exit status "
            f"{code}); the failed rank and its error are reported above",
            file=sys.stderr,
        )
    return code


def lock_outputs(folder: Path, stage: str) -> AbstractContextManager[None]:
    """:func:`ganpipe.files.locked_dir` on ``folder`` in the process the user started.

    A torchrun worker takes no lock: its launcher holds it for the whole run (torchrun and
    the workers do not inherit the descriptor, so a killed launcher frees it).
    """
    if "LOCAL_RANK" in os.environ:
        return contextlib.nullcontext()
    return locked_dir(folder, stage)


def verify_data(*paths: Path) -> None:
    """:func:`ganpipe.data.store.verify_lmdb` on each database, in the process the user
    started, before it launches any worker or opens any output.

    A torchrun worker does not verify again: its launcher did, just before starting it.
    """
    if "LOCAL_RANK" in os.environ:
        return
    for path in paths:
        verify_lmdb(path)


def join(params: Params, module: str) -> dist.DistContext:
    """This process's place in the run of stage ``module``.

    In the process the user started, with a world size > 1: launch ``module`` under
    torchrun and exit with its status. In a torchrun worker (or the only process):
    configure the runtime for this rank and join the process group.
    """
    devices = params.devices
    if devices.world_size > 1 and "LOCAL_RANK" not in os.environ:
        sys.exit(launch(params, module))
    if PARENT_PID_VAR in os.environ:  # a rank of the torchrun that launch() started
        die_with_parent(int(os.environ[PARENT_PID_VAR]))
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size != devices.world_size:
        raise LaunchError(
            f"{world_size} processes were started but devices.nproc_per_node x devices.nnodes "
            f"= {devices.world_size}; let the stage launch torchrun itself"
        )
    runtime.configure_runtime(params.seed, devices, params.determinism, rank)
    return dist.setup(
        devices,
        rank,
        int(os.environ.get("LOCAL_RANK", 0)),
        world_size,
        runtime.resolve_device(devices),
    )


if __name__ == "__main__":
    # ``python -m stages._launch LAUNCHER_PID TORCHRUN_ARGS...``: torchrun, dying with the
    # launcher, and telling its ranks (the environment they inherit) to die with it.
    die_with_parent(int(sys.argv[1]))
    os.environ[PARENT_PID_VAR] = str(os.getpid())
    sys.argv = ["torch.distributed.run", *sys.argv[2:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
