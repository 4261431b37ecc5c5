"""The one mask preparation (functional/masks.py) against masks written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.functional import check_attention_mask, is_causal_mask, prepare_attention_mask
from torchvote.functional.masks import fused_kernel_mask, restrict_mask, voting_mask

SHAPE = (2, 3, 4, 4)  # (b, h, L, S)


def _causal(length=4):
    return torch.ones(length, length, dtype=torch.bool).tril()


def test_only_a_full_size_causal_mask_becomes_is_causal():
    mask, is_causal = prepare_attention_mask(_causal(), None, SHAPE)
    assert mask is None and is_causal
    additive = torch.zeros(4, 4).masked_fill(~_causal(), float("-inf"))
    assert prepare_attention_mask(additive, None, SHAPE) == (None, True)
    for broadcast in (torch.ones(1, 1, dtype=torch.bool), torch.zeros(1, 1)):
        mask, is_causal = prepare_attention_mask(broadcast, None, SHAPE)
        assert mask is broadcast and not is_causal  # "all allowed", not a 1x1 causal pattern


def test_key_mask_and_attention_mask_merge_without_expanding_the_heads():
    allowed = torch.rand(4, 4) > 0.3
    key_mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    mask, is_causal = prepare_attention_mask(allowed, key_mask, SHAPE, is_causal=True)
    assert is_causal and mask.shape == (2, 1, 4, 4)
    assert torch.equal(mask, allowed & key_mask[:, None, None, :])
    float_mask = torch.randn(4, 4)
    merged, _ = prepare_attention_mask(float_mask, key_mask, SHAPE)
    expected = float_mask.expand(2, 1, 4, 4).masked_fill(~key_mask[:, None, None, :], float("-inf"))
    assert torch.equal(merged, expected)


def test_receiver_mask_removes_receivers():
    receivers = torch.tensor([[True, True, False, False], [True, True, True, True]])
    mask, _ = prepare_attention_mask(None, None, SHAPE, receiver_mask=receivers)
    assert torch.equal(mask, receivers[:, None, :, None])


@pytest.mark.parametrize(("dtype", "expected"), [(torch.float16, torch.float32),
                                                 (torch.bfloat16, torch.float32),
                                                 (torch.float64, torch.float64)])
def test_float_masks_take_the_kernel_dtype(dtype, expected):
    mask, _ = prepare_attention_mask(torch.randn(4, 4, dtype=torch.float32), None, SHAPE, dtype=dtype)
    assert mask.dtype == expected


def test_fused_kernel_mask_folds_causality_into_a_given_mask():
    allowed = torch.rand(4, 4) > 0.3
    mask, is_causal = fused_kernel_mask(allowed, True, 4, 4, torch.float32)
    assert not is_causal and torch.equal(mask, allowed & _causal())
    float_mask, _ = fused_kernel_mask(torch.zeros(4, 4, dtype=torch.float64), False, 4, 4, torch.float32)
    assert float_mask.dtype == torch.float32
    assert fused_kernel_mask(None, True, 4, 4, torch.float32) == (None, True)


def test_voting_mask_is_boolean_and_includes_causality():
    causal = voting_mask(None, True, 3, 5, torch.device("cpu"))
    assert torch.equal(causal, torch.ones(3, 5, dtype=torch.bool).tril())
    assert voting_mask(torch.zeros(3, 5), False, 3, 5, torch.device("cpu")) is None  # floats are added
    with pytest.raises(TypeError, match="mask must be boolean"):
        voting_mask(torch.ones(3, 5, dtype=torch.int64), False, 3, 5, torch.device("cpu"))


def test_restrict_mask_keeps_the_mask_kind():
    allowed = torch.tensor([True, False])
    assert torch.equal(restrict_mask(None, allowed), allowed)
    assert torch.equal(restrict_mask(torch.tensor([True, True]), allowed), allowed)
    assert torch.equal(restrict_mask(torch.zeros(2), allowed), torch.tensor([0.0, float("-inf")]))


def test_moved_checks_are_still_exported_from_functional():
    assert is_causal_mask(_causal())
    with pytest.raises(ValueError, match="attn_mask of shape"):
        check_attention_mask(torch.ones(3, 5, dtype=torch.bool), SHAPE, "attn_mask")


def test_a_causal_mask_that_needs_a_gradient_stays_a_mask():
    """A learned float bias that starts as the causal pattern must get its gradient (run as
    ``is_causal`` it would drop out of the graph), as ``F.scaled_dot_product_attention`` gives it."""
    from torch.nn import functional as F

    from torchvote.functional import scaled_dot_product_attention

    start = torch.zeros(4, 4).masked_fill(~_causal(), float("-inf"))
    bias = start.clone().requires_grad_(True)
    mask, is_causal = prepare_attention_mask(bias, None, SHAPE)
    assert mask is bias and not is_causal
    query = torch.randn(2, 4, 3, dtype=torch.float64)
    scaled_dot_product_attention(query, query, query, attn_mask=bias)[0].square().sum().backward()
    reference = start.clone().double().requires_grad_(True)
    F.scaled_dot_product_attention(query, query, query, attn_mask=reference).square().sum().backward()
    assert bias.grad is not None and bias.grad.abs().sum() > 0
    torch.testing.assert_close(bias.grad, reference.grad.float())


def test_a_top_left_causal_mask_of_other_lengths_is_causal():
    for receivers, senders in ((3, 5), (5, 3)):
        lower = torch.ones(receivers, senders, dtype=torch.bool).tril()
        assert is_causal_mask(lower)
        assert is_causal_mask(torch.zeros(receivers, senders).masked_fill(~lower, float("-inf")))
        assert not is_causal_mask(torch.ones(receivers, senders, dtype=torch.bool).tril(1))
        shape = (2, 3, receivers, senders)
        assert prepare_attention_mask(lower, None, shape) == (None, True)


def test_fit_float16_mask_keeps_the_weights_of_masks_beyond_float16():
    """Rows shifted by a constant give the same softmax; nothing finite becomes -inf in float16."""
    from torchvote.functional.masks import fit_float16_mask

    inf = float("-inf")
    mask = torch.tensor([[0.0, -1e5, 0.0], [-7e4, -7.0001e4, inf], [inf, inf, inf], [-3.0, 2.0, -1e6]])
    fitted = fit_float16_mask(mask).half()
    assert torch.equal(torch.isneginf(fitted), torch.isneginf(mask))  # only -inf forbids
    logits = torch.randn(4, 3, dtype=torch.float64)
    rows = slice(0, 2), slice(3, 4)  # row 2 allows nothing
    for row in rows:
        expected = torch.softmax(logits[row] + mask[row].double(), dim=-1)
        torch.testing.assert_close(torch.softmax(logits[row] + fitted[row].double(), dim=-1), expected,
                                   atol=2e-3, rtol=0)  # float16 rounding of the shifted entries
    assert torch.equal(fitted[3], torch.tensor([-5.0, 0.0, torch.finfo(torch.float16).min]).half())


@pytest.mark.parametrize("need_weights", [False, True])
def test_float16_attention_with_a_float32_mask_below_float16s_range(need_weights):
    """A float32 mask row of -7e4 (shifted by a constant) must not turn into -inf in float16: the
    output is the float32 one, as ``F.scaled_dot_product_attention`` gives it."""
    from torch.nn import functional as F

    from torchvote.functional import scaled_dot_product_attention

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 2)
    mask = torch.tensor([[0.0, 0.0, 0.0], [-7e4, -7e4 - 2.0, -7e4]])
    out, _ = scaled_dot_product_attention(q.half(), k.half(), v.half(), attn_mask=mask,
                                          need_weights=need_weights)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out.float(), expected, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("autocast", [False, True], ids=["bfloat16", "autocast"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_bfloat16_attention_keeps_the_weights_of_a_float32_bias(need_weights, autocast):
    """A float32 bias near 200 (a learned offset) met bfloat16 logits rounded to 8 bits: spacing
    1.0 there, each weight off by up to e^0.5 (relative output error 0.19 fused, 0.21 with
    weights, 0.24 fused under autocast). Shifted to its row's largest entry first, it keeps
    bfloat16's own error."""
    from torchvote.functional import scaled_dot_product_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 32).bfloat16() for _ in range(3))
    mask = 200.0 + 2.0 * torch.randn(16, 16)
    logits = q.double() @ k.double().transpose(-1, -2) / math.sqrt(32) + mask.double()
    expected = torch.softmax(logits, dim=-1) @ v.double()  # float64 on the same bfloat16 inputs
    if autocast:  # float32 inputs, bfloat16 products
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                  need_weights=need_weights)
    else:
        out, _ = scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=need_weights)
    error = (out.double() - expected).abs().max() / expected.abs().max()
    assert error < 4 * 2.0**-8, float(error)  # a few of bfloat16's epsilons (measured 2.6e-3 to 5.7e-3)


def test_bfloat16_weights_with_a_float32_mask_blocking_by_its_lowest_value_are_finite():
    """Hugging Face's float32 masks block with finfo(float32).min, which is -inf in bfloat16: a
    row blocked everywhere by it gave NaN weights, outputs and gradients with need_weights."""
    from torchvote.functional import scaled_dot_product_attention

    torch.manual_seed(0)
    q = torch.randn(1, 2, 3, 8).bfloat16().requires_grad_(True)  # 3 queries, 4 keys
    k, v = (torch.randn(1, 2, 4, 8).bfloat16().requires_grad_(True) for _ in range(2))
    lowest = torch.finfo(torch.float32).min
    mask = torch.tensor([[lowest] * 4, [0.0, lowest, 0.0, lowest], [0.0] * 4])
    out, weights = scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=True)
    out.float().sum().backward()
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(weights).all())
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    assert bool((weights[..., 1, 1::2] == 0).all())  # what the mask blocks in a mixed row gets nothing
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(1, 2, 3), atol=1e-2, rtol=0)


def test_fit_mask_to_dtype_shifts_only_a_wider_mask_for_half_logits():
    from torchvote.functional.masks import fit_mask_to_dtype

    mask = torch.tensor([[200.0, 198.0, float("-inf")], [-3.4e38, -3.4e38, -3.4e38]])
    fitted = fit_mask_to_dtype(mask, torch.bfloat16)
    assert torch.equal(fitted, torch.tensor([[0.0, -2.0, float("-inf")], [0.0, 0.0, 0.0]]))
    assert fit_mask_to_dtype(mask, torch.float32) is mask  # float32 logits take it as it is
    assert fit_mask_to_dtype(mask.bfloat16(), torch.bfloat16).dtype == torch.bfloat16
    low = torch.tensor([[0.0, -1e6]]).bfloat16()  # a bfloat16 mask below float16's range
    assert float(fit_mask_to_dtype(low, torch.float16)[0, 1]) == torch.finfo(torch.float16).min


def test_open_rows_without_senders_with_no_senders_at_all():
    from torchvote.functional.masks import open_rows_without_senders

    for mask in (torch.ones(2, 3, 0, dtype=torch.bool), torch.zeros(2, 3, 0)):
        opened, dead = open_rows_without_senders(mask)
        assert opened.shape == (2, 3, 0) and dead.shape == (2, 3, 1) and bool(dead.all())
