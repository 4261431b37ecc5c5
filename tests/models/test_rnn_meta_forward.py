"""``rnn-attention-seq2seq`` on the ``"meta"`` device, without ``source_lengths``: there are no
token values to count for the packing, so every source row is read whole; the outputs have the
shapes they have on the CPU (a padded batch included)."""

from __future__ import annotations

import pytest
import torch

from conftest import padded_source
from torchvote.models import create_model

CASES = pytest.mark.parametrize(
    ("bidirectional", "attention", "num_layers"),
    [(True, "additive", 1), (True, "general", 2), (False, "dot", 2), (False, "concat", 1)],
)


def _model(device: str, **config):
    torch.manual_seed(0)
    return create_model("rnn-attention-seq2seq", "tiny", device=device, **config)


@CASES
def test_forward_on_meta_without_lengths_has_the_cpu_shapes(bidirectional, attention, num_layers):
    config = {"bidirectional": bidirectional, "attention": attention, "num_layers": num_layers}
    source, target = padded_source([5, 2, 7, 0], 7), torch.randint(3, 15, (4, 3))  # (b, s), (b, t)
    on_cpu = _model("cpu", **config)(source, target, need_weights=True)
    on_meta = _model("meta", **config)(source.to("meta"), target.to("meta"), need_weights=True)
    assert on_meta.logits.device.type == "meta"
    assert on_meta.logits.shape == on_cpu.logits.shape == (4, 3, 15)
    assert on_meta.attention[0].shape == on_cpu.attention[0].shape == (4, 3, 7)


@CASES
def test_encode_on_meta_without_lengths_has_the_cpu_shapes(bidirectional, attention, num_layers):
    config = {"bidirectional": bidirectional, "attention": attention, "num_layers": num_layers}
    source = padded_source([5, 2, 7], 7)  # (b, s)
    expected = [t.shape for t in _model("cpu", **config).encode(source)]
    encoded = _model("meta", **config).encode(source.to("meta"))  # memory, source_mask, hidden
    assert [t.shape for t in encoded] == expected
    assert {t.device.type for t in encoded} == {"meta"}
