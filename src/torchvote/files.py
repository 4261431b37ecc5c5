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

__all__ = ["atomic_write", "atomic_write_bytes"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(binary_file)`` on a new file beside ``path``, then rename it to ``path``: a
    reader sees the old file or the whole new one, never a torn one.

    The temporary file is in the same directory (same file system), created with the usual
    permissions (``0o666`` less the umask, not a temporary file's ``0o600``), flushed and fsynced
    before ``os.replace`` swaps the name; the directory is fsynced so the rename survives a power
    loss. On any error the temporary file is removed and ``path`` is untouched.

    Args:
        path: the file to write (its folder is created if missing).
        write: a callable given the open binary file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
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


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """:func:`atomic_write` of ``data``.

    Args:
        path: the file to write.
        data: its new contents.
    """
    atomic_write(path, lambda handle: handle.write(data))


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
