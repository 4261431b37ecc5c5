"""Generation with a key/value cache: the same tokens and logits as rerunning the whole prefix.

Then what generation does at its edges, for every model that generates: seeded sampling draws the
same tokens with and without the cache, prompts at the context limit, ``<eos>`` ending a sequence
(padding after it, decoding stopping once every sequence has ended), ``max_new_tokens=0``, and a
batch of sources of different lengths decoding each as if alone.

For ``transformer-lm`` and ``transformer-seq2seq``, softmax and routing attention, learned and
sinusoidal positions: greedy tokens of ``generate(use_cache=True)`` equal ``use_cache=False``
(batch > 1, padded sources, beyond the LM's context), and the logits of every cached step equal
the uncached forward pass on the whole prefix (1e-5, float32). The encoder-decoder also with
routing over the receivers in its encoder (``routing_normalize_over="receivers"``; its decoder,
the only part cached, stays over the senders).
"""

from __future__ import annotations

import pytest
import torch

from torchvote.models import create_model

VARIANTS = [(a, p) for a in ("softmax", "routing") for p in ("learned", "sinusoidal")]
#: The encoder-decoder's variants: VARIANTS over the senders, and routing over the receivers.
SEQ2SEQ_VARIANTS = [(a, p, "senders") for a, p in VARIANTS] + [
    ("routing", p, "receivers") for p in ("learned", "sinusoidal")
]


def _model(name: str, attention: str, positional: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return create_model(name, "tiny", attention=attention, positional=positional, **overrides).eval()


@pytest.mark.parametrize(("attention", "positional"), VARIANTS)
@pytest.mark.parametrize(("prompt_len", "new_tokens"), [(1, 6), (5, 20), (4, 40)])
def test_lm_greedy_tokens_with_and_without_cache_are_identical(attention, positional, prompt_len,
                                                                new_tokens):
    model = _model("transformer-lm", attention, positional)  # context 32: (4, 40) slides past it
    prompt = torch.randint(model.config.vocab_size, (3, prompt_len),
                           generator=torch.Generator().manual_seed(prompt_len))
    cached = model.generate(prompt, new_tokens, temperature=0.0)
    uncached = model.generate(prompt, new_tokens, temperature=0.0, use_cache=False)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize(("attention", "positional"), VARIANTS)
def test_lm_cached_logits_match_the_whole_prefix_at_every_step(attention, positional):
    model = _model("transformer-lm", attention, positional)
    tokens = torch.randint(model.config.vocab_size, (2, model.config.context_length),
                           generator=torch.Generator().manual_seed(1))
    cache = model.new_cache()
    with torch.no_grad():
        for start, end in [(0, 4), *((t, t + 1) for t in range(4, tokens.shape[1]))]:
            step = model(tokens[:, start:end], cache=cache).logits  # (b, end - start, vocab)
            expected = model(tokens[:, :end]).logits[:, start:]
            torch.testing.assert_close(step, expected, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="context_length"):
            model(tokens[:, :1], cache=cache)  # the context is full


@pytest.mark.parametrize(("attention", "positional", "normalize_over"), SEQ2SEQ_VARIANTS)
def test_seq2seq_greedy_tokens_with_and_without_cache_are_identical(attention, positional, normalize_over):
    model = _model("transformer-seq2seq", attention, positional, seed=1,
                   routing_normalize_over=normalize_over)
    source = torch.randint(3, model.config.src_vocab_size, (4, 9),
                           generator=torch.Generator().manual_seed(2))
    source[1, 5:] = model.config.pad_id  # padding
    source[3, 2:] = model.config.pad_id
    for limit in (1, 7, model.config.max_len - 1):
        cached = model.generate(source, max_new_tokens=limit)
        assert torch.equal(cached, model.generate(source, max_new_tokens=limit, use_cache=False))


@pytest.mark.parametrize(("attention", "positional", "normalize_over"), SEQ2SEQ_VARIANTS)
def test_seq2seq_cached_logits_match_the_whole_prefix_at_every_step(attention, positional, normalize_over):
    model = _model("transformer-seq2seq", attention, positional, routing_normalize_over=normalize_over)
    source = torch.randint(3, model.config.src_vocab_size, (2, 7),
                           generator=torch.Generator().manual_seed(3))
    source[0, 4:] = model.config.pad_id
    target = torch.randint(3, model.config.tgt_vocab_size, (2, 12),
                           generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        memory, source_mask = model.encode(source)
        cache = model.new_cache()
        for t in range(target.shape[1]):
            step = model.decode(target[:, t : t + 1], memory, source_mask, cache=cache)[:, -1]
            expected = model.decode(target[:, : t + 1], memory, source_mask)[:, -1]
            torch.testing.assert_close(step, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positional", ["learned", "sinusoidal"])
def test_seq2seq_routed_over_the_receivers_decodes_the_same_varied_tokens_with_a_cache(positional):
    """Untrained, the tied output layer repeats <bos>; an untied random one (std 1) with an <eos>
    logit of 0 decodes long, varied sequences, so equal tokens say more."""
    model = _model("transformer-seq2seq", "routing", positional, seed=1,
                   routing_normalize_over="receivers", tie_output=False)
    with torch.no_grad():
        torch.nn.init.normal_(model.output.weight, std=1.0)
        model.output.weight[model.config.eos_id] = 0.0
    source = torch.randint(3, model.config.src_vocab_size, (4, 9),
                           generator=torch.Generator().manual_seed(2))
    source[1, 5:] = model.config.pad_id
    source[3, 2:] = model.config.pad_id
    cached = model.generate(source, max_new_tokens=12)
    assert torch.equal(cached, model.generate(source, max_new_tokens=12, use_cache=False))
    assert cached.shape == (4, 13) and len(cached[:, 1:].unique()) >= 4  # none of them <bos> or <pad>


@pytest.mark.parametrize(("attention", "positional"), VARIANTS)
@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, None), (0.7, 5), (2.0, 3)])
def test_lm_sampled_tokens_with_and_without_cache_are_identical(attention, positional, temperature, top_k):
    """Seeded sampling draws the same tokens both ways (past the context too)."""
    model = _model("transformer-lm", attention, positional)
    prompt = torch.randint(model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(7))
    runs = [
        model.generate(prompt, 40, temperature=temperature, top_k=top_k,
                       generator=torch.Generator().manual_seed(11), use_cache=use_cache)
        for use_cache in (True, False)
    ]
    assert torch.equal(*runs)
    assert len(runs[0][:, 4:].unique()) > 3  # sampled, not one repeated token


@pytest.mark.parametrize(("attention", "positional"), VARIANTS)
def test_lm_prompts_at_the_context_limit_generate_the_same_with_and_without_cache(attention, positional):
    model = _model("transformer-lm", attention, positional)
    context = model.config.context_length
    for length in (context - 1, context, context + 3):  # the cache fills at once, is never used, ...
        prompt = torch.randint(model.config.vocab_size, (2, length),
                               generator=torch.Generator().manual_seed(length))
        for new_tokens in (0, 1, 5):
            cached = model.generate(prompt, new_tokens, temperature=0.0)
            assert cached.shape == (2, length + new_tokens) and torch.equal(cached[:, :length], prompt)
            assert torch.equal(cached, model.generate(prompt, new_tokens, temperature=0.0, use_cache=False))


def _forcing_eos(model, eos_step_of_row: list[int]):
    """A hook on the output layer: row ``r``'s ``n``-th decoded token is ``<eos>`` at step
    ``eos_step_of_row[r]``, a varied non-special token before."""
    state = {"step": 0}
    eos = model.config.eos_id

    def hook(module, inputs, output):
        output = output.clone()
        step = state["step"]
        state["step"] += 1
        output[..., -1, :] = 0.0
        output[..., -1, 5 + step % 3] = 1.0
        for row, when in enumerate(eos_step_of_row):
            if step == when:
                output[row, -1, eos] = 10.0
        return output

    return state, model.output.register_forward_hook(hook)


@pytest.mark.parametrize("name", ["transformer-seq2seq", "rnn-attention-seq2seq"])
def test_seq2seq_generation_stops_at_eos_and_pads_after_it(name):
    torch.manual_seed(0)
    model = create_model(name, "tiny").eval()
    config = model.config
    source = torch.randint(3, config.src_vocab_size, (3, 5), generator=torch.Generator().manual_seed(0))
    options = [{"use_cache": True}, {"use_cache": False}] if name == "transformer-seq2seq" else [{}]
    for kwargs in options:
        state, handle = _forcing_eos(model, [1, 2, 3])
        try:
            tokens = model.generate(source, max_new_tokens=10, **kwargs)
        finally:
            handle.remove()
        assert tokens.shape == (3, 5)  # stops once every row has ended, not after 10
        bos, eos, pad = config.bos_id, config.eos_id, config.pad_id
        expected = torch.tensor([[bos, 5, eos, pad, pad], [bos, 5, 6, eos, pad], [bos, 5, 6, 7, eos]])
        assert torch.equal(tokens, expected)
        assert torch.equal(model.generate(source, max_new_tokens=0, **kwargs),
                           torch.full((3, 1), config.bos_id))


@pytest.mark.parametrize("name", ["transformer-seq2seq", "rnn-attention-seq2seq"])
def test_seq2seq_a_batch_of_sources_of_different_lengths_decodes_each_as_alone(name):
    torch.manual_seed(0)
    model = create_model(name, "tiny", **({"tie_output": False} if name == "transformer-seq2seq" else {}))
    model.eval()
    with torch.no_grad():  # varied, long outputs (untrained, the tied layer repeats one token)
        torch.nn.init.normal_(model.output.weight, std=1.0)
    lengths = [8, 5, 2, 1]
    source = torch.randint(3, model.config.src_vocab_size, (4, 8), generator=torch.Generator().manual_seed(1))
    for row, length in enumerate(lengths):
        source[row, length:] = model.config.pad_id
    batched = model.generate(source, max_new_tokens=10)
    for row, length in enumerate(lengths):
        alone = model.generate(source[row : row + 1, :length], max_new_tokens=10)[0]
        assert torch.equal(batched[row, : len(alone)], alone)
        assert (batched[row, len(alone) :] == model.config.pad_id).all()


def test_a_refused_cached_decode_leaves_the_cache_as_it_was():
    """Layer 0's self-attention had taken the new token when its cross-attention refused the
    memory: the layers' caches then disagreed, and the next call's logits were wrong in silence."""
    model = _model("transformer-seq2seq", "softmax", "learned", seed=0)
    source = torch.randint(3, model.config.src_vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    target = torch.tensor([[1, 4, 5], [1, 6, 7]])
    with torch.no_grad():
        memory, source_mask = model.encode(source)
        full = model.decode(target, memory, source_mask)  # (2, 3, vocab)
        cache = model.new_cache()
        model.decode(target[:, :1], memory, source_mask, cache=cache)
        with pytest.raises(ValueError, match="cache holds the keys of a memory of batch 2 and length 5"):
            model.decode(target[:, 1:2], memory[:, :3], source_mask[:, :3], cache=cache)
        assert [layer.self_attention.length for layer in cache.layers] == [1] * len(cache.layers)
        step = model.decode(target[:, 1:2], memory, source_mask, cache=cache)[:, 0]
    torch.testing.assert_close(step, full[:, 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["transformer-seq2seq", "rnn-attention-seq2seq"])
def test_seq2seq_generation_never_picks_padding_or_bos(name):
    """An untrained model's largest logit was often <bos> (or <pad>): a <pad> before <eos> reads
    as the end of the sequence. The next most likely token is taken instead."""
    torch.manual_seed(0)
    model = create_model(name, "tiny").eval()
    config = model.config
    steps = {"n": 0}

    def hook(module, inputs, output):
        output = torch.zeros_like(output)
        output[..., -1, config.pad_id] = 9.0
        output[..., -1, config.bos_id] = 8.0
        output[..., -1, 5] = 1.0
        output[..., -1, config.eos_id] = 5.0 if steps["n"] == 2 else 0.0
        steps["n"] += 1
        return output

    handle = model.output.register_forward_hook(hook)
    try:
        tokens = model.generate(torch.randint(3, config.src_vocab_size, (2, 4)), max_new_tokens=6)
    finally:
        handle.remove()
    expected = torch.tensor([[config.bos_id, 5, 5, config.eos_id]] * 2)
    assert torch.equal(tokens, expected)


def test_greedy_generation_of_a_float64_lm_takes_its_float64_argmax():
    """The last logits were cast to float32 first: two logits 1e-12 apart tied, and the first won."""
    model = _model("transformer-lm", "softmax", "learned").double()
    prompt = torch.tensor([[1, 2]])

    def hook(module, inputs, output):
        output = torch.zeros_like(output)
        output[..., 0], output[..., 1] = 1.0, 1.0 + 1e-12
        return output

    handle = model.head.register_forward_hook(hook)
    try:
        assert int(model(prompt).logits[0, -1].argmax()) == 1
        assert int(model.generate(prompt, 1, temperature=0.0)[0, -1]) == 1
    finally:
        handle.remove()


def test_a_cache_filled_under_inference_mode_goes_on_outside_it():
    """The in-place append wrote into buffers made under ``torch.inference_mode``, which PyTorch
    refuses outside it (a raw error from inside the attention)."""
    model = _model("transformer-lm", "softmax", "learned")
    tokens = torch.randint(model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    cache = model.new_cache()
    with torch.inference_mode():
        model(tokens[:, :5], cache=cache)
        model(tokens[:, 5:6], cache=cache)  # the buffers are made here, as inference tensors
    with torch.no_grad():
        step = model(tokens[:, 6:7], cache=cache).logits
        step = model(tokens[:, 7:8], cache=cache).logits  # and in place again, in new buffers
        expected = model(tokens[:, :8]).logits[:, -1:]
    torch.testing.assert_close(step, expected, rtol=1e-5, atol=1e-5)
