"""Transformer layers and stacks against torch.nn's with copied weights (eval mode, float64)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from torchvote.nn import (
    RoutingAttention,
    TransformerConfig,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

F64 = torch.float64
D_MODEL, HEADS, FEEDFORWARD = 16, 4, 24


def _randomise(module: nn.Module) -> None:
    """Random biases and norm affines, so a mis-copied parameter shows."""
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.dim() == 1:
                parameter.normal_()


def _torch_layer(torch_class, norm_first, activation="relu"):
    """A float64 torch layer with random biases and norm affines, in eval mode."""
    torch.manual_seed(0)
    theirs = torch_class(D_MODEL, HEADS, dim_feedforward=FEEDFORWARD, dropout=0.1,
                         activation=activation, norm_first=norm_first, batch_first=True, dtype=F64)
    _randomise(theirs)
    return theirs.eval()


def _encoder_pair(norm_first, activation="relu"):
    theirs = _torch_layer(nn.TransformerEncoderLayer, norm_first, activation)
    return TransformerEncoderLayer.from_torch(theirs), theirs


def _decoder_pair(norm_first, activation="relu"):
    theirs = _torch_layer(nn.TransformerDecoderLayer, norm_first, activation)
    return TransformerDecoderLayer.from_torch(theirs), theirs


def _padding(batch, length):
    padding = torch.zeros(batch, length, dtype=torch.bool)
    padding[1, -2:] = True
    return padding


def _assert_same_with_grads(ours_fn, theirs_fn, inputs):
    ours_inputs = [t.clone().requires_grad_() for t in inputs]
    their_inputs = [t.clone().requires_grad_() for t in inputs]
    ours_out, their_out = ours_fn(*ours_inputs), theirs_fn(*their_inputs)
    torch.testing.assert_close(ours_out, their_out, rtol=1e-10, atol=1e-10)
    ours_out.pow(2).sum().backward()
    their_out.pow(2).sum().backward()
    for mine, reference in zip(ours_inputs, their_inputs, strict=True):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_encoder_layer_matches_torch(norm_first, activation):
    ours, theirs = _encoder_pair(norm_first, activation)
    inputs = torch.randn(2, 6, D_MODEL, dtype=F64)
    padding = _padding(2, 6)
    _assert_same_with_grads(lambda x: ours(x), lambda x: theirs(x), [inputs])
    _assert_same_with_grads(lambda x: ours(x, key_mask=~padding),
                            lambda x: theirs(x, src_key_padding_mask=padding), [inputs])
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=F64)
    _assert_same_with_grads(lambda x: ours(x, is_causal=True),
                            lambda x: theirs(x, src_mask=causal), [inputs])


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_decoder_layer_matches_torch(norm_first):
    ours, theirs = _decoder_pair(norm_first)
    target, memory = torch.randn(2, 5, D_MODEL, dtype=F64), torch.randn(2, 7, D_MODEL, dtype=F64)
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    target_padding, memory_padding = _padding(2, 5), _padding(2, 7)
    _assert_same_with_grads(lambda t, m: ours(t, m),
                            lambda t, m: theirs(t, m, tgt_mask=causal), [target, memory])
    _assert_same_with_grads(
        lambda t, m: ours(t, m, target_key_mask=~target_padding, memory_key_mask=~memory_padding),
        lambda t, m: theirs(t, m, tgt_mask=causal,
                            tgt_key_padding_mask=torch.zeros(2, 5, dtype=F64).masked_fill(
                                target_padding, float("-inf")),
                            memory_key_padding_mask=memory_padding),
        [target, memory])
    _assert_same_with_grads(lambda t, m: ours(t, m, is_causal=False),
                            lambda t, m: theirs(t, m), [target, memory])


def test_stacks_default_to_a_final_norm_for_pre_norm_layers():
    """The stacks' numbers against torch's are in test_from_torch_transformer.py."""
    pre_norm = TransformerEncoder(lambda: TransformerEncoderLayer(8, 2, norm_first=True), 2)
    assert isinstance(pre_norm.norm, nn.LayerNorm)
    post_norm = TransformerDecoder(lambda: TransformerDecoderLayer(8, 2), 2)
    assert isinstance(post_norm.norm, nn.Identity)  # post-norm layers end in a norm already


def test_config_builds_fresh_layers():
    config = TransformerConfig(d_model=8, num_heads=2, norm_first=True, shared_qkv=True, dropout=0.0)
    encoder = TransformerEncoder(config, 3)
    assert len(encoder.layers) == 3 and isinstance(encoder.norm, nn.LayerNorm)
    assert encoder.layers[0].self_attention.shared_qkv
    assert encoder.layers[0].feedforward.expand.out_features == 32  # 4 * d_model
    assert encoder.layers[0].self_attention.in_proj is not encoder.layers[1].self_attention.in_proj
    decoder = TransformerDecoder(config, 2, final_norm=False)
    assert isinstance(decoder.norm, nn.Identity)
    output = decoder(torch.randn(2, 5, 8), encoder(torch.randn(2, 3, 8)))
    assert output.shape == (2, 5, 8)


def test_decoder_is_causal_by_default():
    torch.manual_seed(0)
    layer = TransformerDecoderLayer(8, 2, dropout=0.0).eval()
    target, memory = torch.randn(1, 5, 8), torch.randn(1, 3, 8)
    changed = target.clone()
    changed[:, 3:] += 1.0  # a change in the future must not reach the past
    torch.testing.assert_close(layer(target, memory)[:, :3], layer(changed, memory)[:, :3])
    assert not torch.allclose(layer(target, memory, is_causal=False)[:, :3],
                              layer(changed, memory, is_causal=False)[:, :3])


class _Recording(nn.Module):
    """Stands in for a routing-style attention: records its calls, returns the query."""

    def __init__(self, embed_dim: int, num_heads: int, *, dropout: float) -> None:
        super().__init__()
        self.settings = (embed_dim, num_heads, dropout)
        self.calls: list[dict] = []

    def forward(self, query, key, value, *, attn_mask=None, key_mask=None, is_causal=False,
                need_weights=False):
        self.calls.append({"same": key is value, "key_mask": key_mask, "is_causal": is_causal})
        return query * 2, None


def test_attention_hook_replaces_both_attentions():
    layer = TransformerDecoderLayer(8, 2, dropout=0.0, attention=_Recording, norm_first=True)
    assert layer.self_attention.settings == (8, 2, 0.0)
    memory_key_mask = torch.ones(1, 3, dtype=torch.bool)
    layer(torch.randn(1, 4, 8), torch.randn(1, 3, 8), memory_key_mask=memory_key_mask)
    assert layer.self_attention.calls == [{"same": True, "key_mask": None, "is_causal": True}]
    assert layer.cross_attention.calls[0]["key_mask"] is memory_key_mask
    assert not layer.cross_attention.calls[0]["is_causal"]
    encoder_layer = TransformerEncoderLayer(8, 2, attention=_Recording)
    encoder_layer(torch.randn(1, 4, 8))
    assert len(encoder_layer.self_attention.calls) == 1


def test_decoder_attention_of_the_config_builds_the_decoder_layers_only():
    receivers = functools.partial(RoutingAttention, iterations=2, normalize_over="receivers",
                                  batch_first=True)
    senders = functools.partial(RoutingAttention, iterations=2, batch_first=True)
    config = TransformerConfig(8, 2, dropout=0.0, attention=receivers, decoder_attention=senders)
    encoder, decoder = TransformerEncoder(config, 2), TransformerDecoder(config, 2)
    assert [layer.self_attention.normalize_over for layer in encoder.layers] == ["receivers"] * 2
    for layer in decoder.layers:
        assert layer.self_attention.normalize_over == layer.cross_attention.normalize_over == "senders"
    default = TransformerDecoder(TransformerConfig(8, 2, attention=receivers), 1)  # falls back
    assert default.layers[0].cross_attention.normalize_over == "receivers"


def test_a_cross_attention_over_the_receivers_would_let_the_decoder_look_ahead():
    """Why decoder layers take their own factory: the cross-attention's receivers are the target
    positions, so a softmax over them sums over later positions, and a later target token changes
    the earlier outputs (with a causal self-attention over the senders). Over the senders the
    decoder stays causal."""
    torch.manual_seed(0)
    target, memory = torch.randn(1, 5, 8), torch.randn(1, 3, 8)
    changed = target.clone()
    changed[:, 3:] += 1.0
    outputs = {}
    for normalize_over in ("senders", "receivers"):
        torch.manual_seed(1)
        layer = TransformerDecoderLayer(8, 2, dropout=0.0, attention=functools.partial(
            RoutingAttention, iterations=2, normalize_over=normalize_over, batch_first=True))
        layer.self_attention = RoutingAttention(8, 2, iterations=2, batch_first=True)  # causal
        outputs[normalize_over] = layer(target, memory)[:, :3], layer(changed, memory)[:, :3]
    torch.testing.assert_close(*outputs["senders"])
    assert not torch.allclose(*outputs["receivers"], atol=1e-4)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: TransformerEncoderLayer(8, 2, attention=_Recording, shared_qkv=True), ValueError,
     "shared_qkv"),
    (lambda: TransformerEncoderLayer(8, 2, activation="tanh"), ValueError, "activation"),
    (lambda: TransformerEncoderLayer(8, 3), ValueError, "divisible by num_heads"),
    (lambda: TransformerDecoderLayer(8, 2, dropout=1.5), ValueError, "dropout"),
    (lambda: TransformerEncoderLayer(8, 2, layer_norm_eps=0.0), ValueError, "layer_norm_eps"),
    (lambda: TransformerDecoderLayer(8, 2, layer_norm_eps=-1e-5), ValueError, "layer_norm_eps"),
    (lambda: TransformerEncoder(TransformerConfig(8, 2), 0), ValueError, "num_layers"),
    (lambda: TransformerEncoder("layer", 2), TypeError, "layer must be a TransformerConfig"),
    # a layer instance, as torch.nn.TransformerEncoder takes: it was called with no input
    (lambda: TransformerEncoder(TransformerEncoderLayer(8, 2), 2), TypeError,
     "got a TransformerEncoderLayer module: pass its config, or a factory"),
    (lambda: TransformerDecoder(TransformerDecoderLayer(8, 2), 2), TypeError,
     "got a TransformerDecoderLayer"),
    (lambda: TransformerEncoder(lambda: 3, 2), TypeError,
     "the layer factory must return an nn.Module, got int"),
    # a config checked when made, not when a stack is built from it (and then named embed_dim)
    (lambda: TransformerConfig(0, 2), ValueError, "d_model must be a positive integer"),
    (lambda: TransformerConfig("8", 2), TypeError, "d_model must be a positive integer"),
    (lambda: TransformerConfig(8, 2, dropout=1.5), ValueError, "dropout"),
    (lambda: TransformerConfig(8, 2, activation="tanh"), ValueError, "activation"),
    (lambda: TransformerConfig(8, 2, attention=42), TypeError, "attention must be a callable"),
    (lambda: TransformerConfig(8, 2, decoder_attention="softmax"), TypeError, "decoder_attention must be"),
])
def test_constructor_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_factory_returning_one_module_twice_is_rejected():
    layer = TransformerEncoderLayer(8, 2)
    with pytest.raises(ValueError, match="same module twice"):
        TransformerEncoder(lambda: layer, 2)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"memory_key_mask": torch.ones(2, 5, dtype=torch.bool)}, ValueError,
         r"memory_key_mask must have shape \(batch, S\) = \(2, 4\), got \(2, 5\)"),
        ({"target_key_mask": torch.ones(2, 4, dtype=torch.bool)}, ValueError,
         r"target_key_mask must have shape \(batch, S\) = \(2, 3\), got \(2, 4\)"),
        ({"memory_mask": torch.ones(3, 5, dtype=torch.bool)}, ValueError, r"memory_mask of shape \(3, 5\)"),
        ({"target_mask": torch.ones(4, 4, dtype=torch.bool)}, ValueError, r"target_mask of shape \(4, 4\)"),
        ({"memory_key_mask": [[True]]}, TypeError, "memory_key_mask must be a tensor, got list"),
        ({"memory_key_mask": torch.ones(2, 4)}, TypeError, "memory_key_mask must be boolean"),
        ({"memory": torch.randn(2, 4, 7)}, ValueError,
         r"memory must have shape \(batch, S, d_model\) = \(2, S, 8\) .*got \(2, 4, 7\)"),
        ({"memory": torch.randn(3, 4, 8)}, ValueError, r"memory must have shape .*got \(3, 4, 8\)"),
        # None was read as "no key": the cross-attention attended over the target itself
        ({"memory": None}, TypeError, "memory must be a tensor, the encoder's output .* got NoneType"),
        ({"memory": torch.randn(2, 4, 8, dtype=torch.float64)}, TypeError,
         r"memory has dtype torch.float64 but the target's features are torch.float32"),
        ({"memory": torch.randn(2, 4, 8, device="meta")}, ValueError, "memory is on meta"),
    ],
)
def test_decoder_layer_names_its_own_arguments_in_errors(options, error, match):
    """The errors named the attentions' arguments (key_mask, attn_mask, key), not the layer's."""
    layer = TransformerDecoderLayer(8, 2, dim_feedforward=16)
    options = {"memory": torch.randn(2, 4, 8), **options}
    with pytest.raises(error, match=match):
        layer(torch.randn(2, 3, 8), **options)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize(("parameters", "inputs"), [(torch.bfloat16, torch.float32), (torch.float32, F64)])
@pytest.mark.parametrize("kind", ["encoder layer", "decoder layer", "encoder", "decoder"])
def test_inputs_of_another_dtype_than_the_parameters_are_named(kind, norm_first, parameters, inputs):
    """A pre-norm layer's first step is its layer norm, which failed deep in torch ("mixed dtype
    (CPU): expect parameter to have scalar type of Float"); post-norm layers named the attention's
    ``query``. Both name the layer's own argument now, as every other module does."""
    config = TransformerConfig(8, 2, dim_feedforward=16, dropout=0.0, norm_first=norm_first)
    build = {
        "encoder layer": lambda: TransformerEncoderLayer(8, 2, dim_feedforward=16, norm_first=norm_first),
        "decoder layer": lambda: TransformerDecoderLayer(8, 2, dim_feedforward=16, norm_first=norm_first),
        "encoder": lambda: TransformerEncoder(config, 2),
        "decoder": lambda: TransformerDecoder(config, 2),
    }[kind]
    module = build().to(parameters)
    x = torch.randn(2, 3, 8, dtype=inputs)
    memory = [torch.randn(2, 4, 8, dtype=inputs)] if kind.startswith("decoder") else []
    argument = "target" if kind.startswith("decoder") else "inputs"
    expected = f"{argument} has dtype {inputs} but the module's parameters are {parameters}"
    with pytest.raises(TypeError, match=expected):
        module(x, *memory)
    assert module(x.to(parameters), *[m.to(parameters) for m in memory]).shape == (2, 3, 8)
    # layer norms kept in float32 beside weights of another dtype (a mixed-precision recipe): the
    # inputs take the weights' dtype, as torch's layer norm allows
    for norm in (m for m in module.modules() if isinstance(m, nn.LayerNorm)):
        norm.float()
    out = module(x.to(parameters), *[m.to(parameters) for m in memory])
    assert out.shape == (2, 3, 8) and torch.isfinite(out).all()
