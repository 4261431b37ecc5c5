"""The one-pass weights path, ``softmax_attention``, against a plain float64 recomputation.

The reference forms the logits, adds the mask, and normalises with an explicit
``exp(l - max) / sum`` in float64, giving rows with nothing to attend to zero weights; it shares
no code with the function under test. Every mask form, causality, rows with nothing to attend to,
autograd on and off (the in-place path), dropout, and half precision (logits in the half dtype,
as torch forms them, float16's clamped to its finite range) are covered.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchvote.functional import scaled_dot_product_attention, softmax_attention


def _inputs(dtype=torch.float64, batch=2, heads=3, length=6, source=7, features=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, n, features, generator=g).to(dtype)
                 for n in (length, source, source))


def _masks(length=6, source=7):
    """name -> (mask given to softmax_attention, boolean allowed, additive float or None)."""
    g = torch.Generator().manual_seed(1)
    allowed = torch.rand(length, source, generator=g) > 0.4
    allowed[2] = False  # a query with nothing to attend to
    key_mask = torch.ones(2, 1, 1, source, dtype=torch.bool)
    key_mask[1] = False  # a whole sequence of padding
    additive = torch.randn(length, source, generator=g, dtype=torch.float64)
    additive[~allowed] = float("-inf")
    return {
        "none": (None, None, None),
        "bool": (allowed, allowed, None),
        "key": (key_mask, key_mask, None),
        "float": (additive, allowed, additive.masked_fill(~allowed, 0.0)),
    }


def _reference(query, key, value, allowed, additive, causal, scale):
    logits = query.double() @ key.double().transpose(-2, -1) * scale  # (b, h, i, j)
    if additive is not None:
        logits = logits + additive
    ok = torch.ones_like(logits, dtype=torch.bool)
    if allowed is not None:
        ok = ok & allowed
    if causal:
        ok = ok & torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
    peak = logits.masked_fill(~ok, -1e300).amax(-1, keepdim=True)
    exp = torch.where(ok, torch.exp(logits.masked_fill(~ok, 0.0) - peak), 0.0)
    total = exp.sum(-1, keepdim=True)
    weights = torch.where(total > 0, exp / total.clamp_min(1e-300), 0.0)
    return weights @ value.double(), weights


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", ["none", "bool", "key", "float"])
def test_matches_the_plain_recomputation_with_finite_gradients(case, causal, grad):
    mask, allowed, additive = _masks()[case]
    query, key, value = (t.requires_grad_(grad) for t in _inputs())
    output, weights = softmax_attention(query, key, value, mask=mask, is_causal=causal, scale=0.4)
    expected, expected_weights = _reference(query, key, value, allowed, additive, causal, 0.4)
    torch.testing.assert_close(weights, expected_weights.expand(weights.shape), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-12)
    if grad:
        ours = torch.autograd.grad((output.sin().sum() + weights.cos().sum()), (query, key, value))
        theirs = torch.autograd.grad((expected.sin().sum() + expected_weights.cos().sum()),
                                     (query, key, value))
        for got, want in zip(ours, theirs, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_in_place_inference_equals_the_autograd_path():
    mask = _masks()["bool"][0]
    query, key, value = _inputs(torch.float32)
    with torch.inference_mode():
        fast = softmax_attention(query, key, value, mask=mask, is_causal=True)
    tracked = softmax_attention(query.requires_grad_(), key, value, mask=mask, is_causal=True)
    for a, b in zip(fast, tracked, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


def test_need_weights_of_the_functional_runs_this_path_and_equals_the_fused_output():
    query, key, value = _inputs(torch.float32)
    output, weights = scaled_dot_product_attention(query, key, value, is_causal=True, need_weights=True)
    expected = F.scaled_dot_product_attention(query, key, value, is_causal=True)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    assert weights.dtype == torch.float32 and weights.shape == (2, 3, 6, 7)


def test_dropout_returns_the_weights_before_dropout_and_drops_the_votes():
    query, key, value = _inputs(torch.float64)
    _, clean = softmax_attention(query, key, value)
    torch.manual_seed(5)
    output, weights = softmax_attention(query, key, value, dropout_p=0.5)
    torch.testing.assert_close(weights, clean)
    torch.manual_seed(5)
    torch.testing.assert_close(output, F.dropout(clean, p=0.5) @ value)
    with pytest.raises(ValueError, match="dropout_p"):
        softmax_attention(query, key, value, dropout_p=1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["none", "bool", "float"])
def test_half_precision_weights_and_gradients_follow_float32(dtype, case):
    """Logits in the half dtype, as torch forms them: at this scale (logits of order 1) the weights,
    outputs and gradients equal float32's on the same rounded inputs to the dtype's precision."""
    mask, _, _ = _masks(130, 9)[case]
    rounded = [t.to(dtype) for t in _inputs(torch.float32, length=130, source=9, seed=3)]
    half = [t.clone().requires_grad_() for t in rounded]
    full = [t.float().requires_grad_() for t in rounded]
    output, weights = softmax_attention(*half, mask=mask, is_causal=True)
    expected, expected_weights = softmax_attention(*full, mask=mask, is_causal=True)
    assert output.dtype == weights.dtype == dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(weights.float(), expected_weights, rtol=0, atol=eps)
    torch.testing.assert_close(output.float(), expected, rtol=0, atol=8 * eps * 3)
    g = torch.Generator().manual_seed(4)
    grad_out, grad_w = torch.randn(output.shape, generator=g), torch.randn(weights.shape, generator=g)
    ours = torch.autograd.grad((output * grad_out.to(dtype)).sum() + (weights * grad_w.to(dtype)).sum(), half)
    theirs = torch.autograd.grad((expected * grad_out).sum() + (expected_weights * grad_w).sum(), full)
    for got, want in zip(ours, theirs, strict=True):
        assert got.dtype == dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, rtol=0, atol=16 * eps * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spread", [1.0, 3.0, 30.0])
@pytest.mark.parametrize("case", ["none", "bool"])
def test_half_precision_weights_carry_only_the_documented_rounding(dtype, spread, case, half_logit_rounding):
    """Log ratios of the half weights against float64 logits of the same inputs, to the bound the
    docstring gives (``half_logit_rounding``): logits from about 1 to about 1e3."""
    mask, allowed, _ = _masks(40, 30)[case]
    query, key, value = (t.mul(spread).to(dtype) for t in _inputs(torch.float32, length=40, source=30,
                                                                     features=8, seed=7))
    scale = 8**-0.5
    _, weights = softmax_attention(query, key, value, mask=mask)
    assert weights.dtype == dtype
    assert half_logit_rounding(weights, query, key, scale, allowed) > 0


def test_float16_logits_past_its_range_are_clamped_not_nan():
    """q . k = 90000 and 89700 pass float16's 65504: torch's float16 logits are inf and the row
    NaN. Clamped to 65504 both, the row shares its weight between them (hand-computed), in float16
    and for float32 inputs under float16 autocast (whose logits are float16: that gave NaN)."""
    query = torch.tensor([[300.0, 0.0]])
    key = torch.tensor([[300.0, 0.0], [299.0, 0.0], [0.0, 1.0]])
    value = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    expected_weights = torch.tensor([[0.5, 0.5, 0.0]])
    half = [t.half().requires_grad_() for t in (query, key, value)]
    output, weights = softmax_attention(*half, scale=1.0)
    torch.testing.assert_close(weights.float(), expected_weights, rtol=0, atol=0)
    torch.testing.assert_close(output.float(), torch.tensor([[0.5, 0.5]]), rtol=0, atol=0)
    grads = torch.autograd.grad(output.float().sum() + weights.float()[0, 0], half)
    assert all(torch.isfinite(g).all() for g in grads)
    with torch.autocast("cpu", dtype=torch.float16):
        output, weights = softmax_attention(query, key, value, scale=1.0)
    assert weights.dtype == torch.float16
    torch.testing.assert_close(weights.float(), expected_weights, rtol=0, atol=0)
    torch.testing.assert_close(output.float(), torch.tensor([[0.5, 0.5]]), rtol=0, atol=0)
