"""Unbatched masks named as the layers name them, and ``from_torch`` of torch layers whose attentions
have mixed layouts; torch.nn's modules are the reference (float64, eval mode).

Unbatched inputs ``(T, E)`` (as torch's layers take them) reached the attentions' own mask checks,
so a wrong mask given to the decoder layer was named ``attn_mask`` or ``key_mask``. A torch decoder
layer whose ``self_attn`` and ``multihead_attn`` have different ``batch_first`` (one attention
replaced after construction) was refused by ``from_torch`` even given ``batch_first=True`` or
``False``, which sets the copy's layout (the weights are the same in either).

Torch's mixed layer reads a batched input in each attention's own layout (the cross-attention of a
batch-first ``(b, T, E)`` target with a sequence-first ``multihead_attn`` attends across the
batch), so batched outputs are compared with a torch layer of one layout holding the same weights;
unbatched inputs mean the same in every layout, so there the mixed layer itself is the reference.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from torchvote.nn import (
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

from .test_transformer import D_MODEL, F64, FEEDFORWARD, HEADS, _assert_same_with_grads, _randomise

T, S = 5, 7
LAYOUTS = pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "sequence-first"])
NORMS = pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])


def _decoder(batch_first: bool) -> TransformerDecoderLayer:
    return TransformerDecoderLayer(D_MODEL, HEADS, dim_feedforward=FEEDFORWARD, dropout=0.0,
                                   batch_first=batch_first)


def _encoder(batch_first: bool) -> TransformerEncoderLayer:
    return TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FEEDFORWARD, dropout=0.0,
                                   batch_first=batch_first)


def _logits_error(argument: str, shape: tuple[int, ...], source_len: int) -> str:
    """The message of an attention mask that does not fit unbatched logits ``(h, T, S)`` (they were
    shown as the attention inside sees them, ``(1, h, T, S)``)."""
    return (f"{argument} of shape {shape} does not broadcast to the attention logits' shape "
            f"{(HEADS, T, source_len)} (heads, L, S) for unbatched inputs")


def _key_mask_error(argument: str, shape: tuple[int, ...], source_len: int) -> str:
    return f"{argument} must have shape (S,) = ({source_len},) for unbatched inputs, got {shape}"


# ---------------------------------------------------------------------------------------------
# Unbatched inputs: the masks' errors name the layer's arguments


@LAYOUTS
@pytest.mark.parametrize(
    ("argument", "mask", "expected"),
    [
        ("target_mask", torch.ones(T, T + 1, dtype=torch.bool), _logits_error("target_mask", (T, T + 1), T)),
        ("target_mask", torch.ones(2, HEADS, T, T, dtype=torch.bool),  # a batch of 2 for one target
         _logits_error("target_mask", (2, HEADS, T, T), T)),
        ("target_key_mask", torch.ones(T + 1, dtype=torch.bool),
         _key_mask_error("target_key_mask", (T + 1,), T)),
        ("target_key_mask", torch.ones(1, T, dtype=torch.bool),  # batched, beside an unbatched target
         _key_mask_error("target_key_mask", (1, T), T)),
        ("memory_mask", torch.ones(T, S + 1, dtype=torch.bool), _logits_error("memory_mask", (T, S + 1), S)),
        ("memory_mask", torch.zeros(S, T), _logits_error("memory_mask", (S, T), S)),  # (S, T): transposed
        ("memory_key_mask", torch.ones(S + 1, dtype=torch.bool),
         _key_mask_error("memory_key_mask", (S + 1,), S)),
        ("memory_key_mask", torch.ones(T, dtype=torch.bool),  # the target's length
         _key_mask_error("memory_key_mask", (T,), S)),
    ],
    ids=["target_mask", "target_mask-batched", "target_key_mask", "target_key_mask-batched", "memory_mask",
         "memory_mask-transposed", "memory_key_mask", "memory_key_mask-target-length"],
)
def test_decoder_unbatched_mask_shape_errors_name_the_layers_argument(batch_first, argument, mask, expected):
    target, memory = torch.randn(T, D_MODEL), torch.randn(S, D_MODEL)
    with pytest.raises(ValueError, match=re.escape(expected)):
        _decoder(batch_first)(target, memory, **{argument: mask})


@LAYOUTS
@pytest.mark.parametrize(
    ("argument", "mask", "expected"),
    [
        ("target_mask", torch.ones(T, T, dtype=torch.long), "target_mask must be boolean (True = may attend) "
         "or floating point (added to the logits), got dtype torch.int64"),
        ("target_key_mask", torch.ones(T),
         "target_key_mask must be boolean (True = real key, False = padding), got dtype torch.float32"),
        ("memory_key_mask", torch.ones(S + 1), "memory_key_mask must be boolean"),  # dtype before shape
        ("memory_key_mask", [True] * S, "memory_key_mask must be a tensor, got list"),
        ("memory_mask", [[True] * S] * T, "memory_mask must be a tensor, got list"),
    ],
    ids=["target_mask-long", "target_key_mask-float", "memory_key_mask-float-shape", "memory_key_mask-list",
         "memory_mask-list"],
)
def test_decoder_unbatched_mask_type_errors_name_the_layers_argument(batch_first, argument, mask, expected):
    target, memory = torch.randn(T, D_MODEL), torch.randn(S, D_MODEL)
    with pytest.raises(TypeError, match=re.escape(expected)):
        _decoder(batch_first)(target, memory, **{argument: mask})


@LAYOUTS
@pytest.mark.parametrize(
    ("argument", "mask", "expected"),
    [
        ("attn_mask", torch.ones(T, T + 1, dtype=torch.bool), _logits_error("attn_mask", (T, T + 1), T)),
        ("key_mask", torch.ones(T + 1, dtype=torch.bool), _key_mask_error("key_mask", (T + 1,), T)),
        ("key_mask", torch.ones(1, T, dtype=torch.bool), _key_mask_error("key_mask", (1, T), T)),
    ],
    ids=["attn_mask", "key_mask", "key_mask-batched"],
)
def test_encoder_unbatched_mask_errors_name_the_layers_argument(batch_first, argument, mask, expected):
    """The encoder layer's masks have its attention's names, so the attention's messages name them."""
    with pytest.raises(ValueError, match=re.escape(expected)):
        _encoder(batch_first)(torch.randn(T, D_MODEL), **{argument: mask})


def _torch_decoder_layer(batch_first: bool = True, norm_first: bool = False) -> nn.TransformerDecoderLayer:
    """A float64 torch decoder layer with random biases and norm affines, in eval mode."""
    torch.manual_seed(0)
    theirs = nn.TransformerDecoderLayer(D_MODEL, HEADS, dim_feedforward=FEEDFORWARD, dropout=0.1,
                                        norm_first=norm_first, batch_first=batch_first, dtype=F64)
    _randomise(theirs)
    return theirs.eval()


def _causal(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).triu(1)  # torch's: True = blocked


@LAYOUTS
def test_decoder_unbatched_masks_of_the_right_shape_match_torch(batch_first):
    """The checks refuse only what is wrong: unbatched key masks ``(T,)``, ``(S,)`` and a per-head
    ``(h, T, S)`` memory mask give torch's outputs."""
    theirs = _torch_decoder_layer(batch_first)
    ours = TransformerDecoderLayer.from_torch(theirs)
    target_padding = torch.zeros(T, dtype=torch.bool).index_fill(0, torch.tensor([T - 1]), True)
    memory_padding = torch.zeros(S, dtype=torch.bool).index_fill(0, torch.tensor([1, S - 1]), True)
    memory_bias = torch.randn(HEADS, T, S, dtype=F64)  # (h, T, S), added to the logits
    # torch's float form of the memory's padding, beside a float memory_mask (mixed kinds warn)
    memory_padding_logits = torch.zeros(S, dtype=F64).masked_fill(memory_padding, float("-inf"))  # (S,)
    _assert_same_with_grads(
        lambda t, m: ours(t, m, target_key_mask=~target_padding, memory_mask=memory_bias,
                          memory_key_mask=~memory_padding),
        lambda t, m: theirs(t, m, tgt_mask=_causal(T), tgt_key_padding_mask=target_padding,
                            memory_mask=memory_bias, memory_key_padding_mask=memory_padding_logits),
        [torch.randn(T, D_MODEL, dtype=F64), torch.randn(S, D_MODEL, dtype=F64)],
    )


# ---------------------------------------------------------------------------------------------
# from_torch of a torch decoder layer whose attentions have mixed layouts


def _mixed_torch_layer(self_first: bool, norm_first: bool = False) -> nn.TransformerDecoderLayer:
    """Torch's decoder layer built with ``batch_first=self_first``, its cross-attention replaced by
    one of the other layout (same sizes, dropout and dtype), random biases and norm affines."""
    theirs = _torch_decoder_layer(self_first, norm_first)
    torch.manual_seed(1)
    theirs.multihead_attn = nn.MultiheadAttention(D_MODEL, HEADS, dropout=0.1, batch_first=not self_first,
                                                  dtype=F64)
    _randomise(theirs.multihead_attn)
    assert theirs.self_attn.batch_first is not theirs.multihead_attn.batch_first
    return theirs.eval()


def _one_layout(mixed: nn.TransformerDecoderLayer, batch_first: bool) -> nn.TransformerDecoderLayer:
    """A torch layer of one layout holding ``mixed``'s weights (the state dict has no layout)."""
    reference = nn.TransformerDecoderLayer(D_MODEL, HEADS, dim_feedforward=FEEDFORWARD, dropout=0.1,
                                           norm_first=mixed.norm_first, batch_first=batch_first, dtype=F64)
    reference.load_state_dict(mixed.state_dict())
    return reference.eval()


def _batched(batch_first: bool, batch: int, length: int) -> torch.Tensor:
    """A random float64 batch in a layout: ``(b, L, E)`` or ``(L, b, E)``."""
    return torch.randn((batch, length, D_MODEL) if batch_first else (length, batch, D_MODEL), dtype=F64)


@NORMS
@pytest.mark.parametrize("self_first", [True, False], ids=["self-batch-first", "self-sequence-first"])
@LAYOUTS
def test_explicit_batch_first_copies_a_mixed_layer(batch_first, self_first, norm_first):
    mixed = _mixed_torch_layer(self_first, norm_first)
    ours = TransformerDecoderLayer.from_torch(mixed, batch_first=batch_first)
    assert ours.batch_first is batch_first
    reference = _one_layout(mixed, batch_first)
    target_padding = torch.zeros(3, T, dtype=torch.bool)
    target_padding[1, -1] = True
    memory_padding = torch.zeros(3, S, dtype=torch.bool)
    memory_padding[2, -2:] = True
    _assert_same_with_grads(
        lambda t, m: ours(t, m, target_key_mask=~target_padding, memory_key_mask=~memory_padding),
        lambda t, m: reference(t, m, tgt_mask=_causal(T), tgt_key_padding_mask=target_padding,
                               memory_key_padding_mask=memory_padding),
        [_batched(batch_first, 3, T), _batched(batch_first, 3, S)],
    )
    # unbatched inputs mean the same to every attention: the mixed layer itself agrees
    _assert_same_with_grads(lambda t, m: ours(t, m), lambda t, m: mixed(t, m, tgt_mask=_causal(T)),
                            [torch.randn(T, D_MODEL, dtype=F64), torch.randn(S, D_MODEL, dtype=F64)])


def test_allow_sequence_first_copies_a_mixed_layer_batch_first():
    mixed = _mixed_torch_layer(self_first=False)
    ours = TransformerDecoderLayer.from_torch(mixed, allow_sequence_first=True)
    assert ours.batch_first is True
    _assert_same_with_grads(lambda t, m: ours(t, m, is_causal=False), _one_layout(mixed, True),
                            [_batched(True, 2, T), _batched(True, 2, S)])


@pytest.mark.parametrize("self_first", [True, False], ids=["self-batch-first", "self-sequence-first"])
def test_default_batch_first_refuses_a_mixed_layer_and_says_what_to_give(self_first):
    expected = (
        f"from_torch: the attentions' layouts differ (self_attn.batch_first={self_first}, "
        f"multihead_attn.batch_first={not self_first}), so the copy has no one layout to keep; "
        "give batch_first=True or False"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        TransformerDecoderLayer.from_torch(_mixed_torch_layer(self_first))


# ---------------------------------------------------------------------------------------------
# The stacks: allow_sequence_first copies mixed layers batch first; without it they are refused


def _mixed_torch_stack() -> nn.TransformerDecoder:
    """Torch's two-layer decoder stack whose layers' cross-attentions are sequence-first, their
    self-attentions batch first, the layers' weights differing."""
    torch.manual_seed(0)
    stack = nn.TransformerDecoder(_torch_decoder_layer(True), 2, norm=nn.LayerNorm(D_MODEL, dtype=F64))
    for layer in stack.layers:
        layer.multihead_attn.batch_first = False  # set after construction: torch reads it in forward
    with torch.no_grad():
        for parameter in stack.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return stack.eval()


def test_decoder_stack_copies_mixed_layers_with_allow_sequence_first():
    mixed = _mixed_torch_stack()
    ours = TransformerDecoder.from_torch(mixed, allow_sequence_first=True)
    assert all(layer.batch_first for layer in ours.layers)
    reference = nn.TransformerDecoder(_one_layout(mixed.layers[0], True), 2,
                                      norm=nn.LayerNorm(D_MODEL, dtype=F64))
    reference.load_state_dict(mixed.state_dict())
    reference.eval()
    _assert_same_with_grads(lambda t, m: ours(t, m), lambda t, m: reference(t, m, tgt_mask=_causal(T)),
                            [_batched(True, 3, T), _batched(True, 3, S)])
    _assert_same_with_grads(lambda t, m: ours(t, m), lambda t, m: mixed(t, m, tgt_mask=_causal(T)),
                            [torch.randn(T, D_MODEL, dtype=F64), torch.randn(S, D_MODEL, dtype=F64)])


def test_decoder_stack_refuses_mixed_layers_without_allow_sequence_first():
    expected = (
        "layers.0: from_torch: self_attn.batch_first=True, multihead_attn.batch_first=False: the stacks "
        "take batch-first (b, T, E) inputs; pass allow_sequence_first=True"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        TransformerDecoder.from_torch(_mixed_torch_stack())


def test_encoder_stack_of_layers_in_different_layouts():
    """A layer of each layout: copied batch first with allow_sequence_first, else the sequence-first
    layer is refused by its index."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, dim_feedforward=FEEDFORWARD, dropout=0.1,
                                       batch_first=True, dtype=F64)
    theirs = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    theirs.layers[1].self_attn.batch_first = False
    with pytest.raises(ValueError, match=r"layers\.1: from_torch: self_attn\.batch_first=False: .*"
                                         r"allow_sequence_first=True"):
        TransformerEncoder.from_torch(theirs)
    ours = TransformerEncoder.from_torch(theirs, allow_sequence_first=True)
    theirs.layers[1].self_attn.batch_first = True  # one layout: torch's reference for batched inputs
    _assert_same_with_grads(ours, theirs, [_batched(True, 2, T)])


def test_stack_checks_allow_sequence_first_itself():
    theirs = nn.TransformerEncoder(nn.TransformerEncoderLayer(D_MODEL, HEADS, batch_first=True), 1,
                                   enable_nested_tensor=False)
    with pytest.raises(TypeError, match="allow_sequence_first"):
        TransformerEncoder.from_torch(theirs, allow_sequence_first="yes")
