"""Writing outputs safely: swap a whole folder in atomically, clear what an interrupted run
left behind, and keep two runs from writing the same outputs at once."""

from __future__ import annotations

import ctypes
import errno
import glob
import hashlib
import logging
import os
import shutil
import stat
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ganpipe.errors import UserError

try:
    import fcntl
except ImportError:  # not POSIX: no locking (see locked_dir)
    fcntl = None

log = logging.getLogger(__name__)

#: ``.NAME.tmp-*``: a file or folder being built beside ``NAME`` (write_bytes_atomic,
#: export_pngs, prepare). ``.NAME.old-*``: a previous ``NAME`` renamed aside (replace_dir).
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
#: The ``errno`` values of a write that failed for lack of space: disk full, quota reached,
#: or the file-size limit (``ulimit -f``; Python ignores SIGXFSZ, so the write fails instead).
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def file_sha256(path: Path) -> str:
    """sha256 of the file ``path``, read in blocks of 1 MiB."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class NoSpaceError(UserError):
    """Writing failed for lack of space; the message says how much is needed, and where.

    A :class:`~ganpipe.errors.UserError`: the stages report it in one line, exit status 2.
    ``strerror`` is the system's reason (``No space left on device``, ``File too large``).
    """

    def __init__(self, message: str, strerror: str | None = None):
        super().__init__(message)
        self.strerror = strerror


def size_text(num_bytes: float) -> str:
    """``num_bytes`` for people: MiB, or GiB from 1 GiB up."""
    if num_bytes >= 2**30:
        return f"{num_bytes / 2**30:,.1f} GiB"
    return f"{num_bytes / 2**20:,.1f} MiB"


def free_bytes(folder: Path) -> int | None:
    """Bytes free on the filesystem of ``folder`` (``None`` when it cannot be told)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def free_space_text(folder: Path) -> str:
    """``"X MiB free there now"`` for the filesystem of ``folder`` (``"free space unknown"``)."""
    try:
        return f"{size_text(shutil.disk_usage(folder).free)} free there now"
    except OSError:
        return "free space unknown"


def no_space_error(exc: OSError, path: Path, needed_bytes: int | None) -> NoSpaceError:
    """The error for writing ``needed_bytes`` (None: not known) to ``path`` (a file, or a
    folder being replaced) that failed with ``exc`` for lack of space (its errno in
    :data:`NO_SPACE_ERRNOS`)."""
    kept = "is unchanged" if path.exists() else "was not written"
    needs = "more room" if needed_bytes is None else size_text(needed_bytes)
    return NoSpaceError(
        f"writing {path} failed ({exc.strerror}): it needs {needs} in "
        f"{path.parent}/ ({free_space_text(path.parent)}); {path} {kept}. Free some space "
        "(or raise the file-size limit, `ulimit -f`), then run the stage again",
        exc.strerror,
    )


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


class OutputLinkError(UserError):
    """An output folder is a symbolic link that cannot be written through (dangling)."""


def build_dir_for(final: Path) -> Path:
    """The folder in which to build a replacement of the folder ``final``.

    Beside ``final``; where ``final`` is a symbolic link (an output moved to a bigger disk),
    beside the folder it points to: :func:`replace_dir` swaps the new folder in there, on
    the target's filesystem (a rename cannot cross filesystems), and the link stays.

    Raises:
        OutputLinkError: ``final`` links to a place whose folder does not exist.
    """
    if not final.is_symlink():
        return final.parent
    target = Path(os.path.realpath(final))
    if not target.parent.is_dir():
        raise OutputLinkError(
            f"{final} is a symbolic link to {target}, whose folder {target.parent} does not "
            f"exist; create {target.parent}, or remove the link {final}"
        )
    return target.parent


def replace_dir(built: Path, final: Path) -> None:
    """Move the finished folder ``built`` to ``final``, then delete the previous ``final``.

    An existing folder is exchanged with the new one in one atomic step, so its path never
    goes missing; where exchange is unsupported it is renamed aside first. A ``final`` that
    is a symbolic link is written through: the folder it points to is replaced, the link
    stays (``built`` must then come from :func:`build_dir_for`).
    """
    if final.is_symlink():
        final = Path(os.path.realpath(final))
    if not final.exists():
        built.rename(final)
    elif exchange(built, final):
        shutil.rmtree(built)
    else:
        aside = final.with_name(f".{final.name}{OLD_MARK}{os.getpid()}")
        final.rename(aside)
        built.rename(final)
        shutil.rmtree(aside)


def remove_dir(final: Path) -> None:
    """Delete the folder ``final``; where it is a symbolic link, the folder it points to (the
    link stays, to be written through again)."""
    shutil.rmtree(os.path.realpath(final) if final.is_symlink() else final)


class OutputsBusyError(UserError):
    """Another process is writing the same outputs; the message names the folder and the pid.

    A :class:`~ganpipe.errors.UserError`: the stages report it in one line, exit status 2.
    """


#: Lock descriptors this process holds (see :func:`locked_dir`).
_HELD_LOCKS: set[int] = set()


def _drop_locks_in_child() -> None:
    # A forked child (prepare's decoding pool) shares the parent's open file description, so
    # it would hold the lock as long as it lives: an orphaned worker of a killed prepare would
    # keep every later run out. Closing the child's copy leaves the parent's lock alone.
    for fd in _HELD_LOCKS:
        with suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_locks_in_child)


def lock_holders(folder: Path) -> list[int]:
    """Process ids holding a ``flock`` on ``folder``, read from Linux's ``/proc/locks``.

    Empty where that cannot be known (another OS, no ``/proc``, another mount namespace).
    """
    try:
        info = os.stat(folder)
        table = Path("/proc/locks").read_text()
    except OSError:
        return []
    exact, same_inode = [], []
    for line in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 4242 00:2a:1234 0 EOF"; waiters have "->" before FLOCK.
        fields = line.split()
        if "FLOCK" not in fields or "->" in fields:
            continue
        at = fields.index("FLOCK")
        try:
            pid = int(fields[at + 3])
            major, minor, inode = fields[at + 4].split(":")
            if int(inode) != info.st_ino:
                continue
        except (IndexError, ValueError):
            continue
        same_inode.append(pid)
        if (int(major, 16), int(minor, 16)) == (os.major(info.st_dev), os.minor(info.st_dev)):
            exact.append(pid)
    # Overlay and FUSE filesystems may show another device number than stat: fall back to
    # the inode alone.
    return exact or same_inode


@contextmanager
def locked_dir(folder: Path, stage: str) -> Iterator[None]:
    """Hold an exclusive lock on the output ``folder`` while ``stage`` writes there.

    The lock is a ``flock`` on the folder itself: no lock file is created, so nothing is left
    behind, and the kernel drops the lock when the holder exits, even by SIGKILL. A second
    run does not wait: it fails at once, naming the folder and the pid holding it, before it
    touches anything (its leftover cleaning would otherwise delete the first run's
    temporaries). Where the filesystem cannot lock (some network filesystems), a warning is
    logged and the run goes on unlocked.

    Raises:
        OutputsBusyError: another process holds the lock.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    owner = os.getpid()
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holders = lock_holders(folder)
            pids = [pid for pid in holders if pid != owner] or holders
            holder = f"process {pids[0]}" if pids else "another process"
            raise OutputsBusyError(
                f"{folder}/ is being written by {holder} (another `{stage}` run?); wait for it "
                f"to finish, or stop it, then rerun `{stage}`"
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
                raise
            log.warning(
                "cannot lock %s (%s): make sure no other %s runs at the same time",
                folder,
                exc.strerror,
                stage,
            )
        _HELD_LOCKS.add(fd)
        yield
    finally:
        if os.getpid() == owner:  # a forked child closed its copy already (and may reuse fd)
            _HELD_LOCKS.discard(fd)
            os.close(fd)


def clear_leftovers(folder: Path, names: Iterable[str]) -> list[Path]:
    """Delete what interrupted writes of ``names`` left in ``folder``.

    Those are the hidden ``.NAME.tmp-*`` and ``.NAME.old-*`` entries (files or folders) that
    an atomic write or :func:`replace_dir` removes when it completes, so one that remains
    belongs to a run that was killed. Call this only while holding :func:`locked_dir` on
    ``folder``: a running writer's temporaries look exactly the same.

    Returns:
        The paths deleted.
    """
    removed = []
    for name in names:
        for mark in (TMP_MARK, OLD_MARK):
            for stale in sorted(folder.glob(f".{glob.escape(name)}{mark}*")):
                if stat.S_ISDIR(stale.lstat().st_mode):
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)
                removed.append(stale)
    if removed:
        log.info(
            "removed %d leftover(s) of an interrupted run in %s: %s",
            len(removed),
            folder,
            ", ".join(p.name for p in removed),
        )
    return removed
