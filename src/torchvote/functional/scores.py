"""Score functions: how much a query (receiver) agrees with each key (sender).

Each returns ``(..., L, S)`` logits for queries ``(..., L, Eq)`` and keys ``(..., S, Ek)``, to be
normalised by :func:`torchvote.functional.attend` (or any configuration of ``vote``).

- dot: Luong, Pham & Manning 2015, eq. 8 ("dot"): ``q . k``.
- general: Luong et al. 2015, eq. 8 ("general"): ``q^T W k``.
- scaled dot: Vaswani et al. 2017, eq. 1: ``q . k / sqrt(E)``.
- additive: Bahdanau, Cho & Bengio 2015, appendix A.1.2: ``v^T tanh(W_q q + W_k k)``.
- concat: Luong et al. 2015, eq. 8 ("concat"): ``v^T tanh(W [q; k])``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["dot_score", "general_score", "scaled_dot_score", "additive_score", "concat_score"]


def _check_rank(name: str, t: Tensor) -> None:
    if t.dim() < 2:
        raise ValueError(f"{name} must have shape (..., length, features), got {tuple(t.shape)}")


def _check_features(name: str, t: Tensor, expected: int, what: str) -> None:
    if t.shape[-1] != expected:
        raise ValueError(
            f"{name} must have {expected} features to match {what}, got shape {tuple(t.shape)}"
        )


def dot_score(query: Tensor, key: Tensor) -> Tensor:
    """Luong's dot score ``q . k``.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.

    Returns:
        ``(..., L, S)`` logits.

    Raises:
        ValueError: if the feature sizes differ.
    """
    _check_rank("query", query)
    _check_rank("key", key)
    _check_features("key", key, query.shape[-1], "query")
    return torch.einsum("...ie,...je->...ij", query, key)


def scaled_dot_score(query: Tensor, key: Tensor, scale: float | None = None) -> Tensor:
    """Vaswani's scaled dot score ``q . k / sqrt(E)`` (or ``q . k * scale``).

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.
        scale: multiplier; default ``1 / sqrt(E)``.

    Returns:
        ``(..., L, S)`` logits.
    """
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return dot_score(query, key) * scale


def general_score(query: Tensor, key: Tensor, weight: Tensor) -> Tensor:
    """Luong's general score ``q^T W k``.

    Args:
        query: ``(..., L, Eq)``.
        key: ``(..., S, Ek)``.
        weight: ``(Eq, Ek)``.

    Returns:
        ``(..., L, S)`` logits.

    Raises:
        ValueError: if ``weight`` is not ``(Eq, Ek)``.
    """
    _check_rank("query", query)
    _check_rank("key", key)
    if weight.shape != (query.shape[-1], key.shape[-1]):
        raise ValueError(
            f"weight must have shape (query features, key features) = "
            f"{(query.shape[-1], key.shape[-1])}, got {tuple(weight.shape)}"
        )
    return torch.einsum("...ie,ef,...jf->...ij", query, weight, key)


def additive_score(
    query: Tensor, key: Tensor, query_weight: Tensor, key_weight: Tensor, vector: Tensor
) -> Tensor:
    """Bahdanau's additive score ``v^T tanh(W_q q + W_k k)``.

    Memory is ``(..., L, S, H)``: the tanh cannot be factored, which is why dot scores displaced
    this form at scale.

    Args:
        query: ``(..., L, Eq)``.
        key: ``(..., S, Ek)``.
        query_weight: ``(H, Eq)``, as an ``nn.Linear`` weight.
        key_weight: ``(H, Ek)``.
        vector: ``(H,)``.

    Returns:
        ``(..., L, S)`` logits.

    Raises:
        ValueError: if the weights' shapes do not fit the inputs.
    """
    _check_rank("query", query)
    _check_rank("key", key)
    hidden = vector.shape[-1]
    if query_weight.shape != (hidden, query.shape[-1]):
        raise ValueError(f"query_weight must have shape {(hidden, query.shape[-1])}, "
                         f"got {tuple(query_weight.shape)}")
    if key_weight.shape != (hidden, key.shape[-1]):
        raise ValueError(f"key_weight must have shape {(hidden, key.shape[-1])}, "
                         f"got {tuple(key_weight.shape)}")
    projected_q = query @ query_weight.T  # (..., L, H)
    projected_k = key @ key_weight.T  # (..., S, H)
    hidden_states = torch.tanh(projected_q.unsqueeze(-2) + projected_k.unsqueeze(-3))  # (..., L, S, H)
    return hidden_states @ vector


def concat_score(query: Tensor, key: Tensor, weight: Tensor, vector: Tensor) -> Tensor:
    """Luong's concat score ``v^T tanh(W [q; k])``.

    ``W [q; k]`` splits into ``W[:, :Eq] q + W[:, Eq:] k``, so this is the additive score with
    the two halves of one matrix.

    Args:
        query: ``(..., L, Eq)``.
        key: ``(..., S, Ek)``.
        weight: ``(H, Eq + Ek)``.
        vector: ``(H,)``.

    Returns:
        ``(..., L, S)`` logits.

    Raises:
        ValueError: if ``weight`` is not ``(H, Eq + Ek)``.
    """
    _check_rank("query", query)
    _check_rank("key", key)
    q_features = query.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != q_features + key.shape[-1]:
        raise ValueError(f"weight must have shape (hidden, {q_features + key.shape[-1]}), "
                         f"got {tuple(weight.shape)}")
    return additive_score(query, key, weight[:, :q_features], weight[:, q_features:], vector)
