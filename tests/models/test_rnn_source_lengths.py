"""``rnn-attention-seq2seq`` and its source lengths: the packing made with the permutations on the
host gives exactly what ``torch.nn.utils.rnn``'s unsorted packing gives (outputs and gradients,
float64), with or without ``source_lengths``; given on the CPU, the lengths spare every read of
the device's values."""

from __future__ import annotations

import pytest
import torch
from einops import rearrange
from torch import Tensor
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from conftest import padded_source, recording_reads
from torchvote.models import create_model

F64 = torch.float64
PAD = 0


def _model(bidirectional: bool, attention: str, num_layers: int):
    torch.manual_seed(0)
    return create_model(
        "rnn-attention-seq2seq", "tiny", bidirectional=bidirectional, attention=attention,
        num_layers=num_layers, dtype=F64,
    ).train(False)


def _torch_encode(model, source: Tensor) -> tuple[Tensor, Tensor]:
    """The reference: the encoder over torch's unsorted packing (``enforce_sorted=False``), as the
    model packed before; ``(memory (b, s, M), hidden (layers, b, H))``."""
    lengths = (source != PAD).sum(dim=1).clamp_min(1).cpu()  # (b,)
    embedded = model.source_embedding(source)  # (b, s, E)
    packed = pack_padded_sequence(embedded, lengths, batch_first=True, enforce_sorted=False)
    states, final = model.encoder(packed)
    memory, _ = pad_packed_sequence(states, batch_first=True, total_length=source.shape[1])
    final = rearrange(final, "(l d) b h -> l b (d h)", d=2 if model.config.bidirectional else 1)
    return memory, torch.tanh(model.bridge(final))


def _gradients(model, loss: Tensor) -> list[Tensor]:
    parameters = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, parameters, allow_unused=True))


CASES = pytest.mark.parametrize(
    ("bidirectional", "attention", "num_layers"),
    [(True, "additive", 1), (True, "general", 2), (False, "dot", 2), (False, "concat", 1)],
)
BATCHES = pytest.mark.parametrize(
    "lengths", [[5, 2, 7, 1, 7], [6, 6, 6], [0, 4, 3]], ids=["padded", "unpadded", "all-padding-row"]
)


@BATCHES
@CASES
def test_encode_is_torchs_unsorted_packing_exactly(bidirectional, attention, num_layers, lengths):
    model = _model(bidirectional, attention, num_layers)
    source = padded_source(lengths, max(lengths))
    reference_memory, reference_hidden = _torch_encode(model, source)
    reference = _gradients(model, reference_memory.square().sum() + reference_hidden.sin().sum())
    for given in (None, torch.tensor(lengths), list(lengths)):
        memory, mask, hidden = model.encode(source, source_lengths=given)
        torch.testing.assert_close(memory, reference_memory, rtol=0, atol=0)
        torch.testing.assert_close(hidden, reference_hidden, rtol=0, atol=0)
        assert torch.equal(mask, source != PAD)
        ours = _gradients(model, memory.square().sum() + hidden.sin().sum())
        for mine, theirs in zip(ours, reference, strict=True):
            if theirs is None:
                assert mine is None
            else:
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


@BATCHES
@CASES
def test_forward_and_generate_are_the_same_with_the_lengths_given(
    bidirectional, attention, num_layers, lengths
):
    model = _model(bidirectional, attention, num_layers)
    source = padded_source(lengths, max(lengths) + 2)  # trailing padding in every row
    target = torch.randint(3, 15, (len(lengths), 4))
    plain = model(source, target, need_weights=True)
    given = model(source, target, need_weights=True, source_lengths=torch.tensor(lengths))
    torch.testing.assert_close(given.logits, plain.logits, rtol=0, atol=0)
    torch.testing.assert_close(given.attention[0], plain.attention[0], rtol=0, atol=0)
    grads = [_gradients(model, out.logits.logsumexp(-1).sum()) for out in (plain, given)]
    for mine, theirs in zip(*grads, strict=True):
        if theirs is not None:
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    assert torch.equal(model.generate(source, source_lengths=lengths), model.generate(source))


def test_given_lengths_read_nothing_back(monkeypatch):
    model = _model(True, "additive", 1)
    source, target = padded_source([5, 2, 7], 7), torch.randint(3, 15, (3, 4))
    with recording_reads(monkeypatch, []) as reads:
        model(source, target, source_lengths=torch.tensor([5, 2, 7]))
    assert reads == []


def test_counted_lengths_read_back_once(monkeypatch):
    # torch's unsorted packing read its inverse permutation back as well (pad_packed_sequence)
    model = _model(True, "additive", 1)
    source, target = padded_source([5, 2, 7], 7), torch.randint(3, 15, (3, 4))
    with recording_reads(monkeypatch, []) as reads:
        model(source, target)
    assert reads == ["cpu"]  # the counted lengths: the one synchronisation left without them


def test_bad_source_lengths_are_refused_by_name():
    model = _model(True, "additive", 1)
    source, target = padded_source([5, 2, 7], 7), torch.randint(3, 15, (3, 4))
    with pytest.raises(ValueError, match=r"source_lengths must count the tokens.*got \[5, 3, 7\]"):
        model(source, target, source_lengths=[5, 3, 7])
    with pytest.raises(ValueError, match=r"source_lengths must have shape \(3,\)"):
        model(source, target, source_lengths=[5, 2])
    with pytest.raises(TypeError, match="source_lengths must be"):
        model(source, target, source_lengths=torch.tensor([5.0, 2.0, 7.0]))
    with pytest.raises(ValueError, match="source_lengths must be on the CPU"):
        model(source, target, source_lengths=torch.tensor([5, 2, 7], device="meta"))
