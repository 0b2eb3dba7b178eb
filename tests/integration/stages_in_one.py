"""Run the featurenet, train, generate and evaluate stages (or the STAGEs named, prepare
among them) in one process, in the current folder (a project made by
``tests.helpers.write_project``).

Each stage's own ``main()``, after the pins of ``stages._cli.pin_cpu``, as
``python -m stages.NAME`` would run them: one Python start-up instead of four, which
matters under ``qemu-x86_64`` (tests/integration/test_emulated_cpus.py), and saves the
start-ups of a fixture's project (tests/integration/test_cli.py).

    python -m tests.integration.stages_in_one [STAGE ...]   # default: all four
"""

from stages import _cli

if __name__ == "__main__":
    _cli.pin_cpu()
    import importlib
    import sys
    from pathlib import Path

    from ganpipe.params import load_params

    params = load_params(Path("params.yaml"))
    for name in sys.argv[1:] or ["featurenet", "train", "generate", "evaluate"]:
        importlib.import_module(f"stages.{name}").main(params)
