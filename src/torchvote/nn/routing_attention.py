"""Iterative routing-style attention: multi-head attention that votes for ``iterations`` passes.

Attention is one pass of weighted voting; dynamic routing is the same vote repeated, each pass
raising the logit of every vote that agrees with the consensus it helped form ("Self-Attention is
fundamentally a Weighted Voting", Mr. For Example, 2023; Sabour, Frosst & Hinton 2017, "Dynamic
Routing Between Capsules", Procedure 1, line 7: ``b_ij <- b_ij + u_hat_j|i . v_j``).
:class:`RoutingAttention` makes that claim testable inside a Transformer: it has exactly the
projections and the ``forward`` of :class:`~torchvote.nn.MultiHeadAttention` (so one can replace
the other through the transformer layers' ``attention=`` hook, and their state dicts are
interchangeable), and with ``iterations=1`` it *is* multi-head attention.

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
layers that picks softmax or routing attention by name, and :class:`AttentionRecorder`, which
collects the weights of every attention module of a model during one forward pass (the layers
themselves ask their attention for no weights).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from einops import rearrange
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from torchvote.functional import (
    DotProductScores,
    SharedVotes,
    VotingState,
    is_causal_mask,
    vote,
)
from torchvote.nn.attention import MultiHeadAttention, _check_inputs, _merge_masks, _same_map
from torchvote.nn.transformer import AttentionFactory

__all__ = [
    "ATTENTION_KINDS",
    "AttentionKind",
    "AttentionRecorder",
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
        scale: multiplies the dot products.
    """

    scale: float

    def __call__(self, state: VotingState) -> Tensor:
        """``(b, h, i, j)`` agreement from ``state.votes`` ``(b, h, j, d)`` and ``state.outputs``
        ``(b, h, i, d)``."""
        return state.votes.dot(state.outputs) * self.scale


class RoutingAttention(MultiHeadAttention):
    """Multi-head attention run as ``iterations`` passes of weighted voting with agreement updates.

    The first pass is scaled dot-product attention (Vaswani et al. 2017, sec. 3.2); every later
    pass adds to the logits the scaled agreement of each value with the receiver's current output
    (the dynamic-routing update of Sabour et al. 2017, Procedure 1, ``accumulate=True``), so the
    receivers listen more to the senders that agree with what they heard. This is the
    "multi-head attention written as dynamic routing" of the weighted-voting article (Mr. For
    Example, 2023), made iterative. With ``iterations=1`` and ``normalize_over="senders"`` it is
    exactly :class:`~torchvote.nn.MultiHeadAttention` (same parameters, same numbers, the same
    fused kernel); its ``state_dict`` loads into a :class:`~torchvote.nn.MultiHeadAttention` and
    back.

    ``normalize_over="receivers"`` normalises every pass over the queries instead (each key spends
    one unit of vote over the queries: capsule routing, bottom-up, as in slot attention). The
    softmax then sums over all queries, so it cannot be causal (a later query would change an
    earlier output): ``is_causal=True`` is refused. In self-attention (``key is query``) the
    ``key_mask`` also removes padded queries from the competition for the votes, so padding
    cannot change the real positions' outputs; for cross-attention with padded queries give the
    query padding in ``attn_mask``. ``aggregation="mean"`` renormalises the weights over the
    senders after the softmax over the receivers (a weighted mean, as in slot attention).

    Unlike the one-pass module it never uses the fused kernel for ``iterations > 1``: every pass
    forms the ``(b, h, L, S)`` weights.

    Args:
        embed_dim: ``E``, the model (and query) feature size.
        num_heads: heads ``h``; must divide ``embed_dim``.
        iterations: passes of voting, at least 1 (1 = softmax attention).
        normalize_over: ``"senders"`` (softmax over the keys, every pass) or ``"receivers"``
            (over the queries).
        aggregation: ``"sum"`` (weighted sum) or ``"mean"`` (weights renormalised over the senders).
        kdim, vdim, bias, dropout, batch_first, shared_qkv, device, dtype: as
            :class:`~torchvote.nn.MultiHeadAttention`. ``dropout`` applies to the weights of every
            pass.

    Raises:
        ValueError: an ``iterations``, ``normalize_over`` or ``aggregation`` that is not allowed,
            or any error of :class:`~torchvote.nn.MultiHeadAttention`.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        iterations: int = 3,
        normalize_over: Literal["senders", "receivers"] = "senders",
        aggregation: Literal["sum", "mean"] = "sum",
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = True,
        shared_qkv: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
        if normalize_over not in ("senders", "receivers"):
            raise ValueError(f"normalize_over must be 'senders' or 'receivers', got {normalize_over!r}")
        if aggregation not in ("sum", "mean"):
            raise ValueError(f"aggregation must be 'sum' or 'mean', got {aggregation!r}")
        super().__init__(
            embed_dim,
            num_heads,
            kdim=kdim,
            vdim=vdim,
            bias=bias,
            dropout=dropout,
            batch_first=batch_first,
            shared_qkv=shared_qkv,
            device=device,
            dtype=dtype,
        )
        self.iterations = iterations
        self.normalize_over = normalize_over
        self.aggregation = aggregation
        self.agreement = ScaledDotAgreement(1.0 / math.sqrt(self.head_dim))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, iterations={self.iterations}, "
            f"normalize_over={self.normalize_over!r}, aggregation={self.aggregation!r}"
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        average_weights: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value`` in ``iterations`` passes.

        Shapes are for ``batch_first=True``; with ``batch_first=False`` swap ``b`` and the length
        in ``query``, ``key``, ``value`` and the output (masks and weights keep batch first).

        Args:
            query: ``(b, L, E)`` (or unbatched ``(L, E)``).
            key: ``(b, S, kdim)``; default ``query`` (self-attention).
            value: ``(b, S, vdim)``; default ``key``.
            attn_mask: boolean (True = may attend) or float (added to the logits, ``-inf``
                forbids), ``(L, S)`` or broadcastable to ``(b, h, L, S)``; holds in every pass.
            key_mask: boolean ``(b, S)``, True for a real key, False for padding.
            is_causal: query ``l`` hears only keys ``s <= l`` in every pass.
            need_weights: also return the weights of the last pass.
            average_weights: average the weights over the heads.

        Returns:
            ``(output, weights)``: output ``(b, L, E)``; the last pass's normalised weights (the
            softmax, before the renormalisation of ``aggregation="mean"``) ``(b, L, S)`` if
            ``average_weights`` else ``(b, h, L, S)``, or ``None`` without ``need_weights``.

        Raises:
            ValueError: wrong shapes or masks (as :class:`~torchvote.nn.MultiHeadAttention`), or
                ``is_causal`` with ``normalize_over="receivers"``.
            TypeError: non-tensor or non-floating inputs, masks of the wrong dtype.
        """
        if is_causal and self.normalize_over == "receivers":
            raise ValueError(
                "is_causal=True needs normalize_over='senders': a softmax over the receivers sums "
                "over later queries, so later tokens would change earlier outputs"
            )
        key = query if key is None else key
        value = key if value is None else value
        self_attention = key is query
        unbatched = _check_inputs(query, key, value, self.embed_dim, self.kdim, self.vdim)
        if unbatched:
            query, key, value = _same_map(lambda t: t.unsqueeze(0), query, key, value)
            if isinstance(key_mask, Tensor):
                key_mask = key_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = _same_map(lambda t: rearrange(t, "l b e -> b l e"), query, key, value)
        if query.shape[0] != key.shape[0]:
            raise ValueError(
                f"query and key must have the same batch size, got {query.shape[0]} and "
                f"{key.shape[0]} (batch_first={self.batch_first})"
            )
        batch, target_len, source_len = query.shape[0], query.shape[1], key.shape[1]
        logits_shape = (batch, self.num_heads, target_len, source_len)
        mask = _merge_masks(attn_mask, key_mask, logits_shape)
        if self.normalize_over == "receivers" and self_attention and key_mask is not None:
            receivers = key_mask.view(batch, 1, target_len, 1)  # padded queries take no votes
            if mask is None:
                mask = receivers
            elif mask.dtype == torch.bool:
                mask = mask & receivers  # (b, .., i, j)
            else:
                mask = mask.masked_fill(~receivers, float("-inf"))  # (b, .., i, j)
        if mask is not None and mask.dim() == 2 and is_causal_mask(mask):
            mask, is_causal = None, True  # as the one-pass module: the fused kernel's fast path

        q, k, v = self.in_proj(query, key, value)  # (b, L, E), (b, S, E), (b, S, E)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)
        q = rearrange(q, "b i (h d) -> b h i d", h=self.num_heads)
        k = rearrange(k, "b j (h d) -> b h j d", h=self.num_heads)
        v = rearrange(v, "b j (h d) -> b h j d", h=self.num_heads)
        result = vote(
            SharedVotes(v),
            DotProductScores(q, k, scale=1.0 / math.sqrt(self.head_dim)),
            normalize_over=self.normalize_over,
            iterations=self.iterations,
            agreement=self.agreement,
            accumulate=True,
            aggregation=self.aggregation,
            mask=mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            record=need_weights,
        )
        output = self.out_proj(rearrange(result.outputs, "b h i d -> b i (h d)"))  # (b, L, E)

        weights = result.weights[-1] if need_weights else None  # (b, h, i, j)
        if weights is not None and average_weights:
            weights = weights.mean(dim=1)  # (b, i, j)
        if unbatched:
            output = output.squeeze(0)  # (L, E)
            weights = weights.squeeze(0) if weights is not None else None
        elif not self.batch_first:
            output = rearrange(output, "b l e -> l b e")
        return output, weights


def attention_factory(kind: AttentionKind = "softmax", *, iterations: int = 3) -> AttentionFactory:
    """The ``attention=`` hook of the transformer layers for softmax or routing attention.

    Args:
        kind: ``"softmax"`` (:class:`~torchvote.nn.MultiHeadAttention`, one pass) or
            ``"routing"`` (:class:`RoutingAttention` with ``iterations`` passes).
        iterations: passes of the routing attention (ignored for softmax, but checked).

    Returns:
        ``factory(embed_dim, num_heads, *, dropout) -> nn.Module``, batch first.

    Raises:
        ValueError: an unknown ``kind`` or ``iterations < 1``.
    """
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"kind must be one of {ATTENTION_KINDS}, got {kind!r}")
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    if kind == "softmax":
        return functools.partial(MultiHeadAttention, batch_first=True)
    return functools.partial(RoutingAttention, iterations=iterations, batch_first=True)


class AttentionRecorder:
    """Collects the weights of every attention module of a model during the forward passes.

    The transformer layers ask their attention for no weights (the fused kernel never forms
    them); inside ``with AttentionRecorder(model) as recorder:`` every
    :class:`~torchvote.nn.MultiHeadAttention` (and :class:`RoutingAttention`) below ``model``
    is called with ``need_weights=True`` instead and its weights (averaged over the heads) are
    kept, in call order, under the module's name. The hooks are removed on exit.

    Example::

        with AttentionRecorder(model) as recorder:
            model(tokens)
        recorder.weights  # {"encoder.layers.0.self_attention": (b, L, S), ...}

    Args:
        module: the model (or any module) whose attention modules are recorded.
        average_weights: average the weights over the heads (``(b, L, S)``) or keep them
            (``(b, h, L, S)``).

    Attributes:
        weights: module name -> the weights of its last call.
        calls: ``(name, weights)`` of every call, in order.
    """

    def __init__(self, module: nn.Module, *, average_weights: bool = True) -> None:
        self.module = module
        self.average_weights = average_weights
        self.calls: list[tuple[str, Tensor]] = []
        self._handles: list[RemovableHandle] = []

    @property
    def weights(self) -> dict[str, Tensor]:
        return dict(self.calls)

    def __enter__(self) -> AttentionRecorder:
        self.calls = []
        for name, child in self.module.named_modules():
            if isinstance(child, MultiHeadAttention):
                self._handles.append(child.register_forward_pre_hook(self._ask_for_weights, with_kwargs=True))
                self._handles.append(child.register_forward_hook(functools.partial(self._keep, name)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _ask_for_weights(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, {**kwargs, "need_weights": True, "average_weights": self.average_weights}

    def _keep(
        self, name: str, module: nn.Module, args: tuple[Any, ...], output: tuple[Tensor, Tensor | None]
    ) -> None:
        weights = output[1]
        assert weights is not None, "the pre-hook asked for the weights"
        self.calls.append((name, weights))
