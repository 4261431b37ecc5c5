"""Hypothesis: torchvote.functional.scaled_dot_product_attention (which MultiHeadAttention runs on)
against F.scaled_dot_product_attention for generated shapes and masks, on both of its paths (the
fused kernel without weights, the voting loop with weights), and its weights against an explicit
softmax. Low-precision dtypes: large logits stay finite on the weights path."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from torchvote.functional import scaled_dot_product_attention

F64 = torch.float64


@st.composite
def attention_case(draw):
    batch_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    target_len, source_len = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    features, value_features = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    kind = draw(st.sampled_from(["none", "bool", "float", "causal", "bool+causal", "float+causal"]))
    logits_shape = (*batch_shape, target_len, source_len)
    # A broadcastable mask: each axis full or 1, possibly fewer leading axes.
    kept = draw(st.integers(2, len(logits_shape)))
    mask_shape = tuple(size if draw(st.booleans()) else 1 for size in logits_shape[-kept:])
    seed = draw(st.integers(0, 2**16))
    return batch_shape, target_len, source_len, features, value_features, kind, mask_shape, seed


def _reference_weights(query, key, mask, causal, scale):
    """softmax(q k^T * scale + mask) computed explicitly; rows with nothing allowed are zero."""
    logits = query @ key.transpose(-1, -2) * scale
    if mask is not None:
        logits = logits + mask if mask.is_floating_point() else logits.masked_fill(~mask, float("-inf"))
    if causal:
        lower = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
        logits = logits.masked_fill(~lower, float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


@settings(max_examples=30, deadline=None)
@given(attention_case(), st.booleans())
def test_matches_torch_sdpa(case, need_weights):
    batch_shape, target_len, source_len, features, value_features, kind, mask_shape, seed = case
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(*batch_shape, target_len, features, generator=generator, dtype=F64)
    key = torch.randn(*batch_shape, source_len, features, generator=generator, dtype=F64)
    value = torch.randn(*batch_shape, source_len, value_features, generator=generator, dtype=F64)
    mask = None
    if kind.startswith("bool"):
        mask = torch.rand(mask_shape, generator=generator) > 0.3
    elif kind.startswith("float"):
        mask = torch.randn(mask_shape, generator=generator, dtype=F64)
        mask[torch.rand(mask_shape, generator=generator) < 0.3] = float("-inf")
    causal = kind.endswith("causal")

    output, weights = scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                   is_causal=causal, need_weights=need_weights)

    # torch takes a mask or is_causal, not both: fold causality into the reference mask.
    reference_mask = mask
    if causal and mask is not None:
        lower = torch.ones(target_len, source_len, dtype=torch.bool).tril()
        reference_mask = mask & lower if mask.dtype == torch.bool else mask.masked_fill(~lower, float("-inf"))
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=reference_mask,
                                              is_causal=causal and mask is None)
    assert output.shape == expected.shape
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)
    if need_weights:
        reference = _reference_weights(query, key, mask, causal, features**-0.5)
        torch.testing.assert_close(weights, reference.expand(weights.shape), rtol=1e-10, atol=1e-12)
    else:
        assert weights is None


@pytest.mark.parametrize("need_weights", [False, True])
def test_a_3d_mask_broadcasts_as_torch_broadcasts_it(need_weights):
    # The functional attention's leading axes need not be (batch, heads): a (2, 1, 1) mask on
    # (2, 2, L, S) logits broadcasts over the second axis, as in F.scaled_dot_product_attention
    # (a refusal meant for MultiHeadAttention's (batch, heads) logits was applied here too).
    query, key, value = (torch.randn(2, 2, 3, 4, dtype=F64) for _ in range(3))
    mask = torch.tensor([True, False]).view(2, 1, 1)
    mask = mask | torch.eye(3, dtype=torch.bool)  # every row keeps one key
    output, _ = scaled_dot_product_attention(query, key, value, attn_mask=mask, need_weights=need_weights)
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_logits_low_precision_weights_path(dtype, half_logit_rounding):
    """Inputs x100 give logits ~1e4 (exp overflows half): finite weights that sum to one, off
    float64's logits by no more than the documented rounding of half logits, and outputs that are
    those weights' sums of the values; in rows decided beyond the rounding, float32's weights and
    the fused kernel's outputs."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 3, 7, 8, generator=generator).mul(100).to(dtype)
                         for _ in range(3))
    allowed = torch.rand(7, 7, generator=generator) > 0.3
    allowed[:, 0] = True
    output, weights = scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                                   need_weights=True)
    assert output.dtype == dtype and weights.dtype == dtype
    assert torch.isfinite(output).all() and torch.isfinite(weights).all()
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(2, 3, 7), rtol=0, atol=7 * eps)
    half_logit_rounding(weights, query, key, 8**-0.5, allowed)
    scale = value.float().abs().max().item()
    torch.testing.assert_close(output.float(), weights.float() @ value.float(), rtol=0, atol=4 * eps * scale)
    expected_weights = scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=allowed, need_weights=True)[1]
    # A row whose largest logit leads the next by more than both their rounding errors and
    # log(2 / eps) is one-hot to the dtype's precision, in half and in float32 alike.
    q, k = query.double(), key.double()
    logits = (8**-0.5 * q @ k.transpose(-2, -1)).masked_fill(~allowed, float("-inf"))
    errors = eps * 8**-0.5 * q.norm(dim=-1)[..., None] * k.norm(dim=-1)[..., None, :]  # (.., i, j)
    top = logits.topk(2, dim=-1).values
    decided = top[..., 0] - top[..., 1] > 2 * errors.amax(-1) + math.log(2 / eps)  # (2, 3, 7) rows
    same = ((weights.float() - expected_weights).abs() <= eps).all(-1)
    assert decided.any() and same[decided].all()
    expected_sdpa = F.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                   attn_mask=allowed)
    torch.testing.assert_close(output.float()[same], expected_sdpa[same], rtol=0, atol=4 * eps * scale)
