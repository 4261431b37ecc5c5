"""Which IDX files of a split are read when a folder holds both forms (``name``, ``name.gz``) of
some, and when the cached copy of a split is read anew.

Each file used to take its own ``.gz`` when there was one: a download stopped after the images'
``.gz`` paired those images with the labels of an older plain pair beside them, another data set's
perhaps (Fashion-MNIST's files have MNIST's names and counts), and nothing said so.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from torchvote.data import CorruptDataError, load_mnist, write_idx
from torchvote.data.mnist import MNIST_IDX_NAMES, find_idx_files

from .conftest import write_tiny_mnist


def pixels(images) -> np.ndarray:
    """The uint8 pixels of loaded (n, 1, 28, 28) images in [0, 1]."""
    return (images[:, 0] * 255).round().numpy().astype(np.uint8)


def test_a_plain_pair_beside_one_gz_file_is_read_as_a_pair(tmp_path: Path) -> None:
    """The ``.gz`` of the images alone (the same data: ``gunzip -k``, then the labels' ``.gz``
    removed) no longer splits the pair: the plain images and labels are read together."""
    image_name, label_name = MNIST_IDX_NAMES["test"]
    images, labels = write_tiny_mnist(tmp_path, "test", num=6, gz=False, seed=2)
    write_idx(tmp_path / f"{image_name}.gz", images)
    assert find_idx_files("test", tmp_path) == (tmp_path / image_name, tmp_path / label_name)
    loaded_images, loaded_labels = load_mnist("test", source="idx", root=tmp_path)
    np.testing.assert_array_equal(pixels(loaded_images), images)
    np.testing.assert_array_equal(loaded_labels.numpy(), labels)
    # completed, the .gz pair is read instead (the form the download writes and checks)
    write_idx(tmp_path / f"{label_name}.gz", labels)
    assert find_idx_files("test", tmp_path) == (tmp_path / f"{image_name}.gz", tmp_path / f"{label_name}.gz")
    # one file of each form, each there once: that is the pair
    (tmp_path / image_name).unlink()
    (tmp_path / f"{label_name}.gz").unlink()
    assert find_idx_files("test", tmp_path) == (tmp_path / f"{image_name}.gz", tmp_path / label_name)
    np.testing.assert_array_equal(pixels(load_mnist("test", source="idx", root=tmp_path)[0]), images)


@pytest.mark.parametrize("which", [0, 1], ids=["images", "labels"])
def test_a_gz_file_that_differs_from_the_plain_one_read_is_refused_naming_both(
    tmp_path: Path, which: int
) -> None:
    """A newer ``.gz`` of one file beside an older plain pair, as many examples in each (the
    case a count check cannot see): which files belong together is unknown, so nothing is
    read; the message names both forms of the file and the download that completes the pair."""
    write_tiny_mnist(tmp_path, "train", num=6, gz=False, seed=2)
    newer_images, newer_labels = write_tiny_mnist(tmp_path / "newer", "train", num=6, gz=True, seed=1)
    name = MNIST_IDX_NAMES["train"][which]
    write_idx(tmp_path / f"{name}.gz", (newer_images, newer_labels)[which])
    with pytest.raises(CorruptDataError) as info:
        load_mnist("train", source="idx", root=tmp_path)
    message = str(info.value)
    read, twin = tmp_path / name, tmp_path / f"{name}.gz"
    assert f"{read} (read: its .gz pair is incomplete) and {twin} beside it" in message
    assert "hold different data" in message and "torchvote data mnist --download" in message


def test_a_file_replaced_with_its_size_and_mtime_kept_is_read_anew(tmp_path: Path) -> None:
    """The split's cache was keyed on each file's (mtime, size): a file replaced by another of the
    same size whose mtime was kept (``rsync -t``, ``cp -p``, ``tar`` extraction) or fell in the
    same timestamp tick was served from the cache, stale. A replaced file is a new inode."""
    write_tiny_mnist(tmp_path, "test", num=5, gz=False, seed=1)
    paths = find_idx_files("test", tmp_path)
    stats = [os.stat(path) for path in paths]
    load_mnist("test", source="idx", root=tmp_path)  # cached now
    images, labels = write_tiny_mnist(tmp_path, "test", num=5, gz=False, seed=2)  # renamed over the old
    for path, stat in zip(paths, stats, strict=True):
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert (os.stat(path).st_mtime_ns, os.stat(path).st_size) == (stat.st_mtime_ns, stat.st_size)
    loaded_images, loaded_labels = load_mnist("test", source="idx", root=tmp_path)
    np.testing.assert_array_equal(pixels(loaded_images), images)
    np.testing.assert_array_equal(loaded_labels.numpy(), labels)
