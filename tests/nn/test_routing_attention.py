"""RoutingAttention against MultiHeadAttention (one pass) and a plain loop (several passes).

The reference below writes the iterative routing-style attention out the way the papers state it:
scaled dot-product logits (Vaswani et al. 2017, eq. 1), then for every pass a softmax per receiver
(or per sender), a weighted sum per receiver, and the dynamic-routing update ``b_ij += v_j . out_i``
(Sabour et al. 2017, Procedure 1), here scaled by ``1 / sqrt(d)``, one head and one query at a time.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from torchvote.nn import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer
from torchvote.nn.routing_attention import (
    RoutingAttention,
    attention_factory,
)

F64 = torch.float64
EMBED, HEADS = 8, 2


def _pair(iterations: int, **kwargs) -> tuple[MultiHeadAttention, RoutingAttention]:
    torch.manual_seed(0)
    softmax = MultiHeadAttention(EMBED, HEADS, **kwargs).double()
    with torch.no_grad():  # random biases, so a mis-used bias shows
        for parameter in softmax.parameters():
            if parameter.dim() == 1:
                parameter.normal_()
    routing = RoutingAttention(EMBED, HEADS, iterations=iterations, **kwargs).double()
    routing.load_state_dict(softmax.state_dict())
    return softmax.eval(), routing.eval()


def _padding_mask(batch: int, length: int) -> Tensor:
    key_mask = torch.ones(batch, length, dtype=torch.bool)
    key_mask[1, -2:] = False
    return key_mask


def _projections(module: RoutingAttention, query: Tensor, key: Tensor, value: Tensor):
    weight, bias = module.in_proj.weight, module.in_proj.bias
    q = query @ weight[:EMBED].T + bias[:EMBED]
    k = key @ weight[EMBED : 2 * EMBED].T + bias[EMBED : 2 * EMBED]
    v = value @ weight[2 * EMBED :].T + bias[2 * EMBED :]
    return q, k, v


def _softmax_or_zeros(logits: list[float], allowed: list[bool]) -> list[float]:
    """Softmax over the allowed entries; all zeros if none is allowed."""
    if not any(allowed):
        return [0.0] * len(logits)
    peak = max(x for x, a in zip(logits, allowed, strict=True) if a)
    exps = [math.exp(x - peak) if a else 0.0 for x, a in zip(logits, allowed, strict=True)]
    total = sum(exps)
    return [e / total for e in exps]


@torch.no_grad()
def reference_routing_attention(
    module: RoutingAttention,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    key_mask: Tensor | None = None,
    is_causal: bool = False,
    mask_receivers: bool = False,
) -> tuple[Tensor, Tensor]:
    """Output ``(b, L, E)`` and the last pass's normalised weights ``(b, h, L, S)`` (before the
    renormalisation of ``aggregation="mean"``), one head and query at a time."""
    q, k, v = _projections(module, query, key, value)
    batch, target_len, source_len = query.shape[0], query.shape[1], key.shape[1]
    head_dim = EMBED // HEADS
    scale = 1.0 / math.sqrt(head_dim)
    heads_out = torch.zeros(batch, target_len, EMBED, dtype=F64)
    last_weights = torch.zeros(batch, HEADS, target_len, source_len, dtype=F64)
    for n in range(batch):
        for h in range(HEADS):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            qh, kh, vh = q[n, :, cols], k[n, :, cols], v[n, :, cols]
            allowed = [[True] * source_len for _ in range(target_len)]
            for i in range(target_len):
                for j in range(source_len):
                    if key_mask is not None and not key_mask[n, j]:
                        allowed[i][j] = False
                    if mask_receivers and key_mask is not None and not key_mask[n, i]:
                        allowed[i][j] = False
                    if is_causal and j > i:
                        allowed[i][j] = False
            logits = [[float(qh[i] @ kh[j]) * scale for j in range(source_len)] for i in range(target_len)]
            for t in range(module.iterations):
                weights = [[0.0] * source_len for _ in range(target_len)]
                if module.normalize_over == "senders":
                    for i in range(target_len):
                        weights[i] = _softmax_or_zeros(logits[i], allowed[i])
                else:
                    for j in range(source_len):
                        column = _softmax_or_zeros(
                            [logits[i][j] for i in range(target_len)],
                            [allowed[i][j] for i in range(target_len)],
                        )
                        for i in range(target_len):
                            weights[i][j] = column[i]
                used = [row[:] for row in weights]  # the weights the votes are summed with
                if module.aggregation == "mean":  # Locatello et al. 2020: 1e-8 on each allowed weight
                    for i in range(target_len):
                        used[i] = [w + 1e-8 if allowed[i][j] else w for j, w in enumerate(used[i])]
                        total = sum(used[i])
                        if total > 0:
                            used[i] = [w / total for w in used[i]]
                outputs = [
                    sum((used[i][j] * vh[j] for j in range(source_len)), torch.zeros(head_dim, dtype=F64))
                    for i in range(target_len)
                ]
                if t < module.iterations - 1:
                    for i in range(target_len):
                        for j in range(source_len):
                            if allowed[i][j]:
                                logits[i][j] += float(vh[j] @ outputs[i]) * scale
            for i in range(target_len):
                heads_out[n, i, cols] = outputs[i]
                last_weights[n, h, i] = torch.tensor(weights[i], dtype=F64)
    output = heads_out @ module.out_proj.weight.T + module.out_proj.bias
    return output, last_weights


# --- one pass is multi-head attention, exactly ---------------------------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", ["self", "key_mask", "causal", "causal_and_key_mask", "cross", "float_mask"])
def test_one_iteration_equals_multi_head_attention_exactly(case, need_weights):
    softmax, routing = _pair(1)
    torch.manual_seed(1)
    x = torch.randn(2, 5, EMBED, dtype=F64)
    memory = torch.randn(2, 7, EMBED, dtype=F64)
    kwargs: dict = {"need_weights": need_weights}
    inputs: tuple = (x,)
    if case == "key_mask":
        kwargs["key_mask"] = _padding_mask(2, 5)
    elif case == "causal":
        kwargs["is_causal"] = True
    elif case == "causal_and_key_mask":
        kwargs |= {"is_causal": True, "key_mask": _padding_mask(2, 5)}
    elif case == "cross":
        inputs = (x, memory, memory)
        kwargs["key_mask"] = _padding_mask(2, 7)
    elif case == "float_mask":
        kwargs["attn_mask"] = torch.randn(5, 5, dtype=F64)
    expected, expected_weights = softmax(*inputs, **kwargs)
    output, weights = routing(*inputs, **kwargs)
    assert torch.equal(output, expected)
    if need_weights:
        assert torch.equal(weights, expected_weights)
    else:
        assert weights is None and expected_weights is None


@pytest.mark.parametrize(
    "options", [{"shared_qkv": True}, {"kdim": 6, "vdim": 3}, {"batch_first": False}, {"bias": False}]
)
def test_one_iteration_equals_multi_head_attention_for_every_projection(options):
    softmax, routing = _pair(1, **options)
    torch.manual_seed(2)
    x = torch.randn(3, 2, EMBED, dtype=F64)
    key = torch.randn(3, 2, options.get("kdim", EMBED), dtype=F64)
    value = torch.randn(3, 2, options.get("vdim", EMBED), dtype=F64)
    expected, _ = softmax(x, key, value)
    output, _ = routing(x, key, value)
    assert torch.equal(output, expected)


def test_state_dicts_are_interchangeable_both_ways():
    softmax, routing = _pair(3)
    assert softmax.state_dict().keys() == routing.state_dict().keys()
    softmax.load_state_dict(routing.state_dict())


# --- regression (issue 7): one pass equals MultiHeadAttention for every mask form ----------------
# The forward once copied into RoutingAttention took a broadcast (1, 1) mask (all True, or a zero
# float mask) for a causal one and differed by up to 1.0. Both modules accept the same masks; with
# the same weights and one pass they agree on outputs and weights for every form.

BATCH, LENGTH, SOURCE = 2, 5, 7


def _causal(length: int) -> Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


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
        "key_mask": {"key_mask": _padding_mask(BATCH, source)},
        "bool_LS_and_key_mask": {"attn_mask": random_bool, "key_mask": _padding_mask(BATCH, source)},
        "float_LS_and_key_mask": {
            "attn_mask": torch.randn(length, source, generator=generator, dtype=F64),
            "key_mask": _padding_mask(BATCH, source),
        },
        "broadcast_11_and_key_mask": {
            "attn_mask": torch.ones(1, 1, dtype=torch.bool),
            "key_mask": _padding_mask(BATCH, source),
        },
    }
    if causal is not None:
        additive = torch.zeros(length, length, dtype=F64).masked_fill(~causal, float("-inf"))
        cases |= {
            "causal_bool_LS": {"attn_mask": causal},
            "causal_float_LS": {"attn_mask": additive},
            "is_causal": {"is_causal": True},
            "is_causal_and_key_mask": {"is_causal": True, "key_mask": _padding_mask(BATCH, source)},
            "is_causal_and_bool_LS": {"is_causal": True, "attn_mask": random_bool},
            "is_causal_and_broadcast_11": {"is_causal": True, "attn_mask": torch.zeros(1, 1, dtype=F64)},
            "causal_bool_and_key_mask": {"attn_mask": causal, "key_mask": _padding_mask(BATCH, source)},
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
    softmax, routing = _pair(1)
    x = torch.randn(BATCH, LENGTH, EMBED, dtype=F64, generator=torch.Generator().manual_seed(1))
    _compare(softmax, routing, (x,), _mask_cases(LENGTH, LENGTH)[case], need_weights)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", CROSS_CASES)
def test_cross_attention_agrees_for_every_mask_form(case, need_weights):
    softmax, routing = _pair(1)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, LENGTH, EMBED, dtype=F64, generator=generator)
    memory = torch.randn(BATCH, SOURCE, EMBED, dtype=F64, generator=generator)
    _compare(softmax, routing, (x, memory, memory), _mask_cases(LENGTH, SOURCE)[case], need_weights)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize(
    "case", ["none", "broadcast_true_bool_11", "causal_float_LS", "is_causal_and_key_mask"]
)
def test_batch_first_false_agrees(case, need_weights):
    softmax, routing = _pair(1, batch_first=False)
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
    softmax, routing = _pair(1)
    x = torch.randn(LENGTH, EMBED, dtype=F64, generator=torch.Generator().manual_seed(4))
    _compare(softmax, routing, (x,), kwargs, need_weights)


# --- several passes against the plain loop -------------------------------------------------------


@pytest.mark.parametrize("iterations", [1, 2, 3])
@pytest.mark.parametrize("masking", ["none", "key_mask", "causal", "causal_and_key_mask"])
def test_senders_match_the_plain_loop(iterations, masking):
    _, routing = _pair(iterations)
    torch.manual_seed(3)
    x = torch.randn(2, 5, EMBED, dtype=F64)
    key_mask = _padding_mask(2, 5) if "key_mask" in masking else None
    is_causal = "causal" in masking
    output, weights = routing(
        x, key_mask=key_mask, is_causal=is_causal, need_weights=True, average_weights=False
    )
    expected, expected_weights = reference_routing_attention(
        routing, x, x, x, key_mask=key_mask, is_causal=is_causal
    )
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("aggregation", ["sum", "mean"])
@pytest.mark.parametrize("iterations", [1, 3])
@pytest.mark.parametrize("padded", [False, True])
def test_receivers_match_the_plain_loop(iterations, aggregation, padded):
    torch.manual_seed(0)
    routing = (
        RoutingAttention(
            EMBED, HEADS, iterations=iterations, normalize_over="receivers", aggregation=aggregation
        )
        .double()
        .eval()
    )
    torch.manual_seed(4)
    x = torch.randn(2, 5, EMBED, dtype=F64)
    key_mask = _padding_mask(2, 5) if padded else None
    output, weights = routing(x, key_mask=key_mask, need_weights=True, average_weights=False)
    expected, expected_weights = reference_routing_attention(
        routing, x, x, x, key_mask=key_mask, mask_receivers=True
    )
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-10)


def test_cross_attention_matches_the_plain_loop():
    _, routing = _pair(3)
    torch.manual_seed(5)
    x, memory = torch.randn(2, 3, EMBED, dtype=F64), torch.randn(2, 6, EMBED, dtype=F64)
    key_mask = _padding_mask(2, 6)
    output, _ = routing(x, memory, memory, key_mask=key_mask)
    expected, _ = reference_routing_attention(routing, x, memory, memory, key_mask=key_mask)
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)


# --- properties ----------------------------------------------------------------------------------


def test_more_iterations_give_a_different_consensus():
    softmax, routing = _pair(3)
    x = torch.randn(2, 5, EMBED, dtype=F64)
    assert not torch.allclose(routing(x)[0], softmax(x)[0], atol=1e-6)


@pytest.mark.parametrize("iterations", [2, 4])
def test_causal_routing_never_hears_the_future(iterations):
    _, routing = _pair(iterations)
    x = torch.randn(2, 6, EMBED, dtype=F64)
    changed = x.clone()
    changed[:, 4:] = torch.randn(2, 2, EMBED, dtype=F64)
    before, after = routing(x, is_causal=True)[0], routing(changed, is_causal=True)[0]
    torch.testing.assert_close(after[:, :4], before[:, :4], rtol=0, atol=1e-12)
    assert not torch.allclose(after[:, 4:], before[:, 4:])


@pytest.mark.parametrize("normalize_over", ["senders", "receivers"])
def test_appended_padding_changes_no_real_output(normalize_over):
    torch.manual_seed(0)
    routing = RoutingAttention(EMBED, HEADS, iterations=3, normalize_over=normalize_over).double().eval()
    x = torch.randn(2, 4, EMBED, dtype=F64)
    padded = torch.cat([x, torch.randn(2, 3, EMBED, dtype=F64)], dim=1)  # (2, 7, E)
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[:, 4:] = False
    torch.testing.assert_close(
        routing(padded, key_mask=key_mask)[0][:, :4], routing(x)[0], rtol=1e-10, atol=1e-10
    )


def test_weights_of_the_last_pass_sum_to_one_over_the_allowed_senders():
    _, routing = _pair(3)
    x = torch.randn(2, 5, EMBED, dtype=F64)
    key_mask = _padding_mask(2, 5)
    _, per_head = routing(x, key_mask=key_mask, is_causal=True, need_weights=True, average_weights=False)
    _, averaged = routing(x, key_mask=key_mask, is_causal=True, need_weights=True)
    assert per_head.shape == (2, HEADS, 5, 5) and averaged.shape == (2, 5, 5)
    torch.testing.assert_close(averaged, per_head.mean(dim=1))
    torch.testing.assert_close(per_head.sum(-1), torch.ones(2, HEADS, 5, dtype=F64))
    assert (per_head.triu(1) == 0).all() and (per_head[1, ..., -2:] == 0).all()


def test_unbatched_inputs_lose_the_batch_axis_again():
    _, routing = _pair(2)
    x = torch.randn(5, EMBED, dtype=F64)
    output, weights = routing(x, key_mask=torch.tensor([True] * 4 + [False]), need_weights=True)
    batched, batched_weights = routing(
        x[None], key_mask=torch.tensor([[True] * 4 + [False]]), need_weights=True
    )
    assert output.shape == (5, EMBED) and weights.shape == (5, 5)
    torch.testing.assert_close(output, batched[0])
    torch.testing.assert_close(weights, batched_weights[0])


def test_gradients_are_finite_when_a_query_hears_nobody():
    _, routing = _pair(3)
    x = torch.randn(1, 3, EMBED, dtype=F64, requires_grad=True)
    attn_mask = torch.tensor([[False, False, False], [True, True, False], [True, True, True]])
    output, _ = routing(x, attn_mask=attn_mask)
    output.pow(2).sum().backward()
    assert torch.isfinite(output).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(output[0, 0], routing.out_proj.bias)  # nobody to hear: the bias


def test_dropout_acts_in_training_mode_only():
    torch.manual_seed(0)
    routing = RoutingAttention(EMBED, HEADS, iterations=2, dropout=0.5).double()
    x = torch.randn(2, 5, EMBED, dtype=F64)
    assert not torch.equal(routing(x)[0], routing(x)[0])
    routing.eval()
    assert torch.equal(routing(x)[0], routing(x)[0])


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"iterations": 0}, "iterations"),
        ({"iterations": 2.0}, "iterations"),
        ({"iterations": True}, "iterations"),
        ({"normalize_over": "keys"}, "normalize_over"),
        ({"aggregation": "max"}, "aggregation"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_bad_arguments_raise_value_errors_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        RoutingAttention(EMBED, HEADS, **kwargs)
    with pytest.raises(ValueError, match="divisible"):
        RoutingAttention(EMBED, 3)


def test_receivers_refuse_causal_attention():
    routing = RoutingAttention(EMBED, HEADS, normalize_over="receivers")
    with pytest.raises(ValueError, match="normalize_over='senders'"):
        routing(torch.randn(1, 3, EMBED), is_causal=True)


@pytest.mark.parametrize("form", ["bool", "float"])
def test_receivers_refuse_a_causal_mask_as_they_refuse_is_causal(form):
    # A causal (L, S) mask is causality given another way; over the receivers it cannot hold: the
    # last position would still change the first one's output.
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()
    mask = allowed if form == "bool" else torch.zeros(4, 4).masked_fill(~allowed, float("-inf"))
    routing = RoutingAttention(EMBED, HEADS, normalize_over="receivers")
    with pytest.raises(ValueError, match="blocks every later key"):
        routing(torch.randn(1, 4, EMBED), attn_mask=mask)
    memory = torch.randn(1, 6, EMBED)  # cross-attention: a causal (4, 6) mask, top-left as is_causal
    with pytest.raises(ValueError, match="blocks every later key"):
        routing(torch.randn(1, 4, EMBED), memory, attn_mask=torch.ones(4, 6, dtype=torch.bool).tril())
    # It was found only alone and 2-D: beside a key_mask (merged into a (b, 1, L, S) mask), or as
    # (1, 1, L, S), it was taken and position 4 changed position 0's output.
    with pytest.raises(ValueError, match="blocks every later key"):
        routing(torch.randn(2, 4, EMBED), attn_mask=mask, key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="blocks every later key"):
        routing(torch.randn(1, 4, EMBED), attn_mask=mask[None, None])
    # A mask that is not causal is taken, and the senders' normalisation takes the causal one.
    routing(torch.randn(1, 4, EMBED), attn_mask=~allowed | torch.eye(4, dtype=torch.bool))
    routing(torch.randn(2, 4, EMBED), attn_mask=torch.ones(2, HEADS, 4, 4, dtype=torch.bool))
    # and a smaller mask that broadcasts is no causal one (a first version read its last two axes)
    for small in (torch.ones(1, 1, dtype=torch.bool), torch.tensor([[True, False, False, False]]),
                  torch.tensor([True, False, False, False]).view(1, 1, 1, 4)):
        routing(torch.randn(1, 4, EMBED), attn_mask=small)
    RoutingAttention(EMBED, HEADS)(torch.randn(1, 4, EMBED), attn_mask=mask)


# -1e4 as bfloat16 stores it: -9984
_BF16_MINUS_1E4 = float(torch.tensor(-1e4, dtype=torch.bfloat16))


@pytest.mark.parametrize("blocked", [-1e4, _BF16_MINUS_1E4, -1e9, torch.finfo(torch.float32).min, "learned"])
def test_receivers_refuse_a_causal_mask_of_finite_or_learned_blocks(blocked):
    """HF/BERT-style causal masks (``-1e4``, ``-1e9``, ``finfo.min`` above the diagonal) and a
    causal ``-inf`` mask plus a learned bias were taken, and the last token moved the first
    output (review finding)."""
    later = torch.ones(4, 4, dtype=torch.bool).triu(1)
    if blocked == "learned":
        bias = torch.randn(4, 4, requires_grad=True)
        mask = torch.zeros(4, 4).masked_fill(later, float("-inf")) + bias
    else:
        mask = torch.zeros(4, 4).masked_fill(later, blocked)
    routing = RoutingAttention(EMBED, HEADS, normalize_over="receivers")
    with pytest.raises(ValueError, match="blocks every later key"):
        routing(torch.randn(1, 4, EMBED), attn_mask=mask)
    # a mild finite bias blocks nothing: taken
    routing(torch.randn(1, 4, EMBED), attn_mask=torch.zeros(4, 4).masked_fill(later, -50.0))


def test_receivers_refuse_every_mask_that_orders_the_positions():
    # A causal mask merged with padding, given per example or as a sliding window was taken, and a
    # later position changed an earlier one's output (review finding).
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    padded = causal & torch.tensor([True, True, True, False])
    window = causal & ~torch.ones(4, 4, dtype=torch.bool).tril(-2)  # the last two positions
    routing = RoutingAttention(EMBED, HEADS, normalize_over="receivers")
    for mask in (padded, causal.expand(2, 1, 4, 4).clone(), window, padded & padded[:, :, None].any(-1)):
        with pytest.raises(ValueError, match="blocks every later key"):
            routing(torch.randn(2, 4, EMBED), attn_mask=mask)
    # A key-padding pattern (the same row for every query) orders nothing and is taken.
    routing(torch.randn(1, 4, EMBED), attn_mask=torch.tensor([True, True, False, False]).expand(4, 4))


def test_receivers_outputs_are_causal_under_every_ordering_mask_they_take():
    # Property over random masks that block every later key and differ between queries: either
    # refused, or no later position moves an earlier output (a key heard by one query only).
    torch.manual_seed(0)
    routing = RoutingAttention(EMBED, HEADS, iterations=2, normalize_over="receivers")
    later = torch.ones(4, 4, dtype=torch.bool).triu(1)
    taken = 0
    for _ in range(200):
        mask = (torch.rand(4, 4) < 0.5) & ~later  # (i, j): j <= i only
        if (mask == mask[:1]).all():
            continue
        x = torch.randn(1, 4, EMBED)
        try:
            before = routing(x, attn_mask=mask)[0]
        except ValueError:
            continue
        taken += 1
        for position in range(1, 4):
            edited = x.clone()
            edited[0, position:] += 3.0
            after = routing(edited, attn_mask=mask)[0]
            torch.testing.assert_close(after[0, :position], before[0, :position])
    assert taken > 0  # the property was tested on some masks (each key heard by one query)


def test_bad_inputs_are_reported_as_by_multi_head_attention():
    routing = RoutingAttention(EMBED, HEADS)
    with pytest.raises(ValueError, match="key_mask must have shape"):
        routing(torch.randn(2, 3, EMBED), key_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="features"):
        routing(torch.randn(2, 3, EMBED + 1))


# --- the transformer hook and the returned record --------------------------------------------------------


def test_attention_factory_builds_either_kind_for_the_transformer_layers():
    softmax_layer = TransformerEncoderLayer(EMBED, HEADS, attention=attention_factory("softmax"))
    routing_layer = TransformerEncoderLayer(
        EMBED, HEADS, attention=attention_factory("routing", iterations=4)
    )
    assert type(softmax_layer.self_attention) is MultiHeadAttention
    assert isinstance(routing_layer.self_attention, RoutingAttention)
    assert routing_layer.self_attention.iterations == 4
    assert softmax_layer.state_dict().keys() == routing_layer.state_dict().keys()
    x = torch.randn(2, 5, EMBED)
    assert routing_layer(x, is_causal=True).shape == (2, 5, EMBED)
    with pytest.raises(ValueError, match="kind"):
        attention_factory("linear")
    with pytest.raises(ValueError, match="iterations"):
        attention_factory("routing", iterations=0)


def test_attention_factory_passes_the_normalisation_and_refuses_it_for_softmax():
    layer = TransformerEncoderLayer(
        EMBED, HEADS, attention=attention_factory("routing", iterations=2, normalize_over="receivers")
    )
    assert layer.self_attention.normalize_over == "receivers"
    assert attention_factory("routing")(EMBED, HEADS, dropout=0.0).normalize_over == "senders"
    with pytest.raises(ValueError, match="normalize_over='receivers' needs kind='routing'"):
        attention_factory("softmax", normalize_over="receivers")
    # iterations given to softmax attention were dropped without a word (review finding)
    with pytest.raises(ValueError, match="iterations=2 needs kind='routing'"):
        attention_factory("softmax", iterations=2)
    assert attention_factory("routing")(EMBED, HEADS, dropout=0.0).iterations == 3
    with pytest.raises(ValueError, match="normalize_over"):
        attention_factory("routing", normalize_over="keys")


def test_returned_record_collects_every_attention_without_hooks():
    torch.manual_seed(0)
    layers = iter([
        TransformerEncoderLayer(EMBED, HEADS, dropout=0.0, attention=attention_factory("routing")),
        TransformerEncoderLayer(EMBED, HEADS, dropout=0.0),
    ])
    stack = TransformerEncoder(lambda: next(layers), 2, final_norm=False)
    x = torch.randn(2, 5, EMBED)
    recorded_output, record = stack(x, return_intermediates=True)
    assert list(record.weights) == ["layers.0.self_attention", "layers.1.self_attention"]
    assert all(w.shape == (2, 5, 5) for w in record.weights.values())
    torch.testing.assert_close(recorded_output, stack(x))  # recording changes no number
    first = stack.layers[0]
    attention = first.self_attention
    assert not attention._forward_hooks and not attention._forward_pre_hooks
    expected = attention(first.attention_norm(x) if first.norm_first else x, need_weights=True)[1]
    torch.testing.assert_close(record.weights["layers.0.self_attention"], expected)


@pytest.mark.parametrize("shape", [(4, 4), (1, 1, 4, 4)])
def test_receivers_read_a_masks_values_once_for_many_calls(shape, monkeypatch):
    """The checks read the mask's values (a device sync on a GPU): each once per mask, also for
    a (1, 1, L, S) mask, whose reshaped view was new, and read again, on every call; and the two
    questions asked of one mask (does it order the positions, is it causal) do not evict each
    other's answers."""
    import torchvote.functional.masks as masks
    import torchvote.nn.routing_attention as routing_attention

    reads = []
    for module, name in ((masks, "is_causal_mask"), (routing_attention, "_orders_receivers")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda mask, real=real, name=name: reads.append(name) or real(mask))
    routing = RoutingAttention(EMBED, HEADS, normalize_over="receivers").eval()
    mask = torch.ones(4, 4, dtype=torch.bool).view(shape)
    for _ in range(3):
        routing(torch.randn(1, 4, EMBED), attn_mask=mask)
    assert reads.count("_orders_receivers") == 1
    assert reads.count("is_causal_mask") == (1 if len(shape) == 2 else 0)  # a 2-D mask may be causal
