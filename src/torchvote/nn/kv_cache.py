"""Key/value caches for incremental decoding: what an attention has projected, kept by the caller.

Generating token ``t + 1`` with causal self-attention needs the keys and values of tokens
``0 .. t``; they do not change once computed (position ``s`` hears only ``<= s``), so a decoder
keeps them instead of recomputing the whole prefix for every new token. Cross-attention's keys and
values come from the encoder's memory, fixed for the whole decoding: they are computed once.

The caches hold no parameters and live outside the modules: the caller creates one
(:meth:`TransformerCache.empty`), passes it to every call of a stack, layer or attention
(``cache=``), and the modules fill it in place. There is no hidden state in a module, so the same
model can decode several batches at once with one cache each. A cache serves one batch from its
first token to its last: a new batch, or the same prompts decoded afresh, takes a new cache (the
models' ``new_cache()``; there is no reset, and no reordering of the batch rows, since nothing in
torchvote runs beam search; ``copy.copy`` of a :class:`KVCache` forks it). Its tensors are the
attention's own projections, so they have the inputs' dtype and device; an appending cache refuses
new keys of another batch, dtype or device (:meth:`KVCache.update`).

Index legend: ``b`` batch, ``h`` heads, ``j`` senders (cached keys, length ``S``), ``d`` features
per head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from torchvote.functional.masks import restrict_mask
from torchvote.validation import check_positive_int

__all__ = ["KVCache", "LayerCache", "TransformerCache", "offset_causality"]


@dataclass
class KVCache:
    """The keys and values one attention module has projected, split into heads.

    Attributes:
        keys: ``(b, h, S, d)``, or ``None`` before the first call. Once appended to without
            autograd (decoding under ``no_grad``), a view of the first ``S`` positions of a larger
            buffer that later calls write into; what an earlier call returned keeps its values.
        values: ``(b, h, S, d)``, or ``None`` before the first call; as ``keys``.
        static: the keys and values are computed on the first call and reused by every later
            one (cross-attention to a fixed memory); otherwise every call appends the keys and
            values of its new tokens (causal self-attention).
    """

    keys: Tensor | None = None
    values: Tensor | None = None
    static: bool = False
    # Where appended keys and values live: (b, h, capacity, d) buffers that ``keys`` and ``values``
    # are the first S positions of, so that a decoding step writes its token's keys in place instead
    # of copying the whole past (``torch.cat``: O(S) a step).
    _buffers: tuple[Tensor, Tensor] | None = field(default=None, repr=False, compare=False)

    def __copy__(self) -> KVCache:
        """A fork: the same keys and values held so far, and a buffer of its own from its first
        append (a shallow copy shared the buffer, so each fork's next token overwrote the other's,
        at the same position). The keys held are not copied: appends write past them."""
        return KVCache(self.keys, self.values, self.static)

    @property
    def length(self) -> int:
        """``S``: the keys held (the position of the next token for a self-attention cache)."""
        return 0 if self.keys is None else self.keys.shape[-2]

    @property
    def filled(self) -> bool:
        """A static cache that holds its keys and values: the attention skips their projection."""
        return self.static and self.keys is not None

    def check_memory(self, batch: int, memory_length: int) -> None:
        """Refuse to reuse a filled static cache for another batch or memory than it was filled
        from (its keys would broadcast over a new batch, or stand for a memory of another length,
        in silence).

        Args:
            batch: the call's batch size.
            memory_length: the call's ``key`` length ``S``.

        Raises:
            ValueError: a batch or length other than the cached keys'.
        """
        if self.keys is None:
            return
        held_batch, held_length = self.keys.shape[0], self.keys.shape[-2]
        if (batch, memory_length) != (held_batch, held_length):
            raise ValueError(
                f"cache holds the keys of a memory of batch {held_batch} and length {held_length}; "
                f"this call has batch {batch} and a memory of length {memory_length} (another "
                "batch or memory: start a new cache)"
            )

    def update(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new keys and values; return every key and value held.

        Args:
            keys: ``(b, h, S_new, d)`` keys of the call's new tokens.
            values: ``(b, h, S_new, d)``.

        Returns:
            ``(keys, values)``, ``(b, h, S, d)`` each: the past ones followed by the new ones.

        Raises:
            ValueError: new keys whose batch, heads, features, dtype or device differ from the
                held ones (another batch, or a model converted or moved since the cache was
                filled: ``torch.cat`` would promote the dtype, mixing precisions in silence, or
                fail on the devices without naming the cache).
        """
        if self.keys is None or self.values is None or self.static:
            self.keys, self.values = keys, values
            return keys, values
        held = self.keys
        if (
            keys.shape[:-2] != held.shape[:-2]
            or keys.shape[-1] != held.shape[-1]
            or keys.dtype != held.dtype
            or keys.device != held.device
        ):
            raise ValueError(
                f"cache holds keys of shape {tuple(held.shape)}, {held.dtype} on {held.device}; "
                f"new keys of shape {tuple(keys.shape)}, {keys.dtype} on {keys.device} do not "
                "extend them (another batch, or a model converted or moved since: start a new "
                "cache)"
            )
        if not _can_append_in_place(held, keys, values):
            self.keys = torch.cat([self.keys, keys], dim=-2)  # (b, h, S + S_new, d)
            self.values = torch.cat([self.values, values], dim=-2)  # (b, h, S + S_new, d)
            self._buffers = None
            return self.keys, self.values
        self.keys, self.values = self._append(keys, values)  # (b, h, S + S_new, d), views
        return self.keys, self.values

    def _append(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """The held keys and values followed by the new ones, written into the buffers, which grow
        by half their size (at least 64 positions) when full: amortised O(S_new) a call, and at
        most half as much memory again as the keys held."""
        held, new = self.length, keys.shape[-2]
        end = held + new
        buffers = self._buffers
        # a buffer serves while keys and values are still its views (a caller may have set them)
        if buffers is None or buffers[0].shape[-2] < end or not _views_of(buffers, self.keys, self.values):
            capacity = end + max(end // 2, 64)
            grown = []
            for past in (self.keys, self.values):
                buffer = past.new_empty((*past.shape[:-2], capacity, past.shape[-1]))  # (b, h, C, d)
                buffer[..., :held, :].copy_(past)
                grown.append(buffer)
            buffers = self._buffers = (grown[0], grown[1])
        for buffer, tensor in zip(buffers, (keys, values), strict=True):
            buffer[..., held:end, :].copy_(tensor)
        return buffers[0][..., :end, :], buffers[1][..., :end, :]


def _can_append_in_place(held: Tensor, keys: Tensor, values: Tensor) -> bool:
    """Writing into a buffer that earlier calls' keys are views of is safe unless autograd may
    need those keys again (their version would change under it), a compiler traces the call, or
    the buffer was made under ``torch.inference_mode`` and this call runs outside it (PyTorch
    refuses to write into an inference tensor there)."""
    if torch.compiler.is_compiling():
        return False
    if held.is_inference() and not torch.is_inference_mode_enabled():
        return False
    tracked = held.requires_grad or keys.requires_grad or values.requires_grad
    return not (torch.is_grad_enabled() and tracked)


def _views_of(buffers: tuple[Tensor, Tensor], keys: Tensor | None, values: Tensor | None) -> bool:
    """``keys`` and ``values`` are the leading positions of ``buffers`` (not replaced since)."""
    return all(
        tensor is not None and tensor.data_ptr() == buffer.data_ptr() and tensor.stride() == buffer.stride()
        for buffer, tensor in zip(buffers, (keys, values), strict=True)
    )


@dataclass
class LayerCache:
    """The caches of one Transformer layer.

    Attributes:
        self_attention: appended on every call (causal self-attention).
        cross_attention: static, filled on the first call (a decoder layer's memory).
    """

    self_attention: KVCache = field(default_factory=KVCache)
    cross_attention: KVCache = field(default_factory=lambda: KVCache(static=True))


@dataclass
class TransformerCache:
    """The caches of a stack of Transformer layers, one :class:`LayerCache` per layer.

    Attributes:
        layers: one cache per layer, in order.
    """

    layers: list[LayerCache]

    @classmethod
    def empty(cls, num_layers: int) -> TransformerCache:
        """A cache for a stack of ``num_layers`` layers, holding nothing yet.

        Raises:
            ValueError: ``num_layers < 1``.
        """
        check_positive_int(num_layers, "num_layers")
        return cls([LayerCache() for _ in range(num_layers)])

    @property
    def length(self) -> int:
        """Tokens already decoded: the position of the next token."""
        return self.layers[0].self_attention.length

    def held(self) -> list[tuple[Tensor | None, Tensor | None]]:
        """What every cache holds now, for :meth:`restore` (references, no copy: an append
        writes past the held keys' end or into a new buffer, never into them)."""
        return [(cache.keys, cache.values) for cache in self._caches()]

    def restore(self, held: list[tuple[Tensor | None, Tensor | None]]) -> None:
        """Put back what :meth:`held` returned: a call that failed halfway through a stack (a
        later layer refusing its memory) left its first layers one token ahead of the others."""
        for cache, (keys, values) in zip(self._caches(), held, strict=True):
            cache.keys, cache.values = keys, values

    def _caches(self) -> list[KVCache]:
        return [cache for layer in self.layers for cache in (layer.self_attention, layer.cross_attention)]


def offset_causality(
    attn_mask: Tensor | None, is_causal: bool, past: int, target_len: int, source_len: int,
    device: torch.device,
) -> tuple[Tensor | None, bool]:
    """Causality for ``target_len`` new queries after ``past`` cached keys.

    ``is_causal`` is top-left aligned (query ``l`` hears keys ``<= l``); after ``P = past``
    keys from a cache, query ``l`` is position ``P + l`` and hears keys ``<= P + l``. When the
    call brings one key per query (self-attention, ``source_len = P + target_len``), that is
    bottom-right alignment; with no past it is the uncached call's. Queries that hear every key
    need no mask at all (one query after its own key); otherwise an explicit ``(L, S)`` mask,
    combined with ``attn_mask``.

    Args:
        attn_mask: the call's mask (boolean or float, ``(L, S)`` or broadcastable), or None.
        is_causal: the call's causality.
        past: ``P``, the keys the cache held before this call.
        target_len: ``L``, the new queries.
        source_len: ``S``, every key: the cached ones and the new ones.
        device: where to build the mask.

    Returns:
        ``(attn_mask, is_causal)`` for :func:`~torchvote.functional.prepare_attention_mask`.
    """
    if not is_causal or past == 0:
        return attn_mask, is_causal
    if past >= source_len - 1:  # even query 0 (position P) hears every key
        return attn_mask, False
    allowed = torch.ones(target_len, source_len, dtype=torch.bool, device=device).tril(past)  # (i, j)
    return restrict_mask(attn_mask, allowed), False
