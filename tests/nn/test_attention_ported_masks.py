"""Masks written for torch.nn.MultiheadAttention (True = blocked) given to MultiHeadAttention:
``key_padding_mask=`` takes torch's padding mask as it is, and torch's causal ``attn_mask``
given without its ``~`` is warned about (it ran in silence, each query hearing only later keys)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from torchvote.nn import MultiHeadAttention

F64 = torch.float64


def _pair(seed: int = 0) -> tuple[MultiHeadAttention, nn.MultiheadAttention]:
    torch.manual_seed(seed)
    theirs = nn.MultiheadAttention(16, 4, batch_first=True, dtype=F64)
    with torch.no_grad():
        theirs.in_proj_bias.normal_()  # torch starts biases at zero: make them matter
    return MultiHeadAttention.from_torch(theirs), theirs


def test_key_padding_mask_is_read_as_torch_reads_it():
    ours, theirs = _pair()
    x = torch.randn(3, 5, 16, dtype=F64)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])  # True = pad
    expected, expected_weights = theirs(x, x, x, key_padding_mask=padding, need_weights=True)
    got, weights = ours(x, key_padding_mask=padding, need_weights=True)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(weights, expected_weights)
    assert torch.equal(got, ours(x, key_mask=~padding, need_weights=True)[0])  # as the documented ~


def test_key_padding_mask_beside_key_mask_or_as_floats_is_refused():
    ours, _ = _pair()
    x = torch.randn(2, 4, 16, dtype=F64)
    padding = torch.zeros(2, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match="give key_mask .* or key_padding_mask .* not both"):
        ours(x, key_mask=~padding, key_padding_mask=padding)
    with pytest.raises(TypeError, match=r"key_padding_mask must be a boolean tensor \(True = padding\)"):
        ours(x, key_padding_mask=torch.zeros(2, 4, dtype=F64))


def test_torchs_causal_mask_without_its_complement_is_warned_about():
    ours, theirs = _pair(1)
    x = torch.randn(2, 6, 16, dtype=F64)
    torch_causal = nn.Transformer.generate_square_subsequent_mask(6).isinf()  # True above the diagonal
    ported = "torch.nn.MultiheadAttention's causal mask.* is_causal=True"
    with pytest.warns(UserWarning, match=ported) as said:
        wrong, _ = ours(x, attn_mask=torch_causal)
    assert [record.filename for record in said] == [__file__]  # the user's line, not torch's Module.__call__
    assert torch.count_nonzero(wrong[:, -1] - ours.out_proj.bias) == 0  # the last query heard no key
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the complement, and masks of other shapes, warn nothing
        right, _ = ours(x, attn_mask=~torch_causal)
        ours(x, attn_mask=torch.ones(6, 6, dtype=torch.bool).triu(2))  # another pattern: as given
        ours(x[:, :1], x[:, :1], attn_mask=torch.zeros(1, 1, dtype=torch.bool))  # one query: no pattern
        ours(x, x[:, :1], attn_mask=torch.zeros(6, 1, dtype=torch.bool))  # one key: all blocked, as said
    torch.testing.assert_close(right, theirs(x, x, x, attn_mask=torch_causal, need_weights=False)[0])


def test_the_warning_comes_from_every_attention_that_takes_a_mask():
    """The scored attentions (Luong, Bahdanau) merge their masks without the multi-head path:
    torch's causal mask went through them unsaid."""
    from torchvote.nn import AdditiveAttention, LuongAttention

    query, key = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    torch_causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    for attention in (LuongAttention(8, 8, score="general"), AdditiveAttention(8, 8, hidden_dim=6)):
        with pytest.warns(UserWarning, match="True means blocked") as said:
            attention(query, key, attn_mask=torch_causal)
        assert [record.filename for record in said] == [__file__]
