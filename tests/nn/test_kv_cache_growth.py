"""The growth policy of an appending :class:`~torchvote.nn.kv_cache.KVCache` (found untested by a
mutation review): its buffers grow by half their size, at least 64 positions, so a long decode
reallocates a logarithmic number of times (amortised O(1) copies per token), not every 64 tokens."""

from __future__ import annotations

import torch

from torchvote.nn.kv_cache import KVCache


def _capacities_by_the_docstring(first: int, steps: int) -> list[int]:
    """The buffer sizes a cache allocates for ``first`` keys then ``steps`` single-token appends,
    by the documented rule: a full buffer is replaced by one of ``end + max(end // 2, 64)``."""
    held, capacities = first, [0]
    for _ in range(steps):
        end = held + 1
        if capacities[-1] < end:
            capacities.append(end + max(end // 2, 64))
        held = end
    return capacities[1:]


def test_a_long_decode_grows_its_buffers_by_half():
    """Guards ``capacity = end + max(end // 2, 64)``: 1000 appends without autograd allocate the
    buffers the documented rule gives (7 here; a fixed step of 64 positions would take about 16), and the
    keys held are still the concatenation of every step."""
    steps = [torch.full((1, 1, 1, 2), float(t)) for t in range(1001)]
    cache = KVCache()
    capacities = []
    with torch.no_grad():
        for keys in steps:
            cache.update(keys, keys)
            if cache._buffers is not None and cache._buffers[0].shape[-2] not in capacities:
                capacities.append(cache._buffers[0].shape[-2])
    expected = _capacities_by_the_docstring(1, 1000)
    assert capacities == expected and len(expected) == 7
    torch.testing.assert_close(cache.keys, torch.cat(steps, dim=-2), rtol=0, atol=0)
