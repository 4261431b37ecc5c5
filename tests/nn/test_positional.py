"""Positional encodings against Vaswani et al. sec. 3.5 computed position by position."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.nn import LearnedPositionalEmbedding, SinusoidalPositionalEncoding


def _formula(position: int, index: int, embed_dim: int) -> float:
    """PE(pos, 2k) = sin(pos / 10000^(2k/d)), PE(pos, 2k+1) = cos(pos / 10000^(2k/d))."""
    pair = index // 2
    angle = position / 10000 ** (2 * pair / embed_dim)
    return math.sin(angle) if index % 2 == 0 else math.cos(angle)


@pytest.mark.parametrize("embed_dim", [8, 7])
def test_sinusoidal_matches_formula(embed_dim):
    max_len = 3000  # large positions: catches angles formed in float32 (error ~ pos * 6e-8)
    module = SinusoidalPositionalEncoding(embed_dim, max_len=max_len)
    expected = torch.tensor([[_formula(p, k, embed_dim) for k in range(embed_dim)]
                             for p in range(max_len)], dtype=torch.float32)
    zeros = torch.zeros(2, max_len, embed_dim)
    torch.testing.assert_close(module(zeros), expected.expand(2, -1, -1), rtol=0, atol=1e-6)


def test_sinusoidal_offset_continues_the_sequence():
    module = SinusoidalPositionalEncoding(6, max_len=20)
    inputs = torch.randn(3, 10, 6)
    full = module(inputs)
    for start in (0, 4, 9):
        torch.testing.assert_close(module(inputs[:, start:start + 1], offset=start),
                                   full[:, start:start + 1])
    assert module(torch.zeros(1, 1, 6), offset=19).shape == (1, 1, 6)


def test_sinusoidal_table_is_a_non_persistent_buffer_following_dtype():
    module = SinusoidalPositionalEncoding(4, max_len=10)
    assert "table" in dict(module.named_buffers())
    assert module.state_dict() == {}
    assert module(torch.zeros(1, 3, 4, dtype=torch.float64)).dtype == torch.float64
    assert module(torch.zeros(1, 3, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert module.double().table.dtype == torch.float64


def test_sinusoidal_dropout_only_in_training():
    module = SinusoidalPositionalEncoding(4, max_len=10, dropout=0.5)
    inputs = torch.ones(2, 5, 4)
    module.eval()
    torch.testing.assert_close(module(inputs), inputs + module.table[:5])
    module.train()
    torch.manual_seed(0)
    assert (module(inputs) == 0).any()


def test_learned_adds_its_rows_and_gradients_reach_only_them():
    torch.manual_seed(0)
    module = LearnedPositionalEmbedding(10, 4)
    inputs = torch.randn(2, 3, 4)
    output = module(inputs, offset=5)
    torch.testing.assert_close(output, inputs + module.weight[5:8])
    output.sum().backward()
    used = torch.zeros(10, dtype=torch.bool)
    used[5:8] = True
    assert torch.all(module.weight.grad[used] == 2)  # one per batch element
    assert torch.all(module.weight.grad[~used] == 0)


@pytest.mark.parametrize("make", [lambda: SinusoidalPositionalEncoding(4, max_len=6),
                                  lambda: LearnedPositionalEmbedding(6, 4)])
@pytest.mark.parametrize(("shape", "offset", "match"), [
    ((1, 7, 4), 0, "exceed max_len=6"),
    ((1, 3, 4), 4, r"offset=4, T=3\) exceed max_len"),
    ((1, 3, 4), -1, "offset must be a non-negative integer"),
    ((1, 3, 4), True, "offset must be a non-negative integer"),
    ((1, 3, 5), 0, r"inputs must have shape \(\.\.\., T, 4\)"),
])
def test_errors(make, shape, offset, match):
    with pytest.raises(ValueError, match=match):
        make()(torch.zeros(shape), offset=offset)


@pytest.mark.parametrize(("make", "name"), [
    (lambda: SinusoidalPositionalEncoding(0), "embed_dim"),
    (lambda: SinusoidalPositionalEncoding(8.0), "embed_dim"),  # was a TypeError from torch.empty
    (lambda: SinusoidalPositionalEncoding(8, max_len=0), "max_len"),
    (lambda: SinusoidalPositionalEncoding(8, dropout=1.0), "dropout"),
    (lambda: LearnedPositionalEmbedding(0, 4), "max_len"),
    (lambda: LearnedPositionalEmbedding(4, 0), "embed_dim"),
])
def test_constructor_errors(make, name):
    with pytest.raises(ValueError, match=name):
        make()


@pytest.mark.parametrize("make", [lambda: SinusoidalPositionalEncoding(4),
                                  lambda: LearnedPositionalEmbedding(6, 4)])
def test_integer_inputs_are_refused(make):
    # Integer features plus the float encodings once came back as integers: the encodings were lost.
    with pytest.raises(TypeError, match="inputs must be floating point"):
        make()(torch.zeros(1, 3, 4, dtype=torch.long))


def test_inputs_on_another_device_than_the_table_are_named():
    """A table on one device and inputs on another failed in PyTorch's addition, naming no argument."""
    inputs = torch.zeros(1, 3, 4)
    with pytest.raises(ValueError, match="inputs is on meta but the encodings are on cpu"):
        SinusoidalPositionalEncoding(4)(inputs.to("meta"))
    # a table still on meta was never filled: said, not "move the inputs to meta"
    with pytest.raises(ValueError, match="table was never filled: .* built on the 'meta' device"):
        SinusoidalPositionalEncoding(4, device="meta")(inputs)
    with pytest.raises(ValueError, match="inputs is on cpu but the module's parameters are on meta"):
        LearnedPositionalEmbedding(6, 4, device="meta")(inputs)
