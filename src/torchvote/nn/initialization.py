"""Initialisations shared by torchvote's modules, written so that ``reset_parameters`` draws what
the constructor drew before it had one: a seeded model keeps its exact starting weights.

Each fills a parameter in place, without recording gradients, on the parameter's own device and
dtype, so that a module built on the ``"meta"`` device gets real values after ``to_empty()``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["near_identity_", "scaled_normal_"]


def scaled_normal_(tensor: Tensor, std: float) -> Tensor:
    """Fill ``tensor`` with ``torch.randn(shape) * std``, in place (bit for bit what the modules
    drew before, which ``nn.init.normal_`` does not promise).

    Args:
        tensor: the parameter to fill.
        std: the standard deviation.

    Returns:
        ``tensor``.
    """
    with torch.no_grad():
        return tensor.copy_(torch.randn(tensor.shape, device=tensor.device, dtype=tensor.dtype) * std)


def near_identity_(tensor: Tensor, std: float = 0.1) -> Tensor:
    """Fill ``tensor`` ``(..., P, P)`` with the identity plus ``N(0, std^2)`` noise, in place: matrix
    capsules' transformations start near the identity so that poses pass on.

    Args:
        tensor: the parameter to fill, square in its last two axes.
        std: the noise's standard deviation.

    Returns:
        ``tensor``.
    """
    with torch.no_grad():
        eye = torch.eye(tensor.shape[-1], device=tensor.device, dtype=tensor.dtype)
        return tensor.copy_(eye + std * torch.randn(tensor.shape, device=tensor.device, dtype=tensor.dtype))
