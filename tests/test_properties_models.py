"""Metamorphic properties of the registered models at their tiny presets (float64, eval mode).

- **Batch independence**: every model's outputs (and, for the classifiers, the gradient with
  respect to each image) are those the example gets alone, and a reordered batch gives reordered
  outputs; for the sequence models also greedy decoding (``generate``), with and without the
  key/value cache.
- **Padding**: a seq2seq source padded with ``pad_id`` (to the length of a longer source in the
  same batch, or beyond) gives the logits of the unpadded source alone.
- **Causality**: a target (or LM) token changes no earlier position's logits: in one forward
  pass, and through the key/value cache (``forward(cache=...)`` in chunks, ``generate`` and
  ``stream``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchvote.models import create_model, get_model_spec, list_models

pytestmark = pytest.mark.usefixtures("one_thread")

DOUBLE = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
CLASSIFIERS = [name for name in list_models() if get_model_spec(name).task == "image-classification"]
SEQ2SEQ = [name for name in list_models() if get_model_spec(name).task == "seq2seq"]
LANGUAGE_MODELS = [name for name in list_models() if get_model_spec(name).task == "language-model"]
# the sequence models with their other attentions: routing-style attention, Luong's scores
SEQ2SEQ_VARIANTS = [pytest.param(name, {}, id=name) for name in SEQ2SEQ] + [
    pytest.param("transformer-seq2seq", {"attention": "routing"}, id="transformer-seq2seq-routing"),
    pytest.param("rnn-attention-seq2seq", {"attention": "general", "bidirectional": False},
                 id="rnn-attention-seq2seq-luong-general"),
    pytest.param("rnn-attention-seq2seq", {"attention": "concat"}, id="rnn-attention-seq2seq-luong-concat"),
]
LM_VARIANTS = [pytest.param(name, {}, id=name) for name in LANGUAGE_MODELS] + [
    pytest.param("transformer-lm", {"attention": "routing"}, id="transformer-lm-routing"),
]


def test_every_task_is_covered():
    assert set(CLASSIFIERS) | set(SEQ2SEQ) | set(LANGUAGE_MODELS) == set(list_models())
    assert CLASSIFIERS and SEQ2SEQ and LANGUAGE_MODELS


def tiny(name, **overrides):
    torch.manual_seed(0)
    return create_model(name, "tiny", dtype=DOUBLE, **overrides).eval()


def tensors_of(output) -> dict:
    """Every tensor an output holds, by field (intermediates and attention lists included)."""
    found = {}
    for key, value in vars(output).items():
        if isinstance(value, torch.Tensor):
            found[key] = value
        elif isinstance(value, dict):
            found.update({f"{key}.{k}": v for k, v in value.items() if isinstance(v, torch.Tensor)})
        elif isinstance(value, list):
            found.update({f"{key}[{i}]": v for i, v in enumerate(value) if isinstance(v, torch.Tensor)})
    return found


def assert_rows(got: dict, full: dict, rows):
    assert got.keys() == full.keys()
    for key in got:
        torch.testing.assert_close(got[key], full[key][rows], **TIGHT, msg=lambda m, key=key: f"{key}: {m}")


def tokens(shape, low, high, seed):
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))


# --- classifiers ----------------------------------------------------------------------------------


TARGETS = {"none": None, "classes": torch.tensor([3, 7, 1]), "pairs": torch.tensor([[3, 5], [7, 0], [1, 2]])}


@pytest.mark.parametrize("targets", TARGETS)  # evaluation, and the decoders masked by true classes
@pytest.mark.parametrize("name", CLASSIFIERS)
def test_classifier_rows_are_independent(name, targets):
    model = tiny(name)
    batch, targets = 3, TARGETS[targets]

    def rows(index):
        return None if targets is None else targets[index]

    images = torch.rand(batch, 1, 28, 28, generator=torch.Generator().manual_seed(1), dtype=DOUBLE)
    images.requires_grad_(True)
    output = model(images, targets)
    full = tensors_of(output)
    weights = torch.randn(output.scores.shape, generator=torch.Generator().manual_seed(2), dtype=DOUBLE)
    (grad,) = torch.autograd.grad((output.scores * weights).sum(), images)
    for k in range(batch):
        row = images[k : k + 1].detach().requires_grad_(True)
        alone = model(row, rows(slice(k, k + 1)))
        assert_rows(tensors_of(alone), full, slice(k, k + 1))
        (grad_alone,) = torch.autograd.grad((alone.scores * weights[k : k + 1]).sum(), row)
        torch.testing.assert_close(grad_alone, grad[k : k + 1], **TIGHT)
    order = torch.tensor([2, 0, 1])
    assert_rows(tensors_of(model(images[order], rows(order))), full, order)


# --- seq2seq --------------------------------------------------------------------------------------


def sources(lengths, width, seed):
    """Sources of the given lengths (ids 3..14), padded with 0 to ``width``."""
    rows = tokens((len(lengths), width), 3, 15, seed)
    for k, length in enumerate(lengths):
        rows[k, length:] = 0
    return rows


@pytest.mark.parametrize(("name", "overrides"), SEQ2SEQ_VARIANTS)
def test_seq2seq_rows_and_padding_are_independent(name, overrides):
    model = tiny(name, **overrides)
    lengths = [5, 2, 7, 3]
    source = sources(lengths, 9, 1)  # padded to 9: two more than the longest
    target = tokens((4, 4), 3, 15, 2)
    target[:, 0] = 1  # <bos>
    full = tensors_of(model(source, target, need_weights=True))
    for k, length in enumerate(lengths):
        alone = model(source[k : k + 1, :length], target[k : k + 1], need_weights=True)
        logits = alone.logits
        torch.testing.assert_close(logits, full["logits"][k : k + 1], **TIGHT)
        attention = full.get("attention[0]")
        if attention is not None and name == "rnn-attention-seq2seq":  # (b, t, s): no weight on padding
            torch.testing.assert_close(attention[k : k + 1, :, :length], alone.attention[0], **TIGHT)
            assert not attention[k, :, length:].any()
    order = torch.tensor([3, 1, 0, 2])
    assert_rows({"logits": model(source[order], target[order]).logits}, {"logits": full["logits"]}, order)


@pytest.mark.parametrize(("name", "overrides"), SEQ2SEQ_VARIANTS)
def test_seq2seq_padding_embedding_can_be_anything(name, overrides):
    """Padded source positions are masked out everywhere: the embedding row of ``pad_id`` gets no
    gradient and can take any value. (Where the output layer is tied to that embedding the logit
    of ``pad_id`` itself follows it, by design: that column is left out.)"""
    model = tiny(name, **overrides)
    pad = model.config.pad_id
    source, target = sources([3, 1, 5], 6, 7), tokens((3, 4), 3, 15, 8)
    target[:, 0] = 1
    logits = model(source, target).logits
    real = [c for c in range(logits.shape[-1]) if c != pad]
    weights = torch.randn(logits[..., real].shape, generator=torch.Generator().manual_seed(9), dtype=DOUBLE)
    (grad,) = torch.autograd.grad((logits[..., real] * weights).sum(), model.source_embedding.weight)
    assert not grad[pad].any()
    with torch.no_grad():
        model.source_embedding.weight[pad] = 50 * torch.randn(
            grad.shape[-1], generator=torch.Generator().manual_seed(10), dtype=DOUBLE)
    torch.testing.assert_close(model(source, target).logits[..., real], logits[..., real], **TIGHT)


@pytest.mark.parametrize(("name", "overrides"), SEQ2SEQ_VARIANTS)
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), position=st.integers(1, 4))
def test_seq2seq_target_tokens_change_no_earlier_logits(name, overrides, seed, position):
    model = tiny(name, **overrides)
    source = sources([4, 6], 6, seed)
    target = tokens((2, 5), 3, 15, seed + 1)
    target[:, 0] = 1
    changed = target.clone()
    changed[:, position] = 3 + (target[:, position] - 3 + 5) % 12  # another real token
    before, after = model(source, target).logits, model(source, changed).logits
    torch.testing.assert_close(after[:, :position], before[:, :position], **TIGHT)
    assert not torch.allclose(after[:, position], before[:, position])  # the change is seen


@pytest.mark.parametrize(("name", "overrides"), SEQ2SEQ_VARIANTS)
def test_seq2seq_greedy_decoding_is_per_row_and_the_same_with_or_without_the_cache(name, overrides):
    model = tiny(name, **overrides)
    lengths = [6, 2, 4]
    source = sources(lengths, 8, 3)
    decoded = model.generate(source, max_new_tokens=6)
    assert torch.equal(model.generate(source, max_new_tokens=6, use_cache=False), decoded)
    for k, length in enumerate(lengths):
        alone = model.generate(source[k : k + 1, :length], max_new_tokens=6)
        width = alone.shape[1]  # a batch decodes until every row has ended: padding after
        assert torch.equal(alone[0], decoded[k, :width])
        assert not decoded[k, width:].any()


# --- language models ------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "overrides"), LM_VARIANTS)
def test_language_model_rows_are_independent(name, overrides):
    model = tiny(name, **overrides)
    text = tokens((3, 7), 0, model.config.vocab_size, 1)
    full = tensors_of(model(text, need_weights=True))
    for k in range(3):
        assert_rows(tensors_of(model(text[k : k + 1], need_weights=True)), full, slice(k, k + 1))
    order = torch.tensor([1, 2, 0])
    assert_rows(tensors_of(model(text[order], need_weights=True)), full, order)


@pytest.mark.parametrize(("name", "overrides"), LM_VARIANTS)
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), position=st.integers(1, 7))
def test_language_model_is_causal_with_and_without_the_cache(name, overrides, seed, position):
    model = tiny(name, **overrides)
    vocab = model.config.vocab_size
    text = tokens((2, 8), 0, vocab, seed)
    changed = text.clone()
    changed[:, position] = (text[:, position] + 1 + seed % (vocab - 1)) % vocab
    before, after = model(text).logits, model(changed).logits
    torch.testing.assert_close(after[:, :position], before[:, :position], **TIGHT)
    assert not torch.allclose(after[:, position], before[:, position])
    # the same through the cache: the prefix, then the rest in chunks of 2 (the change in one of them)
    split = max(1, position - 1)
    for sequence, reference in ((text, before), (changed, after)):
        cache = model.new_cache()
        pieces = [model(sequence[:, :split], cache=cache).logits]
        for start in range(split, 8, 2):
            pieces.append(model(sequence[:, start : start + 2], cache=cache).logits)
        torch.testing.assert_close(torch.cat(pieces, dim=1), reference, **TIGHT)


@pytest.mark.parametrize(("name", "overrides"), LM_VARIANTS)
def test_language_model_greedy_generation_is_per_row_cached_or_not(name, overrides):
    model = tiny(name, **overrides)
    prompt = tokens((3, 4), 0, model.config.vocab_size, 5)
    greedy = model.generate(prompt, 6, temperature=0.0)
    assert torch.equal(model.generate(prompt, 6, temperature=0.0, use_cache=False), greedy)
    assert torch.equal(torch.stack(list(model.stream(prompt, 6, temperature=0.0)), dim=1), greedy[:, 4:])
    for k in range(3):
        assert torch.equal(model.generate(prompt[k : k + 1], 6, temperature=0.0), greedy[k : k + 1])
    # a continuation never rewrites its prompt, and a longer prompt ending the same way...
    assert torch.equal(greedy[:, :4], prompt)
    # ...the first three generated tokens of a prompt determine the next: greedy from greedy[:, :7]
    assert torch.equal(model.generate(greedy[:, :7], 3, temperature=0.0), greedy)
