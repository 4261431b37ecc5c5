"""The real affNIST test set (Tieleman 2013): download, cache, verify, load.

affNIST (https://www.cs.toronto.edu/~tijmen/affNIST/) is MNIST under random affine transforms
on a 40x40 canvas. Its test split transforms each of the 10,000 MNIST test digits 32 times:
320,000 images, shipped as the MATLAB v5 file ``test.mat`` inside
``32x/transformed/test.mat.zip`` (:data:`AFFNIST_TEST`). The file holds a struct
``affNISTdata`` whose field ``image`` is a (1600, N) uint8 matrix, one 40x40 image per column
stored row by row, and ``label_int`` the N labels (reading it needs scipy, the ``affnist``
extra). Sabour et al. 2017 (sec. 5.2) report 79% for CapsNet on this set after training on
translated 40x40 MNIST (:func:`torchvote.data.pad_and_translate_train`).

Checksums. The archive's SHA-256 is the one published in TensorFlow Datasets'
``tensorflow_datasets/url_checksums/affnist.txt`` (github.com/tensorflow/datasets, read at
commit 94091efb1e61ddb2906c9619592dbe9f6766f452; listed for the ``http://`` address of the
same file, 121,743,191 bytes);
:func:`download_affnist` rejects any other bytes. The site publishes no checksum of its own.
After the archive is verified, ``test.mat`` is extracted (zip CRC checked while reading), its
layout checked (320,000 images of 1,600 pixels, labels 0-9), and a ``manifest.json`` written
beside it with the size and SHA-256 of both files. Every later load compares ``test.mat``
against that manifest (the hash once per process and file version), so a changed or truncated
file is reported instead of read.

Where the data is looked for: with ``root`` given, only there (a ``.mat`` file, or a folder
holding ``test.mat`` or numbered batch files ``1.mat ... 32.mat``); else the cache,
``$TORCHVOTE_DATA/affnist/`` or ``~/.cache/torchvote/affnist/``. Files are written atomically:
each goes to a temporary file in the destination folder and is renamed once complete.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shlex
import zipfile
import zlib
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from torchvote.data.download import download_file, file_digest
from torchvote.data.errors import CorruptDataError, DataNotFoundError
from torchvote.data.mnist import _validate_limit
from torchvote.data.paths import as_path, dataset_dir, download_dir, names_a_file
from torchvote.files import atomic_write_bytes, create_temporary, file_version
from torchvote.validation import check_positive_float

__all__ = [
    "AFFNIST_DOWNLOAD_COMMAND",
    "AFFNIST_TEST",
    "AffnistRelease",
    "affnist_mat_files",
    "download_affnist",
    "find_affnist",
    "load_affnist",
    "load_affnist_mat",
    "verification_of",
    "verify_affnist",
]

AFFNIST_DOWNLOAD_COMMAND = "torchvote data affnist --download"
MANIFEST_NAME = "manifest.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class AffnistRelease:
    """One official affNIST archive: where to fetch it, what it holds, how to check it.

    Attributes:
        urls: Addresses of the same archive, tried in order.
        archive: File name of the zip archive.
        member: The ``.mat`` file inside the archive.
        sha256: Published SHA-256 of the archive.
        checksum_source: Where that digest is published.
        images: Number of images in ``member``.
        size: Size of the archive in bytes, as published with ``sha256``: a download stops one
            byte past it (``None``: not known, the stream is read to its end).
    """

    urls: tuple[str, ...]
    archive: str
    member: str
    sha256: str
    checksum_source: str
    images: int
    size: int | None = None


#: The transformed test split: 10,000 MNIST test digits x 32 transforms.
AFFNIST_TEST = AffnistRelease(
    urls=(
        "https://www.cs.toronto.edu/~tijmen/affNIST/32x/transformed/test.mat.zip",
        "http://www.cs.toronto.edu/~tijmen/affNIST/32x/transformed/test.mat.zip",
    ),
    archive="test.mat.zip",
    member="test.mat",
    sha256="2cde38ec83ee2ebfd7b901f8be5a09efb17a1bda04771f9b4905751eb945c01a",
    checksum_source="tensorflow/datasets: tensorflow_datasets/url_checksums/affnist.txt",
    images=320_000,
    size=121_743_191,  # the same line of affnist.txt
)


# --------------------------------------------------------------------------------------------
# reading .mat files
# --------------------------------------------------------------------------------------------


def _field(record: Any, name: str, path: Path) -> np.ndarray:
    try:
        value = record[name] if isinstance(record, dict) else getattr(record, name)
    except (KeyError, AttributeError):
        raise CorruptDataError(f"{path}: affNISTdata has no field {name!r}") from None
    return np.asarray(value)


def _unreadable(path: Path, err: BaseException) -> CorruptDataError:
    """The error for a ``.mat`` file scipy cannot read, saying what to do about it."""
    if zipfile.is_zipfile(path):
        advice = "it is a zip archive: extract the .mat file from it and pass that (or its folder)"
    else:
        advice = (
            "it is truncated, damaged or not MATLAB v5; replace it, e.g. "
            f"`{AFFNIST_DOWNLOAD_COMMAND} --force --root {shlex.quote(str(path.parent))}`"
        )
    return CorruptDataError(f"{path}: not a readable MATLAB file ({type(err).__name__}: {err}); {advice}")


def _read_one_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        from scipy.io import loadmat
        from scipy.io.matlab import MatReadError
    except ImportError as err:
        raise ImportError(
            "reading affNIST's .mat files needs scipy, the 'affnist' extra: pip install "
            "\"torchvote[affnist]\" (or pip install scipy)"
        ) from err
    try:
        contents = loadmat(str(path), simplify_cells=True)
    except (
        MatReadError,  # empty or truncated header
        ValueError,
        TypeError,
        OSError,
        EOFError,
        IndexError,  # a file cut inside its header
        KeyError,
        NotImplementedError,  # MATLAB v7.3 (HDF5)
        zlib.error,  # a damaged compressed variable
    ) as err:
        raise _unreadable(path, err) from None
    if "affNISTdata" not in contents:
        keys = sorted(k for k in contents if not k.startswith("__"))
        raise CorruptDataError(f"{path}: no 'affNISTdata' variable (found {keys})")
    record = contents["affNISTdata"]
    pixels = _field(record, "image", path)
    labels = _field(record, "label_int", path).reshape(-1)
    if pixels.ndim == 1:  # a file holding a single image is squeezed to (1600,)
        pixels = pixels[:, None]
    if pixels.ndim != 2 or pixels.shape[0] != 40 * 40:
        raise CorruptDataError(f"{path}: expected 'image' of shape (1600, N), got {pixels.shape}")
    if pixels.shape[1] != len(labels):
        raise CorruptDataError(f"{path}: {pixels.shape[1]} images but {len(labels)} labels in 'label_int'")
    return pixels, labels


def _check_values(path: Path, pixels: np.ndarray, labels: np.ndarray) -> None:
    """Refuse pixels that are not 8-bit levels and labels that are not the digits 0-9."""
    for name, values, high in (("image", pixels, 255), ("label_int", labels, 9)):
        if values.dtype == np.uint8 and high == 255:
            continue  # the release's pixel type: every value is an 8-bit level
        if values.dtype.kind not in "uif" or (
            values.size
            and (
                values.min() < 0
                or values.max() > high
                or (values.dtype.kind == "f" and not np.array_equal(values, np.round(values)))
            )
        ):
            if values.dtype.kind == "f" and np.isnan(values).any():
                shown = "NaN"  # np.unique lists NaN last, past the first ten values shown
            else:
                shown = np.unique(values)[:10] if values.dtype.kind in "uifb" else values.dtype
            raise CorruptDataError(
                f"{path}: expected {name!r} to hold whole numbers in 0-{high}, got {shown}"
            )


#: Folders of affNIST's other numbered batches (its training and validation sets), named as
#: the page's archives unpack; their files are numbered as the test batches are.
_OTHER_BATCH_FOLDERS = ("training_batches", "validation_batches", "training_and_validation_batches")
#: Images in each of ``test_batches.zip``'s 32 files (a training batch holds 50,000 or 60,000).
TEST_BATCH_IMAGES = 10_000


def _numbered_mat_files(directory: Path) -> list[Path]:
    """``directory``'s ``<digits>.mat`` files (ASCII digits: ``int`` refuses others)."""
    return [p for p in directory.glob("*.mat") if p.stem.isascii() and p.stem.isdigit()]


def _test_batches(directory: Path) -> list[Path]:
    """The test set's files in a folder: ``test.mat``, or the numbered batches of
    ``test_batches.zip`` (``1.mat ... 32.mat``) in order. Other ``.mat`` names (``training.mat``,
    ``validation.mat``) are not read.

    Raises:
        ValueError: the folder is one of the page's training or validation batch folders (their
            files are numbered as the test batches are), or its numbered files are not ``1.mat``
            to ``K.mat`` without a gap, a repeat or a leading zero (a batch missing or counted
            twice would change the set in silence).
    """
    whole = directory / AFFNIST_TEST.member
    if whole.is_file():
        return [whole]
    numbered = _numbered_mat_files(directory)
    if not numbered:
        return []
    if directory.name in _OTHER_BATCH_FOLDERS:
        raise ValueError(
            f"{directory} holds affNIST's {directory.name.replace('_', ' ')}, not the test set: pass the "
            f"folder of test_batches.zip or test.mat (or {AFFNIST_DOWNLOAD_COMMAND})"
        )
    stems = sorted((p.stem for p in numbered), key=lambda stem: (int(stem), stem))
    if stems != [str(number) for number in range(1, len(stems) + 1)]:
        shown = ", ".join(f"{stem}.mat" for stem in stems[:12]) + (", ..." if len(stems) > 12 else "")
        raise ValueError(
            f"{directory}: the numbered test batches must be 1.mat ... {len(stems)}.mat, without a "
            f"gap, a repeat or a leading zero (as test_batches.zip unpacks); found {shown}"
        )
    return sorted(numbered, key=lambda p: int(p.stem))


def affnist_mat_files(path: Path) -> list[Path]:
    """The affNIST test set's ``.mat`` files at ``path``, as :func:`load_affnist_mat` reads them,
    found without reading them (``torchvote data affnist`` checks its ``--root`` with it).

    Args:
        path: one ``.mat`` file, or a folder holding ``test.mat`` or the numbered test batches.

    Returns:
        The files, the numbered batches in natural order.

    Raises:
        ValueError: ``path`` is a file that is not a ``.mat`` file (a mistyped path).
        FileNotFoundError: nothing at ``path``, or a folder without the test set's files.
    """
    if path.is_dir():
        files = _test_batches(path)
        if not files:
            raise FileNotFoundError(f"no test.mat or numbered test batches (1.mat ... 32.mat) in {path}")
        return files
    if path.is_file():
        if path.suffix.lower() != ".mat":  # a mistyped path (a usage error), not a damaged file
            raise ValueError(
                f"{path} is not a .mat file: pass affNIST's test.mat (or a numbered test batch), or "
                "the folder that holds them"
            )
        return [path]
    raise FileNotFoundError(f"affNIST file or directory not found: {path}")


def load_affnist_mat(path: str | PathLike[str], *, limit: int | None = None) -> tuple[Tensor, Tensor]:
    """Read real affNIST ``.mat`` files (MATLAB v5, as distributed by Tieleman).

    Each file holds a struct ``affNISTdata`` whose field ``image`` is a (1600, N) uint8 matrix,
    one 40x40 image per column stored row by row, and ``label_int`` holds the N labels. Needs
    the optional dependency ``scipy`` (``scipy.io.loadmat``); it is imported only here.

    Args:
        path: One ``.mat`` file, or a directory holding ``test.mat`` or the numbered test
            batches, read in natural order (``1.mat, 2.mat, ..., 32.mat``) and concatenated;
            its other ``.mat`` files (the training and validation sets) are not read.
        limit: Keep only the first ``limit`` images (converted to float only those).

    Returns:
        ``(images, labels)``: float32 (N, 1, 40, 40) in [0, 1] (``uint8 / 255``) and
        int64 (N,).

    Raises:
        ImportError: If scipy is not installed (the message says how to install it).
        FileNotFoundError: If ``path`` does not exist or a directory has no ``.mat`` file.
        TypeError, ValueError: If ``limit`` is not a positive int.
        TypeError: If ``path`` is not a ``str`` or ``os.PathLike``.
        CorruptDataError: (a ``ValueError``) If a file is not readable (truncated, damaged, a zip
            archive, MATLAB v7.3) or lacks the affNIST layout: an ``affNISTdata`` struct,
            ``image`` of shape (1600, N) with whole-number pixels in 0-255, N labels 0-9 in
            ``label_int``. The message names the file.
        ValueError: If the path names other data (a usage error): a file that is not a
            ``.mat``, or a folder whose numbered batches are not the test batches (a training or
            validation folder, numbers with a gap, a repeat or a leading zero, a batch of more
            than 10,000 images).
    """
    limit = _validate_limit(limit)
    files = affnist_mat_files(as_path(path, "path"))
    parts = [_read_one_mat(file) for file in files]
    for file, (pixels, labels) in zip(files, parts, strict=True):
        _check_values(file, pixels, labels)
        if file.stem.isdigit() and len(labels) > TEST_BATCH_IMAGES:  # a training batch: 50,000 or 60,000
            raise ValueError(
                f"{file} holds {len(labels):,} images; a test batch holds {TEST_BATCH_IMAGES:,} (this "
                "is one of affNIST's training batches, not the test set)"
            )
    pixels = np.concatenate([p for p, _ in parts], axis=1)[:, :limit]  # (1600, N)
    labels = np.concatenate([y for _, y in parts])[:limit].astype(np.int64)
    # Each column is one image, stored row by row.
    images = torch.from_numpy(pixels.T.reshape(-1, 40, 40).astype(np.float32) / 255.0).unsqueeze(1)
    return images, torch.from_numpy(labels)


# --------------------------------------------------------------------------------------------
# manifest: what was verified at download time
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _sha256_of(path: str, _version: tuple[int, ...]) -> str:
    """SHA-256 of a file, hashed once per process and file version (``_version``:
    :func:`~torchvote.files.file_version`: a file replaced with its size and mtime kept is
    hashed anew, not taken for the one verified)."""
    return file_digest(path, "sha256")


def _check_against_manifest(mat: Path) -> dict[str, Any] | None:
    """If a manifest for ``mat`` lies beside it, raise unless ``mat`` has its size and SHA-256.

    Returns:
        The manifest, or ``None`` when there is none or it records another file (a user's own
        ``.mat`` beside the downloaded ``test.mat`` is read as it is).
    """
    manifest_path = mat.parent / MANIFEST_NAME
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        member = str(manifest.get("member", AFFNIST_TEST.member))
        expected_size, expected_sha = int(manifest["mat_bytes"]), str(manifest["mat_sha256"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CorruptDataError(f"{manifest_path}: unreadable manifest ({err}); {_redownload(mat)}") from None
    if mat.name != member:  # the manifest speaks for the downloaded file only
        return None
    stat = mat.stat()
    if stat.st_size != expected_size:
        raise CorruptDataError(
            f"{mat} has {stat.st_size} bytes but {expected_size} were verified at download "
            f"(truncated or replaced); {_redownload(mat)}"
        )
    actual = _sha256_of(str(mat), file_version(mat))
    if actual != expected_sha:
        raise CorruptDataError(
            f"{mat} changed since it was verified (sha256 {actual}, manifest {expected_sha}); "
            f"{_redownload(mat)}"
        )
    return manifest


def _redownload(mat: Path) -> str:
    return f"run `{AFFNIST_DOWNLOAD_COMMAND} --force --root {shlex.quote(str(mat.parent))}`"


# --------------------------------------------------------------------------------------------
# download
# --------------------------------------------------------------------------------------------


def _extract_member(archive: Path, member: str, directory: Path) -> tuple[Path, str]:
    """Stream ``member`` out of ``archive`` into a temporary file in ``directory``.

    Returns:
        ``(temporary path, sha256)``; the caller renames or removes the file.

    Raises:
        CorruptDataError: (a ``ValueError``) If the archive is not a zip, lacks ``member``, or a
            CRC does not match.
    """
    digest = hashlib.sha256()
    fd, tmp = create_temporary(directory / member, ".part")
    complete = False
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(archive) as zf:
            names = zf.namelist()
            if member not in names:
                raise CorruptDataError(f"{archive}: no {member!r} in the archive (found {names[:5]})")
            with zf.open(member) as source:  # raises BadZipFile on a CRC mismatch at the end
                for chunk in iter(lambda: source.read(_CHUNK), b""):
                    digest.update(chunk)
                    out.write(chunk)
            out.flush()
            os.fsync(out.fileno())  # on disk before any rename can make it look final
        complete = True
    except (zipfile.BadZipFile, zlib.error, EOFError) as err:
        raise CorruptDataError(
            f"{archive}: damaged zip archive ({err}); download it again with --force"
        ) from err
    finally:
        if not complete:
            tmp.unlink(missing_ok=True)
    return tmp, digest.hexdigest()


def _layout_problems(
    parts: list[tuple[np.ndarray, np.ndarray]], expected_images: int
) -> tuple[np.ndarray, list[str]]:
    """Images per digit of ``(pixels, labels)`` parts, and how they differ from the release."""
    problems = [f"pixels are {p.dtype}, not uint8" for p, _ in parts if p.dtype != np.uint8][:1]
    labels = np.concatenate([y for _, y in parts]).astype(np.int64)
    if len(labels) != expected_images:
        problems.append(f"{len(labels)} images, expected {expected_images}")
    if len(labels) and (labels.min() < 0 or labels.max() > 9):
        problems.append(f"labels outside 0-9 ({labels.min()}..{labels.max()})")
    counts = np.bincount(labels.clip(0, 9), minlength=10)
    if len(labels) and (counts == 0).any():
        problems.append(f"no image of the digits {np.flatnonzero(counts == 0).tolist()}")
    return counts, problems


def download_affnist(
    root: str | PathLike[str] | None = None,
    *,
    release: AffnistRelease = AFFNIST_TEST,
    timeout: float = 60.0,
    force: bool = False,
) -> Path:
    """Download the official affNIST test archive, verify it and cache ``test.mat``.

    Steps: fetch the archive (skipped when a copy with the published SHA-256 is already there,
    unless ``force``), extract ``test.mat`` (zip CRC checked), check its layout, rename it into
    place and write ``manifest.json`` beside it. Nothing incomplete is ever left under a final
    name. A cache that matches its manifest is returned as is.

    Args:
        root: Destination folder; default ``$TORCHVOTE_DATA/affnist`` or
            ``~/.cache/torchvote/affnist``.
        release: Which archive (default :data:`AFFNIST_TEST`).
        timeout: Socket timeout in seconds for each request.
        force: Download and extract again even when verified files are present.

    Returns:
        Path of the verified ``test.mat``.

    Raises:
        ChecksumError: If the archive's bytes do not match the published SHA-256.
        OSError: If no address could be reached.
        CorruptDataError: (a ``ValueError``) If the archive or the extracted file is damaged or
            not the affNIST layout.
        ValueError: If ``root`` names a file rather than the folder to download into, or
            ``timeout`` is not a positive finite number (a TypeError if it is no number).
        ImportError: If scipy (needed to check the layout) is missing.
    """
    timeout = check_positive_float(timeout, "timeout")  # checked also when the cache answers
    directory = download_dir("affnist", root, "root (--root)", ".mat", ".zip")
    mat = directory / release.member
    if not force and mat.is_file():
        try:
            manifest = _check_against_manifest(mat)
        except ValueError:
            manifest = None  # changed or damaged: extract again from a verified archive
        if manifest is not None and manifest.get("archive_sha256") == release.sha256:
            return mat
    archive = download_file(
        release.urls,
        directory / release.archive,
        checksum=release.sha256,
        algorithm="sha256",
        timeout=timeout,
        force=force,
        size=release.size,
    )
    tmp, mat_sha = _extract_member(archive, release.member, directory)
    try:
        label_counts, problems = _layout_problems([_read_one_mat(tmp)], release.images)
        if problems:
            raise CorruptDataError(f"{archive} holds no affNIST {release.member}: {'; '.join(problems)}")
        manifest = {
            "format": 1,
            "archive": release.archive,
            "archive_bytes": archive.stat().st_size,
            "archive_sha256": release.sha256,
            "archive_sha256_source": release.checksum_source,
            "member": release.member,
            "mat_bytes": tmp.stat().st_size,
            "mat_sha256": mat_sha,
            "images": int(label_counts.sum()),
            "label_counts": label_counts.tolist(),
        }
        # The manifest goes first: a crash before the rename leaves a manifest that the old
        # file (if any) fails, never an unverified file that passes.
        atomic_write_bytes(directory / MANIFEST_NAME, (json.dumps(manifest, indent=2) + "\n").encode())
        os.replace(tmp, mat)
    finally:
        tmp.unlink(missing_ok=True)
    return mat


# --------------------------------------------------------------------------------------------
# finding and loading
# --------------------------------------------------------------------------------------------


def find_affnist(root: str | PathLike[str] | None = None) -> Path:
    """Locate the real affNIST test data.

    Args:
        root: A ``.mat`` file, or a folder holding ``test.mat`` or numbered batch files
            (``1.mat ... 32.mat``, as in ``test_batches.zip``). When given, only this location
            is checked; default the cache folder (``$TORCHVOTE_DATA/affnist`` or
            ``~/.cache/torchvote/affnist``), read alike: its ``test.mat`` (what the download
            writes) or numbered batch files.

    Returns:
        A ``.mat`` file or a folder of them, for :func:`load_affnist_mat`.

    Raises:
        DataNotFoundError: Listing the paths checked, the download command and the generated
            stand-in ``affnist-style``.
        TypeError: If ``root`` is not ``None``, a ``str`` or an ``os.PathLike``.
    """
    given = as_path(root, "root") if root is not None else None
    if given is not None and given.is_file():
        return given
    note = ""
    if given is not None and names_a_file(given, ".mat"):  # not there yet: a file, not a folder
        looked, directory = [given], given.parent
        note = f"The download writes {directory / AFFNIST_TEST.member}: pass that file or its folder. "
    else:
        directory = dataset_dir("affnist", given)
        mat = directory / AFFNIST_TEST.member
        if mat.is_file():
            return mat
        try:  # numbered test batches: in the folder given, or in the cache
            batches = _test_batches(directory) if directory.is_dir() else []
        except ValueError as err:  # not the test batches: an error for a folder given, a note for the cache
            if given is not None:
                raise
            batches, note = [], f"{err}. "
        if batches:
            return directory
        looked = [mat, directory / "<n>.mat"]
        if given is not None and given.is_dir():  # the data one folder down: say where
            below = sorted({p.parent for p in given.glob(f"*/{AFFNIST_TEST.member}")})
            batches = given / "test_batches"
            below += [batches] if batches.is_dir() and _numbered_mat_files(batches) else []
            if below:
                note = f"Found {', '.join(str(d) for d in below)}: pass that folder as the root. "
    command = AFFNIST_DOWNLOAD_COMMAND
    if given is not None:
        command += f" --root {shlex.quote(str(directory))}"
    raise DataNotFoundError(
        "The real affNIST test set (test.mat, 320,000 images)",
        looked,
        command,
        note=f"{note}Without it, the generated stand-in is the data set 'affnist-style' "
        "(e.g. eval_on=[affnist-style], 40x40 as the real set; eval_on=[affnist-style:canvas=28] "
        "for a model of 28x28 images).",
    )


def load_affnist(
    root: str | PathLike[str] | None = None, *, limit: int | None = None
) -> tuple[Tensor, Tensor]:
    """Load the real affNIST test set (see :func:`find_affnist` for where it is looked for).

    A file with a ``manifest.json`` beside it (what :func:`download_affnist` writes) must match
    it; other files are read as they are.

    Args:
        root: A ``.mat`` file or a folder of them; default the cache.
        limit: Keep only the first ``limit`` images.

    Returns:
        ``(images, labels)``: float32 (N, 1, 40, 40) in [0, 1] and int64 (N,).

    Raises:
        DataNotFoundError: If no affNIST file is found (the message names the download command
            and ``affnist-style``).
        TypeError, ValueError: If ``limit`` is not a positive int.
        CorruptDataError: (a ``ValueError``) If a file changed since it was verified or is not the
            affNIST layout.
        ImportError: If scipy is not installed.
    """
    limit = _validate_limit(limit)
    path = find_affnist(root)
    if path.is_file():
        _check_against_manifest(path)
    return load_affnist_mat(path, limit=limit)


def verification_of(path: str | PathLike[str]) -> str:
    """How far the affNIST data at ``path`` (as :func:`find_affnist` returns it) is verified, in
    words: against the ``manifest.json`` of its download (size and SHA-256), or not at all.

    Raises:
        CorruptDataError: (a ``ValueError``) the file fails its manifest (changed or truncated
            since the download).
    """
    path = as_path(path, "path")
    if path.is_file() and _check_against_manifest(path) is not None:
        return "verified: size and SHA-256 match the download's manifest.json"
    return "not verified: no manifest.json of a download beside it; --verify counts its images"


def verify_affnist(root: str | PathLike[str] | None = None) -> tuple[list[int], list[str]]:
    """Check the real affNIST test set without converting it to float.

    Args:
        root: As in :func:`find_affnist`.

    Returns:
        ``(label_counts, problems)``: images per digit 0-9, and what is wrong (empty when the
        data has :data:`AFFNIST_TEST`'s image count, uint8 pixels and every digit 0-9).

    Raises:
        DataNotFoundError, ValueError, ImportError: As :func:`load_affnist`.
    """
    path = find_affnist(root)
    if path.is_file():
        _check_against_manifest(path)
    counts, problems = _layout_problems(
        [_read_one_mat(file) for file in affnist_mat_files(path)], AFFNIST_TEST.images
    )
    return counts.tolist(), problems
