"""Key/value caches: attention and layers fed a few tokens at a time equal the whole-sequence call.

References are independent of the cache: ``torch.nn.MultiheadAttention`` on the whole prefix with
a causal mask, or the same module called without a cache on the whole prefix.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from torchvote.nn import MultiHeadAttention, RoutingAttention, TransformerDecoderLayer
from torchvote.nn.kv_cache import KVCache, LayerCache, TransformerCache
from torchvote.nn.transformer import TransformerConfig
from torchvote.nn.transformer_stack import TransformerDecoder

EMBED, HEADS = 16, 4
CHUNKS = (3, 1, 1, 2, 1)  # a prompt, single tokens, and several new tokens after a cache


def _chunks(x: torch.Tensor):
    start = 0
    for size in CHUNKS:
        yield start, x[:, start : start + size]
        start += size


def test_self_attention_cache_matches_torch_on_the_whole_prefix():
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(EMBED, HEADS, batch_first=True).eval()
    ours = MultiHeadAttention.from_torch(theirs).eval()
    x = torch.randn(2, sum(CHUNKS), EMBED)
    cache = KVCache()
    for start, new in _chunks(x):
        end = start + new.shape[1]
        out, weights = ours(new, is_causal=True, need_weights=True, cache=cache)
        blocked = torch.ones(end, end, dtype=torch.bool).triu(1)
        expected, expected_weights = theirs(x[:, :end], x[:, :end], x[:, :end], attn_mask=blocked)
        torch.testing.assert_close(out, expected[:, start:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(weights, expected_weights[:, start:], rtol=1e-5, atol=1e-5)
        assert cache.length == end


def test_routing_attention_over_the_senders_cache_matches_the_uncached_call():
    torch.manual_seed(0)
    module = RoutingAttention(EMBED, HEADS, iterations=3, normalize_over="senders").eval()
    x = torch.randn(2, sum(CHUNKS), EMBED)
    cache = KVCache()
    for start, new in _chunks(x):
        end = start + new.shape[1]
        out, _ = module(new, is_causal=True, cache=cache)
        expected, _ = module(x[:, :end], is_causal=True)
        torch.testing.assert_close(out, expected[:, start:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("memory_len", [3, 7])
def test_a_static_cache_takes_masks_and_causality_as_the_uncached_call(memory_len):
    # Cross-attention to a fixed memory: the cache only saves projecting it again, so a causal
    # (top-left) call gives what the same call gives without a cache, first call and later ones.
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS).eval()
    memory = torch.randn(2, memory_len, EMBED)
    cache = KVCache(static=True)
    for queries in (torch.randn(2, 5, EMBED), torch.randn(2, 1, EMBED), torch.randn(2, 4, EMBED)):
        out, weights = module(queries, memory, is_causal=True, need_weights=True, cache=cache)
        expected, expected_weights = module(queries, memory, is_causal=True, need_weights=True)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(weights, expected_weights)


def test_routing_over_the_receivers_refuses_a_cache():
    module = RoutingAttention(EMBED, HEADS, normalize_over="receivers")
    with pytest.raises(ValueError, match="cache needs normalize_over='senders'"):
        module(torch.randn(1, 3, EMBED), cache=KVCache())


def test_cross_attention_cache_projects_the_memory_once():
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS).eval()
    memory = torch.randn(2, 5, EMBED)
    key_mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    calls = []
    module.in_proj.register_forward_hook(lambda *args: calls.append(1))
    cache = KVCache(static=True)
    outputs = [module(torch.randn(2, n, EMBED), memory, key_mask=key_mask, cache=cache) for n in (2, 1, 1)]
    assert len(calls) == 1  # later calls project the queries alone
    keys = cache.keys
    query = torch.randn(2, 1, EMBED)
    out, _ = module(query, memory, key_mask=key_mask, cache=cache)
    assert cache.keys is keys
    expected, _ = module(query, memory, key_mask=key_mask)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert outputs[0][0].shape == (2, 2, EMBED)


@pytest.mark.parametrize(("batch", "memory_len"), [(2, 5), (1, 4)])
def test_a_filled_static_cache_refuses_another_batch_or_memory(batch, memory_len):
    """Filled from a batch of 1 and a memory of 5, the cached keys broadcast over a batch of 2 (a
    wrong answer, off by up to 0.7) or stood for a memory of another length, in silence."""
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS).eval()
    cache = KVCache(static=True)
    module(torch.randn(1, 1, EMBED), torch.randn(1, 5, EMBED), cache=cache)
    with pytest.raises(ValueError, match=r"batch 1 and length 5; this call has batch "
                                         rf"{batch} and a memory of length {memory_len}"):
        module(torch.randn(batch, 1, EMBED), torch.randn(batch, memory_len, EMBED), cache=cache)


def test_a_stack_refuses_a_cache_without_causality():
    """Two layers, a cache and ``is_causal=False``: the second layer's cached keys of earlier
    tokens were computed before the later tokens existed, so the output differed from the
    uncached call (by 0.03 here) in silence."""
    torch.manual_seed(0)
    layer = TransformerConfig(EMBED, HEADS, dim_feedforward=32, dropout=0.0)
    decoder = TransformerDecoder(layer, 2).eval()
    target, memory = torch.randn(1, 4, EMBED), torch.randn(1, 3, EMBED)
    with pytest.raises(ValueError, match="a cache in a stack of several layers needs is_causal=True"):
        decoder(target, memory, is_causal=False, cache=decoder.new_cache())
    one_layer = TransformerDecoder(layer, 1).eval()  # one layer: the cache stays exact
    cache = one_layer.new_cache()
    steps = [one_layer(target[:, t : t + 1], memory, is_causal=False, cache=cache) for t in range(4)]
    expected = one_layer(target, memory, is_causal=True)  # each step hears its past only
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-6)


def test_decoder_stack_cache_matches_the_uncached_stack():
    torch.manual_seed(0)
    layer = TransformerConfig(EMBED, HEADS, dim_feedforward=32, dropout=0.0, norm_first=True)
    decoder = TransformerDecoder(layer, 2).eval()
    memory = torch.randn(2, 5, EMBED)
    memory_key_mask = torch.tensor([[True] * 5, [True] * 4 + [False]])
    target = torch.randn(2, sum(CHUNKS), EMBED)
    cache = decoder.new_cache()
    for start, new in _chunks(target):
        end = start + new.shape[1]
        out = decoder(new, memory, memory_key_mask=memory_key_mask, cache=cache)
        expected = decoder(target[:, :end], memory, memory_key_mask=memory_key_mask)
        torch.testing.assert_close(out, expected[:, start:], rtol=1e-5, atol=1e-5)
    assert cache.length == sum(CHUNKS)


def test_bad_caches_are_refused():
    module = MultiHeadAttention(EMBED, HEADS)
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        module(torch.randn(1, 2, EMBED), cache={})
    decoder = TransformerDecoder(TransformerConfig(EMBED, HEADS), 2)
    with pytest.raises(ValueError, match="one entry per layer"):
        decoder(torch.randn(1, 2, EMBED), torch.randn(1, 3, EMBED), cache=TransformerCache.empty(3))
    cache = KVCache()
    cache.update(torch.zeros(1, HEADS, 2, 4), torch.zeros(1, HEADS, 2, 4))
    with pytest.raises(ValueError, match="do not extend"):
        cache.update(torch.zeros(2, HEADS, 1, 4), torch.zeros(2, HEADS, 1, 4))
    with pytest.raises(ValueError, match="num_layers"):
        TransformerCache.empty(0)
    layer = TransformerDecoderLayer(EMBED, HEADS)
    assert isinstance(LayerCache().cross_attention, KVCache) and LayerCache().cross_attention.static
    out = layer(torch.randn(1, 1, EMBED), torch.randn(1, 3, EMBED), cache=LayerCache())
    assert out.shape == (1, 1, EMBED)


@pytest.mark.parametrize(
    ("dtype", "device", "named"),
    [(torch.float64, "cpu", "torch.float64 on cpu"), (torch.float32, "meta", "torch.float32 on meta")],
)
def test_an_appending_cache_refuses_keys_of_another_dtype_or_device(dtype, device, named):
    # torch.cat promoted float32 + float64 in silence (old keys at the lower precision) and
    # failed on two devices without naming the cache.
    cache = KVCache()
    held = torch.zeros(1, HEADS, 2, 4)
    cache.update(held, held)
    new = torch.zeros(1, HEADS, 1, 4, dtype=dtype, device=device)
    with pytest.raises(ValueError, match=f"torch.float32 on cpu; new keys of shape \\(1, {HEADS}, 1, 4\\), "
                                         f"{named} do not extend them"):
        cache.update(new, new)
    assert cache.keys is held  # nothing was changed
    static = KVCache(static=True)  # a fixed memory: replaced on a new call, never extended
    static.update(held, held)
    assert static.update(new, new)[0] is new


def _appended(steps, grad=False):
    """Feed ``steps`` (b, h, n, d) key chunks (values: the keys + 1) to one cache; return what each
    update returned, cloned at once, and the cache."""
    cache, seen = KVCache(), []
    with torch.set_grad_enabled(grad):
        for keys in steps:
            held_keys, held_values = cache.update(keys, keys + 1)
            seen.append((held_keys, held_values, held_keys.clone(), held_values.clone()))
    return seen, cache


def test_appending_writes_into_a_buffer_and_returns_what_concatenation_would():
    """Without autograd, the keys of each step go into a buffer that grows by half when full (not
    a torch.cat of the whole past every step); every update returns the concatenation of all keys
    so far, and what an earlier update returned still holds its values after later writes."""
    generator = torch.Generator().manual_seed(0)
    steps = [torch.randn(2, 3, n, 4, generator=generator) for n in (5, 1, 1, 3) + (1,) * 70]
    seen, cache = _appended(steps)
    for t, (keys, values, keys_then, values_then) in enumerate(seen):
        expected = torch.cat(steps[: t + 1], dim=-2)
        torch.testing.assert_close(keys_then, expected, rtol=0, atol=0)
        torch.testing.assert_close(values_then, expected + 1, rtol=0, atol=0)
        torch.testing.assert_close(keys, keys_then, rtol=0, atol=0)  # later writes left it alone
        torch.testing.assert_close(values, values_then, rtol=0, atol=0)
    storages = {keys.untyped_storage().data_ptr() for keys, *_ in seen[1:]}
    assert len(storages) == 2  # 73 appends, one growth past 64 + 6 positions: two buffers
    assert cache.length == sum(step.shape[-2] for step in steps)


def test_appending_under_autograd_concatenates_and_gradients_flow():
    """Keys that need a gradient are concatenated (a buffer written in place would change tensors
    autograd saved): the gradient of every step's keys is what the concatenation gives."""
    steps = [torch.randn(1, 2, n, 4, requires_grad=True) for n in (3, 1, 2)]
    seen, cache = _appended(steps, grad=True)
    assert cache._buffers is None
    loss = sum((keys * (t + 1)).sum() + values.sum() for t, (keys, values, _, _) in enumerate(seen))
    loss.backward()
    for index, step in enumerate(steps):  # step `index` is in every later update's keys
        expected = sum(t + 1 for t in range(index, len(steps))) + (len(steps) - index)
        torch.testing.assert_close(step.grad, torch.full_like(step, float(expected)))


def test_keys_set_by_the_caller_are_extended_not_the_stale_buffer():
    generator = torch.Generator().manual_seed(1)
    steps = [torch.randn(1, 2, n, 4, generator=generator) for n in (2, 1)]
    _, cache = _appended(steps)
    replaced = torch.randn(1, 2, 5, 4, generator=generator)
    cache.keys, cache.values = replaced, replaced + 1
    new = torch.randn(1, 2, 1, 4, generator=generator)
    with torch.no_grad():
        keys, values = cache.update(new, new + 1)
    torch.testing.assert_close(keys, torch.cat([replaced, new], dim=-2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([replaced, new], dim=-2) + 1, rtol=0, atol=0)


def test_an_appending_cache_aligns_causality_as_its_docstring_says():
    """Query ``l`` is position ``P + l``: with an empty cache that is the uncached call's top-left
    causality, even where the call brings more keys than queries; after ``P`` cached keys each
    query hears keys ``<= P + l``."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(8, 2).double().eval()
    query, keys = torch.randn(1, 2, 8, dtype=torch.float64), torch.randn(1, 4, 8, dtype=torch.float64)
    uncached, _ = attention(query, keys, keys, is_causal=True)
    cache = KVCache()
    cached, _ = attention(query, keys, keys, is_causal=True, cache=cache)
    torch.testing.assert_close(cached, uncached)
    more = torch.randn(1, 3, 8, dtype=torch.float64)  # 4 cached keys, 3 new: 7 in all
    after, _ = attention(query, more, more, is_causal=True, cache=cache)
    allowed = torch.ones(2, 7, dtype=torch.bool).tril(4)  # query l hears keys <= 4 + l
    everything = torch.cat([keys, more], dim=1)
    expected, _ = attention(query, everything, everything, attn_mask=allowed)
    torch.testing.assert_close(after, expected)


@pytest.mark.parametrize(
    ("mask", "error", "says"),
    [
        (torch.ones(2, 2, dtype=torch.bool), ValueError, r"attn_mask of shape \(2, 2\) does not broadcast"),
        (torch.ones(2, 5, dtype=torch.long), TypeError, "attn_mask must be boolean"),
        ([[True]], TypeError, "attn_mask must be a tensor"),
    ],
)
def test_a_decoding_mask_is_checked_before_causality_shifts_it(mask, error, says):
    """With keys cached and is_causal=True the mask went to offset_causality unchecked: a mask of
    the new tokens only (the docstring asks for all P + S keys) gave 'size of tensor a (2) must
    match ... (5)', an integer mask an int64 overflow, a list an AttributeError."""
    from torchvote.nn.kv_cache import KVCache

    layer, cache = MultiHeadAttention(8, 2).eval(), KVCache()
    layer(torch.randn(2, 3, 8), is_causal=True, cache=cache)  # 3 keys cached
    with pytest.raises(error, match=says):
        layer(torch.randn(2, 2, 8), is_causal=True, cache=cache, attn_mask=mask)
    assert cache.length == 3  # refused before the cache took the new keys
    every_key = torch.ones(2, 5, dtype=torch.bool)
    assert layer(torch.randn(2, 2, 8), is_causal=True, cache=cache, attn_mask=every_key)[0].shape == (2, 2, 8)


def test_an_unbatched_call_on_a_growing_cache_takes_a_key_mask_over_the_cached_keys_too():
    # The unbatched check compared the mask with the new keys only: with 2 cached keys and 1 new,
    # a (3,) mask was refused ("(S,) = (1,)") while the decoder layer above asked for (3,).
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS).eval()
    x = torch.randn(3, EMBED)
    unbatched, batched = KVCache(), KVCache()
    module(x[:2], is_causal=True, cache=unbatched)
    module(x[None, :2], is_causal=True, cache=batched)
    key_mask = torch.tensor([False, True, True])  # the first cached key hidden
    out, _ = module(x[2:], is_causal=True, key_mask=key_mask, cache=unbatched)
    expected, _ = module(x[None, 2:], is_causal=True, key_mask=key_mask[None], cache=batched)
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"key_mask must have shape \(S,\) = \(4,\) for unbatched inputs"):
        module(x[2:], is_causal=True, key_mask=key_mask, cache=unbatched)  # 3 cached now, 1 new


def test_an_unbatched_call_on_a_growing_cache_takes_an_attention_mask_over_the_cached_keys_too():
    """Its shape error showed the logits with a batch of 1, ``(1, h, L, P + S)``."""
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS).eval()
    x = torch.randn(3, EMBED)
    unbatched, batched = KVCache(), KVCache()
    module(x[:2], cache=unbatched)
    module(x[None, :2], cache=batched)
    attn_mask = torch.tensor([[False, True, True]])  # (L, P + S): the first cached key hidden
    out, _ = module(x[2:], attn_mask=attn_mask, cache=unbatched)
    expected, _ = module(x[None, 2:], attn_mask=attn_mask, cache=batched)
    torch.testing.assert_close(out, expected[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match=re.escape(f"shape {(HEADS, 1, 4)} (heads, L, S) for unbatched")):
        module(x[2:], attn_mask=attn_mask, cache=unbatched)  # 3 cached now, 1 new


def test_an_unbatched_decoder_layer_on_a_cache_takes_its_target_key_mask_over_the_cached_tokens():
    from torchvote.nn import TransformerDecoderLayer

    torch.manual_seed(0)
    layer = TransformerDecoderLayer(EMBED, HEADS, dim_feedforward=16, dropout=0.0).eval()
    target, memory = torch.randn(3, EMBED), torch.randn(5, EMBED)
    cache = LayerCache()
    layer(target[:2], memory, cache=cache)
    out = layer(target[2:], memory, target_key_mask=torch.ones(3, dtype=torch.bool), cache=cache)
    whole = layer(target, memory)  # causal: the last position sees what the cached call saw
    torch.testing.assert_close(out, whole[2:], rtol=1e-5, atol=1e-6)


def test_a_shallow_copy_of_a_filled_static_cache_stays_static_and_filled():
    """A fork of a cross-attention cache holds the memory's keys: its next call projects the
    queries alone and attends to them (mutation review: a fork made a self-attention cache, which
    would append the memory again, went unnoticed)."""
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS).eval()
    memory, queries = torch.randn(2, 5, EMBED), torch.randn(2, 1, EMBED)
    cache = KVCache(static=True)
    module(torch.randn(2, 3, EMBED), memory, cache=cache)
    fork = copy.copy(cache)
    assert fork.static and fork.filled and fork.length == 5
    calls = []
    module.in_proj.register_forward_hook(lambda *args: calls.append(1))
    out, _ = module(queries, memory, cache=fork)
    assert len(calls) == 0 and fork.length == 5  # the memory's keys reused, none appended
    expected, _ = module(queries, memory)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_a_shallow_copy_of_a_cache_is_a_fork_of_its_own():
    """``copy.copy`` shared the growing buffer: the copy's next token overwrote the original's keys
    (0.16 off the uncached output), as forking a decode from one prefix does."""
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS).eval()
    x, other = torch.randn(1, 6, EMBED), torch.randn(1, 1, EMBED)
    with torch.no_grad():  # appends in place, into the buffer
        full, _ = module(x, is_causal=True)
        branched, _ = module(torch.cat([x[:, :4], other], dim=1), is_causal=True)
        cache = KVCache()
        module(x[:, :3], is_causal=True, cache=cache)
        module(x[:, 3:4], is_causal=True, cache=cache)  # the first append: the buffer is made
        fork = copy.copy(cache)
        module(x[:, 4:5], is_causal=True, cache=cache)
        forked, _ = module(other, is_causal=True, cache=fork)
        last, _ = module(x[:, 5:6], is_causal=True, cache=cache)
    torch.testing.assert_close(last, full[:, 5:6])
    torch.testing.assert_close(forked, branched[:, 4:5])
    assert (fork.length, cache.length) == (5, 6)
