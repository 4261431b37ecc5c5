"""Where torchvote keeps data on disk.

One rule for every data set: files live in ``<data root>/<data set name>/``, where the data root
is ``$TORCHVOTE_DATA`` when that variable is set and non-empty, else the user cache directory
``$XDG_CACHE_HOME/torchvote`` (``~/.cache/torchvote`` when ``XDG_CACHE_HOME`` is unset). Nothing
is created at import time; directories are made only by the functions that write into them.
"""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path

from torchvote.files import file_in_the_way
from torchvote.validation import as_path

__all__ = ["DATA_ENV_VAR", "as_path", "data_root", "dataset_dir", "download_dir", "names_a_file"]

DATA_ENV_VAR = "TORCHVOTE_DATA"


def data_root() -> Path:
    """Return the directory that holds one sub-directory per data set.

    Returns:
        ``Path($TORCHVOTE_DATA)`` if set, else ``$XDG_CACHE_HOME/torchvote`` or
        ``~/.cache/torchvote``. The directory may not exist yet.

    Raises:
        ValueError: ``$TORCHVOTE_DATA`` names a file, or a path under one (a download failed on
            "Not a directory" with a path that did not say where it came from).
    """
    env = os.environ.get(DATA_ENV_VAR, "").strip()
    if env:
        root = Path(env).expanduser()
        blocking = file_in_the_way(root)
        if blocking == root:
            raise ValueError(f"{DATA_ENV_VAR}={env} names a file; it must name the folder data sets go in")
        if blocking is not None:
            raise ValueError(
                f"{DATA_ENV_VAR}={env}: {blocking} is a file; it must name the folder data sets go in"
            )
        return root
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(cache).expanduser() if cache else Path.home() / ".cache"
    return base / "torchvote"


def dataset_dir(name: str, root: str | PathLike[str] | None = None) -> Path:
    """Return the directory for one data set.

    Args:
        name: Data set folder name, e.g. ``"mnist"``.
        root: An explicit directory; when given it is returned as is (the user named the folder
            that holds the files).

    Returns:
        ``Path(root)`` if ``root`` is given, else ``data_root() / name``.

    Raises:
        TypeError: If ``root`` is neither ``None`` nor a path (``str`` or ``os.PathLike``).
        ValueError: If ``root`` is the empty string, or is ``None`` and ``$TORCHVOTE_DATA`` names
            a file (:func:`data_root`).
    """
    if root is not None:
        return as_path(root, "root")
    return data_root() / name


def download_dir(name: str, root: str | PathLike[str] | None, argument: str, *suffixes: str) -> Path:
    """The folder a download of data set ``name`` writes into: :func:`dataset_dir`, refusing a
    ``root`` that names a file (one that exists, or a path ending in one of ``suffixes``), which
    would become a folder of that name or fail on ``mkdir`` with a bare ``File exists``.

    Args:
        name: Data set folder name.
        root: The folder given, or ``None`` for the default.
        argument: The option's name, for the message (``--root``, ``--dir``).
        suffixes: File name endings that mark a file, e.g. ``".mat"``.

    Returns:
        The folder (not created).

    Raises:
        ValueError: ``root`` names a file; the message gives its folder.
        TypeError: as :func:`dataset_dir`.
    """
    directory = dataset_dir(name, root)
    if root is not None and names_a_file(directory, *suffixes):
        raise ValueError(
            f"{argument}: {directory} names a file; a download writes its files into a folder: "
            f"pass the folder ({directory.parent})"
        )
    return directory


def names_a_file(path: Path, *suffixes: str) -> bool:
    """Whether a path given for data names a file, not a folder: an existing file, or a path not
    there yet whose name ends in one of ``suffixes`` (``".mat"``, ``".gz"``); any other path that
    does not exist is a folder to create.

    Args:
        path: the path given.
        suffixes: file name endings that mark a file.

    Returns:
        True for a file.
    """
    return path.is_file() or (not path.exists() and path.name.endswith(suffixes))
