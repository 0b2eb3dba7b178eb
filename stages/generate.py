"""generate: samples from the EMA generator — a grid, interpolations and exported PNGs.

Inputs: params ``seed``, ``generate``, ``determinism`` and of ``devices`` what chooses the
device and threads (``accelerator``, ``gpus``, ``cpu_threads``: one process); ``models/g_ema.pt``.
Outputs: ``samples/grid.png`` (fixed-seed grid), ``samples/interpolation.png`` (latent
interpolation strips), ``samples/images/NNNNNN.png`` (``generate.num_images`` samples for
external tools). Files are written atomically, the folder is swapped in when complete.
While it writes, the stage holds a lock on ``samples/`` (a second generate fails at once,
naming the pid of the first) and first deletes what a killed run left there
(``samples/.images.tmp-*``, ``.grid.png.tmp-*``...).
Command: ``python -m stages.generate``
"""

from __future__ import annotations

from stages import _cli

if __name__ == "__main__":
    _cli.pin_cpu()  # before the imports below load torch: its libraries read the pins once

from pathlib import Path

import torch

from ganpipe import runtime
from ganpipe.files import build_dir_for, clear_leftovers, locked_dir, remove_dir
from ganpipe.modelfile import read_generator
from ganpipe.params import ModelParams, Params
from ganpipe.sampling import export_pngs, interpolation_strips, sample_grid, save_png

SAMPLES = Path("samples")


def main(params: Params) -> None:
    runtime.configure_runtime(params.seed, params.devices, params.determinism)
    generator = read_generator(Path("models/g_ema.pt"))
    g = generator.net.to(runtime.resolve_device(params.devices))
    with locked_dir(SAMPLES, "generate"):
        clear_leftovers(SAMPLES, ["grid.png", "interpolation.png", "images"])
        clear_leftovers(build_dir_for(SAMPLES / "images"), ["images"])  # a link's target's
        write_samples(g, generator.model, params)


def write_samples(g: torch.nn.Module, model: ModelParams, params: Params) -> None:
    """The grid, the interpolation strips and the exported images, each written atomically."""
    cfg = params.generate
    grid = sample_grid(g, model.z_dim, cfg.grid_rows, cfg.seed, cfg.truncation)
    save_png(grid, SAMPLES / "grid.png")
    strips = interpolation_strips(
        g, model.z_dim, cfg.interpolation_rows, cfg.interpolation_steps, cfg.seed, cfg.truncation
    )
    save_png(strips, SAMPLES / "interpolation.png")
    if cfg.num_images:
        export_pngs(g, model.z_dim, cfg.num_images, cfg.seed, SAMPLES / "images", cfg.truncation)
    elif (SAMPLES / "images").exists():
        remove_dir(SAMPLES / "images")


if __name__ == "__main__":
    _cli.run(main, __doc__)
