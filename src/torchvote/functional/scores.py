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
from collections.abc import Callable

import torch
from torch import Tensor

from torchvote.validation import broadcast_shape, check_input_dtype, check_scale, computes_in_float16

__all__ = ["dot_score", "general_score", "scaled_dot_score", "additive_score", "concat_score"]


def default_scale(features: int) -> float:
    """``1 / sqrt(E)`` for ``E`` query features, the scaled dot product's default (Vaswani et al.
    2017, eq. 1). ``E = 0`` gives 1: dot products over no features are all zero whatever the
    scale, and the weights uniform (as ``F.scaled_dot_product_attention`` gives them)."""
    return 1.0 / math.sqrt(features) if features > 0 else 1.0


def _check_pair(query: Tensor, key: Tensor) -> None:
    """Queries ``(..., L, Eq)`` and keys ``(..., S, Ek)``: floating-point tensors of one dtype
    (outside ``torch.autocast``) whose batch axes broadcast (shapes and dtypes only).

    Raises:
        TypeError: naming ``query`` or ``key``.
        ValueError: fewer than 2 axes, batch axes that do not broadcast.
    """
    for name, t in (("query", query), ("key", key)):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            described = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a floating-point tensor, got {described}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., length, features), got {tuple(t.shape)}")
    check_input_dtype(key, query.dtype, "key", "the queries")
    if broadcast_shape(query.shape[:-2], key.shape[:-2]) is None:
        raise ValueError(
            f"query and key must have batch axes that broadcast, got shapes {tuple(query.shape)} "
            f"and {tuple(key.shape)}"
        )


def _check_parameter(name: str, value: Tensor, query: Tensor, shape: tuple[int, ...]) -> None:
    """A score's parameter: a tensor of ``shape`` in the queries' dtype (outside autocast)."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(value.shape)}")
    check_input_dtype(value, query.dtype, name, "the queries")


def _check_features(name: str, t: Tensor, expected: int, what: str) -> None:
    if t.shape[-1] != expected:
        raise ValueError(
            f"{name} must have {expected} features to match {what}, got shape {tuple(t.shape)}"
        )


_FLOAT16_MAX = torch.finfo(torch.float16).max  # 65504


def _float16_safe_product(product: Callable[..., Tensor], *operands: Tensor, scale: float = 1.0) -> Tensor:
    """``scale * product(*operands)``, but in float16 (operands, or float16 autocast) formed in
    float32 with autocast off, scaled there and clamped to float16's range before the cast to
    float16: a product past 65504 was ``inf`` (and the softmax of its row NaN) where the scaled
    logit fits, or ties at 65504 where it does not (as attention's weights do). The result's dtype
    is what it was: the operands', or autocast's."""
    from torchvote.functional.voting import autocast_off  # voting imports this module

    if not computes_in_float16(*operands):
        logits = product(*operands)
        return logits * scale if scale != 1.0 else logits
    with autocast_off(operands[0].device.type):
        logits = product(*(x.float() for x in operands)) * scale
    return logits.clamp(-_FLOAT16_MAX, _FLOAT16_MAX).to(torch.float16)


def _dot(query: Tensor, key: Tensor) -> Tensor:
    return torch.einsum("...ie,...je->...ij", query, key)  # (..., i, j) = (..., L, S)


def _general(query: Tensor, weight: Tensor, key: Tensor) -> Tensor:
    # (q W) k^T as two products in a fixed order: a three-operand einsum lets opt_einsum, where
    # installed, choose the order and return the scores transposed in memory
    return (query @ weight) @ key.mT  # (..., L, Ek) @ (..., Ek, S)


def dot_score(query: Tensor, key: Tensor) -> Tensor:
    """Luong's dot score ``q . k``.

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.

    Returns:
        ``(..., L, S)`` logits in the inputs' dtype (or autocast's); float16 ones are formed in
        float32 and clamped to +-65504 (a larger score ties there).

    Raises:
        ValueError: if the feature sizes differ, or the batch axes do not broadcast.
        TypeError: ``query`` or ``key`` not floating-point tensors of one dtype.
    """
    _check_pair(query, key)
    _check_features("key", key, query.shape[-1], "query")
    return _float16_safe_product(_dot, query, key)


def scaled_dot_score(query: Tensor, key: Tensor, scale: float | None = None) -> Tensor:
    """Vaswani's scaled dot score ``q . k / sqrt(E)`` (or ``q . k * scale``).

    Args:
        query: ``(..., L, E)``.
        key: ``(..., S, E)``.
        scale: multiplier; default ``1 / sqrt(E)``.

    Returns:
        ``(..., L, S)`` logits in the inputs' dtype; float16 ones are scaled in float32 before
        the clamp of :func:`dot_score` (a product past 65504 may be a score that fits).

    Raises:
        ValueError, TypeError: as :func:`dot_score`; a ``scale`` that is not a finite real number.
    """
    scale = check_scale(scale)
    _check_pair(query, key)
    _check_features("key", key, query.shape[-1], "query")
    scale = default_scale(query.shape[-1]) if scale is None else scale
    return _float16_safe_product(_dot, query, key, scale=scale)


def general_score(query: Tensor, key: Tensor, weight: Tensor) -> Tensor:
    """Luong's general score ``q^T W k``.

    Args:
        query: ``(..., L, Eq)``.
        key: ``(..., S, Ek)``.
        weight: ``(Eq, Ek)``.

    Returns:
        ``(..., L, S)`` logits in the inputs' dtype (float16: as :func:`dot_score`, with ``q W``
        in float32 too).

    Raises:
        ValueError: if ``weight`` is not ``(Eq, Ek)``, or the batch axes do not broadcast.
        TypeError: inputs or ``weight`` not floating-point tensors of one dtype.
    """
    _check_pair(query, key)
    _check_parameter("weight", weight, query, (query.shape[-1], key.shape[-1]))  # (Eq, Ek)
    return _float16_safe_product(_general, query, weight, key)


def _hidden_size(weight: Tensor, name: str, query: Tensor, features: int) -> int:
    """``H`` of the additive and concat scores, read from their first matrix ``weight``
    ``(H, features)``, checked (shape, dtype): the other parameters are then checked against it,
    so a ``vector`` of another size is blamed on the vector, not on the matrix.

    Raises:
        ValueError: ``weight`` not ``(H, features)``.
        TypeError: as :func:`_check_parameter`.
    """
    if not isinstance(weight, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.shape[1] != features:
        raise ValueError(f"{name} must have shape (hidden, {features}), got {tuple(weight.shape)}")
    _check_parameter(name, weight, query, tuple(weight.shape))
    return weight.shape[0]


def _check_vector(vector: Tensor, query: Tensor, hidden: int, source: str) -> None:
    """The additive and concat scores' ``vector`` ``(H,)``, with ``H`` read from ``source``.

    Raises:
        ValueError: ``vector`` not ``(H,)``, naming the vector and where ``H`` came from.
        TypeError: as :func:`_check_parameter`.
    """
    if not isinstance(vector, Tensor):
        raise TypeError(f"vector must be a tensor, got {type(vector).__name__}")
    if vector.dim() != 1 or vector.shape[0] != hidden:
        raise ValueError(
            f"vector must have shape (hidden,) = ({hidden},), the hidden size of {source}, got "
            f"{tuple(vector.shape)}"
        )
    _check_parameter("vector", vector, query, (hidden,))


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
        ValueError: if the parameters' shapes do not fit the inputs or each other (``H`` is read
            from ``query_weight``: ``key_weight`` and ``vector`` are checked against it), or the
            batch axes do not broadcast.
        TypeError: inputs or parameters not floating-point tensors of one dtype.
    """
    _check_pair(query, key)
    hidden = _hidden_size(query_weight, "query_weight", query, query.shape[-1])  # (H, Eq)
    source = f"query_weight {tuple(query_weight.shape)}"
    if isinstance(key_weight, Tensor) and key_weight.dim() == 2 and key_weight.shape[0] != hidden:
        raise ValueError(
            f"key_weight must have shape (hidden, Ek) = {(hidden, key.shape[-1])}, the hidden size of "
            f"{source}, got {tuple(key_weight.shape)}"
        )
    _check_parameter("key_weight", key_weight, query, (hidden, key.shape[-1]))  # (H, Ek)
    _check_vector(vector, query, hidden, source)  # (H,)
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
        ValueError: if ``weight`` is not ``(H, Eq + Ek)`` or ``vector`` not ``(H,)`` (``H`` read
            from ``weight``), or the batch axes do not broadcast.
        TypeError: inputs or parameters not floating-point tensors of one dtype.
    """
    _check_pair(query, key)
    q_features = query.shape[-1]
    hidden = _hidden_size(weight, "weight", query, q_features + key.shape[-1])  # (H, Eq + Ek)
    _check_vector(vector, query, hidden, f"weight {tuple(weight.shape)}")  # (H,)
    return additive_score(query, key, weight[:, :q_features], weight[:, q_features:], vector)
