"""Attention as one pass of the voting operator, normalised over the senders.

Without weights, the dot-product forms end in :func:`torchvote.functional.vote`, handing their
scores over unexpanded (:class:`DotProductScores`) so that the work runs on
``F.scaled_dot_product_attention`` and no ``(L, S)`` matrix is formed. With weights they run on
:func:`softmax_attention`, the same one pass written for its cost: the ``(L, S)`` logits are
formed once in the compute dtype and softmaxed in place where autograd allows (the general voting
loop, which iterative routing needs, upcasts to float32 and keeps several temporaries). Masks are
prepared by :mod:`torchvote.functional.masks` (``check_attention_mask`` and ``is_causal_mask``
live there and are re-exported here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from torchvote.functional.masks import (
    causal_mask,
    check_attention_mask,
    check_mask_dtype,
    fit_mask_to_dtype,
    is_causal_mask,
    prepare_attention_mask,
)
from torchvote.functional.scores import default_scale
from torchvote.functional.voting import DotProductScores, SharedVotes, vote
from torchvote.tracing import plain_ops_required
from torchvote.validation import (
    broadcast_shape,
    check_flag,
    check_inputs_beside,
    check_probability,
    check_scale,
)

__all__ = [
    "scaled_dot_product_attention",
    "softmax_attention",
    "attend",
    "self_attention",
    "check_attention_mask",
    "is_causal_mask",
]


def _check_qkv(
    query: Tensor, key: Tensor, value: Tensor, mask: tuple[str, Tensor | None] = ("mask", None)
) -> None:
    """Queries ``(..., L, E)``, keys ``(..., S, E)`` and values ``(..., S, Ev)``: floating-point
    tensors of one dtype, on one device with the ``(name, mask)`` given, whose shapes fit (shapes,
    dtypes and devices only).

    Raises:
        TypeError: naming the input that is not a floating-point tensor, or the three dtypes.
        ValueError: naming the input of too few axes, on another device than the queries, or the
            shapes that do not fit.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., length, features), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(
            f"query, key and value must have one dtype, got {query.dtype}, {key.dtype} and "
            f"{value.dtype}"
        )
    # a CPU tensor beside "meta" ones computed on uninitialised memory; other pairs failed in torch
    check_inputs_beside(query, (("key", key), ("value", value)), masks=(mask,), where="the queries")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must share their feature size, got {query.shape[-1]} and "
            f"{key.shape[-1]}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length, got {key.shape[-2]} and {value.shape[-2]}"
        )
    if broadcast_shape(query.shape[:-2], key.shape[:-2], value.shape[:-2]) is None:
        raise ValueError(
            f"query, key and value must have batch axes that broadcast, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
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
    same); with it, on :func:`softmax_attention`, which also returns the weights. A causal 2-D mask is
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
        ValueError: mismatched shapes, a mask that does not broadcast or holds NaN or +inf, a
            ``scale`` that is not finite, ``dropout_p`` outside ``[0, 1)``; a key, value or mask
            on another device than the query.
        TypeError: a mask that is neither boolean nor floating point, non-float inputs or
            inputs of different dtypes, a ``scale`` that is not a real number, ``is_causal`` or
            ``need_weights`` that is not a bool.

    Examples:
        >>> import torch
        >>> from torchvote.functional import scaled_dot_product_attention
        >>> _ = torch.manual_seed(0)
        >>> q, k, v = torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 4)
        >>> out, weights = scaled_dot_product_attention(q, k, v, need_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 5, 4]), torch.Size([2, 5, 7]))
        >>> torch.allclose(weights.sum(dim=-1), torch.ones(2, 5))
        True
        >>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=1e-6)
        True
    """
    _check_qkv(query, key, value, ("attn_mask", attn_mask))
    check_flag(is_causal, "is_causal")
    check_flag(need_weights, "need_weights")
    scale = check_scale(scale)
    check_probability(dropout_p, "dropout_p")
    target = (*broadcast_shape(query.shape[:-2], key.shape[:-2]),  # checked by _check_qkv
              query.shape[-2], key.shape[-2])
    attn_mask, is_causal = prepare_attention_mask(attn_mask, None, target, is_causal=is_causal)
    if need_weights:
        return _softmax_attention(query, key, value, mask=attn_mask, is_causal=is_causal,
                                  dropout_p=dropout_p, scale=scale)
    result = vote(
        SharedVotes(value),
        DotProductScores(query, key, scale),
        normalize_over="senders",
        mask=attn_mask,
        is_causal=is_causal,
        dropout_p=dropout_p,
    )
    return result.outputs, None


def softmax_attention(
    query: Tensor, key: Tensor, value: Tensor, *, mask: Tensor | None = None,
    is_causal: bool = False, dropout_p: float = 0.0, scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """One pass of softmax attention that returns its weights, paying only for the weights.

    The ``(..., L, S)`` logits are formed once, in the inputs' dtype, as ``(q * scale) k^T`` (the
    scale folded into the smaller factor, as ``torch.nn.MultiheadAttention`` does); a float mask
    is added and the forbidden entries set to ``-inf`` in place. The softmax runs in place when
    autograd does not track the logits (inference, ``no_grad``, ``q`` and ``k`` without
    gradient); otherwise the logits are freed once it has run, so one ``(..., L, S)`` tensor is
    kept for backward, as in torch (two with dropout: the weights and the dropped weights).

    The logits are those of ``torch.nn.MultiheadAttention``: in the compute dtype, so in a half
    dtype they carry its rounding (the scaled queries and the product are each rounded once: a
    logit is off by up to ``eps |q| |k| scale``, tested against float64); the voting
    loop (:func:`~torchvote.functional.vote`) forms the same weights in float32, and is the path
    for several passes. float16 ends at 65504: float16 logits (float16 inputs, or any under
    float16 autocast) are clamped to ``[-65504, 65504]`` once a float mask is added, where
    torch's would be ``inf`` and their weights NaN; a row whose largest logits pass 65504 shares
    its weight among them. A query with nothing to attend to gets zero weights and a zero output
    with finite gradients: its logits are made uniform before the softmax and its weights and
    output zeroed after (under autograd the returned weights are then a masked copy, not the
    tensor kept for backward).

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.
        value: ``(..., S, Ev)``.
        mask: boolean (True = may attend) or float (added to the logits, ``-inf`` forbids),
            broadcastable to ``(..., L, S)``; as :func:`prepare_attention_mask` returns it.
        is_causal: query ``l`` attends to keys ``s <= l`` (top-left aligned).
        dropout_p: dropout on the weights (the returned weights are those before dropout).
        scale: multiplies ``q k^T``; default ``1 / sqrt(E)``.

    Returns:
        ``(output, weights)``: ``(..., L, Ev)`` and ``(..., L, S)``, both in the inputs' dtype.

    Raises:
        ValueError: mismatched shapes, a mask that does not broadcast to ``(..., L, S)`` or holds
            NaN or ``+inf``, ``dropout_p`` outside ``[0, 1)``, a ``scale`` that is not finite; a
            key, value or mask on another device than the query.
        TypeError: non-float inputs or inputs of different dtypes, a mask that is neither boolean
            nor floating point, a ``scale`` that is not a real number, an ``is_causal`` that is
            not a bool.
    """
    _check_qkv(query, key, value, ("mask", mask))
    check_flag(is_causal, "is_causal")
    scale = check_scale(scale)
    check_probability(dropout_p, "dropout_p")
    target = (*broadcast_shape(query.shape[:-2], key.shape[:-2]), query.shape[-2], key.shape[-2])
    check_attention_mask(mask, target, "mask")
    return _softmax_attention(query, key, value, mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                              scale=scale)


def _softmax_attention(
    query: Tensor, key: Tensor, value: Tensor, *, mask: Tensor | None, is_causal: bool,
    dropout_p: float, scale: float | None,
) -> tuple[Tensor, Tensor]:
    """:func:`softmax_attention` on arguments checked by the caller (the attention modules and
    :func:`scaled_dot_product_attention`, which check theirs where they enter)."""
    scale = default_scale(query.shape[-1]) if scale is None else scale
    receivers, senders = query.shape[-2], key.shape[-2]
    additive, allowed = None, None  # float mask; boolean, True = may attend
    if mask is not None:
        check_mask_dtype(mask)
        if mask.dtype == torch.bool:
            allowed = mask
        else:
            additive, allowed = mask, ~mask.isneginf()
    if is_causal:
        causal = causal_mask(receivers, senders, query.device)  # (i, j)
        allowed = causal if allowed is None else allowed & causal
    # (..., i | 1, 1) (1 for a key-padding mask), True for a query with nothing to attend to;
    # causality alone leaves every query its first key.
    dead = ~allowed.any(dim=-1, keepdim=True) if mask is not None else None
    logits = torch.matmul(query * scale, key.transpose(-2, -1))  # (..., i, j)
    weights, grad = _softmax_(logits, additive, allowed, dead)  # (..., i, j)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0.0 else weights
    output = torch.matmul(dropped, value)  # (..., i, Ev)
    if grad and dead is not None:
        output = output.masked_fill(dead, 0.0)
        weights = weights.masked_fill(dead, 0.0)
    return output, weights


_FLOAT16_MAX = torch.finfo(torch.float16).max  # 65504


def _clamp_to_float16_(logits: Tensor) -> Tensor:
    """float16 ``logits`` clamped to float16's finite range, in place: an overflowed logit is
    ``inf`` (finite float16 lies within +-65504), so ``inf`` becomes 65504; NaN stays NaN.

    Autograd does not record it (as :func:`_masked_fill_`): a clamped logit's gradient is the one
    it would have at the bound, finite, and recording would keep a copy of the logits for backward.
    """
    with torch.no_grad():
        return logits.nan_to_num_(nan=math.nan, posinf=_FLOAT16_MAX, neginf=-_FLOAT16_MAX)


def _softmax_(
    logits: Tensor, additive: Tensor | None, allowed: Tensor | None, dead: Tensor | None
) -> tuple[Tensor, bool]:
    """Masked softmax over the last axis, in place where autograd allows.

    Returns:
        ``(weights, grad)``: with ``grad`` (the logits need a gradient) the rows in ``dead`` are
        uniform and the caller zeroes what it returns; without, they are zero already.
    """
    if additive is not None:  # half logits: no -inf from -7e4 (float16), no rounded weights (bfloat16)
        logits = _add_(logits, fit_mask_to_dtype(additive, logits.dtype))
    if logits.dtype == torch.float16:  # past 65504 a logit is inf, and its row's weights NaN
        logits = _clamp_to_float16_(logits)  # forbidden entries (inf - inf too) are refilled below
    if allowed is not None:
        logits = _masked_fill_(logits, ~allowed, float("-inf"))
    if dead is not None:
        logits = _masked_fill_(logits, dead, 0.0)  # uniform and finite: no NaN, even in backward
    # requires_grad is False under no_grad / inference_mode; torch.func transforms and
    # forward-mode AD cannot follow the out= softmax
    if logits.requires_grad or plain_ops_required(logits):
        return torch.softmax(logits, dim=-1), True  # the logits are freed once it has run
    weights = torch.softmax(logits, dim=-1, out=logits)
    if dead is not None:
        weights.masked_fill_(dead, 0.0)
    return weights, False


def _add_(logits: Tensor, mask: Tensor) -> Tensor:
    """``logits + mask``, in place when the mask broadcasts to the logits' shape."""
    if broadcast_shape(logits.shape, mask.shape) == tuple(logits.shape):
        return logits.add_(mask)
    return logits + mask


def _masked_fill_(logits: Tensor, where: Tensor, value: float) -> Tensor:
    """``logits`` with ``value`` where ``where`` holds, in place when shapes allow.

    In place, autograd does not record it: the entries filled take zero weight (``-inf``) or
    belong to rows whose weights and outputs are zeroed afterwards, so the softmax's backward
    gives them zero gradient anyway, and recording would cost one more pass over the logits.
    """
    if broadcast_shape(logits.shape, where.shape) == tuple(logits.shape):
        with torch.no_grad():
            return logits.masked_fill_(where, value)
    return logits.masked_fill(where, value)


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
        TypeError: ``scores`` or ``value`` not a floating-point tensor, or not of one dtype
            (outside ``torch.autocast``).
        ValueError: ``scores`` of fewer than 2 axes, ``value``'s length not ``scores``' last
            axis, batch axes that do not broadcast, a bad mask, or a ``value`` or mask on another
            device than ``scores``.
    """
    for name, tensor in (("scores", scores), ("value", value)):
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise TypeError(
                f"{name} must be a floating-point tensor, got "
                f"{tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__}"
            )
    check_inputs_beside(scores, (("value", value),), masks=(("attn_mask", attn_mask),), where="the scores")
    if scores.dim() < 2:
        raise ValueError(f"scores must have shape (..., L, S), got {tuple(scores.shape)}")
    if value.dim() < 2 or value.shape[-2] != scores.shape[-1]:
        raise ValueError(
            f"value must have shape (..., S={scores.shape[-1]}, features) to match scores "
            f"{tuple(scores.shape)}, got {tuple(value.shape)}"
        )
    if broadcast_shape(scores.shape[:-2], value.shape[:-2]) is None:  # vote's error named its own terms
        raise ValueError(
            f"scores {tuple(scores.shape)} and value {tuple(value.shape)} must have batch axes (all "
            "but the last two) that broadcast"
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

    Raises:
        TypeError, ValueError: ``inputs`` not a floating-point ``(..., T, D)`` tensor, a bad
            ``scale`` or ``need_weights`` (as :func:`scaled_dot_product_attention`).

    Examples:
        >>> import torch
        >>> from torchvote.functional import self_attention
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(2, 5, 8)  # (batch, T, D): every token is query, key and value
        >>> out, weights = self_attention(x, need_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 5, 8]), torch.Size([2, 5, 5]))
        >>> torch.allclose(out, weights @ x, atol=1e-6)
        True
    """
    if not isinstance(inputs, Tensor):  # a TypeError, as scaled_dot_product_attention's
        raise TypeError(f"inputs must be a tensor of shape (..., T, D), got {type(inputs).__name__}")
    if inputs.dim() < 2:
        raise ValueError(f"inputs must be a tensor of shape (..., T, D), got {tuple(inputs.shape)}")
    if not inputs.is_floating_point():
        raise TypeError(f"inputs must be floating point, got dtype {inputs.dtype}")
    return scaled_dot_product_attention(inputs, inputs, inputs, scale=scale,
                                        need_weights=need_weights)
