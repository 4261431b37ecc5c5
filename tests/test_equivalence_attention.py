"""The weighted-voting article's claim, run: multi-head self-attention written as dynamic routing.

"Self-Attention is fundamentally a Weighted Voting" (Mr. For Example, 2023) gives the pseudocode
"Multi-Head Attention Pseudocode Implementation using Dynamic Routing"::

    For J number of predictions
        For I0 number of capsules
            For I1 number of capsules
                b_i0_i1_j = Dot(u_i0_j, u_i1_j)
    For J number of predictions
        For I0 number of capsules
            c_i0_j = Softmax(b_i0_j)
    For J number of predictions
        For I0 number of capsules
            s_i0_j = 0
            For I1 number of capsules
                s_i0_j += c_i0_i1_j * u_i1_j

where capsule ``i`` is a token, prediction type ``j`` is a head, and ``u_i_j`` is token ``i``'s
projection for head ``j`` by the one shared matrix the article proposes (query = key = value).
Below it is written as literal nested loops over plain tensors (softmax by hand too) and shown
equal to (a) ``MultiHeadAttention(shared_qkv=True)`` and (b) ``torchvote.functional.vote``.

The pseudocode leaves out the softmax's "divide by a constant": for (a) the loop multiplies every
Dot by ``1 / sqrt(head_dim)``, as multi-head attention does; (b) runs the literal, unscaled
pseudocode (``DotProductScores(u, u, scale=1.0)``). Both run on ``--device``, the loops too.
"""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.functional import DotProductScores, SharedVotes, vote
from torchvote.nn import MultiHeadAttention

F64 = torch.float64


Capsules = list[list[torch.Tensor]]  # u[i][j]: capsule i's vector for prediction type (head) j


def pseudocode_multi_head_attention(u: Capsules, dot_scale: float) -> Capsules:
    """The article's pseudocode, loop for loop. ``u[i][j]`` is capsule i's prediction of type j."""
    num_capsules, num_predictions = len(u), len(u[0])
    # b_i0_i1_j = Dot(u_i0_j, u_i1_j)
    b = [[[None] * num_predictions for _ in range(num_capsules)] for _ in range(num_capsules)]
    for j in range(num_predictions):
        for i0 in range(num_capsules):
            for i1 in range(num_capsules):
                b[i0][i1][j] = torch.dot(u[i0][j], u[i1][j]) * dot_scale
    # c_i0_j = Softmax(b_i0_j): over i1, for a fixed i0 and j
    c = [[[None] * num_predictions for _ in range(num_capsules)] for _ in range(num_capsules)]
    for j in range(num_predictions):
        for i0 in range(num_capsules):
            peak = max(b[i0][i1][j] for i1 in range(num_capsules))
            total = sum(torch.exp(b[i0][i1][j] - peak) for i1 in range(num_capsules))
            for i1 in range(num_capsules):
                c[i0][i1][j] = torch.exp(b[i0][i1][j] - peak) / total
    # s_i0_j = sum_i1 c_i0_i1_j * u_i1_j
    s = [[None] * num_predictions for _ in range(num_capsules)]
    for j in range(num_predictions):
        for i0 in range(num_capsules):
            s[i0][j] = torch.zeros_like(u[0][j])
            for i1 in range(num_capsules):
                s[i0][j] = s[i0][j] + c[i0][i1][j] * u[i1][j]
    return s


def _split(projected: torch.Tensor, num_heads: int) -> list[list[torch.Tensor]]:
    """(T, E) -> u[i][j]: token i's slice for head j."""
    head_dim = projected.shape[-1] // num_heads
    return [[projected[i, j * head_dim:(j + 1) * head_dim] for j in range(num_heads)]
            for i in range(projected.shape[0])]


@pytest.mark.parametrize("need_weights", [False, True])
def test_pseudocode_equals_shared_qkv_multi_head_attention(need_weights, device):
    torch.manual_seed(0)
    tokens, embed_dim, num_heads = 6, 12, 3
    module = MultiHeadAttention(embed_dim, num_heads, shared_qkv=True, dtype=F64)
    with torch.no_grad():
        module.in_proj.shared.bias.normal_()
        module.out_proj.bias.normal_()
    module = module.to(device)
    inputs = torch.randn(2, tokens, embed_dim, dtype=F64).to(device)

    output, _ = module(inputs, need_weights=need_weights)

    shared = module.in_proj.shared  # the one projection W (query = key = value)
    for batch in range(inputs.shape[0]):
        u = _split(inputs[batch] @ shared.weight.T + shared.bias, num_heads)
        s = pseudocode_multi_head_attention(u, dot_scale=1.0 / math.sqrt(embed_dim // num_heads))
        concatenated = torch.stack([torch.cat(s[i]) for i in range(tokens)])  # concat over heads j
        expected = concatenated @ module.out_proj.weight.T + module.out_proj.bias
        torch.testing.assert_close(output[batch], expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("record", [False, True], ids=["fused kernel", "voting loop"])
def test_pseudocode_equals_vote_with_shared_votes(record, device):
    """The literal (unscaled) pseudocode is one pass of ``vote`` over shared votes ``u``."""
    torch.manual_seed(1)
    tokens, num_heads, head_dim = 5, 2, 4
    u = torch.randn(num_heads, tokens, head_dim, dtype=F64).to(device)  # (h, i, d): one vote set per head

    result = vote(SharedVotes(u), DotProductScores(u, u, scale=1.0), normalize_over="senders",
                  record=record)

    per_token = [[u[j, i] for j in range(num_heads)] for i in range(tokens)]
    s = pseudocode_multi_head_attention(per_token, dot_scale=1.0)
    expected = torch.stack([torch.stack([s[i][j] for i in range(tokens)]) for j in range(num_heads)])
    torch.testing.assert_close(result.outputs, expected, rtol=1e-12, atol=1e-12)
