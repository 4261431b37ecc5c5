"""Writing files so that nothing a user saved is ever half-written.

:func:`atomic_write` is the one atomic write of the project: checkpoints, the affNIST manifest,
the summaries of ``torchvote reproduce`` and the pictures and page of ``torchvote explain`` go
through it (:func:`atomic_write_bytes` for bytes already in memory). :class:`FolderLock` keeps a
second process out of a folder one process writes (a run folder); it and the metrics log open
their files with :func:`open_no_follow`. :func:`load_failure_reason` says why a file saved with
``torch.save`` could not be read back.
"""

from __future__ import annotations

import errno
import os
import secrets
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

__all__ = [
    "FolderInUseError",
    "FolderLock",
    "atomic_write",
    "atomic_write_bytes",
    "create_temporary",
    "discard_output",
    "file_version",
    "folder_failure",
    "load_failure_reason",
    "open_no_follow",
    "remove_abandoned_temporaries",
]

#: The lock file :class:`FolderLock` keeps in its folder.
LOCK_NAME = ".lock"
#: ``flock`` errors that mean "this file system cannot lock", not "locked": run unlocked.
_NO_LOCKING = frozenset({errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL})


class FolderInUseError(OSError):
    """Another process holds the folder's :class:`FolderLock`."""


class FolderLock:
    """An exclusive lock on a folder for as long as this process holds it: ``fcntl.flock`` on
    ``<folder>/.lock``, which holds the holder's process id for the message. The operating system
    releases it when the process ends, however it ends (a killed process leaves no stale lock).
    Where ``fcntl`` does not exist (Windows) nothing is locked.

    Two processes writing one run folder (one command started twice, a scheduler that requeued a
    job whose first process still runs) interleaved its metrics records and renamed each other's
    checkpoints aside, without a word.

    Args:
        folder: the folder to lock (created if missing).
        what: what the folder is, for the message (``"run folder"``).
    """

    def __init__(self, folder: str | os.PathLike[str], what: str = "folder") -> None:
        self.folder, self.what = Path(folder), what
        self._descriptor: int | None = None
        self._created = False  # whether acquire() made the lock file (release(discard=True) removes it)

    def acquire(self) -> FolderLock:
        """Take the lock.

        Raises:
            FolderInUseError: another process holds it (the message names its process id).
            PermissionError: the folder cannot be written (read-only, another user's); the message
                names it.
            OSError: ``<folder>/.lock`` is a symbolic link (:func:`open_no_follow`).
        """
        if self._descriptor is not None:  # held already (a second flock here would refuse it)
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # no flock on this system: unlocked, as before
            return self
        created = not (self.folder / LOCK_NAME).exists()
        try:  # the file is truncated and written below: a link there must not lead to a user's file
            descriptor = open_no_follow(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:  # a read-only mount, a folder of another user's ...
            if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            raise PermissionError(
                f"{self.what} {self.folder} cannot be written ({error.strerror}): this command writes "
                "into it; reading it (torchvote evaluate, explain) needs no write access"
            ) from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(descriptor, 32).decode(errors="replace").strip() or "unknown"
            os.close(descriptor)
            raise FolderInUseError(
                f"{self.what} {self.folder} is in use by another process (pid {holder}): wait for it "
                "to end or stop it; two processes writing one folder mix their files"
            ) from None
        except OSError as error:  # a file system without flock (some network or FUSE mounts)
            os.close(descriptor)
            if error.errno not in _NO_LOCKING:
                raise
            warnings.warn(
                f"{self.folder}: this file system cannot lock ({error.strerror}); another process "
                f"could write the {self.what} at the same time",
                stacklevel=2,
            )
            return self
        self._descriptor, self._created = descriptor, created
        try:  # the holder's pid, for another process's message; the lock holds without it
            os.ftruncate(descriptor, 0)
            os.write(descriptor, f"{os.getpid()}\n".encode())
        except OSError:  # a full disk
            pass
        return self

    def release(self, *, discard: bool = False) -> None:
        """Let the lock go (closing the file releases it); nothing if not held.

        Args:
            discard: also remove the lock file if :meth:`acquire` made it (a folder that turned
                out not to be this process's to write: a user's files are left as they were).
        """
        if self._descriptor is None:
            return
        if discard and self._created:
            (self.folder / LOCK_NAME).unlink(missing_ok=True)  # before the lock goes: nobody else's yet
        os.close(self._descriptor)
        self._descriptor = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def open_no_follow(path: str | os.PathLike[str], flags: int, mode: int = 0o666) -> int:
    """``os.open(path, flags | O_NOFOLLOW, mode)``: a file in a run folder opened to be written in
    place (the lock, the metrics log) is refused where it is a symbolic link, not followed.

    A run folder can come from someone else (an archive, a shared disk); a ``.lock`` linked to
    ``~/.bashrc`` was emptied by the lock, a linked ``metrics.jsonl`` had records appended to, and
    its last line cut from, the file it named. Only the last part of the path is checked: a folder
    that is itself a link (a run kept on another disk) still works. Where the system has no
    ``O_NOFOLLOW`` (Windows) the file is opened as before.

    Args:
        path: the file to open.
        flags: ``os.open`` flags (``os.O_RDWR | os.O_CREAT`` ...).
        mode: the permissions of a file the call creates (less the umask).

    Returns:
        The open file descriptor; the caller closes it.

    Raises:
        OSError: ``path`` is a symbolic link (the message names it and says to remove it), or
            ``os.open``'s own error (missing, no permission).
    """
    # O_BINARY (Windows only): as io.open's descriptors, so that os.fdopen alone turns newlines
    flags |= getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    try:
        return os.open(path, flags, mode)
    except OSError as error:
        # ELOOP on Linux and macOS, EMLINK on FreeBSD; islink tells a link from a loop of links
        if error.errno not in (errno.ELOOP, errno.EMLINK) or not os.path.islink(path):
            raise
        raise OSError(
            f"{path} is a symbolic link: torchvote does not write through links in a run folder; remove it"
        ) from None


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

    Raises:
        NotADirectoryError: a file stands where ``path``'s folder must be (:func:`make_folder`).
    """
    path = Path(path)
    make_folder(path.parent)
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


def file_in_the_way(folder: str | os.PathLike[str]) -> Path | None:
    """The file that stands where ``folder``, or one of its parents, must be a folder.

    The nearest part of the path that exists decides: ``None`` where it is a folder (or nothing
    exists), else that part; a symbolic link to nothing is in the way too. Checked before work
    whose results go to ``folder``, so that the user hears of the file first, not after minutes of
    work (mkdir's own error, "File exists" or "Not a directory" with the whole path, says neither
    which part nor which argument).

    Args:
        folder: the folder to be made or written into.

    Returns:
        The blocking file, or ``None``.
    """
    for part in (Path(folder), *Path(folder).parents):
        if part.exists():
            return None if part.is_dir() else part
        if part.is_symlink():  # a link to nothing: mkdir fails on it with "File exists"
            return part
    return None


def folder_failure(folder: str | os.PathLike[str], error: OSError) -> str:
    """Why ``folder`` could not be made, in words: the folder as given and, where that is
    relative, absolute (a relative one is the current folder's, which the user may not know), and
    the reason (``[Errno 30] Read-only file system: 'runs'`` said neither).

    Args:
        folder: the folder the command tried to make.
        error: what making it raised.

    Returns:
        ``"runs (/home/me/runs): Read-only file system"``.
    """
    try:
        absolute = os.path.abspath(folder)
    except OSError:  # the current folder was deleted: os.getcwd() fails too
        absolute = f"{folder} in a current folder that no longer exists"
    where = str(folder) if absolute == str(folder) else f"{folder} ({absolute})"
    return f"{where}: {error.strerror or ' '.join(str(error).split())}"


def discard_output(stream: Any) -> None:
    """Point ``stream``'s file descriptor at ``os.devnull``: its reader went away (a closed pipe).
    Later writes, and the flush at exit, succeed there instead of raising BrokenPipeError again;
    what the stream buffered goes there too. A stream without a descriptor (a test's) is left as
    it is: each write to it is then dropped by its caller.

    Args:
        stream: a file object, ``sys.stderr`` say.
    """
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def make_folder(folder: str | os.PathLike[str]) -> Path:
    """``mkdir -p folder``, naming the file that stands where a folder must be (mkdir's own
    error, "File exists" or "Not a directory" with the whole path, did not say which part).

    Args:
        folder: the folder to make (nothing happens where it exists).

    Returns:
        ``folder`` as a :class:`~pathlib.Path`.

    Raises:
        NotADirectoryError: ``folder`` or one of its parents is a file.
    """
    folder = Path(folder)
    blocking = file_in_the_way(folder)
    if blocking is not None:
        raise NotADirectoryError(f"cannot make the folder {folder}: {blocking} is a file")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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


def file_version(path: str | os.PathLike[str]) -> tuple[int, int, int, int]:
    """What tells one version of a file from another for an in-process cache: inode, size,
    modification and change times (ns).

    Size and mtime alone served a stale copy for a file replaced by one of the same size within
    the file system's timestamp resolution, or with its mtime kept (``cp -p``, ``rsync -t``,
    ``tar``); the inode changes with every atomic replace (a new file renamed over the old), and
    the change time with every write and ``utime``, which cannot set it back. Still one ``stat``.

    Args:
        path: the file.

    Returns:
        ``(st_ino, st_size, st_mtime_ns, st_ctime_ns)``.

    Raises:
        OSError: the file cannot be ``stat``-ed (missing, no permission).
    """
    stat = os.stat(path)
    return stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns


def load_failure_reason(error: BaseException, path: str | os.PathLike[str] | None = None) -> str:
    """Why ``torch.load(..., weights_only=True)`` refused a file, in words fit for a user.

    torch's message is a paragraph that ends in advice to load with ``weights_only=False``: for a
    damaged or foreign file (a script named as a checkpoint), advice to run whatever code it
    holds. Its first line says what failed, unless that line is the advice itself.

    Args:
        error: what ``torch.load`` raised.
        path: the file it read, if it was one: a file that starts as neither a zip archive nor a
            pickle (text, a script) is said to be no file ``torch.save`` writes (the unpickler's
            own errors on it read ``KeyError: 101`` or "Unsupported operand 105").

    Returns:
        One line: the message's first line, or the error's type and "not a file of tensors that
        torch.load reads without running code", with what the unpickler met where it says.
    """
    start = _first_bytes(path, 2) if path is not None else b""
    if start and not start.startswith((b"PK", b"\x80")):  # torch.save writes a zip, or a legacy pickle
        return f"not a file torch.save writes (it starts with {start!r}, neither a zip archive nor a pickle)"
    text = str(error).strip()
    reason = text.splitlines()[0] if text else type(error).__name__
    if "weights_only" in reason or reason.startswith("Weights only load failed"):
        reason = f"{type(error).__name__}: not a file of tensors that torch.load reads without running code"
        marker = "WeightsUnpickler error:"
        if marker in text:  # what it met, e.g. "Unsupported global: GLOBAL numpy...", without the advice
            told = [line.strip() for line in text.split(marker, 1)[1].splitlines() if line.strip()]
            what = told[0].split(". ")[0].rstrip(".") if told else ""
            reason += f" ({what})" if what else ""
    return reason


def _first_bytes(path: str | os.PathLike[str], count: int) -> bytes:
    """The first ``count`` bytes of ``path``; ``b""`` where it cannot be read."""
    try:
        with open(path, "rb") as file:
            return file.read(count)
    except OSError:
        return b""


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
