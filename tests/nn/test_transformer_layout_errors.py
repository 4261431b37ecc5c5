"""A transformer layer's shape errors show the shapes and names the user gave, in either layout.

A sequence-first layer (``batch_first=False``) transposes its ``(T, b, E)`` inputs around the
batch-first computation; an error raised inside showed the transposed shapes, named as the
attention names them (``query``, ``key``), to a user who passed ``(T, b, E)``.
"""

import re

import pytest
import torch

from torchvote.nn import TransformerDecoderLayer, TransformerEncoderLayer

D_MODEL, HEADS, BATCH, T, S = 8, 2, 3, 5, 7
LAYOUTS = pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])


def _shape(batch_first: bool, batch: int, length: int, features: int = D_MODEL) -> tuple[int, int, int]:
    """A batched sequence's shape in a layer's layout."""
    return (batch, length, features) if batch_first else (length, batch, features)


def _layout(batch_first: bool, length: str) -> str:
    """The layout a layer names in its messages."""
    return f"(batch, {length}, d_model)" if batch_first else f"({length}, batch, d_model)"


def _encoder(batch_first: bool) -> TransformerEncoderLayer:
    return TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=16, dropout=0.0, batch_first=batch_first)


def _decoder(batch_first: bool) -> TransformerDecoderLayer:
    return TransformerDecoderLayer(D_MODEL, HEADS, dim_feedforward=16, dropout=0.0, batch_first=batch_first)


@LAYOUTS
@pytest.mark.parametrize(
    "shape",
    [
        lambda bf: _shape(bf, BATCH, T, D_MODEL + 1),
        lambda bf: (1, *_shape(bf, BATCH, T)),
        lambda bf: (D_MODEL,),
    ],
    ids=["features", "rank 4", "rank 1"],
)
def test_encoder_inputs_error_shows_the_shape_given(batch_first, shape):
    inputs = torch.randn(shape(batch_first))
    expected = (
        f"inputs must have shape {_layout(batch_first, 'T')} (batch_first={batch_first}) or unbatched "
        f"(T, d_model), with d_model = {D_MODEL}, got {tuple(inputs.shape)}"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        _encoder(batch_first)(inputs)


@LAYOUTS
def test_decoder_target_error_shows_the_shape_given(batch_first):
    target = torch.randn(_shape(batch_first, BATCH, T, D_MODEL + 1))
    expected = (
        f"target must have shape {_layout(batch_first, 'T')} (batch_first={batch_first}) or unbatched "
        f"(T, d_model), with d_model = {D_MODEL}, got {tuple(target.shape)}"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        _decoder(batch_first)(target, torch.randn(_shape(batch_first, BATCH, S)))


@LAYOUTS
@pytest.mark.parametrize(
    "memory_shape",
    [
        lambda bf: _shape(bf, BATCH, S, D_MODEL + 1),  # features
        lambda bf: _shape(bf, BATCH + 1, S),  # another batch than the target's
        lambda bf: (S, D_MODEL),  # unbatched beside a batched target
    ],
    ids=["features", "batch", "unbatched"],
)
def test_decoder_memory_error_shows_both_shapes_given(batch_first, memory_shape):
    target = torch.randn(_shape(batch_first, BATCH, T))
    memory = torch.randn(memory_shape(batch_first))
    wanted = f"({BATCH}, S, {D_MODEL})" if batch_first else f"(S, {BATCH}, {D_MODEL})"
    expected = (
        f"memory must have shape {_layout(batch_first, 'S')} = {wanted} for a target of shape "
        f"{tuple(target.shape)}, got {tuple(memory.shape)}"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        _decoder(batch_first)(target, memory)


@LAYOUTS
def test_decoder_batched_memory_beside_unbatched_target_is_named_memory(batch_first):
    """The attention named it ``key`` ("must have the rank of query"), transposed."""
    memory = torch.randn(_shape(batch_first, BATCH, S))
    expected = (
        f"memory must have shape (S, d_model) = (S, {D_MODEL}) for an unbatched target of shape "
        f"{(T, D_MODEL)}, got {tuple(memory.shape)}"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        _decoder(batch_first)(torch.randn(T, D_MODEL), memory)


@LAYOUTS
def test_decoder_missing_memory_names_the_layout(batch_first):
    expected = f"memory must be a tensor, the encoder's output {_layout(batch_first, 'S')}, got NoneType"
    with pytest.raises(TypeError, match=re.escape(expected)):
        _decoder(batch_first)(torch.randn(_shape(batch_first, BATCH, T)), None)


@LAYOUTS
@pytest.mark.parametrize(
    ("argument", "mask", "expected"),
    [
        ("target_mask", torch.ones(T, T + 1, dtype=torch.bool),
         f"target_mask of shape {(T, T + 1)} does not broadcast to the attention logits' shape "
         f"{(BATCH, HEADS, T, T)}"),
        ("target_key_mask", torch.ones(BATCH, T + 1, dtype=torch.bool),
         f"target_key_mask must have shape (batch, S) = {(BATCH, T)}, got {(BATCH, T + 1)}"),
        ("memory_mask", torch.ones(T, S + 1, dtype=torch.bool),
         f"memory_mask of shape {(T, S + 1)} does not broadcast to the attention logits' shape "
         f"{(BATCH, HEADS, T, S)}"),
        ("memory_key_mask", torch.ones(S, BATCH, dtype=torch.bool),  # laid out as the memory, wrongly
         f"memory_key_mask must have shape (batch, S) = {(BATCH, S)}, got {(S, BATCH)}"),
    ],
)
def test_decoder_mask_errors_read_sizes_in_the_layout_given(batch_first, argument, mask, expected):
    """Masks are batch first in either layout: the sizes they must have are read from the target and
    memory in the layer's layout (checked before a sequence-first layer transposes them)."""
    target, memory = torch.randn(_shape(batch_first, BATCH, T)), torch.randn(_shape(batch_first, BATCH, S))
    with pytest.raises(ValueError, match=re.escape(expected)):
        _decoder(batch_first)(target, memory, **{argument: mask})


@LAYOUTS
@pytest.mark.parametrize(
    ("argument", "mask", "expected"),
    [
        ("attn_mask", torch.ones(T, T + 1, dtype=torch.bool),
         f"attn_mask of shape {(T, T + 1)} does not broadcast to the attention logits' shape "
         f"{(BATCH, HEADS, T, T)}"),
        ("key_mask", torch.ones(T, BATCH, dtype=torch.bool),  # laid out as the inputs, wrongly
         f"key_mask must have shape (batch, S) = {(BATCH, T)}, got {(T, BATCH)}"),
    ],
)
def test_encoder_mask_errors_read_sizes_in_the_layout_given(batch_first, argument, mask, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        _encoder(batch_first)(torch.randn(_shape(batch_first, BATCH, T)), **{argument: mask})
