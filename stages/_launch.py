"""Launching a stage as several processes through torchrun (``python -m torch.distributed.run``)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from contextlib import AbstractContextManager
from pathlib import Path

from ganpipe import dist, runtime
from ganpipe.files import locked_dir
from ganpipe.params import Params

log = logging.getLogger("stages.launch")


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
    if runtime.wants_cuda(devices):
        runtime.check_gpus(devices)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
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
    # signal during torchrun's shutdown would abandon the workers mid-checkpoint.
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


def join(params: Params, module: str) -> dist.DistContext:
    """This process's place in the run of stage ``module``.

    In the process the user started, with a world size > 1: launch ``module`` under
    torchrun and exit with its status. In a torchrun worker (or the only process):
    configure the runtime for this rank and join the process group.
    """
    devices = params.devices
    if devices.world_size > 1 and "LOCAL_RANK" not in os.environ:
        sys.exit(launch(params, module))
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size != devices.world_size:
        raise ValueError(
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
