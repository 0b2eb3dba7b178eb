"""Replacing a whole output folder atomically: build beside it, then swap it in."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path

OLD_MARK = ".old-"


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None or not sys.platform.startswith("linux"):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False  # e.g. a filesystem without exchange support
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(a))


def replace_dir(built: Path, final: Path) -> None:
    """Move the finished folder ``built`` to ``final``, then delete the previous ``final``.

    An existing folder is exchanged with the new one in one atomic step, so its path never
    goes missing; where exchange is unsupported it is renamed aside first.
    """
    if not final.exists():
        built.rename(final)
    elif exchange(built, final):
        shutil.rmtree(built)
    else:
        aside = final.with_name(f".{final.name}{OLD_MARK}{os.getpid()}")
        final.rename(aside)
        built.rename(final)
        shutil.rmtree(aside)
