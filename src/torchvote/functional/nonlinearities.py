"""Nonlinearities applied to a consensus before it leaves the voting loop."""

from __future__ import annotations

import torch
from torch import Tensor

from torchvote.validation import check_dim, check_positive_float

__all__ = ["squash"]

_HALF = (torch.float16, torch.bfloat16)


def check_vectors(inputs: Tensor, dim: int) -> None:
    """What a squash takes: a floating-point tensor and one of its axes (dtype and shape only).

    Raises:
        TypeError: ``inputs`` not a floating-point tensor.
        ValueError: ``dim`` not an axis of ``inputs``.
    """
    if not isinstance(inputs, Tensor) or not inputs.is_floating_point():
        described = inputs.dtype if isinstance(inputs, Tensor) else type(inputs).__name__
        raise TypeError(f"inputs must be a floating-point tensor, got {described}")
    check_dim(dim, inputs.dim())


def squash(inputs: Tensor, dim: int = -1, eps: float = 1e-20) -> Tensor:
    """Shrink a vector to length below 1 while keeping its direction.

    Sabour, Frosst & Hinton 2017, "Dynamic Routing Between Capsules", eq. 1::

        v = ||s||^2 / (1 + ||s||^2) * s / ||s||

    computed as ``s * ||s||^2 / (1 + ||s||^2) / sqrt(||s||^2 + eps)`` so that a zero vector gives
    a zero vector with a finite gradient (the paper's form divides by zero there). The relative
    error is about ``eps / (2 ||s||^2)``: with the default ``eps = 1e-20``, below float32's
    rounding for every ``||s||`` above 1e-6 (an ``eps`` of 1e-8, the default until 2026-11-28,
    shrank a vector of length 1e-4 by 29%; short vectors are what a freshly initialised layer
    routes). For float16 and bfloat16 the squared length is formed in float32: in float16 it
    overflows once ``||s||`` passes 256 (``inf / inf`` made the output NaN). The two factors are
    each bounded, so no ``||s||^3`` is formed: in float32 that overflowed once ``||s||`` passed
    7e12 and made the output zero. Limits,
    far beyond what training reaches: in float32 the gradient loses its radial part once ``||s||``
    passes about 3e12 (``||s||^-3`` underflows), and the output is NaN once ``||s||^2`` overflows
    (``||s||`` past 1.8e19); in float64 past 1e102 and 1.3e154.

    Args:
        inputs: any shape; vectors lie along ``dim``.
        dim: the vector axis.
        eps: added under the square root; must be positive.

    Returns:
        A tensor of the shape and dtype of ``inputs`` whose vectors have length < 1 (in exact
        arithmetic: float32 rounds the length to 1.0 once ``||s||`` passes about 4e3, float16
        and bfloat16 much sooner).

    Raises:
        ValueError: if ``eps`` is not positive or ``dim`` is not an axis of ``inputs``.
        TypeError: ``inputs`` not a floating-point tensor.

    Examples:
        >>> import torch
        >>> from torchvote.functional import squash
        >>> v = squash(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))  # lengths 5 and 0
        >>> torch.allclose(v.norm(dim=-1), torch.tensor([25 / 26, 0.0]))  # ||s||^2 / (1 + ||s||^2)
        True
        >>> torch.allclose(v[0] / v[0].norm(), torch.tensor([0.6, 0.8]))  # the direction is kept
        True
        >>> _ = torch.manual_seed(0)
        >>> bool((squash(10 * torch.randn(4, 8, 16)).norm(dim=-1) < 1).all())
        True
    """
    check_positive_float(eps, "eps")
    check_vectors(inputs, dim)
    return _squash(inputs, dim, eps)


def _squash(inputs: Tensor, dim: int = -1, eps: float = 1e-20) -> Tensor:
    """:func:`squash` on checked arguments (the voting loop's step, run in every pass)."""
    vectors = inputs.float() if inputs.dtype in _HALF else inputs
    squared_norm = vectors.pow(2).sum(dim=dim, keepdim=True)
    # ||s||^2 / (1 + ||s||^2) <= 1 times 1 / sqrt(||s||^2 + eps): no ||s||^3 to overflow
    scale = squared_norm / (1 + squared_norm) * torch.rsqrt(squared_norm + eps)
    # multiplied in float32 for half inputs and rounded once: a float16 factor near 1 / ||s|| is
    # subnormal past ||s|| = 2^14 (relative error 5.7e-3 at 2e5, against 3.3e-4)
    return (vectors * scale).to(inputs.dtype)
