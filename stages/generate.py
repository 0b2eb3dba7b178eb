"""generate: a fixed-seed grid of samples from the EMA generator.

Inputs: params ``generate``, ``devices``, ``determinism``; ``models/g_ema.pt``.
Outputs: ``samples/grid.png`` (written atomically).
Command: ``python -m stages.generate``
"""

from __future__ import annotations

from pathlib import Path

from ganpipe import runtime
from ganpipe.checkpoint import load
from ganpipe.nets import DcganGenerator
from ganpipe.params import ModelParams, Params
from ganpipe.sampling import generate_grid, save_png
from stages import _cli


def load_generator(path: Path) -> tuple[DcganGenerator, ModelParams]:
    """Rebuild a generator from a model file written by the train stage."""
    record = load(path)
    model = ModelParams(**record["model"])
    g = DcganGenerator(
        model.z_dim, model.g_width, record["channels"], record["image_size"], model.norm
    )
    g.load_state_dict(record["state_dict"])
    return g.eval(), model


def main(params: Params) -> None:
    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    g, model = load_generator(Path("models/g_ema.pt"))
    grid = generate_grid(g, model.z_dim, params.generate.grid_rows, params.generate.seed)
    save_png(grid, Path("samples/grid.png"))


if __name__ == "__main__":
    _cli.run(main, __doc__)
