"""The one mask preparation (functional/masks.py) against masks written out by hand."""

from __future__ import annotations

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
