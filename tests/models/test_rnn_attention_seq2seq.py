"""The GRU encoder-decoder with Bahdanau or Luong attention (rnn-attention-seq2seq).

Shapes and weights for each score, the decoder's causality, padding invariance (the source is
packed), greedy decoding against teacher forcing, config errors, and a seconds-long training
through the training loop's public entry on the shipped ``rnn-addition`` preset.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchvote.models import create_model
from torchvote.nn import AdditiveAttention, LuongAttention
from torchvote.training import train
from torchvote.training.config import load_config

BOS, EOS, PAD = 1, 2, 0
SCORES = [
    ("additive", {}),
    ("general", {}),
    ("concat", {"attention_dim": 24}),
    ("dot", {"bidirectional": False}),
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see the fixture


def _model(attention: str = "additive", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return create_model("rnn-attention-seq2seq", "tiny", attention=attention, **overrides).eval()


def _sources() -> torch.Tensor:
    """Three sources of 5, 3 and 6 tokens (ending in <eos>), padded to 6."""
    source = torch.tensor([[5, 6, 7, 8, EOS, PAD], [9, 4, EOS, PAD, PAD, PAD], [3, 4, 5, 6, 7, EOS]])
    return source


def _targets(length: int = 5) -> torch.Tensor:
    target = torch.randint(3, 13, (3, length), generator=torch.Generator().manual_seed(1))
    target[:, 0] = BOS
    return target


def test_sources_of_any_length_are_read_unlike_the_transformers():
    """`max_source_length` tells `torchvote generate` how long a source may be: the GRUs read any
    length, the Transformer's positions end at its max_len."""
    model = _model(max_len=4)
    assert model.max_source_length is None
    long = torch.randint(3, 13, (1, 3 * model.config.max_len))  # three times max_len
    long[0, -1] = EOS
    assert model.generate(long).shape[0] == 1
    transformer = create_model("transformer-seq2seq", "tiny", max_len=4)
    assert transformer.max_source_length == 4
    with pytest.raises(ValueError, match="source"):
        transformer.generate(long)


@pytest.mark.parametrize(("attention", "options"), SCORES)
def test_shapes_and_weights_for_every_score(attention, options):
    model = _model(attention, **options)
    expected = AdditiveAttention if attention == "additive" else LuongAttention
    assert isinstance(model.attention, expected)
    source, target = _sources(), _targets()
    output = model(source, target)
    assert output.logits.shape == (3, 5, model.config.tgt_vocab_size) and output.attention is None
    recorded = model(source, target, need_weights=True)
    torch.testing.assert_close(recorded.logits, output.logits)
    (weights,) = recorded.attention
    assert weights.shape == (3, 5, 6)
    assert torch.equal(recorded.intermediates["attention"], weights)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 5))
    assert (weights[1, :, 3:] == 0).all() and (weights[0, :, 5] == 0).all()  # padding: no weight


@pytest.mark.parametrize(("attention", "options"), SCORES[:2])
def test_the_decoder_never_looks_ahead(attention, options):
    model = _model(attention, **options)
    source, target = _sources(), _targets(7)
    changed = target.clone()
    changed[:, 4:] = 3 + (changed[:, 4:] - 2) % 10
    before, after = model(source, target).logits, model(source, changed).logits
    torch.testing.assert_close(after[:, :4], before[:, :4], rtol=0, atol=0)
    assert not torch.allclose(after[:, 4:], before[:, 4:], atol=1e-4)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("attention", ["additive", "general"])
def test_appending_padding_to_the_source_changes_nothing(attention, bidirectional):
    model = _model(attention, bidirectional=bidirectional, num_layers=2)
    source, target = _sources(), _targets()
    padded = torch.cat([source, torch.full((3, 3), PAD)], dim=1)
    torch.testing.assert_close(
        model(padded, target).logits, model(source, target).logits, rtol=1e-6, atol=1e-6
    )
    memory, mask, _ = model.encode(padded)
    assert (memory[~mask] == 0).all()


@pytest.mark.parametrize(("attention", "options"), SCORES)
def test_greedy_generation_agrees_with_teacher_forcing(attention, options):
    model = _model(attention, **options)
    source = _sources()
    tokens = model.generate(source, max_new_tokens=6)
    assert tokens.shape[0] == 3 and 2 <= tokens.shape[1] <= 7 and (tokens[:, 0] == BOS).all()
    logits = model(source, tokens[:, :-1]).logits  # (b, n, vocab)
    logits[..., [PAD, BOS]] = -torch.inf  # generation never picks them
    predicted = logits.argmax(-1)  # (b, n)
    ended = (tokens[:, 1:-1] == EOS).cumsum(dim=1) > 0  # positions after an <eos>
    ended = torch.cat([torch.zeros(3, 1, dtype=torch.bool), ended], dim=1)
    assert torch.equal(predicted[~ended], tokens[:, 1:][~ended])
    assert (tokens[:, 1:][ended] == PAD).all()
    model.train()
    model.generate(source, max_new_tokens=2)
    assert model.training  # the mode is restored


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"attention": "dot"}, "bidirectional"),
        ({"attention": "bilinear"}, "attention"),
        ({"attention": "general", "attention_dim": 8}, "attention_dim"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_layers": 0}, "num_layers"),
        ({"dropout": -0.1}, "dropout"),
        ({"eos_id": 15}, "eos_id"),
        ({"pad_id": 1}, "pad_id"),
    ],
)
def test_bad_config_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        create_model("rnn-attention-seq2seq", "tiny", **overrides)


def test_bad_inputs_name_the_argument():
    model = _model()
    with pytest.raises(ValueError, match="padding \\(pad_id\\) before a real token"):
        model(torch.tensor([[5, PAD, 6, EOS]]), _targets()[:1])
    with pytest.raises(ValueError, match="target_input must hold integer"):
        model(_sources(), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="same batch size"):
        model(_sources(), _targets()[:2])
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(_sources(), max_new_tokens=-1)
    with pytest.raises(ValueError, match="source holds ids outside the vocabulary"):
        model.generate(_sources() + model.config.src_vocab_size)
    with pytest.raises(ValueError, match="target_input holds ids outside the vocabulary"):
        model(_sources(), _targets() - 100)


@pytest.mark.parametrize("attention", ["additive", "general"])
def test_learns_addition_through_the_training_loop(tmp_path: Path, attention):
    losses: list[float] = []
    config = load_config(
        "rnn-addition",
        [
            "model.preset=tiny",
            f"model.attention={attention}",
            "data.options.max_len=2",
            "data.options.num_samples=640",
            "data.eval_limit=64",
            "batch_size=32",
            "epochs=2",
            "optim.lr=0.01",
            "optim.warmup_steps=0",
            "optim.schedule=constant",
            "progress=false",
            "tensorboard=false",
            "log_every=10",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    result = train(config, callbacks=[lambda info: losses.append(info.loss)], verbose=False)
    assert len(losses) == 40
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert end < 0.8 * start, f"loss went from {start:.3f} to {end:.3f}"
    assert result.model.config.attention == attention
    assert "sequence_accuracy" in result.results["addition/test"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"pad_id": 1.5}, "pad_id must be an integer >= 0, got 1.5"),
        ({"eos_id": None}, "eos_id must be an integer >= 0, got None"),
    ],
)
def test_special_ids_that_are_not_integers_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        create_model("rnn-attention-seq2seq", "tiny", **overrides)
