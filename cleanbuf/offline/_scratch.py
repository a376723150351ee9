"""The writer's temporary directory next to DST: its disk space and its leftovers.

``cleanbuf clean`` writes DST in a hidden directory next to it,
``.DST.cleanbuf-tmp-XXXXXXXX``, renamed into place at the end. Two faults
end there:

* **Disk full.** The rows are written through memory maps, and a page of
  a sparse file that the disk has no room for kills the process with a
  bus error (``SIGBUS``), no message, the directory left filling the
  disk. :func:`check_free` refuses a write the disk cannot hold before
  anything is laid out, and :func:`reserve` allocates every file of the
  maps (``posix_fallocate``) before a row goes through them, so that a
  disk that fills meanwhile is an ``ENOSPC`` error, never a signal. Both
  raise :class:`NoSpaceError`, which names DST and the bytes needed.
* **A killed run.** ``kill -9`` (or a power cut) leaves the directory.
  Each run holds a lock (``flock``) on its own directory while it lives;
  the next run for the same DST removes every one nobody holds, and says
  so (:func:`clear_leftovers`). One holding the previous DST (a ``--force``
  run killed between its two renames) is named, never removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable

try:
    import fcntl
except ImportError:  # not POSIX: no lock, so leftovers are named, not removed
    fcntl = None

TMP_TAG = ".cleanbuf-tmp-"
FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # errors of a disk (or quota) full
OLD = "old"  # inside a temporary directory: the DST that --force replaces


class NoSpaceError(OSError):
    """The disk holding DST has no room for the output (``errno.ENOSPC``).

    An ``OSError``, as Python's own for a full disk, with a message that
    names DST, the bytes needed and those free.
    """

    def __init__(self, dst: str, need: int, free: int | None = None, what: str = "it"):
        where = os.path.dirname(dst) or "."
        have = "" if free is None else f", {size_text(free)} free there"
        message = (
            f"no space left to write {dst}: {what} needs {size_text(need)} ({need} bytes) on "
            f"{where}{have}. Free some space or pick a DST on a larger disk; nothing was written."
        )
        super().__init__(errno.ENOSPC, message, dst)
        self.need, self.free = need, free

    def __str__(self) -> str:
        return self.strerror


def size_text(n: int) -> str:
    """Bytes for a person.

    Examples:
        >>> size_text(999), size_text(7_232_000), size_text(3 << 30)
        ('999 B', '7.2 MB', '3.2 GB')
    """
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def check_free(dst: str, need: int, what: str = "it") -> None:
    """Raises :class:`NoSpaceError` when DST's disk has less than ``need`` bytes free.

    ``what`` needs them, for the message.
    """
    free = _free(dst)
    if free is not None and free < need:
        raise NoSpaceError(dst, need, free, what)


@contextlib.contextmanager
def space_for(dst: str, need: int, what: str = "it"):
    """Turns a full disk's ``OSError`` inside the block into :class:`NoSpaceError`.

    Examples:
        >>> with space_for("/data/clean.npz", 2_000_000):  # doctest: +ELLIPSIS
        ...     raise OSError(errno.ENOSPC, "No space left on device")
        Traceback (most recent call last):
        ...
        cleanbuf.offline._scratch.NoSpaceError: no space left to write /data/clean.npz: ...
    """
    try:
        yield
    except NoSpaceError:
        raise
    except OSError as err:
        if err.errno not in FULL:
            raise
        raise NoSpaceError(dst, need, _free(dst), what) from err
    except RuntimeError as err:  # torch's file errors: "... No space left on device (28)"
        if f"{os.strerror(errno.ENOSPC)} ({errno.ENOSPC})" not in str(err):
            raise
        raise NoSpaceError(dst, need, _free(dst), what) from err


def _free(dst: str) -> int | None:
    try:
        return shutil.disk_usage(os.path.dirname(dst) or ".").free
    except OSError:
        return None


def reserve(folder: str, dst: str, need: int) -> None:
    """Allocates every file under ``folder`` to its size, before writing through a map.

    A memory-mapped file is laid out sparse: its blocks are taken at the
    first write of each page, too late to fail but with a signal. Where
    the file system cannot allocate ahead (``EOPNOTSUPP``, ``EINVAL``, or
    no ``posix_fallocate``), :func:`check_free` is the only guard.

    Raises:
        NoSpaceError: the disk has no room for the files (``need`` bytes).
    """
    allocate = getattr(os, "posix_fallocate", None)
    if allocate is None:
        return
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            size = os.path.getsize(path)
            if not size:
                continue
            fd = os.open(path, os.O_RDWR)
            try:
                allocate(fd, 0, size)
            except OSError as err:
                if err.errno in FULL:
                    raise NoSpaceError(dst, need, _free(dst)) from err
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    raise
                return  # cannot allocate ahead here: the free space check stands
            finally:
                os.close(fd)


def make(dst: str) -> tuple[str, int | None]:
    """A new temporary directory next to ``dst``, locked while this process lives.

    Returns:
        Its path and the descriptor holding its lock (None where there is no
        lock); :func:`remove` releases both.
    """
    tmp = tempfile.mkdtemp(prefix=_prefix(dst), dir=os.path.dirname(dst))
    if fcntl is None:
        return tmp, None
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks: the directory stays unlocked
        pass
    return tmp, fd


def remove(tmp: str, fd: int | None) -> None:
    """Removes a temporary directory made by :func:`make`, then drops its lock."""
    shutil.rmtree(tmp, ignore_errors=True)
    if fd is not None:
        os.close(fd)


def clear_leftovers(dst: str, say: Callable[[str], None]) -> None:
    """Removes the temporary directories of earlier runs for ``dst`` that died.

    A directory whose lock nobody holds belongs to no living run (the
    kernel drops a killed process's locks): it is removed, and ``say`` is
    told. One a living run holds, one whose lock cannot be tried, and one
    holding the previous DST are named and left alone.

    Examples:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp()
        >>> dst = os.path.join(d, "clean.npz")
        >>> left = tempfile.mkdtemp(prefix=".clean.npz.cleanbuf-tmp-", dir=d)  # no lock
        >>> clear_leftovers(dst, print)  # doctest: +ELLIPSIS
        removed .../.clean.npz.cleanbuf-tmp-... (0 B), left by an earlier cleanbuf clean ...
        >>> os.listdir(d)
        []
    """
    folder = os.path.dirname(dst)
    pattern = re.escape(_prefix(dst)) + r"[a-z0-9_]{8}"
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return
    for name in names:
        path = os.path.join(folder, name)
        if not re.fullmatch(pattern, name) or not os.path.isdir(path):
            continue
        size = size_text(_bytes(path))
        if os.path.lexists(os.path.join(path, OLD)):
            say(
                f"{path} ({size}) holds the previous {dst}, moved aside by a --force run that "
                f"was stopped before it finished; left alone. Move {os.path.join(path, OLD)} "
                "back to DST to keep it, or delete the directory."
            )
            continue
        held = _held(path)
        if held is False:
            shutil.rmtree(path, ignore_errors=True)
            say(
                f"removed {path} ({size}), left by an earlier cleanbuf clean for the same DST "
                "that was stopped before it finished."
            )
        elif held:
            say(f"{path} ({size}) belongs to another cleanbuf clean for {dst}, still running.")
        else:
            say(
                f"{path} ({size}) looks left by an earlier cleanbuf clean for the same DST; "
                "this file system cannot tell whether it still runs, so it is left alone: "
                "delete it if none does."
            )


def _prefix(dst: str) -> str:
    return f".{os.path.basename(dst)}{TMP_TAG}"


def _held(path: str) -> bool | None:
    """Whether a living process holds the directory's lock; None if it cannot be tried."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # drops the lock if it was taken
    return False


def _bytes(path: str) -> int:
    """The bytes the files under ``path`` take on disk."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total
