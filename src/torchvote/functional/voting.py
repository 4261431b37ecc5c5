"""The voting operator: attention and capsule routing as one loop.

Every method in torchvote is weighted voting that reaches a consensus:

1. senders cast **votes** (projections of their inputs),
2. the votes are **scored** for agreement, giving logits,
3. the logits are **normalised** into weights,
4. the weighted votes are **aggregated** (summed or averaged) per receiver,
5. the result optionally goes through a **nonlinearity** (squash, layer norm, a GRU, ...),
6. and the loop may run again, the agreement of each vote with the new outputs updating the
   logits (one pass: attention; r passes: dynamic routing, EM routing, slot attention).

Index legend, used by the operator's einsums and the attention and routing code built on it::

    b  batch                 h  heads (or capsule-type groups)
    i  receivers             (queries, output capsules, slots)
    j  senders               (keys, input capsules, pixels)
    d  features              (value / pose dimensions)

EM routing's kernel (``functional/em_kernel.py``) and the matrix-capsule layers keep the letters of
their own loops (``h`` pose entries, ``L`` patch positions), each said in its own legend.

Weights always have shape ``(..., i, j)``. **The one axis choice that separates attention from
routing:** ``normalize_over="senders"`` applies the softmax over ``j`` (every receiver distributes
one unit of attention over the senders: attention, top-down); ``normalize_over="receivers"``
applies it over ``i`` (every sender distributes one unit of vote over the receivers: capsule
routing, bottom-up). See docs/voting.md for the mapping of every method onto this operator.

(Over 400 lines: the operator, the vote representations its loop reads and the protocol they
follow are read together; the mask preparation leaves for ``functional/masks.py``, issue 7.)
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, get_args

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchvote.functional.masks import (
    check_mask_dtype,
    fused_kernel_mask,
    open_rows_without_senders,
    voting_mask,
)
from torchvote.functional.nonlinearities import _squash
from torchvote.functional.scores import default_scale
from torchvote.tracing import under_autograd_transforms, under_vmap
from torchvote.validation import (
    autocast_available,
    autocast_enabled,
    broadcast_shape,
    check_choice,
    check_device,
    check_dim,
    check_flag,
    check_input_dtype,
    check_positive_int,
    check_probability,
    check_scale,
    check_tensor_values,
    computes_in_float16,
)

__all__ = [
    "NormalizeOver",
    "Update",
    "Votes",
    "SharedVotes",
    "PairwiseVotes",
    "DotProductScores",
    "VotingState",
    "VoteResult",
    "masked_softmax",
    "vote",
]

_T = TypeVar("_T")
NormalizeOver = Literal["senders", "receivers"]
#: How the agreement of one pass becomes the next pass's logits (see :func:`vote`).
Update = Literal["accumulate", "replace", "prior"]
_UPDATES = get_args(Update)


class Votes(Protocol):
    """What the voting loop needs from a set of votes.

    A vote representation only has to know how to form the weighted sum of its votes and how to
    score its votes against the receivers' outputs. This is what lets attention (one value per
    sender, shared by every receiver) and routing (one vote per sender-receiver pair) run through
    the same loop, and what lets a capsule layer avoid materialising its votes at all.
    """

    def weighted_sum(self, weights: Tensor) -> Tensor:
        """``(..., i, j)`` weights -> ``(..., i, d)`` sum over senders of weight * vote."""
        ...

    def dot(self, outputs: Tensor) -> Tensor:
        """``(..., i, d)`` outputs -> ``(..., i, j)`` dot product of every vote with its receiver,
        never in float16 (its products pass 65504 once 16-D entries pass about 64): in float32
        where float16 would compute it; bfloat16, with float32's range, stays bfloat16."""
        ...

    def squared_norm(self) -> Tensor:
        """Squared length of every vote, broadcastable to ``(..., i, j)``, in at least float32
        (half-precision votes' squared lengths pass float16's 65504 once entries pass 64)."""
        ...

    def detach(self) -> Votes:
        """The same votes cut from the autograd graph."""
        ...

    def zero_logits(self) -> Tensor:
        """``(..., i, j)`` zeros in the votes' device and dtype: routing's uniform start
        ``b_ij = 0``. Votes that do not know their receiver count raise ``ValueError``."""
        ...

    def materialize(self) -> Tensor:
        """The votes as a tensor ``(..., i, j, d)`` (broadcastable), for methods that need them
        elementwise (EM routing)."""
        ...

    @property
    def dtype(self) -> torch.dtype: ...


@dataclass(frozen=True)
class SharedVotes:
    """Votes that every receiver sees alike: attention's values.

    Args:
        values: ``(..., j, d)``: sender ``j`` proposes ``values[..., j, :]`` to every receiver.
    """

    values: Tensor

    def weighted_sum(self, weights: Tensor) -> Tensor:
        return torch.einsum("...ij,...jd->...id", weights, self.values)

    def dot(self, outputs: Tensor) -> Tensor:
        return _einsum_without_float16("...jd,...id->...ij", self.values, outputs)

    def squared_norm(self) -> Tensor:
        return _upcast(self.values).pow(2).sum(-1).unsqueeze(-2)  # (..., 1, j)

    def detach(self) -> SharedVotes:
        return SharedVotes(self.values.detach())

    def zero_logits(self) -> Tensor:
        raise ValueError(
            "logits=None (uniform start) needs PairwiseVotes; shared votes need logits, since the "
            "receiver count comes from them"
        )

    def materialize(self) -> Tensor:
        """``(..., 1, j, d)``: every receiver's votes, broadcast (a view, no copy)."""
        return self.values.unsqueeze(-3)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device


@dataclass(frozen=True)
class PairwiseVotes:
    """One vote per (receiver, sender) pair: capsule routing's predictions u_hat_{j|i}.

    Args:
        votes: ``(..., i, j, d)``: sender ``j``'s prediction for receiver ``i``. (Capsule papers
            index inputs by ``i`` and outputs by ``j``; here ``i`` is always the receiver.)
    """

    votes: Tensor

    def weighted_sum(self, weights: Tensor) -> Tensor:
        return torch.einsum("...ij,...ijd->...id", weights, self.votes)

    def dot(self, outputs: Tensor) -> Tensor:
        return _einsum_without_float16("...ijd,...id->...ij", self.votes, outputs)

    def squared_norm(self) -> Tensor:
        return _upcast(self.votes).pow(2).sum(-1)  # (..., i, j)

    def detach(self) -> PairwiseVotes:
        return PairwiseVotes(self.votes.detach())

    def zero_logits(self) -> Tensor:
        return self.votes.new_zeros(self.votes.shape[:-1])

    def materialize(self) -> Tensor:
        return self.votes

    @property
    def dtype(self) -> torch.dtype:
        return self.votes.dtype

    @property
    def device(self) -> torch.device:
        return self.votes.device


@dataclass(frozen=True)
class DotProductScores:
    """Lazy attention logits ``scale * q k^T``, kept factored so a fused kernel can take them.

    Args:
        queries: ``(..., i, e)``.
        keys: ``(..., j, e)``.
        scale: multiplies the dot products; ``None`` means ``1 / sqrt(e)`` (Vaswani et al. 2017,
            eq. 1).

    Raises:
        TypeError: queries or keys that are not floating-point tensors.
        ValueError: queries or keys of fewer than 2 axes, or of different feature sizes ``e``
            (checked here: :meth:`materialize` failed inside ``einsum``, naming neither).
    """

    queries: Tensor
    keys: Tensor
    scale: float | None = None

    def __post_init__(self) -> None:
        for name, tensor in (("queries", self.queries), ("keys", self.keys)):
            if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
                described = tensor.dtype if isinstance(tensor, Tensor) else type(tensor).__name__
                raise TypeError(f"DotProductScores {name} must be a floating-point tensor, got {described}")
            if tensor.dim() < 2:
                raise ValueError(f"DotProductScores {name} must have shape (..., length, features), got "
                                 f"{tuple(tensor.shape)}")
        query_shape, key_shape = self.queries.shape, self.keys.shape  # each read once: torch.Size costs
        if query_shape[-1] != key_shape[-1]:
            raise ValueError(
                f"DotProductScores queries and keys must share their feature size, got shapes "
                f"{tuple(query_shape)} and {tuple(key_shape)}"
            )

    @property
    def effective_scale(self) -> float:
        return self.scale if self.scale is not None else default_scale(self.queries.shape[-1])

    def materialize(self) -> Tensor:
        """The ``(..., i, j)`` logits, computed in at least float32 so half inputs cannot overflow
        (with autocast off: under ``torch.autocast`` the product would be float16 again)."""
        return _einsum_at_least_float32("...ie,...je->...ij", self.queries, self.keys) * self.effective_scale


Logits = Tensor | DotProductScores


@dataclass
class VotingState:
    """What an agreement function sees after each pass of the loop.

    Attributes:
        votes: the votes (possibly detached, see ``detach_votes``).
        outputs: ``(..., i, d)`` receivers' outputs after the nonlinearity.
        aggregated: ``(..., i, d)`` receivers' outputs before the nonlinearity.
        weights: ``(..., i, j)`` the normalised weights of this pass.
        vote_weights: ``(..., i, j)`` the weights the votes were aggregated with (``weights``
            times the sender weights, if any).
        logits: ``(..., i, j)`` the logits of this pass.
        initial_logits: ``(..., i, j)`` the logits the loop started from (a prior).
        iteration: 0-based index of this pass.
    """

    votes: Votes
    outputs: Tensor
    aggregated: Tensor
    weights: Tensor
    vote_weights: Tensor
    logits: Tensor
    initial_logits: Tensor
    iteration: int


AgreementFn = Callable[[VotingState], Tensor]
NonlinearityFn = Callable[[Tensor, Tensor | None], Tensor]


@dataclass
class VoteResult:
    """The consensus and, on request, how it was reached.

    Attributes:
        outputs: ``(..., i, d)``.
        weights: per pass, the ``(..., i, j)`` normalised weights (empty unless recorded).
        logits: per pass, the ``(..., i, j)`` logits before normalisation (empty unless recorded).
    """

    outputs: Tensor
    weights: list[Tensor] = field(default_factory=list)
    logits: list[Tensor] = field(default_factory=list)


def _upcast(x: Tensor) -> Tensor:
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _einsum_at_least_float32(equation: str, *operands: Tensor) -> Tensor:
    """``torch.einsum`` of half operands upcast to float32, with autocast off (under
    ``torch.autocast`` the product would be float16 again), the result in that dtype: for the
    reductions whose sums pass float16's 65504 (dot products of votes, attention logits). Operands
    of different dtypes (under autocast) meet in their promoted dtype."""
    upcast = [_upcast(x) for x in operands]
    dtype = upcast[0].dtype
    for x in upcast[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    with autocast_off(upcast[0].device.type):
        return torch.einsum(equation, *(x.to(dtype) for x in upcast))


def _einsum_without_float16(equation: str, *operands: Tensor) -> Tensor:
    """``torch.einsum``, but in float32 where it would compute in float16 (a float16 operand, or
    float16 autocast on the device), whose results pass 65504: the dot products of votes
    (:meth:`Votes.dot`). bfloat16 has float32's range: it computes as before, without the float32
    copies (twice the votes' bytes, kept for backward) that :func:`_einsum_at_least_float32` makes."""
    if computes_in_float16(*operands):
        return _einsum_at_least_float32(equation, *operands)
    return torch.einsum(equation, *operands)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context in which ``torch.autocast`` is off for ``device_type``.

    For the products that must run in the dtype they are given: float32 statistics of half
    inputs (attention logits, EM's vote statistics) and the ``out=`` kernels of the capsule votes,
    which autocast would otherwise compute in float16 or bfloat16 (float16 logits overflow past
    65504; an ``out=`` tensor of another dtype is refused). Where autocast does not exist for the
    device (``"meta"``, on which entering ``torch.autocast`` raises) there is nothing to turn off
    and the context does nothing.

    Args:
        device_type: the ``device.type`` of the tensors computed on, e.g. ``"cuda"``.

    Returns:
        A context manager.
    """
    if autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def routed_in_dtype(dtype: torch.dtype, *results: Tensor | None) -> tuple[Tensor | None, ...]:
    """Routing's results in ``dtype``, the one the same call has without ``torch.autocast``.

    Routing is a normalisation, as softmax and layer norm are, which CUDA autocast computes in
    float32 (its "float32 list"): every routing function, router and capsule layer returns its outputs,
    couplings and activations in the votes' dtype (a layer's: the promotion of its inputs' and
    parameters'), whatever the router and the strategy, where the weighted sums or the
    materialised votes ran in autocast's dtype. Only these small results are cast, only under
    autocast and only where one differs; ``None`` entries (no activations) pass through.

    Args:
        dtype: the dtype of the call without autocast.
        *results: the tensors to return (or ``None``).

    Returns:
        ``results``, each in ``dtype``.
    """
    present = [tensor for tensor in results if tensor is not None]
    if all(tensor.dtype == dtype for tensor in present) or not autocast_enabled(present[0].device.type):
        return results
    return tuple(None if tensor is None else tensor.to(dtype) for tensor in results)


def refuse_double_backward(message: str) -> Callable[[Callable[..., _T]], Callable[..., _T]]:
    """Decorate a custom autograd backward that is neither differentiable nor batchable so that it
    raises ``RuntimeError(message)`` at once where it is asked to be either.

    - A backward asked for a graph of its own (``create_graph=True``: a gradient penalty, a second
      derivative): under ``once_differentiable`` alone the first derivative came back silently
      detached, and the second failed later with autograd's "appears to not have been used in the
      graph".
    - A backward run under ``vmap`` (batched gradients: ``torch.autograd.grad(...,
      is_grads_batched=True)``, ``torch.autograd.functional.jacobian`` or ``hessian`` with
      ``vectorize=True``): the forward ran unbatched, on the kernels, so only the backward sees
      the transform, and its ``out=`` products failed deep inside with "Batching rule not
      implemented".

    Not checked while ``torch.compile`` traces the backward (it decides its own grad mode there).

    Args:
        message: what cannot be differentiated twice or in batches, and what to use instead.

    Returns:
        The decorator.
    """

    def decorate(backward: Callable[..., _T]) -> Callable[..., _T]:
        @functools.wraps(backward)
        def run(ctx: Any, *grads: Tensor | None) -> _T:
            if not torch.compiler.is_compiling() and (torch.is_grad_enabled() or under_vmap(*grads)):
                raise RuntimeError(message)
            return backward(ctx, *grads)

        return run

    return decorate


def masked_softmax(logits: Tensor, dim: int, mask: Tensor | None = None) -> Tensor:
    """Softmax that gives all-zero weights (and finite gradients) where nothing may vote.

    Computed in at least float32 and returned in that dtype, so float16 and bfloat16 logits
    cannot overflow.

    Args:
        logits: any shape; ``-inf`` entries take no weight.
        dim: the axis to normalise over.
        mask: boolean, broadcastable to ``logits``; ``True`` marks entries that may take weight.

    Returns:
        Weights of the shape of ``logits`` (broadcast with ``mask``) summing to 1 over ``dim``,
        or to 0 where every entry along ``dim`` is masked or ``-inf`` (or ``dim`` is empty).

    Raises:
        TypeError: ``logits`` not a floating-point tensor, ``mask`` not a boolean tensor.
        ValueError: ``dim`` not an axis of ``logits``, a ``mask`` that does not broadcast to
            ``logits``.

    Examples:
        >>> import torch
        >>> from torchvote.functional import masked_softmax
        >>> logits = torch.zeros(2, 3)
        >>> mask = torch.tensor([[True, True, False], [False, False, False]])
        >>> masked_softmax(logits, dim=-1, mask=mask)  # a fully masked row takes no weight at all
        tensor([[0.5000, 0.5000, 0.0000],
                [0.0000, 0.0000, 0.0000]])
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        described = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise TypeError(f"logits must be a floating-point tensor, got {described}")
    check_dim(dim, logits.dim())
    logits = _upcast(logits)
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(
                f"mask must be a boolean tensor (True = may take weight), got "
                f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}"
            )
        _check_mask_shape(mask, logits.shape)
        logits = logits.masked_fill(~mask, float("-inf"))
    if logits.dim() == 0:  # one entry along dim 0, as torch.softmax reads a 0-d tensor
        return masked_softmax(logits.reshape(1), 0).reshape(())
    if logits.shape[dim] == 0:  # nothing to normalise over: no weights at all
        return logits
    exp, _ = shifted_exp(logits, dim)
    total = exp.sum(dim=dim, keepdim=True)
    # a row with nothing to weigh (total 0) divides 0 by 1: a floor of float's tiniest number
    # gave its backward g / tiny = inf (past |g| of about 4), and inf * exp'(-inf) = NaN
    return exp / torch.where(total > 0, total, 1.0)


def shifted_exp(logits: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``(exp(logits - peak), peak)`` with ``peak`` each slice's largest logit along ``dim``
    (kept), detached (a constant to autograd: what is built from the pair does not depend on
    it), and 0 in a slice with no finite maximum (all ``-inf``: every exponential 0, no NaN).
    The stable core of :func:`masked_softmax` and of EM's M-step weights."""
    peak = logits.amax(dim=dim, keepdim=True).detach()
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    return torch.exp(logits - peak), peak  # -inf -> 0


def _finite_softmax(logits: Tensor, dim: int) -> Tensor:
    """``masked_softmax`` for logits known to be finite, with no mask: one fused softmax."""
    return torch.softmax(_upcast(logits), dim=dim)


_NONLINEARITIES: dict[str, NonlinearityFn] = {
    "identity": lambda aggregated, previous: aggregated,
    "squash": lambda aggregated, previous: _squash(aggregated, dim=-1),
    "layer_norm": lambda aggregated, previous: F.layer_norm(aggregated, aggregated.shape[-1:]),
}


def _dot_agreement(state: VotingState) -> Tensor:
    return state.votes.dot(state.outputs)


def _distance_agreement(state: VotingState) -> Tensor:
    """Negative squared Euclidean distance ``-||u - v||^2 = 2 u.v - ||u||^2 - ||v||^2``, each term
    in at least float32 (in float16 the squared lengths overflow long before the distance)."""
    out_sq = _upcast(state.outputs).pow(2).sum(-1).unsqueeze(-1)  # (..., i, 1)
    return 2 * _upcast(state.votes.dot(state.outputs)) - state.votes.squared_norm() - out_sq


_AGREEMENTS: dict[str, AgreementFn] = {
    "dot": _dot_agreement,
    "distance": _distance_agreement,
}


def check_returned(value: Any, shape: torch.Size, argument: str, described: str) -> Tensor:
    """``value`` if a user's callable returned a floating-point tensor of ``shape``; otherwise an
    error naming ``argument`` (it was torch's, from deep inside the loop).

    Args:
        value: what the callable returned.
        shape: the shape it must have.
        argument: the callable's argument name, e.g. ``"nonlinearity"``.
        described: what it must return, e.g. ``"the outputs (..., i, d)"``.

    Returns:
        ``value``.

    Raises:
        TypeError: anything but a floating-point tensor.
        ValueError: a tensor of another shape.
    """
    if isinstance(value, Tensor) and value.is_floating_point() and value.shape == shape:
        return value
    is_float = isinstance(value, Tensor) and value.is_floating_point()
    got = (
        f"a {value.dtype} tensor of shape {tuple(value.shape)}"
        if isinstance(value, Tensor) else type(value).__name__
    )
    error = ValueError if is_float else TypeError
    raise error(f"{argument} must return {described}, a float tensor of shape {tuple(shape)}; got {got}")


def _checked_nonlinearity(fn: NonlinearityFn) -> NonlinearityFn:
    """A user's ``f(aggregated, previous)``, its result checked to be outputs of the same shape."""

    def checked(aggregated: Tensor, previous: Tensor | None) -> Tensor:
        outputs = fn(aggregated, previous)
        return check_returned(outputs, aggregated.shape, "nonlinearity", "the outputs (..., i, d)")

    return checked


def _checked_agreement(fn: AgreementFn) -> AgreementFn:
    """A user's agreement, its result checked to broadcast to the ``(..., i, j)`` logits."""

    def checked(state: VotingState) -> Tensor:
        agreement, shape = fn(state), state.logits.shape
        if isinstance(agreement, Tensor) and agreement.shape == shape and agreement.is_floating_point():
            return agreement  # the common case, first: the check runs every pass
        trailing = shape[len(shape) - agreement.dim():] if isinstance(agreement, Tensor) else None
        if trailing is not None and agreement.dim() <= len(shape) and all(
            size in (1, target) for size, target in zip(agreement.shape, trailing, strict=True)
        ):  # (1, j) or (..., i, 1) agreement broadcasts, as the update adds it
            agreement = agreement.expand(shape)
        return check_returned(agreement, shape, "agreement", "logits (..., i, j)")

    return checked


def _resolve(name_or_fn, table: dict, argument: str, checked: Callable | None = None):
    if callable(name_or_fn):
        return name_or_fn if checked is None else checked(name_or_fn)
    if name_or_fn in table:
        return table[name_or_fn]
    raise ValueError(f"{argument} must be one of {sorted(table)} or a callable, got {name_or_fn!r}")


def _can_fuse(
    votes: Votes,
    logits: Logits,
    normalize_over: str,
    aggregation: str,
    nonlinearity,
    iterations: int,
    sender_weights: Tensor | None,
    record: bool,
    bias: Tensor | None,
) -> bool:
    """True when the configuration is exactly softmax attention, one pass: the fused kernel's."""
    return (
        isinstance(votes, SharedVotes)
        and isinstance(logits, DotProductScores)
        and normalize_over == "senders"
        and aggregation == "sum"
        and nonlinearity == "identity"
        and iterations == 1
        and sender_weights is None
        and bias is None
        and not record
    )


def vote(
    votes: Votes | Tensor,
    logits: Logits | None = None,
    *,
    normalize_over: NormalizeOver,
    iterations: int = 1,
    agreement: str | AgreementFn = "dot",
    update: Update = "accumulate",
    aggregation: Literal["sum", "mean"] = "sum",
    nonlinearity: str | NonlinearityFn = "identity",
    mask: Tensor | None = None,
    is_causal: bool = False,
    sender_weights: Tensor | None = None,
    bias: Tensor | None = None,
    initial_outputs: Tensor | None = None,
    detach_votes: bool = False,
    dropout_p: float = 0.0,
    record: bool = False,
) -> VoteResult:
    """Weighted voting that reaches a consensus: the operator behind every layer in torchvote.

    One pass (``t = 0 .. iterations - 1``)::

        w      = softmax(logits, over j if normalize_over == "senders" else over i)   (masked)
        w_eff  = w * sender_weights[..., None, j]                     (if sender weights are given)
        s_i    = sum_j w_eff_ij u_ij   (aggregation "sum")
                 sum_j (w_eff_ij + eps) u_ij / sum_j (w_eff_ij + eps)    ("mean", eps = 1e-8 on
                                                      the senders that may vote: logit > -inf)
        out_i  = nonlinearity(s_i + bias_i, previous out_i)
        logits = logits + agreement(u, out)          update="accumulate"  (dynamic routing)
                 agreement(u, out)                   update="replace"     (EM, inverted
                                                                         dot-product, slots)
                 initial_logits + agreement(u, out)  update="prior"       (the start as a prior)

    The agreement is not computed after the last pass. When the configuration is exactly one pass
    of softmax attention over dot-product scores (``SharedVotes``, ``DotProductScores``,
    ``normalize_over="senders"``, sum, identity, no sender weights, bias or recording) it runs on
    ``F.scaled_dot_product_attention`` and never forms the ``(i, j)`` matrix.

    Args:
        votes: a :class:`SharedVotes` (attention's values, ``(..., j, d)``), a
            :class:`PairwiseVotes` (routing's predictions, ``(..., i, j, d)``), any object
            following the :class:`Votes` protocol, or a plain tensor of either shape, told apart
            by the rank of the logits: of their rank, shared votes ``(..., j, d)``; of one more,
            pairwise votes ``(..., i, j, d)``.
        logits: initial agreement logits ``(..., i, j)``, a :class:`DotProductScores`, or
            ``None`` for zeros (uniform weights: routing's ``b_ij = 0``). A plain tensor
            ``votes`` needs logits (their rank says which votes it holds and, for shared votes,
            they give the receiver count); without them wrap it.
        normalize_over: ``"senders"`` (softmax over ``j``: attention) or ``"receivers"``
            (softmax over ``i``: routing).
        iterations: number of passes, at least 1.
        agreement: ``"dot"`` (u . out), ``"distance"`` (-||u - out||^2), or a callable taking a
            :class:`VotingState` and returning ``(..., i, j)`` agreement.
        update: how the agreement becomes the next logits: ``"accumulate"`` adds it to the
            running logits (dynamic routing, Sabour et al. 2017, Procedure 1); ``"replace"``
            makes it the new logits on its own, the initial logits taking part in the first pass
            only (inverted dot-product routing, slot attention, EM routing: the E-step's
            ``log a_i + log p_ij`` is the whole logit); ``"prior"`` adds it to the initial logits,
            which act as a fixed prior in every pass. A float ``mask`` is added to the logits of
            every pass whichever the update.
        aggregation: ``"sum"`` (weighted sum) or ``"mean"`` (weighted mean, weights
            renormalised over senders after ``1e-8`` is added to each that may vote, as slot
            attention does, Locatello et al. 2020, Algorithm 1: a receiver every sender left
            still takes a mean of the votes, never a sum scaled up by a clamped denominator).
        nonlinearity: ``"identity"``, ``"squash"``, ``"layer_norm"``, or a callable
            ``f(aggregated, previous_outputs)`` (``previous_outputs`` is ``initial_outputs`` in
            the first pass).
        mask: boolean ``(..., i, j)`` (broadcastable), True where a sender may vote for a receiver;
            or a float tensor added to the logits (``-inf`` forbids).
        is_causal: receivers ``i`` may only hear senders ``j <= i`` (attention; top-left
            aligned, as in ``F.scaled_dot_product_attention``).
        sender_weights: ``(..., j)`` non-negative activations multiplying each sender's weights
            after normalisation (EM routing's input activations ``a_j``).
        bias: ``(..., i, d)`` added to the aggregate before the nonlinearity.
        initial_outputs: ``(..., i, d)`` passed to a callable nonlinearity as the previous
            outputs in the first pass (slot attention's initial slots).
        detach_votes: use votes cut from the graph in every pass but the last (a common speed-up
            for dynamic routing; the paper back-propagates through every pass).
        dropout_p: dropout on the weights (only during attention-style use; pass 0 in eval).
        record: keep every pass's weights and logits in the result.

    Returns:
        A :class:`VoteResult` with ``outputs`` ``(..., i, d)`` and, if recorded, per-pass weights
        and logits.

    Raises:
        ValueError: ``is_causal`` with ``normalize_over="receivers"`` (not causal: later receivers
            would change earlier outputs); bad ``normalize_over``, ``iterations``, ``update``,
            ``aggregation``, names, or shapes: logits that do not fit the votes (or, for pairwise
            votes, grow their batch), a ``mask``, ``sender_weights``, ``bias`` or
            ``initial_outputs`` that does not broadcast to its ``(..., i, j)``, ``(..., j)``,
            ``(..., i, d)`` or ``(..., i, ...)`` shape without growing it (a ``(4, b, ...)`` bias
            would have turned ``b`` outputs into ``4 b``); a :class:`DotProductScores` whose keys
            are not as many as the values; logits, scores, a mask, sender weights, bias or initial
            outputs on another device than the votes; negative (or NaN) ``sender_weights``.
        TypeError: votes, logits, scores, sender weights, bias or initial outputs that are not
            floating-point tensors or not of the votes' dtype (outside ``torch.autocast``; float
            ``logits`` of another dtype are allowed, they are upcast), a non-boolean,
            non-floating mask, or ``is_causal``, ``detach_votes`` or ``record`` that is not a
            bool.

    A float ``mask``'s values are not checked here (every layer and attention function checks its
    masks where they enter; ``vote`` is the step they all call): NaN or ``+inf`` in it gives NaN.

    Examples:
        Attention is one pass normalised over the senders ``j`` (the keys):

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from torchvote.functional import PairwiseVotes, SharedVotes, vote
        >>> _ = torch.manual_seed(0)
        >>> q, k, v = torch.randn(2, 5, 8), torch.randn(2, 7, 8), torch.randn(2, 7, 4)
        >>> logits = q @ k.transpose(-2, -1) / 8 ** 0.5  # (batch, i, j): receivers i, senders j
        >>> result = vote(SharedVotes(v), logits, normalize_over="senders")
        >>> result.outputs.shape
        torch.Size([2, 5, 4])
        >>> torch.allclose(result.outputs, F.scaled_dot_product_attention(q, k, v), atol=1e-6)
        True

        Routing is several passes normalised over the receivers ``i``: each sender splits one vote.

        >>> votes = PairwiseVotes(torch.randn(2, 3, 6, 4))  # (batch, i, j, d)
        >>> result = vote(votes, normalize_over="receivers", iterations=3, nonlinearity="squash",
        ...               record=True)
        >>> result.outputs.shape, len(result.weights)
        (torch.Size([2, 3, 4]), 3)
        >>> torch.allclose(result.weights[-1].sum(dim=-2), torch.ones(2, 6))
        True
    """
    check_choice(normalize_over, get_args(NormalizeOver), "normalize_over")
    check_positive_int(iterations, "iterations")
    check_choice(update, _UPDATES, "update")
    check_choice(aggregation, ("sum", "mean"), "aggregation")
    check_probability(dropout_p, "dropout_p")
    for flag, argument in ((is_causal, "is_causal"), (detach_votes, "detach_votes"), (record, "record")):
        check_flag(flag, argument)
    if is_causal and normalize_over == "receivers":  # as RoutingAttention refuses it
        raise ValueError(
            "is_causal=True needs normalize_over='senders': a softmax over the receivers sums over "
            "later queries, so later receivers would change earlier outputs"
        )
    votes = _as_votes(votes, logits)
    _check_votes(votes)
    update_fn = _resolve(nonlinearity, _NONLINEARITIES, "nonlinearity", _checked_nonlinearity)
    agreement_fn = _resolve(agreement, _AGREEMENTS, "agreement", _checked_agreement)

    if isinstance(logits, DotProductScores):
        _check_scores(logits, votes)
    elif logits is not None and (not isinstance(logits, Tensor) or not logits.is_floating_point()):
        described = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise TypeError(
            f"logits must be a floating-point tensor, a DotProductScores or None, got {described}"
        )

    _check_devices(votes, logits, mask=mask, sender_weights=sender_weights, bias=bias,
                   initial_outputs=initial_outputs)

    if _can_fuse(votes, logits, normalize_over, aggregation, nonlinearity, iterations,
                 sender_weights, record, bias):
        assert isinstance(logits, DotProductScores) and isinstance(votes, SharedVotes)
        queries, keys, values = logits.queries, logits.keys, votes.values
        if mask is not None:  # the batch axes broadcast: _check_scores said so
            batch = broadcast_shape(queries.shape[:-2], keys.shape[:-2], values.shape[:-2])
            _check_mask(mask, (*batch, queries.shape[-2], keys.shape[-2]))  # (..., i, j)
        return VoteResult(_fused_softmax_attention(queries, keys, values, mask, is_causal, dropout_p,
                                                  logits.effective_scale))

    initial = _initial_logits(votes, logits)
    weights_shape = _check_logits(votes, initial)  # (..., i, j)
    _check_mask(mask, weights_shape)
    _check_vote_inputs(votes, weights_shape, sender_weights, bias, initial_outputs)
    bool_mask = _combine_masks(mask, is_causal, initial)
    if mask is not None and mask.is_floating_point():
        initial = initial + _upcast(mask)
    additive = _upcast(mask) if update == "replace" and mask is not None and mask.is_floating_point() \
        else None  # "replace" drops the initial logits, so the float mask is added anew
    if bool_mask is not None:
        initial = initial.masked_fill(~bool_mask, float("-inf"))
    axis = -1 if normalize_over == "senders" else -2  # -1: over j (attention); -2: over i (routing)
    # From b_ij = 0 with no mask every logit stays finite: the plain softmax (one fused kernel,
    # fewer passes over the (..., i, j) logits) gives what masked_softmax would.
    softmax = _finite_softmax if logits is None and mask is None and not is_causal else masked_softmax

    result = VoteResult(outputs=initial.new_empty(0))
    current = initial
    previous = initial_outputs
    for t in range(iterations):
        last = t == iterations - 1
        cast = votes if (last or not detach_votes) else votes.detach()
        weights = softmax(current, axis).to(votes.dtype)  # (..., i, j), summing to 1 over axis
        vote_weights = weights
        if sender_weights is not None:
            vote_weights = vote_weights * sender_weights.unsqueeze(-2)  # (..., i, j) * (..., 1, j)
        if dropout_p > 0.0:  # contiguous: the mask's draws follow memory order, and the weights'
            # layout follows the logits' (a score function may return them permuted, as an einsum
            # can): the same seed gives the same mask whatever the layout
            vote_weights = F.dropout(vote_weights.contiguous(), p=dropout_p)
        if aggregation == "mean":
            vote_weights = _mean_weights(vote_weights, current)
        aggregated = cast.weighted_sum(vote_weights)  # (..., i, d)
        if bias is not None:
            aggregated = aggregated + bias
        outputs = update_fn(aggregated, previous)  # (..., i, d)
        if record:
            result.weights.append(weights)
            result.logits.append(current)
        if not last:
            state = VotingState(cast, outputs, aggregated, weights, vote_weights, current,
                                initial, t)
            agreement_logits = _upcast(agreement_fn(state))  # (..., i, j)
            if update == "accumulate":
                current = current + agreement_logits
            elif update == "prior":
                current = initial + agreement_logits
            else:
                current = agreement_logits if additive is None else agreement_logits + additive
            if bool_mask is not None:
                current = current.masked_fill(~bool_mask, float("-inf"))
        previous = outputs
    result.outputs = outputs
    return result


def _fused_softmax_attention(
    queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, is_causal: bool,
    dropout_p: float, scale: float,
) -> Tensor:
    """One pass of softmax attention on ``F.scaled_dot_product_attention``: what :func:`vote` runs
    when its configuration is exactly that (:func:`_can_fuse`), on arguments checked by the caller
    (``vote``, or an attention module that checked them where they entered).

    Args:
        queries: ``(..., i, e)``; keys ``(..., j, e)``; values ``(..., j, d)``.
        mask: boolean (True = may attend) or float, broadcastable to ``(..., i, j)``, or None.
        is_causal: query ``i`` hears only keys ``j <= i``.
        dropout_p: dropout on the weights.
        scale: multiplies ``q . k``.

    Returns:
        ``(..., i, d)``; zero for a query with nothing to attend to.
    """
    dtype = queries.dtype  # what the kernel computes in: autocast's dtype for float32 queries
    if dtype == torch.float32 and autocast_enabled(queries.device.type):
        dtype = torch.get_autocast_dtype(queries.device.type)
    mask, is_causal = fused_kernel_mask(mask, is_causal, queries.shape[-2], keys.shape[-2], dtype)
    dead = None  # (..., i | 1, 1): queries with no sender (causality alone leaves each its first)
    if mask is not None:
        mask, dead = open_rows_without_senders(mask)
    # the fused kernels have no forward-mode AD: under torch.func transforms, the math one
    transformed = under_autograd_transforms(queries, keys, values)
    with sdpa_kernel(SDPBackend.MATH) if transformed else contextlib.nullcontext():
        outputs = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale,
        )  # (..., i, d)
    return outputs if dead is None else outputs.masked_fill(dead, 0.0)


def _as_votes(votes: Votes | Tensor, logits: Logits | None) -> Votes:
    if isinstance(votes, (SharedVotes, PairwiseVotes)):  # their tensor is checked by _check_votes
        return votes
    if not isinstance(votes, Tensor):
        if not all(hasattr(votes, name) for name in ("weighted_sum", "dot", "dtype")):
            raise TypeError(
                f"votes must be a tensor, a SharedVotes, a PairwiseVotes or another Votes object, got "
                f"{type(votes).__name__}"
            )
        return votes
    if logits is None:
        raise ValueError(
            "a plain tensor of votes is ambiguous without logits: wrap it in SharedVotes "
            "((..., j, d), attention) or PairwiseVotes ((..., i, j, d), routing)"
        )
    if not isinstance(logits, (Tensor, DotProductScores)):
        raise TypeError(f"logits must be a floating-point tensor, a DotProductScores or None, got "
                        f"{type(logits).__name__}")
    logit_rank = logits.queries.dim() if isinstance(logits, DotProductScores) else logits.dim()
    if votes.dim() == logit_rank:
        return SharedVotes(votes)
    if votes.dim() == logit_rank + 1:
        return PairwiseVotes(votes)
    raise ValueError(
        f"votes must have rank {logit_rank} ((..., j, d)) or {logit_rank + 1} ((..., i, j, d)) "
        f"to match logits, got shape {tuple(votes.shape)}"
    )


def _check_votes(votes: Votes) -> None:
    """Refuse votes that are not floating point, and the tensor of a :class:`SharedVotes` or
    :class:`PairwiseVotes` of too few axes (shapes and dtypes only).

    Raises:
        TypeError: naming ``votes`` and its dtype or type.
        ValueError: a ``(..., j, d)`` of fewer than 2 axes, a ``(..., i, j, d)`` of fewer than 3.
    """
    for kind, tensor, rank, layout in ((SharedVotes, "values", 2, "(..., j, d)"),
                                       (PairwiseVotes, "votes", 3, "(..., i, j, d)")):
        if isinstance(votes, kind):
            value = getattr(votes, tensor)
            if not isinstance(value, Tensor):
                raise TypeError(f"{kind.__name__}.{tensor} must be a tensor, got {type(value).__name__}")
            if value.dim() < rank:
                raise ValueError(
                    f"{kind.__name__}.{tensor} must have shape {layout}, got {tuple(value.shape)}"
                )
    if not votes.dtype.is_floating_point:
        raise TypeError(f"votes must be floating point, got dtype {votes.dtype}")


def _check_scores(scores: DotProductScores, votes: Votes) -> None:
    """Dtypes and batch axes of the queries and keys of ``scores`` (their types, ranks and feature
    sizes were checked when it was made), and of the values they weigh.

    Raises:
        TypeError: queries and keys not of one dtype with each other and with shared votes
            (outside ``torch.autocast``); a bad ``scale``.
        ValueError: keys not as many as the values, batch axes that do not broadcast.
    """
    queries, keys = scores.queries, scores.keys
    check_input_dtype(keys, queries.dtype, "DotProductScores keys", "the queries")
    if scores.scale is not None:
        check_scale(scores.scale, "DotProductScores scale")
    query_shape, key_shape = queries.shape, keys.shape  # each read once: torch.Size costs
    shapes = [query_shape, key_shape]
    if isinstance(votes, SharedVotes):
        values = votes.values
        check_input_dtype(values, queries.dtype, "values", "the queries")
        if values.shape[-2] != key_shape[-2]:
            raise ValueError(
                f"keys and values must have the same length, got shapes {tuple(key_shape)} and "
                f"{tuple(values.shape)}"
            )
        shapes.append(values.shape)
    if any(len(shape) != len(query_shape) or shape[:-2] != query_shape[:-2] for shape in shapes[1:]):
        batches = [shape[:-2] for shape in shapes]
        if broadcast_shape(*batches) is None:
            raise ValueError(
                f"queries, keys and values must have batch axes that broadcast, got "
                f"{', '.join(str(tuple(batch)) for batch in batches)}"
            )


def _votes_device(votes: Votes) -> torch.device | None:
    """The device of ``votes`` (their ``device``, read from their tensors: nothing is computed), or
    ``None`` for a votes object that does not say."""
    device = getattr(votes, "device", None)
    return device if isinstance(device, torch.device) else None


def _check_devices(votes: Votes, logits: Logits | None, **tensors: Tensor | None) -> None:
    """Refuse logits (or the queries and keys of scores) and the ``tensors`` (the mask, sender
    weights, bias, initial outputs) on another device than the votes: devices only, nothing is
    read. A CPU tensor beside ``meta`` votes was computed on uninitialised memory without a word,
    other pairs failed deep inside PyTorch naming no argument. A votes object that does not say
    its device is not checked.

    Raises:
        ValueError: naming the argument and both devices (:func:`check_device`).
    """
    device = _votes_device(votes)
    if device is None:
        return
    named = ((("DotProductScores queries", logits.queries), ("DotProductScores keys", logits.keys))
             if isinstance(logits, DotProductScores) else (("logits", logits),))
    for name, tensor in (*named, *tensors.items()):
        if isinstance(tensor, Tensor):
            check_device(tensor, device, name, "the votes")


def _initial_logits(votes: Votes, logits: Logits | None) -> Tensor:
    if isinstance(logits, DotProductScores):
        return logits.materialize()
    if logits is not None:
        return _upcast(logits)
    return _upcast(votes.zero_logits())  # routing's b_ij = 0; shared votes raise


def _votes_shape(votes: Votes) -> tuple[int, ...] | None:
    """``(..., i, j, d)`` of the votes, read from their shapes (nothing is computed): the receiver
    count of a :class:`SharedVotes` is ``-1`` (it comes from the logits); ``None`` for a votes
    object that does not say."""
    if isinstance(votes, PairwiseVotes):
        return tuple(votes.votes.shape)
    if isinstance(votes, SharedVotes):
        return (*votes.values.shape[:-2], -1, *votes.values.shape[-2:])
    sizes = [getattr(votes, name, None) for name in ("batch_shape", "receivers", "senders", "out_dim")]
    return None if None in sizes else (*sizes[0], *sizes[1:])


def _check_logits(votes: Votes, logits: Tensor) -> tuple[int, ...]:
    """Shapes only (nothing read from the device): logits ``(..., i, j)`` that fit the votes. Logits
    of votes that know their receivers (pairwise votes) broadcast to the votes' ``(..., i, j)``
    without growing it, as a mask, sender weights or a bias must (``(4, b, i, j)`` logits turned
    ``b`` outputs into ``4 b``); shared votes take the batch of the logits, as attention's values
    take the queries'.

    Returns:
        The ``(..., i, j)`` shape of the weights: the logits' broadcast with the votes'.

    Raises:
        ValueError: naming ``logits`` and the shapes.
    """
    shape = _votes_shape(votes)
    if shape is None:
        return tuple(logits.shape)
    shared = shape[-3] == -1  # the receivers come from the logits
    expected = (*shape[:-3], logits.shape[-2] if shared and logits.dim() >= 2 else shape[-3],
                shape[-2])  # (..., i, j)
    fits = logits.dim() >= 2 and logits.shape[-2:] == tuple(expected[-2:])
    batch = broadcast_shape(logits.shape[:-2], expected[:-2]) if fits else None
    if batch is None:
        described = f"values of shape {tuple(votes.values.shape)}" if isinstance(votes, SharedVotes) \
            else f"votes of shape {shape}"
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not fit {described}: expected (..., i, j) = "
            f"{tuple(expected)}"
        )
    if not shared and batch != tuple(expected[:-2]):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} must broadcast to the votes' (..., i, j) = "
            f"{tuple(expected)} without growing it (votes of shape {shape})"
        )
    return (*batch, *expected[-2:])


def _check_mask(mask: Tensor | None, weights_shape: tuple[int, ...]) -> None:
    """Refuse a ``mask`` that is not a tensor or does not broadcast to the ``(..., i, j)``
    ``weights_shape`` without growing it (shapes only).

    Raises:
        TypeError: a ``mask`` that is not a tensor, or neither boolean nor floating point.
        ValueError: naming ``mask`` and the shapes.
    """
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a tensor or None, got {type(mask).__name__}")
    check_mask_dtype(mask)  # the fused kernel's own error names nothing
    if broadcast_shape(mask.shape, weights_shape) != tuple(weights_shape):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the weights' shape "
            f"(..., i, j) = {tuple(weights_shape)}"
        )


def _check_vote_inputs(
    votes: Votes,
    weights_shape: tuple[int, ...],
    sender_weights: Tensor | None,
    bias: Tensor | None,
    initial_outputs: Tensor | None,
) -> None:
    """Shapes and dtypes of ``sender_weights``, ``bias`` and ``initial_outputs`` against the
    ``(..., i, j)`` weights: each must broadcast to its part of them without growing it (a larger
    batch would silently multiply the outputs).

    Raises:
        TypeError: a ``sender_weights``, ``bias`` or ``initial_outputs`` that is not a
            floating-point tensor or not of the votes' dtype (outside ``torch.autocast``).
        ValueError: naming the argument, its shape and the shape expected; negative or NaN
            ``sender_weights`` (checked with :func:`~torchvote.validation.check_tensor_values`).
    """
    *batch, receivers, senders = weights_shape
    if sender_weights is not None:
        check_input_dtype(sender_weights, votes.dtype, "sender_weights", "the votes")
        target = (*batch, senders)  # (..., j)
        if sender_weights.dim() < 1 or broadcast_shape(sender_weights.shape, target) != target:
            raise ValueError(
                f"sender_weights must broadcast to (..., j) = {target}, got {tuple(sender_weights.shape)}"
            )
        check_tensor_values(  # a negative weight turns a sender's vote against itself
            (sender_weights >= 0).all(),
            "sender_weights must be non-negative (a sender's activation)",
            detail=lambda: f", got smallest {sender_weights.min().item()}",
        )
    shape = _votes_shape(votes)
    features = shape[-1] if shape is not None else None
    if bias is not None:
        check_input_dtype(bias, votes.dtype, "bias", "the votes")
        if bias.dim() < 1:
            raise ValueError(f"bias must have shape (..., i, d), got {tuple(bias.shape)}")
        target = (*batch, receivers, bias.shape[-1] if features is None else features)  # (..., i, d)
        if broadcast_shape(bias.shape, target) != target:
            raise ValueError(f"bias must broadcast to (..., i, d) = {target}, got {tuple(bias.shape)}")
    if initial_outputs is not None:
        if not isinstance(initial_outputs, Tensor):
            raise TypeError(f"initial_outputs must be a tensor or None, got {type(initial_outputs).__name__}")
        check_input_dtype(initial_outputs, votes.dtype, "initial_outputs", "the votes")
        target = (*batch, receivers)  # (..., i): its features are the nonlinearity's business
        if initial_outputs.dim() < 2 or broadcast_shape(initial_outputs.shape[:-1], target) != target:
            raise ValueError(
                f"initial_outputs must broadcast to (..., i, features) with (..., i) = {target}, got "
                f"{tuple(initial_outputs.shape)}"
            )


def _check_mask_shape(mask: Tensor, logits_shape: torch.Size) -> None:
    """Raise a ValueError naming ``mask`` unless it broadcasts with ``logits_shape`` (shapes only;
    :func:`masked_softmax` returns the broadcast)."""
    if broadcast_shape(mask.shape, logits_shape) is None:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the logits' shape "
            f"{tuple(logits_shape)}"
        )


#: What aggregation="mean" adds to each weight before normalising (slot attention's epsilon).
_MEAN_EPS = 1e-8


def _mean_weights(weights: Tensor, logits: Tensor) -> Tensor:
    """The weights of ``aggregation="mean"``, ``(w_ij + eps) / sum_j (w_ij + eps)`` over the senders
    that may vote (Locatello et al. 2020, Algorithm 1): a receiver every sender left still takes
    the mean of the votes. "May vote" is read from the pass's logits, ``> -inf`` (a boolean mask,
    causality or a float mask's ``-inf``); a receiver no sender may vote for gets 0, not 0 / 0.
    Formed in at least float32 (1e-8 is 0 in float16), then cast back.

    Args:
        weights: ``(..., i, j)`` the pass's vote weights (after sender weights and dropout).
        logits: the pass's logits, broadcastable to ``weights``.

    Returns:
        ``weights``' shape and dtype, each row summing to 1 (or 0 where no sender may vote).
    """
    raised = weights.to(torch.promote_types(weights.dtype, torch.float32))
    raised = torch.where(logits > -math.inf, raised + _MEAN_EPS, raised)
    total = raised.sum(-1, keepdim=True)  # (..., i, 1)
    return (raised / torch.where(total > 0, total, 1.0)).to(weights.dtype)  # as masked_softmax


def _combine_masks(mask: Tensor | None, is_causal: bool, logits: Tensor) -> Tensor | None:
    """The boolean mask (True = may vote) from a boolean mask and/or causality, or None."""
    return voting_mask(mask, is_causal, logits.shape[-2], logits.shape[-1], logits.device)
