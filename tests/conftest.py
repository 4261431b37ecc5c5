"""Shared test references: Hinton et al. 2018's Procedure 1 for a convolutional capsule layer."""

from __future__ import annotations

import math

import pytest
import torch

EPS = 1e-6


def _conv_procedure1(votes, activations, beta_u, beta_a, grid, in_types, kernel, stride, schedule, eps=EPS):
    """Procedure 1 for one image of a convolutional capsule layer, loops over input capsules.

    ``votes[pos, o, s]``: the vote of patch ``pos``'s sender slot ``s`` (kernel row, kernel column,
    input type) for output type ``o``. An input capsule's parents are every ``(pos, o)`` whose patch
    holds it; its assignments are normalised over all of them (the paper's E-step over
    ``Omega_{L+1}``), and start at ``1 / |parents|``.
    """
    rows, cols = grid
    out_cols = (cols - kernel) // stride + 1
    positions, out_types, slots, pose_dim = votes.shape
    parents = {}  # input capsule (r, c, t) -> [(pos, slot)]
    for pos in range(positions):
        top, left = (pos // out_cols) * stride, (pos % out_cols) * stride
        for kh in range(kernel):
            for kw in range(kernel):
                for t in range(in_types):
                    slot = (kh * kernel + kw) * in_types + t
                    parents.setdefault((top + kh, left + kw, t), []).append((pos, slot))
    R = [[[None] * slots for _ in range(out_types)] for _ in range(positions)]
    for members in parents.values():
        for pos, slot in members:
            for o in range(out_types):
                R[pos][o][slot] = torch.tensor(1.0 / (len(members) * out_types), dtype=votes.dtype)
    for t, lam in enumerate(schedule):
        R_used = [[row[:] for row in patch] for patch in R]
        mu, var, a_out = {}, {}, {}
        for pos in range(positions):  # M-step, every output capsule of every patch
            for o in range(out_types):
                w = [R[pos][o][s] * activations[pos, s] for s in range(slots)]
                total = sum(w)
                mu[pos, o] = sum(w[s] * votes[pos, o, s] for s in range(slots)) / total
                spread = sum(w[s] * (votes[pos, o, s] - mu[pos, o]) ** 2 for s in range(slots))
                var[pos, o] = spread / total + eps
                cost = ((beta_u[o] + torch.log(torch.sqrt(var[pos, o]))) * total).sum()
                a_out[pos, o] = torch.sigmoid(lam * (beta_a[o] - cost))
        if t == len(schedule) - 1:
            break
        for members in parents.values():  # E-step, every input capsule over all its parents
            p = {}
            for pos, slot in members:
                for o in range(out_types):
                    density = 1.0 / torch.sqrt(torch.prod(2 * math.pi * var[pos, o]))
                    distance = ((votes[pos, o, slot] - mu[pos, o]) ** 2 / (2 * var[pos, o])).sum()
                    likelihood = density * torch.exp(-distance)
                    p[pos, o, slot] = a_out[pos, o] * likelihood
            normaliser = sum(p.values())
            for (pos, o, slot), value in p.items():
                R[pos][o][slot] = value / normaliser
    poses = torch.stack([torch.stack([mu[pos, o] for o in range(out_types)]) for pos in range(positions)])
    acts = torch.stack([torch.stack([a_out[pos, o] for o in range(out_types)]) for pos in range(positions)])
    assignments = torch.stack([torch.stack([torch.stack(row) for row in patch]) for patch in R_used])
    return poses, acts, assignments


@pytest.fixture
def conv_procedure1():
    """The paper's loop with joint normalisation over every parent of an input capsule."""
    return _conv_procedure1
