"""The sinusoidal table, which no state dict holds, after the ways a model gets its weights
without its constructor's draw: built on ``"meta"``, moved by ``to_empty()`` and loaded; built
with ``"meta"`` as the default device."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.models import create_model
from torchvote.nn import SinusoidalPositionalEncoding


def _paper_table(max_len: int, embed_dim: int) -> torch.Tensor:
    """Vaswani et al. 2017, sec. 3.5, one entry at a time."""
    table = torch.empty(max_len, embed_dim, dtype=torch.float64)
    for pos in range(max_len):
        for i in range(embed_dim):
            angle = pos / 10000 ** ((i - i % 2) / embed_dim)
            table[pos, i] = math.sin(angle) if i % 2 == 0 else math.cos(angle)
    return table


def test_load_state_dict_fills_the_table_of_a_module_moved_from_meta():
    """load_state_dict left to_empty()'s memory in the table (1e21 seen; NaN logits)."""
    module = SinusoidalPositionalEncoding(6, max_len=9, device="meta", dtype=torch.float64)
    module = module.to_empty(device="cpu")
    with torch.no_grad():
        module.table.fill_(float("nan"))  # to_empty's memory is whatever was there: make it visible
    module.load_state_dict({})
    torch.testing.assert_close(module.table, _paper_table(9, 6), rtol=0, atol=1e-15)


def test_a_model_moved_from_meta_and_loaded_computes_what_the_original_does():
    reference = create_model("transformer-seq2seq", "tiny").eval()
    loaded = create_model("transformer-seq2seq", "tiny", device="meta").to_empty(device="cpu")
    loaded.load_state_dict(reference.state_dict())
    loaded.eval()
    source = torch.randint(3, 10, (2, 5))
    target = torch.randint(3, 10, (2, 4))
    expected = reference(source, target).logits
    torch.testing.assert_close(loaded(source, target).logits, expected, rtol=0, atol=0)


def test_a_model_built_on_meta_and_loaded_by_assignment_says_its_table_is_empty():
    """``load_state_dict(assign=True)`` assigns what the state dict holds and leaves the table, a
    buffer it does not hold, on "meta": the forward pass advised moving the inputs to "meta". It
    says what happened now, and to_empty() first (the recipe) computes what the original does."""
    reference = create_model("transformer-seq2seq", "tiny").eval()
    with torch.device("meta"):
        assigned = create_model("transformer-seq2seq", "tiny")
    assigned.load_state_dict(reference.state_dict(), assign=True)
    source, target = torch.randint(3, 10, (2, 5)), torch.randint(3, 10, (2, 4))
    with pytest.raises(ValueError, match=r"table was never filled.*to_empty\(device=...\)"):
        assigned.eval()(source, target)
    assigned.to_empty(device="cpu").load_state_dict(reference.state_dict())
    expected = reference(source, target).logits
    torch.testing.assert_close(assigned(source, target).logits, expected, rtol=0, atol=0)


def test_the_table_is_computed_on_the_cpu_under_a_meta_default_device():
    """Its factories took the default device: "Cannot copy out of meta tensor" under
    ``with torch.device("meta")`` with ``device="cpu"`` given."""
    with torch.device("meta"):
        module = SinusoidalPositionalEncoding(4, max_len=7, device="cpu", dtype=torch.float64)
    assert module.table.device.type == "cpu"
    torch.testing.assert_close(module.table, _paper_table(7, 4), rtol=0, atol=1e-15)
