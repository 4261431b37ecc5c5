"""Metamorphic properties of attention: what must hold by the mathematics, whatever the numbers.

- **Batch independence**: each example's output and gradient are those it gets alone (masks
  included), and a reordered batch gives reordered outputs.
- **Permutations**: without positions, attention is a function of the *set* of (key, value) pairs:
  permuting keys and values together changes nothing, permuting the queries permutes the outputs,
  so self-attention is permutation-equivariant over tokens. Slot attention: invariant to permuting
  its inputs, equivariant to permuting its slots.
- **Masking**: a masked-out key's key and value can be anything: no output changes, and they get
  zero gradient. Causal attention: a token changes no earlier position's output.
- **Documented identities**: ``RoutingAttention(iterations=1)`` is bit-identical to
  ``MultiHeadAttention`` with the same weights (docs/voting.md); a query with nothing to attend to
  gets zero weights, so its output is ``out_proj``'s bias (``MultiHeadAttention.forward``).

Everything in float64 with tight tolerances, modules in eval mode, dropout 0.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchvote.functional import self_attention
from torchvote.nn import (
    AdditiveAttention,
    LuongAttention,
    MultiHeadAttention,
    NadarayaWatson,
    RoutingAttention,
    SlotAttention,
    TransformerDecoderLayer,
    TransformerEncoderLayer,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DOUBLE = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
E = 8  # model width


def draw(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DOUBLE)


def _mha(**options):
    def build():
        torch.manual_seed(0)
        module = MultiHeadAttention(E, 2, dtype=DOUBLE, **options).eval()

        def call(query, key, value, *, key_mask=None, attn_mask=None, is_causal=False):
            return module(query, key, value, key_mask=key_mask, attn_mask=attn_mask, is_causal=is_causal)[0]

        return call

    return build


def _routing(**options):
    def build():
        torch.manual_seed(0)
        module = RoutingAttention(E, 2, dtype=DOUBLE, **options).eval()

        def call(query, key, value, *, key_mask=None, attn_mask=None, is_causal=False):
            return module(query, key, value, key_mask=key_mask, attn_mask=attn_mask, is_causal=is_causal)[0]

        return call

    return build


def _scored(cls, **options):
    def build():
        torch.manual_seed(0)
        module = cls(E, E, **options).double().eval()

        def call(query, key, value, *, key_mask=None, attn_mask=None, is_causal=False):
            assert not is_causal
            return module(query, key, value, key_mask=key_mask, attn_mask=attn_mask)[0]

        return call

    return build


def _kernel_regression():
    module = NadarayaWatson(bandwidth=0.7, dtype=DOUBLE)

    def call(query, key, value, *, key_mask=None, attn_mask=None, is_causal=False):
        assert attn_mask is None and not is_causal
        return module(query, key, value, key_mask=key_mask)[0]

    return call


ATTENTIONS = {
    "mha": _mha(),
    "mha-shared-qkv": _mha(shared_qkv=True),
    "routing-senders": _routing(iterations=3),
    "routing-receivers-mean": _routing(iterations=2, normalize_over="receivers", aggregation="mean"),
    "additive": _scored(AdditiveAttention, hidden_dim=6),
    "luong-general": _scored(LuongAttention, score="general"),
    "luong-concat": _scored(LuongAttention, score="concat", hidden_dim=6),
    "kernel-regression": _kernel_regression,
}
# With the softmax over the receivers (the queries) a key's weight for one query depends on the
# other queries' logits, so a key forbidden to one query still reaches it through the others: the
# per-query properties (attn_mask, causality; the latter refused by RoutingAttention) hold for the
# softmax over the senders only.
WITH_ATTN_MASK = ["mha", "mha-shared-qkv", "routing-senders", "additive", "luong-general", "luong-concat"]
CAUSAL = ["mha", "mha-shared-qkv", "routing-senders"]


def key_mask_for(batch, keys, seed):
    """A boolean (b, S) mask with at least one real key per row and some padding."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, keys, generator=generator) < 0.6
    mask[:, 0] = True
    mask[0, -1] = False
    return mask


# --- batch independence ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ATTENTIONS)
def test_attention_rows_are_independent(name):
    attend = ATTENTIONS[name]()
    batch, length, keys = 4, 3, 5
    query = draw((batch, length, E), 1).requires_grad_(True)
    key, value = draw((batch, keys, E), 2), draw((batch, keys, E), 3)
    mask = key_mask_for(batch, keys, 4)
    out = attend(query, key, value, key_mask=mask)
    weights = draw(out.shape, 5)
    (grad,) = torch.autograd.grad((out * weights).sum(), query)
    for k in range(batch):
        row = query[k : k + 1].detach().requires_grad_(True)
        alone = attend(row, key[k : k + 1], value[k : k + 1], key_mask=mask[k : k + 1])
        torch.testing.assert_close(alone, out[k : k + 1], **TIGHT)
        (grad_alone,) = torch.autograd.grad((alone * weights[k : k + 1]).sum(), row)
        torch.testing.assert_close(grad_alone, grad[k : k + 1], **TIGHT)
    order = torch.tensor([1, 3, 0, 2])
    torch.testing.assert_close(attend(query[order], key[order], value[order], key_mask=mask[order]),
                               out[order], **TIGHT)


# --- permutations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ATTENTIONS)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), keys=st.integers(1, 6), length=st.integers(1, 4))
def test_permuting_keys_with_values_changes_nothing_and_permuting_queries_permutes(name, seed, keys, length):
    attend = ATTENTIONS[name]()
    query, key, value = draw((2, length, E), seed), draw((2, keys, E), seed + 1), draw((2, keys, E), seed + 2)
    mask = key_mask_for(2, keys, seed + 3)
    generator = torch.Generator().manual_seed(seed)
    senders = torch.randperm(keys, generator=generator)
    receivers = torch.randperm(length, generator=generator)
    out = attend(query, key, value, key_mask=mask)
    moved = attend(query, key[:, senders], value[:, senders], key_mask=mask[:, senders])
    torch.testing.assert_close(moved, out, **TIGHT)
    moved = attend(query[:, receivers], key, value, key_mask=mask)
    torch.testing.assert_close(moved, out[:, receivers], **TIGHT)


@pytest.mark.parametrize("name", ["mha", "mha-shared-qkv", "routing-senders", "routing-receivers-mean"])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), length=st.integers(1, 6))
def test_self_attention_without_positions_is_permutation_equivariant(name, seed, length):
    attend = ATTENTIONS[name]()
    x = draw((2, length, E), seed)
    perm = torch.randperm(length, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(attend(x[:, perm], x[:, perm], x[:, perm]), attend(x, x, x)[:, perm], **TIGHT)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), length=st.integers(1, 6))
def test_functional_self_attention_is_permutation_equivariant(seed, length):
    x = draw((2, length, 4), seed)
    perm = torch.randperm(length, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(self_attention(x[:, perm])[0], self_attention(x)[0][:, perm], **TIGHT)


def test_encoder_layer_without_positions_is_permutation_equivariant():
    torch.manual_seed(0)
    layer = TransformerEncoderLayer(E, 2, dim_feedforward=16, dropout=0.0, dtype=DOUBLE).eval()
    x, perm = draw((2, 5, E), 1), torch.tensor([3, 0, 4, 2, 1])
    mask = key_mask_for(2, 5, 2)
    moved = layer(x[:, perm], key_mask=mask[:, perm])
    torch.testing.assert_close(moved, layer(x, key_mask=mask)[:, perm], **TIGHT)


@pytest.mark.parametrize("attention", ["softmax", "routing"])
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), position=st.integers(0, 4))
def test_decoder_layer_reads_memory_as_a_set_and_targets_causally(attention, seed, position):
    """Cross-attention has no positions: permuting the memory (with its key mask) changes nothing;
    a padded memory token can be anything; target token ``t`` changes no earlier output."""
    from torchvote.nn import attention_factory

    torch.manual_seed(0)
    options = {} if attention == "softmax" else {"attention": attention_factory("routing", iterations=3)}
    layer = TransformerDecoderLayer(E, 2, dim_feedforward=16, dropout=0.0, dtype=DOUBLE, **options).eval()
    target, memory = draw((2, 5, E), seed), draw((2, 6, E), seed + 1)
    mask = key_mask_for(2, 6, seed + 2)
    out = layer(target, memory, memory_key_mask=mask)
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(layer(target, memory[:, perm], memory_key_mask=mask[:, perm]), out, **TIGHT)
    noise = torch.where((~mask)[..., None], 40 * draw(memory.shape, seed + 3), memory)
    torch.testing.assert_close(layer(target, noise, memory_key_mask=mask), out, **TIGHT)
    changed = target.clone()
    changed[:, position] = 10 * draw((2, E), seed + 4)
    torch.testing.assert_close(layer(changed, memory, memory_key_mask=mask)[:, :position], out[:, :position],
                               **TIGHT)


# --- masking --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ATTENTIONS)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_a_masked_key_and_its_value_can_be_anything(name, seed):
    attend = ATTENTIONS[name]()
    query = draw((2, 3, E), seed)
    key = draw((2, 5, E), seed + 1).requires_grad_(True)
    value = draw((2, 5, E), seed + 2).requires_grad_(True)
    mask = key_mask_for(2, 5, seed + 3)
    out = attend(query, key, value, key_mask=mask)
    grads = torch.autograd.grad((out * draw(out.shape, seed + 4)).sum(), (key, value))
    for grad in grads:  # no gradient reaches a padded key or its value
        assert not grad[~mask].any()
    noise_k, noise_v = 100 * draw(key.shape, seed + 5), 100 * draw(value.shape, seed + 6)
    padded = (~mask)[..., None]
    changed = attend(query, torch.where(padded, noise_k, key), torch.where(padded, noise_v, value),
                     key_mask=mask)
    torch.testing.assert_close(changed, out, **TIGHT)


@pytest.mark.parametrize("name", WITH_ATTN_MASK)
def test_a_key_forbidden_by_attn_mask_can_be_anything_for_that_query(name):
    attend = ATTENTIONS[name]()
    query, key, value = draw((2, 3, E), 1), draw((2, 4, E), 2), draw((2, 4, E), 3)
    allowed = torch.tensor([[True, False, True, True], [True, True, True, True], [False, True, True, True]])
    out = attend(query, key, value, attn_mask=allowed)
    # query 0 may not hear key 1, query 2 not key 0; change key 1: query 0's output stays
    changed = key.clone()
    changed[:, 1] = 50 * draw((2, E), 4)
    changed_value = value.clone()
    changed_value[:, 1] = 50 * draw((2, E), 5)
    moved = attend(query, changed, changed_value, attn_mask=allowed)
    torch.testing.assert_close(moved[:, 0], out[:, 0], **TIGHT)


@pytest.mark.parametrize("name", CAUSAL)
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), position=st.integers(0, 4))
def test_causal_attention_never_hears_a_later_token(name, seed, position):
    attend = ATTENTIONS[name]()
    x = draw((2, 5, E), seed).requires_grad_(True)
    out = attend(x, x, x, is_causal=True)
    changed = x.detach().clone()
    changed[:, position] = 10 * draw((2, E), seed + 1)
    torch.testing.assert_close(attend(changed, changed, changed, is_causal=True)[:, :position],
                               out[:, :position], **TIGHT)
    (grad,) = torch.autograd.grad(out[:, :position].sum(), x) if position else (torch.zeros_like(x),)
    assert not grad[:, position:].any()


def test_a_query_with_nothing_to_attend_to_gives_the_output_bias():
    torch.manual_seed(0)
    module = MultiHeadAttention(E, 2, dtype=DOUBLE).eval()
    with torch.no_grad():
        module.out_proj.bias.copy_(draw((E,), 9))
    query, key = draw((2, 3, E), 1), draw((2, 4, E), 2)
    allowed = torch.ones(3, 4, dtype=torch.bool)
    allowed[1] = False  # query 1 hears nobody
    out = module(query, key, key, attn_mask=allowed)[0]
    torch.testing.assert_close(out[:, 1], module.out_proj.bias.expand(2, E), **TIGHT)
    assert torch.isfinite(out).all()


# --- documented identities ------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_routing_attention_with_one_pass_is_bit_identical_to_multi_head_attention(causal):
    torch.manual_seed(0)
    mha = MultiHeadAttention(E, 2, dtype=DOUBLE).eval()
    routing = RoutingAttention(E, 2, iterations=1, dtype=DOUBLE).eval()
    routing.load_state_dict(mha.state_dict())
    x, mask = draw((3, 5, E), 1), key_mask_for(3, 5, 2)
    kwargs = {"is_causal": True} if causal else {"key_mask": mask}
    assert torch.equal(routing(x, **kwargs)[0], mha(x, **kwargs)[0])


# --- slot attention -------------------------------------------------------------------------------


def slot_module():
    torch.manual_seed(0)
    return SlotAttention(3, 5, slot_dim=6, iterations=3, hidden_dim=8).double().eval()


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_slot_attention_is_invariant_to_its_inputs_order_and_equivariant_to_its_slots(seed):
    module = slot_module()
    inputs, slots = draw((2, 7, 5), seed), draw((2, 3, 6), seed + 1)
    mask = key_mask_for(2, 7, seed + 2)
    generator = torch.Generator().manual_seed(seed)
    senders, receivers = torch.randperm(7, generator=generator), torch.randperm(3, generator=generator)
    out, attention = module(inputs, slots=slots, mask=mask, return_attention=True)
    moved, moved_attention = module(inputs[:, senders], slots=slots, mask=mask[:, senders],
                                    return_attention=True)
    torch.testing.assert_close(moved, out, **TIGHT)
    torch.testing.assert_close(moved_attention, attention[..., senders], **TIGHT)
    moved, moved_attention = module(inputs, slots=slots[:, receivers], mask=mask, return_attention=True)
    torch.testing.assert_close(moved, out[:, receivers], **TIGHT)
    torch.testing.assert_close(moved_attention, attention[:, receivers], **TIGHT)


def test_slot_attention_masked_inputs_can_be_anything_and_rows_are_independent():
    module = slot_module()
    inputs, slots = draw((3, 7, 5), 1).requires_grad_(True), draw((3, 3, 6), 2)
    mask = key_mask_for(3, 7, 3)
    out = module(inputs, slots=slots, mask=mask)
    (grad,) = torch.autograd.grad(out.pow(2).sum(), inputs)
    assert not grad[~mask].any()
    noise = torch.where((~mask)[..., None], 30 * draw(inputs.shape, 4), inputs.detach())
    torch.testing.assert_close(module(noise, slots=slots, mask=mask), out, **TIGHT)
    for k in range(3):
        alone = module(inputs[k : k + 1], slots=slots[k : k + 1], mask=mask[k : k + 1])
        torch.testing.assert_close(alone, out[k : k + 1], **TIGHT)


@pytest.mark.parametrize("name", ["mha", "routing-senders"])
@pytest.mark.parametrize("chunks", [(2, 1, 3), (1, 1, 1, 1, 1, 1), (6,)])
def test_causal_attention_through_the_cache_equals_one_pass_in_any_chunks(name, chunks):
    """Keys and values appended chunk by chunk (with padding among them): every position's output
    is the one-pass causal output, whatever the chunking."""
    from torchvote.nn.kv_cache import KVCache

    torch.manual_seed(0)
    cls, options = (MultiHeadAttention, {}) if name == "mha" else (RoutingAttention, {"iterations": 3})
    module = cls(E, 2, dtype=DOUBLE, **options).eval()
    x = draw((3, 6, E), 1)
    key_mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1], [1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    full = module(x, key_mask=key_mask, is_causal=True)[0]
    cache, pieces, start = KVCache(), [], 0
    for size in chunks:
        end = start + size
        pieces.append(module(x[:, start:end], key_mask=key_mask[:, :end], is_causal=True, cache=cache)[0])
        start = end
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, **TIGHT)


# --- softmax identities, through the masks ---------------------------------------------------------


@pytest.mark.parametrize("name", ["mha", "routing-senders", "additive", "luong-general"])
def test_a_duplicated_key_is_a_float_mask_of_log_two(name):
    """Softmax over the senders: key ``j`` given twice weighs as key ``j`` once with ``log 2``
    added to its logits (a float ``attn_mask``); the routing passes' agreement keeps them equal."""
    attend = ATTENTIONS[name]()
    query, key, value = draw((2, 3, E), 1), draw((2, 4, E), 2), draw((2, 4, E), 3)
    twice = attend(query, torch.cat([key, key[:, 1:2]], 1), torch.cat([value, value[:, 1:2]], 1))
    bonus = torch.zeros(3, 4, dtype=DOUBLE)
    bonus[:, 1] = torch.log(torch.tensor(2.0, dtype=DOUBLE))
    torch.testing.assert_close(attend(query, key, value, attn_mask=bonus), twice, **TIGHT)


@pytest.mark.parametrize("name", ["mha", "routing-senders", "additive", "luong-concat"])
def test_a_float_mask_constant_along_each_query_changes_nothing(name):
    attend = ATTENTIONS[name]()
    query, key, value = draw((2, 3, E), 1), draw((2, 4, E), 2), draw((2, 4, E), 3)
    shift = (5 * draw((3, 1), 4)).expand(3, 4)  # one constant per query
    torch.testing.assert_close(attend(query, key, value, attn_mask=shift), attend(query, key, value), **TIGHT)


@pytest.mark.parametrize("name", ["mha", "additive", "luong-general", "kernel-regression"])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), a=st.floats(-3, 3), b=st.floats(-3, 3))
def test_one_pass_attention_is_affine_in_the_values(name, seed, a, b):
    """One pass: the weights do not depend on the values, so the output is affine in them
    (``f(a v + b w) = a f(v) + b f(w) + (1 - a - b) f(0)``)."""
    attend = ATTENTIONS[name]()
    query, key, mask = draw((2, 3, E), seed), draw((2, 4, E), seed + 1), key_mask_for(2, 4, seed + 2)
    v, w = draw((2, 4, E), seed + 3), draw((2, 4, E), seed + 4)

    def f(values):
        return attend(query, key, values, key_mask=mask)

    expected = a * f(v) + b * f(w) + (1 - a - b) * f(torch.zeros_like(v))
    torch.testing.assert_close(f(a * v + b * w), expected, rtol=1e-9, atol=1e-11)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), shift=st.floats(-10, 10))
def test_kernel_regression_is_translation_invariant(seed, shift):
    """The Gaussian kernel reads ``x - x_i`` only: moving queries and keys together changes nothing."""
    attend = _kernel_regression()
    query, key, value = draw((2, 3), seed), draw((2, 5), seed + 1), draw((2, 5), seed + 2)
    torch.testing.assert_close(attend(query + shift, key + shift, value), attend(query, key, value),
                               rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("name", ["mha", "mha-shared-qkv", "routing-senders"])
@pytest.mark.parametrize("masks", ["key_mask", "causal", "both"])
def test_asking_for_the_weights_changes_no_output(name, masks):
    """The fused kernel (no weights) and the loop that forms them (``need_weights=True``) are two
    routes to one function (docs/voting.md, "The fused kernel")."""
    torch.manual_seed(0)
    cls = MultiHeadAttention if name.startswith("mha") else RoutingAttention
    options = {"shared_qkv": True} if name == "mha-shared-qkv" else {}
    module = cls(E, 2, dtype=DOUBLE, **options).eval()
    x, mask = draw((3, 5, E), 1), key_mask_for(3, 5, 2)
    kwargs = {"key_mask": mask} if masks != "causal" else {}
    kwargs["is_causal"] = masks != "key_mask"
    plain, none = module(x, **kwargs)
    weighed, weights = module(x, need_weights=True, **kwargs)
    assert none is None and weights.shape == (3, 5, 5)
    torch.testing.assert_close(weighed, plain, **TIGHT)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 5, dtype=DOUBLE), **TIGHT)
    if masks != "causal":  # no weight on padding
        assert not weights.masked_select(~mask[:, None, :].expand(3, 5, 5)).any()
