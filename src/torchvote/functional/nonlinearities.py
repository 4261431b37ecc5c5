"""Nonlinearities applied to a consensus before it leaves the voting loop."""

from __future__ import annotations

import torch
from torch import Tensor

from torchvote.validation import check_positive_float

__all__ = ["squash"]


def squash(inputs: Tensor, dim: int = -1, eps: float = 1e-8) -> Tensor:
    """Shrink a vector to length below 1 while keeping its direction.

    Sabour, Frosst & Hinton 2017, "Dynamic Routing Between Capsules", eq. 1::

        v = ||s||^2 / (1 + ||s||^2) * s / ||s||

    computed as ``s * ||s||^2 / ((1 + ||s||^2) * sqrt(||s||^2 + eps))`` so that a zero vector gives
    a zero vector with a finite gradient (the paper's form divides by zero there).

    Args:
        inputs: any shape; vectors lie along ``dim``.
        dim: the vector axis.
        eps: added under the square root; must be positive.

    Returns:
        A tensor of the shape and dtype of ``inputs`` whose vectors have length < 1.

    Raises:
        ValueError: if ``eps`` is not positive.
    """
    check_positive_float(eps, "eps")
    squared_norm = inputs.pow(2).sum(dim=dim, keepdim=True)
    scale = squared_norm / ((1 + squared_norm) * torch.sqrt(squared_norm + eps))
    return inputs * scale
