"""Bahdanau and Luong attention modules against the papers' formulas written as plain loops."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.nn import AdditiveAttention, LuongAttention

F64 = torch.float64


@torch.no_grad()
def _loop_attention(query, key, value, score, allowed=None):
    """context_i = sum_j softmax_j(score(q_i, k_j)) v_j, one (batch, query) at a time."""
    batch, target_len, source_len = query.shape[0], query.shape[1], key.shape[1]
    contexts = torch.zeros(batch, target_len, value.shape[-1], dtype=value.dtype)
    weights = torch.zeros(batch, target_len, source_len, dtype=value.dtype)
    for b in range(batch):
        for i in range(target_len):
            keys = [j for j in range(source_len) if allowed is None or allowed[b, i, j]]
            scores = {j: score(query[b, i], key[b, j]) for j in keys}
            total = sum(math.exp(s) for s in scores.values())
            for j in keys:
                weights[b, i, j] = math.exp(scores[j]) / total
                contexts[b, i] += weights[b, i, j] * value[b, j]
    return contexts, weights


def _inputs(query_dim=5, key_dim=3, value_dim=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, query_dim, generator=generator, dtype=F64),
            torch.randn(2, 4, key_dim, generator=generator, dtype=F64),
            torch.randn(2, 4, value_dim, generator=generator, dtype=F64))


def test_additive_matches_bahdanau_formula():
    query, key, value = _inputs()
    module = AdditiveAttention(5, 3, 6).double()
    w_q, w_k, v = module.query_proj.weight, module.key_proj.weight, module.vector

    def score(q, k):  # e = v^T tanh(W q + U k)
        return float(sum(v[h] * math.tanh(float(w_q[h] @ q + w_k[h] @ k)) for h in range(6)))

    context, weights = module(query, key, value)
    expected_context, expected_weights = _loop_attention(query, key, value, score)
    torch.testing.assert_close(context, expected_context, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("score_name", ["dot", "general", "concat"])
def test_luong_matches_formula(score_name):
    key_dim = 5 if score_name == "dot" else 3
    query, key, value = _inputs(key_dim=key_dim)
    module = LuongAttention(5, key_dim, score=score_name, **(
        {"hidden_dim": 7} if score_name == "concat" else {})).double()
    if score_name == "dot":
        def score(q, k):
            return float(q @ k)
    elif score_name == "general":
        def score(q, k):
            return float(q @ module.weight @ k)
    else:
        w, v = module.concat_proj.weight, module.vector

        def score(q, k):  # v^T tanh(W [q; k])
            concatenated = torch.cat([q, k])
            return float(sum(v[h] * math.tanh(float(w[h] @ concatenated)) for h in range(7)))

    context, weights = module(query, key, value)
    expected_context, expected_weights = _loop_attention(query, key, value, score)
    torch.testing.assert_close(context, expected_context, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-12)


def _additive_score(module):
    w_q, w_k, v = module.query_proj.weight, module.key_proj.weight, module.vector
    return lambda q, k: float(v @ torch.tanh(w_q @ q + w_k @ k))


def _general_score(module):
    return lambda q, k: float(q @ module.weight @ k)


@pytest.mark.parametrize(("module", "score_of"), [
    (AdditiveAttention(5, 5, 4), _additive_score),
    (LuongAttention(5, 5, score="general"), _general_score),
], ids=["additive", "general"])
def test_masks_exclude_keys(module, score_of):
    module = module.double()
    query, key, value = _inputs(key_dim=5)
    key_mask = torch.tensor([[True, True, False, True], [True, False, False, True]])
    attn_mask = torch.ones(3, 4, dtype=torch.bool)
    attn_mask[1, 0] = False
    context, weights = module(query, key, value, key_mask=key_mask, attn_mask=attn_mask)
    allowed = key_mask[:, None, :] & attn_mask  # (b, L, S)
    expected_context, expected_weights = _loop_attention(query, key, value, score_of(module), allowed)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(context, expected_context, rtol=1e-10, atol=1e-12)


def test_value_defaults_to_key():
    query, key, _ = _inputs(key_dim=5)
    module = LuongAttention(5, 5).double()
    torch.testing.assert_close(module(query, key)[0], module(query, key, key)[0])


def test_additive_dropout_only_in_training():
    torch.manual_seed(0)
    module = AdditiveAttention(5, 3, 4, dropout=0.5).double()
    query, key, value = _inputs()
    module.eval()
    first = module(query, key, value)[0]
    torch.testing.assert_close(module(query, key, value)[0], first)
    module.train()
    assert not torch.allclose(module(query, key, value)[0], first)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: LuongAttention(4, 3, score="dot"), "query_dim == key_dim"),
    (lambda: LuongAttention(4, 4, score="cosine"), "score must be"),
    (lambda: LuongAttention(4, 4, score="general", hidden_dim=3), "hidden_dim only applies"),
    (lambda: AdditiveAttention(4, 4, 0), "hidden_dim"),
    (lambda: AdditiveAttention(4, 4, 3, dropout=-0.1), "dropout"),
])
def test_constructor_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(("args", "kwargs", "match"), [
    ((torch.randn(2, 3, 4), torch.randn(2, 5, 3)), {}, r"key must have shape \(batch, S, 4\)"),
    ((torch.randn(2, 3, 5), torch.randn(2, 5, 4)), {}, r"query must have shape \(batch, L, 4\)"),
    ((torch.randn(3, 4), torch.randn(2, 5, 4)), {}, "query must have shape"),
    ((torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 6, 4)), {}, "value must have shape"),
    ((torch.randn(2, 3, 4), torch.randn(2, 5, 4)), {"key_mask": torch.ones(2, 4, dtype=torch.bool)},
     "key_mask must have shape"),
    ((torch.randn(2, 3, 4), torch.randn(2, 5, 4)), {"attn_mask": torch.ones(4, 5, dtype=torch.bool)},
     "attn_mask of shape"),
])
def test_forward_errors(args, kwargs, match):
    module = LuongAttention(4, 4)
    with pytest.raises(ValueError, match=match):
        module(*args, **kwargs)


@pytest.mark.parametrize("make", [lambda: AdditiveAttention(4, 4, 8), lambda: LuongAttention(4, 4),
                                  lambda: LuongAttention(4, 4, score="general")])
def test_dtype_errors(make):
    module = make()
    query, key = torch.randn(2, 3, 4), torch.randn(2, 5, 4)
    with pytest.raises(TypeError, match="value must be floating point"):  # was a truncated result
        module(query, key, torch.randint(0, 9, (2, 5, 1)))
    with pytest.raises(TypeError, match="key has dtype torch.float64"):
        module(query, key.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts: no dtype error
        context, _ = module(query, key)
    assert context.shape == (2, 3, 4)


# --- reset_parameters: torch's convention (to_empty() + reset_parameters() gives a working module)

SCORED = {
    "additive": lambda **f: AdditiveAttention(24, 40, 32, **f),
    "dot": lambda **f: LuongAttention(24, 24, score="dot", **f),
    "general": lambda **f: LuongAttention(24, 40, score="general", **f),
    "concat": lambda **f: LuongAttention(24, 40, score="concat", hidden_dim=32, **f),
}


def _init_bounds(module):
    """Each parameter's default range: nn.Linear's weights (kaiming-uniform with a = sqrt(5))
    and v_a (as an nn.Linear(H, 1)) within 1 / sqrt(fan_in); general's W_a Glorot-uniform,
    sqrt(6 / (fan_in + fan_out))."""
    bounds = {}
    for name, parameter in module.named_parameters():
        if name == "weight":  # Luong's general W_a: (query_dim, key_dim)
            bounds[name] = math.sqrt(6.0 / sum(parameter.shape))
        else:  # (out, in) projections and the (H,) vector: fan_in is the last size
            bounds[name] = 1.0 / math.sqrt(parameter.shape[-1])
    return bounds


@pytest.mark.parametrize("kind", SCORED)
def test_reset_parameters_under_a_seed_draws_what_construction_drew(kind):
    torch.manual_seed(3)
    built = SCORED[kind]()
    module = SCORED[kind]()
    for parameter in module.parameters():
        torch.nn.init.constant_(parameter, float("nan"))
    torch.manual_seed(3)
    module.reset_parameters()  # was an AttributeError: neither module had it
    assert built.state_dict().keys() == module.state_dict().keys()
    for name, tensor in built.state_dict().items():
        assert torch.equal(module.state_dict()[name], tensor), name


@pytest.mark.parametrize("kind", SCORED)
def test_built_on_meta_then_to_empty_and_reset_parameters_gives_a_working_module(kind):
    module = SCORED[kind](device="meta").to_empty(device="cpu")
    torch.manual_seed(4)
    module.reset_parameters()
    torch.manual_seed(4)
    fresh = SCORED[kind]()
    for name, bound in _init_bounds(module).items():
        parameter = module.get_parameter(name)
        assert parameter.abs().max() <= bound, name  # the default init's range ...
        assert parameter.abs().max() > 0.9 * bound, name  # ... filled, not left at zero
        assert torch.equal(parameter, fresh.get_parameter(name)), name  # the default init itself
    query, key, value = _inputs(query_dim=24, key_dim=module.key_dim)
    context, weights = module.double()(query, key, value)
    assert torch.isfinite(context).all() and torch.isfinite(weights).all()
    torch.testing.assert_close(context, fresh.double()(query, key, value)[0], rtol=0, atol=0)


def test_module_wide_reset_reaches_every_parameter_of_a_seq2seq_attention():
    """The idiom of a meta-built model: reset every module that has reset_parameters. Before,
    ``v_a`` (additive, concat) and ``W_a`` (general) were left as to_empty's uninitialised memory."""
    for kind in ("additive", "general", "concat"):
        module = SCORED[kind](device="meta").to_empty(device="cpu")
        with torch.no_grad():
            for parameter in module.parameters():
                parameter.fill_(float("nan"))  # what uninitialised memory may hold
        for submodule in module.modules():
            if hasattr(submodule, "reset_parameters"):
                submodule.reset_parameters()
        assert all(torch.isfinite(p).all() for p in module.parameters()), kind


def test_the_parameterless_dot_score_names_the_queries_in_a_dtype_error():
    attention = LuongAttention(4, 4, score="dot")
    with pytest.raises(TypeError, match="key has dtype torch.float64 but the queries are torch.float32"):
        attention(torch.randn(1, 2, 4), torch.randn(1, 3, 4, dtype=torch.float64))


def test_inputs_on_another_device_than_the_weights_are_named():
    """A CPU query beside meta weights (a module built on meta, its weights never materialised)
    computed on uninitialised memory and returned CPU numbers that changed from call to call; the
    dot score returned a meta tensor for a meta key; MultiHeadAttention failed 23 frames down."""
    from torchvote.nn import MultiHeadAttention

    query = torch.randn(2, 3, 8)
    luong = LuongAttention(8, 8, score="general", device="meta")
    additive = AdditiveAttention(8, 8, 8, device="meta")
    for layer in (luong, additive):
        with pytest.raises(ValueError, match="query is on cpu but the module's parameters are on meta"):
            layer(query, query)
    with pytest.raises(ValueError, match="key is on meta but the queries are on cpu"):
        LuongAttention(8, 8)(query, query.to("meta"))
    with pytest.raises(ValueError, match="query is on cpu but the module's parameters are on meta"):
        MultiHeadAttention(8, 2, device="meta")(query)
    with pytest.raises(ValueError, match="attn_mask is on meta but the module's parameters are on cpu"):
        MultiHeadAttention(8, 2)(query, attn_mask=torch.ones(3, 3, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="key_mask is on meta"):
        meta_mask = torch.ones(2, 3, dtype=torch.bool, device="meta")
        LuongAttention(8, 8, score="general")(query, query, key_mask=meta_mask)


def test_multi_head_weights_in_training_are_the_softmax_before_dropout():
    """The documented difference from nn.MultiheadAttention (its weights come after dropout): ours
    sum to 1 per row, and the outputs agree."""
    from torchvote.nn import MultiHeadAttention

    theirs = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True, dtype=torch.float64)
    ours = MultiHeadAttention.from_torch(theirs)
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    torch.manual_seed(1)
    expected, _ = theirs(x, x, x)
    torch.manual_seed(1)
    output, weights = ours(x, need_weights=True, average_weights=False)
    torch.testing.assert_close(output, expected)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 4, dtype=torch.float64))
