"""ganpipe: a declarative, reproducible GAN training pipeline.

``ganpipe.load_generator(path, device=...)`` reads a generator from a model file (see
:func:`ganpipe.modelfile.load_generator`). It is imported on first use: importing ``ganpipe``
itself must not load torch, since :func:`ganpipe.cpu.pin` has to run before torch loads.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_generator"]


def __getattr__(name: str) -> Any:
    if name == "load_generator":
        from ganpipe.modelfile import load_generator

        return load_generator
    raise AttributeError(f"module 'ganpipe' has no attribute {name!r}")
