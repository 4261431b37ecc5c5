"""Attention as one pass of the voting operator, normalised over the senders.

Every function here ends in :func:`torchvote.functional.vote`; the dot-product forms hand their
scores over unexpanded (:class:`DotProductScores`) so that, when no weights are requested, the
work runs on ``F.scaled_dot_product_attention`` and no ``(L, S)`` matrix is formed. Masks are
prepared by :mod:`torchvote.functional.masks` (``check_attention_mask`` and ``is_causal_mask``
live there and are re-exported here).
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchvote.functional.masks import check_attention_mask, is_causal_mask, prepare_attention_mask
from torchvote.functional.voting import DotProductScores, SharedVotes, vote

__all__ = [
    "scaled_dot_product_attention",
    "attend",
    "self_attention",
    "check_attention_mask",
    "is_causal_mask",
]


def _check_qkv(query: Tensor, key: Tensor, value: Tensor) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., length, features), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must share their feature size, got {query.shape[-1]} and "
            f"{key.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length, got {key.shape[-2]} and {value.shape[-2]}"
        )


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    scale: float | None = None,
    need_weights: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``softmax(q k^T * scale + mask) v``: Vaswani et al. 2017, "Attention Is All You Need", eq. 1.

    Without ``need_weights`` this runs on ``F.scaled_dot_product_attention`` (numerically the
    same); with it, on the voting loop, which also returns the weights. A causal 2-D mask is
    recognised and run as ``is_causal``. A query that may attend to nothing gets a zero output and
    zero weights, with finite gradients.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.
        value: ``(..., S, Ev)``.
        attn_mask: boolean (True = may attend) or float (added to the logits), broadcastable to
            ``(..., L, S)``.
        is_causal: query ``l`` attends to keys ``s <= l`` (top-left aligned).
        dropout_p: dropout on the weights; pass 0.0 when not training.
        scale: multiplies ``q k^T``; default ``1 / sqrt(E)``.
        need_weights: also return the ``(..., L, S)`` weights.

    Returns:
        ``(output, weights)``: output ``(..., L, Ev)``; weights ``(..., L, S)`` or ``None``.

    Raises:
        ValueError: mismatched shapes, a mask that does not broadcast or holds NaN.
        TypeError: a mask that is neither boolean nor floating point, non-float inputs.
    """
    _check_qkv(query, key, value)
    target = (*torch.broadcast_shapes(query.shape[:-2], key.shape[:-2]),
              query.shape[-2], key.shape[-2])
    attn_mask, is_causal = prepare_attention_mask(attn_mask, None, target, is_causal=is_causal)
    result = vote(
        SharedVotes(value),
        DotProductScores(query, key, scale),
        normalize_over="senders",
        mask=attn_mask,
        is_causal=is_causal,
        dropout_p=dropout_p,
        record=need_weights,
    )
    weights = result.weights[0] if need_weights else None
    return result.outputs, weights


def attend(
    scores: Tensor,
    value: Tensor,
    *,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """Attention with precomputed scores (additive, general, concat, ...): one pass of voting.

    Args:
        scores: ``(..., L, S)`` logits from any score function.
        value: ``(..., S, Ev)``.
        attn_mask: boolean (True = may attend) or float, broadcastable to ``scores``.
        dropout_p: dropout on the weights.

    Returns:
        ``(output, weights)``: ``(..., L, Ev)`` and ``(..., L, S)``.

    Raises:
        ValueError: if ``value``'s length differs from ``scores``' last axis, or a bad mask.
    """
    if value.dim() < 2 or value.shape[-2] != scores.shape[-1]:
        raise ValueError(
            f"value must have shape (..., S={scores.shape[-1]}, features) to match scores "
            f"{tuple(scores.shape)}, got {tuple(value.shape)}"
        )
    check_attention_mask(attn_mask, tuple(scores.shape), "attn_mask")
    result = vote(SharedVotes(value), scores, normalize_over="senders", mask=attn_mask,
                  dropout_p=dropout_p, record=True)
    return result.outputs, result.weights[0]


def self_attention(
    inputs: Tensor, *, scale: float | None = None, need_weights: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Parameter-free self-attention ``softmax(X X^T / c) X``.

    Every token is query, key and value at once: no projections, nothing learned. The weights
    depend on the inputs alone (the starting point of the Q/K/V story in the reference articles).

    Args:
        inputs: ``(..., T, D)``.
        scale: ``1 / c``; default ``1 / sqrt(D)``.
        need_weights: also return the ``(..., T, T)`` weights.

    Returns:
        ``(output, weights)``: ``(..., T, D)`` and ``(..., T, T)`` or ``None``.
    """
    return scaled_dot_product_attention(inputs, inputs, inputs, scale=scale,
                                        need_weights=need_weights)
