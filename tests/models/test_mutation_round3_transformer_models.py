"""Mutation review, round 3: the Transformer models' wiring written out from the papers.

The earlier tests checked shapes, causality and that the models learn; a class token read from the
wrong end, patches in column order, a post-norm encoder or unscaled embeddings pass all of them.
Each reference below is built from the model's own submodules (each tested on its own) in the
order the paper gives.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchvote.models import create_model


def _model(name: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return create_model(name, "tiny", **overrides).eval()


def _randomize_(*tensors: torch.Tensor) -> None:
    with torch.no_grad():
        for tensor in tensors:
            tensor.normal_()


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_vision_transformer_is_patches_in_row_major_order_then_the_pooled_token(pooling):
    """Mutants: the class token read at the last position, put after the patches, or mean pooling
    replaced by the first token; the patches flattened column by column. Dosovitskiy et al. 2021,
    eq. 1-4: ``z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos`` with the patches in reading order,
    the prediction from ``z_L^0`` (or, pooled, the mean of the tokens)."""
    model = _model("transformer-classifier", pooling=pooling)
    _randomize_(model.positions.weight, *([model.class_token] if model.class_token is not None else []))
    images = torch.rand(2, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    patch, weight = model.config.patch_size, model.patch_embedding.weight  # (E, c, p, p)
    tokens = []
    for row in range(28 // patch):  # reading order: along a row of patches, then the next row
        for col in range(28 // patch):
            pixels = images[:, :, row * patch : (row + 1) * patch, col * patch : (col + 1) * patch]
            tokens.append(F.linear(pixels.flatten(1), weight.flatten(1), model.patch_embedding.bias))
    sequence = torch.stack(tokens, dim=1)  # (b, N, E)
    if pooling == "cls":
        sequence = torch.cat([model.class_token.expand(2, -1, -1), sequence], dim=1)
    hidden = model.encoder(model.positions(sequence))
    pooled = hidden[:, 0] if pooling == "cls" else hidden.mean(dim=1)
    with torch.no_grad():
        torch.testing.assert_close(model(images).scores, model.head(pooled), rtol=1e-4, atol=1e-5)


def test_the_language_models_head_is_the_token_embedding():
    """Mutant: ``tie_weights`` ignored. With tied weights (the default; Press & Wolf 2017, as
    GPT-2) the logits are the last hidden states times the embedding matrix, so a change of the
    embedding is a change of the head."""
    model = _model("transformer-lm")
    assert model.config.tie_weights
    with torch.no_grad():
        model.token_embedding.weight.mul_(2.0)
    tokens = torch.randint(model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(2))
    hidden = model.decoder(model.positions(model.token_embedding(tokens)), is_causal=True)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, hidden @ model.token_embedding.weight.T)
    untied = _model("transformer-lm", tie_weights=False)
    count = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in untied.parameters()) == count + model.head.weight.numel()


def test_seq2seq_scales_the_embeddings_by_the_root_of_d_model():
    """Mutant: the embeddings not scaled. Vaswani et al. 2017, sec. 3.4: "we multiply those
    weights by sqrt(d_model)" before the positional encodings (sec. 3.5) are added; the encoder's
    first layer receives exactly that."""
    model = _model("transformer-seq2seq")
    source = torch.randint(3, 13, (2, 5), generator=torch.Generator().manual_seed(3))
    seen = []
    first = next(module for name, module in model.named_modules() if name.endswith("layers.0"))
    handle = first.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    embedding = next(m for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding))
    try:
        with torch.no_grad():
            model(source, torch.randint(3, 13, (2, 4)))
    finally:
        handle.remove()
    d_model = model.config.d_model
    position = torch.arange(5, dtype=torch.float32)[:, None]
    frequency = torch.exp(-math.log(10000.0) * torch.arange(0, d_model, 2, dtype=torch.float32) / d_model)
    encoding = torch.zeros(5, d_model)
    encoding[:, 0::2], encoding[:, 1::2] = torch.sin(position * frequency), torch.cos(position * frequency)
    expected = embedding(source) * math.sqrt(d_model) + encoding
    torch.testing.assert_close(seen[0], expected.detach(), rtol=1e-4, atol=1e-5)


def test_lm_generation_past_the_context_reads_the_last_context_length_tokens():
    """Mutant: past ``context_length`` the window kept one token fewer (``tokens[:, -context + 1:]``).
    The model knows ``context_length`` positions; greedy decoding from a prompt that fills them must
    choose each token from exactly the last ``context_length`` tokens, a loop of forward calls."""
    model = _model("transformer-lm", context_length=8)
    prompt = torch.randint(model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4))
    generated = model.generate(prompt, 2, temperature=0.0)  # a full prompt: no cache, the window
    tokens = prompt
    with torch.no_grad():
        for _ in range(2):
            following = model(tokens[:, -8:]).logits[:, -1].argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, following], dim=1)
    assert torch.equal(generated, tokens)
