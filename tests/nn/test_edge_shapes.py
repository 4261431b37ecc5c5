"""The edges of shape: an empty batch, one token, one input or output capsule, one iteration, and
queries or batch items with nothing to attend to.

Each case either works and matches a reference (a hand-computed value, PyTorch's own function, or
a property the docs state) or is refused by name; none gives NaN. References: with one key a query's
weight is 1 whatever the normalisation, so attention returns the projected value; with one output
capsule every input's coupling is 1 (a softmax over one receiver), so dynamic routing and uniform
couplings return ``squash(sum_j u_j)``; a query with nothing to attend to gets zero weights, so its
output is ``out_proj``'s bias (``MultiHeadAttention.forward``'s docs), and
``F.scaled_dot_product_attention`` gives such a row zeros (its math kernel, on the CPU and on CUDA).

Every case runs on ``--device`` (the CPU unless given), its reference there too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from conftest import routing_passes
from torchvote.functional import scaled_dot_product_attention, squash
from torchvote.nn import CapsuleLinear, MultiHeadAttention, RoutingAttention, SlotAttention
from torchvote.nn.em_capsules import MatrixCapsules

from .test_factory_kwargs import ALL_CASES, _outputs, place

F64 = torch.float64
ROUTERS = ["dynamic", "uniform", "em", "inverted_dot_product", "self_attention", "slot"]
ATTENTIONS = {
    "softmax": lambda: MultiHeadAttention(8, 2, dtype=F64),
    **{
        f"routing-{iterations}-{over}-{aggregation}": (
            lambda iterations=iterations, over=over, aggregation=aggregation: RoutingAttention(
                8, 2, iterations=iterations, normalize_over=over, aggregation=aggregation, dtype=F64))
        for iterations in (1, 3)
        for over in ("senders", "receivers")
        for aggregation in ("sum", "mean")
    },
}


def _empty_batch(value):
    """``value``'s tensors cut to a batch of 0 along their first axis."""
    if isinstance(value, Tensor):
        return value[:0].detach().requires_grad_(value.is_floating_point())
    if isinstance(value, MatrixCapsules):
        return MatrixCapsules(*(_empty_batch(t) for t in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_empty_batch(t) for t in value)
    return value


@pytest.mark.parametrize("case", ALL_CASES)
def test_every_module_takes_an_empty_batch(case, device):
    torch.manual_seed(0)
    module = case.build().to(device)
    args, kwargs = place(case.inputs(torch.float32), device=device)
    full = [t for t in _outputs(module(*args, **kwargs)) if t.is_floating_point()]
    empty = [t for t in _outputs(module(*_empty_batch(args), **kwargs)) if t.is_floating_point()]
    assert [t.shape[1:] for t in empty] == [t.shape[1:] for t in full]
    assert all(t.shape[0] == 0 for t in empty)
    sum(t.sum() for t in empty if t.requires_grad).backward()  # an empty gradient, no error


@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_one_key_gives_the_projected_value(name, device):
    torch.manual_seed(0)
    module = ATTENTIONS[name]().to(device)
    query, memory = place((torch.randn(2, 1, 8, dtype=F64), torch.randn(2, 1, 8, dtype=F64)), device=device)
    kwargs = {} if name.endswith(("receivers-sum", "receivers-mean")) else {"is_causal": True}
    output, weights = module(query, memory, need_weights=True, **kwargs)
    value_weight, value_bias = module.in_proj.weight.chunk(3)[2], module.in_proj.bias.chunk(3)[2]
    values = F.linear(memory, value_weight, value_bias)  # (b, 1, E): torch's packed layout, rows [2E, 3E)
    torch.testing.assert_close(output, module.out_proj(values))  # weight 1 on the one key
    torch.testing.assert_close(weights, torch.ones(2, 1, 1, dtype=F64, device=device))


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("name", sorted(ATTENTIONS))
def test_a_query_or_a_batch_item_with_nothing_to_attend_to_gets_the_bias(name, need_weights, device):
    torch.manual_seed(0)
    module = ATTENTIONS[name]().to(device)
    x = torch.randn(2, 5, 8, dtype=F64).to(device).requires_grad_()
    row = torch.ones(5, 5, dtype=torch.bool, device=device)
    row[2] = False  # query 2 hears nobody
    padded = torch.tensor([[True] * 5, [False] * 5], device=device)  # batch item 1 is all padding
    bias = module.out_proj.bias
    for mask, dead in (({"attn_mask": row}, (slice(None), 2)), ({"key_mask": padded}, (1,))):
        output, weights = module(x, need_weights=need_weights, average_weights=False, **mask)
        torch.testing.assert_close(output[dead], bias.expand_as(output[dead]))
        if need_weights:
            dead_weights = weights[:, :, 2] if "attn_mask" in mask else weights[1]
            assert torch.all(dead_weights == 0)
        (grad,) = torch.autograd.grad(output.pow(2).sum(), x)
        assert torch.isfinite(output).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("additive", [False, True])
def test_functional_attention_gives_a_row_with_nothing_to_attend_to_zeros_as_torch(
    additive, need_weights, device
):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 4, dtype=F64, generator=generator).to(device).requires_grad_()
               for _ in range(3))
    allowed = torch.ones(5, 5, dtype=torch.bool, device=device)
    allowed[2] = False
    additive_mask = torch.zeros(5, 5, dtype=F64, device=device).masked_fill(~allowed, float("-inf"))
    mask = additive_mask if additive else allowed
    output, weights = scaled_dot_product_attention(q, k, v, attn_mask=mask, need_weights=need_weights)
    torch.testing.assert_close(output, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert torch.all(output[:, 2] == 0)
    if need_weights:
        assert torch.all(weights[:, 2] == 0)
    grads = torch.autograd.grad(output.pow(2).sum(), [q, k, v])
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("strategy", ["materialize", "stream"])
@pytest.mark.parametrize("routing", ROUTERS)
@pytest.mark.parametrize(("in_caps", "out_caps", "iterations"), [(1, 3, 3), (5, 1, 3), (1, 1, 1), (5, 3, 1)])
def test_one_capsule_or_one_pass_routes_as_the_other_strategy_and_sums_to_one(
    routing, strategy, in_caps, out_caps, iterations, device
):
    torch.manual_seed(0)
    iterations = routing_passes(routing, iterations)  # unset for a one-pass router
    reference = CapsuleLinear(in_caps, 4, out_caps, 6, routing=routing, iterations=iterations, init_std=0.5,
                              strategy="stream" if strategy == "materialize" else "materialize", dtype=F64)
    layer = CapsuleLinear(in_caps, 4, out_caps, 6, routing=routing, iterations=iterations, strategy=strategy,
                          dtype=F64)
    layer.load_state_dict(reference.state_dict())
    reference, layer = reference.to(device), layer.to(device)
    inputs = torch.randn(2, in_caps, 4, dtype=F64).to(device).requires_grad_()
    result, expected = layer(inputs, return_routing=True), reference(inputs, return_routing=True)
    torch.testing.assert_close(result.outputs, expected.outputs, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(result.couplings, expected.couplings, rtol=1e-10, atol=1e-12)
    # every input splits one unit over the output capsules (all of it to the one, if one)
    torch.testing.assert_close(result.couplings.sum(-2), torch.ones(2, in_caps, dtype=F64, device=device))
    (grad,) = torch.autograd.grad(result.outputs.pow(2).sum(), inputs)
    assert torch.isfinite(result.outputs).all() and torch.isfinite(grad).all()


@pytest.mark.parametrize("routing", ["dynamic", "uniform"])
def test_one_output_capsule_takes_every_vote_whole(routing, device):
    torch.manual_seed(0)
    layer = CapsuleLinear(5, 4, 1, 6, routing=routing, init_std=0.5, dtype=F64).to(device)
    inputs = torch.randn(2, 5, 4, dtype=F64).to(device)
    votes = torch.einsum("ijde,bje->bijd", layer.weight, inputs)  # (b, 1, j, d): Sabour et al., eq. 2
    torch.testing.assert_close(layer(inputs), squash(votes.sum(-2)))  # c_1j = 1: s_1 = sum_j u_1j


def test_slot_attention_with_a_fully_masked_item_updates_from_nothing(device):
    """A batch item whose inputs are all masked gives every slot an empty weighted mean (zero), so
    its slots are ``update(0, slots)`` in every pass, and the other item is unaffected."""
    torch.manual_seed(0)
    module = SlotAttention(3, 6, slot_dim=4, hidden_dim=8, iterations=2).double().to(device)
    inputs, slots = place((torch.randn(2, 5, 6, dtype=F64), torch.randn(2, 3, 4, dtype=F64)), device=device)
    mask = torch.tensor([[True] * 5, [False] * 5], device=device)
    output = module(inputs, slots=slots, mask=mask)
    expected = slots[1]
    for _ in range(2):
        expected = module.update(torch.zeros_like(expected), expected)
    torch.testing.assert_close(output[1], expected)
    torch.testing.assert_close(output[0], module(inputs[:1], slots=slots[:1])[0])


@pytest.mark.parametrize("need_weights", [False, True])
def test_multi_head_attention_with_no_keys_and_a_key_mask(need_weights):
    """No key at all: every query has nothing to attend to and its output is ``out_proj``'s bias,
    with a key mask as without one."""
    attention = MultiHeadAttention(8, 2)
    query, memory = torch.randn(2, 3, 8), torch.randn(2, 0, 8)
    out, _ = attention(query, memory, key_mask=torch.ones(2, 0, dtype=torch.bool), need_weights=need_weights)
    torch.testing.assert_close(out, attention.out_proj.bias.expand(2, 3, 8))
