"""``_plain_gru`` (rnn-attention-seq2seq's ``batch_first`` ``nn.GRU`` in plain operations, run
under ``torch.func`` transforms) against torch's own ``nn.GRU``, in float64:

- in eval mode with ``dropout=0.5``: no dropout at all (outputs, final states, and their gradients
  with respect to the inputs, the initial states and every weight), 2 layers, one or two
  directions, with and without biases;
- in train mode with ``dropout=1.0``, where ``nn.GRU`` is deterministic (layer 1's input zeroed,
  layer 0's not): dropout between the layers only;
- with ``steps`` (rows of different lengths): torch's unsorted packing
  (``pack_padded_sequence(enforce_sorted=False)``) padded back with zeros by
  ``pad_packed_sequence``: zero outputs at the padded steps, the final states after each row's last
  token;
- through the model: ``vmap`` of ``encode`` over sources padded to different lengths (the plain
  GRU) gives the memory of the eager, packed ``encode``, zeros at the padding included.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.func import vmap
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from conftest import padded_source
from torchvote.models import create_model
from torchvote.models.rnn_attention_seq2seq import _plain_gru

F64 = torch.float64
BATCH, LENGTH, IN, HIDDEN, LAYERS = 4, 5, 3, 4, 2


def _gru(bidirectional: bool, bias: bool = True, dropout: float = 0.0) -> nn.GRU:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (a dropout warning, should torch give one)
        return nn.GRU(
            IN, HIDDEN, LAYERS, bias=bias, batch_first=True, dropout=dropout,
            bidirectional=bidirectional, dtype=F64,
        )


def _inputs(bidirectional: bool) -> tuple[Tensor, Tensor]:
    """``(b, s, in)`` inputs and ``(layers * directions, b, H)`` initial states, requiring grad."""
    generator = torch.Generator().manual_seed(1)
    directions = 2 if bidirectional else 1
    inputs = torch.randn(BATCH, LENGTH, IN, dtype=F64, generator=generator)
    hidden = torch.randn(LAYERS * directions, BATCH, HIDDEN, dtype=F64, generator=generator)
    return inputs.requires_grad_(), hidden.requires_grad_()


def _grads(outputs: Tensor, final: Tensor, wrt: list[Tensor]) -> tuple[Tensor, ...]:
    """Gradients of a loss through every output and final state (weighted, so no two cancel)."""
    weights = torch.linspace(0.5, 1.5, outputs.numel(), dtype=F64).reshape(outputs.shape)
    loss = (weights * outputs).sum() + final.square().sum()
    return torch.autograd.grad(loss, wrt, allow_unused=True)


def _assert_same(gru: nn.GRU, got: tuple[Tensor, Tensor], want: tuple[Tensor, Tensor], wrt) -> None:
    torch.testing.assert_close(got[0], want[0], msg=lambda m: f"outputs: {m}")
    torch.testing.assert_close(got[1], want[1], msg=lambda m: f"final states: {m}")
    names = ["inputs", "hidden"] + [name for name, _ in gru.named_parameters()]
    got_grads, want_grads = _grads(*got, wrt), _grads(*want, wrt)
    for name, g, w in zip(names, got_grads, want_grads, strict=True):
        g = torch.zeros_like(wrt[names.index(name)]) if g is None else g
        w = torch.zeros_like(wrt[names.index(name)]) if w is None else w
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"gradient of {name}: {m}")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "unidirectional"])
def test_plain_gru_in_eval_mode_equals_nn_gru_without_dropout(bidirectional, bias):
    """``dropout=0.5`` in eval mode: none applied, by either."""
    gru = _gru(bidirectional, bias, dropout=0.5).eval()
    inputs, hidden = _inputs(bidirectional)
    wrt = [inputs, hidden, *gru.parameters()]
    _assert_same(gru, _plain_gru(gru, inputs, hidden), gru(inputs, hidden), wrt)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "unidirectional"])
def test_plain_gru_in_train_mode_drops_between_layers_only(bidirectional):
    """``dropout=1.0`` in training zeroes layer 1's input, and only that: deterministic, so
    ``nn.GRU`` in training is the reference (checked first against a layer 1 run over zeros)."""
    gru = _gru(bidirectional, dropout=1.0).train()
    inputs, hidden = _inputs(bidirectional)
    want = gru(inputs, hidden)
    # the reference really drops everything between the layers and nothing before layer 0:
    # layer 1 alone over a zero input (layer 1's weights copied into a one-layer GRU) ...
    directions = 2 if bidirectional else 1
    top = nn.GRU(directions * HIDDEN, HIDDEN, 1, batch_first=True, bidirectional=bidirectional, dtype=F64)
    bottom = nn.GRU(IN, HIDDEN, 1, batch_first=True, bidirectional=bidirectional, dtype=F64)
    with torch.no_grad():
        for name, parameter in gru.named_parameters():
            layer = bottom if "_l0" in name else top
            getattr(layer, name.replace("_l1", "_l0")).copy_(parameter)
        zeros = torch.zeros(BATCH, LENGTH, directions * HIDDEN, dtype=F64)
        top_out, top_final = top(zeros, hidden[directions:])
        _, bottom_final = bottom(inputs, hidden[:directions])  # ... and layer 0 over the inputs
    torch.testing.assert_close(want[0].detach(), top_out)
    torch.testing.assert_close(want[1].detach(), torch.cat([bottom_final, top_final]))
    wrt = [inputs, hidden, *gru.parameters()]
    _assert_same(gru, _plain_gru(gru, inputs, hidden), want, wrt)


@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "given-state"])
def test_plain_gru_with_steps_equals_the_packed_gru_padded_back(initial):
    """Rows of lengths 5, 2, 4, 1 (unsorted): zeros at the padded steps, the final states after
    each row's last token (the backward direction starts there), as torch's packing gives."""
    gru = _gru(bidirectional=True, dropout=0.5).eval()
    inputs, hidden = _inputs(bidirectional=True)
    lengths = torch.tensor([5, 2, 4, 1])
    steps = torch.arange(LENGTH) < lengths[:, None]  # (b, s)
    state = hidden if initial else None
    packed = pack_padded_sequence(inputs, lengths, batch_first=True, enforce_sorted=False)
    packed_out, final = gru(packed, state)
    outputs, _ = pad_packed_sequence(packed_out, batch_first=True, total_length=LENGTH)
    assert outputs[~steps].eq(0).all()  # padded back with zeros
    wrt = [inputs, hidden, *gru.parameters()]
    _assert_same(gru, _plain_gru(gru, inputs, state, steps=steps), (outputs, final), wrt)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "unidirectional"])
def test_vmapped_encode_equals_the_packed_encode_padding_included(bidirectional):
    """``encode`` example by example under ``vmap`` (plain GRU, no packing) against the eager batch
    (packed): the memory, zeros at the padding, and the decoder's first state."""
    torch.manual_seed(0)
    attention = "additive" if bidirectional else "general"
    model = create_model(
        "rnn-attention-seq2seq", "tiny", num_layers=2, bidirectional=bidirectional, attention=attention,
        dtype=F64,
    ).eval()
    source = padded_source([5, 8, 3, 0], 8)  # an all-padding row: packing reads one (padding) token
    memory, mask, hidden = model.encode(source)
    run = torch.arange(8) < mask.sum(dim=1, keepdim=True).clamp_min(1)  # (b, s): the steps packing runs
    assert memory[~run].eq(0).all() and memory[run].ne(0).any(dim=-1).all()  # zeros at padding only

    def one(row: Tensor) -> tuple[Tensor, Tensor]:
        memory, _, hidden = model.encode(row[None])
        return memory[0], hidden[:, 0]  # (s, directions * H), (layers, H)

    got_memory, got_hidden = vmap(one)(source)
    torch.testing.assert_close(got_memory, memory)
    torch.testing.assert_close(got_hidden.transpose(0, 1), hidden)
