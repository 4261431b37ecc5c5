"""EM routing of matrix capsules as a configuration of the voting operator.

Hinton, Sabour & Frosst 2018, "Matrix capsules with EM routing", Procedure 1, written in
torchvote's legend: ``i`` output capsule (``Omega_{L+1}``, the receiver) and ``j`` input capsule
(``Omega_L``, the sender); the paper swaps the letters::

    R_ij = 1 / |Omega_{L+1}|
    repeat t = 0 .. r-1:
        M-step, for every output i:
            R_ij    <- R_ij * a_j                                    (NOT renormalised over i)
            mu_i^h  <- sum_j R_ij V_ij^h / sum_j R_ij
            s2_i^h  <- sum_j R_ij (V_ij^h - mu_i^h)^2 / sum_j R_ij
            cost^h  <- (beta_u + log sigma_i^h) sum_j R_ij
            a_i     <- logistic(lambda_t (beta_a - sum_h cost^h))
        E-step, for every input j (not after the last M-step: it changes nothing returned):
            p_ij    <- N(V_ij | mu_i, diag s2_i)
            R_ij    <- a_i p_ij / sum_k a_k p_kj                     (normalised over the OUTPUTS)

Layout: votes ``(batch..., out_caps, in_caps, pose_dim)`` and assignments ``(batch..., out_caps,
in_caps)``, receivers first as everywhere in torchvote; the input activations, per-input data,
are ``(batch..., in_caps)``. As voting::

    vote(MomentVotes(V), 0, normalize_over="receivers", sender_weights=a_in,
         aggregation="sum", update="replace", agreement=E-step log-likelihood, iterations=r)

- the softmax over the receivers of ``log a_i + log p_ij`` *is* the E-step's normalisation, and
  it is the whole new logit (``update="replace"``: nothing of the previous pass is kept);
- ``sender_weights=a_in`` multiplies the assignments by the input activations after the softmax,
  the M-step's ``R_ij a_j`` (never renormalised over the outputs: doing so, as one popular
  implementation does, makes ``sum_i R_ij a_j = 1`` and cancels the activations);
- each vote carries its sufficient statistics ``(1, c, c^2)`` (``_MomentVotes``), so one weighted
  sum gives every receiver's ``(sum R, sum R c, sum R c^2)``: the M-step's weighted mean and
  variance without a ``(batch, out, in, pose)`` temporary per pass; the E-step's log-likelihood
  ``-sum_h (c - mu)^2 / (2 s2) + const`` is one dot product of the same statistics with
  ``(const, mu / s2, -1 / (2 s2))``. The votes are centred first (``c = V - m`` with ``m`` each
  output capsule's plain mean of its votes, a constant to autograd: every quantity is
  shift-invariant) so that ``E[c^2] - E[c]^2`` does not cancel in float32;
- every batch element (every patch of a convolutional capsule layer) routes on its own, so the
  batch is routed in blocks whose statistics stay in cache through all the passes.

Everything is kept in log space: ``log sigma = log(s2 + eps) / 2`` and the E-step works with
``log a_j + log p_ij`` (``log a`` as ``logsigmoid``), so no variance, probability or activation
underflows to zero and no gradient becomes NaN.

(Over 400 lines: the hand-written gradients of the moment votes only serve this routing and are
read with it.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from torchvote.functional.voting import VotingState, vote
from torchvote.validation import check_positive_float, check_positive_int

__all__ = [
    "InverseTemperature",
    "default_inverse_temperature",
    "em_routing",
    "inverse_temperature_schedule",
]

# Elements of the per-vote statistics routed at once (16 MB in float32): see em_routing.
_BLOCK_ELEMENTS = 1 << 22

InverseTemperature = Callable[[int], float] | Sequence[float] | float


class _Statistics:
    """The statistics ``[c, c^2]`` of one block of centred votes, and their gradient's pieces.

    Laid out ``(N = n * i, j, 2h)``, receivers first, built once outside autograd (the constant
    ``1`` of the sufficient statistics ``(1, c, c^2)`` is handled by the products directly) and
    kept for the backward pass in place of the votes.

    It also collects the per-pass pieces of the votes' gradient: every product contributes
    ``scale_j (q1 + 2 c_j q2)`` to ``d/dc``; summed over the passes that is
    ``P @ Q1 + 2 c (P @ Q2)`` with the scales stacked in ``P``: one small matrix product for the
    whole loop (in :class:`_Anchor`) instead of one per pass plus the additions.
    """

    def __init__(self, votes: Tensor, shift: Tensor) -> None:
        n, receivers, senders, pose_dim = votes.shape  # votes (n, i, j, h), shift (n, i, 1, h)
        with torch.no_grad():
            # Rows [c, c^2]: for h = 16 each half fills whole cache lines of its own, so each of
            # the two writes touches only the memory it fills.
            statistics = votes.new_empty(n, receivers, senders, 2 * pose_dim)
            centred = statistics[..., :pose_dim]
            torch.sub(votes, shift, out=centred)
            torch.mul(centred, centred, out=statistics[..., pose_dim:])
        self.tensor = statistics.view(n * receivers, senders, 2 * pose_dim)  # (N, j, 2h)
        self.scales: list[Tensor] = []  # (N, j) each
        self.coefficients: list[Tensor] = []  # (N, 2h) each: [q1, q2]

    def add_gradient(self, scale: Tensor, coefficients: Tensor) -> None:
        self.scales.append(scale)
        self.coefficients.append(coefficients)


class _Anchor(torch.autograd.Function):
    """Ties the votes to the products' token; its backward, which autograd runs after every
    product's backward (they all consume the token), turns the stored pieces into ``d/dvotes``."""

    @staticmethod
    def forward(ctx: FunctionCtx, votes: Tensor, statistics: _Statistics) -> Tensor:
        ctx.statistics, ctx.votes_shape = statistics, votes.shape
        return votes.new_zeros(())

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, None]:
        store = ctx.statistics
        if not store.scales:
            return None, None
        stats = store.tensor
        pose_dim = stats.shape[-1] // 2
        scales = torch.stack(store.scales, dim=-1)  # (N, j, passes)
        coefficients = torch.stack(store.coefficients, dim=1)  # (N, passes, 2h)
        store.scales, store.coefficients = [], []
        pieces = torch.bmm(scales, coefficients)  # (N, j, 2h): [sum_t s q1, sum_t s q2]
        centred = stats[..., :pose_dim]
        grad_votes = torch.addcmul(pieces[..., :pose_dim], centred, pieces[..., pose_dim:], value=2.0)
        return grad_votes.view(ctx.votes_shape), None


class _MomentSum(torch.autograd.Function):
    """``[sum_j w, sum_j w c, sum_j w c^2]`` per receiver: ``(N, j)`` weights -> ``(N, 1 + 2h)``."""

    @staticmethod
    def forward(ctx: FunctionCtx, weights: Tensor, token: Tensor, statistics: _Statistics) -> Tensor:
        ctx.save_for_backward(weights)
        ctx.statistics = statistics
        moments = torch.bmm(weights.unsqueeze(1), statistics.tensor).squeeze(1)  # (N, 2h)
        return torch.cat([weights.sum(-1, keepdim=True), moments], dim=-1)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        (weights,) = ctx.saved_tensors
        grad_w = grad_token = None
        if ctx.needs_input_grad[0]:
            grad_w = torch.baddbmm(grad[:, :1].unsqueeze(-1), ctx.statistics.tensor,
                                   grad[:, 1:].unsqueeze(-1)).squeeze(-1)  # (N, j)
        if ctx.needs_input_grad[1]:
            ctx.statistics.add_gradient(weights, grad[:, 1:])
            grad_token = grad.new_zeros(())
        return grad_w, grad_token, None


class _MomentDot(torch.autograd.Function):
    """``k + c . q1 + c^2 . q2`` per (receiver, sender): ``(N, 1 + 2h)`` queries -> ``(N, j)``."""

    @staticmethod
    def forward(ctx: FunctionCtx, queries: Tensor, token: Tensor, statistics: _Statistics) -> Tensor:
        ctx.save_for_backward(queries)
        ctx.statistics = statistics
        return torch.baddbmm(queries[:, :1].unsqueeze(-1), statistics.tensor,
                             queries[:, 1:].unsqueeze(-1)).squeeze(-1)  # (N, j)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        (queries,) = ctx.saved_tensors
        grad_q = grad_token = None
        if ctx.needs_input_grad[0]:
            moments = torch.bmm(grad.unsqueeze(1), ctx.statistics.tensor).squeeze(1)  # (N, 2h)
            grad_q = torch.cat([grad.sum(-1, keepdim=True), moments], dim=-1)
        if ctx.needs_input_grad[1]:
            ctx.statistics.add_gradient(grad, queries[:, 1:])
            grad_token = grad.new_zeros(())
        return grad_q, grad_token, None


class _MomentVotes:
    """Votes carrying the sufficient statistics ``(1, c, c^2)`` of centred Gaussian votes.

    A :class:`~torchvote.functional.voting.Votes` whose ``weighted_sum`` returns
    ``[sum_j w, sum_j w c, sum_j w c^2]`` and whose ``dot`` with ``[k, q1, q2]`` returns
    ``k + c . q1 + c^2 . q2``: everything the M-step and the E-step need, from one matrix-vector
    product each. The two products have hand-written gradients; their parts that flow to the
    votes (``c = votes - shift``, the shift a constant) are summed over all passes by one
    :class:`_Anchor` node.

    Args:
        votes: ``(n, i, j, h)`` votes (any strides).
        shift: ``(n, i, 1, h)`` a constant to centre them on.
    """

    def __init__(self, votes: Tensor, shift: Tensor) -> None:
        self.votes, self.shift = votes, shift
        self.shape = votes.shape
        self.statistics = _Statistics(votes, shift)
        if votes.requires_grad and torch.is_grad_enabled():
            self.token = _Anchor.apply(votes, self.statistics)
        else:
            self.token = votes.new_zeros(())

    def weighted_sum(self, weights: Tensor) -> Tensor:
        n, receivers, senders, _ = self.shape
        flat = weights.reshape(n * receivers, senders)
        return _MomentSum.apply(flat, self.token, self.statistics).view(n, receivers, -1)

    def dot(self, queries: Tensor) -> Tensor:
        n, receivers, senders, _ = self.shape
        flat = queries.reshape(n * receivers, -1)
        return _MomentDot.apply(flat, self.token, self.statistics).view(n, receivers, senders)

    def squared_norm(self) -> Tensor:
        raise NotImplementedError("EM routing scores votes by likelihood, not by distance")

    def detach(self) -> _MomentVotes:
        return _MomentVotes(self.votes.detach(), self.shift)

    def zero_logits(self) -> Tensor:
        return self.votes.new_zeros(self.shape[:-1])  # (n, i, j)

    def materialize(self) -> Tensor:
        return self.votes  # (n, i, j, h)

    @property
    def dtype(self) -> torch.dtype:
        return self.votes.dtype


def default_inverse_temperature(iteration: int) -> float:
    """``lambda_t = 0.01 (1 - 0.95^(t + 1))`` for the 0-based iteration ``t``.

    The schedule the authors gave for the inverse temperature in their reply on OpenReview (the
    paper only says lambda is increased at each iteration), as used by the public
    implementations: 0.0005, 0.000975, 0.00143, ... rising towards 0.01.

    Args:
        iteration: 0-based routing iteration.

    Returns:
        The inverse temperature of that iteration.
    """
    return 0.01 * (1.0 - 0.95 ** (iteration + 1))


def inverse_temperature_schedule(inverse_temperature: InverseTemperature, iterations: int) -> list[float]:
    """The ``lambda_t`` of each of ``iterations`` passes.

    Args:
        inverse_temperature: a callable of the 0-based iteration, one value per iteration, or a
            constant.
        iterations: passes.

    Returns:
        ``iterations`` floats.

    Raises:
        ValueError: a sequence of the wrong length, or a value that is not finite and >= 0.
    """
    if callable(inverse_temperature):
        values = [float(inverse_temperature(t)) for t in range(iterations)]
    elif isinstance(inverse_temperature, (int, float)):
        values = [float(inverse_temperature)] * iterations
    else:
        values = [float(v) for v in inverse_temperature]
        if len(values) != iterations:
            raise ValueError(
                f"inverse_temperature must give one value per iteration ({iterations}), got {len(values)}"
            )
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"inverse_temperature must be finite and >= 0, got {values}")
    return values


def _m_step(
    sums: Tensor, pose_dim: int, beta_u: Tensor, beta_a: Tensor, inverse_temperature: float, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The M-step from the aggregated statistics ``(sum R, sum R V, sum R V^2)`` per receiver.

    Returns ``(mean, variance, activation logit)``: ``(..., i, h)``, ``(..., i, h)``, ``(..., i)``;
    the activation is ``sigmoid`` of the logit (kept as a logit for ``logsigmoid``).
    """
    total = sums[..., :1]  # sum_j R_ij a_j: (..., i, 1)
    denominator = total.clamp_min(eps)
    mean = sums[..., 1 : 1 + pose_dim] / denominator  # (..., i, h)
    second = sums[..., 1 + pose_dim :] / denominator
    variance = (second - mean.pow(2)).clamp_min(0.0) + eps  # (..., i, h)
    log_sigma = 0.5 * torch.log(variance)
    cost = (beta_u.unsqueeze(-1) + log_sigma) * total  # Procedure 1: (beta_u + log sigma) sum R
    logit = inverse_temperature * (beta_a - cost.sum(-1))  # (..., i)
    return mean, variance, logit


def em_routing(
    votes: Tensor,
    activations: Tensor,
    beta_u: Tensor | float,
    beta_a: Tensor | float,
    *,
    iterations: int = 3,
    inverse_temperature: InverseTemperature = default_inverse_temperature,
    eps: float = 1e-6,
    return_assignments: bool = False,
    all_passes: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """EM routing (Hinton, Sabour & Frosst 2018, Procedure 1) as one call of ``vote``.

    The cost is Procedure 1's form, ``cost^h = (beta_u + log sigma_i^h) sum_j R_ij`` with ``R``
    already multiplied by the input activations, and ``a_i = logistic(lambda (beta_a - sum_h
    cost^h))``; the paper's other form (sec. 3, ``(log sigma + (1 + log 2 pi) / 2) sum R`` from the
    Gaussian's entropy, with beta_u absorbing the constant) is not used. No normalisation of the
    cost across capsules is applied (the paper has none). Gradients flow through every
    iteration.

    Args:
        votes: ``(batch..., out_caps, in_caps, pose_dim)``: ``V_ij = M_j W_ij`` flattened (16 for
            4x4 poses); any strides.
        activations: ``(batch..., in_caps)`` input activations ``a_j`` in ``[0, 1]``.
        beta_u: the per-dimension cost offset, a float or a tensor broadcastable to
            ``(batch..., out_caps)`` (learned per output capsule type in the modules).
        beta_a: the activation offset, as ``beta_u``.
        iterations: EM iterations (the paper uses 3); at least 1.
        inverse_temperature: ``lambda_t``: a callable of the 0-based iteration, a sequence of one
            value per iteration, or a constant. Default :func:`default_inverse_temperature`,
            ``0.01 (1 - 0.95^(t+1))``.
        eps: added to every variance (and the floor of ``sum_j R_ij``), so that a single vote or
            identical votes give a finite ``log sigma``.
        return_assignments: also return the assignments ``R`` of the final M-step.
        all_passes: with ``return_assignments``, the assignments of every iteration stacked on a
            new leading axis.

    Returns:
        ``(poses, activations)``: ``(batch..., out_caps, pose_dim)`` the means ``mu_i``, and
        ``(batch..., out_caps)`` the activations ``a_i``; with ``return_assignments`` also
        ``(batch..., out_caps, in_caps)`` ``R_ij``, summing to 1 over ``out_caps`` (before the
        input activations multiply them).

    Raises:
        ValueError: ``iterations`` < 1, mismatched shapes, a bad schedule or ``eps``.
    """
    check_positive_int(iterations, "iterations")
    check_positive_float(eps, "eps")
    if votes.dim() < 3 or not votes.is_floating_point():
        raise ValueError(
            f"votes must be a floating tensor of shape (..., out_caps, in_caps, pose_dim), got "
            f"{votes.dtype} {tuple(votes.shape)}"
        )
    batch_shape, (out_caps, in_caps, pose_dim) = votes.shape[:-3], votes.shape[-3:]
    if activations.shape != (*batch_shape, in_caps):
        raise ValueError(
            f"activations must have shape (batch..., in_caps) = {(*batch_shape, in_caps)} to match "
            f"votes {tuple(votes.shape)}, got {tuple(activations.shape)}"
        )
    schedule = inverse_temperature_schedule(inverse_temperature, iterations)
    beta_u = torch.as_tensor(beta_u, dtype=votes.dtype, device=votes.device)
    beta_a = torch.as_tensor(beta_a, dtype=votes.dtype, device=votes.device)
    try:
        beta_u = beta_u.expand(*batch_shape, out_caps).reshape(-1, out_caps)  # (n, i)
        beta_a = beta_a.expand(*batch_shape, out_caps).reshape(-1, out_caps)
    except RuntimeError:
        raise ValueError(
            f"beta_u and beta_a must broadcast to (batch..., out_caps) = {(*batch_shape, out_caps)}, "
            f"got {tuple(beta_u.shape)} and {tuple(beta_a.shape)}"
        ) from None
    flat_votes = votes.reshape(-1, out_caps, in_caps, pose_dim)  # (n, i, j, h)
    flat_activations = activations.reshape(-1, in_caps)  # (n, j)
    # Every batch element (every patch of a convolutional layer) routes on its own, so the work
    # runs over blocks of them small enough that a block's statistics stay in cache through all
    # the passes; split (not indexing) keeps the backward to one concatenation.
    rows = max(1, _BLOCK_ELEMENTS // max(1, in_caps * out_caps * (2 * pose_dim + 1)))
    blocks = [
        _em_block(v, a, bu, ba, schedule, eps, return_assignments, all_passes)
        for v, a, bu, ba in zip(
            flat_votes.split(rows),
            flat_activations.split(rows),
            beta_u.split(rows),
            beta_a.split(rows),
            strict=True,
        )
    ]
    poses = torch.cat([block[0] for block in blocks]).view(*batch_shape, out_caps, pose_dim)
    out_activations = torch.cat([block[1] for block in blocks]).view(*batch_shape, out_caps)
    if not return_assignments:
        return poses, out_activations
    axis = 1 if all_passes else 0  # assignments: (passes, n, i, j) or (n, i, j)
    assignments = torch.cat([block[2] for block in blocks], dim=axis)
    leading = assignments.shape[:axis]
    return poses, out_activations, assignments.view(*leading, *batch_shape, out_caps, in_caps)


def _em_block(
    votes: Tensor,
    activations: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    schedule: list[float],
    eps: float,
    return_assignments: bool,
    all_passes: bool,
) -> tuple[Tensor, ...]:
    """EM routing of ``(n, i, j, h)`` votes and ``(n, j)`` activations: one call of ``vote``."""
    pose_dim = votes.shape[-1]
    # Centre on each receiver's plain mean of votes (a constant: every quantity below is
    # shift-invariant, so the gradient is exact) so that E[V^2] - E[V]^2 keeps its digits.
    with torch.no_grad():
        shift = votes.mean(dim=-2, keepdim=True)  # (n, i, 1, h)
    moments = _MomentVotes(votes, shift)  # statistics of the centred votes: (n * i, j, 1 + 2h)
    log_2pi = math.log(2 * math.pi)

    def e_step(state: VotingState) -> Tensor:
        """log a_i + log N(V_ij | mu_i, s2_i): the next pass's logits (softmax over i = E-step)."""
        mean, variance, logit = _m_step(
            state.aggregated, pose_dim, beta_u, beta_a, schedule[state.iteration], eps
        )
        constant = (-0.5 * (mean.pow(2) / variance + log_2pi + torch.log(variance))).sum(-1)
        constant = constant + F.logsigmoid(logit)  # (n, i)
        query = torch.cat([constant.unsqueeze(-1), mean / variance, -0.5 / variance], dim=-1)
        return moments.dot(query)  # (n, i, j)

    result = vote(
        moments,
        moments.zero_logits(),  # R_ij = 1 / |Omega_{L+1}|
        normalize_over="receivers",
        iterations=len(schedule),
        agreement=e_step,
        update="replace",  # the E-step's log a_i + log p_ij is the whole new logit
        aggregation="sum",
        nonlinearity="identity",
        sender_weights=activations,  # (n, j): the M-step's R_ij * a_j
        record=return_assignments,
    )
    mean, _, logit = _m_step(result.outputs, pose_dim, beta_u, beta_a, schedule[-1], eps)
    poses = mean + shift.squeeze(-2)  # (n, i, h)
    out_activations = torch.sigmoid(logit)  # (n, i)
    if not return_assignments:
        return poses, out_activations
    if all_passes:
        return poses, out_activations, torch.stack(result.weights)  # (passes, n, i, j)
    return poses, out_activations, result.weights[-1]  # (n, i, j)
