"""Nucleus (top-p) sampling in :func:`~torchvote.models.sampling.sample_next_token` and
``TransformerLM.generate`` (Holtzman et al. 2020, sec. 3.1).

A hand-computed distribution is sampled many times: the tokens drawn are exactly those of the
nucleus, at their renormalised probabilities (within 5 binomial standard errors). The kept set of
random logits equals a plain-Python loop written from the paper's definition (hypothesis);
``top_p=1`` changes nothing, ``top_k`` cuts first, greedy decoding ignores ``top_p``, and
``generate`` draws only from the nucleus, the same tokens with and without its cache.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from torchvote.models import create_model
from torchvote.models.sampling import _filtered_logits, sample_next_token

#: Draws per hand-computed case: a frequency's standard error is at most 0.5 / sqrt(DRAWS) = 0.0016.
DRAWS = 100_000


def _draw_frequencies(probabilities: list[float], *, seed: int, **options) -> torch.Tensor:
    """The frequency of every id among DRAWS tokens drawn from ``log(probabilities)`` (float64)."""
    logits = torch.tensor(probabilities, dtype=torch.float64).log().expand(DRAWS, -1)  # (DRAWS, vocab)
    tokens = sample_next_token(logits, generator=torch.Generator().manual_seed(seed), **options)  # (DRAWS, 1)
    assert tokens.shape == (DRAWS, 1) and tokens.dtype == torch.int64
    return torch.bincount(tokens[:, 0], minlength=len(probabilities)).double() / DRAWS  # (vocab,)


def _assert_draws_follow(frequencies: torch.Tensor, kept: dict[int, float]) -> None:
    """Exactly the ids of ``kept`` drawn, each at its probability within 5 standard errors."""
    drawn = set(torch.nonzero(frequencies).flatten().tolist())
    assert drawn == set(kept)
    for token, probability in kept.items():
        tolerance = 5 * math.sqrt(probability * (1 - probability) / DRAWS)
        assert abs(float(frequencies[token]) - probability) <= tolerance, (token, frequencies.tolist())


@pytest.mark.parametrize(
    ("top_p", "kept_ids"),
    [(0.45, [0]), (0.79, [0, 1]), (0.81, [0, 1, 2]), (0.96, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_draws_the_nucleus_at_its_renormalised_probabilities(top_p, kept_ids):
    """[0.5, 0.3, 0.15, 0.05]: the nucleus of 0.79 is {0, 1} (0.8 reached), drawn 0.625 / 0.375."""
    probabilities = [0.5, 0.3, 0.15, 0.05]
    mass = sum(probabilities[i] for i in kept_ids)
    frequencies = _draw_frequencies(probabilities, seed=0, temperature=1.0, top_p=top_p)
    _assert_draws_follow(frequencies, {i: probabilities[i] / mass for i in kept_ids})


@pytest.mark.parametrize(("top_p", "kept_ids"), [(0.5, [0]), (0.75, [0, 1]), (0.8, [0, 1, 2])])
def test_top_p_keeps_up_to_the_token_that_reaches_it_and_ties_go_to_the_lowest_id(top_p, kept_ids):
    """Powers of two, exact in float64: at 0.75 the first two tokens reach top_p exactly, so the
    third goes; at 0.8 one of the two tokens of 0.125 is needed, the lower id (2, never 3)."""
    probabilities = [0.5, 0.25, 0.125, 0.125]
    logits = torch.tensor([probabilities], dtype=torch.float64).log()
    assert torch.softmax(logits, dim=-1)[0, :2].tolist() == [0.5, 0.25]  # the boundary is exact
    mass = sum(probabilities[i] for i in kept_ids)
    frequencies = _draw_frequencies(probabilities, seed=1, temperature=1.0, top_p=top_p)
    _assert_draws_follow(frequencies, {i: probabilities[i] / mass for i in kept_ids})


def _reference_nucleus(row: list[float], temperature: float, top_k: int | None, top_p: float):
    """Holtzman et al.'s V^(p) after top-k, in plain Python: the ids by decreasing probability
    (Python's sort is stable: ties to the lowest id), the first ``top_k`` of them, then, in that
    order, every id until the ones taken hold ``top_p``. Returns the kept ids, their renormalised
    probabilities and the mass before each candidate (to stay clear of the threshold)."""
    peak = max(row)
    scaled = [(x - peak) / temperature for x in row]  # as the sampler scales them, in float64
    order = sorted(range(len(row)), key=lambda i: -scaled[i])
    candidates = order if top_k is None else order[:top_k]
    weights = {i: math.exp(scaled[i]) for i in candidates}
    total = sum(weights.values())
    kept, mass, masses_before = [], 0.0, []
    for i in candidates:
        masses_before.append(mass)
        if mass >= top_p:
            break
        kept.append(i)
        mass += weights[i] / total
    kept_total = sum(weights[i] for i in kept)
    return {i: weights[i] / kept_total for i in kept}, masses_before


_LOGIT = st.one_of(st.integers(-4, 4).map(float), st.floats(-10.0, 10.0))  # small integers tie


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 10).flatmap(lambda vocab: st.lists(
        st.lists(_LOGIT, min_size=vocab, max_size=vocab), min_size=1, max_size=3)),
    temperature=st.floats(0.25, 4.0),
    top_k=st.none() | st.integers(1, 12),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
)
def test_the_kept_tokens_are_the_nucleus_of_the_paper(rows, temperature, top_k, top_p):
    """Logits in [-10, 10] and a temperature >= 0.25: every kept token's probability is > 0
    (no underflow), so the ids drawn with positive probability are the reference's."""
    references = [_reference_nucleus(row, temperature, top_k, top_p) for row in rows]
    for _, masses_before in references:  # a sum within rounding of top_p may go either way
        assume(all(abs(mass - top_p) > 1e-9 for mass in masses_before[1:]))  # [0]: 0, always kept
    filtered = _filtered_logits(torch.tensor(rows, dtype=torch.float64), temperature, top_k, top_p)
    probabilities = torch.softmax(filtered, dim=-1)  # (b, vocab)
    for row, (kept, _) in zip(probabilities, references, strict=True):
        assert set(torch.nonzero(row).flatten().tolist()) == set(kept)
        for token, probability in kept.items():
            assert math.isclose(float(row[token]), probability, rel_tol=1e-9)


def test_top_p_one_changes_nothing():
    """The mass before the last token of [0, -40] rounds to 1 in float64: ``before < 1`` alone
    would drop it. With a seed, 1.0 draws exactly as no top_p, in sample_next_token and generate."""
    extreme = torch.tensor([[0.0, -40.0, 3.0, -745.0]], dtype=torch.float64)
    assert torch.equal(_filtered_logits(extreme, 1.0, None, 1.0), _filtered_logits(extreme, 1.0, None, None))
    assert torch.isfinite(_filtered_logits(extreme, 1.0, None, 1.0)).all()
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))  # (64, 50)
    draws = [
        sample_next_token(logits, temperature=0.8, top_k=20, top_p=top_p,
                          generator=torch.Generator().manual_seed(1))
        for top_p in (None, 1.0)
    ]
    assert torch.equal(*draws) and len(draws[0].unique()) > 10
    model = _model("softmax")
    prompt = torch.randint(model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(2))
    runs = [model.generate(prompt, 12, top_p=top_p, generator=torch.Generator().manual_seed(5))
            for top_p in (None, 1.0)]
    assert torch.equal(*runs) and len(runs[0][:, 3:].unique()) > 3


@pytest.mark.parametrize(("top_k", "top_p", "kept"), [(2, 0.5, {0: 1.0}), (3, 0.75, {0: 4 / 7, 1: 3 / 7})])
def test_top_k_cuts_before_top_p(top_k, top_p, kept):
    """[0.4, 0.3, 0.2, 0.1]: top_k=2 leaves [4/7, 3/7], whose nucleus of 0.5 is {0} (top-p first
    would keep {0, 1}); top_k=3 leaves [4/9, 3/9, 2/9], whose nucleus of 0.75 is {0, 1} (first,
    {0, 1, 2})."""
    frequencies = _draw_frequencies([0.4, 0.3, 0.2, 0.1], seed=2, temperature=1.0, top_k=top_k, top_p=top_p)
    _assert_draws_follow(frequencies, kept)


def test_greedy_ignores_top_p_and_draws_nothing():
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(3))  # (16, 30)
    generator = torch.Generator().manual_seed(4)
    state = generator.get_state()
    greedy = sample_next_token(logits, temperature=0.0, top_k=3, top_p=0.2, generator=generator)
    assert torch.equal(greedy, logits.argmax(dim=-1, keepdim=True))
    assert torch.equal(generator.get_state(), state)  # no draw
    model = _model("softmax")
    prompt = torch.randint(model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model.generate(prompt, 10, temperature=0.0, top_p=0.3),
                       model.generate(prompt, 10, temperature=0.0))


def _model(attention: str, positional: str = "learned"):
    torch.manual_seed(0)
    return create_model("transformer-lm", "tiny", attention=attention, positional=positional).eval()


@pytest.mark.parametrize("attention", ["softmax", "routing"])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, None, 0.3), (0.7, 20, 0.6)])
def test_generate_draws_only_from_the_nucleus(attention, temperature, top_k, top_p):
    """Every token generated lies in the nucleus of the model's logits at its step (recomputed on
    the prefix, as ``use_cache=False`` computed them; the nucleus by the plain-Python reference):
    the untrained model is nearly uniform, so the nucleus of 0.3 is about a third of the
    vocabulary, and sampling outside it would leave it within a few steps."""
    model = _model(attention)
    prompt = torch.randint(model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(7))
    tokens = model.generate(prompt, 20, temperature=temperature, top_k=top_k, top_p=top_p,
                            generator=torch.Generator().manual_seed(11), use_cache=False)  # (3, 24)
    assert len(tokens[:, 4:].unique()) > 3
    with torch.no_grad():
        for t in range(4, tokens.shape[1]):
            logits = model(tokens[:, :t]).logits[:, -1].double()  # (3, vocab)
            for row, token in zip(logits.tolist(), tokens[:, t].tolist(), strict=True):
                kept, _ = _reference_nucleus(row, temperature, top_k, top_p)
                assert len(kept) < min(top_k or model.config.vocab_size, model.config.vocab_size)
                assert token in kept, t


@pytest.mark.parametrize(("attention", "positional"), [("softmax", "learned"), ("routing", "sinusoidal")])
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, None, 0.9), (0.7, 5, 0.8)])
def test_generate_with_top_p_draws_the_same_with_and_without_cache(attention, positional, temperature,
                                                                   top_k, top_p):
    """Seeded, past the context (32) too."""
    model = _model(attention, positional)
    prompt = torch.randint(model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(7))
    runs = [
        model.generate(prompt, 40, temperature=temperature, top_k=top_k, top_p=top_p,
                       generator=torch.Generator().manual_seed(11), use_cache=use_cache)
        for use_cache in (True, False)
    ]
    assert torch.equal(*runs)
    assert len(runs[0][:, 4:].unique()) > 3  # sampled, not one repeated token


@pytest.mark.parametrize(
    ("bad", "error"),
    [(0, ValueError), (0.0, ValueError), (-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
     (float("inf"), ValueError), (True, ValueError), ("0.9", TypeError), (None, None)],
)
@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_bad_top_p_is_refused_by_name(bad, error, temperature):
    """Checked when greedy too; a bool is refused as a wrong type (a TypeError and a ValueError)."""
    if error is None:  # None is no top_p
        assert sample_next_token(torch.zeros(1, 3), temperature=temperature, top_p=bad).shape == (1, 1)
        return
    expected = rf"^top_p must be a finite number in \(0.0, 1.0\], got {re.escape(repr(bad))}$"
    with pytest.raises(error, match=expected):
        sample_next_token(torch.zeros(1, 3), temperature=temperature, top_p=bad)
    if error is ValueError and not isinstance(bad, bool):
        with pytest.raises(ValueError) as refused:
            sample_next_token(torch.zeros(1, 3), temperature=temperature, top_p=bad)
        assert not isinstance(refused.value, TypeError)  # a value out of range, not a wrong type
    model = _model("softmax")
    with pytest.raises(error, match=expected):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=temperature, top_p=bad)


@pytest.mark.parametrize(
    ("logits", "error", "match"),
    [
        (torch.zeros(3), ValueError, r"logits must be of shape \(batch, vocab\) with vocab >= 1, got \(3,\)"),
        (torch.zeros(2, 0), ValueError, r"logits must be of shape .* got \(2, 0\)"),
        (torch.zeros(2, 3, dtype=torch.long), TypeError, "logits must be floating point"),
    ],
)
def test_sample_next_token_refuses_logits_not_of_shape_batch_vocab(logits, error, match):
    with pytest.raises(error, match=match):
        sample_next_token(logits, temperature=1.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
def test_sample_next_token_refuses_rows_it_cannot_draw_from(bad, temperature):
    """Greedy took the NaN's index (or token 0 for a row of -inf) in silence; sampling failed
    inside torch.multinomial naming no argument (review finding). -inf entries beside a finite
    one are masked tokens, and are taken; greedy takes a +inf as the most likely token."""
    logits = torch.zeros(3, 5)
    if bad == "all -inf":
        logits[1] = float("-inf")
    else:
        logits[1, 2] = bad
    if bad == float("inf") and temperature == 0.0:
        assert sample_next_token(logits, temperature=0.0).flatten().tolist() == [0, 2, 0]
    else:
        with pytest.raises(ValueError, match=r"must hold no NaN and a value above -inf .*; rows \[1\]"):
            sample_next_token(logits, temperature=temperature)
    masked = torch.tensor([[float("-inf"), 0.0, float("-inf")]])
    assert sample_next_token(masked, temperature=temperature).item() == 1
