"""The weighted-voting article's two pseudocodes, run literally, against torchvote.

"Self-Attention is fundamentally a Weighted Voting" (../shared/seeds/000_ddb76f012c165e09.txt)
writes dynamic routing, and then multi-head attention "in the style of dynamic routing", as nested
loops. Its letters: ``i`` capsule, ``j`` prediction (output capsule, or head). Both are run here
line by line on plain Python floats and compared with :func:`dynamic_routing` and with
:func:`vote` configured as attention, run on ``--device``.
"""

from __future__ import annotations

import math

import pytest
import torch
from einops import rearrange

from torchvote.functional import DotProductScores, SharedVotes, vote
from torchvote.functional.routing import dynamic_routing


def dot(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def squash(s: list[float]) -> list[float]:
    n2 = dot(s, s)
    return [x * n2 / (1 + n2) / math.sqrt(n2) if n2 > 0 else 0.0 for x in s]  # eq. 1 exactly


def softmax(xs: list[float]) -> list[float]:
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]


def article_dynamic_routing(u, K):
    """u[i][j]: capsule i's predicted feature j (a list). Returns v[j] and c[i][j]."""
    n_caps, n_pred = len(u), len(u[0])  # the article's I and J
    b = [[0.0] * n_pred for _ in range(n_caps)]  # b_i_j = 0 for all i, j
    c = [[1.0 / n_pred] * n_pred for _ in range(n_caps)]  # c_i_j = 1 / j for all i, j
    v = None
    c_used = c
    for _ in range(K):  # For K number of iterations
        c_used = [row[:] for row in c]
        v = []
        for j in range(n_pred):  # For J number of predictions
            s = [0.0] * len(u[0][0])  # s_j = 0
            for i in range(n_caps):  # For I number of capsules
                s = [sk + c[i][j] * uk for sk, uk in zip(s, u[i][j], strict=True)]  # s_j += c_i_j * u_i_j
            v.append(squash(s))  # v_j = Squash(s_j)
        for j in range(n_pred):
            for i in range(n_caps):
                b[i][j] += dot(u[i][j], v[j])  # b_i_j += Dot(u_i_j, v_j)
        for i in range(n_caps):
            c[i] = softmax(b[i])  # c_i = Softmax(b_i)
    return v, c_used


def article_multi_head_attention(u):
    """u[i][j]: capsule i's predicted feature j (head j). Returns s[i0][j]."""
    n_caps, n_heads = len(u), len(u[0])  # the article's I and J
    b = [[[0.0] * n_heads for _ in range(n_caps)] for _ in range(n_caps)]
    for j in range(n_heads):
        for i0 in range(n_caps):
            for i1 in range(n_caps):
                b[i0][i1][j] = dot(u[i0][j], u[i1][j])  # b_i0_i1_j = Dot(u_i0_j, u_i1_j)
    c = [[[0.0] * n_heads for _ in range(n_caps)] for _ in range(n_caps)]
    for j in range(n_heads):
        for i0 in range(n_caps):
            weights = softmax([b[i0][i1][j] for i1 in range(n_caps)])  # c_i0_j = Softmax(b_i0_j)
            for i1 in range(n_caps):
                c[i0][i1][j] = weights[i1]
    s = [[None] * n_heads for _ in range(n_caps)]
    for j in range(n_heads):
        for i0 in range(n_caps):
            acc = [0.0] * len(u[0][0])  # s_i0_j = 0
            for i1 in range(n_caps):
                acc = [a + c[i0][i1][j] * x for a, x in zip(acc, u[i1][j], strict=True)]
            s[i0][j] = acc
    return s, c


@pytest.mark.parametrize("iterations", [1, 2, 3, 5])
def test_article_dynamic_routing_equals_dynamic_routing(iterations, device):
    torch.manual_seed(iterations)
    votes = torch.randn(3, 4, 6, 5, dtype=torch.float64).to(device) * 0.8  # (batch, J outputs, I capsules, d)
    outputs, couplings = dynamic_routing(votes, iterations=iterations)
    for n in range(3):
        # The article indexes (I, J): convert at the reference's edge, and its couplings back.
        v, c = article_dynamic_routing(rearrange(votes[n], "j i d -> i j d").tolist(), iterations)
        expected_c = rearrange(torch.tensor(c, dtype=torch.float64, device=device), "i j -> j i")
        expected_v = torch.tensor(v, dtype=torch.float64, device=device)
        torch.testing.assert_close(outputs[n], expected_v, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(couplings[n], expected_c, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("record", [False, True])
def test_article_multi_head_attention_equals_vote_as_attention(record, device):
    torch.manual_seed(7)
    u = torch.randn(2, 5, 3, 4, dtype=torch.float64).to(device)  # (batch, I capsules, J heads, d)
    per_head = u.transpose(1, 2)  # (batch, heads, I, d): every capsule is query, key and value
    result = vote(SharedVotes(per_head), DotProductScores(per_head, per_head, scale=1.0),
                  normalize_over="senders", record=record)  # one pass, softmax over the senders
    for n in range(2):
        s, c = article_multi_head_attention(u[n].tolist())
        expected = torch.tensor(s, dtype=torch.float64, device=device).transpose(0, 1)  # (heads, I, d)
        torch.testing.assert_close(result.outputs[n], expected, rtol=1e-12, atol=1e-12)
        if record:
            weights = torch.tensor(c, dtype=torch.float64, device=device).permute(2, 0, 1)  # (heads, i0, i1)
            torch.testing.assert_close(result.weights[0][n], weights, rtol=1e-12, atol=1e-12)
            ones = torch.ones(2, 3, 5, dtype=torch.float64, device=device)
            torch.testing.assert_close(result.weights[0].sum(-1), ones)


def test_the_two_differ_only_in_the_axis_and_the_loop(device):
    """Attention's weights sum to 1 over the senders; routing's over the receivers."""
    torch.manual_seed(8)
    u = torch.randn(1, 5, 3, 4, dtype=torch.float64).to(device)
    per_head = u.transpose(1, 2)  # (1, J, I, d): receivers first for routing, heads for attention
    _, couplings = dynamic_routing(per_head, iterations=3)  # (1, J, I): each capsule splits one vote
    torch.testing.assert_close(couplings.sum(-2), torch.ones(1, 5, dtype=torch.float64, device=device))
    attention = vote(SharedVotes(per_head), DotProductScores(per_head, per_head, scale=1.0),
                     normalize_over="senders", record=True).weights[0]
    torch.testing.assert_close(attention.sum(-1), torch.ones(1, 3, 5, dtype=torch.float64, device=device))
