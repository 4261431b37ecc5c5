"""A query with nothing to attend to gets a zero output and zero, finite gradients whatever the
fused kernel gives such a row.

``F.scaled_dot_product_attention`` returns zeros for it on this torch's CPU kernels, but NaN from
its math kernel before torch 2.5 and, for some versions, from CUDA's memory-efficient kernel
(pytorch/pytorch#110213), which the float64 device tests never reach (float64 runs on the math
kernel). So the kernel is replaced here by the plain formula, ``softmax(q k^T * scale + mask) v``,
which gives NaN for such a row as those kernels do, and torchvote's results are compared with the
same formula on the other rows.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchvote.functional import scaled_dot_product_attention
from torchvote.functional.masks import open_rows_without_senders
from torchvote.nn import MultiHeadAttention

F64 = torch.float64


def _plain_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """``F.scaled_dot_product_attention`` as the kernels that give NaN for a row with no key."""
    assert dropout_p == 0.0
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    logits = query @ key.transpose(-2, -1) * scale  # (..., i, j)
    if is_causal:
        logits = logits.masked_fill(~torch.ones_like(logits, dtype=torch.bool).tril(), float("-inf"))
    if attn_mask is not None:
        logits = logits.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else logits + attn_mask
    return torch.softmax(logits, dim=-1) @ value  # a row of -inf: NaN


@pytest.fixture
def nan_kernel(monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", _plain_kernel)
    q, nobody = torch.zeros(1, 2, 3), torch.zeros(2, 2, dtype=torch.bool)
    assert torch.isnan(F.scaled_dot_product_attention(q, q, q, attn_mask=nobody)).all()


def _qkv(seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 5, 4, dtype=F64, generator=generator).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("additive", [False, True])
def test_functional_attention_zeroes_the_row_under_a_kernel_that_gives_nan(nan_kernel, additive):
    allowed = torch.rand(5, 5, generator=torch.Generator().manual_seed(1)) > 0.4
    allowed[:, 0] = True
    allowed[2] = False  # query 2 hears nobody
    mask = allowed if not additive else torch.zeros(5, 5, dtype=F64).masked_fill(~allowed, float("-inf"))
    q, k, v = _qkv()
    output, _ = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    upstream = torch.randn(output.shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((output * upstream).sum(), (q, k, v))

    live = [0, 1, 3, 4]  # the reference on the rows that hear someone, zero on the other
    q2, k2, v2 = _qkv()
    expected = _plain_kernel(q2[:, live], k2, v2, attn_mask=allowed[live])
    expected_grads = torch.autograd.grad((expected * upstream[:, live]).sum(), (q2, k2, v2))
    torch.testing.assert_close(output[:, live], expected)
    assert torch.all(output[:, 2] == 0)
    for grad, reference in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference)  # the row gives no gradient: q[:, 2]'s is 0


def test_a_fully_padded_batch_item_of_multi_head_attention(nan_kernel):
    torch.manual_seed(0)
    module = MultiHeadAttention(8, 2, dtype=F64)
    x = torch.randn(2, 5, 8, dtype=F64, requires_grad=True)
    key_mask = torch.tensor([[True, True, True, False, False], [False] * 5])  # item 1: all padding
    output, _ = module(x, key_mask=key_mask)
    (grad,) = torch.autograd.grad(output.pow(2).sum(), x)
    torch.testing.assert_close(output[1], module.out_proj.bias.expand(5, 8))  # zero before out_proj
    assert torch.isfinite(grad).all() and torch.all(grad[1] == 0)
    first, _ = module(x[:1], key_mask=key_mask[:1])  # item 0 as if alone
    torch.testing.assert_close(output[0], first[0])


@pytest.mark.parametrize("additive", [False, True])
def test_open_rows_without_senders_opens_only_those_rows(additive):
    allowed = torch.rand(3, 4, 6, generator=torch.Generator().manual_seed(0)) > 0.5
    allowed[0, 1] = False
    allowed[2, 3] = False
    mask = allowed if not additive else torch.randn(3, 4, 6).masked_fill(~allowed, float("-inf"))
    opened, dead = open_rows_without_senders(mask)
    expected_dead = torch.tensor([[not row.any() for row in item] for item in allowed]).unsqueeze(-1)
    assert dead.shape == (3, 4, 1) and torch.equal(dead, expected_dead)
    assert opened.dtype == mask.dtype and opened.shape == mask.shape
    for item in range(3):
        for row in range(4):
            if dead[item, row]:
                assert (opened[item, row] == (0.0 if additive else True)).all()
            else:
                assert torch.equal(opened[item, row], mask[item, row])
