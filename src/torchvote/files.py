"""Writing files so that nothing a user saved is ever half-written.

:func:`atomic_write` is the one atomic write of the project: checkpoints, the affNIST manifest,
the summaries of ``torchvote reproduce`` and the pictures and page of ``torchvote explain`` go
through it (:func:`atomic_write_bytes` for bytes already in memory).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "atomic_write_bytes", "create_temporary", "remove_abandoned_temporaries"]


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, suffix: str = ".tmp"
) -> None:
    """Call ``write(binary_file)`` on a new file beside ``path``, then rename it to ``path``: a
    reader sees the old file or the whole new one, never a torn one.

    The temporary file is in the same directory (same file system), created with the usual
    permissions (``0o666`` less the umask, not a temporary file's ``0o600``), flushed and fsynced
    before ``os.replace`` swaps the name; the directory is fsynced so the rename survives a power
    loss. On any error the temporary file is removed and ``path`` is untouched.

    Args:
        path: the file to write (its folder is created if missing).
        write: a callable given the open binary file; an exception it raises (a checksum that
            does not match) leaves ``path`` as it was.
        suffix: the temporary file's last suffix (``.part`` for a download).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = create_temporary(path, suffix)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def create_temporary(path: str | os.PathLike[str], suffix: str = ".tmp") -> tuple[int, Path]:
    """A new, empty file beside ``path`` to write and then rename to it: ``.NAME.PID.HEX`` plus
    ``suffix``, opened for writing, with the usual permissions (``0o666`` less the umask, where
    ``tempfile.mkstemp`` gives ``0o600``: a shared data folder's files became unreadable to the
    other users). The pid in the name lets :func:`remove_abandoned_temporaries` tell a write whose
    process was killed from one in progress.

    Args:
        path: the file the temporary one will become (its folder must exist).
        suffix: the temporary file's last suffix.

    Returns:
        ``(descriptor, temporary path)``; the caller closes the one and renames or removes the other.
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)  # O_BINARY: Windows only
    return os.open(temporary, flags, 0o666), temporary


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """:func:`atomic_write` of ``data``.

    Args:
        path: the file to write.
        data: its new contents.
    """
    atomic_write(path, lambda handle: handle.write(data))


def remove_abandoned_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files :func:`atomic_write` left in ``directory`` when its process was
    killed mid-write (a ``SIGKILL`` or a power loss skips its clean-up): a hidden file the size of
    what was being written, never read. Only files whose writing process no longer runs on this
    machine are deleted, so a write in progress (this process's or another's) is left alone.

    Args:
        directory: the folder to clean (nothing happens if it does not exist).

    A file this process may not delete (another user's, a read-only folder) is left alone. On a
    folder shared between machines (NFS) a process id names another machine's process: keep such
    folders to one machine's writers.

    Returns:
        The files deleted.
    """
    removed = []
    for temporary in (*Path(directory).glob(".*.tmp"), *Path(directory).glob(".*.part")):
        pid = temporary.name.rsplit(".", 3)[1]  # .NAME.PID.HEX.tmp (or .part)
        if pid.isdigit() and int(pid) != os.getpid() and not _process_runs(int(pid)):
            try:
                temporary.unlink(missing_ok=True)
            except OSError:  # another user's, in a shared read-only folder: left for its owner
                continue
            removed.append(temporary)
    return removed


def _process_runs(pid: int) -> bool:
    """Whether a process with this id runs on this machine (signal 0 checks without sending; on
    Windows ``os.kill`` would end the process instead, so there every process counts as running)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it runs, under another user (PermissionError), or the check is not allowed
        return True
    return True


def _fsync_directory(directory: Path) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory descriptors
        return
    try:
        os.fsync(descriptor)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(descriptor)
