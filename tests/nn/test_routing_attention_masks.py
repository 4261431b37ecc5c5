"""Regression: ``RoutingAttention(iterations=1)`` is ``MultiHeadAttention`` for every mask form.

Issue 7: the forward copied into ``RoutingAttention`` treated a broadcast ``(1, 1)`` mask (all
True, or a zero float mask) as a causal mask and differed from ``MultiHeadAttention`` by up to
1.0. Both modules accept the same masks; with the same weights (``load_state_dict``) and one pass
they must agree on the outputs and the weights, for every form.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from torchvote.nn import MultiHeadAttention, RoutingAttention

F64 = torch.float64
EMBED, HEADS, BATCH, LENGTH, SOURCE = 8, 2, 2, 5, 7


def _pair(**kwargs) -> tuple[MultiHeadAttention, RoutingAttention]:
    torch.manual_seed(0)
    softmax = MultiHeadAttention(EMBED, HEADS, **kwargs).double()
    with torch.no_grad():  # random biases, so a mis-used bias shows
        for parameter in softmax.parameters():
            if parameter.dim() == 1:
                parameter.normal_()
    routing = RoutingAttention(EMBED, HEADS, iterations=1, **kwargs).double()
    routing.load_state_dict(softmax.state_dict())
    return softmax.eval(), routing.eval()


def _causal(length: int) -> Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def _key_mask(batch: int, length: int) -> Tensor:
    key_mask = torch.ones(batch, length, dtype=torch.bool)
    key_mask[-1, -2:] = False
    return key_mask


def _mask_cases(length: int, source: int) -> dict[str, dict]:
    """Every mask form the two modules accept, as forward keyword arguments."""
    generator = torch.Generator().manual_seed(5)
    random_bool = torch.rand(length, source, generator=generator) > 0.3
    random_bool[:, 0] = True  # every query hears someone
    causal = _causal(length) if length == source else None
    cases: dict[str, dict] = {
        "none": {},
        "bool_LS": {"attn_mask": random_bool},
        "float_LS": {"attn_mask": torch.randn(length, source, generator=generator, dtype=F64)},
        "broadcast_true_bool_11": {"attn_mask": torch.ones(1, 1, dtype=torch.bool)},
        "broadcast_zero_float_11": {"attn_mask": torch.zeros(1, 1, dtype=F64)},
        "bool_bhLS": {
            "attn_mask": torch.rand(BATCH, HEADS, length, source, generator=generator) > 0.2
        },
        "float_b1LS": {"attn_mask": torch.randn(BATCH, 1, length, source, generator=generator, dtype=F64)},
        "key_mask": {"key_mask": _key_mask(BATCH, source)},
        "bool_LS_and_key_mask": {"attn_mask": random_bool, "key_mask": _key_mask(BATCH, source)},
        "float_LS_and_key_mask": {
            "attn_mask": torch.randn(length, source, generator=generator, dtype=F64),
            "key_mask": _key_mask(BATCH, source),
        },
        "broadcast_11_and_key_mask": {
            "attn_mask": torch.ones(1, 1, dtype=torch.bool),
            "key_mask": _key_mask(BATCH, source),
        },
    }
    if causal is not None:
        additive = torch.zeros(length, length, dtype=F64).masked_fill(~causal, float("-inf"))
        cases |= {
            "causal_bool_LS": {"attn_mask": causal},
            "causal_float_LS": {"attn_mask": additive},
            "is_causal": {"is_causal": True},
            "is_causal_and_key_mask": {"is_causal": True, "key_mask": _key_mask(BATCH, source)},
            "is_causal_and_bool_LS": {"is_causal": True, "attn_mask": random_bool},
            "is_causal_and_broadcast_11": {"is_causal": True, "attn_mask": torch.zeros(1, 1, dtype=F64)},
            "causal_bool_and_key_mask": {"attn_mask": causal, "key_mask": _key_mask(BATCH, source)},
        }
    return cases


SELF_CASES = sorted(_mask_cases(LENGTH, LENGTH))
CROSS_CASES = sorted(_mask_cases(LENGTH, SOURCE))


def _compare(softmax, routing, inputs, kwargs, need_weights: bool, average_weights: bool = True) -> None:
    options = {**kwargs, "need_weights": need_weights, "average_weights": average_weights}
    expected, expected_weights = softmax(*inputs, **options)
    output, weights = routing(*inputs, **options)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-12)
    if need_weights:
        torch.testing.assert_close(weights, expected_weights, rtol=1e-12, atol=1e-12)
    else:
        assert weights is None and expected_weights is None


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", SELF_CASES)
def test_self_attention_agrees_for_every_mask_form(case, need_weights):
    softmax, routing = _pair()
    x = torch.randn(BATCH, LENGTH, EMBED, dtype=F64, generator=torch.Generator().manual_seed(1))
    _compare(softmax, routing, (x,), _mask_cases(LENGTH, LENGTH)[case], need_weights)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", CROSS_CASES)
def test_cross_attention_agrees_for_every_mask_form(case, need_weights):
    softmax, routing = _pair()
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, LENGTH, EMBED, dtype=F64, generator=generator)
    memory = torch.randn(BATCH, SOURCE, EMBED, dtype=F64, generator=generator)
    _compare(softmax, routing, (x, memory, memory), _mask_cases(LENGTH, SOURCE)[case], need_weights)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize(
    "case", ["none", "broadcast_true_bool_11", "causal_float_LS", "is_causal_and_key_mask"]
)
def test_batch_first_false_agrees(case, need_weights):
    softmax, routing = _pair(batch_first=False)
    x = torch.randn(LENGTH, BATCH, EMBED, dtype=F64, generator=torch.Generator().manual_seed(3))
    _compare(softmax, routing, (x,), _mask_cases(LENGTH, LENGTH)[case], need_weights, average_weights=False)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"attn_mask": torch.ones(1, 1, dtype=torch.bool)},
        {"attn_mask": torch.zeros(1, 1, dtype=F64)},
        {"attn_mask": _causal(LENGTH)},
        {"is_causal": True},
        {"key_mask": torch.tensor([True, True, True, False, False])},
    ],
    ids=["none", "bool_11", "float_11", "causal_bool", "is_causal", "key_mask"],
)
def test_unbatched_input_agrees(kwargs, need_weights):
    softmax, routing = _pair()
    x = torch.randn(LENGTH, EMBED, dtype=F64, generator=torch.Generator().manual_seed(4))
    _compare(softmax, routing, (x,), kwargs, need_weights)
