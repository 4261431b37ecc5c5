"""Every constructor option of the attention modules takes effect, shown with a non-default value.

Each test sets one option away from its default and compares against an independent reference:
PyTorch's own modules (with the same weights and, for dropout, the same random stream) or the
formula written out with ``torch.nn.functional``. Options already covered elsewhere (``kdim`` /
``vdim``, ``bias``, ``batch_first``, ``shared_qkv`` against torch; ``iterations``,
``normalize_over`` and ``aggregation`` against the plain routing loop; ``norm_first``,
``activation`` and ``dim_feedforward`` of the layers against torch) are not repeated here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchvote.nn import (
    AdditiveAttention,
    LuongAttention,
    MultiHeadAttention,
    RoutingAttention,
    TransformerDecoder,
    TransformerEncoder,
    TransformerEncoderLayer,
)

F64 = torch.float64
EMBED, HEADS = 8, 2


def _x(batch=2, length=5, features=EMBED, seed=0):
    return torch.randn(batch, length, features, dtype=F64, generator=torch.Generator().manual_seed(seed))


# --- dropout: the same random stream as torch, in training mode only ------------------------------


@pytest.mark.parametrize("need_weights", [False, True])
def test_multi_head_attention_dropout_matches_torch_in_training(need_weights):
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(EMBED, HEADS, dropout=0.5, batch_first=True, dtype=F64)
    ours = MultiHeadAttention.from_torch(theirs)
    x = _x()
    torch.manual_seed(7)
    expected, _ = theirs(x, x, x, need_weights=need_weights)
    torch.manual_seed(7)
    output, _ = ours(x, need_weights=need_weights)
    torch.testing.assert_close(output, expected, rtol=1e-10, atol=1e-10)
    without_dropout, _ = MultiHeadAttention.from_torch(theirs.eval())(x)
    assert not torch.allclose(output, without_dropout)  # the option acts in training mode
    torch.testing.assert_close(ours.eval()(x)[0], without_dropout)  # and not in eval mode


@pytest.mark.parametrize("need_weights", [False, True])
def test_routing_attention_dropout_with_one_pass_matches_multi_head_attention(need_weights):
    torch.manual_seed(0)
    softmax = MultiHeadAttention(EMBED, HEADS, dropout=0.4).double()
    routing = RoutingAttention(EMBED, HEADS, iterations=1, dropout=0.4).double()
    routing.load_state_dict(softmax.state_dict())
    x = _x()
    torch.manual_seed(3)
    expected, _ = softmax(x, need_weights=need_weights)
    torch.manual_seed(3)
    output, _ = routing(x, need_weights=need_weights)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(output, routing.eval()(x)[0])


def test_routing_attention_dropout_acts_on_every_pass():
    """With dropout on the weights of every pass, two passes differ from a plain loop without it."""
    torch.manual_seed(0)
    routing = RoutingAttention(EMBED, HEADS, iterations=2, dropout=0.3).double()
    quiet = RoutingAttention(EMBED, HEADS, iterations=2, dropout=0.0).double()
    quiet.load_state_dict(routing.state_dict())
    x = _x()
    torch.testing.assert_close(routing.eval()(x)[0], quiet.eval()(x)[0])
    routing.train()
    assert not torch.allclose(routing(x)[0], quiet(x)[0])


def _scored_reference(module, query, key, value, p):
    scores = module.score(query, key)  # (b, i, j)
    return F.dropout(torch.softmax(scores, dim=-1), p=p) @ value  # (b, i, d)


@pytest.mark.parametrize(
    "make",
    [
        lambda: AdditiveAttention(5, 3, 6, dropout=0.5),
        lambda: LuongAttention(5, 3, score="general", dropout=0.5),
        lambda: LuongAttention(5, 3, score="concat", hidden_dim=4, dropout=0.5),
    ],
    ids=["additive", "luong-general", "luong-concat"],
)
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_scored_attention_dropout_matches_the_formula_in_training(make, layout, monkeypatch):
    """``permuted``: scores laid out transposed in memory, as ``torch.einsum`` returns Luong's
    three-operand general score where opt_einsum is installed; the dropout mask, drawn in memory
    order, differed from the formula's then."""
    torch.manual_seed(0)
    module = make().double()
    if layout == "permuted":
        score = module.score
        monkeypatch.setattr(module, "score", lambda q, k: score(q, k).mT.contiguous().mT)
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 3, 5, dtype=F64, generator=generator)
    key = torch.randn(2, 4, 3, dtype=F64, generator=generator)
    value = torch.randn(2, 4, 6, dtype=F64, generator=generator)
    torch.manual_seed(5)
    expected = _scored_reference(module, query, key, value, 0.5)
    torch.manual_seed(5)
    context, _ = module(query, key, value)
    torch.testing.assert_close(context, expected, rtol=1e-12, atol=1e-12)
    module.eval()
    expected_eval = _scored_reference(module, query, key, value, 0.0)
    torch.testing.assert_close(module(query, key, value)[0], expected_eval)


def test_luong_concat_hidden_dim_sets_the_score_size():
    module = LuongAttention(5, 3, score="concat", hidden_dim=9)
    assert module.concat_proj.weight.shape == (9, 8) and module.vector.shape == (9,)
    assert LuongAttention(5, 3, score="concat").concat_proj.weight.shape == (5, 8)  # default: query_dim


# --- transformer layers and stacks against torch ---------------------------------------------------


def _torch_encoder_layer(**options):
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(
        EMBED, HEADS, dim_feedforward=12, batch_first=True, dtype=F64, **options
    )
    with torch.no_grad():
        for parameter in theirs.parameters():
            if parameter.dim() == 1:
                parameter.normal_()
    ours = TransformerEncoderLayer(
        EMBED, HEADS, dim_feedforward=12, **options
    ).double()
    ours.self_attention = MultiHeadAttention.from_torch(theirs.self_attn)
    ours.feedforward.expand.load_state_dict(theirs.linear1.state_dict())
    ours.feedforward.contract.load_state_dict(theirs.linear2.state_dict())
    ours.attention_norm.load_state_dict(theirs.norm1.state_dict())
    ours.feedforward_norm.load_state_dict(theirs.norm2.state_dict())
    return ours, theirs


@pytest.mark.parametrize("norm_first", [False, True])
def test_layer_norm_eps_matches_torch(norm_first):
    ours, theirs = _torch_encoder_layer(layer_norm_eps=0.5, norm_first=norm_first, dropout=0.0)
    x = _x(seed=2) * 0.1  # small activations, where a large epsilon shows
    torch.testing.assert_close(ours.eval()(x), theirs.eval()(x), rtol=1e-10, atol=1e-10)
    default, _ = _torch_encoder_layer(norm_first=norm_first, dropout=0.0)
    default.load_state_dict(ours.state_dict())
    assert not torch.allclose(default.eval()(x), ours(x))


def test_encoder_layer_dropout_acts_in_training_only():
    ours, theirs = _torch_encoder_layer(dropout=0.3)
    x = _x(seed=3)
    torch.testing.assert_close(ours.eval()(x), theirs.eval()(x), rtol=1e-10, atol=1e-10)
    ours.train()
    assert not torch.allclose(ours(x), theirs.eval()(x))
    assert not torch.allclose(ours(x), ours(x))  # a new mask every call


def test_stack_final_norm_and_its_epsilon_match_torch():
    ours_layer, their_layer = _torch_encoder_layer(dropout=0.0)  # post-norm: no final norm by default
    theirs = nn.TransformerEncoder(
        their_layer, 1, norm=nn.LayerNorm(EMBED, eps=0.25, dtype=F64), enable_nested_tensor=False
    ).eval()
    ours = TransformerEncoder(lambda: ours_layer, 1, final_norm=True, layer_norm_eps=0.25).double().eval()
    assert isinstance(ours.norm, nn.LayerNorm) and ours.norm.eps == 0.25
    theirs.layers[0].load_state_dict(their_layer.state_dict())
    x = _x(seed=4)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-10, atol=1e-10)
    pre_norm = TransformerDecoder(lambda: nn.Identity(), 1, final_norm=False)
    assert isinstance(pre_norm.norm, nn.Identity)  # final_norm=False is honoured too


def test_encoder_layer_return_intermediates_matches_the_attention_called_directly():
    ours, _ = _torch_encoder_layer(dropout=0.0, norm_first=True)
    x = _x(seed=5)
    output, record = ours.eval()(x, return_intermediates=True)
    torch.testing.assert_close(output, ours(x))
    expected = ours.self_attention(ours.attention_norm(x), need_weights=True)[1]
    torch.testing.assert_close(record.weights["self_attention"], expected)
    assert record.last is record.weights["self_attention"]
