"""Iterative routing-style attention: multi-head attention that votes for ``iterations`` passes.

Attention is one pass of weighted voting; dynamic routing is the same vote repeated, each pass
raising the logit of every vote that agrees with the consensus it helped form ("Self-Attention is
fundamentally a Weighted Voting", Mr. For Example, 2023; Sabour, Frosst & Hinton 2017, "Dynamic
Routing Between Capsules", Procedure 1, line 7, ``b_ij <- b_ij + u_hat_j|i . v_j`` in the paper's
letters; in this module's legend, below, ``b_ij <- b_ij + u_ij . out_i`` for output ``i`` and the
vote ``u_ij`` of input ``j``).
:class:`RoutingAttention` makes that claim testable inside a Transformer: it has exactly the
projections and the ``forward`` of :class:`~torchvote.nn.MultiHeadAttention` (it inherits them and
overrides only the voting step ``_attend``, so one can replace the other through the transformer
layers' ``attention=`` hook, and their state dicts are interchangeable), and with
``iterations=1`` it *is* multi-head attention.

Per head, with ``q = x W_Q``, ``k = x W_K``, ``v = x W_V`` and ``d`` the head size::

    logits_ij = q_i . k_j / sqrt(d)                        (Vaswani et al. 2017, eq. 1)
    repeat iterations times:
        w_ij  = softmax over j (normalize_over="senders": attention)
                 or over i     (normalize_over="receivers": routing)          (masked)
        out_i = sum_j w_ij v_j
        logits_ij += v_j . out_i / sqrt(d)                 (agreement; not after the last pass)

Index legend: ``b`` batch, ``h`` heads, ``i`` receivers (queries, length ``L``), ``j`` senders
(keys, length ``S``), ``d`` features per head. Masks: True = may attend; ``key_mask`` True = real
key, False = padding. Masks hold in every pass.

This module also provides :func:`attention_factory`, the ``attention=`` hook of the transformer
layers that picks softmax or routing attention by name. The weights of every attention of a
model come back as a returned record (``return_intermediates=True`` on the transformer layers and
stacks, :class:`~torchvote.nn.AttentionIntermediates`), not through hooks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from torchvote.functional import VotingState
from torchvote.functional.masks import _orders_receivers, _read_mask_once
from torchvote.functional.voting import NormalizeOver
from torchvote.nn.attention import MultiHeadAttention
from torchvote.nn.transformer import AttentionFactory
from torchvote.validation import check_choice, check_keyword_options, check_positive_int, check_scale

__all__ = [
    "ATTENTION_KINDS",
    "AttentionKind",
    "RoutingAttention",
    "ScaledDotAgreement",
    "attention_factory",
]

AttentionKind = Literal["softmax", "routing"]
ATTENTION_KINDS: tuple[str, ...] = ("softmax", "routing")


@dataclass(frozen=True)
class ScaledDotAgreement:
    """Agreement of every value with its receiver's current output: ``scale * v_j . out_i``.

    The dynamic-routing update (Sabour et al. 2017, Procedure 1, line 7) with the ``1 / sqrt(d)``
    of scaled dot-product attention, so that the update lives on the scale of the initial logits
    ``q . k / sqrt(d)``.

    Args:
        scale: multiplies the dot products; a finite real number.

    Raises:
        TypeError: ``scale`` not a real number.
        ValueError: ``scale`` not finite.
    """

    scale: float

    def __post_init__(self) -> None:
        if self.scale is None:
            raise TypeError("scale must be a real number, got None")
        object.__setattr__(self, "scale", check_scale(self.scale))  # a float (frozen dataclass)

    def __call__(self, state: VotingState) -> Tensor:
        """``(b, h, i, j)`` agreement from ``state.votes`` ``(b, h, j, d)`` and ``state.outputs``
        ``(b, h, i, d)``."""
        return state.votes.dot(state.outputs) * self.scale


class RoutingAttention(MultiHeadAttention):
    """Multi-head attention run as ``iterations`` passes of weighted voting with agreement updates.

    The first pass is scaled dot-product attention (Vaswani et al. 2017, sec. 3.2); every later
    pass adds to the logits the scaled agreement of each value with the receiver's current output
    (the dynamic-routing update of Sabour et al. 2017, Procedure 1, ``update="accumulate"``), so the
    receivers listen more to the senders that agree with what they heard. This is the
    "multi-head attention written as dynamic routing" of the weighted-voting article (Mr. For
    Example, 2023), made iterative. With ``iterations=1`` and ``normalize_over="senders"`` it is
    exactly :class:`~torchvote.nn.MultiHeadAttention` (same parameters, same numbers, the same
    fused kernel); its ``state_dict`` loads into a :class:`~torchvote.nn.MultiHeadAttention` and
    back.

    ``normalize_over="receivers"`` normalises every pass over the queries instead (each key spends
    one unit of vote over the queries: capsule routing, bottom-up, as in slot attention). The
    softmax then sums over all queries, so it cannot be causal (a later query would change an
    earlier output): ``is_causal=True`` and an ``attn_mask`` that orders the positions (one that
    blocks every later key: causal, also merged with padding, per example or as a sliding window;
    a float mask blocks with ``-inf`` or any value at or below ``-1000``, learned bias added or not)
    are refused (any other mask limits which pairs vote but cannot make the outputs causal). Under
    ``torch.compile`` and ``torch.export`` the mask's values are not read (a read would break the
    graph): there only ``is_causal=True`` is refused, and a causal mask is the caller's to avoid.
    In self-attention
    (``key is query``) the ``key_mask`` also removes padded queries from the competition for the
    votes, so padding cannot change the real positions' outputs; for cross-attention with padded
    queries give the query padding in ``attn_mask``. ``aggregation="mean"`` renormalises the weights over the
    senders after the softmax over the receivers (a weighted mean, as in slot attention).

    Unlike the one-pass module it never uses the fused kernel for ``iterations > 1``: every pass
    forms the ``(b, h, L, S)`` weights.

    Key/value cache (``forward(..., cache=...)``, incremental decoding): with
    ``normalize_over="senders"`` every pass of a query reads only that query's logits over the
    keys it may hear and the values, so a new query needs the past keys and values and nothing
    else: the cache works and gives the uncached numbers. With ``"receivers"`` each pass's
    softmax runs over all the queries, so a new query would change the weights (and outputs) of
    the earlier ones: there is nothing to cache, and a ``cache`` is refused with a ValueError.

    Args:
        embed_dim: ``E``, the model (and query) feature size.
        num_heads: heads ``h``; must divide ``embed_dim``.
        iterations: passes of voting, at least 1 (1 = softmax attention).
        normalize_over: ``"senders"`` (softmax over the keys, every pass) or ``"receivers"``
            (over the queries).
        aggregation: ``"sum"`` (weighted sum) or ``"mean"`` (weights renormalised over the senders).
        device: where to create the parameters.
        dtype: the parameters' dtype.
        **attention_options: ``kdim``, ``vdim``, ``bias``, ``dropout``, ``batch_first``,
            ``shared_qkv``, keyword-only, as :class:`~torchvote.nn.MultiHeadAttention`.
            ``dropout`` applies to the weights of every pass.

    Raises:
        ValueError: an ``iterations``, ``normalize_over`` or ``aggregation`` that is not allowed,
            or any error of :class:`~torchvote.nn.MultiHeadAttention`.

    Examples:
        >>> import torch
        >>> from torchvote.nn import MultiHeadAttention, RoutingAttention
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(2, 5, 16)  # (batch, length, embed_dim)
        >>> routing = RoutingAttention(16, 4, iterations=3)
        >>> routing(x)[0].shape
        torch.Size([2, 5, 16])
        >>> one_pass = RoutingAttention(16, 4, iterations=1)  # exactly multi-head attention
        >>> attention = MultiHeadAttention(16, 4)
        >>> _ = attention.load_state_dict(one_pass.state_dict())
        >>> torch.allclose(one_pass(x)[0], attention(x)[0], atol=1e-6)
        True
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        iterations: int = 3,
        normalize_over: Literal["senders", "receivers"] = "senders",
        aggregation: Literal["sum", "mean"] = "sum",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **attention_options: Any,
    ) -> None:
        check_positive_int(iterations, "iterations")
        check_choice(normalize_over, ("senders", "receivers"), "normalize_over")
        check_choice(aggregation, ("sum", "mean"), "aggregation")
        check_keyword_options(attention_options, MultiHeadAttention.__init__, type(self).__name__)
        super().__init__(embed_dim, num_heads, device=device, dtype=dtype, **attention_options)
        self.iterations = iterations
        self.normalize_over = normalize_over
        self.aggregation = aggregation
        self.agreement = ScaledDotAgreement(self.scale)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, iterations={self.iterations}, "
            f"normalize_over={self.normalize_over!r}, aggregation={self.aggregation!r}"
        )

    def _receiver_mask(
        self,
        key_mask: Tensor | None,
        *,
        is_causal: bool,
        self_attention: bool,
        attn_mask: Tensor | None = None,
        lengths: tuple[int, int] | None = None,
    ) -> Tensor | None:
        """Refuse causality over the receivers; in self-attention, padded queries take no votes.

        An ``attn_mask`` of the full ``(L, S)`` size (any leading axes) that orders the positions
        is causality too: one that blocks every later key, differs between queries and lets a key
        reach two queries (a causal mask, also merged with padding, per example or as a sliding
        window; :func:`~torchvote.functional.masks._orders_receivers`). A smaller mask that
        broadcasts (``(1, 1)``, ``(1, S)``) orders nothing.

        Raises:
            ValueError: ``is_causal`` (given, or a causal ``attn_mask``) with
                ``normalize_over="receivers"``.
        """
        if self.normalize_over != "receivers":
            return None
        if (
            not is_causal
            and isinstance(attn_mask, Tensor)
            and attn_mask.dim() >= 2
            and tuple(attn_mask.shape[-2:]) == lengths
            and not torch.compiler.is_compiling()  # a read of the values: a graph break
        ):  # read once for a mask every layer of a stack is given (a sync on a GPU)
            is_causal = _read_mask_once(attn_mask, _orders_receivers)
        if is_causal:
            raise ValueError(
                "causality (is_causal=True, or an attn_mask that blocks every later key) needs "
                "normalize_over='senders': a softmax over the receivers sums over later queries, "
                "so later tokens would change earlier outputs"
            )
        return key_mask if self_attention else None  # (b, L) | None

    def _check_cache(self) -> None:
        """Refuse a key/value cache when the softmax runs over the receivers.

        Raises:
            ValueError: ``normalize_over="receivers"``.
        """
        if self.normalize_over == "receivers":
            raise ValueError(
                "cache needs normalize_over='senders': with 'receivers' every pass normalises over "
                "all the queries, so a new query changes the earlier ones' outputs; decode without "
                "a cache (use_cache=False)"
            )

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``iterations`` passes of voting with the scaled agreement update.

        Arguments and shapes as :meth:`MultiHeadAttention._attend`; the mask and the causality
        hold in every pass, and the weights returned are the last pass's softmax (before the
        renormalisation of ``aggregation="mean"``).
        """
        if self.iterations == 1 and self.normalize_over == "senders" and self.aggregation == "sum":
            return super()._attend(q, k, v, mask, is_causal, need_weights)  # softmax attention
        return self._vote(
            q, k, v, mask, is_causal, need_weights,
            normalize_over=self.normalize_over,
            iterations=self.iterations,
            agreement=self.agreement,
            update="accumulate",
            aggregation=self.aggregation,
        )  # (b, h, i, d), (b, h, i, j) | None; one pass without weights runs on the fused kernel


def attention_factory(
    kind: AttentionKind = "softmax",
    *,
    iterations: int | None = None,
    normalize_over: NormalizeOver = "senders",
) -> AttentionFactory:
    """The ``attention=`` hook of the transformer layers for softmax or routing attention.

    Args:
        kind: ``"softmax"`` (:class:`~torchvote.nn.MultiHeadAttention`, one pass) or
            ``"routing"`` (:class:`RoutingAttention` with ``iterations`` passes).
        iterations: passes of the routing attention (``None``: 3); softmax attention makes one
            and refuses the argument.
        normalize_over: the routing attention's softmax axis, ``"senders"`` (every query's
            weights sum to one) or ``"receivers"`` (every key's weights sum to one; refuses
            causal attention and a cache, see :class:`RoutingAttention`). Softmax attention
            normalises over the senders only.

    Returns:
        ``factory(embed_dim, num_heads, *, dropout, device=None, dtype=None) -> nn.Module``,
        batch first.

    Raises:
        ValueError: an unknown ``kind`` or ``normalize_over``, ``iterations < 1``, or
            ``iterations`` or ``normalize_over="receivers"`` with ``kind="softmax"``.
    """
    check_choice(kind, ATTENTION_KINDS, "kind")
    if iterations is not None:
        check_positive_int(iterations, "iterations")
    check_choice(normalize_over, get_args(NormalizeOver), "normalize_over")
    if kind == "softmax":
        if iterations is not None:
            raise ValueError(
                f"iterations={iterations!r} needs kind='routing': softmax attention makes one pass"
            )
        if normalize_over != "senders":
            raise ValueError(
                f"normalize_over={normalize_over!r} needs kind='routing': softmax attention "
                "normalises over the senders"
            )
        return functools.partial(MultiHeadAttention, batch_first=True)
    passes = {} if iterations is None else {"iterations": iterations}  # None: RoutingAttention's own
    return functools.partial(RoutingAttention, normalize_over=normalize_over, batch_first=True, **passes)
