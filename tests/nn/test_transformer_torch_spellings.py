"""The Transformer layers take ``torch.nn``'s spellings: built with the keyword arguments of
``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` (``nhead``, ``batch_first``
in both layouts, ``bias=True``) and given torch's weights, they compute torch's outputs and
gradients (float64, eval mode)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchvote.nn import TransformerDecoderLayer, TransformerEncoderLayer

F64 = torch.float64
D_MODEL, HEADS, FEEDFORWARD, BATCH, T, S = 16, 4, 24, 3, 5, 7
LAYOUTS = pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
NORMS = pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])


def _torch_options(batch_first: bool, norm_first: bool) -> dict:
    """Every keyword of torch's layer constructors, as a torch user writes them."""
    return {
        "d_model": D_MODEL, "nhead": HEADS, "dim_feedforward": FEEDFORWARD, "dropout": 0.1,
        "activation": "gelu", "layer_norm_eps": 1e-4, "batch_first": batch_first,
        "norm_first": norm_first, "bias": True, "dtype": F64,
    }


def _pair(ours_class, torch_class, batch_first, norm_first):
    """Torch's layer with random weights and ours built from the same keywords, torch's weights
    loaded (through a batch-first copy: the weights do not depend on the layout)."""
    torch.manual_seed(0)
    options = _torch_options(batch_first, norm_first)
    theirs = torch_class(**options)
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.normal_(0.0, 0.3)
    theirs.eval()
    ours = ours_class(**options)
    assert (ours.num_heads, ours.batch_first) == (HEADS, batch_first)
    ours.load_state_dict(ours_class.from_torch(theirs, allow_sequence_first=True).state_dict())
    return ours.eval(), theirs


def _layout(batch_first: bool, batch: int, length: int) -> tuple[int, ...]:
    return (batch, length, D_MODEL) if batch_first else (length, batch, D_MODEL)


def _assert_same_with_grads(ours_fn, theirs_fn, inputs):
    ours_inputs = [t.clone().requires_grad_() for t in inputs]
    their_inputs = [t.clone().requires_grad_() for t in inputs]
    ours_out, their_out = ours_fn(*ours_inputs), theirs_fn(*their_inputs)
    assert ours_out.shape == their_out.shape
    torch.testing.assert_close(ours_out, their_out, rtol=1e-10, atol=1e-10)
    ours_out.pow(2).sum().backward()
    their_out.pow(2).sum().backward()
    for mine, reference in zip(ours_inputs, their_inputs, strict=True):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-9, atol=1e-10)


@NORMS
@LAYOUTS
def test_encoder_layer_built_with_torch_keywords_matches_torch(batch_first, norm_first):
    ours, theirs = _pair(TransformerEncoderLayer, nn.TransformerEncoderLayer, batch_first, norm_first)
    inputs = torch.randn(_layout(batch_first, BATCH, T), dtype=F64)
    padding = torch.zeros(BATCH, T, dtype=torch.bool)  # torch's: True = padding; (b, T) in both layouts
    padding[1, -2:] = True
    _assert_same_with_grads(ours, theirs, [inputs])
    _assert_same_with_grads(lambda x: ours(x, key_mask=~padding),
                            lambda x: theirs(x, src_key_padding_mask=padding), [inputs])
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=F64)
    _assert_same_with_grads(lambda x: ours(x, is_causal=True), lambda x: theirs(x, src_mask=causal), [inputs])


@NORMS
@LAYOUTS
def test_decoder_layer_built_with_torch_keywords_matches_torch(batch_first, norm_first):
    ours, theirs = _pair(TransformerDecoderLayer, nn.TransformerDecoderLayer, batch_first, norm_first)
    target = torch.randn(_layout(batch_first, BATCH, T), dtype=F64)
    memory = torch.randn(_layout(batch_first, BATCH, S), dtype=F64)
    memory_padding = torch.zeros(BATCH, S, dtype=torch.bool)
    memory_padding[0, -3:] = True
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=F64)
    _assert_same_with_grads(
        lambda t, m: ours(t, m, memory_key_mask=~memory_padding),
        lambda t, m: theirs(t, m, tgt_mask=causal, memory_key_padding_mask=memory_padding),
        [target, memory],
    )
    _assert_same_with_grads(lambda t, m: ours(t, m, is_causal=False), theirs, [target, memory])


def test_sequence_first_intermediates_stay_batch_first():
    ours, _ = _pair(TransformerEncoderLayer, nn.TransformerEncoderLayer, False, False)
    inputs = torch.randn(T, BATCH, D_MODEL, dtype=F64)
    output, record = ours(inputs, return_intermediates=True)
    assert output.shape == (T, BATCH, D_MODEL)
    assert record.weights["self_attention"].shape == (BATCH, T, T)
    assert "batch_first=False" in repr(ours).splitlines()[1]  # the layer's layout, not its attention's
    batch_first = TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FEEDFORWARD, layer_norm_eps=1e-4,
                                          activation="gelu", dtype=F64).eval()
    batch_first.load_state_dict(ours.state_dict())
    again = batch_first(inputs.transpose(0, 1)).transpose(0, 1)  # (T, b, E)
    torch.testing.assert_close(again, output, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("norm_first", [False, True])
def test_a_copy_of_a_sequence_first_torch_layer_keeps_its_layout(norm_first):
    """Torch's default layers are sequence first: ``from_torch`` copies that layout, so the copy
    takes torch's ``(T, b, E)`` inputs and gives torch's outputs (it was refused, and a copy made
    with ``allow_sequence_first`` took batch-first inputs); ``allow_sequence_first=True`` still
    makes that batch-first copy, for the stacks."""
    torch.manual_seed(1)
    settings = {"dim_feedforward": FEEDFORWARD, "dropout": 0.0, "norm_first": norm_first, "dtype": F64}
    encoder = nn.TransformerEncoderLayer(D_MODEL, HEADS, **settings).eval()
    decoder = nn.TransformerDecoderLayer(D_MODEL, HEADS, **settings).eval()
    inputs = torch.randn(T, BATCH, D_MODEL, dtype=F64)  # (T, b, E)
    memory = torch.randn(T + 2, BATCH, D_MODEL, dtype=F64)  # (S, b, E)
    copy = TransformerEncoderLayer.from_torch(encoder)
    assert copy.batch_first is False
    torch.testing.assert_close(copy(inputs), encoder(inputs), rtol=1e-10, atol=1e-10)
    copy = TransformerDecoderLayer.from_torch(decoder)
    assert copy.batch_first is False
    torch.testing.assert_close(copy(inputs, memory, is_causal=False), decoder(inputs, memory),
                               rtol=1e-10, atol=1e-10)
    for batch_first in (TransformerEncoderLayer.from_torch(encoder, batch_first=True),
                        TransformerEncoderLayer.from_torch(encoder, allow_sequence_first=True)):  # old name
        assert batch_first.batch_first is True
        torch.testing.assert_close(batch_first(inputs.transpose(0, 1)).transpose(0, 1), encoder(inputs),
                                   rtol=1e-10, atol=1e-10)


def test_from_torch_sets_the_layout_it_is_told():
    """``batch_first=False`` copies a batch-first torch layer sequence first: the same outputs,
    transposed; contradicting ``allow_sequence_first=True`` or a value that is no bool is refused."""
    torch.manual_seed(2)
    theirs = nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FEEDFORWARD, dropout=0.0,
                                        batch_first=True, dtype=F64).eval()
    copy = TransformerEncoderLayer.from_torch(theirs, batch_first=False)
    inputs = torch.randn(BATCH, T, D_MODEL, dtype=F64)  # (b, T, E)
    assert copy.batch_first is False
    torch.testing.assert_close(copy(inputs.transpose(0, 1)).transpose(0, 1), theirs(inputs),
                               rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="allow_sequence_first=True asks for a batch-first copy"):
        TransformerEncoderLayer.from_torch(theirs, batch_first=False, allow_sequence_first=True)
    with pytest.raises(TypeError, match="batch_first"):
        TransformerEncoderLayer.from_torch(theirs, batch_first="yes")


@pytest.mark.parametrize("layer_class", [TransformerEncoderLayer, TransformerDecoderLayer])
def test_heads_by_either_name(layer_class):
    assert layer_class(D_MODEL, nhead=HEADS).num_heads == HEADS
    assert layer_class(d_model=D_MODEL, num_heads=HEADS, nhead=HEADS).num_heads == HEADS
    assert layer_class(D_MODEL, HEADS).num_heads == HEADS
    with pytest.raises(ValueError, match=r"num_heads=4 and nhead=2 .*torch's spelling"):
        layer_class(D_MODEL, HEADS, nhead=2)
    with pytest.raises(TypeError, match="num_heads.*nhead"):
        layer_class(D_MODEL)
    with pytest.raises(ValueError, match="num_heads"):
        layer_class(D_MODEL, nhead=0)


@pytest.mark.parametrize("layer_class", [TransformerEncoderLayer, TransformerDecoderLayer])
def test_bias_and_batch_first_are_checked(layer_class):
    assert layer_class(D_MODEL, HEADS, bias=True).batch_first
    with pytest.raises(ValueError, match="bias=False is not supported"):
        layer_class(D_MODEL, HEADS, bias=False)
    with pytest.raises(TypeError, match="batch_first"):
        layer_class(D_MODEL, HEADS, batch_first="no")
