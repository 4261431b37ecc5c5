"""Attention with learned score functions: Bahdanau (additive) and Luong (dot, general, concat).

The score function (:mod:`torchvote.functional.scores`) says how much each query (receiver ``i``)
agrees with each key (sender ``j``); :func:`torchvote.functional.attend` turns the scores into
weights, normalised over the senders, and sums the values with them: one pass of weighted voting.
These modules only own the score functions' parameters.

Index legend: ``b`` batch, ``i`` receivers (queries, length ``L``), ``j`` senders (keys, length
``S``), ``d`` features. Masks: True = may attend; ``key_mask`` True = real key, False = padding.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from torchvote.functional import additive_score, attend, concat_score, dot_score, general_score, merge_masks
from torchvote.validation import (
    check_choice,
    check_float_dtype,
    check_inputs_beside,
    check_positive_int,
    check_probability,
    first_parameter,
)

__all__ = ["AdditiveAttention", "LuongAttention", "ScoredAttention"]


def _check_attention_inputs(query: Tensor, key: Tensor, value: Tensor, query_dim: int, key_dim: int) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape (batch, length, features), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    if query.shape[-1] != query_dim:
        raise ValueError(f"query must have shape (batch, L, {query_dim}), got {tuple(query.shape)}")
    if key.shape[-1] != key_dim:
        raise ValueError(f"key must have shape (batch, S, {key_dim}), got {tuple(key.shape)}")
    if key.shape[0] != query.shape[0]:
        raise ValueError(
            f"key must share query's batch size {query.shape[0]}, got query {tuple(query.shape)}, "
            f"key {tuple(key.shape)}"
        )
    if value.shape[:2] != key.shape[:2]:
        raise ValueError(
            f"value must have shape (batch, S, features) = ({key.shape[0]}, {key.shape[1]}, ...) "
            f"as key {tuple(key.shape)}, got {tuple(value.shape)}"
        )


class ScoredAttention(nn.Module, abc.ABC):
    """Base of the attentions with a learned score: one pass of voting on ``score(query, key)``.

    Subclasses set their parameters and implement :meth:`score`; the checks, masks, dropout and
    the voting are written here once.

    Args:
        query_dim: query feature size ``Eq``.
        key_dim: key feature size ``Ek``.
        dropout: dropout on the attention weights, in training mode only.

    Raises:
        ValueError: a non-positive size or ``dropout`` outside ``[0, 1)``, naming it.
    """

    def __init__(self, query_dim: int, key_dim: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.query_dim = check_positive_int(query_dim, "query_dim")
        self.key_dim = check_positive_int(key_dim, "key_dim")
        self.dropout = check_probability(dropout, "dropout")

    @abc.abstractmethod
    def score(self, query: Tensor, key: Tensor) -> Tensor:
        """``(b, i, j)`` logits from ``query`` ``(b, L, Eq)`` and ``key`` ``(b, S, Ek)``."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor | None = None,
        *,
        key_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Attend from every query to the keys.

        Args:
            query: ``(b, L, Eq)``.
            key: ``(b, S, Ek)``.
            value: ``(b, S, Ev)``; default ``key``.
            key_mask: boolean ``(b, S)``, True for a real key.
            attn_mask: boolean (True = may attend) or float (added), broadcastable to
                ``(b, L, S)``.

        Returns:
            ``(context, weights)``: ``(b, L, Ev)`` and ``(b, L, S)``.

        Raises:
            ValueError, TypeError: bad shapes, masks or dtypes (inputs must be floating point, of
                the parameters' dtype outside ``torch.autocast``), naming the argument.
        """
        value = key if value is None else value
        _check_attention_inputs(query, key, value, self.query_dim, self.key_dim)
        # the dot score has no parameter: the queries' dtype and device rule
        parameter = first_parameter(self)
        reference, where = (query, "the queries") if parameter is None else (parameter, None)
        check_inputs_beside(
            reference,
            (("query", query), ("key", key), ("value", value)),
            masks=(("attn_mask", attn_mask), ("key_mask", key_mask)),
            where=where,
        )
        mask = merge_masks(attn_mask, key_mask, (query.shape[0], query.shape[1], key.shape[1]))
        scores = self.score(query, key)  # (b, i, j)
        return attend(scores, value, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0)


def _init_score_vector(vector: nn.Parameter) -> None:
    """``v_a`` of an additive or concat score, uniform in ``[-1/sqrt(H), 1/sqrt(H)]``: what an
    ``nn.Linear(H, 1)`` (the layer ``v_a^T`` is) would draw for its weight."""
    bound = 1.0 / vector.shape[0] ** 0.5
    nn.init.uniform_(vector, -bound, bound)


class AdditiveAttention(ScoredAttention):
    """Bahdanau attention: ``score(q, k) = v^T tanh(W_q q + W_k k)``.

    Bahdanau, Cho & Bengio 2015, "Neural Machine Translation by Jointly Learning to Align and
    Translate", appendix A.1.2 (``e_ij = v_a^T tanh(W_a s_{i-1} + U_a h_j)``). The tanh does not
    factor, so the scores cost ``(b, L, S, hidden_dim)`` memory.

    ``W_a`` and ``U_a`` are initialised as ``nn.Linear`` does, ``v_a`` as an ``nn.Linear(H, 1)``
    would be; :meth:`reset_parameters` draws them again.

    Args:
        query_dim: query feature size ``Eq``.
        key_dim: key feature size ``Ek``.
        hidden_dim: size ``H`` of the hidden layer of the score.
        dropout: dropout on the attention weights, in training mode only.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: a non-positive size or ``dropout`` outside ``[0, 1)``.

    Examples:
        >>> import torch
        >>> from torchvote.nn import AdditiveAttention
        >>> _ = torch.manual_seed(0)
        >>> attention = AdditiveAttention(query_dim=8, key_dim=6, hidden_dim=10)
        >>> query, key = torch.randn(2, 3, 8), torch.randn(2, 5, 6)  # (b, L, Eq), (b, S, Ek)
        >>> context, weights = attention(query, key)  # the keys are the values
        >>> context.shape, weights.shape
        (torch.Size([2, 3, 6]), torch.Size([2, 3, 5]))
        >>> torch.allclose(weights.sum(dim=-1), torch.ones(2, 3))
        True
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        hidden_dim: int,
        *,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(query_dim, key_dim, dropout=dropout)
        self.hidden_dim = check_positive_int(hidden_dim, "hidden_dim")
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.query_proj = nn.Linear(query_dim, hidden_dim, bias=False, **factory)  # W_a
        self.key_proj = nn.Linear(key_dim, hidden_dim, bias=False, **factory)  # U_a
        self.vector = nn.Parameter(torch.empty(hidden_dim, **factory))  # v_a
        _init_score_vector(self.vector)  # the projections initialised themselves

    def reset_parameters(self) -> None:
        """Draw every parameter again as the constructor did, in its order (under one seed, the
        same numbers): ``W_a`` and ``U_a`` as ``nn.Linear`` does, then ``v_a``. A module built on
        ``"meta"`` works after ``to_empty(device=...)`` and this."""
        self.query_proj.reset_parameters()
        self.key_proj.reset_parameters()
        _init_score_vector(self.vector)

    def score(self, query: Tensor, key: Tensor) -> Tensor:
        """``v_a^T tanh(W_a q_i + U_a k_j)``: ``(b, i, j)`` from ``(b, L, Eq)`` and ``(b, S, Ek)``."""
        return additive_score(query, key, self.query_proj.weight, self.key_proj.weight, self.vector)


LuongScore = Literal["dot", "general", "concat"]


class LuongAttention(ScoredAttention):
    """Luong attention with the ``dot``, ``general`` or ``concat`` score.

    Luong, Pham & Manning 2015, "Effective Approaches to Attention-based Neural Machine
    Translation", eq. 8::

        dot:      score(q, k) = q^T k                     (needs query_dim == key_dim)
        general:  score(q, k) = q^T W_a k                 W_a: (query_dim, key_dim)
        concat:   score(q, k) = v_a^T tanh(W_a [q; k])    W_a: (hidden_dim, query_dim + key_dim)

    None is scaled by ``1 / sqrt(d)`` (that is Vaswani's change). The score function is chosen
    once, here. ``W_a`` of ``general`` is Glorot-uniform; ``W_a`` of ``concat`` is initialised as
    ``nn.Linear`` does and its ``v_a`` as an ``nn.Linear(hidden_dim, 1)`` would be;
    :meth:`reset_parameters` draws them again.

    Args:
        query_dim: query feature size ``Eq``.
        key_dim: key feature size ``Ek``.
        score: ``"dot"``, ``"general"`` or ``"concat"``.
        hidden_dim: hidden size of the ``concat`` score; default ``query_dim``. Only for concat.
        dropout: dropout on the attention weights, in training mode only.
        device: where to create the parameters (the ``dot`` score has none).
        dtype: the parameters' dtype.

    Raises:
        ValueError: an unknown ``score``, ``dot`` with ``query_dim != key_dim``, ``hidden_dim``
            given for a score other than concat, or a non-positive size.

    Examples:
        >>> import torch
        >>> from torchvote.nn import LuongAttention
        >>> _ = torch.manual_seed(0)
        >>> attention = LuongAttention(query_dim=8, key_dim=6, score="general")
        >>> query, key, value = torch.randn(2, 3, 8), torch.randn(2, 5, 6), torch.randn(2, 5, 4)
        >>> key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])  # padding: False
        >>> context, weights = attention(query, key, value, key_mask=key_mask)
        >>> context.shape, weights.shape
        (torch.Size([2, 3, 4]), torch.Size([2, 3, 5]))
        >>> bool((weights[1, :, 3:] == 0).all())  # the padded keys take no weight
        True
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        *,
        score: LuongScore = "dot",
        hidden_dim: int | None = None,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(query_dim, key_dim, dropout=dropout)
        check_choice(score, ("dot", "general", "concat"), "score")
        if score == "dot" and query_dim != key_dim:
            raise ValueError(
                f"score='dot' needs query_dim == key_dim, got {query_dim} and {key_dim}; "
                f"use score='general' to relate different sizes"
            )
        if hidden_dim is not None and score != "concat":
            raise ValueError(f"hidden_dim only applies to score='concat', got score={score!r}")
        if hidden_dim is not None:
            check_positive_int(hidden_dim, "hidden_dim")
        self.score_name = score
        self.score_fn: Callable[[Tensor, Tensor], Tensor]
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        if score == "dot":
            self.score_fn = dot_score
        elif score == "general":
            self.weight = nn.Parameter(torch.empty(query_dim, key_dim, **factory))  # W_a
            self.score_fn = self._general
        else:
            self.hidden_dim = query_dim if hidden_dim is None else hidden_dim
            self.concat_proj = nn.Linear(query_dim + key_dim, self.hidden_dim, bias=False, **factory)  # W_a
            self.vector = nn.Parameter(torch.empty(self.hidden_dim, **factory))  # v_a
            self.score_fn = self._concat
        self._init_own_parameters()  # concat_proj initialised itself

    def _init_own_parameters(self) -> None:
        """Draw the parameters this module holds itself (not those of its ``nn.Linear``)."""
        if self.score_name == "general":
            nn.init.xavier_uniform_(self.weight)
        elif self.score_name == "concat":
            _init_score_vector(self.vector)

    def reset_parameters(self) -> None:
        """Draw every parameter again as the constructor did, in its order (under one seed, the
        same numbers); the ``dot`` score has none. A module built on ``"meta"`` works after
        ``to_empty(device=...)`` and this."""
        if self.score_name == "concat":
            self.concat_proj.reset_parameters()
        self._init_own_parameters()

    def _general(self, query: Tensor, key: Tensor) -> Tensor:
        return general_score(query, key, self.weight)

    def _concat(self, query: Tensor, key: Tensor) -> Tensor:
        return concat_score(query, key, self.concat_proj.weight, self.vector)

    def extra_repr(self) -> str:
        return f"query_dim={self.query_dim}, key_dim={self.key_dim}, score={self.score_name!r}"

    def score(self, query: Tensor, key: Tensor) -> Tensor:
        """The chosen Luong score: ``(b, i, j)`` from ``(b, L, Eq)`` and ``(b, S, Ek)``."""
        return self.score_fn(query, key)
