"""Functional attention against F.scaled_dot_product_attention and hand-written loops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchvote.functional import (
    additive_score,
    attend,
    concat_score,
    dot_score,
    general_score,
    is_causal_mask,
    scaled_dot_product_attention,
    scaled_dot_score,
    self_attention,
)


def qkv(batch=2, heads=3, length=5, source=7, features=4, value_features=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, length, features, generator=g, dtype=dtype)
    k = torch.randn(batch, heads, source, features, generator=g, dtype=dtype)
    v = torch.randn(batch, heads, source, value_features, generator=g, dtype=dtype)
    return q, k, v


def masks(length=5, source=7):
    g = torch.Generator().manual_seed(1)
    boolean = torch.rand(length, source, generator=g) > 0.3
    boolean[:, 0] = True  # every row keeps a key, so the reference has no NaN
    additive = torch.randn(2, 1, length, source, generator=g, dtype=torch.float64)
    additive[..., 1] = float("-inf")
    return {"none": None, "bool": boolean, "float": additive}


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_equals_pytorch_sdpa(mask_kind, is_causal, need_weights, scale):
    q, k, v = qkv()
    mask = masks()[mask_kind]
    got, weights = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                scale=scale, need_weights=need_weights)
    if mask is not None and is_causal:  # PyTorch takes one or the other: combine by hand
        causal = torch.ones(5, 7, dtype=torch.bool).tril()
        mask = mask & causal if mask.dtype == torch.bool else mask.masked_fill(~causal, -math.inf)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                  scale=scale)
    torch.testing.assert_close(got, expected)
    if need_weights:
        torch.testing.assert_close(weights @ v, expected)
        torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))
    else:
        assert weights is None


def test_weights_are_the_softmax_of_scaled_scores_by_hand():
    q, k, v = qkv(batch=1, heads=1, length=2, source=3, features=2, value_features=1)
    _, weights = scaled_dot_product_attention(q, k, v, need_weights=True)
    for i in range(2):
        scores = [float(q[0, 0, i] @ k[0, 0, j]) / math.sqrt(2) for j in range(3)]
        total = sum(math.exp(s) for s in scores)
        for j in range(3):
            assert weights[0, 0, i, j].item() == pytest.approx(math.exp(scores[j]) / total, rel=1e-12)


@pytest.mark.parametrize("need_weights", [False, True])
def test_a_query_with_nothing_to_attend_gives_zeros_and_finite_gradients(need_weights):
    q, k, v = (t.requires_grad_() for t in qkv())
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[3] = False
    out, _ = scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=need_weights)
    torch.testing.assert_close(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


def test_an_explicit_causal_mask_runs_as_is_causal(monkeypatch):
    seen = {}
    original = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    q, k, v = qkv(source=5)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    scaled_dot_product_attention(q, k, v, attn_mask=causal)
    assert seen["is_causal"] is True and seen["attn_mask"] is None


def test_a_one_by_one_mask_broadcasts_and_is_not_taken_for_causal():
    q, k, v = qkv(length=1, source=3)
    out, _ = scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_is_causal_mask_recognises_bool_and_float_forms_only():
    lower = torch.ones(4, 4, dtype=torch.bool).tril()
    additive = torch.zeros(4, 4).masked_fill(~lower, -math.inf)
    assert is_causal_mask(lower) and is_causal_mask(additive)
    assert not is_causal_mask(~lower)
    assert is_causal_mask(torch.ones(4, 5, dtype=torch.bool).tril())  # (L, S): top-left, as is_causal
    assert not is_causal_mask(torch.ones(4, 5, dtype=torch.bool).tril(1))
    assert not is_causal_mask(additive.masked_fill(~lower, -1e4))
    assert not is_causal_mask(lower.unsqueeze(0))


def _stack_with_a_read_counter(monkeypatch):
    """A 3-layer encoder in float64, eval mode, and a list that grows by one per read of a mask's
    values (``is_causal_mask``, one host wait on a GPU)."""
    from torchvote.functional import masks
    from torchvote.nn import TransformerConfig, TransformerEncoder

    reads = []
    real = masks.is_causal_mask
    monkeypatch.setattr(masks, "is_causal_mask", lambda mask: reads.append(1) or real(mask))
    torch.manual_seed(0)
    stack = TransformerEncoder(TransformerConfig(8, 2, dim_feedforward=16, dropout=0.0), 3).double().eval()
    return stack, reads


def test_a_square_mask_given_to_every_layer_is_read_once(monkeypatch):
    stack, reads = _stack_with_a_read_counter(monkeypatch)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    out = stack(x, attn_mask=mask)
    assert len(reads) == 1  # was one per layer
    torch.testing.assert_close(out, stack(x, is_causal=True))  # run as causality, as before
    stack(x, attn_mask=mask)
    assert len(reads) == 1  # the same tensor, unchanged: still known


def test_a_mask_changed_in_place_is_read_again(monkeypatch):
    stack, reads = _stack_with_a_read_counter(monkeypatch)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    causal = stack(x, attn_mask=mask)
    mask[0, 1] = True  # no longer causal: query 0 hears key 1
    changed = stack(x, attn_mask=mask)
    assert len(reads) == 2
    torch.testing.assert_close(changed, stack(x, attn_mask=mask.clone()))  # a new tensor: read afresh
    assert not torch.allclose(changed, causal)
    with torch.inference_mode():  # an inference tensor has no version: read on every call
        fresh = torch.ones(5, 5, dtype=torch.bool).tril()
        torch.testing.assert_close(stack(x, attn_mask=fresh), causal)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"attn_mask": torch.ones(5, 6, dtype=torch.bool)}, ValueError, "attn_mask of shape"),
        ({"attn_mask": torch.ones(5, 7, dtype=torch.int32)}, TypeError, "attn_mask must be boolean"),
        ({"attn_mask": torch.full((5, 7), math.nan, dtype=torch.float64)}, ValueError, "NaN"),
        ({"attn_mask": torch.full((5, 7), math.inf, dtype=torch.float64)}, ValueError, r"\+inf"),
    ],
)
def test_bad_masks_raise_clear_errors(kwargs, error, match):
    q, k, v = qkv()
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(q, k, v, **kwargs)


def test_bad_shapes_raise_clear_errors():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="feature size"):
        scaled_dot_product_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="same length"):
        scaled_dot_product_attention(q, k, v[..., :6, :])
    with pytest.raises(ValueError, match="query must have shape"):
        scaled_dot_product_attention(torch.randn(4), k, v)
    with pytest.raises(TypeError, match="floating point"):
        scaled_dot_product_attention(q.long(), k, v)
    with pytest.raises(TypeError, match="one dtype"):
        scaled_dot_product_attention(q, k.float(), v)
    with pytest.raises(ValueError, match="batch axes that broadcast"):
        scaled_dot_product_attention(q, k[:1].expand(3, -1, -1, -1), v[:1].expand(3, -1, -1, -1))
    with pytest.raises(ValueError, match="inputs must be a tensor of shape"):
        self_attention(torch.randn(8))
    with pytest.raises(TypeError, match=r"inputs must be a tensor of shape \(\.\.\., T, D\), got list"):
        self_attention([[1.0, 2.0]])  # a ValueError, where every other attention function says TypeError
    # Batch axes that broadcast are taken, as by torch's kernel.
    out, _ = scaled_dot_product_attention(q, k[:1], v[:1])
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k[:1].expand_as(k), v[:1].expand_as(v)))


def test_attend_refuses_integer_values_and_scores():
    # Integer values would make the weights integers too: every weight truncated to 0.
    scores = torch.randn(1, 2, 3)
    with pytest.raises(TypeError, match="value must be a floating-point tensor"):
        attend(scores, torch.tensor([[[1], [2], [3]]]))
    with pytest.raises(TypeError, match="scores must be a floating-point tensor"):
        attend(scores.long(), torch.randn(1, 3, 1))
    with pytest.raises(ValueError, match=r"scores must have shape \(\.\.\., L, S\)"):
        attend(torch.randn(5), torch.randn(5, 6))


def test_attend_with_no_keys_gives_zeros_like_the_fused_kernel():
    q, k, v = qkv(source=0)
    expected, _ = scaled_dot_product_attention(q, k, v)
    out, weights = attend(q @ k.transpose(-1, -2), v)
    assert weights.shape == (2, 3, 5, 0)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out, torch.zeros(2, 3, 5, 6, dtype=torch.float64))


def test_parameter_free_self_attention_is_softmax_xxt_over_c_times_x():
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    out, weights = self_attention(x, need_weights=True)
    reference = torch.softmax(x @ x.transpose(-1, -2) / 2.0, dim=-1) @ x  # c = sqrt(4)
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(weights @ x, out)


def test_score_functions_against_loops():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    k4 = k[..., :4]
    w_general = torch.randn(4, 6, generator=g, dtype=torch.float64)
    w_q = torch.randn(7, 4, generator=g, dtype=torch.float64)
    w_k = torch.randn(7, 6, generator=g, dtype=torch.float64)
    vec = torch.randn(7, generator=g, dtype=torch.float64)
    w_cat = torch.cat([w_q, w_k], dim=1)
    got = {
        "dot": dot_score(q, k4),
        "scaled": scaled_dot_score(q, k4),
        "general": general_score(q, k, w_general),
        "additive": additive_score(q, k, w_q, w_k, vec),
        "concat": concat_score(q, k, w_cat, vec),
    }
    for b in range(2):
        for i in range(3):
            for j in range(5):
                qi, kj = q[b, i], k[b, j]
                expected = {
                    "dot": qi @ kj[:4],
                    "scaled": qi @ kj[:4] / 2.0,
                    "general": qi @ w_general @ kj,
                    "additive": vec @ torch.tanh(w_q @ qi + w_k @ kj),
                    "concat": vec @ torch.tanh(w_cat @ torch.cat([qi, kj])),
                }
                for name, value in expected.items():
                    assert got[name][b, i, j].item() == pytest.approx(value.item(), rel=1e-12,
                                                                      abs=1e-12), name


def test_score_functions_reject_mismatched_weights():
    q, k = torch.randn(1, 2, 4), torch.randn(1, 3, 6)
    with pytest.raises(ValueError, match="weight must have shape"):
        general_score(q, k, torch.randn(6, 4))
    with pytest.raises(ValueError, match="key_weight"):
        additive_score(q, k, torch.randn(5, 4), torch.randn(5, 4), torch.randn(5))
    with pytest.raises(ValueError, match="weight must have shape"):
        concat_score(q, k, torch.randn(5, 9), torch.randn(5))
    with pytest.raises(ValueError, match="features to match"):
        dot_score(q, k)


def test_attend_with_additive_scores_and_padding():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    k = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    w_q, w_k = (torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    vec = torch.randn(6, generator=g, dtype=torch.float64)
    scores = additive_score(q, k, w_q, w_k, vec)
    key_is_real = torch.tensor([[True] * 5, [True, True, True, False, False]]).view(2, 1, 5)
    out, weights = attend(scores, k, attn_mask=key_is_real)
    expected_w = torch.softmax(scores.masked_fill(~key_is_real, -math.inf), dim=-1)
    torch.testing.assert_close(weights, expected_w)
    torch.testing.assert_close(out, expected_w @ k)
    with pytest.raises(ValueError, match="value must have shape"):
        attend(scores, k[:, :4])


@pytest.mark.parametrize("mask_dtype", [torch.float64, torch.float16])
def test_a_float_mask_of_another_dtype_works_on_both_paths(mask_dtype):
    q, k, v = (t.float() for t in qkv(source=5))
    mask = torch.zeros(5, 5, dtype=mask_dtype)
    mask[:, 3] = -math.inf
    fused, _ = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    looped, _ = scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=True)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.float())
    torch.testing.assert_close(fused, expected)
    torch.testing.assert_close(looped, expected)


@pytest.mark.parametrize("need_weights", [False, True])
def test_queries_and_keys_without_features_average_the_values_as_torch_does(need_weights):
    """``E = 0``: every dot product is 0, so the weights are uniform (the default scale
    ``1 / sqrt(E)`` would divide by zero)."""
    q, k, v = torch.randn(2, 3, 0), torch.randn(2, 4, 0), torch.randn(2, 4, 5)
    out, _ = scaled_dot_product_attention(q, k, v, need_weights=need_weights)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(out, v.mean(dim=1, keepdim=True).expand(2, 3, 5))
    assert torch.equal(scaled_dot_score(q, k), torch.zeros(2, 3, 4))


@pytest.mark.parametrize("mask", [torch.ones(3, 0, dtype=torch.bool), torch.zeros(3, 0)])
def test_no_keys_with_a_mask_gives_zeros(mask):
    q = torch.randn(2, 3, 4, requires_grad=True)
    k, v = torch.randn(2, 0, 4), torch.randn(2, 0, 5)
    for need_weights in (False, True):
        out, _ = scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=need_weights)
        assert out.shape == (2, 3, 5) and not out.any()
        (grad,) = torch.autograd.grad(out.sum(), q)
        assert not grad.any()


def test_concat_score_names_the_vector_or_weight_that_does_not_fit():
    q, k = torch.randn(2, 3), torch.randn(4, 3)
    # the hidden size H is read from the weight (H, Eq + Ek), whose width the inputs confirm: a
    # vector of another size is the vector's fault (it was blamed on the weight)
    with pytest.raises(ValueError, match=r"vector must have shape \(hidden,\) = \(7,\), the hidden size "
                                         r"of weight \(7, 6\), got \(8,\)"):
        concat_score(q, k, torch.randn(7, 6), torch.randn(8))
    with pytest.raises(ValueError, match=r"weight must have shape \(hidden, 6\), got \(7, 5\)"):
        concat_score(q, k, torch.randn(7, 5), torch.randn(7))
    with pytest.raises(TypeError, match="weight must be a floating-point tensor, got torch.int64"):
        concat_score(q, k, torch.ones(8, 6, dtype=torch.int64), torch.randn(8))
    with pytest.raises(ValueError, match=r"vector must have shape \(hidden,\)"):
        concat_score(q, k, torch.randn(8, 6), torch.randn(8, 1))
