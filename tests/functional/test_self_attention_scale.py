"""``self_attention``'s ``scale`` (found untested by a mutation review): the parameter-free
``softmax(X X^T / c) X`` with a given ``1 / c`` against the formula written out in float64."""

from __future__ import annotations

import pytest
import torch

from torchvote.functional import self_attention


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_self_attention_uses_the_given_scale(scale, need_weights):
    """Guards that ``scale`` reaches the attention (it was ignored for the default
    ``1 / sqrt(D)``, which these scales are not), with and without the weights returned."""
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    weights = torch.softmax(x @ x.transpose(-2, -1) * scale, dim=-1)  # (b, T, T)
    out, returned = self_attention(x, scale=scale, need_weights=need_weights)
    torch.testing.assert_close(out, weights @ x)
    if need_weights:
        torch.testing.assert_close(returned, weights)
    else:
        assert returned is None
