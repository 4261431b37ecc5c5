"""Gaps a mutation review of ``functional/voting.py`` found: what an agreement callable sees in
``VotingState`` (weights versus vote weights, outputs versus aggregates), and ``-inf`` logits
given directly (no mask) taking no weight."""

from __future__ import annotations

import torch

from torchvote.functional import PairwiseVotes, SharedVotes, vote


def _recording_agreement(seen: list):
    def agreement(state):
        seen.append(state)
        return state.votes.dot(state.outputs)

    return agreement


def test_agreement_state_separates_weights_from_sender_scaled_vote_weights():
    """``VotingState.weights`` is the softmax of the pass's logits, ``vote_weights`` that times
    the sender weights (its docstring): an EM-style agreement needs the two apart."""
    torch.manual_seed(0)
    votes = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    logits = torch.randn(2, 3, 4, dtype=torch.float64)
    activations = torch.rand(2, 4, dtype=torch.float64) * 0.8 + 0.1
    seen: list = []
    vote(PairwiseVotes(votes), logits, normalize_over="receivers", iterations=2,
         sender_weights=activations, agreement=_recording_agreement(seen))
    state = seen[0]
    expected = torch.softmax(logits, dim=-2)  # over the receivers
    torch.testing.assert_close(state.weights, expected)
    torch.testing.assert_close(state.vote_weights, expected * activations[:, None, :])
    torch.testing.assert_close(state.weights.sum(-2), torch.ones(2, 4, dtype=torch.float64))


def test_agreement_state_outputs_are_after_the_nonlinearity():
    """``VotingState.outputs`` is the squashed consensus and ``aggregated`` the plain weighted sum
    (Sabour et al. 2017 eq. 1 computed by hand)."""
    torch.manual_seed(1)
    votes = torch.randn(1, 3, 4, 5, dtype=torch.float64)
    seen: list = []
    vote(PairwiseVotes(votes), None, normalize_over="receivers", iterations=2, nonlinearity="squash",
         agreement=_recording_agreement(seen))
    state = seen[0]
    s = votes.sum(dim=-2) / 3  # uniform start: every weight 1/3 (3 receivers)
    torch.testing.assert_close(state.aggregated, s)
    n2 = (s * s).sum(-1, keepdim=True)
    torch.testing.assert_close(state.outputs, s * n2 / (1 + n2) / n2.sqrt())


def test_minus_inf_logits_without_a_mask_take_no_weight_and_give_no_nan():
    """Logits given with ``-inf`` entries and no mask: a receiver whose every logit is ``-inf``
    hears no sender (output 0, as :func:`masked_softmax` documents), not NaN."""
    torch.manual_seed(2)
    values = torch.randn(2, 4, 3, dtype=torch.float64)
    logits = torch.randn(2, 3, 4, dtype=torch.float64)
    logits[:, 1, :] = float("-inf")  # receiver 1 may hear nobody
    logits[:, 2, 0] = float("-inf")  # receiver 2 may not hear sender 0
    out = vote(SharedVotes(values), logits, normalize_over="senders", aggregation="sum",
               nonlinearity="squash").outputs
    assert torch.isfinite(out).all()
    assert (out[:, 1] == 0).all()
    # receiver 2: a plain softmax over senders 1..3 only, then squash
    w = torch.softmax(logits[:, 2, 1:], dim=-1)
    s = torch.einsum("bj,bjd->bd", w, values[:, 1:])
    n2 = (s * s).sum(-1, keepdim=True)
    torch.testing.assert_close(out[:, 2], s * n2 / (1 + n2) / n2.sqrt())
