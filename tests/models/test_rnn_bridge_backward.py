"""``rnn-attention-seq2seq``'s ``bridge="backward"``: the decoder starts from RNNsearch's
``s_0 = tanh(W_s h<-_1)`` (Bahdanau, Cho & Bengio 2015, app. A.2.2), the encoder's backward final
state, checked against a GRU loop written here; ``"both"`` (the default) keeps the two directions'
states, as checkpoints saved before the option hold."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from conftest import padded_source
from torchvote.models import create_model
from torchvote.training.config import model_config_from

F64 = torch.float64


def _model(bridge: str | None, num_layers: int = 1, **extra):
    torch.manual_seed(0)
    options = {} if bridge is None else {"bridge": bridge}
    return create_model(
        "rnn-attention-seq2seq", "tiny", num_layers=num_layers, dtype=F64, **options, **extra
    ).train(False)


def _gru_cell(x: Tensor, h: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor, b_hh: Tensor) -> Tensor:
    """One GRU step (the gates of ``torch.nn.GRU``): ``x (E,)``, ``h (H,)`` -> ``(H,)``."""
    r_x, z_x, n_x = (w_ih @ x + b_ih).chunk(3)
    r_h, z_h, n_h = (w_hh @ h + b_hh).chunk(3)
    r, z = torch.sigmoid(r_x + r_h), torch.sigmoid(z_x + z_h)
    n = torch.tanh(n_x + r * n_h)
    return (1 - z) * n + z * h


def _backward_first_state(model, tokens: Tensor) -> Tensor:
    """``h<-_1`` of a one-layer encoder: the backward GRU run from the last real token to the
    first, from a zero state (app. A.2.2: the backward RNN reads the sequence in reverse)."""
    gru = model.encoder
    names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
    weights = [getattr(gru, f"{name}_l0_reverse") for name in names]
    h = torch.zeros(gru.hidden_size, dtype=F64)
    for x in model.source_embedding(tokens).flip(0):  # (E,) each, x_Tx first
        h = _gru_cell(x, h, *weights)
    return h  # (H,)


@pytest.mark.parametrize("lengths", [[5, 2, 7, 1], [6, 6, 6]], ids=["padded", "unpadded"])
def test_s0_is_tanh_of_W_s_times_the_backward_first_state(lengths):
    model = _model("backward")
    source = padded_source(lengths, max(lengths) + 1)
    memory, _, hidden = model.encode(source)  # hidden: (1, b, H)
    W_s, b_s = model.bridge.weight, model.bridge.bias  # (H, H), (H,)
    H = model.config.hidden_size
    for row, length in enumerate(lengths):
        h_back = _backward_first_state(model, source[row, :length])  # (H,)
        s_0 = torch.tanh(W_s @ h_back + b_s)  # app. A.2.2
        torch.testing.assert_close(hidden[0, row], s_0, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(memory[row, 0, H:], h_back, rtol=1e-12, atol=1e-12)  # h<-_1


def test_every_layer_starts_from_its_own_backward_state():
    model = _model("backward", num_layers=2)
    lengths = [4, 1, 6]
    source = padded_source(lengths, 6)
    _, _, hidden = model.encode(source)  # (2, b, H)
    for row, length in enumerate(lengths):
        embedded = model.source_embedding(source[row : row + 1, :length])  # (1, length, E), no padding
        _, final = model.encoder(embedded)  # (layers * 2, 1, H): l0 fwd, l0 bwd, l1 fwd, l1 bwd
        for layer in range(2):
            expected = torch.tanh(model.bridge(final[2 * layer + 1, 0]))
            torch.testing.assert_close(hidden[layer, row], expected, rtol=1e-12, atol=1e-12)


def test_both_is_the_default_and_reads_both_directions():
    default, both = _model(None), _model("both")
    assert default.config.bridge == "both"
    H = default.config.hidden_size
    assert default.bridge.weight.shape == both.bridge.weight.shape == (H, 2 * H)
    assert _model("backward").bridge.weight.shape == (H, H)
    source = padded_source([5, 2, 7], 7)
    torch.testing.assert_close(default.encode(source)[2], both.encode(source)[2], rtol=0, atol=0)
    _, _, hidden = both.encode(source)
    for row, length in enumerate([5, 2, 7]):
        _, final = both.encoder(both.source_embedding(source[row : row + 1, :length]))  # (2, 1, H)
        expected = torch.tanh(both.bridge(torch.cat([final[0, 0], final[1, 0]])))  # [h->_Tx; h<-_1]
        torch.testing.assert_close(hidden[0, row], expected, rtol=1e-12, atol=1e-12)


def test_a_backward_bridge_trains_and_decodes():
    model = _model("backward").train()
    source, target = padded_source([5, 2, 7], 7), torch.randint(3, 15, (3, 4))
    model(source, target).logits.sum().backward()
    assert model.bridge.weight.grad is not None and model.bridge.weight.grad.abs().sum() > 0
    assert model.generate(source, max_new_tokens=3).shape[0] == 3


def test_bad_bridges_are_refused_by_name():
    with pytest.raises(ValueError, match=r"bridge must be one of 'both', 'backward', got 'forward'"):
        _model("forward")
    with pytest.raises(ValueError, match=r"bridge='backward'.*bidirectional=False"):
        _model("backward", bidirectional=False, attention="general")
    _model("both", bidirectional=False, attention="general")  # Luong's: its one direction


def test_the_option_reaches_the_model_from_an_override():
    from torchvote.models.registry import get_model_spec
    from torchvote.training.config import apply_overrides, config_from_dict

    values = {"model": {"name": "rnn-attention-seq2seq", "preset": "tiny"}, "data": {"name": "reverse"}}
    config = apply_overrides(config_from_dict(values), ["model.bridge=backward"])
    model_config = model_config_from(config)
    assert model_config.bridge == "backward"
    model = get_model_spec("rnn-attention-seq2seq").model_cls(model_config)
    assert model.bridge.weight.shape == (model_config.hidden_size, model_config.hidden_size)
