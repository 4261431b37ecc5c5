"""Mutation review, round 3: :class:`~torchvote.nn.MultiHeadAttention`'s initial state against
``torch.nn.MultiheadAttention``'s, whose parameters it mirrors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchvote.nn import MultiHeadAttention
from torchvote.nn.kv_cache import KVCache


@pytest.mark.parametrize("kdim", [None, 6])
def test_a_fresh_module_starts_with_zero_biases_as_torchs_does(kdim):
    """Mutant: the output projection's bias left at ``nn.Linear``'s uniform draw. torch's module
    zeroes every bias at initialisation (``_reset_parameters``), so a fresh layer is the linear map
    of its heads and a query with nothing to attend to gives zeros; the projections' biases too."""
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(8, 2, kdim=kdim, vdim=kdim, batch_first=True)
    ours = MultiHeadAttention(8, 2, kdim=kdim, vdim=kdim)
    assert torch.count_nonzero(reference.out_proj.bias) == 0  # what torch does, checked
    assert torch.count_nonzero(ours.out_proj.bias) == 0
    for name, parameter in ours.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(parameter) == 0, name
    query = torch.randn(1, 3, 8)
    key = torch.randn(1, 4, 8 if kdim is None else kdim)
    nothing = torch.zeros(1, 4, dtype=torch.bool)  # every key padding: no query hears anything
    output, _ = ours(query, key, key, key_mask=nothing)
    torch.testing.assert_close(output, torch.zeros_like(output))


@pytest.mark.parametrize("options", [{}, {"kdim": 6, "vdim": 6}, {"shared_qkv": True}])
def test_a_filled_static_cache_projects_the_queries_with_their_bias(options):
    """Mutant: the queries of a filled static (cross-attention) cache projected without the
    packed projection's bias rows. A fresh module's biases are zero, so the cache tests, on fresh
    modules, passed; a trained decoder's are not. The reference is the same call without a cache,
    and torch's module with the same (non-zero) weights."""
    torch.manual_seed(0)
    module = MultiHeadAttention(8, 2, **options).eval()
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith("bias"):
                parameter.normal_()
    memory = torch.randn(2, 5, options.get("kdim", 8))
    cache = KVCache(static=True)
    for length in (3, 1, 2):  # the first call fills the cache, the later ones reuse it
        query = torch.randn(2, length, 8)
        out, _ = module(query, memory, cache=cache)
        expected, _ = module(query, memory)
        torch.testing.assert_close(out, expected)
    if not options:
        reference = nn.MultiheadAttention(8, 2, batch_first=True).eval()
        with torch.no_grad():
            reference.in_proj_weight.copy_(module.in_proj.weight)
            reference.in_proj_bias.copy_(module.in_proj.bias)
            reference.out_proj.weight.copy_(module.out_proj.weight)
            reference.out_proj.bias.copy_(module.out_proj.bias)
        torch.testing.assert_close(out, reference(query, memory, memory, need_weights=False)[0])
