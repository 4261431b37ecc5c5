"""The strategies behind :func:`torchvote.functional.em.em_routing`: one loop, three ways to run it.

Hinton, Sabour & Frosst 2018, "Matrix capsules with EM routing", Procedure 1, in torchvote's
layout (receivers first): votes ``V[n, i, j, h]`` of sender (input capsule) ``j`` for
receiver (output capsule) ``i``; ``n`` indexes routing rows (batch x positions of
a convolutional layer). Index legend of every einsum here::

    n  routing rows (batch, or batch x output positions)
    i  receivers (output capsules)        j  senders (input capsules)
    h  pose entries (16 for 4x4 poses; not heads, as in the operator's legend)
    L  a convolutional layer's output positions (the period of the sender groups' rows)

Procedure 1, in log space::

    R_ij = 1 / |parents of j|                               (uniform initial assignments)
    for t = 0 .. T-1:
        M-step:  w_ij = R_ij a_j                             (NOT renormalised over i)
                 mu_i = sum_j w_ij V_ij / sum_j w_ij                 (0 where sum_j w_ij = 0)
                 s2_i = sum_j w_ij (V_ij - mu_i)^2 / sum_j w_ij + eps    (eps there)
                 cost_i^h = (beta_u + log sigma_i^h) sum_j w_ij          (Procedure 1's cost)
                 a_i = sigmoid(lambda_t (beta_a - sum_h cost_i^h))
        E-step (not after the last M-step):
                 R_ij = softmax over the parents of j of  log a_i + log N(V_ij | mu_i, s2_i)

The statistics are sums over votes centred on a shift ``m_i`` per receiver,
``mu_i = m_i + sum_j w_ij (V_ij - m_i) / sum_j w_ij``, the same as above; ``m_i`` is a constant to
autograd, which is exact because every quantity is unchanged by that shift. Which constant only
changes the rounding: the passes use the expanded forms ``E_w[c^2] - E_w[c]^2`` and
``c . (mu / s2) + c^2 . (-1 / (2 s2))``, whose terms are about ``|mu - m|^2 / s2`` and cancel, so
``m_i`` is the first M-step's own weighted mean, ``sum_j p_ij V_ij`` with the weights of the first
pass (``p_ij`` proportional to ``R_ij a_j`` with the initial ``R``; the plain mean where no
activation is positive): votes of inactive senders, however far away, then cost no precision in
float32. Later passes keep that shift; a receiver whose weighted mean moves far from it (by ``D``,
say, as outliers with a positive activation lose their ``R``) loses about ``eps D^2 / s2`` of its
E-step logits. (A floor ``max(sum_j w_ij, eps)`` would break that invariance for a receiver with less
than ``eps`` of data, and its gradient with it.) The normalised weights ``w_ij / sum_j w_ij`` are
a softmax over ``j`` of ``log R_ij + log a_j`` (the E-step gives ``log R``): no division by a
sum that may be subnormal, so the gradients stay finite however little data a receiver has. A
receiver no vote reaches gets pose 0, variance ``eps`` and the activation ``sigmoid(lambda beta_a)``.

The softmax of the E-step runs over the receivers ``i`` of each sender: per row ``n`` by default
(each patch on its own), or, with ``sender_groups``, jointly over every ``(n, i)`` whose sender
is the same input capsule (the paper's form for convolutional capsules: an input capsule's parents
are the output capsules of every patch that contains it, as in IBM's implementation). The joint
logsumexp is taken in two levels: over each patch's receivers (a dense reduction), then over the
patches of each group (a scatter of ``(n, j)`` values only, ``1 / i`` of the logits).

Strategies (every one gives the same numbers; ``"auto"`` is ``"blocked"`` on CPU and
``"vectorized"`` on CUDA, while ``torch.compile`` traces and under ``torch.func`` transforms or
forward-mode AD; ``"compiled"`` is only ever an explicit choice):

- ``"vectorized"``: the loop above on all rows at once, plain autograd (double backward works);
  the fastest eager form on CUDA, but autograd keeps several ``(n, i, j, h)`` temporaries per pass.
- ``"blocked"``: rows in blocks (whole periods of ``sender_groups``, so no group straddles two
  blocks); a custom autograd Function runs the blocks without autograd and saves only its inputs
  (the votes are referenced, not copied); its backward recomputes each block under autograd and
  writes that block's gradient. Peak memory is one gradient of the votes plus one block's
  temporaries; with :class:`PerSenderVotes` (a convolutional layer's votes, not yet formed) each
  block's votes are formed in a reused buffer and neither the votes nor their gradient exist
  whole. Backward once only, one gradient at a time: double backward and batched gradients
  (``is_grads_batched=True``, ``vectorize=True``) raise (use ``"vectorized"``), and so do
  ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``, ``jvp``) and forward-mode AD, which
  ``"auto"`` gives the vectorized loop. An eager kernel:
  under ``torch.compile`` it runs as one opaque call (one graph break), and ``"auto"`` picks
  ``"vectorized"`` there, which traces into the caller's graph.
- ``"compiled"``: ``torch.compile`` of the vectorized loop (about 10-30 s to compile per shape on
  CPU). On a GPU one graph for all rows; on a CPU the rows run in blocks of whole periods
  (:func:`_compiled_blocks`, about 16 MB of votes each, at least one period), one compiled graph
  per block shape, each differentiated by autograd: Inductor fuses each pass over a block into one
  loop that reads the votes once (the blocked strategy's eager products read ``[c, c^2]``, twice
  their size), and its backward recomputes the ``(n, i, j, h)`` temporaries, so a block's graph
  keeps its votes and a few ``(n, i, j)`` tensors; votes formed from :class:`PerSenderVotes` past
  :data:`_KEPT_VOTES_BYTES` per call (512 MiB) are kept as the product that formed them and formed
  again in backward (:func:`_saved_as_recipe`), so memory stops growing with the batch. Double
  backward raises (torch's "does not currently support double backward"); so does backward after
  a factor of votes formed again was modified in place since forward.

Votes in bfloat16 or float16 are routed with float32 statistics (cast per block in ``"blocked"``);
poses, activations and assignments come back in the votes' dtype. Every strategy runs with
``torch.autocast`` off: under autocast the statistics' products would be float16 or bfloat16 (and
the blocked strategy's recorded products of another dtype than its backward's).

This file is over 400 lines on purpose: the strategies share one loop (:func:`_em_loop`) written
against two statistics classes, and the blocked strategy's hand-written product gradients are
only correct together with the Function that scopes them to one backward call; split, the
invariants that make the gradients right would live in different files.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from torchvote.functional.voting import autocast_off, refuse_double_backward, shifted_exp
from torchvote.tracing import plain_ops_required
from torchvote.validation import ArgumentTypeError, check_positive_int

__all__ = [
    "STRATEGIES",
    "EMStrategy",
    "PerSenderVotes",
    "SenderGroups",
    "conv_sender_groups",
    "prepare_sender_groups",
    "prepared_conv_sender_groups",
    "route",
]

EMStrategy = Literal["auto", "blocked", "vectorized", "compiled"]
STRATEGIES = get_args(EMStrategy)
# Vote elements (n * i * j * h) per block of the blocked strategy (2 MB in float32): small enough
# that a block's votes and temporaries stay near the core through its passes, large enough that
# Python's per-operation cost is amortised. Rounded up to whole periods of sender_groups.
_BLOCK_ELEMENTS = 1 << 19
# The same for the compiled strategy's blocks on a CPU (16 MB in float32): each compiled pass streams
# its block once whatever its size, so blocks are large, to spread the per-call cost of the compiled
# forward and backward over many rows.
_COMPILED_BLOCK_ELEMENTS = 1 << 22
# Bytes of block votes the compiled strategy forms from PerSenderVotes on a CPU and keeps for backward,
# per call; later blocks are kept as the product that formed them and formed again in backward
# (about 9 ms a 21 MB block on the 2-core CPU: 0.3 s a step were all 32 blocks of the paper's
# ConvCaps1 at batch 32 formed again). Blocks within the budget cost no time, and past it the memory
# no longer grows with the batch.
_KEPT_VOTES_BYTES = 1 << 29
_LOG_2PI = math.log(2 * math.pi)


@dataclass(frozen=True)
class _Config:
    schedule: tuple[float, ...]
    eps: float
    groups: Tensor | None  # (L, j) compact ids 0..G-1, or None: per-row normalisation
    num_groups: int  # G: ids per period
    initial: Tensor | None  # (L, 1, j) initial R with groups (1 / (i * multiplicity)), else None
    record: bool  # return assignments
    all_passes: bool


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _group_log_softmax(logits: Tensor, ids: Tensor, num_groups: int) -> Tensor:
    """Log-softmax of ``(n, i, j)`` logits jointly over all ``(n, i)`` whose sender has the same id.

    ``ids`` ``(n, j)`` in ``[0, num_groups)``. In two levels, so that only ``(n, j)`` tensors are
    scattered (a sender has ``i`` parents in each of its patches): each patch's log-sum-exp over
    its receivers, then each group's log-sum-exp of those, stable by subtracting the group's
    maximum (a constant to autograd: the result does not depend on it), then
    ``log R = logit - group's log-sum-exp`` (<= 0).
    """
    local = torch.logsumexp(logits, dim=1)  # (n, j): over the receivers of each patch
    flat_ids = ids.reshape(-1)  # (n j)
    with torch.no_grad():
        peak = local.new_full((num_groups,), -math.inf)
        peak = peak.scatter_reduce(0, flat_ids, local.detach().reshape(-1), "amax")[ids]  # (n, j)
    sums = local.new_zeros(num_groups).index_add(0, flat_ids, (local - peak).exp().reshape(-1))
    total = sums.log()[ids] + peak  # (n, j): log of the group's sum of exp(logit)
    return logits - total.unsqueeze(1)


def _first_pass_shift(votes: Tensor, activations: Tensor, config: _Config, fused: bool = False) -> Tensor:
    """The centre of the statistics: each receiver's mean of its votes under the first M-step's
    weights, ``sum_j p_j V_ij`` with ``p_j`` proportional to ``R_ij a_j`` (the initial ``R`` is
    the same for every receiver of a sender, so ``p`` is ``(n, j)``), ``(n, i, h)``.

    ``votes`` ``(n, i, j, h)`` in the compute dtype and ``activations`` ``(n, j)``, both detached
    (the shift is a constant to autograd). Activations that are not positive (NaN included) weigh
    nothing, as in the loop; where none is positive, or their sum is not finite, the plain mean.
    One reduction over the votes, as the plain mean was; no host synchronisation.
    """
    weights = activations.to(votes.dtype)
    weights = torch.where(weights > 0, weights, 0.0)  # (n, j)
    if config.initial is not None:  # R_ij = 1 / |parents of j| differs between senders
        initial = config.initial.to(votes.dtype).squeeze(1)  # (L, j)
        weights = weights * initial.repeat(weights.shape[0] // initial.shape[0], 1)
    total = weights.sum(-1, keepdim=True)  # (n, 1)
    usable = (total > 0) & (total < math.inf)
    weights = torch.where(usable, weights / torch.where(usable, total, 1.0), 1.0 / weights.shape[-1])
    if fused:  # a broadcast product, which Inductor fuses
        return (weights[:, None, :, None] * votes).sum(2)
    # a batched vector-matrix product: on a CPU about 1.5x the time of the plain mean for votes laid
    # out (n, i, j, h) (an einsum copied them first: 6x); votes in PerSenderVotes' receivers-first
    # view are copied by it (4.7x, one block's copy at a time: the peak memory is unchanged)
    return torch.matmul(weights[:, None, None, :], votes).squeeze(-2)


class _DenseStatistics:
    """Centred votes ``c = V - m`` and ``c^2`` of all rows, for the vectorized and compiled
    strategies: the M-step's sums and the E-step's dot products, differentiated by plain autograd.

    ``m`` (each receiver's mean of its votes under the first M-step's weights, ``(n, i, h)``,
    :func:`_first_pass_shift`) is a constant to autograd: every quantity is shift-invariant, and
    the centring keeps the first pass's ``E[c^2] - E[c]^2`` exact in float32 whatever the votes of
    inactive senders. Eager mode uses einsums (batched matrix products); under ``torch.compile``
    (``fused=True``) the same sums are written as broadcast products reduced over ``j``, which
    Inductor fuses with their neighbours instead of calling out to a matrix product.
    """

    def __init__(self, votes: Tensor, activations: Tensor, config: _Config, fused: bool = False) -> None:
        votes = votes.to(_compute_dtype(votes.dtype))
        self.fused = fused
        self.shift = _first_pass_shift(votes.detach(), activations.detach(), config, fused)  # (n, i, h)
        self.centred = votes - self.shift.unsqueeze(2)  # (n, i, j, h)
        self.squares = self.centred.square()

    def weighted_sum(self, weights: Tensor) -> Tensor:
        """``(n, i, j)`` weights -> ``(n, i, 2h)``: ``[sum_j w c, sum_j w c^2]``."""
        if self.fused:
            w = weights.unsqueeze(-1)
            return torch.cat([(w * self.centred).sum(2), (w * self.squares).sum(2)], dim=-1)
        return torch.cat([torch.einsum("nij,nijh->nih", weights, self.centred),
                          torch.einsum("nij,nijh->nih", weights, self.squares)], dim=-1)

    def dot(self, queries: Tensor) -> Tensor:
        """``(n, i, 2h)`` queries ``[q1, q2]`` -> ``(n, i, j)``: ``c . q1 + c^2 . q2``."""
        half = queries.shape[-1] // 2
        first, second = queries[..., :half], queries[..., half:]
        if self.fused:
            return (self.centred * first.unsqueeze(2) + self.squares * second.unsqueeze(2)).sum(-1)
        return (torch.einsum("nijh,nih->nij", self.centred, first)
                + torch.einsum("nijh,nih->nij", self.squares, second))


def _em_loop(
    statistics, activations: Tensor, beta_u: Tensor, beta_a: Tensor, config: _Config, rows: int
) -> tuple[Tensor, ...]:
    """Procedure 1 on ``rows`` rows given their vote statistics (``_DenseStatistics`` or one
    block's ``_BlockStatistics``), ``(n, j)`` activations and ``(n, i)`` offsets -> poses
    ``(n, i, h)``, activation logits ``(n, i)`` and the recorded assignments ``(n, i, j)``.

    With groups, ``n`` is a whole number of periods ``L``; group ids are made distinct per period.
    """
    shift = statistics.shift  # (n, i, h)
    dtype, (receivers, pose_dim) = shift.dtype, shift.shape[1:]
    activations, beta_u, beta_a = activations.to(dtype), beta_u.to(dtype), beta_a.to(dtype)
    senders, eps = activations.shape[-1], config.eps
    ids = None
    if config.groups is None:
        log_assignments = shift.new_full((1, 1, 1), -math.log(receivers))  # R_ij = 1 / |Omega_{L+1}|
    else:
        period = config.groups.shape[0]
        repeats = rows // period
        offsets = torch.arange(repeats, device=shift.device).repeat_interleave(period) * config.num_groups
        ids = config.groups.repeat(repeats, 1) + offsets.unsqueeze(1)  # (n, j) distinct per period
        log_assignments = config.initial.to(dtype).log().repeat(repeats, 1, 1)  # (n, 1, j): 1 / |parents|
    # log a_j; -inf for a_j <= 0 (no weight), NaN kept (NaN outputs, as the input says). The
    # gradient with respect to an activation of exactly 0 is then 0 (a sigmoid's 0 passes none).
    inactive = activations <= 0  # (n, j)
    log_activations = torch.where(inactive, -math.inf, torch.where(inactive, 1.0, activations).log())
    recorded = []
    mean = logit = shift
    last = len(config.schedule) - 1
    for t, inverse_temperature in enumerate(config.schedule):
        if config.record and (config.all_passes or t == last):
            recorded.append(log_assignments.exp().expand(rows, receivers, senders))
        # Weights R_ij a_j, NOT renormalised over i; the weighted mean and variance take them
        # normalised over j, p_ij = R_ij a_j / sum_j R_ij a_j, formed in log space: exact, hence
        # unchanged by the shift m (a constant to autograd; a floor of eps under the sum made them
        # depend on m, and the gradient of a receiver with less than eps of data wrong), and with
        # bounded gradients however little data a receiver has (a division by a subnormal sum
        # overflowed in backward). A receiver no vote reaches gets pose 0. Formed on the broadcast
        # shape: the first pass's uniform R is one row for every receiver.
        log_weights = log_assignments + log_activations.unsqueeze(1)  # (n, i | 1, j)
        normalised, total, reached = _normalised_weights(log_weights)  # (n, i | 1, j), (n, i | 1, 1) x 2
        normalised = normalised.expand(rows, receivers, senders)
        total = total.expand(rows, receivers, 1)  # sum_j R_ij a_j: the receiver's data
        reached = reached.expand(rows, receivers, 1)  # some vote has weight (its sum may underflow)
        sums = statistics.weighted_sum(normalised)  # (n, i, 2h)
        mean = torch.where(reached, sums[..., :pose_dim], -shift)  # of the centred votes: mu - m
        variance = (sums[..., pose_dim:] - mean.square()).clamp_min(0.0) + eps  # (n, i, h)
        log_variance = variance.log()
        cost = (beta_u.unsqueeze(-1) + 0.5 * log_variance) * total  # (beta_u + log sigma) sum R
        logit = inverse_temperature * (beta_a - cost.sum(-1))  # (n, i): a_i = sigmoid(logit)
        if t == last:
            break  # no E-step after the last M-step: it changes nothing returned
        # log a_i + log N(V_ij | mu_i, s2_i) = k_i + c . (mu / s2) + c^2 . (-1 / (2 s2))
        precision = variance.reciprocal()
        constant = -0.5 * (mean.square() * precision + log_variance + _LOG_2PI).sum(-1)
        constant = constant + F.logsigmoid(logit)  # (n, i)
        queries = torch.cat([mean * precision, -0.5 * precision], dim=-1)  # (n, i, 2h)
        logits = constant.unsqueeze(-1) + statistics.dot(queries)  # (n, i, j)
        if ids is None:
            log_assignments = logits.log_softmax(dim=1)  # over the receivers of each sender
        else:
            log_assignments = _group_log_softmax(logits, ids, repeats * config.num_groups)
    return mean + shift, logit, *recorded


def _normalised_weights(log_weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The M-step's weights from their logarithms: ``(softmax over the last axis, sum of exp,
    whether the row has any weight)``; the softmax is 0 in a row that is all ``-inf`` (an
    unreached receiver; finite gradients), the sum ``exp(peak) * sum exp(w - peak)`` (exact: the
    peak, a constant to autograd, cancels)."""
    exp, peak = shifted_exp(log_weights, -1)
    sums = exp.sum(dim=-1, keepdim=True)  # >= 1 where any weight is > 0
    reached = ~(sums <= 0)  # NaN counts as reached: NaN activations give NaN outputs
    return exp / torch.where(reached, sums, 1.0), sums * peak.exp(), reached


class _BlockStatistics:
    """One block's ``[c, c^2]``, laid out ``(N = n * i, j, 2h)`` (the votes' own layout, so that
    building it is a contiguous pass), built without autograd.

    Its two products are autograd Functions whose backward returns the gradient of the small
    operand and records the pieces of the votes' gradient here: every product contributes
    ``scale_j * coefficient`` to ``d/d[c, c^2]``; :meth:`votes_gradient` sums them as one small
    batched product. An instance lives for one forward or one backward recomputation only.
    """

    def __init__(self, votes: Tensor, activations: Tensor, config: _Config, workspace: Tensor,
                 replay: list[Tensor] | None = None) -> None:
        n, receivers, senders, pose_dim = votes.shape
        # The products' results of the forward, recorded there and replayed by the backward's
        # recomputation (which then only builds the statistics and differentiates the small ops).
        self.replay = replay
        self.recorded: list[Tensor] = []
        with torch.no_grad():
            votes = votes.to(_compute_dtype(votes.dtype))
            # the first pass's weighted mean (:func:`_first_pass_shift`), the same in forward and
            # in the backward's recomputation (same votes, activations and operations)
            self.shift = _first_pass_shift(votes, activations, config)  # (n, i, h)
            # One buffer reused by every block: a fresh one per block pays its page faults again.
            stats = workspace[: 2 * votes.numel()].view(n, receivers, senders, 2 * pose_dim)
            centred = stats[..., :pose_dim]  # (n, i, j, h)
            torch.sub(votes, self.shift.unsqueeze(2), out=centred)
            torch.mul(centred, centred, out=stats[..., pose_dim:])
            stats = stats.view(n * receivers, senders, 2 * pose_dim)
        self.tensor, self.shape = stats, (n, receivers, senders, pose_dim)
        self.token = votes.new_zeros(())
        self.scales: list[Tensor] = []  # (N, j) each
        self.coefficients: list[Tensor] = []  # (N, 2h) each

    def weighted_sum(self, weights: Tensor) -> Tensor:
        n, receivers, senders, _ = self.shape
        flat = weights.reshape(n * receivers, senders)
        return _StatisticsSum.apply(flat, self.token, self).view(n, receivers, -1)

    def dot(self, queries: Tensor) -> Tensor:
        n, receivers, senders, _ = self.shape
        flat = queries.reshape(n * receivers, -1)
        return _StatisticsDot.apply(flat, self.token, self).view(n, receivers, senders)

    def product(self, compute: Callable[[], Tensor]) -> Tensor:
        """A product's result: replayed in the backward's recomputation, else computed and recorded."""
        if self.replay is not None:
            return self.replay.pop(0).clone()
        result = compute()
        self.recorded.append(result)
        return result

    def release(self) -> None:
        """Drop every tensor this block holds. Required after a backward recomputation: the
        products' autograd nodes hold this object (``ctx.stats``) and it holds their saved inputs
        (the pieces), a reference cycle through autograd's C++ nodes that Python's garbage
        collector cannot see; unbroken, every training step leaks the block's workspace."""
        self.scales, self.coefficients, self.recorded, self.replay = [], [], [], None
        self.tensor = self.shift = self.token = None

    def add_piece(self, scale: Tensor, coefficient: Tensor) -> None:
        """One product's share of ``d/d[c, c^2]``: ``scale`` ``(N, j)`` times ``coefficient`` ``(N, 2h)``."""
        self.scales.append(scale)
        self.coefficients.append(coefficient)

    def votes_gradient(self, votes: Tensor, out: Tensor) -> None:
        """Write ``d/dV`` ``(n, i, j, h)`` into ``out`` from the recorded pieces.

        ``d/dc = sum_k P_k Q1_k`` and ``d/d(c^2) = sum_k P_k Q2_k`` over the products ``k``; with
        ``c = V - m``: ``d/dV = sum_k P_k Q1_k + 2 c sum_k P_k Q2_k``, two batched products in the
        votes' own layout and one ``addcmul`` (no transposing copy). Formed from ``c``, not as
        ``sum_k P_k (Q1_k - 2 m Q2_k) + 2 V sum_k P_k Q2_k``: those two terms are about
        ``|m| / |c|`` times the result and cancelled (1e-2 relative error in float32 for poses
        at 1e3 in a cluster of spread 0.1).
        """
        n, receivers, senders, pose_dim = self.shape
        # (N, j, K) as a transposed view of (N, K, j): MKL's fast path for a small inner K
        scales = torch.stack(self.scales, dim=1).transpose(1, 2)
        coefficients = torch.stack(self.coefficients, dim=1)  # (N, K, 2h): [Q1, Q2]
        first, second = coefficients[..., :pose_dim], coefficients[..., pose_dim:]
        shift = self.shift.unsqueeze(2)  # (n, i, 1, h)
        size = out.numel()  # the statistics are no longer needed: their buffer holds the pieces
        linear = self.tensor.view(-1)[:size].view(n * receivers, senders, pose_dim)
        quadratic = self.tensor.view(-1)[size:].view(n * receivers, senders, pose_dim)
        torch.bmm(scales, first, out=linear)
        torch.bmm(scales, second, out=quadratic)
        linear, quadratic = linear.view(out.shape), quadratic.view(out.shape)  # (n, i, j, h)
        if out.dtype == linear.dtype:  # c formed in out itself, then out = linear + 2 c quadratic
            torch.sub(votes, shift, out=out)
            torch.addcmul(linear, out, quadratic, value=2.0, out=out)
        else:  # half votes: c in the statistics' dtype, in the copy that casts the votes
            torch.addcmul(linear, votes.to(linear.dtype).sub_(shift), quadratic, value=2.0, out=out)


class _StatisticsSum(torch.autograd.Function):
    """``(N, j)`` weights -> ``(N, 2h)`` ``[sum_j w c, sum_j w c^2]``."""

    @staticmethod
    def forward(ctx: FunctionCtx, weights: Tensor, token: Tensor, stats: _BlockStatistics) -> Tensor:
        ctx.save_for_backward(weights)
        ctx.stats = stats
        return stats.product(lambda: torch.bmm(weights.unsqueeze(1), stats.tensor).squeeze(1))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        (weights,) = ctx.saved_tensors
        # the vector as (N, 2h, 1) with strides (2h, 1, 2h): MKL's fast matrix-vector path
        grad_weights = torch.bmm(ctx.stats.tensor, grad.unsqueeze(1).transpose(1, 2)).squeeze(-1)  # (N, j)
        if ctx.needs_input_grad[1]:
            ctx.stats.add_piece(weights, grad)
        return grad_weights, None, None


class _StatisticsDot(torch.autograd.Function):
    """``(N, 2h)`` queries ``[q1, q2]`` -> ``(N, j)`` ``c . q1 + c^2 . q2``."""

    @staticmethod
    def forward(ctx: FunctionCtx, queries: Tensor, token: Tensor, stats: _BlockStatistics) -> Tensor:
        ctx.save_for_backward(queries)
        ctx.stats = stats
        column = queries.unsqueeze(1).transpose(1, 2)  # (N, 2h, 1)
        return stats.product(lambda: torch.bmm(stats.tensor, column).squeeze(-1))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        (queries,) = ctx.saved_tensors
        grad_queries = torch.bmm(grad.unsqueeze(1), ctx.stats.tensor).squeeze(1)  # (N, 2h)
        if ctx.needs_input_grad[1]:
            ctx.stats.add_piece(grad, queries)
        return grad_queries, None, None


class _VotesByInput(torch.autograd.Function):
    """``out[n, j] = left[j, n] @ right[j]``: a batched matrix product over ``j`` whose result is
    written ``n``-major (the routing reads it per row ``n``) without a transposing copy."""

    @staticmethod
    def forward(ctx: FunctionCtx, left: Tensor, right: Tensor) -> Tensor:  # (j, n, k), (j, k, c) -> (n, j, c)
        ctx.save_for_backward(left, right)
        if torch.compiler.is_compiling():  # an out= of other strides is a graph break: let it lay out
            return torch.bmm(left, right).transpose(0, 1)  # (n, j, c)
        out = left.new_empty(left.shape[1], left.shape[0], right.shape[-1])
        torch.bmm(left, right, out=out.transpose(0, 1))
        return out

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        left, right = ctx.saved_tensors
        per_input = grad.transpose(0, 1)  # (j, n, c)
        grad_left = torch.bmm(per_input, right.transpose(1, 2)) if ctx.needs_input_grad[0] else None
        grad_right = torch.bmm(left.transpose(1, 2), per_input) if ctx.needs_input_grad[1] else None
        return grad_left, grad_right


@dataclass(frozen=True)
class PerSenderVotes:
    """Votes cast by one linear map per sender, not yet formed:
    ``V[n, i, j, :] = (left[j, n] @ right[j])[i h : (i + 1) h]`` for a row ``n`` (of
    ``batch_shape``, flattened), receiver ``i``, sender ``j``.

    ``ConvMatrixCapsules`` casts its votes this way (a patch's pose times the block-diagonal
    ``I kron W_ji``). The ``"blocked"`` strategy forms them one block of rows at a time, in a
    buffer it reuses, and turns each block's votes gradient into the factors' gradients at once:
    neither the votes (680 MB at the paper's ConvCaps1 size, batch 32) nor their gradient ever
    exist whole. The other strategies route :meth:`materialize`.

    Attributes:
        left: ``(j, n, k)``.
        right: ``(j, k, i * h)``.
        batch_shape: the shape of the rows, ``n`` = its product.
        receivers: ``i``.
    """

    left: Tensor
    right: Tensor
    batch_shape: tuple[int, ...]
    receivers: int

    @property
    def shape(self) -> torch.Size:
        """``(batch..., i, j, h)``: the votes' shape."""
        senders, width = self.left.shape[0], self.right.shape[-1]
        return torch.Size((*self.batch_shape, self.receivers, senders, width // self.receivers))

    @property
    def dtype(self) -> torch.dtype:
        return torch.promote_types(self.left.dtype, self.right.dtype)

    @property
    def device(self) -> torch.device:
        return self.left.device

    def materialize(self) -> Tensor:
        """The votes ``(batch..., i, j, h)``: a receivers-first view of ``(n, j, i * h)`` memory."""
        *batch, receivers, senders, pose_dim = self.shape
        if plain_ops_required(self.left, self.right):  # the Function's out= product does not transform
            votes = torch.bmm(self.left, self.right).transpose(0, 1)  # (n, j, i*h)
        else:
            votes = _VotesByInput.apply(self.left, self.right)  # (n, j, i*h)
        return votes.view(*batch, senders, receivers, pose_dim).transpose(-3, -2)

    def flattened(self) -> PerSenderVotes:
        """The same votes with one batch axis ``(n,)``."""
        return PerSenderVotes(self.left, self.right, (self.left.shape[1],), self.receivers)


class _VoteBlocks:
    """The votes of a block of rows for the blocked strategy, in ``(rows, i, j, h)`` (any strides),
    with the buffers every block reuses (a fresh one per block pays its page faults again).

    Formed votes are sliced. With per-sender factors (``right`` given, ``votes`` is ``left``) each
    block is formed by one batched product into a buffer, and :meth:`gradient_view` gives the
    buffer its gradient is written to, in the factors' layout ``(j, rows, i h)``.
    """

    def __init__(self, votes: Tensor, right: Tensor | None, receivers: int, block_rows: int) -> None:
        self.votes, self.right, self.receivers = votes, right, receivers
        if right is None:
            self.rows, per_row, dtype = votes.shape[0], votes[0].numel(), votes.dtype
        else:
            (senders, self.rows, _), width = votes.shape, right.shape[-1]
            per_row, dtype = senders * width, torch.promote_types(votes.dtype, right.dtype)
            self.formed = torch.empty(block_rows * per_row, dtype=dtype, device=votes.device)
            self.gradient = torch.empty_like(self.formed)
        self.statistics = torch.empty(2 * block_rows * per_row, dtype=_compute_dtype(dtype),
                                      device=votes.device)

    def _layout(self, buffer: Tensor, rows: int) -> tuple[Tensor, Tensor]:
        """``buffer``'s first part as ``(j, rows, i h)`` and as its ``(rows, i, j, h)`` view."""
        senders, width = self.votes.shape[0], self.right.shape[-1]
        flat = buffer[: senders * rows * width].view(senders, rows, width)
        return flat, flat.view(senders, rows, self.receivers, -1).permute(1, 2, 0, 3)

    def __call__(self, block: slice) -> Tensor:
        """The votes of rows ``block``, ``(rows, i, j, h)``."""
        if self.right is None:
            return self.votes[block]
        left = self.votes[:, block]  # (j, rows, k)
        flat, votes = self._layout(self.formed, left.shape[1])
        torch.bmm(left, self.right, out=flat)
        return votes

    def gradient_view(self, rows: int) -> tuple[Tensor, Tensor]:
        """The gradient buffer as ``(j, rows, i h)`` and as ``(rows, i, j, h)`` (factors only)."""
        return self._layout(self.gradient, rows)


class _BlockedEM(torch.autograd.Function):
    """The blocked strategy: forward without autograd, backward by recomputing each block.

    ``votes`` are the formed votes ``(n, i, j, h)`` (``right`` is ``None``), or the ``left``
    factor ``(j, n, k)`` of :class:`PerSenderVotes` with ``right`` ``(j, k, i h)``.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, votes: Tensor, right: Tensor | None, activations: Tensor, beta_u: Tensor,
                beta_a: Tensor, config: _Config, block_rows: int) -> tuple[Tensor, ...]:
        ctx.save_for_backward(votes, right, activations, beta_u, beta_a)
        ctx.config, ctx.block_rows, ctx.device_type = config, block_rows, votes.device.type
        ctx.set_materialize_grads(False)
        blocks = _VoteBlocks(votes, right, beta_u.shape[1], block_rows)
        pieces, ctx.products = [], []
        for s in range(0, blocks.rows, block_rows):
            block = slice(s, s + block_rows)
            stats = _BlockStatistics(blocks(block), activations[block], config, blocks.statistics)
            pieces.append(_em_loop(stats, activations[block], beta_u[block], beta_a[block], config,
                                   min(block_rows, blocks.rows - s)))
            # (N, 2h) and (N, j) per product: 1 / (2h) of the votes' size per E-step
            ctx.products.append(stats.recorded)
            stats.release()
        return tuple(torch.cat([p[k] for p in pieces]) for k in range(len(pieces[0])))

    @staticmethod
    @refuse_double_backward(
        "em_routing(strategy='blocked') can be differentiated once only, one gradient at a time (its "
        "backward recomputes each block and is neither differentiable nor batchable); use EM's "
        "strategy='vectorized' for double backward (create_graph=True) and batched gradients "
        "(is_grads_batched=True, jacobian or hessian with vectorize=True): em_routing(..., "
        "strategy='vectorized'), EMRouter(strategy="
        "'vectorized'), or router_options={'strategy': 'vectorized'} of a capsule layer or model"
    )
    def backward(ctx: FunctionCtx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        with autocast_off(ctx.device_type):  # recompute as forward ran, whatever autocast is on now
            return _BlockedEM.recompute_backward(ctx, *grads)

    @staticmethod
    def recompute_backward(ctx: FunctionCtx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        """:meth:`backward` (autocast off): each block recomputed, its gradient written."""
        votes, right, *small = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        votes_needed = needs[0] or needs[1]  # the votes' gradient, or the factors' it feeds
        if not any(needs) or all(g is None for g in grads):
            return None, None, None, None, None, None, None
        results = [torch.zeros(x.shape, dtype=x.dtype, device=x.device) if need else None
                   for x, need in zip(small, needs[2:], strict=True)]
        if right is None:
            # every block writes its rows of the votes' gradient (or zeroes them), in the votes'
            # own memory layout: formed as a view of another layout, they get their gradient back
            # without a transposing copy
            grad_votes = torch.empty_like(votes) if needs[0] else None
            grad_right = None
        else:  # the factors' gradients, accumulated block by block
            grad_votes = torch.zeros_like(votes) if needs[0] else None
            grad_right = torch.zeros_like(right) if needs[1] else None
        block_rows = ctx.block_rows
        blocks = _VoteBlocks(votes, right, small[1].shape[1], block_rows)
        for index, s in enumerate(range(0, blocks.rows, block_rows)):
            block, rows = slice(s, s + block_rows), min(block_rows, blocks.rows - s)
            block_votes = blocks(block)  # (rows, i, j, h)
            stats = _BlockStatistics(block_votes, small[0][block], ctx.config, blocks.statistics,
                                     list(ctx.products[index]))
            with torch.enable_grad():
                stats.token.requires_grad_(votes_needed)
                inputs = [x[block].detach().requires_grad_(need)
                          for x, need in zip(small, needs[2:], strict=True)]
                outputs = _em_loop(stats, *inputs, ctx.config, rows)
                pairs = [(o, g[block]) for o, g in zip(outputs, grads, strict=True)
                         if g is not None and o.requires_grad]  # the initial R is a constant
                wanted = [x for x in [stats.token, *inputs] if x.requires_grad]
                found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                                 allow_unused=True) if pairs else [None] * len(wanted))
            if votes_needed:
                next(found)
                if right is None:
                    if stats.scales:
                        stats.votes_gradient(block_votes, out=grad_votes[block])
                    else:
                        grad_votes[block].zero_()
                elif stats.scales:
                    flat, view = blocks.gradient_view(rows)  # (j, rows, i h), (rows, i, j, h)
                    stats.votes_gradient(block_votes, out=view)
                    if needs[0]:  # d left[j, n] = dV[n, :, j] right[j]^T
                        grad_votes[:, block] = torch.bmm(flat, right.transpose(1, 2))
                    if needs[1]:  # d right[j] += left[j, n]^T dV[n, :, j]
                        grad_right.baddbmm_(votes[:, block].transpose(1, 2), flat)
            stats.release()
            for result, need in zip(results, needs[2:], strict=True):
                if need:
                    piece = next(found)
                    if piece is not None:
                        result[block] = piece
        return grad_votes, grad_right, *results, None, None


# torch's own lazy form of torch.compiler.disable: that imports dynamo (and inductor) when the
# decorator runs, 2-3 s of `import torchvote.nn` on a CPU; this one at the first call
@torch._disable_dynamo
def _blocked_em(*args: object) -> tuple[Tensor, ...]:
    """:class:`_BlockedEM` applied, always eagerly: under ``torch.compile`` one call between two
    graphs (one graph break, by design). Its reused buffers and ``out=`` products into strided
    views are what keep its memory low, and they do not trace: followed by dynamo they broke the
    graph a dozen times. ``"auto"`` gives the compiler the vectorized loop instead."""
    return _BlockedEM.apply(*args)


_COMPILED = {}


def _fused_loop(votes: Tensor, activations: Tensor, beta_u: Tensor, beta_a: Tensor, config: _Config,
                rows: int) -> tuple[Tensor, ...]:
    return _em_loop(_DenseStatistics(votes, activations, config, fused=True), activations, beta_u, beta_a,
                    config, rows)


# Compilations of the loop kept per process: one per shape of its inputs (every block shape of every
# layer, with and without gradient); dynamo's default of 8 would run a model's later layers eagerly.
_RECOMPILE_LIMIT = 64


def _compiled_loop() -> Callable[..., tuple[Tensor, ...]]:
    """``torch.compile`` of the whole loop (statistics included), made once per process, called
    with dynamo's recompilation limit raised to :data:`_RECOMPILE_LIMIT` and without donated
    buffers (so that gradients can be taken in any order, with ``retain_graph=True``)."""
    if "loop" not in _COMPILED:
        from torch._dynamo import config as dynamo_config
        from torch._functorch import config as functorch_config

        compiled = torch.compile(_fused_loop, dynamic=False)

        def call(*args: object) -> tuple[Tensor, ...]:
            if torch.compiler.is_compiling():  # a caller's trace: the loop goes into its graph
                return _fused_loop(*args)
            # donated buffers (backward reusing the saved tensors' memory) would refuse a second
            # backward through the graph (retain_graph=True), which every strategy allows
            with (dynamo_config.patch(recompile_limit=_RECOMPILE_LIMIT),
                  functorch_config.patch(donated_buffer=False)):
                return compiled(*args)

        _COMPILED["loop"] = call
    return _COMPILED["loop"]


class _Recipe(NamedTuple):
    """How to form a saved tensor again: ``form(*sources)``, with the sources' versions when saved
    and the dtype and shape it had."""

    form: Callable[..., Tensor]
    sources: tuple[Tensor, ...]
    versions: tuple[int, ...]
    dtype: torch.dtype
    shape: torch.Size


class _Kept(NamedTuple):
    """A saved tensor kept as it is (detached: an output saved by its own operation would otherwise
    hold its graph in a reference cycle) and its version when saved."""

    tensor: Tensor
    version: int


_MODIFIED = ("one of the variables needed for gradient computation has been modified by an inplace "
             "operation after the forward pass of em_routing(strategy='compiled')")


def _callers_hooks_may_be_active() -> bool:
    """Whether a caller's saved-tensor hooks are active, or this torch cannot tell: it has no
    ``_top_saved_tensors_default_hooks`` (2.7.1 does not) or one that takes other arguments."""
    query = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return query is None or query(False) is not None
    except TypeError:  # a private query: its signature may differ between releases
        return True


@contextlib.contextmanager
def _saved_as_recipe(tensor: Tensor, form: Callable[..., Tensor], *sources: Tensor) -> Iterator[None]:
    """While active, autograd keeps ``tensor`` (formed as ``form(*sources)``) for backward as that
    recipe and forms it again (without autocast) when backward needs it. Every other saved tensor is
    kept as it is, with the check autograd makes without hooks: backward raises if it was modified
    in place since. Not applied under a caller's saved-tensor hooks (activation checkpointing,
    offloading: theirs decide what is kept), where hooks are disabled, nor on a torch that cannot
    tell whether a caller's hooks are active (2.7.1 and older lack the query): there every saved
    tensor is kept as autograd keeps it, the formed votes included (more memory, same numbers).

    Raises (in backward):
        RuntimeError: a source of ``tensor``, or another saved tensor, was modified in place after
            the forward pass, as autograd raises for a saved tensor.
    """
    enabled = torch._C._autograd._saved_tensors_hooks_is_enabled()
    if not torch.is_grad_enabled() or not enabled or _callers_hooks_may_be_active():
        yield
        return

    kept = weakref.ref(tensor)  # autograd may keep the hooks as long as the graph: not the tensor

    def pack(saved: Tensor) -> _Kept | _Recipe:
        if saved is kept():  # the compiled graph saves its input itself, not an alias
            versions = tuple(source._version for source in sources)
            return _Recipe(form, sources, versions, saved.dtype, saved.shape)
        return _Kept(saved.detach(), saved._version)  # detach() shares the version counter

    def unpack(packed: _Kept | _Recipe) -> Tensor:
        if isinstance(packed, _Kept):
            if packed.tensor._version != packed.version:
                raise RuntimeError(_MODIFIED)
            return packed.tensor
        if any(source._version != version for source, version in zip(packed.sources, packed.versions,
                                                                       strict=True)):
            raise RuntimeError(f"{_MODIFIED} (a tensor its votes are formed from)")
        with torch.no_grad(), autocast_off(packed.sources[0].device.type):  # as in forward
            formed = packed.form(*packed.sources)
        if formed.dtype != packed.dtype or formed.shape != packed.shape:  # never: forward made it so
            raise RuntimeError(f"em_routing: votes formed again as {formed.dtype} {tuple(formed.shape)}, "
                               f"saved as {packed.dtype} {tuple(packed.shape)}")
        return formed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _formed_block(left: Tensor, right: Tensor, *, receivers: int) -> Tensor:
    """``(rows, i, j, h)`` contiguous votes of a block of :class:`PerSenderVotes`, from its factors
    ``left`` ``(j, rows, e)`` and ``right`` ``(j, e, i h)``, in one batched product."""
    senders, rows = left.shape[:2]
    formed = torch.bmm(left, right)  # (j, rows, i h)
    return formed.view(senders, rows, receivers, -1).permute(1, 2, 0, 3).contiguous()


def _compiled_blocks(votes: Tensor | PerSenderVotes, activations: Tensor, beta_u: Tensor, beta_a: Tensor,
                     config: _Config, block_rows: int) -> tuple[Tensor, ...]:
    """The compiled loop on blocks of ``block_rows`` rows (whole periods of ``sender_groups``), the
    ``"compiled"`` strategy on a CPU; plain autograd differentiates each block's compiled graph.

    A block's votes are made contiguous first (formed by one batched product if unformed): the
    compiled passes stream a contiguous block about 1.8x faster than the strided view of
    :class:`PerSenderVotes`. With gradients, each block's graph keeps a few ``(rows, i, j)`` tensors
    (Inductor recomputes the ``(rows, i, j, h)`` temporaries in backward) and its votes. Votes formed
    from :class:`PerSenderVotes`: the first :data:`_KEPT_VOTES_BYTES` as they are, later blocks as
    the product that formed them, formed again in backward (:func:`_saved_as_recipe`), so that
    memory stops growing with the batch past that budget (the paper's ConvCaps1 at batch 32 has
    680 MB of votes; at batch 128, 2.7 GB). Blocks of dense votes are views, or copies of strided
    votes kept as they are (forming them again would keep the caller's whole votes instead).
    """
    factored = isinstance(votes, PerSenderVotes)
    rows = votes.left.shape[1] if factored else votes.shape[0]
    # (j, rows, e) x (j, e, i h) -> (rows, i, j, h)
    form = functools.partial(_formed_block, receivers=votes.receivers) if factored else None
    loop, pieces, kept_bytes = _compiled_loop(), [], 0
    for start in range(0, rows, block_rows):
        block = slice(start, start + block_rows)
        kept = contextlib.nullcontext()
        if form is None:  # a view of contiguous votes, else a copy of strided ones (kept whole)
            block_votes = votes[block].contiguous()
        else:
            sources = (votes.left[:, block], votes.right)
            block_votes = form(*sources)
            kept_bytes += block_votes.numel() * block_votes.element_size()
            if kept_bytes > _KEPT_VOTES_BYTES:
                kept = _saved_as_recipe(block_votes, form, *sources)
        with kept:
            pieces.append(loop(block_votes, activations[block], beta_u[block], beta_a[block], config,
                               block_votes.shape[0]))
    return tuple(torch.cat([piece[k] for piece in pieces]) for k in range(len(pieces[0])))


def conv_sender_groups(
    rows: int,
    cols: int,
    in_types: int,
    kernel_size: int,
    stride: int,
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """Global input-capsule ids of every patch-local sender of a convolutional capsule layer.

    The patch ordering of :class:`torchvote.nn.em_capsules.ConvMatrixCapsules`: output positions
    ``L = rows' * cols'`` row-major, and within a patch the senders ``(kh kw t)`` (kernel row,
    kernel column, input type). The input capsule at grid cell ``(r, c)`` of type ``t`` has id
    ``(r * cols + c) * in_types + t``.

    Args:
        rows: input grid rows.
        cols: input grid columns.
        in_types: input capsule types.
        kernel_size: ``K``.
        stride: the convolution's stride.
        device: where the ids are made (the votes' device; default: PyTorch's default device).

    Returns:
        ``(L, K * K * in_types)`` int64 ids, for ``em_routing(sender_groups=...)``.

    Raises:
        ValueError: a non-positive size, or a grid smaller than the kernel.
    """
    for value, argument in ((rows, "rows"), (cols, "cols"), (in_types, "in_types"),
                            (kernel_size, "kernel_size"), (stride, "stride")):
        check_positive_int(value, argument)
    if rows < kernel_size or cols < kernel_size:
        raise ValueError(f"the grid {rows}x{cols} (rows, cols) is smaller than kernel_size={kernel_size}")
    out_rows, out_cols = (rows - kernel_size) // stride + 1, (cols - kernel_size) // stride + 1
    top = torch.arange(out_rows, device=device) * stride  # first input row of each output row
    left = torch.arange(out_cols, device=device) * stride
    offsets = torch.arange(kernel_size, device=device)
    cell_rows = (top[:, None] + offsets[None, :])[:, None, :, None]  # (rows', 1, kh, 1)
    cell_cols = (left[:, None] + offsets[None, :])[None, :, None, :]  # (1, cols', 1, kw)
    cells = cell_rows * cols + cell_cols  # (rows', cols', kh, kw)
    ids = cells.unsqueeze(-1) * in_types + torch.arange(in_types, device=device)  # (rows', cols', kh, kw, t)
    return ids.reshape(out_rows * out_cols, kernel_size * kernel_size * in_types)


class SenderGroups(NamedTuple):
    """``sender_groups`` prepared once, for a layer that routes on the same grid every call.

    :func:`prepare_sender_groups` makes it; ``em_routing(sender_groups=...)`` takes it in place of
    the ids and then reads nothing back from the device (preparing the ids needs two host reads:
    the check for negative ids and the size of ``torch.unique``; a GPU waits for both).

    Attributes:
        ids: ``(L, j)`` int64 compact ids in ``[0, count)``, on the votes' device.
        count: ``G``, the distinct ids of one period.
        patches: ``(L, j)`` float64: how many patches (rows of a period) hold each sender's id.
    """

    ids: Tensor
    count: int
    patches: Tensor


def prepare_sender_groups(sender_groups: Tensor, *, device: torch.device | str | None = None) -> SenderGroups:
    """Check and compact ``sender_groups`` ids once (see :func:`~torchvote.functional.em.em_routing`).

    The ids are read where they are (on a GPU: two synchronisations, for the check and the size
    of ``torch.unique``) and the results moved to ``device``: ids on the CPU cost an accelerator
    nothing, and serve votes on the ``"meta"`` device too.

    Args:
        sender_groups: ``(L, j)`` non-negative integer ids of the input capsule behind each
            patch-local sender (:func:`conv_sender_groups` makes them).
        device: where the prepared tensors live (the votes' device; default: the ids' device).

    Returns:
        A :class:`SenderGroups` for ``em_routing(sender_groups=...)``.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) not an int32 or int64 tensor.
        ValueError: not 2-D with at least one row, ids on the ``"meta"`` device (they have no
            values to read), or a negative id.
    """
    if not isinstance(sender_groups, Tensor) or sender_groups.dtype not in (torch.int32, torch.int64):
        described = (f"dtype {sender_groups.dtype}" if isinstance(sender_groups, Tensor)
                     else type(sender_groups).__name__)
        raise ArgumentTypeError(
            f"sender_groups must be a 2-D integer tensor (L, in_caps) of int32 or int64 ids, got {described}"
        )
    if sender_groups.dim() != 2 or sender_groups.shape[0] == 0:
        raise ValueError(
            f"sender_groups must be a 2-D integer tensor (L, in_caps) with L >= 1, got shape "
            f"{tuple(sender_groups.shape)}"
        )
    if sender_groups.is_meta:
        raise ValueError(
            "sender_groups on the meta device have no ids to check and compact; pass them on the CPU "
            "(they are moved to the votes' device)"
        )
    if (sender_groups < 0).any():
        raise ValueError("sender_groups must hold non-negative ids")
    device = sender_groups.device if device is None else torch.device(device)
    unique, compact = torch.unique(sender_groups.to(torch.int64), return_inverse=True)  # where the ids are
    counts = torch.bincount(compact.reshape(-1), minlength=unique.numel())  # patches holding each id
    patches = counts[compact].to(torch.float64)
    return SenderGroups(compact.to(device), unique.numel(), patches.to(device))


def _windows_per_cell(size: int, kernel_size: int, stride: int, device: torch.device | str | None
                      ) -> tuple[Tensor, Tensor, int]:
    """Along one axis of ``size`` cells cut into windows of ``kernel_size`` every ``stride``:
    how many windows hold each cell ``(size,)``, each held cell's rank among the held cells
    ``(size,)``, and how many cells are held (a stride above the kernel skips cells)."""
    windows = (size - kernel_size) // stride + 1
    starts = torch.arange(windows, device=device).unsqueeze(1) * stride  # (windows, 1)
    cells = torch.arange(size, device=device)  # (size,)
    holding = ((cells >= starts) & (cells < starts + kernel_size)).sum(0)  # (size,)
    rank = torch.cumsum(holding > 0, 0) - 1  # (size,)
    return holding, rank, (windows - 1) * min(stride, kernel_size) + kernel_size


def prepared_conv_sender_groups(
    rows: int,
    cols: int,
    in_types: int,
    kernel_size: int,
    stride: int,
    *,
    device: torch.device | str | None = None,
) -> SenderGroups:
    """``prepare_sender_groups(conv_sender_groups(...))``, computed from the sizes alone.

    :func:`prepare_sender_groups` reads the ids (a check and the size of ``torch.unique``); here
    the compact ids and the patch counts of a convolution's ids follow from the geometry: an input
    capsule is held by a patch when its row and its column are, so the held capsules are the
    held rows x held columns x types, numbered in the order of their global ids. Nothing is read
    back: on a GPU nothing waits, and under ``torch.compile`` it traces into the graph (the
    check and ``torch.unique`` are graph breaks).

    Args:
        rows, cols, in_types, kernel_size, stride: as :func:`conv_sender_groups`.
        device: where the prepared tensors are made (the votes' device).

    Returns:
        The :class:`SenderGroups` of :func:`conv_sender_groups`'s ids.

    Raises:
        ValueError: as :func:`conv_sender_groups`.
    """
    ids = conv_sender_groups(rows, cols, in_types, kernel_size, stride, device=device)  # (L, j)
    cell, kind = ids // in_types, ids % in_types  # (L, j) each: grid cell r * cols + c, type t
    row_holding, row_rank, held_rows = _windows_per_cell(rows, kernel_size, stride, device)
    col_holding, col_rank, held_cols = _windows_per_cell(cols, kernel_size, stride, device)
    row, col = cell // cols, cell % cols  # (L, j) each
    compact = (row_rank[row] * held_cols + col_rank[col]) * in_types + kind  # (L, j)
    patches = (row_holding[row] * col_holding[col]).to(torch.float64)  # (L, j)
    return SenderGroups(compact, held_rows * held_cols * in_types, patches)


def _prepare_groups(sender_groups: Tensor | SenderGroups, rows: int, senders: int, receivers: int,
                    device: torch.device) -> tuple[Tensor, int, Tensor]:
    """Compact ids ``(L, j)``, their count ``G`` and the initial assignments ``(L, 1, j)``."""
    if not isinstance(sender_groups, SenderGroups):
        sender_groups = prepare_sender_groups(sender_groups, device=device)
    ids, count, patches = sender_groups
    if ids.shape[1] != senders or rows % ids.shape[0] != 0:
        raise ValueError(
            f"sender_groups must be an integer tensor of shape (L, in_caps={senders}) with L dividing "
            f"the {rows} rows of votes, got {tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"sender_groups were prepared on {ids.device}, the votes are on {device}")
    # R_ij = 1 / |parents of j|: the parents are every receiver of every patch that holds j.
    initial = 1.0 / (receivers * patches)
    return ids, count, initial.unsqueeze(1)


def route(
    votes: Tensor | PerSenderVotes,
    activations: Tensor,
    beta_u: Tensor,
    beta_a: Tensor,
    *,
    schedule: Sequence[float],
    eps: float,
    sender_groups: Tensor | SenderGroups | None,
    strategy: EMStrategy,
    return_assignments: bool,
    all_passes: bool,
) -> tuple[Tensor, ...]:
    """Procedure 1 on checked, flattened inputs (see :func:`torchvote.functional.em.em_routing`,
    which validates everything but ``sender_groups`` and calls this).

    Args:
        votes: ``(n, i, j, h)``, or :class:`PerSenderVotes` of that shape (formed block by block
            by ``"blocked"``, materialised for the other strategies).
        activations: ``(n, j)``.
        beta_u: ``(n, i)`` (an expanded view is fine).
        beta_a: ``(n, i)``.
        schedule: ``lambda_t`` per iteration, at least one.
        eps: the variance floor.
        sender_groups: ``None``, ``(L, j)`` integer ids (``L`` dividing ``n``) or their
            :class:`SenderGroups`.
        strategy: one of :data:`EMStrategy`.
        return_assignments: also return ``R``.
        all_passes: ``R`` of every M-step, stacked.

    Returns:
        poses ``(n, i, h)`` and activations ``(n, i)`` in the votes' dtype, then (with
        ``return_assignments``) ``R`` ``(n, i, j)`` or ``(iterations, n, i, j)``, also in it.

    Raises:
        ValueError: malformed ``sender_groups``.
    """
    rows, receivers, senders, pose_dim = votes.shape
    factored = isinstance(votes, PerSenderVotes)
    groups, num_groups, initial = None, 0, None
    if sender_groups is not None:
        groups, num_groups, initial = _prepare_groups(sender_groups, rows, senders, receivers, votes.device)
    config = _Config(tuple(schedule), eps, groups, num_groups, initial, bool(return_assignments),
                     bool(return_assignments and all_passes))
    factors = (votes.left, votes.right) if factored else (votes,)
    transformed = plain_ops_required(*factors, activations, beta_u, beta_a)
    if strategy == "auto":  # the blocked kernel's out= products and reused buffers do not trace
        vectorized = votes.device.type == "cuda" or torch.compiler.is_compiling() or transformed
        strategy = "vectorized" if vectorized else "blocked"
    elif strategy == "blocked" and transformed:
        raise RuntimeError(
            "em_routing(strategy='blocked') does not run under torch.func transforms (vmap, grad, "
            "jacrev, jvp, ...), forward-mode AD or torch.export: its autograd Function writes into "
            "reused buffers; "
            "use strategy='vectorized' (or 'auto', which picks it there), the same numbers")
    if factored and votes.left.dtype != votes.right.dtype:  # (under autocast) one dtype for the products
        votes = PerSenderVotes(votes.left.to(votes.dtype), votes.right.to(votes.dtype), votes.batch_shape,
                               votes.receivers)
    # compiled on a CPU: block by block (not while a caller's torch.compile traces, which takes the
    # whole loop into its graph, nor under transforms)
    compiled_blocks = (strategy == "compiled" and votes.device.type == "cpu" and not transformed
                       and not torch.compiler.is_compiling())
    with autocast_off(votes.device.type):  # float32 statistics, products in their inputs' dtype
        if strategy == "blocked" or compiled_blocks:  # blocks of whole periods; votes formed per block
            period = 1 if groups is None else groups.shape[0]
            per_row = receivers * senders * pose_dim
            target = _COMPILED_BLOCK_ELEMENTS if compiled_blocks else _BLOCK_ELEMENTS
            block_rows = min(rows, period * max(1, target // (per_row * period)))
            if compiled_blocks:
                outputs = _compiled_blocks(votes, activations, beta_u, beta_a, config, block_rows)
            else:
                left, right = (votes.left, votes.right) if factored else (votes, None)
                outputs = _blocked_em(left, right, activations, beta_u, beta_a, config, block_rows)
        else:  # every row at once, on materialised votes
            if factored:
                votes = votes.materialize()  # (n, i, j, h)
            if strategy == "compiled":
                outputs = _compiled_loop()(votes, activations, beta_u, beta_a, config, rows)
            else:
                outputs = _em_loop(_DenseStatistics(votes, activations, config), activations, beta_u, beta_a,
                                   config, rows)
    poses, out_activations = outputs[0].to(votes.dtype), torch.sigmoid(outputs[1]).to(votes.dtype)
    if not return_assignments:
        return poses, out_activations
    assignments = torch.stack(outputs[2:]) if all_passes else outputs[2]
    return poses, out_activations, assignments.to(votes.dtype)
