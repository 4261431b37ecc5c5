"""MultiHeadAttention against torch.nn.MultiheadAttention (copied weights), F.scaled_dot_product_attention
and properties. Gradients are compared in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from torchvote.nn import MultiHeadAttention

F64 = torch.float64
BATCH, HEADS, EMBED = 2, 4, 16


def _torch_pair(*, kdim=None, vdim=None, bias=True, batch_first=True, dtype=F64, seed=0):
    """A torch MHA with random (non-zero) biases and our copy of it."""
    torch.manual_seed(seed)
    theirs = nn.MultiheadAttention(EMBED, HEADS, kdim=kdim, vdim=vdim, bias=bias,
                                   batch_first=batch_first, dtype=dtype)
    with torch.no_grad():
        for parameter in theirs.parameters():
            if parameter.dim() == 1:  # torch initialises biases to zero: make them matter
                parameter.normal_()
    return MultiHeadAttention.from_torch(theirs), theirs


def _canonical_grads(module) -> list[torch.Tensor]:
    """Parameter gradients of either implementation in one order: Wq, Wk, Wv, bq, bk, bv, Wo, bo."""
    if isinstance(module, nn.MultiheadAttention):
        if module.in_proj_weight is not None:
            weights = list(module.in_proj_weight.grad.chunk(3))
        else:
            weights = [module.q_proj_weight.grad, module.k_proj_weight.grad, module.v_proj_weight.grad]
        biases = list(module.in_proj_bias.grad.chunk(3)) if module.in_proj_bias is not None else []
    else:
        projection = module.in_proj
        if hasattr(projection, "weight"):
            weights = list(projection.weight.grad.chunk(3))
            biases = list(projection.bias.grad.chunk(3)) if projection.bias is not None else []
        else:
            linears = (projection.query, projection.key, projection.value)
            weights = [linear.weight.grad for linear in linears]
            biases = [linear.bias.grad for linear in linears] if linears[0].bias is not None else []
    out = [module.out_proj.weight.grad]
    if module.out_proj.bias is not None:
        out.append(module.out_proj.bias.grad)
    return weights + biases + out


def _run(module, query, key, value, call_kwargs):
    module.zero_grad(set_to_none=True)
    query, key, value = (t.detach().clone().requires_grad_() for t in (query, key, value))
    output, weights = module(query, key, value, **call_kwargs)
    loss = output.pow(2).sum() + (weights.pow(2).sum() if weights is not None else 0)
    loss.backward()
    return output, weights, [query.grad, key.grad, value.grad]


def _compare(ours, theirs, query, key, value, our_kwargs, their_kwargs, *, rows=None):
    """Outputs, weights and all gradients agree (optionally on a boolean selection of rows)."""
    ours_out, ours_w, ours_grads = _run(ours, query, key, value, our_kwargs)
    their_out, their_w, their_grads = _run(theirs, query, key, value, their_kwargs)
    select = (lambda t: t) if rows is None else (lambda t: t[rows])
    torch.testing.assert_close(select(ours_out), select(their_out), rtol=1e-10, atol=1e-10)
    if their_w is not None:
        assert ours_w is not None and ours_w.shape == their_w.shape
        torch.testing.assert_close(ours_w, their_w, rtol=1e-10, atol=1e-10)
    else:
        assert ours_w is None
    if rows is None:
        for mine, reference in zip(ours_grads, their_grads, strict=True):
            torch.testing.assert_close(mine, reference, rtol=1e-9, atol=1e-10)
        for mine, reference in zip(_canonical_grads(ours), _canonical_grads(theirs), strict=True):
            torch.testing.assert_close(mine, reference, rtol=1e-9, atol=1e-10)
    return ours_out, ours_w


def _inputs(target_len=5, source_len=5, *, kdim=EMBED, vdim=EMBED, batch_first=True, seed=1):
    generator = torch.Generator().manual_seed(seed)

    def rand(length, features):
        shape = (BATCH, length, features) if batch_first else (length, BATCH, features)
        return torch.randn(*shape, generator=generator, dtype=F64)

    return rand(target_len, EMBED), rand(source_len, kdim), rand(source_len, vdim)


def _allowed(target_len, source_len, *, seed=2, shape=None):
    """A random boolean (True = may attend) mask with at least one allowed key per query."""
    generator = torch.Generator().manual_seed(seed)
    shape = shape or (target_len, source_len)
    mask = torch.rand(*shape, generator=generator) > 0.4
    mask[..., 0] = True
    return mask


# --- self and cross attention, weights, kdim/vdim, bias ---------------------------------------

@pytest.mark.parametrize("need_weights", [False, True])
def test_self_attention_matches_torch(need_weights):
    ours, theirs = _torch_pair()
    x, _, _ = _inputs()
    ours_out, _ = _run(ours, x, x, x, {"need_weights": need_weights})[:2]
    # self-attention via key=None must be the same computation as passing x three times
    again, _ = ours(x, need_weights=need_weights)
    torch.testing.assert_close(again, ours_out)
    _compare(ours, theirs, x, x, x, {"need_weights": need_weights}, {"need_weights": need_weights})


@pytest.mark.parametrize("average", [True, False])
def test_weights_averaged_and_per_head_match_torch(average):
    ours, theirs = _torch_pair()
    x, _, _ = _inputs()
    _, weights = _compare(
        ours, theirs, x, x, x,
        {"need_weights": True, "average_weights": average},
        {"need_weights": True, "average_attn_weights": average},
    )
    assert weights.shape == ((BATCH, 5, 5) if average else (BATCH, HEADS, 5, 5))


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize(("kdim", "vdim"), [(None, None), (6, 10), (16, 7)])
def test_cross_attention_matches_torch(kdim, vdim, need_weights):
    ours, theirs = _torch_pair(kdim=kdim, vdim=vdim)
    query, key, value = _inputs(4, 7, kdim=kdim or EMBED, vdim=vdim or EMBED)
    _compare(ours, theirs, query, key, value, {"need_weights": need_weights},
             {"need_weights": need_weights})


def test_cross_attention_with_keys_as_values_matches_torch():
    """``value is key`` takes the one-matmul key/value path of the packed projection."""
    ours, theirs = _torch_pair()
    query, memory, _ = _inputs(4, 7)
    memory = memory.requires_grad_()
    ours_out, _ = ours(query, memory)
    their_out, _ = theirs(query, memory, memory, need_weights=False)
    torch.testing.assert_close(ours_out, their_out, rtol=1e-10, atol=1e-10)
    (ours_grad,) = torch.autograd.grad(ours_out.sum(), memory)
    (their_grad,) = torch.autograd.grad(their_out.sum(), memory)
    torch.testing.assert_close(ours_grad, their_grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kdim", [None, 9])
def test_no_bias_matches_torch(kdim):
    ours, theirs = _torch_pair(bias=False, kdim=kdim, vdim=kdim)
    assert ours.out_proj.bias is None
    query, key, value = _inputs(4, 6, kdim=kdim or EMBED, vdim=kdim or EMBED)
    _compare(ours, theirs, query, key, value, {"need_weights": True}, {"need_weights": True})


@pytest.mark.parametrize("need_weights", [False, True])
def test_batch_first_false_matches_torch(need_weights):
    ours, theirs = _torch_pair(batch_first=False)
    assert not ours.batch_first
    query, key, value = _inputs(4, 6, batch_first=False)
    key_padding = torch.zeros(BATCH, 6, dtype=torch.bool)
    key_padding[1, -2:] = True
    out, _ = _compare(ours, theirs, query, key, value,
                      {"need_weights": need_weights, "key_mask": ~key_padding},
                      {"need_weights": need_weights, "key_padding_mask": key_padding})
    assert out.shape == (4, BATCH, EMBED)


def test_unbatched_input_matches_torch():
    ours, theirs = _torch_pair()
    query, key, value = (t[0] for t in _inputs(4, 6))
    padding = torch.tensor([False, False, True, False, False, True])
    ours_out, ours_w = ours(query, key, value, key_mask=~padding, need_weights=True)
    their_out, their_w = theirs(query, key, value, key_padding_mask=padding)
    assert ours_out.shape == (4, EMBED) and ours_w.shape == (4, 6)
    torch.testing.assert_close(ours_out, their_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours_w, their_w, rtol=1e-10, atol=1e-10)


# --- masks --------------------------------------------------------------------------------------

def _mask_cases(target_len, source_len):
    """(name, our kwargs, torch kwargs): every mask kind, translated to torch's conventions."""
    allowed = _allowed(target_len, source_len)
    allowed_3d = _allowed(target_len, source_len, seed=3, shape=(BATCH * HEADS, target_len, source_len))
    generator = torch.Generator().manual_seed(4)
    additive = torch.randn(target_len, source_len, generator=generator, dtype=F64)
    additive[~allowed] = float("-inf")
    additive_3d = torch.randn(BATCH * HEADS, target_len, source_len, generator=generator, dtype=F64)
    padding = torch.zeros(BATCH, source_len, dtype=torch.bool)
    padding[0, -2:] = True
    padding[1, 1] = True
    causal_blocked = torch.ones(target_len, source_len, dtype=torch.bool).triu(1)
    per_head = (BATCH, HEADS, target_len, source_len)
    return [
        ("bool 2d", {"attn_mask": allowed}, {"attn_mask": ~allowed}),
        ("bool 3d", {"attn_mask": allowed_3d.view(per_head)}, {"attn_mask": ~allowed_3d}),
        ("float 2d", {"attn_mask": additive}, {"attn_mask": additive}),
        ("float 3d", {"attn_mask": additive_3d.view(per_head)}, {"attn_mask": additive_3d}),
        ("key mask", {"key_mask": ~padding}, {"key_padding_mask": padding}),
        ("key mask + bool", {"key_mask": ~padding, "attn_mask": allowed},
         {"key_padding_mask": padding, "attn_mask": ~allowed}),
        ("key mask + float", {"key_mask": ~padding, "attn_mask": additive},
         {"key_padding_mask": torch.zeros(padding.shape, dtype=F64).masked_fill(padding, float("-inf")),
          "attn_mask": additive}),
        ("causal", {"is_causal": True}, {"attn_mask": causal_blocked}),
        ("causal + key mask", {"is_causal": True, "key_mask": ~padding},
         {"attn_mask": causal_blocked, "key_padding_mask": padding}),
        ("causal + bool", {"is_causal": True, "attn_mask": allowed},
         {"attn_mask": causal_blocked | ~allowed}),
    ]


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("case", range(10), ids=[c[0] for c in _mask_cases(5, 5)])
def test_masks_match_torch(case, need_weights):
    ours, theirs = _torch_pair()
    x, _, _ = _inputs()
    _, our_kwargs, their_kwargs = _mask_cases(5, 5)[case]
    _compare(ours, theirs, x, x, x,
             {**our_kwargs, "need_weights": need_weights, "average_weights": False},
             {**their_kwargs, "need_weights": need_weights, "average_attn_weights": False})


def test_masks_cross_attention_match_torch():
    ours, theirs = _torch_pair(kdim=6, vdim=6)
    query, key, value = _inputs(4, 7, kdim=6, vdim=6)
    for _, our_kwargs, their_kwargs in _mask_cases(4, 7):
        _compare(ours, theirs, query, key, value, {**our_kwargs, "need_weights": True},
                 {**their_kwargs, "need_weights": True})


def test_causal_mask_given_explicitly_equals_is_causal():
    ours, _ = _torch_pair()
    x, _, _ = _inputs()
    lower = torch.ones(5, 5, dtype=torch.bool).tril()
    for need_weights in (False, True):
        explicit = ours(x, attn_mask=lower, need_weights=need_weights)
        flagged = ours(x, is_causal=True, need_weights=need_weights)
        torch.testing.assert_close(explicit[0], flagged[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("need_weights", [False, True])
def test_fully_masked_query_gives_zero_attention_and_finite_grads(need_weights):
    ours, theirs = _torch_pair()
    x, _, _ = _inputs()
    allowed = _allowed(5, 5)
    allowed[2] = False  # query 2 may attend to nothing
    ours_out, ours_w, grads = _run(ours, x, x, x, {"attn_mask": allowed, "need_weights": True})
    # Nothing attended: the heads output zero, so the output is out_proj's bias alone.
    torch.testing.assert_close(ours_out[:, 2], ours.out_proj.bias.expand(BATCH, EMBED))
    assert torch.all(ours_w[:, 2] == 0)
    for grad in grads + _canonical_grads(ours):
        assert torch.isfinite(grad).all()
    # Rows that can attend agree with torch (torch's fully masked row is NaN).
    rows = torch.ones(BATCH, 5, dtype=torch.bool)
    rows[:, 2] = False
    their_out, _ = theirs(x, x, x, attn_mask=~allowed, need_weights=False)
    torch.testing.assert_close(ours_out[rows], their_out[rows], rtol=1e-10, atol=1e-10)
    fused_out, _ = ours(x, attn_mask=allowed, need_weights=need_weights)
    torch.testing.assert_close(fused_out, ours_out, rtol=1e-10, atol=1e-10)


def test_fully_padded_sequence_gives_finite_output_and_grads():
    ours, _ = _torch_pair()
    x, _, _ = _inputs()
    key_mask = torch.ones(BATCH, 5, dtype=torch.bool)
    key_mask[1] = False
    for need_weights in (False, True):
        output, _, grads = _run(ours, x, x, x, {"key_mask": key_mask, "need_weights": need_weights})
        torch.testing.assert_close(output[1], ours.out_proj.bias.expand(5, EMBED))
        assert all(torch.isfinite(g).all() for g in grads)


class _RecordShapes(TorchDispatchMode):
    """Records the number of elements of every tensor an aten op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest[str(func)] = max(self.largest.get(str(func), 0), t.numel())
        return out


@pytest.mark.parametrize("masks", ["none", "causal", "key mask", "key mask + 2d", "causal + key mask"])
def test_no_attention_matrix_without_weights(masks):
    """Without need_weights no (b, h, L, S) tensor is formed, forward or backward; a key mask is
    merged at (b, 1, L, S) at most, never expanded over the heads."""
    batch, length, heads = 2, 256, 4
    module = MultiHeadAttention(16, heads)
    x = torch.randn(batch, length, 16, requires_grad=True)
    key_mask = torch.ones(batch, length, dtype=torch.bool)
    key_mask[0, -10:] = False
    kwargs = {
        "none": {},
        "causal": {"is_causal": True},
        "key mask": {"key_mask": key_mask},
        "key mask + 2d": {"key_mask": key_mask, "attn_mask": _allowed(length, length)},
        "causal + key mask": {"key_mask": key_mask, "is_causal": True},
    }[masks]
    with _RecordShapes() as recorder:
        output, _ = module(x, **kwargs)
        output.sum().backward()
    largest = max(recorder.largest.values())
    if masks in ("none", "causal", "key mask"):
        assert largest < length * length, recorder.largest  # not even one (L, S) matrix
    else:  # the merged mask is (b, 1, L, S): needed by the kernel, but not repeated per head
        assert largest == batch * length * length, recorder.largest


# --- training-mode dropout, dtypes, devices ---------------------------------------------------

def test_dropout_only_in_training():
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS, dropout=0.5)
    reference = MultiHeadAttention(EMBED, HEADS)
    reference.load_state_dict(module.state_dict())
    x = torch.randn(BATCH, 6, EMBED)
    module.eval()
    for need_weights in (False, True):
        torch.testing.assert_close(module(x, need_weights=need_weights)[0], reference(x)[0])
    module.train()
    for need_weights in (False, True):
        assert not torch.allclose(module(x, need_weights=need_weights)[0], reference(x)[0])


@pytest.mark.parametrize("need_weights", [False, True])
def test_output_dtype_follows_parameters_and_inputs(need_weights):
    module = MultiHeadAttention(EMBED, HEADS, dtype=F64)
    assert module.out_proj.weight.dtype == F64
    output, weights = module(torch.randn(1, 3, EMBED, dtype=F64), need_weights=need_weights)
    assert output.dtype == F64
    assert weights is None or weights.dtype == F64


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.float16])
def test_float_mask_of_another_dtype_is_accepted_on_both_paths(input_dtype):
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS).to(input_dtype)
    x = torch.randn(BATCH, 5, EMBED).to(input_dtype)
    additive = torch.randn(5, 5, dtype=F64)
    fused, _ = module(x, attn_mask=additive)
    looped, _ = module(x, attn_mask=additive, need_weights=True)
    reference, _ = module(x, attn_mask=additive.to(input_dtype))
    assert fused.dtype == looped.dtype == input_dtype
    tolerance = {"rtol": 0, "atol": 4 * torch.finfo(input_dtype).eps * reference.abs().max().item()}
    torch.testing.assert_close(fused, reference, **tolerance)
    torch.testing.assert_close(looped, reference, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("training", [False, True])
def test_half_precision_weights_are_torchs(dtype, training):
    """In a half dtype the weights are formed as nn.MultiheadAttention forms them (scaled queries,
    logits and softmax in that dtype): the same weights and outputs to one rounding."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(EMBED, HEADS, batch_first=True).to(dtype).train(training)
    ours = MultiHeadAttention.from_torch(theirs).train(training)
    x = (torch.randn(BATCH, 9, EMBED) * 2).to(dtype)
    with torch.no_grad():
        expected, expected_weights = theirs(x, x, x, need_weights=True)
        output, weights = ours(x, need_weights=True)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=eps)
    torch.testing.assert_close(output, expected, rtol=0, atol=eps * expected.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_large_logits_are_finite_and_close_to_float32(dtype):
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS)
    x = torch.randn(BATCH, 6, EMBED)
    half = MultiHeadAttention(EMBED, HEADS).to(dtype)
    half.load_state_dict(module.state_dict())
    # Inputs x100 make logits of order 1e4: exp of them overflows half, not the softmax's float32 sum.
    output, weights = half((x * 100).to(dtype), need_weights=True)
    assert output.dtype == dtype and torch.isfinite(output).all() and torch.isfinite(weights).all()
    torch.testing.assert_close(weights.float().sum(-1), torch.ones(BATCH, 6), rtol=0, atol=1e-2)
    # At ordinary scale the half result follows the float32 one within the dtype's precision.
    eps = torch.finfo(dtype).eps
    low = x.to(dtype)
    ours_half, weights_half = half(low, need_weights=True)
    ours_float, weights_float = module(low.float(), need_weights=True)
    scale = ours_float.abs().max().item()
    torch.testing.assert_close(ours_half.float(), ours_float, rtol=0, atol=8 * eps * scale)
    torch.testing.assert_close(weights_half.float(), weights_float, rtol=0, atol=8 * eps)


def test_gradcheck_voting_path_float64():
    torch.manual_seed(0)
    module = MultiHeadAttention(4, 2, kdim=3, vdim=5, dtype=F64)
    query = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
    key = torch.randn(2, 4, 3, dtype=F64, requires_grad=True)
    value = torch.randn(2, 4, 5, dtype=F64, requires_grad=True)
    key_mask = torch.tensor([[True, True, False, True], [True, False, True, True]])
    additive = torch.randn(3, 4, dtype=F64)

    def run(q, k, v):
        output, weights = module(q, k, v, key_mask=key_mask, attn_mask=additive, need_weights=True,
                                 average_weights=False)
        return output, weights

    assert torch.autograd.gradcheck(run, (query, key, value))
    assert torch.autograd.gradgradcheck(run, (query, key, value))


# --- shared projection ----------------------------------------------------------------------

def test_shared_qkv_self_attention_is_sdpa_of_one_projection():
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS, shared_qkv=True, dtype=F64)
    names = {name for name, _ in module.named_parameters()}
    assert names == {"in_proj.shared.weight", "in_proj.shared.bias", "out_proj.weight", "out_proj.bias"}
    x = torch.randn(BATCH, 5, EMBED, dtype=F64)
    u = F.linear(x, module.in_proj.shared.weight, module.in_proj.shared.bias)  # q = k = v
    u = u.view(BATCH, 5, HEADS, EMBED // HEADS).transpose(1, 2)
    reference = F.scaled_dot_product_attention(u, u, u).transpose(1, 2).reshape(BATCH, 5, EMBED)
    reference = module.out_proj(reference)
    for need_weights in (False, True):
        torch.testing.assert_close(module(x, need_weights=need_weights)[0], reference)


def test_shared_qkv_cross_attention_projects_query_and_memory_with_one_matrix():
    torch.manual_seed(0)
    module = MultiHeadAttention(EMBED, HEADS, shared_qkv=True, dtype=F64)
    query, memory, other = (torch.randn(BATCH, n, EMBED, dtype=F64) for n in (3, 6, 6))

    def heads(t):
        projected = F.linear(t, module.in_proj.shared.weight, module.in_proj.shared.bias)
        return projected.view(BATCH, -1, HEADS, EMBED // HEADS).transpose(1, 2)

    for value in (memory, other):
        attended = F.scaled_dot_product_attention(heads(query), heads(memory), heads(value))
        reference = module.out_proj(attended.transpose(1, 2).reshape(BATCH, 3, EMBED))
        torch.testing.assert_close(module(query, memory, value)[0], reference)


# --- from_torch and constructor / input validation --------------------------------------------

def test_from_torch_copies_settings_and_training_flag():
    theirs = nn.MultiheadAttention(EMBED, HEADS, dropout=0.25, batch_first=False).eval()
    ours = MultiHeadAttention.from_torch(theirs)
    assert (ours.dropout, ours.batch_first, ours.training) == (0.25, False, False)
    assert ours.out_proj.weight.data_ptr() != theirs.out_proj.weight.data_ptr()


@pytest.mark.parametrize(("kwargs", "match"), [({"add_bias_kv": True}, "add_bias_kv"),
                                                ({"add_zero_attn": True}, "add_zero_attn")])
def test_from_torch_rejects_unsupported_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(EMBED, HEADS, **kwargs))


def test_from_torch_rejects_other_modules():
    with pytest.raises(TypeError, match="module"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"embed_dim": 10, "num_heads": 4}, "divisible by num_heads"),
    ({"embed_dim": 0, "num_heads": 1}, "embed_dim"),
    ({"embed_dim": 8, "num_heads": 2, "dropout": 1.0}, "dropout"),
    ({"embed_dim": 8, "num_heads": 2, "shared_qkv": True, "kdim": 4}, "shared_qkv.*kdim"),
    ({"embed_dim": 8, "num_heads": 2, "shared_qkv": True, "vdim": 4}, "shared_qkv.*vdim"),
])
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(**kwargs)


def _call(module, query, key=None, value=None, **kwargs):
    return module(query, key, value, **kwargs)


@pytest.mark.parametrize(("make_args", "error", "match"), [
    (lambda: (torch.randn(2, 3, 4, 16),), ValueError, r"query must have shape \(batch, L, 16\)"),
    (lambda: (torch.randn(2, 3, 15),), ValueError, "query must have 16 features"),
    (lambda: (torch.randn(2, 3, 16), torch.randn(2, 4, 6)), ValueError, "key must have 16 features"),
    (lambda: (torch.randn(2, 3, 16), torch.randn(2, 4, 16), torch.randn(2, 5, 16)), ValueError,
     "key and value must agree"),
    (lambda: (torch.randn(2, 3, 16), torch.randn(3, 4, 16)), ValueError, "same batch size"),
    (lambda: (torch.randn(2, 3, 16), torch.randn(4, 16)), ValueError, "key must have the rank"),
    (lambda: (torch.randint(0, 3, (2, 3, 16)),), TypeError, "query must be floating point"),
])
def test_input_errors(make_args, error, match):
    module = MultiHeadAttention(16, 4)
    with pytest.raises(error, match=match):
        _call(module, *make_args())


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"attn_mask": torch.ones(3, 5, dtype=torch.bool)}, ValueError, r"attn_mask of shape \(3, 5\)"),
    ({"attn_mask": torch.ones(2, 3, 3, 4, dtype=torch.bool)}, ValueError, "attn_mask of shape"),
    ({"attn_mask": torch.ones(3, 4, dtype=torch.int64)}, TypeError, "attn_mask must be boolean"),
    ({"attn_mask": torch.full((3, 4), float("nan"))}, ValueError, "attn_mask contains NaN"),
    ({"attn_mask": torch.ones(8, 3, 4, dtype=torch.bool)}, ValueError, r"\(batch \* heads, L, S\)"),
    ({"key_mask": torch.ones(2, 5, dtype=torch.bool)}, ValueError, r"key_mask must have shape \(batch, S\)"),
    ({"key_mask": torch.ones(2, 4)}, TypeError, "key_mask must be boolean"),
    ({"key_mask": [[True] * 4] * 2}, TypeError, "key_mask must be a tensor"),
])
def test_mask_errors(kwargs, error, match):
    module = MultiHeadAttention(16, 4)
    with pytest.raises(error, match=match):
        module(torch.randn(2, 3, 16), torch.randn(2, 4, 16), **kwargs)


def test_per_head_mask_broadcasts_over_batch():
    """A (1, h, L, S) mask broadcasts to (b, h, L, S): every head masked its own way."""
    ours, theirs = _torch_pair()
    x, _, _ = _inputs()
    allowed = _allowed(5, 5, seed=7, shape=(HEADS, 5, 5))
    torch_mask = (~allowed).repeat(BATCH, 1, 1)  # torch wants (b * h, L, S)
    _compare(ours, theirs, x, x, x, {"attn_mask": allowed.unsqueeze(0), "need_weights": True},
             {"attn_mask": torch_mask, "need_weights": True})


@pytest.mark.parametrize("batch", [1, 2, HEADS, HEADS + 1])
def test_a_3d_mask_of_several_slices_is_refused_at_every_batch_size(batch):
    """A per-head (h, L, S) mask was refused only when the batch equalled the heads (as ambiguous
    with a per-example mask): a run failed on its one short last batch of that size. Now refused
    at every batch size of batched inputs, naming the 4-D forms; unbatched, it is torch's
    (h, L, S) and taken."""
    torch.manual_seed(0)
    ours, theirs = _torch_pair()
    allowed = _allowed(5, 5, seed=7, shape=(HEADS, 5, 5))
    with pytest.raises(ValueError, match=r"3-D with 4 slices.*\(batch, 1, L, S\).*\(1, heads, L, S\)"):
        ours(torch.randn(batch, 5, EMBED, dtype=F64), attn_mask=allowed)
    x = torch.randn(5, EMBED, dtype=F64, requires_grad=True)
    _compare(ours, theirs, x, x, x, {"attn_mask": allowed, "need_weights": True},
             {"attn_mask": ~allowed, "need_weights": True})


@pytest.mark.parametrize("batch", [2, HEADS])
def test_a_3d_mask_of_one_slice_is_one_mask_for_every_example_and_head(batch):
    """``(1, L, S)`` is not ambiguous: it is taken at every batch size, as the 2-D mask it
    broadcasts like (torch's own layout repeats it per example and head); mutation review: a
    refusal of every 3-D mask on batched inputs went unnoticed."""
    ours, theirs = _torch_pair()
    allowed = _allowed(5, 5, seed=7)
    x = torch.randn(batch, 5, EMBED, dtype=F64, requires_grad=True)
    _compare(ours, theirs, x, x, x, {"attn_mask": allowed[None], "need_weights": True},
             {"attn_mask": (~allowed).repeat(batch * HEADS, 1, 1), "need_weights": True})


def test_inputs_of_another_dtype_than_the_parameters_are_named_unless_autocast():
    module = MultiHeadAttention(EMBED, HEADS)
    x = torch.randn(BATCH, 5, EMBED)
    with pytest.raises(TypeError, match="query has dtype torch.float64 but the module's parameters"):
        module(x.double())
    with pytest.raises(TypeError, match="value has dtype torch.float64"):
        module(x, x, x.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = module(x.bfloat16())
    assert out.dtype == torch.bfloat16
    out64, _ = module.double()(x.double())  # a module converted with its inputs
    assert out64.dtype == torch.float64


# (2, 2): the smallest batch the check must refuse, where it broadcasts silently (mutation review)
@pytest.mark.parametrize(("batch", "heads"), [(HEADS, HEADS), (3, HEADS), (2, 2)])
def test_a_3d_mask_of_one_slice_per_example_is_refused(batch, heads):
    # (b, L, S) would broadcast as (h, L, S) when b == h: silently per head, not per example.
    module = MultiHeadAttention(EMBED, heads)
    with pytest.raises(ValueError, match=r"\(batch, 1, L, S\)"):
        module(torch.randn(batch, 5, EMBED), attn_mask=torch.ones(batch, 5, 5, dtype=torch.bool))
    allowed = _allowed(5, 5, seed=3, shape=(batch, 5, 5))
    per_example, _ = module(torch.randn(batch, 5, EMBED), attn_mask=allowed.unsqueeze(1))
    assert per_example.shape == (batch, 5, EMBED)


class _RecordOps(TorchDispatchMode):
    """Records the aten ops that compute something (views and detaches left out)."""

    VIEWS = ("view", "transpose", "split", "chunk", "slice", "select", "unsqueeze", "expand",
             "permute", "alias", "detach", "aten.t.", "as_strided", "_reshape_alias")

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not any(view in str(func) for view in self.VIEWS):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_backward_runs_exactly_the_ops_of_raw_sdpa(is_causal):
    """Against the few lines everyone would write (packed Linear, SDPA, Linear): not one extra
    copy, mask or kernel, forward or backward. This is what keeps the module within noise of raw
    SDPA in benchmarks/attention.py."""
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(32, 4, batch_first=True)
    ours = MultiHeadAttention.from_torch(theirs)

    def raw(x):
        batch, length, embed = x.shape
        q, k, v = F.linear(x, theirs.in_proj_weight, theirs.in_proj_bias).split(embed, dim=2)
        q, k, v = (t.view(batch, length, 4, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return theirs.out_proj(y.transpose(1, 2).reshape(batch, length, embed))

    x = torch.randn(2, 16, 32)
    with _RecordOps() as ours_ops:
        ours(x.clone().requires_grad_(), is_causal=is_causal)[0].sum().backward()
    with _RecordOps() as raw_ops:
        raw(x.clone().requires_grad_()).sum().backward()
    assert ours_ops.ops == raw_ops.ops
    assert any("flash_attention" in op for op in ours_ops.ops)
