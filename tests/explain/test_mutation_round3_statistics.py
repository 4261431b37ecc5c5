"""Mutation review, round 3: explanation statistics against plain loops and properties.

Each test names the mutant of :mod:`torchvote.explain.statistics` it was written to kill; the
earlier hand-computed cases used square coupling matrices, a degenerate spread of votes or few tied
keys, where the mutants give the same numbers.
"""

from __future__ import annotations

import math

import torch

from torchvote.explain.statistics import coupling_entropy, project_votes, routing_agreement, top_attended


def _entropy_loop(couplings: torch.Tensor, over_receivers: bool) -> list[float]:
    """Mean entropy per pass of ``(t, b, i, j)`` couplings, one distribution at a time."""
    means = []
    for per_pass in couplings:
        entropies = []
        for example in per_pass:
            distributions = example.T if over_receivers else example  # each row one distribution
            for row in distributions:
                entropies.append(-sum(float(c) * math.log(float(c)) for c in row if c > 0))
        means.append(sum(entropies) / len(entropies))
    return means


def test_coupling_entropy_over_receivers_averages_over_the_inputs_of_a_non_square_layer():
    """Mutant: the axes of ``normalize_over`` swapped (receivers summed over ``j``). With as many
    inputs as outputs the mean of the row entropies equals the mean of the column entropies, so the
    hand cases (2 x 2) passed; with 2 outputs and 3 inputs it is the total over 2 against over 3."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 2, 3, generator=generator)  # (t, b, i=2, j=3)
    receivers = torch.softmax(logits, dim=-2)  # each input j spreads one unit over the outputs i
    senders = torch.softmax(logits, dim=-1)  # each output i over the inputs j
    expected_receivers = torch.tensor(_entropy_loop(receivers, over_receivers=True))
    expected_senders = torch.tensor(_entropy_loop(senders, over_receivers=False))
    torch.testing.assert_close(coupling_entropy(receivers), expected_receivers)
    torch.testing.assert_close(coupling_entropy(senders, normalize_over="senders"), expected_senders)


def test_project_votes_explains_the_fraction_of_variance_along_each_axis():
    """Mutant: ``explained`` from the singular values instead of their squares. Votes on a line
    give (1, 0) either way; for a spread cloud the fraction is the projected points' share of the
    total sum of squares of the centred votes (PCA's definition)."""
    generator = torch.Generator().manual_seed(1)
    votes = torch.randn(20, 4, generator=generator) * torch.tensor([3.0, 2.0, 1.0, 0.5])
    points, _, explained = project_votes(votes)
    total = (votes - votes.mean(dim=0)).square().sum()
    expected = points.square().sum(dim=0) / total  # variance along each of the two axes
    torch.testing.assert_close(explained, expected, rtol=1e-5, atol=1e-6)
    assert float(explained.sum()) < 1.0  # two of four directions: not all of the variance


def test_routing_agreement_dots_each_vote_with_its_own_receivers_output():
    """Mutant: the einsum read the outputs at the sender index (``tbjd``). The hand cases had one
    output capsule, where broadcasting hid it; a loop over ``(t, b, i, j)``."""
    generator = torch.Generator().manual_seed(2)
    votes = torch.randn(2, 3, 3, 4, generator=generator)  # (b, i=3, j=3, d)
    outputs = torch.randn(2, 2, 3, 4, generator=generator)  # (t, b, i, d)
    expected = torch.zeros(2)
    for t in range(2):
        total = 0.0
        for b in range(2):
            for i in range(3):
                for j in range(3):
                    total += float(votes[b, i, j] @ outputs[t, b, i])
        expected[t] = total / (2 * 3 * 3)
    torch.testing.assert_close(routing_agreement(votes, outputs), expected)
    non_square = routing_agreement(votes[:, :2], outputs[:, :, :2])  # i=2, j=3
    assert non_square.shape == (2,)


def test_top_attended_keeps_the_key_order_among_many_ties():
    """Mutant: the sort made unstable. Among a few tied keys torch's unstable sort happens to keep
    their order; among 64 uniform weights it does not, and the docstring promises ties in key
    order."""
    tokens = [f"t{j}" for j in range(64)]
    weights = torch.full((2, 1, 64), 1.0 / 64)  # (h, i, j): every key tied
    heads = top_attended(weights, tokens, 0, k=3)
    assert len(heads) == 2  # one per head: the loop checks each
    for head in heads:
        assert [token for token, _ in head] == ["t0", "t1", "t2"]
