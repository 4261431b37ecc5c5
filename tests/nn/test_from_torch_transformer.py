"""``from_torch`` on the Transformer layers and stacks: torch.nn's modules are the reference.

Float64, eval mode. Masks translated as MultiHeadAttention's docstring says: torch's bool masks
(True = blocked) become ``~mask`` (True = may attend), a causal mask ``is_causal=True``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchvote.nn import (
    MultiHeadAttention,
    RoutingAttention,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
    attention_factory,
)

from .test_transformer import D_MODEL, F64, FEEDFORWARD, HEADS, _assert_same_with_grads, _padding, _randomise

LAYERS = 2


def _torch_layer(torch_class=nn.TransformerEncoderLayer, **options):
    settings = {"dim_feedforward": FEEDFORWARD, "dropout": 0.1, "batch_first": True, "dtype": F64}
    return torch_class(D_MODEL, HEADS, **(settings | options))


def _torch_stack(torch_class, layer_class, norm_first, activation, final_norm):
    """A float64 torch stack whose layers differ from each other, with random biases and affines."""
    torch.manual_seed(0)
    layer = _torch_layer(layer_class, norm_first=norm_first, activation=activation)
    norm = nn.LayerNorm(D_MODEL, eps=1e-3, dtype=F64) if final_norm else None
    options = {"enable_nested_tensor": False} if torch_class is nn.TransformerEncoder else {}
    stack = torch_class(layer, LAYERS, norm=norm, **options)
    with torch.no_grad():
        for parameter in stack.parameters():  # the layers are deep copies of one: make them differ
            parameter.add_(0.1 * torch.randn_like(parameter))
    _randomise(stack)
    return stack.eval()


def _causal(length):
    return torch.ones(length, length, dtype=torch.bool).triu(1)  # torch's: True = blocked


STACK_CASES = pytest.mark.parametrize(
    ("norm_first", "activation", "final_norm"),
    [(norm_first, activation, final_norm) for norm_first in (False, True)
     for activation in ("relu", "gelu") for final_norm in (False, True)],
)


@STACK_CASES
def test_encoder_stack_matches_torch(norm_first, activation, final_norm):
    theirs = _torch_stack(nn.TransformerEncoder, nn.TransformerEncoderLayer, norm_first, activation,
                          final_norm)
    ours = TransformerEncoder.from_torch(theirs)
    assert isinstance(ours.norm, nn.LayerNorm if final_norm else nn.Identity)
    inputs = torch.randn(2, 6, D_MODEL, dtype=F64)
    padding = _padding(2, 6)
    _assert_same_with_grads(ours, theirs, [inputs])
    _assert_same_with_grads(lambda x: ours(x, key_mask=~padding),
                            lambda x: theirs(x, src_key_padding_mask=padding), [inputs])
    _assert_same_with_grads(lambda x: ours(x, key_mask=~padding, is_causal=True),
                            lambda x: theirs(x, mask=_causal(6), src_key_padding_mask=padding), [inputs])


@STACK_CASES
def test_decoder_stack_matches_torch(norm_first, activation, final_norm):
    theirs = _torch_stack(nn.TransformerDecoder, nn.TransformerDecoderLayer, norm_first, activation,
                          final_norm)
    ours = TransformerDecoder.from_torch(theirs)
    target, memory = torch.randn(2, 5, D_MODEL, dtype=F64), torch.randn(2, 7, D_MODEL, dtype=F64)
    target_padding, memory_padding = _padding(2, 5), _padding(2, 7)
    # torch's decoder is causal when given the causal mask, ours by default
    _assert_same_with_grads(ours, lambda t, m: theirs(t, m, tgt_mask=_causal(5)), [target, memory])
    _assert_same_with_grads(lambda t, m: ours(t, m, is_causal=False), theirs, [target, memory])
    _assert_same_with_grads(
        lambda t, m: ours(t, m, target_key_mask=~target_padding, memory_key_mask=~memory_padding),
        lambda t, m: theirs(t, m, tgt_mask=_causal(5), tgt_key_padding_mask=target_padding,
                            memory_key_padding_mask=memory_padding),
        [target, memory])


@pytest.mark.parametrize(("activation", "name"), [
    ("relu", "relu"), (F.relu, "relu"), (torch.relu, "relu"), (nn.ReLU(), "relu"),
    ("gelu", "gelu"), (F.gelu, "gelu"), (nn.GELU(), "gelu"), (nn.GELU(approximate="none"), "gelu"),
])
def test_every_form_of_relu_and_gelu_is_copied(activation, name):
    torch.manual_seed(0)
    theirs = _torch_layer(activation=activation).eval()
    _randomise(theirs)
    ours = TransformerEncoderLayer.from_torch(theirs)
    assert ours.feedforward.activation is {"relu": F.relu, "gelu": F.gelu}[name]
    _assert_same_with_grads(ours, theirs, [torch.randn(2, 6, D_MODEL, dtype=F64)])


def test_sequence_first_layers_are_copied_only_when_allowed():
    torch.manual_seed(0)
    theirs = nn.TransformerEncoder(_torch_layer(batch_first=False), LAYERS, enable_nested_tensor=False)
    with pytest.raises(ValueError, match=r"layers\.0: .*self_attn\.batch_first=False.*allow_sequence_first"):
        TransformerEncoder.from_torch(theirs)
    ours = TransformerEncoder.from_torch(theirs.eval(), allow_sequence_first=True)
    inputs = torch.randn(2, 6, D_MODEL, dtype=F64)  # (b, T, E); torch's take (T, b, E)
    _assert_same_with_grads(ours, lambda x: theirs(x.transpose(0, 1)).transpose(0, 1), [inputs])

    decoder = _torch_layer(nn.TransformerDecoderLayer, batch_first=False).eval()
    ours_decoder = TransformerDecoderLayer.from_torch(decoder, allow_sequence_first=True)
    target, memory = torch.randn(2, 5, D_MODEL, dtype=F64), torch.randn(2, 7, D_MODEL, dtype=F64)
    _assert_same_with_grads(
        lambda t, m: ours_decoder(t, m, is_causal=False),
        lambda t, m: decoder(t.transpose(0, 1), m.transpose(0, 1)).transpose(0, 1), [target, memory])


@pytest.mark.parametrize("training", [False, True])
def test_copy_follows_the_source_device_dtype_and_mode(device, training):
    torch.manual_seed(0)
    theirs = nn.TransformerDecoder(
        _torch_layer(nn.TransformerDecoderLayer, dtype=torch.float32, device=device, dropout=0.25,
                     layer_norm_eps=1e-3),
        LAYERS, norm=nn.LayerNorm(D_MODEL, eps=1e-4, device=device),
    ).train(training)
    ours = TransformerDecoder.from_torch(theirs)
    assert ours.training is training
    layer = ours.layers[1]  # the settings that no parameter shows
    assert layer.dropout.p == layer.feedforward.dropout.p == 0.25
    assert layer.self_attention.dropout == layer.cross_attention.dropout == 0.25
    assert layer.self_attention_norm.eps == layer.feedforward_norm.eps == 1e-3 and ours.norm.eps == 1e-4
    assert layer.feedforward.expand.out_features == FEEDFORWARD
    assert all(module.training is training for module in ours.modules())
    for parameter in ours.parameters():
        assert parameter.device == device and parameter.dtype == torch.float32
    # parameter for parameter the same numbers, under the names the class docstring gives
    renamed = {"self_attention.": "self_attn.", "cross_attention.": "multihead_attn.",
               "feedforward.expand": "linear1", "feedforward.contract": "linear2",
               "self_attention_norm": "norm1", "cross_attention_norm": "norm2",
               "feedforward_norm": "norm3", "in_proj.weight": "in_proj_weight",
               "in_proj.bias": "in_proj_bias"}
    their_state = theirs.state_dict()
    ours_state = ours.state_dict()
    assert len(ours_state) == len(their_state)
    for name, value in ours_state.items():
        for mine, torch_name in renamed.items():
            name = name.replace(mine, torch_name)
        torch.testing.assert_close(value, their_state[name], rtol=0, atol=0)
    with torch.no_grad():  # a copy: a later change to torch's stack does not carry over
        theirs.layers[0].linear1.weight.zero_()
    assert ours.layers[0].feedforward.expand.weight.abs().sum() > 0


def test_attention_factory_turns_the_copied_attention_into_routing():
    torch.manual_seed(0)
    theirs = _torch_stack(nn.TransformerEncoder, nn.TransformerEncoderLayer, True, "relu", True)
    inputs = torch.randn(2, 6, D_MODEL, dtype=F64)
    one_pass = TransformerEncoder.from_torch(theirs, attention=attention_factory("routing", iterations=1))
    _assert_same_with_grads(one_pass, theirs, [inputs])  # one pass of voting is attention

    routed = TransformerEncoder.from_torch(theirs, attention=attention_factory("routing", iterations=3))
    softmax = TransformerEncoder.from_torch(theirs)
    for layer, reference in zip(routed.layers, softmax.layers, strict=True):
        assert isinstance(layer.self_attention, RoutingAttention)
        assert layer.self_attention.iterations == 3
        for (name, value), (_, expected) in zip(layer.state_dict().items(),
                                                reference.state_dict().items(), strict=True):
            torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)
    inputs.requires_grad_()
    output = routed(inputs)
    assert not torch.allclose(output, softmax(inputs))  # the agreement passes change the votes
    output.sum().backward()
    assert torch.isfinite(inputs.grad).all()

    decoder = _torch_layer(nn.TransformerDecoderLayer).eval()
    routed_decoder = TransformerDecoderLayer.from_torch(
        decoder, attention=attention_factory("routing", iterations=1)
    )
    assert isinstance(routed_decoder.cross_attention, RoutingAttention)
    _assert_same_with_grads(lambda t, m: routed_decoder(t, m, is_causal=False), decoder,
                            [torch.randn(2, 5, D_MODEL, dtype=F64), torch.randn(2, 7, D_MODEL, dtype=F64)])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_torch_fast_path_agrees_at_the_real_positions():
    """Torch's encoder runs nested tensors in inference with padding: zeros where ours computes."""
    torch.manual_seed(0)
    theirs = nn.TransformerEncoder(_torch_layer(), LAYERS).eval()
    _randomise(theirs)
    ours = TransformerEncoder.from_torch(theirs)
    inputs, padding = torch.randn(2, 6, D_MODEL, dtype=F64), _padding(2, 6)
    with torch.no_grad():
        expected = theirs(inputs, src_key_padding_mask=padding)
        output = ours(inputs, key_mask=~padding)
    torch.testing.assert_close(output[~padding], expected[~padding], rtol=1e-10, atol=1e-10)


def _set(module, **attributes):
    for path, value in attributes.items():
        *parents, name = path.split("__")
        target = module
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)
    return module


class _OwnForward(nn.TransformerEncoderLayer):
    def forward(self, src, *args, **kwargs):
        return 2 * super().forward(src, *args, **kwargs)


def _no_params(embed_dim, num_heads, *, dropout, **factory):
    return nn.Identity()


_LAYER_ERRORS = [
    (lambda: _torch_layer(activation=nn.GELU(approximate="tanh")), ValueError,
     r"activation=GELU\(approximate='tanh'\)"),
    (lambda: _torch_layer(activation=torch.tanh), ValueError, "activation=.*not supported"),
    (lambda: _torch_layer(activation=nn.SiLU()), ValueError, "activation=SiLU"),
    (lambda: _torch_layer(bias=False), ValueError, r"bias=False .*self_attn"),
    (lambda: _set(_torch_layer(), linear2=nn.Linear(FEEDFORWARD, D_MODEL, bias=False, dtype=F64)),
     ValueError, r"bias=False .*linear2"),
    (lambda: _set(_torch_layer(), norm2=nn.LayerNorm(D_MODEL, bias=False, dtype=F64)), ValueError,
     r"bias=False .*norm2"),
    (lambda: _set(_torch_layer(), norm1=nn.LayerNorm(D_MODEL, elementwise_affine=False)), ValueError,
     r"norm1\.elementwise_affine=False"),
    (lambda: _set(_torch_layer(), norm1=nn.Identity()), ValueError, "norm1 must be an nn.LayerNorm"),
    (lambda: _set(_torch_layer(), norm2__eps=1e-3), ValueError, r"norm1\.eps=1e-05, norm2\.eps=0\.001"),
    (lambda: _set(_torch_layer(), dropout1__p=0.2), ValueError, r"dropout probabilities.*dropout1\.p=0\.2"),
    (lambda: _set(_torch_layer(), self_attn__dropout=0.3), ValueError, r"self_attn\.dropout=0\.3"),
    (lambda: _set(_torch_layer(), dropout=nn.Identity()), ValueError, "dropout must be an nn.Dropout"),
    (lambda: _set(_torch_layer(), self_attn=nn.MultiheadAttention(D_MODEL, HEADS, add_bias_kv=True,
                                                                   batch_first=True, dtype=F64)),
     ValueError, "self_attn: .*add_bias_kv"),
    (lambda: _set(_torch_layer(), self_attn=nn.Linear(2, 2)), TypeError, "self_attn: .*MultiheadAttention"),
    (lambda: _OwnForward(D_MODEL, HEADS, batch_first=True), ValueError, "_OwnForward overrides .*forward"),
]
_DECODER_ERRORS = [
    (lambda: _set(_torch_layer(nn.TransformerDecoderLayer), multihead_attn=nn.MultiheadAttention(
        D_MODEL, HEADS, kdim=8, vdim=8, batch_first=True, dtype=F64)), ValueError, "multihead_attn .*kdim=8"),
    (lambda: _set(_torch_layer(nn.TransformerDecoderLayer), multihead_attn=nn.MultiheadAttention(
        D_MODEL, 2, batch_first=True, dtype=F64)), ValueError, "multihead_attn .*num_heads=2"),
    (lambda: _set(_torch_layer(nn.TransformerDecoderLayer), dropout3__p=0.0), ValueError,
     r"dropout3\.p=0\.0"),
    (lambda: _set(_torch_layer(nn.TransformerDecoderLayer), norm3__eps=1e-6), ValueError, r"norm3\.eps"),
    (lambda: _set(_torch_layer(nn.TransformerDecoderLayer), multihead_attn__batch_first=False), ValueError,
     r"layouts differ \(self_attn\.batch_first=True, multihead_attn\.batch_first=False\)"),
]


@pytest.mark.parametrize(("make", "error", "match"), _LAYER_ERRORS)
def test_what_the_encoder_layer_cannot_express_is_refused(make, error, match):
    with pytest.raises(error, match=match):
        TransformerEncoderLayer.from_torch(make())


@pytest.mark.parametrize(("make", "error", "match"), _DECODER_ERRORS)
def test_what_the_decoder_layer_cannot_express_is_refused(make, error, match):
    with pytest.raises(error, match=match):
        TransformerDecoderLayer.from_torch(make())


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: TransformerEncoderLayer.from_torch(_torch_layer(nn.TransformerDecoderLayer)), TypeError,
     "module must be a torch.nn.TransformerEncoderLayer, got TransformerDecoderLayer"),
    (lambda: TransformerDecoderLayer.from_torch(nn.MultiheadAttention(D_MODEL, HEADS)), TypeError,
     "torch.nn.TransformerDecoderLayer"),
    (lambda: TransformerEncoder.from_torch(_torch_layer()), TypeError, "torch.nn.TransformerEncoder"),
    (lambda: TransformerEncoderLayer.from_torch(_torch_layer(), allow_sequence_first="yes"), TypeError,
     "allow_sequence_first"),
    (lambda: TransformerEncoderLayer.from_torch(_torch_layer(), attention=_no_params), ValueError,
     "attention factory's Identity does not take MultiHeadAttention's parameters"),
    (lambda: TransformerEncoder.from_torch(nn.TransformerEncoder(
        _torch_layer(), LAYERS, norm=nn.RMSNorm(D_MODEL), enable_nested_tensor=False)), ValueError,
     "norm must be an nn.LayerNorm"),
    (lambda: TransformerDecoder.from_torch(nn.TransformerDecoder(
        _torch_layer(nn.TransformerDecoderLayer), LAYERS, norm=nn.LayerNorm(D_MODEL, bias=False))),
     ValueError, r"bias=False is not supported \(norm has no bias\)"),
    (lambda: TransformerEncoder.from_torch(_set(nn.TransformerEncoder(
        _torch_layer(), LAYERS, enable_nested_tensor=False), layers=nn.ModuleList([
            _torch_layer(), _torch_layer(activation=nn.GELU(approximate="tanh"))]))),
     ValueError, r"layers\.1: from_torch: activation="),
    (lambda: TransformerEncoder.from_torch(
        nn.TransformerEncoder(_torch_layer(), 0, enable_nested_tensor=False)), ValueError, "no layers"),
])
def test_other_inputs_are_refused(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_attention_copies_reuse_multihead_attention_from_torch():
    """The layer's attention holds what MultiHeadAttention.from_torch copies, nothing else."""
    theirs = _torch_layer(nn.TransformerDecoderLayer)
    ours = TransformerDecoderLayer.from_torch(theirs)
    for mine, torch_attention in ((ours.self_attention, theirs.self_attn),
                                  (ours.cross_attention, theirs.multihead_attn)):
        reference = MultiHeadAttention.from_torch(torch_attention)
        assert mine.extra_repr() == reference.extra_repr()
        for (name, value), (_, expected) in zip(mine.state_dict().items(),
                                                reference.state_dict().items(), strict=True):
            torch.testing.assert_close(value, expected, rtol=0, atol=0, msg=name)
