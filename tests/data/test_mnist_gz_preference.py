"""Gap a mutation review of ``data/mnist.py`` found: where both a ``.gz`` and a plain IDX file
of a split are present, the ``.gz`` one is read (as ``find_idx_files`` documents)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from torchvote.data import load_mnist
from torchvote.data.mnist import MNIST_IDX_NAMES, find_idx_files

from .conftest import write_tiny_mnist


def test_gz_files_are_preferred_over_plain_ones(tmp_path: Path) -> None:
    """Both forms present with different contents: the images and labels are the ``.gz`` pair's."""
    gz_images, gz_labels = write_tiny_mnist(tmp_path, "test", num=4, gz=True, seed=1)
    write_tiny_mnist(tmp_path, "test", num=6, gz=False, seed=2)
    image_name, label_name = MNIST_IDX_NAMES["test"]
    assert find_idx_files("test", tmp_path) == (tmp_path / f"{image_name}.gz", tmp_path / f"{label_name}.gz")
    images, labels = load_mnist("test", source="idx", root=tmp_path)
    np.testing.assert_array_equal((images[:, 0] * 255).round().numpy(), gz_images)
    np.testing.assert_array_equal(labels.numpy(), gz_labels)
