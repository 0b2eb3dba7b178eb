"""Run the train stage in each project folder named, one after another, in this process: one
start-up of Python and torch (and of torchrun) for several runs (tests/integration/test_ddp.py).

    python -m tests.integration.train_projects PROJECT ...
    python -m torch.distributed.run --standalone --nproc-per-node=N \\
        -m tests.integration.train_projects PROJECT ...

Each run is the stage's ``main()`` in its project folder, after the pins of
``stages._cli.pin_cpu`` (the first project's; every project must pin the same), as
``python -m stages.train`` runs it there, or as each worker of the torchrun it launches runs
it. Under torchrun every run joins a process group of its own, on a store of its own (rank 0
picks a free port and tells the others through torchrun's store): the stage leaves its group
at the end of a run, and a group made again on the same store would read the peer addresses
of the one before. What each rank logs during a run goes to ``stage-rank<RANK>.log`` in its
project folder (the tests read it as the stage's output).
"""

from stages import _cli

if __name__ == "__main__":
    import os
    import sys
    from pathlib import Path

    projects = [Path(p).resolve() for p in sys.argv[1:]]
    os.chdir(projects[0])
    sys.argv = sys.argv[:1]  # pin_cpu reads --params from argv: the default, params.yaml
    _cli.pin_cpu()
    import datetime
    import logging
    import socket

    import torch.distributed as dist

    from ganpipe import cpu
    from ganpipe.params import load_params
    from stages import train

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    rank = int(os.environ.get("RANK", 0))
    agent = None
    if "LOCAL_RANK" in os.environ:  # a torchrun worker
        agent = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )
    for number, project in enumerate(projects):
        os.chdir(project)
        params = load_params(Path("params.yaml"))
        cpu.pin(params.determinism, params.devices)  # a no-op, or refused: pinned otherwise
        if agent is not None:
            key = f"train_projects/{number}/port"
            if rank == 0:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    agent.set(key, str(s.getsockname()[1]))
            os.environ["MASTER_PORT"] = agent.get(key).decode()
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"  # rank 0 serves the store
        handler = logging.FileHandler(project / f"stage-rank{rank}.log")
        logging.getLogger().addHandler(handler)
        try:
            train.main(params)
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()
