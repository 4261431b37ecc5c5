"""The voting operator against plain loops written from its definition, and its properties."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from torchvote.functional import (
    DotProductScores,
    PairwiseVotes,
    SharedVotes,
    masked_softmax,
    squash,
    vote,
)


def loop_vote(votes, logits, *, over, iterations, agreement, update, aggregation, nonlinearity, kept=None,
              dropout_p=0.0):
    """A literal loop over receivers i and senders j for one batch element.

    votes: (i, j, d) pairwise; logits: (i, j); kept: None or one (i, j) 0/1 dropout mask per pass,
    each kept weight scaled by 1 / (1 - dropout_p) before the sum (inverted dropout). Returns the
    outputs (i, d) and per-pass weights.
    """
    receivers, senders, _ = votes.shape
    current = logits.clone()
    history = []
    for t in range(iterations):
        weights = torch.zeros(receivers, senders, dtype=votes.dtype)
        if over == "senders":
            for i in range(receivers):
                exps = [math.exp(current[i, j]) for j in range(senders)]
                for j in range(senders):
                    weights[i, j] = exps[j] / sum(exps)
        else:
            for j in range(senders):
                exps = [math.exp(current[i, j]) for i in range(receivers)]
                for i in range(receivers):
                    weights[i, j] = exps[i] / sum(exps)
        history.append(weights)
        if kept is not None:
            weights = weights * kept[t] / (1 - dropout_p)
        outputs = []
        for i in range(receivers):
            s = sum(weights[i, j] * votes[i, j] for j in range(senders))
            if aggregation == "mean":  # Locatello et al. 2020, Algorithm 1: 1e-8 on every weight
                s = sum((weights[i, j] + 1e-8) * votes[i, j] for j in range(senders))
                s = s / sum(weights[i, j] + 1e-8 for j in range(senders))
            if nonlinearity == "squash":
                # Sabour et al. eq. 1, exactly
                n2 = float((s * s).sum())
                s = s * (n2 / (1 + n2)) / math.sqrt(n2)
            outputs.append(s)
        outputs = torch.stack(outputs)
        if t < iterations - 1:
            new = torch.zeros_like(current)
            for i in range(receivers):
                for j in range(senders):
                    if agreement == "dot":
                        a = float(votes[i, j] @ outputs[i])
                    else:
                        a = -float(((votes[i, j] - outputs[i]) ** 2).sum())
                    base = {"accumulate": current[i, j], "prior": logits[i, j], "replace": 0.0}
                    new[i, j] = base[update] + a
            current = new
    return outputs, history


@pytest.mark.parametrize("over", ["senders", "receivers"])
@pytest.mark.parametrize("agreement", ["dot", "distance"])
@pytest.mark.parametrize("update", ["accumulate", "replace", "prior"])
@pytest.mark.parametrize("aggregation", ["sum", "mean"])
@pytest.mark.parametrize("nonlinearity", ["identity", "squash"])
def test_vote_matches_plain_loop(over, agreement, update, aggregation, nonlinearity):
    torch.manual_seed(0)
    votes = torch.randn(2, 4, 5, 3, dtype=torch.float64) * 0.7  # (b, i, j, d)
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    result = vote(PairwiseVotes(votes), logits, normalize_over=over, iterations=3,
                  agreement=agreement, update=update, aggregation=aggregation,
                  nonlinearity=nonlinearity, record=True)
    tol = {"rtol": 1e-10, "atol": 1e-12}
    for b in range(2):
        expected, history = loop_vote(votes[b], logits[b], over=over, iterations=3,
                                      agreement=agreement, update=update,
                                      aggregation=aggregation, nonlinearity=nonlinearity)
        torch.testing.assert_close(result.outputs[b], expected, **tol)
        for got, want in zip(result.weights, history, strict=True):
            torch.testing.assert_close(got[b], want, **tol)


def test_weights_sum_to_one_over_the_chosen_axis():
    votes = PairwiseVotes(torch.randn(3, 6, 7, 4))
    logits = torch.randn(3, 6, 7)
    attention = vote(votes, logits, normalize_over="senders", iterations=2, record=True)
    routing = vote(votes, logits, normalize_over="receivers", iterations=2, record=True)
    assert len(attention.weights) == len(routing.weights) == 2  # one per pass: the loops check each
    for w in attention.weights:
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 6))
    for w in routing.weights:
        torch.testing.assert_close(w.sum(-2), torch.ones(3, 7))


def test_shared_votes_equal_pairwise_votes_repeated_over_receivers():
    values = torch.randn(2, 5, 3, dtype=torch.float64)  # (b, j, d)
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    pairwise = values.unsqueeze(1).expand(2, 4, 5, 3)
    for over in ("senders", "receivers"):
        a = vote(SharedVotes(values), logits, normalize_over=over, iterations=3, agreement="distance")
        b = vote(PairwiseVotes(pairwise), logits, normalize_over=over, iterations=3,
                 agreement="distance")
        torch.testing.assert_close(a.outputs, b.outputs)


def test_fused_path_equals_the_voting_loop_and_sdpa():
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, n, 8, dtype=torch.float64) for n in (5, 6, 6))
    fused = vote(SharedVotes(v), DotProductScores(q, k), normalize_over="senders")
    looped = vote(SharedVotes(v), DotProductScores(q, k), normalize_over="senders", record=True)
    reference = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(fused.outputs, reference)
    torch.testing.assert_close(looped.outputs, reference)
    assert fused.weights == [] and len(looped.weights) == 1


def test_fused_path_never_materialises_the_score_matrix(monkeypatch):
    calls = []
    original = DotProductScores.materialize
    monkeypatch.setattr(DotProductScores, "materialize",
                        lambda self: calls.append(1) or original(self))
    q = torch.randn(1, 2, 16, 4)
    vote(SharedVotes(q), DotProductScores(q, q), normalize_over="senders", is_causal=True)
    assert calls == []
    vote(SharedVotes(q), DotProductScores(q, q), normalize_over="senders", record=True)
    assert calls == [1]


def test_sender_weights_scale_each_senders_contribution():
    votes = torch.randn(1, 3, 4, 2, dtype=torch.float64)
    activations = torch.tensor([[1.0, 0.0, 0.5, 2.0]], dtype=torch.float64)
    result = vote(PairwiseVotes(votes), None, normalize_over="receivers",
                  sender_weights=activations, record=True)
    weights = result.weights[0]  # uniform 1/3 over receivers
    expected = torch.einsum("bij,bj,bijd->bid", weights, activations, votes)
    torch.testing.assert_close(result.outputs, expected)
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 3))


def test_bias_is_added_before_the_nonlinearity():
    votes = torch.randn(2, 3, 4, 5)
    bias = torch.randn(3, 5)
    got = vote(PairwiseVotes(votes), None, normalize_over="receivers", bias=bias,
               nonlinearity="squash").outputs
    expected = squash(votes.mean(-2) * 4 / 3 + bias)  # uniform weights 1/3 over receivers
    torch.testing.assert_close(got, expected)


def test_callable_nonlinearity_sees_the_previous_outputs():
    seen = []

    def update(aggregated, previous):
        seen.append(previous)
        return aggregated

    start = torch.randn(1, 2, 3)
    votes = torch.randn(1, 2, 4, 3)
    result = vote(PairwiseVotes(votes), None, normalize_over="receivers", iterations=3,
                  nonlinearity=update, initial_outputs=start)
    assert seen[0] is start
    assert seen[2] is not None and seen[2].shape == (1, 2, 3)
    assert result.outputs.shape == (1, 2, 3)


def test_a_callable_agreement_may_return_logits_that_broadcast():
    # The check of a user's agreement (its result must fit the (..., i, j) logits) keeps what
    # broadcasting allowed before: a (..., i, 1) or (j,) agreement, as the update adds it.
    torch.manual_seed(3)
    votes = PairwiseVotes(torch.randn(2, 3, 4, 5))  # (b, i, j, d)

    def run(agreement):
        return vote(votes, None, normalize_over="receivers", iterations=3, agreement=agreement).outputs

    for narrow in (lambda state: state.aggregated.sum(-1, keepdim=True),  # (b, i, 1)
                   lambda state: torch.arange(4.0)):  # (j,)
        torch.testing.assert_close(run(narrow), run(lambda state, f=narrow: f(state).expand(2, 3, 4)))


def test_detach_votes_cuts_gradients_of_all_but_the_last_pass():
    torch.manual_seed(2)
    raw = torch.randn(1, 3, 4, 2, dtype=torch.float64, requires_grad=True)

    def grad(detach):
        out = vote(PairwiseVotes(raw), None, normalize_over="receivers", iterations=3,
                   nonlinearity="squash", detach_votes=detach).outputs
        (g,) = torch.autograd.grad(out.pow(2).sum(), raw)
        return g

    full, cut = grad(False), grad(True)
    assert not torch.allclose(full, cut)
    # With the earlier passes detached, the couplings are constants for autograd.
    with torch.no_grad():
        couplings = vote(PairwiseVotes(raw), None, normalize_over="receivers", iterations=3,
                         nonlinearity="squash", record=True).weights[-1]
    s = torch.einsum("bij,bijd->bid", couplings, raw)
    (expected,) = torch.autograd.grad(squash(s).pow(2).sum(), raw)
    torch.testing.assert_close(cut, expected)


def test_gradcheck_through_three_routing_passes():
    votes = torch.randn(1, 3, 4, 2, dtype=torch.float64, requires_grad=True)
    logits = torch.randn(1, 3, 4, dtype=torch.float64, requires_grad=True)

    def fn(v, lg):
        return vote(PairwiseVotes(v), lg, normalize_over="receivers", iterations=3,
                    nonlinearity="squash", agreement="distance").outputs

    assert torch.autograd.gradcheck(fn, (votes, logits))


def test_gradcheck_attention_weights_path_with_mask():
    q = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 5, 2, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 5) > 0.4
    mask[0] = False

    def fn(q, k, v):
        return vote(SharedVotes(v), DotProductScores(q, k), normalize_over="senders", mask=mask,
                    record=True).outputs

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_masked_softmax_rows_with_nothing_to_weigh_are_zero_with_finite_gradients():
    logits = torch.randn(3, 4, requires_grad=True)
    mask = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4])
    weights = masked_softmax(logits, -1, mask)
    torch.testing.assert_close(weights[1], torch.zeros(4))
    torch.testing.assert_close(weights.sum(-1), torch.tensor([1.0, 0.0, 1.0]))
    weights.pow(2).sum().backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("scale", [1.0, 10.0, 1e3])
def test_rows_with_nothing_to_weigh_keep_finite_gradients_under_any_upstream_gradient(scale):
    """A row with nothing to weigh divided by float's tiniest number: its backward g / tiny
    overflowed to inf once |g| passed about 4, and inf * exp'(-inf) = inf * 0 = NaN, in the
    softmax and in the weighted mean's normalisation alike."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    float_mask = torch.zeros(3, 4, dtype=torch.float64)
    float_mask[1] = -math.inf  # the whole row masked through the logits
    weights = masked_softmax(logits + float_mask, -1)
    (weights * scale).sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert torch.equal(logits.grad[1], torch.zeros(4, dtype=torch.float64))
    votes = torch.randn(1, 2, 2, 3, generator=generator, dtype=torch.float64, requires_grad=True)
    sender_weights = torch.rand(1, 2, generator=generator, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[[False, False], [True, True]]])  # receiver 0: no sender may vote
    outputs = vote(PairwiseVotes(votes), torch.zeros(1, 2, 2, dtype=torch.float64), normalize_over="senders",
                   aggregation="mean", mask=mask, sender_weights=sender_weights).outputs
    (outputs * scale).sum().backward()
    assert torch.isfinite(votes.grad).all() and torch.isfinite(sender_weights.grad).all()
    # receiver 1 alone: its weighted mean's gradient w.r.t. the sender weights, by hand (the
    # softmax's 1/2 times the sender weights, plus Locatello et al.'s eps, normalised)
    w = 0.5 * sender_weights.detach()[0] + 1e-8
    v = votes.detach()[0, 1].sum(-1)  # (j,) each vote's contribution to sum(outputs)
    expected = scale * 0.5 * (v * w.sum() - (w * v).sum()) / w.sum() ** 2
    torch.testing.assert_close(sender_weights.grad[0], expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("over", ["senders", "receivers"])
def test_dropout_drops_each_pass_weights_with_the_same_p(over, monkeypatch):
    """Dropout after the first pass was only checked to change the numbers (p / 2 on the later
    passes passed): every pass's weights against the loop with the same masks."""
    generator = torch.Generator().manual_seed(3)
    votes = torch.randn(1, 4, 5, 3, generator=generator, dtype=torch.float64)  # (b, i, j, d)
    logits = torch.randn(1, 4, 5, generator=generator, dtype=torch.float64)
    kept = (torch.rand(3, 4, 5, generator=generator) > 0.3).double()  # one mask per pass
    calls = []

    def dropout(weights, p, **kwargs):  # inverted dropout with the pass's mask
        calls.append(p)
        return weights * kept[len(calls) - 1] / (1 - p)

    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    result = vote(PairwiseVotes(votes), logits, normalize_over=over, iterations=3, dropout_p=0.3,
                  nonlinearity="squash")
    assert calls == [0.3, 0.3, 0.3]
    expected, _ = loop_vote(votes[0], logits[0], over=over, iterations=3, agreement="dot",
                            update="accumulate", aggregation="sum", nonlinearity="squash", kept=kept,
                            dropout_p=0.3)
    torch.testing.assert_close(result.outputs[0], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits_do_not_overflow(dtype):
    q = (torch.randn(1, 4, 16) * 60).to(dtype)  # q.k reaches ~1e4 * 16: beyond float16's range
    v = torch.randn(1, 4, 16).to(dtype)
    result = vote(SharedVotes(v), DotProductScores(q, q, scale=1.0), normalize_over="senders",
                  record=True)
    assert torch.isfinite(result.outputs).all() and result.outputs.dtype == dtype
    reference = vote(SharedVotes(v.float()), DotProductScores(q.float(), q.float(), scale=1.0),
                     normalize_over="senders").outputs
    torch.testing.assert_close(result.outputs.float(), reference, atol=2e-2, rtol=2e-2)


@settings(max_examples=25, deadline=None)
@given(
    receivers=st.integers(1, 5),
    senders=st.integers(1, 5),
    dim=st.integers(1, 4),
    iterations=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_routing_outputs_do_not_depend_on_sender_order(receivers, senders, dim, iterations, seed):
    generator = torch.Generator().manual_seed(seed)
    votes = torch.randn(2, receivers, senders, dim, generator=generator, dtype=torch.float64)
    perm = torch.randperm(senders, generator=generator)
    a = vote(PairwiseVotes(votes), None, normalize_over="receivers", iterations=iterations,
             nonlinearity="squash").outputs
    b = vote(PairwiseVotes(votes[:, :, perm]), None, normalize_over="receivers",
             iterations=iterations, nonlinearity="squash").outputs
    torch.testing.assert_close(a, b)
    assert (a.norm(dim=-1) < 1).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"normalize_over": "rows"}, ValueError, "normalize_over"),
        ({"normalize_over": "receivers", "iterations": 0}, ValueError, "iterations"),
        ({"normalize_over": "receivers", "aggregation": "max"}, ValueError, "aggregation"),
        ({"normalize_over": "receivers", "nonlinearity": "relu"}, ValueError, "nonlinearity"),
        ({"normalize_over": "receivers", "agreement": "cosine"}, ValueError, "agreement"),
        ({"normalize_over": "receivers", "dropout_p": 1.0}, ValueError, "dropout_p"),
        ({"normalize_over": "receivers", "update": "sum"}, ValueError, "update"),
        ({"normalize_over": "receivers", "mask": torch.ones(3, 4, dtype=torch.int64)},
         TypeError, "mask"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        vote(PairwiseVotes(torch.randn(1, 3, 4, 2)), None, **kwargs)


def test_logits_and_masks_that_do_not_fit_the_votes_are_named():
    votes = PairwiseVotes(torch.randn(2, 3, 5, 4))  # (b, i, j, d)
    with pytest.raises(ValueError, match=r"mask of shape \(4, 4\) does not broadcast"):
        vote(votes, None, normalize_over="receivers", mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"logits of shape \(3, 3\) do not fit votes"):
        vote(votes, torch.zeros(3, 3), normalize_over="receivers")
    with pytest.raises(ValueError, match="logits of shape"):
        vote(torch.randn(2, 5, 4), torch.zeros(2, 3, 6), normalize_over="senders")  # 6 senders, 5 votes
    with pytest.raises(TypeError, match="mask must be a tensor"):
        vote(votes, None, normalize_over="receivers", mask=[[True]])
    # Logits and masks that broadcast over the batch are taken.
    assert vote(votes, torch.zeros(3, 5), normalize_over="receivers",
                mask=torch.ones(5, dtype=torch.bool)).outputs.shape == (2, 3, 4)


def test_masked_softmax_checks_its_mask_and_takes_an_empty_axis():
    logits = torch.randn(3, 4)
    with pytest.raises(TypeError, match="mask must be a boolean tensor"):
        masked_softmax(logits, -1, torch.ones(3, 4))
    with pytest.raises(ValueError, match=r"mask of shape \(4, 3\)"):
        masked_softmax(logits, -1, torch.ones(4, 3, dtype=torch.bool))
    assert masked_softmax(torch.randn(3, 0), -1).shape == (3, 0)  # was an amax() IndexError


def test_plain_tensor_votes_are_read_from_their_rank_or_refused():
    logits = torch.randn(2, 3, 4)
    shared = torch.randn(2, 4, 5)
    pairwise = torch.randn(2, 3, 4, 5)
    assert vote(shared, logits, normalize_over="senders").outputs.shape == (2, 3, 5)
    assert vote(pairwise, logits, normalize_over="receivers").outputs.shape == (2, 3, 5)
    with pytest.raises(ValueError, match="wrap it"):
        vote(pairwise, None, normalize_over="receivers")
    with pytest.raises(ValueError, match="votes must have rank"):
        vote(torch.randn(4, 5), logits, normalize_over="senders")


def test_squash_is_the_papers_formula_and_safe_at_zero():
    s = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1e-3, 0.0]], dtype=torch.float64, requires_grad=True)
    v = squash(s)
    # eq. 1: |v| = |s|^2 / (1 + |s|^2) along s's direction; |s| = 5 gives 25 / 26.
    torch.testing.assert_close(v[0], torch.tensor([0.6, 0.8], dtype=torch.float64) * 25 / 26)
    torch.testing.assert_close(v[1], torch.zeros(2, dtype=torch.float64))
    v.sum().backward()
    assert torch.isfinite(s.grad).all()
    assert (squash(torch.randn(100, 8) * 50).norm(dim=-1) < 1).all()


def test_replace_keeps_a_float_mask_in_every_pass():
    votes = PairwiseVotes(torch.randn(2, 3, 4, 5, dtype=torch.float64))
    mask = torch.zeros(3, 4, dtype=torch.float64)
    mask[0, 1] = mask[2, 3] = float("-inf")
    result = vote(votes, None, normalize_over="receivers", iterations=3, update="replace",
                  mask=mask, record=True)
    assert len(result.weights) == 3  # one per pass: the loop checks each
    for weights in result.weights:
        assert (weights[:, 0, 1] == 0).all() and (weights[:, 2, 3] == 0).all()
        torch.testing.assert_close(weights.sum(-2), torch.ones(2, 4, dtype=torch.float64))


def test_replace_drops_the_initial_logits_after_the_first_pass():
    """With update="replace" the second pass's logits are the agreement alone."""
    votes = torch.randn(1, 3, 4, 5, dtype=torch.float64)
    logits = torch.randn(1, 3, 4, dtype=torch.float64) * 5
    result = vote(PairwiseVotes(votes), logits, normalize_over="receivers", iterations=2,
                  update="replace", record=True)
    first = torch.softmax(logits, dim=-2)
    outputs = torch.einsum("bij,bijd->bid", first, votes)
    torch.testing.assert_close(result.logits[1], torch.einsum("bijd,bid->bij", votes, outputs))


def test_every_votes_class_starts_from_zero_logits_and_materializes():
    from torchvote.functional import LinearVotes, SharedLinearVotes

    inputs = torch.randn(2, 4, 3, dtype=torch.float64)  # (b, j, e)
    for votes in (
        PairwiseVotes(torch.randn(2, 5, 4, 6, dtype=torch.float64)),
        LinearVotes(torch.randn(5, 4, 6, 3, dtype=torch.float64), inputs),
        SharedLinearVotes(torch.randn(5, 6, 3, dtype=torch.float64), inputs),
    ):
        zeros = votes.zero_logits()
        assert zeros.shape == (2, 5, 4) and not zeros.any()
        weights = torch.rand(2, 5, 4, dtype=torch.float64)
        torch.testing.assert_close(votes.weighted_sum(weights),
                                   torch.einsum("bij,bijd->bid", weights, votes.materialize()))
    shared = SharedVotes(torch.randn(2, 4, 6))
    assert shared.materialize().shape == (2, 1, 4, 6)
    with pytest.raises(ValueError, match="need logits"):
        shared.zero_logits()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_an_integer_mask_is_refused_by_name_on_every_branch(dtype):
    values, queries, keys = torch.randn(3, 5, 2), torch.randn(3, 4, 6), torch.randn(3, 5, 6)
    mask = torch.ones(4, 5, dtype=dtype)
    for normalize_over in ("senders", "receivers"):  # the fused kernel's branch, the voting loop
        with pytest.raises(TypeError, match="mask must be boolean .* or floating point"):
            vote(SharedVotes(values), DotProductScores(queries, keys), normalize_over=normalize_over,
                 mask=mask)


def test_masked_softmax_of_a_0_d_tensor_is_that_of_one_entry():
    assert torch.equal(masked_softmax(torch.tensor(2.5), 0), torch.softmax(torch.tensor(2.5), 0))
    assert torch.equal(masked_softmax(torch.tensor(2.5), -1, torch.tensor(False)), torch.tensor(0.0))
    assert torch.equal(masked_softmax(torch.tensor(float("-inf")), 0), torch.tensor(0.0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_a_masked_weighted_mean_keeps_the_votes_dtype(dtype):
    """The mean's eps on the weights that may vote, made from a boolean mask, was a float32
    tensor: half-precision weights became float32 ones."""
    votes = SharedVotes(torch.randn(2, 5, 4).to(dtype))
    mask = torch.tensor([[True] * 3 + [False] * 2] * 3)
    result = vote(votes, torch.randn(2, 3, 5).to(dtype), normalize_over="receivers", aggregation="mean",
                  mask=mask, iterations=2, record=True)
    assert result.outputs.dtype == dtype and result.weights[-1].dtype == dtype
    zeros = torch.zeros(2, 3, 5, dtype=dtype)
    short = vote(SharedVotes(votes.values[:, :3]), zeros[..., :3], normalize_over="receivers",
                 aggregation="mean", iterations=1)
    masked = vote(votes, zeros, normalize_over="receivers", aggregation="mean", mask=mask, iterations=1)
    torch.testing.assert_close(masked.outputs, short.outputs)  # masked senders take no eps either


def test_a_float_minus_inf_mask_forbids_the_mean_as_a_boolean_mask_does():
    """The mean's eps went to the senders a boolean mask allows; a float mask's -inf senders got
    it too: a row every sender was forbidden took the mean of the forbidden votes (2.5, not 0)."""
    values = torch.arange(1.0, 5.0, dtype=torch.float64).view(1, 4, 1)  # (b, j, d)
    allowed = torch.tensor([[True, True, False, False], [False] * 4])  # (i, j)
    additive = torch.zeros(2, 4, dtype=torch.float64).masked_fill(~allowed, float("-inf"))
    logits = torch.zeros(1, 2, 4, dtype=torch.float64)
    options = {"normalize_over": "senders", "aggregation": "mean"}
    by_bool = vote(SharedVotes(values), logits, mask=allowed, **options).outputs
    by_float = vote(SharedVotes(values), logits, mask=additive, **options).outputs
    torch.testing.assert_close(by_float, by_bool, rtol=0, atol=0)
    torch.testing.assert_close(by_bool[0, :, 0], torch.tensor([1.5, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_mean_of_a_receiver_every_sender_left_is_a_mean_in_half_precision(dtype):
    """1e-8 is 0 in float16, and its smallest normal number clamped the total: the "mean" of values
    1 to 4 for a slot 14 logits behind the other was 0.137 (float32: 2.5)."""
    values = torch.arange(1.0, 5.0).view(1, 4, 1).to(dtype)  # (b, j, d)
    logits = torch.tensor([[[-14.0] * 4, [0.0] * 4]]).to(dtype)  # slot 0 loses every input
    outputs = vote(SharedVotes(values), logits, normalize_over="receivers", aggregation="mean").outputs
    assert outputs.dtype == dtype
    assert abs(float(outputs[0, 0, 0]) - 2.5) < 0.02


def test_causal_voting_over_the_receivers_is_refused():
    """vote accepted is_causal=True with normalize_over="receivers" (RoutingAttention refuses it),
    and the outputs were not causal: editing the last query changed the first output."""
    from torchvote.functional import DotProductScores, SharedVotes, vote

    q, k, v = torch.randn(3, 1, 4, 8).unbind(0)
    with pytest.raises(ValueError, match="is_causal=True needs normalize_over='senders'"):
        vote(SharedVotes(v), DotProductScores(q, k), normalize_over="receivers", is_causal=True)
    causal = vote(SharedVotes(v), DotProductScores(q, k), normalize_over="senders", is_causal=True)
    edited = q.clone()
    edited[0, 3] += 3.0
    again = vote(SharedVotes(v), DotProductScores(edited, k), normalize_over="senders", is_causal=True)
    torch.testing.assert_close(causal.outputs[0, :3], again.outputs[0, :3])  # senders: causal
