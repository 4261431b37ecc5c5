"""One ``generate`` call for both encoder-decoders, and what the caches refuse.

The GRU encoder-decoder takes the Transformer encoder-decoder's arguments, checked the same way:
``max_new_tokens`` in ``[0, max_len - 1]`` (one message for both), ``use_cache`` a bool that
leaves the GRU's tokens unchanged (its state is the cache). A key/value cache refuses new keys of
another dtype (``torch.cat`` promoted them in silence) and the language model reads ``top_k`` of
the vocabulary size or more as no restriction, as nanoGPT does.
"""

from __future__ import annotations

import pytest
import torch

from torchvote.models import create_model

SEQ2SEQ = ["transformer-seq2seq", "rnn-attention-seq2seq"]


def _model(name: str, **overrides):
    torch.manual_seed(0)
    return create_model(name, "tiny", **overrides).eval()


def _varied(model):
    """Untrained, a model repeats one token or ends at once; random output weights (std 1) and
    an <eos> that never wins (-inf bias; a zero row without bias) decode long, varied rows."""
    with torch.no_grad():
        torch.nn.init.normal_(model.output.weight, std=1.0)
        if model.output.bias is not None:
            model.output.bias.zero_()
            model.output.bias[model.config.eos_id] = float("-inf")
        else:
            model.output.weight[model.config.eos_id] = 0.0
    return model


def _sources(model) -> torch.Tensor:
    source = torch.randint(3, model.config.src_vocab_size, (3, 6), generator=torch.Generator().manual_seed(0))
    source[1, 4:] = model.config.pad_id
    return source


@pytest.mark.parametrize("name", SEQ2SEQ)
@pytest.mark.parametrize("bad", [-1, 32, 10**6, True, 2.0, "3"])
def test_seq2seq_max_new_tokens_is_checked_the_same_way_by_both_models(name, bad):
    model = _model(name)
    assert model.config.max_len == 32
    expected = f"max_new_tokens must be an integer in [0, max_len - 1 = 31], got {bad!r}"
    with pytest.raises(ValueError) as error:
        model.generate(_sources(model), max_new_tokens=bad)
    assert str(error.value) == expected


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_max_new_tokens_at_the_limit_and_by_default_decode_max_len_tokens(name):
    model = _varied(_model(name, **({"tie_output": False} if name == "transformer-seq2seq" else {})))
    source = _sources(model)
    for limit in (None, 31):
        tokens = model.generate(source, max_new_tokens=limit)
        if name == "rnn-attention-seq2seq":  # no <eos> possible: all 31 steps
            assert tokens.shape == (3, 32)
        assert tokens.shape[1] <= 32 and (tokens[:, 0] == model.config.bos_id).all()
    assert model.generate(source, max_new_tokens=0).shape == (3, 1)


@pytest.mark.parametrize("attention", ["additive", "general"])
def test_rnn_use_cache_is_a_checked_switch_that_changes_no_token(attention):
    model = _varied(_model("rnn-attention-seq2seq", attention=attention))
    source = _sources(model)
    cached = model.generate(source, max_new_tokens=12, use_cache=True)
    assert torch.equal(cached, model.generate(source, max_new_tokens=12, use_cache=False))
    assert torch.equal(cached, model.generate(source, max_new_tokens=12))
    assert cached.shape == (3, 13)  # no <eos>: every step ran
    for value in ("no", None, 0, 1):
        with pytest.raises(TypeError, match=f"use_cache must be True or False, got {value!r}"):
            model.generate(source, max_new_tokens=2, use_cache=value)


def test_lm_cache_refuses_keys_of_another_dtype_after_the_model_is_converted():
    """Filled in float32, then the model converted to float64: torch.cat promoted the cached keys
    and decoding went on with float32-rounded keys for the past, a silently mixed precision."""
    model = _model("transformer-lm")
    prompt = torch.randint(model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache()
    with torch.no_grad():
        model(prompt, cache=cache)
        model.double()
        refused = "torch.float32 on cpu; new keys .* torch.float64 on cpu do not extend"
        with pytest.raises(ValueError, match=refused):
            model(prompt[:, :1], cache=cache)
        fresh = model.new_cache()  # what the message says: a new cache, filled in float64
        model(prompt, cache=fresh)
        step = model(prompt[:, :1], cache=fresh).logits
        torch.testing.assert_close(step, model(torch.cat([prompt, prompt[:, :1]], 1)).logits[:, -1:])


def test_lm_top_k_of_the_vocabulary_size_or_more_samples_as_no_top_k():
    model = _model("transformer-lm")
    prompt = torch.randint(model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(2))
    runs = [
        model.generate(prompt, 12, top_k=top_k, generator=torch.Generator().manual_seed(5))
        for top_k in (None, model.config.vocab_size, model.config.vocab_size + 100)
    ]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    assert len(runs[0][:, 3:].unique()) > 3  # sampled, not one repeated token
