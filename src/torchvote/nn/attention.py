"""Multi-head attention: projections and heads around one pass of weighted voting.

The math is one pass of :func:`torchvote.functional.vote`, normalised over the senders (without
weights, vote's fused branch itself, called without vote's argument checks); this module owns the
parameters: the input projections that turn tokens into queries, keys and values
(the votes), and the output projection that mixes the heads. As in x-transformers' split of
``Attend`` from ``Attention``, :meth:`MultiHeadAttention.forward` checks the inputs, prepares the
masks (:func:`torchvote.functional.prepare_attention_mask`), projects and splits the heads, and
hands ``q, k, v`` ``(b, h, i, d)`` to one overridable step, :meth:`MultiHeadAttention._attend`. A
variant (e.g. :class:`~torchvote.nn.RoutingAttention`) overrides that step, never ``forward``.

Index legend: ``b`` batch, ``h`` heads, ``i`` receivers (queries, length ``L``), ``j`` senders
(keys, length ``S``), ``d`` features per head.

Incremental decoding: ``forward(..., cache=KVCache())`` keeps the heads' keys and values in a
cache the caller owns (:mod:`torchvote.nn.kv_cache`); a later call projects only its new tokens.

Mask convention (all of torchvote): ``True`` means *may attend*. ``key_mask`` is ``True`` for a
real key and ``False`` for padding, the opposite of ``torch.nn.MultiheadAttention``'s
``key_padding_mask``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from torchvote.functional import DotProductScores, SharedVotes, prepare_attention_mask, vote
from torchvote.functional.attention import _softmax_attention
from torchvote.functional.masks import check_attention_mask, check_key_mask, refuse_per_example_3d_mask
from torchvote.functional.voting import _fused_softmax_attention
from torchvote.nn.attention_projections import (
    _check_inputs,
    _PackedProjection,
    _same_map,
    _SeparateProjections,
    _SharedProjection,
)
from torchvote.nn.kv_cache import KVCache, offset_causality
from torchvote.validation import (
    check_flag,
    check_float_dtype,
    check_inputs_beside,
    check_positive_int,
    check_probability,
)

__all__ = ["MultiHeadAttention"]


def _split_heads(projected: Tensor, heads: int) -> Tensor:
    """``(b, n, h * d) -> (b, h, n, d)``, a view. Written with ``view`` and ``transpose`` rather
    than einops' ``rearrange``: this runs three times a call, and at the lengths where a GPU
    call is bound by its launches (T ~ 1e3) rearrange's Python time (about 3x) showed."""
    batch, length, features = projected.shape  # sizes spelled out: -1 is ambiguous in an empty batch
    return projected.view(batch, length, heads, features // heads).transpose(1, 2)


def _key_mask_from_padding(key_mask: Tensor | None, key_padding_mask: Tensor | None) -> Tensor | None:
    """``key_mask`` (True = a real key) from torch's ``key_padding_mask`` (True = padding), when
    that is the one given."""
    if key_padding_mask is None:
        return key_mask
    if key_mask is not None:
        raise TypeError(
            "give key_mask (True = a real key) or key_padding_mask (True = padding, as in "
            "torch.nn.MultiheadAttention), not both"
        )
    if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
        given = key_padding_mask
        described = given.dtype if isinstance(given, Tensor) else type(given).__name__
        raise TypeError(
            f"key_padding_mask must be a boolean tensor (True = padding), got {described}; a float "
            "padding mask (added to the logits) goes in attn_mask as mask[:, None, None, :]"
        )
    return ~key_padding_mask


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, sec. 3.2.2) on the voting operator.

    ``MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W_O`` with
    ``head_h = softmax(Q W_Q^h (K W_K^h)^T / sqrt(d) + mask) V W_V^h``. Each head is one pass of
    weighted voting: the senders (keys) cast their values as votes, every receiver (query) weighs
    them by scaled dot-product agreement, normalised over the senders.

    Without ``need_weights`` the attention runs on ``F.scaled_dot_product_attention`` and no
    ``(L, S)`` matrix is formed; with it, on :func:`~torchvote.functional.softmax_attention`,
    which forms the weights once, in the compute dtype. A causal
    mask is best given as ``is_causal=True`` (the fused kernel then skips the masked half; a 2-D
    causal ``attn_mask`` is recognised and run the same way).

    Parameters mirror ``torch.nn.MultiheadAttention`` so :meth:`from_torch` copies them exactly:
    ``in_proj.weight`` ``(3E, E)`` (packed, when ``kdim == vdim == embed_dim``) or
    ``in_proj.query/key/value`` (separate), and ``out_proj``. With ``shared_qkv=True`` a single
    ``(E, E)`` matrix ``in_proj.shared`` makes queries, keys and values: the parameter sharing
    proposed in "Self-Attention is fundamentally a Weighted Voting" (Mr. For Example, 2023),
    under which self-attention is dynamic routing with pairwise agreement (see
    tests/test_equivalence_attention.py for the article's pseudocode run against this module).

    Masks, translated from ``torch.nn.MultiheadAttention`` (True always means *may attend* here)::

        torch bool attn_mask (True = blocked)      ->  attn_mask = ~torch_mask
        torch float attn_mask (added)              ->  attn_mask = torch_mask   (unchanged)
        torch 3-D attn_mask (b * h, L, S)          ->  attn_mask = mask.view(b, h, L, S) (bool: ~)
        torch key_padding_mask (True = padding)    ->  key_mask = ~key_padding_mask
                                                       (or key_padding_mask= as it is)
        torch float key_padding_mask (added)       ->  attn_mask = kpm[:, None, None, :] (+ others)
        torch attn_mask=causal, is_causal=True     ->  is_causal=True (no mask needed)

    Unbatched inputs ``(L, E)`` (with ``key_mask`` ``(S,)``) are accepted, as in torch: they are
    treated as a batch of one and the outputs lose the batch axis again.

    Args:
        embed_dim: ``E``, the model (and query) feature size.
        num_heads: number of heads ``h``; must divide ``embed_dim`` (``head_dim = E / h``).
        kdim: key feature size; default ``embed_dim``.
        vdim: value feature size; default ``embed_dim``.
        bias: add biases to the input and output projections.
        dropout: dropout probability on the attention weights, applied in training mode only.
        batch_first: inputs are ``(batch, length, E)``; if False, ``(length, batch, E)``.
        shared_qkv: one ``(E, E)`` matrix projects queries, keys and values (for cross-attention
            it projects both the query and the key/value inputs). Needs ``kdim == vdim == E``.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``num_heads`` does not divide ``embed_dim``, a size is not positive,
            ``dropout`` is outside ``[0, 1)``, or ``shared_qkv`` with ``kdim``/``vdim`` that differ
            from ``embed_dim``.
        TypeError: ``bias``, ``batch_first`` or ``shared_qkv`` that is not a bool.

    Examples:
        >>> import torch
        >>> from torchvote.nn import MultiHeadAttention
        >>> _ = torch.manual_seed(0)
        >>> attention = MultiHeadAttention(embed_dim=16, num_heads=4)
        >>> x = torch.randn(2, 5, 16)  # (batch, length, embed_dim): batch_first by default
        >>> out, weights = attention(x, need_weights=True)  # self-attention: key and value default to x
        >>> out.shape, weights.shape  # weights averaged over the heads
        (torch.Size([2, 5, 16]), torch.Size([2, 5, 5]))
        >>> reference = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        >>> torch.allclose(MultiHeadAttention.from_torch(reference)(x)[0], reference(x, x, x)[0], atol=1e-6)
        True
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        batch_first: bool = True,
        shared_qkv: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(embed_dim, "embed_dim")
        check_positive_int(num_heads, "num_heads")
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        check_probability(dropout, "dropout")
        for flag, argument in ((bias, "bias"), (batch_first, "batch_first"), (shared_qkv, "shared_qkv")):
            check_flag(flag, argument)
        kdim = check_positive_int(embed_dim if kdim is None else kdim, "kdim")
        vdim = check_positive_int(embed_dim if vdim is None else vdim, "vdim")
        if shared_qkv and (kdim != embed_dim or vdim != embed_dim):
            raise ValueError(
                f"shared_qkv=True projects queries, keys and values with one (embed_dim, "
                f"embed_dim) matrix, so kdim and vdim must equal embed_dim={embed_dim}, got "
                f"kdim={kdim}, vdim={vdim}"
            )
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = kdim
        self.vdim = vdim
        self.dropout = dropout
        self.batch_first = batch_first
        self.shared_qkv = shared_qkv
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        # The projection is chosen once. Packed whenever the sizes allow: for self-attention one
        # (E -> 3E) matmul measured 1.1-1.6x faster than three (E -> E) ones in forward + backward
        # on a 2-core CPU at E = 512 (about even in inference), and it is torch's layout.
        self.in_proj: nn.Module
        if shared_qkv:
            self.in_proj = _SharedProjection(embed_dim, bias=bias, **factory)
        elif kdim == embed_dim and vdim == embed_dim:
            self.in_proj = _PackedProjection(embed_dim, bias=bias, **factory)
        else:
            self.in_proj = _SeparateProjections(embed_dim, kdim, vdim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        if self.out_proj.bias is not None:
            nn.init.zeros_(self.out_proj.bias)

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        parts.append(f"dropout={self.dropout}, batch_first={self.batch_first}")
        if self.shared_qkv:
            parts.append("shared_qkv=True")
        return ", ".join(parts)

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
        cache: KVCache | None = None,
        key_padding_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attend from ``query`` to ``key``/``value``.

        Shapes are for ``batch_first=True``; with ``batch_first=False`` swap ``b`` and the
        length in ``query``, ``key``, ``value`` and the output (masks and weights keep batch
        first).

        Args:
            query: ``(b, L, E)``.
            key: ``(b, S, kdim)``; default ``query`` (self-attention).
            value: ``(b, S, vdim)``; default ``key``.
            attn_mask: boolean (True = may attend) or float (added to the logits, ``-inf``
                forbids) of shape ``(L, S)`` or broadcastable to ``(b, h, L, S)``; a 3-D mask
                only as ``(1, L, S)`` (more slices are ambiguous: give ``(b, 1, L, S)`` or
                ``(1, h, L, S)``), or ``(h, L, S)`` for unbatched inputs.
            key_mask: boolean ``(b, S)``, True for a real key, False for padding (the opposite
                of torch's ``key_padding_mask``).
            is_causal: query ``l`` attends only to keys ``s <= l`` (top-left aligned); combined
                with ``attn_mask`` and ``key_mask`` if those are given too.
            need_weights: also return the attention weights (forms the ``(b, h, L, S)`` matrix),
                before dropout: in training with ``dropout > 0`` they are the softmax's, each row
                summing to 1, where ``nn.MultiheadAttention`` returns them after dropout (the
                outputs agree).
            average_weights: average the weights over the heads.
            cache: keys and values kept between calls (incremental decoding), filled in place.
                An appending cache (self-attention) adds this call's keys and values after the
                ``P`` it holds: ``S`` and the masks then count all ``P + S`` keys, and
                ``is_causal`` lets query ``l`` (position ``P + l``) hear keys ``<= P + l``. A
                static cache (cross-attention) is filled on the first call; later calls reuse
                its keys and values and do not project ``key``/``value`` (which must still be
                the memory they came from: same batch and length); masks and ``is_causal`` then
                apply as they would without a cache.
            key_padding_mask: ``torch.nn.MultiheadAttention``'s form of ``key_mask``, for ported
                code: boolean ``(b, S)``, True for padding (read as ``key_mask=~key_padding_mask``).
                Give one of the two.

        Returns:
            ``(output, weights)``: output ``(b, L, E)``; weights ``(b, L, S)`` if
            ``average_weights`` else ``(b, h, L, S)``, or ``None`` without ``need_weights``. A
            query with nothing to attend to gets zero weights, so its output is ``out_proj``'s
            bias.

        Raises:
            ValueError: wrong ranks, feature sizes, batch sizes or lengths; masks of the wrong
                shape; NaN in a float mask; a filled static ``cache`` given another batch or
                memory length.
            TypeError: non-tensor or non-floating inputs, inputs of another dtype than the
                parameters' (outside ``torch.autocast``), masks that are not boolean (or, for
                ``attn_mask``, floating point), a ``cache`` that is not a :class:`KVCache`;
                ``is_causal``, ``need_weights`` or ``average_weights`` that is not a bool;
                ``key_padding_mask`` beside ``key_mask``, or not boolean.
        """
        key_mask = _key_mask_from_padding(key_mask, key_padding_mask)
        for flag, argument in ((is_causal, "is_causal"), (need_weights, "need_weights"),
                               (average_weights, "average_weights")):
            check_flag(flag, argument)
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be a KVCache or None, got {type(cache).__name__}")
            self._check_cache()
        if key is None and isinstance(value, Tensor) and isinstance(query, Tensor) \
                and value.shape[:-1] != query.shape[:-1]:
            raise ValueError(  # the check below would blame a key the user never gave
                f"value of shape {tuple(value.shape)} was given without key, so key defaulted to "
                f"query {tuple(query.shape)}, whose batch and length value must share; give key too "
                "for cross-attention"
            )
        key = query if key is None else key
        value = key if value is None else value
        self_attention = key is query
        unbatched = _check_inputs(query, key, value, self.embed_dim, self.kdim, self.vdim)
        check_inputs_beside(  # torch's own errors name no argument
            self.out_proj.weight,
            (("query", query), ("key", key), ("value", value)),
            masks=(("attn_mask", attn_mask), ("key_mask", key_mask)),
        )
        if unbatched:
            # a growing cache's keys come first: the mask covers them too (a fixed memory's do not add)
            keys = key.shape[0] + (cache.length if cache is not None and not cache.static else 0)
            check_key_mask(key_mask, None, keys, "key_mask")  # (S,): the batched check would show (1, S)
            # (h, L, S): the batched check would show (1, h, L, S)
            logits = (1, self.num_heads, query.shape[0], keys)  # the batch of 1 they are attended as
            check_attention_mask(attn_mask, logits, "attn_mask", unbatched=True)
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
        if cache is not None and cache.static:  # a fixed memory: every call as it would be uncached
            if cache.filled:
                cache.check_memory(batch, source_len)
        elif cache is not None:  # the queries follow the cached keys: causality shifts with them
            source_len += cache.length
            # the user's mask covers every key, the cached ones too: checked before it is shifted
            check_attention_mask(attn_mask, (batch, self.num_heads, target_len, source_len), "attn_mask")
            attn_mask, is_causal = offset_causality(attn_mask, is_causal, cache.length, target_len,
                                                    source_len, query.device)
        receiver_mask = self._receiver_mask(
            key_mask, is_causal=is_causal, self_attention=self_attention, attn_mask=attn_mask,
            lengths=(target_len, source_len),
        )
        asked_causal = is_causal
        if not unbatched:  # unbatched, a 3-D mask is torch's (heads, L, S)
            refuse_per_example_3d_mask(attn_mask, (batch, self.num_heads, target_len, source_len))
        mask, is_causal = prepare_attention_mask(
            attn_mask,
            key_mask,
            (batch, self.num_heads, target_len, source_len),
            is_causal=is_causal,
            receiver_mask=receiver_mask,
            dtype=query.dtype,
        )  # broadcastable to (b, h, i, j), or None
        if is_causal and not asked_causal:  # a causal attn_mask is causality too: the same checks
            self._receiver_mask(key_mask, is_causal=True, self_attention=self_attention)

        if cache is not None and cache.filled:  # keys and values of a fixed memory: reused
            q = _split_heads(self.in_proj.project_query(query), self.num_heads)  # (b, h, i, d)
            k, v = cache.keys, cache.values  # (b, h, j, d)
        else:
            q, k, v = self.in_proj(query, key, value)  # (b, L, E), (b, S, E), (b, S, E)
            q = _split_heads(q, self.num_heads)  # (b, h, i, d)
            k, v = _split_heads(k, self.num_heads), _split_heads(v, self.num_heads)  # (b, h, j, d)
            if cache is not None:
                k, v = cache.update(k, v)  # (b, h, P + S, d): the past keys, then the new ones
        attended, weights = self._attend(q, k, v, mask, is_causal, need_weights)  # (b, h, i, d)
        output = self.out_proj(attended.transpose(1, 2).flatten(2))  # (b, h, i, d) -> (b, L, E)

        if weights is not None and average_weights:
            weights = weights.mean(dim=1)  # (b, i, j)
        if unbatched:
            output = output.squeeze(0)  # (L, E)
            weights = weights.squeeze(0) if weights is not None else None
        elif not self.batch_first:
            output = rearrange(output, "b l e -> l b e")
        return output, weights

    @property
    def scale(self) -> float:
        """``1 / sqrt(head_dim)``, the scale of the dot products (Vaswani et al. 2017, eq. 1)."""
        return 1.0 / math.sqrt(self.head_dim)

    def _receiver_mask(
        self,
        key_mask: Tensor | None,
        *,
        is_causal: bool,
        self_attention: bool,
        attn_mask: Tensor | None = None,
        lengths: tuple[int, int] | None = None,
    ) -> Tensor | None:
        """Hook: refuse a call a variant cannot run, and name the receivers that take no votes.

        Softmax attention takes every call and needs no receiver mask; a variant that normalises
        over the receivers overrides this (see :class:`~torchvote.nn.RoutingAttention`).

        Args:
            key_mask: the batched ``(b, S)`` key mask, or None.
            is_causal: the call's causality.
            self_attention: the keys are the queries.
            attn_mask: the call's ``attn_mask`` as given, or None.
            lengths: ``(L, S)``, the queries' and keys' lengths.

        Returns:
            ``None``, or a boolean ``(b, L)`` mask, False for a receiver that takes no vote.
        """
        return None

    def _check_cache(self) -> None:
        """Hook: refuse a key/value cache where the variant's math does not allow one (softmax
        attention normalises each query over its own keys: a new one needs only past keys)."""

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The voting itself, after projections and head split: the one step a variant overrides.

        Args:
            q: ``(b, h, i, d)`` queries.
            k: ``(b, h, j, d)`` keys.
            v: ``(b, h, j, d)`` values.
            mask: as :func:`~torchvote.functional.prepare_attention_mask` returns it, or None.
            is_causal: receiver ``i`` hears only senders ``j <= i``.
            need_weights: also return the ``(b, h, i, j)`` weights.

        Returns:
            ``(attended, weights)``: ``(b, h, i, d)`` and ``(b, h, i, j)`` or None.
        """
        if need_weights:  # one pass that forms the weights once, in the compute dtype
            return _softmax_attention(q, k, v, mask=mask, is_causal=is_causal,
                                      dropout_p=self.dropout if self.training else 0.0,
                                      scale=self.scale)
        # one pass without weights: vote's fused branch, called without vote's checks of what
        # forward checked already (they cost about a fifth of a small call)
        attended = _fused_softmax_attention(q, k, v, mask, is_causal,
                                           self.dropout if self.training else 0.0, self.scale)
        return attended, None  # (b, h, i, d)

    def _vote(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        is_causal: bool,
        need_weights: bool,
        **options: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """:func:`~torchvote.functional.vote` on the heads' scaled dot products, with this
        module's dropout; ``options`` (``normalize_over``, ``iterations``, ...) pass through.

        Returns:
            ``(attended, weights)``: ``(b, h, i, d)`` and the last pass's ``(b, h, i, j)`` or None.
        """
        options.setdefault("normalize_over", "senders")
        result = vote(
            SharedVotes(v),
            DotProductScores(q, k, scale=self.scale),
            mask=mask,
            is_causal=is_causal,
            dropout_p=self.dropout if self.training else 0.0,
            record=need_weights,
            **options,
        )
        return result.outputs, (result.weights[-1] if need_weights else None)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """A :class:`MultiHeadAttention` with exactly ``module``'s weights and settings.

        Copies ``in_proj_weight`` (or ``q/k/v_proj_weight`` when ``kdim``/``vdim`` differ from
        ``embed_dim``), ``in_proj_bias``, ``out_proj``, ``dropout``, ``batch_first``, the
        training flag, device and dtype. Translate the masks as shown in the class docstring.

        Args:
            module: a ``torch.nn.MultiheadAttention``.

        Returns:
            The equivalent module (a copy: later changes to ``module`` do not carry over).

        Raises:
            TypeError: ``module`` is not a ``torch.nn.MultiheadAttention``.
            ValueError: ``module`` uses ``add_bias_kv`` or ``add_zero_attn`` (unsupported: they
                append a learned or zero key/value to every sequence).
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"module must be a torch.nn.MultiheadAttention, got {type(module).__name__}")
        if module.bias_k is not None or module.bias_v is not None:
            raise ValueError("from_torch: add_bias_kv=True (bias_k / bias_v) is not supported")
        if module.add_zero_attn:
            raise ValueError("from_torch: add_zero_attn=True is not supported")
        reference = module.out_proj.weight
        ours = cls(
            module.embed_dim,
            module.num_heads,
            kdim=module.kdim,
            vdim=module.vdim,
            bias=module.in_proj_bias is not None,
            dropout=module.dropout,
            batch_first=module.batch_first,
            device=reference.device,
            dtype=reference.dtype,
        )
        embed_dim = module.embed_dim
        with torch.no_grad():
            if isinstance(ours.in_proj, _PackedProjection):
                ours.in_proj.weight.copy_(module.in_proj_weight)
                if module.in_proj_bias is not None:
                    ours.in_proj.bias.copy_(module.in_proj_bias)
            else:
                assert isinstance(ours.in_proj, _SeparateProjections)
                sources = (module.q_proj_weight, module.k_proj_weight, module.v_proj_weight)
                targets = (ours.in_proj.query, ours.in_proj.key, ours.in_proj.value)
                for index, (source, target) in enumerate(zip(sources, targets, strict=True)):
                    target.weight.copy_(source)
                    if module.in_proj_bias is not None:
                        target.bias.copy_(module.in_proj_bias[index * embed_dim : (index + 1) * embed_dim])
            ours.out_proj.weight.copy_(module.out_proj.weight)
            if module.out_proj.bias is not None:
                ours.out_proj.bias.copy_(module.out_proj.bias)
        return ours.train(module.training)

