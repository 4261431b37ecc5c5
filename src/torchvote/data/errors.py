"""Errors raised by :mod:`torchvote.data`.

Two failure modes deserve their own types because callers react to them differently:

* :class:`DataNotFoundError` -- the data is simply not on this machine. The message lists every
  path that was tried and the one command that provides the data, so the fix is a copy-paste.
* :class:`ChecksumError` -- a downloaded file does not match its published digest (a corrupt or
  tampered download). The partial file is never left under its final name.
* :class:`DownloadError` -- no mirror could be reached (offline, or every server failed); an
  error writing the file on this machine (a full disk, a read-only folder) is not one.
* :class:`CorruptDataError` -- a data file on this machine is damaged, truncated or changed since
  it was verified; the message says how to fetch it again.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from os import PathLike

__all__ = ["ChecksumError", "CorruptDataError", "DataNotFoundError", "DownloadError"]


class DataNotFoundError(FileNotFoundError):
    """A data set is not available locally.

    Subclasses :class:`FileNotFoundError`, so ``except FileNotFoundError`` also catches it.

    Args:
        what: Human-readable name of the missing data, e.g. ``"MNIST (train split)"``.
        looked_for: Every file or directory that was checked, in the order checked.
        command: The single shell command that makes the data available.
        note: An optional last line, e.g. an alternative that needs no download.

    Attributes:
        looked_for: The checked paths as strings.
        command: The command from the message.
    """

    def __init__(
        self,
        what: str,
        looked_for: Iterable[str | PathLike[str]],
        command: str,
        *,
        note: str | None = None,
    ) -> None:
        self.looked_for: tuple[str, ...] = tuple(str(p) for p in looked_for)
        self.command = command
        lines = [f"Not found: {what}. Looked for:"]
        lines += [f"  - {p}" for p in self.looked_for] or ["  (nothing to look for)"]
        lines += ["To get it, run:", f"  {command}"]
        lines += [note] if note else []
        super().__init__("\n".join(lines))


class ChecksumError(RuntimeError):
    """A downloaded file's digest differs from the expected one.

    Args:
        source: Where the bytes came from (a URL).
        algorithm: Name of the hash, e.g. ``"md5"`` or ``"sha256"``.
        expected: Expected hex digest.
        actual: Digest of the bytes actually received.
    """

    def __init__(self, source: str, algorithm: str, expected: str, actual: str) -> None:
        self.source = source
        self.algorithm = algorithm
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"{algorithm} mismatch for {source}: expected {expected}, got {actual}. "
            "The download is corrupt or was altered; it was discarded."
        )


class CorruptDataError(ValueError):
    """A data file on this machine cannot be read as what it should be: a damaged or truncated
    file, or one changed since its download was verified. The message names the file and how to
    fetch it again.

    Subclasses :class:`ValueError` (what these were before), so ``except ValueError`` also catches
    it; the ``torchvote`` command tells it apart from a bad value on the command line: running
    failed (exit status 1), the command line was fine.
    """


class DownloadError(OSError):
    """Every mirror of a file failed to serve it: unreachable, an HTTP error, a broken stream or
    an address that is no URL (the message gives each mirror's reason). Subclasses
    :class:`OSError`, so ``except OSError`` also catches it.

    Args:
        message: what failed, in one line.
        failures: each mirror's URL and the error it gave, in the order they were tried.

    Attributes:
        failures: as given.
    """

    def __init__(self, message: str, failures: Sequence[tuple[str, BaseException]] = ()) -> None:
        super().__init__(message)
        self.failures = list(failures)
