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
    ``strerror`` is the system's reason (``No space left on device``, ``File too large``);
    from :func:`no_space_error` also ``path``, ``needed_bytes`` and the ``os_error``, to say
    it again once the path is put back (:func:`kept_on_no_space`).
    """

    def __init__(
        self,
        message: str,
        strerror: str | None = None,
        path: Path | None = None,
        needed_bytes: int | None = None,
        os_error: OSError | None = None,
    ):
        super().__init__(message)
        self.strerror = strerror
        self.path, self.needed_bytes, self.os_error = path, needed_bytes, os_error


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
        path,
        needed_bytes,
        exc,
    )


def write_bytes_atomic(data: bytes, path: Path) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, then rename over ``path``.

    A reader (or a crash) sees the old file or the new one, never a partial one.

    Raises:
        NoSpaceError: the disk, a quota or the file-size limit had no room for ``data``; the
            message says how much was needed and what is free where. ``path`` is unchanged.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno not in NO_SPACE_ERRNOS:
            raise
        raise no_space_error(exc, path, len(data)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


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


def _link_tree(source: Path, copy: Path) -> None:
    """Make ``copy`` hold what the folder ``source`` holds, as hard links to its files (a
    plain copy where the filesystem has no hard links)."""
    copy.mkdir()
    for entry in os.scandir(source):
        target = copy / entry.name
        if entry.is_dir(follow_symlinks=False):
            _link_tree(Path(entry.path), target)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        else:
            try:
                os.link(entry.path, target)
            except OSError as exc:
                if exc.errno in NO_SPACE_ERRNOS:
                    raise
                shutil.copy2(entry.path, target)


def _no_space(exc: BaseException) -> bool:
    return isinstance(exc, NoSpaceError) or (
        isinstance(exc, OSError) and exc.errno in NO_SPACE_ERRNOS
    )


@contextmanager
def kept_on_no_space(folder: Path) -> Iterator[None]:
    """Put ``folder`` back as it was when the block fails for lack of space.

    For a writer that rewrites ``folder`` in place, file by file (dvclive's logs, which the
    user watches while they are written): the previous contents are kept aside as hard
    links, ``.NAME.tmp-PID`` beside ``folder`` (beside its target, where it is a symbolic
    link), so keeping them takes no room for data. When the block raises a
    :class:`NoSpaceError` (or an ``OSError`` of :data:`NO_SPACE_ERRNOS`, which becomes one
    naming ``folder``), they are swapped back in (:func:`replace_dir`): ``folder`` is
    byte-identical to what it was, or absent again. Any other ending deletes the kept copy
    and leaves the block's writing as it is (a failed run's log shows what happened).

    The writer must replace the files it rewrites, never write into an existing one (a hard
    link shares the data): dvclive deletes its files when a log is opened and writes them
    anew. A kept copy that a killed run left behind is deleted first, so call this only
    while holding the outputs' lock (:func:`locked_dir`), as :func:`clear_leftovers` says.

    Raises:
        NoSpaceError: the block failed for lack of space; or there was no room to keep the
            previous contents (then nothing was changed).
    """
    beside = build_dir_for(folder)
    clear_leftovers(beside, [folder.name])
    kept = beside / f".{folder.name}{TMP_MARK}{os.getpid()}"
    existed = folder.is_dir()
    if existed:
        try:
            _link_tree(folder, kept)
        except OSError as exc:
            shutil.rmtree(kept, ignore_errors=True)
            if exc.errno not in NO_SPACE_ERRNOS:
                raise
            raise no_space_error(exc, folder, None) from None
    try:
        yield
    except BaseException as exc:
        if not _no_space(exc):
            shutil.rmtree(kept, ignore_errors=True)
            raise
        if existed:
            replace_dir(kept, folder)
        elif folder.is_dir():
            remove_dir(folder)
        if isinstance(exc, OSError):
            raise no_space_error(exc, folder, None) from None
        if exc.path == folder and exc.os_error is not None:  # say "unchanged" only if it is
            raise no_space_error(exc.os_error, folder, exc.needed_bytes) from None
        raise
    shutil.rmtree(kept, ignore_errors=True)


@contextmanager
def reported_as_no_space(path: Path) -> Iterator[None]:
    """Report a write inside the block that fails for lack of space (an ``OSError`` of
    :data:`NO_SPACE_ERRNOS`) as a :class:`NoSpaceError` naming ``path``, the file or folder
    being written: for writers that raise the bare ``OSError`` (dvclive)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in NO_SPACE_ERRNOS:
            raise
        raise no_space_error(exc, path, None) from None


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
