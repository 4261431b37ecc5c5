"""Download data files with checksum verification (for users who have the internet).

Nothing here runs at import time and no test needs the network: tests replace :func:`urlopen`
in this module with a fake that serves local bytes.

Guarantees of :func:`download_file`: the bytes are streamed into a temporary file in the
destination directory and hashed on the way; only a file whose digest matches is flushed to disk
(``fsync``) and moved to its final name with :func:`os.replace` (atomic on one file system). A
failed, interrupted or corrupt download never leaves a file under the final name (nor a folder
made for it that stayed empty), and a crash just after the rename cannot leave a name pointing at
bytes that never reached the disk.
Mirrors are tried in order.
"""

from __future__ import annotations

import hashlib
import http.client
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Any, BinaryIO
from urllib.error import HTTPError, URLError
from urllib.parse import urlsplit
from urllib.request import Request, urlopen

from torchvote.data.errors import ChecksumError, DownloadError
from torchvote.data.paths import as_path, download_dir
from torchvote.files import atomic_write, make_folder, remove_abandoned_temporaries
from torchvote.validation import check_positive_float, check_positive_int, check_texts

__all__ = [
    "MNIST_FILES",
    "MNIST_MIRRORS",
    "MNIST_SIZES",
    "download_file",
    "download_mnist",
    "file_digest",
]

#: Mirrors of the original MNIST files, tried in order. The S3 copy is the one torchvision uses
#: since the original site (last entry) started refusing automated downloads.
MNIST_MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)

#: Standard MNIST file names and the MD5 digests of the gzip files as published (the same
#: digests torchvision and TensorFlow Datasets check).
MNIST_FILES: dict[str, str] = {
    "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
}

#: The byte sizes of those files, as published with them (LeCun et al.'s page; TensorFlow
#: Datasets' ``url_checksums/mnist.txt`` lists the same): a download stops one byte past its size,
#: where a mirror that never ended the stream (the plain-http one, or whoever stands in its path)
#: filled the disk before the digest was compared.
MNIST_SIZES: dict[str, int] = {
    "train-images-idx3-ubyte.gz": 9_912_422,
    "train-labels-idx1-ubyte.gz": 28_881,
    "t10k-images-idx3-ubyte.gz": 1_648_877,
    "t10k-labels-idx1-ubyte.gz": 4_542,
}

_CHUNK = 1 << 20
_USER_AGENT = "torchvote-data/0.1 (+https://pypi.org/project/torchvote/)"


def file_digest(path: str | PathLike[str], algorithm: str = "md5") -> str:
    """Return the hex digest of a file, read in 1 MiB chunks.

    Args:
        path: File to hash.
        algorithm: Any name :func:`hashlib.new` accepts, e.g. ``"md5"`` or ``"sha256"``.

    Returns:
        Lower-case hex digest.
    """
    digest = hashlib.new(algorithm)
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_checksum(checksum: object, algorithm: str) -> None:
    """Refuse a digest that no file can match, before anything is downloaded."""
    try:
        length = 2 * hashlib.new(algorithm).digest_size
    except (ValueError, TypeError):
        raise ValueError(f"algorithm: expected a hashlib name such as 'sha256', got {algorithm!r}") from None
    if not isinstance(checksum, str):
        raise TypeError(f"checksum: expected a hex digest string, got {type(checksum).__name__}")
    if len(checksum) != length or any(c not in "0123456789abcdef" for c in checksum.lower()):
        raise ValueError(f"checksum: expected {length} hex digits (a {algorithm} digest), got {checksum!r}")


class _MirrorFailed(Exception):
    """The mirror's own failure (raised from the error it met), where the next mirror may serve:
    unlike an error writing the file here, which every mirror would meet again."""


def _fetch_one(url: str, dest: Path, algorithm: str, expected: str, timeout: float, size: int | None) -> None:
    """Stream ``url`` into a temporary file next to ``dest``; rename it if the digest matches.

    Raises:
        _MirrorFailed: the address, the connection or the stream failed.
        ChecksumError: the bytes are not the expected ones (or more than ``size``, where given:
            the stream is not read past ``size + 1`` bytes).
        OSError: writing the file here failed.
    """
    received = 0

    def read(response: Any) -> bytes:
        # one byte past the size tells a longer file without reading the rest of it
        count = _CHUNK if size is None else min(_CHUNK, size + 1 - received)
        try:
            return response.read(count)
        except (OSError, http.client.HTTPException) as err:
            raise _MirrorFailed(err) from err

    def write_verified(out: BinaryIO) -> None:
        digest = hashlib.new(algorithm)
        try:
            request = Request(url, headers={"User-Agent": _USER_AGENT})
            response = urlopen(request, timeout=timeout)
        except (OSError, http.client.HTTPException, ValueError) as err:  # ValueError: no URL
            raise _MirrorFailed(err) from err
        nonlocal received
        with response:
            for chunk in iter(lambda: read(response), b""):
                received += len(chunk)
                if size is not None and received > size:  # before a byte of it is written
                    raise ChecksumError(url, algorithm, expected.lower(), f"more than its {size} bytes")
                digest.update(chunk)
                out.write(chunk)
        actual = digest.hexdigest()
        if actual != expected.lower():  # raised inside the write: the temporary file goes, dest stays
            raise ChecksumError(url, algorithm, expected.lower(), actual)

    atomic_write(dest, write_verified, suffix=".part")


def download_file(
    urls: str | Sequence[str],
    dest: str | PathLike[str],
    *,
    checksum: str,
    algorithm: str = "md5",
    timeout: float = 60.0,
    force: bool = False,
    size: int | None = None,
) -> Path:
    """Download one file from the first mirror that serves bytes with the right digest.

    Args:
        urls: One URL or several mirrors of the same file, tried in order.
        dest: Final path of the file. Its directory is created if needed.
        checksum: Expected hex digest of the file.
        algorithm: Hash algorithm of ``checksum`` (default ``"md5"``).
        timeout: Socket timeout in seconds for each request.
        force: Download even if ``dest`` already exists with the right digest.
        size: The file's size in bytes, where known: a mirror that serves more is refused after
            ``size + 1`` bytes (a :class:`ChecksumError`, as for wrong bytes), not read to the
            end of its stream. A shorter file fails the digest.

    Before downloading, hidden temporary files that a download or extraction killed mid-write
    (``SIGKILL``, a power cut) left beside ``dest`` are deleted where this user may
    (:func:`~torchvote.files.remove_abandoned_temporaries`).

    Returns:
        ``dest`` as a :class:`~pathlib.Path`.

    Raises:
        TypeError: If ``urls`` is not a URL or a sequence of URLs, ``checksum`` not a string,
            ``dest`` not a path, ``timeout`` not a number or ``size`` not an integer.
        ValueError: If ``urls`` is empty, ``algorithm`` unknown to :mod:`hashlib`,
            ``checksum`` not a hex digest of that algorithm's length (no file could match it), or
            ``timeout`` not a positive finite number (0 made the socket non-blocking, every
            mirror then "failed"), or ``size`` negative. Every argument is checked before a
            mirror is tried.
        ChecksumError: If every mirror answered but none with the expected digest (or each
            served more than ``size`` bytes).
        DownloadError: If no mirror served the file (the message gives each mirror's reason; its
            ``failures``, each mirror's URL and error). The folders this call made for ``dest``
            are removed again while empty, as after any failure or interruption.
        OSError: If writing the file here failed (a full disk, a read-only folder): raised at
            once, not tried again from the next mirror.
    """
    mirrors = [urls] if isinstance(urls, str) else list(urls) if isinstance(urls, Sequence) else None
    if mirrors is None or not all(isinstance(url, str) for url in mirrors):
        raise TypeError(f"urls: expected a URL string or a sequence of them, got {urls!r}")
    if not mirrors:
        raise ValueError("urls: expected at least one URL, got none")
    _check_checksum(checksum, algorithm)
    timeout = check_positive_float(timeout, "timeout")
    size = None if size is None else check_positive_int(size, "size", minimum=0)
    dest = as_path(dest, "dest")
    if not force and dest.is_file() and file_digest(dest, algorithm) == checksum.lower():
        return dest
    # what a download (or an extraction) killed mid-write left here: a hidden file, never read
    remove_abandoned_temporaries(dest.parent)
    created = [folder for folder in (dest.parent, *dest.parent.parents) if not folder.exists()]
    try:
        make_folder(dest.parent)
        return _from_mirrors(mirrors, dest, algorithm, checksum, timeout, size)
    except BaseException:  # a failed or interrupted download leaves no folder it made behind
        for folder in created:  # innermost first; only while empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _from_mirrors(
    mirrors: list[str], dest: Path, algorithm: str, checksum: str, timeout: float, size: int | None
) -> Path:
    """``dest`` from the first mirror that serves the right bytes (:func:`download_file`)."""
    failures: list[tuple[str, Exception]] = []
    for url in mirrors:
        try:
            _fetch_one(url, dest, algorithm, checksum, timeout, size)
            return dest
        except ChecksumError as err:
            failures.append((url, err))
        except _MirrorFailed as err:
            failures.append((url, err.__cause__ or err))
    checksum_errors = [err for _, err in failures if isinstance(err, ChecksumError)]
    if checksum_errors and len(checksum_errors) == len(failures):
        raise checksum_errors[0]
    raise DownloadError(
        f"could not download {dest.name}: every mirror failed ({_failure_report(failures)})", failures
    )


def _failure_report(failures: list[tuple[str, Exception]]) -> str:
    """The mirrors' failures in one line, each reason once after the mirrors that gave it (by host
    name; by URL where two mirrors share a host): ``a.org, b.org: timed out; c.org: HTTP 404 Not
    Found``."""
    hosts = [urlsplit(url).netloc or url for url, _ in failures]
    names = hosts if len(set(hosts)) == len(hosts) else [url for url, _ in failures]
    by_reason: dict[str, list[str]] = {}
    for name, (_, err) in zip(names, failures, strict=True):
        by_reason.setdefault(_reason(err), []).append(name)
    return "; ".join(f"{', '.join(where)}: {reason}" for reason, where in by_reason.items())


def _reason(err: Exception) -> str:
    """A mirror's failure in a few words: an HTTP status, the reason of a URL error (``Temporary
    failure in name resolution``, ``timed out``), else the error's own message."""
    if isinstance(err, HTTPError):
        return f"HTTP {err.code} {err.reason}"
    if isinstance(err, URLError):
        reason = err.reason
        return str(reason.strerror if isinstance(reason, OSError) and reason.strerror else reason)
    return str(err) or type(err).__name__


def download_mnist(
    root: str | PathLike[str] | None = None,
    *,
    mirrors: Sequence[str] = MNIST_MIRRORS,
    timeout: float = 60.0,
    force: bool = False,
) -> dict[str, Path]:
    """Download the four original MNIST IDX files and verify their MD5 digests (and their sizes,
    :data:`MNIST_SIZES`, as they arrive).

    Args:
        root: Destination directory; default ``$TORCHVOTE_DATA/mnist`` or
            ``~/.cache/torchvote/mnist`` (see :mod:`torchvote.data.paths`). This is where
            :func:`torchvote.data.load_mnist` looks with ``source="auto"`` or ``"idx"``.
        mirrors: Base URLs ending in ``/``, tried in order for each file.
        timeout: Socket timeout in seconds for each request.
        force: Download again even when a file with the right digest is present.

    Returns:
        File name -> path of each of the four files.

    Raises:
        ChecksumError: If a file arrives with the wrong digest from every mirror.
        DownloadError: If no mirror is reachable.
        TypeError: If ``mirrors`` is one string (it was read as its characters, one "mirror"
            each) or holds no strings, or ``timeout`` is no number.
        ValueError: If ``root`` names a file rather than the folder to download into,
            ``mirrors`` is empty, or ``timeout`` not a positive finite number.
    """
    mirrors = check_texts(mirrors, "mirrors")
    if not mirrors:
        raise ValueError("mirrors must name at least one base URL, got none")
    timeout = check_positive_float(timeout, "timeout")
    directory = download_dir("mnist", root, "root (--root)", ".gz", "-ubyte")
    return {
        name: download_file(
            [base + name for base in mirrors],
            directory / name,
            checksum=md5,
            algorithm="md5",
            timeout=timeout,
            force=force,
            size=MNIST_SIZES.get(name),  # None for a file added to MNIST_FILES: its size unknown
        )
        for name, md5 in MNIST_FILES.items()
    }
