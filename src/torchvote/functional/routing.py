"""Capsule routing as configurations of the voting operator.

Every router here is one call of :func:`torchvote.functional.vote` with the softmax taken over the
**receivers** (``normalize_over="receivers"``): each input capsule splits one unit of vote among
the output capsules (bottom-up), where attention lets each query split one unit among the keys
(top-down). What else differs between the methods is where the logits start, how agreement is
scored, whether it accumulates, and the nonlinearity:

=========================  ================  ============  ==========  ==================
router                     start logits      agreement     update      nonlinearity
=========================  ================  ============  ==========  ==================
dynamic (Sabour 2017)      0                 u . v (or     accumulate  squash
                                             -||u - v||^2)
uniform (control)          0                 (one pass)    -           squash
inverted dot-product       0                 u . v         replace     layer norm
(Tsai 2020)
self-attention             u_j . sum_k u_k   (one pass)    -           Efficient-CapsNet
(Mazzia 2021)              / sqrt(d)                                   squash, + log prior
EM (Hinton 2018)           0                 Gaussian      replace     (M-step, see
                                             log-lik.                  ``em_routing``)
slot (Locatello 2020)      q(slot) . u       q(slot) . u   replace     GRU + MLP
=========================  ================  ============  ==========  ==================

Slot attention (Locatello 2020) is the same loop with shared votes (the values), a weighted mean
and a GRU as the nonlinearity: :func:`slot_attention`.

**Layout: receivers first.** Every function here takes votes ``(batch..., out_caps, in_caps,
dim)``: ``votes[..., i, j, :]`` is input capsule ``j``'s prediction for output capsule ``i`` (the
papers write it ``u_hat_{j|i}`` with ``i`` the input; here ``i`` is always the receiver), and
returns couplings ``(batch..., out_caps, in_caps)``, the layout of :func:`vote`'s ``(..., i, j)``
weights, each input's column summing to 1 over ``out_caps``. Per-input data (EM's input
activations) stays ``(batch..., in_caps)``. Instead of a tensor the functions also accept any
:class:`~torchvote.functional.voting.Votes` object, such as
:class:`~torchvote.functional.routing_votes.LinearVotes`, which never materialises the votes.

Index legend: ``b`` batch, ``i`` receivers (output capsules), ``j`` senders (input capsules),
``d`` features.

(Over 400 lines: six short routing functions, each with its paper's procedure in its docstring,
kept in one file so that the table above and the functions it describes are read side by side.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from torchvote.functional.dynamic_kernel import linear_dynamic_routing
from torchvote.functional.nonlinearities import check_vectors
from torchvote.functional.routing_votes import LinearVotes
from torchvote.functional.voting import (
    _NONLINEARITIES,
    AgreementFn,
    NonlinearityFn,
    PairwiseVotes,
    SharedVotes,
    VoteResult,
    Votes,
    _check_devices,
    _upcast,
    _votes_shape,
    check_returned,
    routed_in_dtype,
    vote,
)
from torchvote.validation import (
    ArgumentTypeError,
    broadcast_shape,
    check_flag,
    check_float_tensor,
    check_input_dtype,
    check_inputs_beside,
    check_positive_float,
    check_positive_int,
    check_scale,
)

__all__ = [
    "as_routing_votes",
    "dynamic_routing",
    "efficient_squash",
    "inverted_dot_product_routing",
    "list_routers",
    "self_attention_routing",
    "slot_attention",
    "slot_routing",
    "uniform_routing",
]

RoutingVotes = Tensor | Votes


def list_routers() -> dict[str, str]:
    """Every routing method torchvote has, by the name ``CapsuleLinear(routing=...)`` takes.

    Returns:
        ``{name: one-line description}``.
    """
    return {
        "dynamic": "dynamic routing by agreement (Sabour, Frosst & Hinton 2017, Procedure 1)",
        "em": "EM routing of matrix capsules (Hinton, Sabour & Frosst 2018, Procedure 1)",
        "inverted_dot_product": "inverted dot-product attention routing (Tsai et al. 2020, Procedure 1)",
        "self_attention": "Efficient-CapsNet self-attention routing (Mazzia et al. 2021, eqs. 3-6)",
        "slot": "slot attention over output capsules (Locatello et al. 2020, Algorithm 1)",
        "uniform": "uniform couplings, no routing: the control (one pass, c_ij = 1 / out_caps)",
    }


# --- helpers ----------------------------------------------------------------------------------------


def as_routing_votes(votes: RoutingVotes, argument: str = "votes") -> Votes:
    """Votes as the voting loop takes them.

    Args:
        votes: a tensor ``(..., out_caps, in_caps, dim)``, or a
            :class:`~torchvote.functional.voting.Votes` object, returned as is.
        argument: the argument's name, for error messages.

    Returns:
        A :class:`PairwiseVotes` over the tensor (no copy), or ``votes`` itself.

    Raises:
        ValueError: if a tensor has fewer than 3 dimensions.
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) a tensor that is not floating
            point: a ``TypeError`` as :func:`~torchvote.functional.vote` raises for it, and the
            ``ValueError`` this function raised before.
        TypeError: ``votes`` neither a tensor nor a votes object (one with ``weighted_sum``,
            ``dot`` and ``zero_logits``).
    """
    if not isinstance(votes, Tensor):
        if not all(hasattr(votes, name) for name in ("weighted_sum", "dot", "zero_logits", "dtype")):
            raise TypeError(
                f"{argument} must be a tensor (..., out_caps, in_caps, dim) or a votes object such as "
                f"LinearVotes, got {type(votes).__name__}"
            )
        return votes
    if votes.dim() < 3:
        raise ValueError(
            f"{argument} must have shape (..., out_caps, in_caps, dim), got {tuple(votes.shape)}"
        )
    if not votes.is_floating_point():
        raise ArgumentTypeError(f"{argument} must be floating point, got dtype {votes.dtype}")
    return PairwiseVotes(votes)


def _couplings(result: VoteResult, all_passes: bool) -> Tensor:
    """The last pass's ``(..., i, j)`` couplings, or every pass's stacked: ``(passes, ..., i, j)``."""
    return torch.stack(result.weights) if all_passes else result.weights[-1]


def _check_fits(tensor: Tensor, target: tuple[int, ...], argument: str, expected: str) -> None:
    """Refuse a ``tensor`` that does not broadcast to ``target`` (without growing it)."""
    if tensor.dim() < 2 or broadcast_shape(tensor.shape, target) != target:
        raise ValueError(f"{argument} must broadcast to {expected} = {target}, got {tuple(tensor.shape)}")


def _bias_for(bias: Tensor | None, votes: Votes) -> Tensor | None:
    """``bias``, checked against the votes: broadcastable to ``(batch..., out_caps, out_dim)``, of
    their dtype (outside autocast)."""
    if bias is None:
        return None
    check_input_dtype(bias, votes.dtype, "bias", "the votes")
    _check_devices(votes, None, bias=bias)
    shape = _votes_shape(votes)
    if shape is None:  # a votes object of unknown shape: only the rank is checked here
        if bias.dim() < 2:
            raise ValueError(f"bias must have shape (..., out_caps, dim), got {tuple(bias.shape)}")
        return bias
    _check_fits(bias, (*shape[:-3], shape[-3], shape[-1]), "bias", "(batch..., out_caps, out_dim)")
    return bias


# --- nonlinearities ---------------------------------------------------------------------------------


def efficient_squash(inputs: Tensor, dim: int = -1, eps: float = 1e-12) -> Tensor:
    """Efficient-CapsNet's squash: ``(1 - exp(-||s||)) s / ||s||``.

    Mazzia, Salvetti & Chiaberge 2021, "Efficient-CapsNet: capsule network with self-attention
    routing", eq. 6. Computed with ``||s|| = sqrt(sum s^2 + eps)`` so a zero vector gives zero with
    a finite gradient; lengths lie in ``[0, 1)``. Limit: once ``sum s^2`` overflows (``||s||``
    past 1.8e19 in float32 and bfloat16, 1.3e154 in float64), the output is zero, not a vector of
    length 1 (``squash`` gives NaN there).

    Args:
        inputs: any shape; vectors along ``dim``.
        dim: the vector axis.
        eps: added under the square root; positive.

    Returns:
        A tensor of the shape and dtype of ``inputs``.

    Raises:
        ValueError: if ``eps`` is not positive or ``dim`` is not an axis of ``inputs``.
        TypeError: ``inputs`` not a floating-point tensor.
    """
    check_positive_float(eps, "eps")
    check_vectors(inputs, dim)
    return _efficient_squash(inputs, dim, eps)


def _efficient_squash(inputs: Tensor, dim: int = -1, eps: float = 1e-12) -> Tensor:
    """:func:`efficient_squash` on checked arguments. For float16 and bfloat16 the length is formed
    in float32: in float16 ``sum s^2`` overflows once ``||s||`` passes 256, and the output was
    zero instead of a vector of length near 1."""
    vectors = inputs.float() if inputs.dtype in (torch.float16, torch.bfloat16) else inputs
    norm = torch.sqrt(vectors.pow(2).sum(dim=dim, keepdim=True) + eps)
    return (vectors * (-torch.expm1(-norm) / norm)).to(inputs.dtype)  # rounded once, as squash


#: the nonlinearities the routers take by name: vote's own table and Efficient-CapsNet's squash
_NONLINEARITY_NAMES = tuple(sorted({*_NONLINEARITIES, "efficient_squash"}))


def _as_update(fn: str | Callable[[Tensor], Tensor] | NonlinearityFn, argument: str):
    """A one-argument normalisation as vote's ``f(aggregated, previous)`` (known names pass
    through, checked here so that the message names ``argument``)."""
    if isinstance(fn, str):
        if fn not in _NONLINEARITY_NAMES:
            raise ValueError(
                f"{argument} must be one of {list(_NONLINEARITY_NAMES)} or a callable, got {fn!r}"
            )
        if fn == "efficient_squash":
            return lambda aggregated, previous: _efficient_squash(aggregated)
        return fn
    if not callable(fn):
        raise ValueError(f"{argument} must be a name or a callable, got {fn!r}")
    return lambda aggregated, previous: check_returned(
        fn(aggregated), aggregated.shape, argument, "the outputs (batch..., out_caps, out_dim)"
    )


# --- dynamic routing --------------------------------------------------------------------------------


def dynamic_routing(
    votes: RoutingVotes,
    *,
    iterations: int = 3,
    agreement: str | AgreementFn = "dot",
    detach_votes: bool = False,
    bias: Tensor | None = None,
    all_passes: bool = False,
) -> tuple[Tensor, Tensor]:
    """Routing by agreement: Sabour, Frosst & Hinton 2017, "Dynamic Routing Between Capsules".

    Procedure 1 (eqs. 1-3), written in torchvote's legend (``i`` output capsule, ``j`` input
    capsule; the paper swaps the letters)::

        b_ij = 0
        repeat r times:
            c_j  = softmax(b_j)                over the OUTPUT capsules i
            s_i  = sum_j c_ij u_ij  (+ bias_i)
            v_i  = squash(s_i)                 (eq. 1)
            b_ij = b_ij + u_ij . v_i           (not after the last pass)

    As voting: ``vote(votes, 0, normalize_over="receivers", iterations=r, agreement="dot",
    update="accumulate", nonlinearity="squash")``. The default is paper-exact, with gradients through
    every iteration. On :class:`~torchvote.functional.routing_votes.LinearVotes` with the dot
    agreement the same numbers come from one kernel,
    :func:`~torchvote.functional.dynamic_kernel.linear_dynamic_routing`.

    Args:
        votes: ``(batch..., out_caps, in_caps, out_dim)`` predictions ``u_ij = W_ij u_j``, or
            a :class:`~torchvote.functional.voting.Votes` object such as
            :class:`~torchvote.functional.routing_votes.LinearVotes`.
        iterations: routing iterations ``r`` (the paper uses 3); at least 1.
        agreement: ``"dot"`` (``u_hat . v``, the paper) or ``"distance"`` (``-||u_hat - v||^2``,
            the negative squared Euclidean distance the weighted-voting article names as the
            alternative), or a callable on the :class:`~torchvote.functional.voting.VotingState`.
        detach_votes: stop the gradient through the votes in every iteration but the last (a
            common speed-up of public implementations; not the paper's).
        bias: ``(batch..., out_caps, out_dim)`` (or broadcastable, e.g. ``(out_caps, out_dim)``)
            added to ``s_i`` before the squash in every iteration, as in the authors' released
            code.
        all_passes: return the couplings of every iteration stacked on a new leading axis.

    Returns:
        ``(outputs, couplings)``: ``v`` of shape ``(batch..., out_caps, out_dim)`` (lengths below
        1) and the couplings ``c`` that formed it, ``(batch..., out_caps, in_caps)``, summing to 1
        over ``out_caps`` (with ``all_passes``: ``(iterations, batch..., out_caps, in_caps)``).

    Raises:
        ValueError: ``iterations`` < 1, votes of fewer than 3 dimensions, an unknown agreement, a
            ``bias`` that does not broadcast to ``(batch..., out_caps, out_dim)`` or is on another
            device than the votes.
        TypeError: a ``bias`` that is not floating point or not of the votes' dtype (outside
            ``torch.autocast``); ``detach_votes`` or ``all_passes`` that is not a bool.
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) votes that are not floating
            point (:func:`as_routing_votes`).

    Examples:
        >>> import torch
        >>> from torchvote.functional import dynamic_routing
        >>> _ = torch.manual_seed(0)
        >>> votes = torch.randn(2, 10, 32, 16)  # (batch, out_caps, in_caps, out_dim)
        >>> outputs, couplings = dynamic_routing(votes, iterations=3)
        >>> outputs.shape, couplings.shape
        (torch.Size([2, 10, 16]), torch.Size([2, 10, 32]))
        >>> torch.allclose(couplings.sum(dim=-2), torch.ones(2, 32))  # summing to 1 over the out_caps
        True
        >>> bool((outputs.norm(dim=-1) < 1).all())  # squashed
        True
    """
    routed = as_routing_votes(votes)
    check_flag(detach_votes, "detach_votes")
    check_flag(all_passes, "all_passes")
    if isinstance(routed, LinearVotes) and agreement == "dot":
        check_positive_int(iterations, "iterations")
        outputs, couplings = linear_dynamic_routing(
            routed,
            iterations=iterations,
            bias=_bias_for(bias, routed),
            detach_votes=detach_votes,
            all_passes=all_passes,
        )
        return routed_in_dtype(routed.dtype, outputs, couplings)
    result = vote(
        routed,
        None,  # b_ij = 0: zero logits, finite in every pass (vote takes its fused softmax)
        normalize_over="receivers",
        iterations=iterations,
        agreement=agreement,
        update="accumulate",
        aggregation="sum",
        nonlinearity="squash",
        bias=_bias_for(bias, routed),
        detach_votes=detach_votes,
        record=True,
    )
    return routed_in_dtype(routed.dtype, result.outputs, _couplings(result, all_passes))


def uniform_routing(
    votes: RoutingVotes,
    *,
    nonlinearity: str | Callable[[Tensor], Tensor] = "squash",
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """No routing: every input capsule splits its vote equally, ``c_ij = 1 / out_caps``.

    The control of the "does routing help?" studies (e.g. Paik, Kwon & Kim 2019, "Capsule networks
    need an improved routing algorithm"; Gu & Tresp 2020, "Improving the robustness of capsule
    networks to image affine transformations", which drops routing for uniform couplings).
    As voting: one pass from zero logits normalised over the receivers, so identical to
    ``dynamic_routing(votes, iterations=1)`` with the default squash::

        v_i = squash(sum_j u_ij / out_caps)

    Args:
        votes: ``(batch..., out_caps, in_caps, out_dim)`` or a votes object.
        nonlinearity: ``"squash"`` (default), ``"identity"``, ``"layer_norm"``,
            ``"efficient_squash"`` or a callable on the ``(batch..., out_caps, out_dim)`` sums.
        bias: added to the sums before the nonlinearity, ``(..., out_caps, out_dim)``.

    Returns:
        ``(outputs, couplings)``: ``(batch..., out_caps, out_dim)`` and the constant
        ``(batch..., out_caps, in_caps)`` couplings.

    Raises:
        ValueError: bad votes or nonlinearity, a ``bias`` that does not broadcast to
            ``(batch..., out_caps, out_dim)`` or is on another device than the votes.
        TypeError: a ``bias`` not of the votes' floating dtype (outside ``torch.autocast``);
            votes that are not floating point (an ``ArgumentTypeError``, a ``ValueError`` too).

    Examples:
        >>> import torch
        >>> from torchvote.functional import dynamic_routing, uniform_routing
        >>> _ = torch.manual_seed(0)
        >>> votes = torch.randn(2, 4, 6, 8)  # (batch, out_caps, in_caps, out_dim)
        >>> outputs, couplings = uniform_routing(votes)
        >>> outputs.shape, torch.allclose(couplings, torch.full((2, 4, 6), 1 / 4))
        (torch.Size([2, 4, 8]), True)
        >>> torch.allclose(outputs, dynamic_routing(votes, iterations=1)[0])
        True
    """
    routed = as_routing_votes(votes)
    result = vote(
        routed,
        None,  # b_ij = 0: zero logits, finite in every pass (vote takes its fused softmax)
        normalize_over="receivers",
        iterations=1,
        nonlinearity=_as_update(nonlinearity, "nonlinearity"),
        bias=_bias_for(bias, routed),
        record=True,
    )
    return routed_in_dtype(routed.dtype, result.outputs, _couplings(result, False))


# --- descendants ------------------------------------------------------------------------------------


def inverted_dot_product_routing(
    votes: RoutingVotes,
    *,
    iterations: int = 3,
    normalization: str | Callable[[Tensor], Tensor] = "layer_norm",
    all_passes: bool = False,
) -> tuple[Tensor, Tensor]:
    """Inverted dot-product attention routing: Tsai, Srivastava, Goh & Salakhutdinov, ICLR 2020.

    "Capsules with Inverted Dot-Product Attention Routing", Procedure 1, in torchvote's legend
    (``i`` output capsule, ``j`` input capsule)::

        p_i = 0                                       (so the first pass is uniform)
        repeat r times:
            a_ij = p_i . v_ij                         (agreement with the CURRENT poses only)
            r_ij = softmax(a_j)                       over the OUTPUT capsules i
            p_i  = LayerNorm(sum_j r_ij v_ij)

    As voting: ``vote(votes, 0, normalize_over="receivers", iterations=r, agreement="dot",
    update="replace", nonlinearity="layer_norm")``. Unlike dynamic routing the logits are replaced,
    not accumulated, and layer normalisation replaces the squash. Unlike attention the softmax runs
    over the output capsules (the receivers), i.e. the "inverted" direction. The agreement is the
    paper's eq. 2, unscaled; the authors' released code divides it by ``sqrt(out_dim)``, so their
    checkpoints route with other couplings here (dividing the votes by ``sqrt(out_dim)`` gives
    theirs: the layer norm takes the scale out of the poses, up to its epsilon).

    Args:
        votes: ``(batch..., out_caps, in_caps, out_dim)`` or a votes object.
        iterations: passes ``r`` (the first is the uniform one); at least 1.
        normalization: ``"layer_norm"`` (no affine parameters; the module passes its own
            ``nn.LayerNorm``) or a callable on ``(batch..., out_caps, out_dim)``.
        all_passes: return the couplings of every pass stacked on a new leading axis.

    Returns:
        ``(poses, couplings)``: ``(batch..., out_caps, out_dim)`` and
        ``(batch..., out_caps, in_caps)``.

    Raises:
        ValueError: ``iterations`` < 1, bad votes or normalisation.
        TypeError: an ``all_passes`` that is not a bool; votes that are not floating point (an
            ``ArgumentTypeError``, a ``ValueError`` too).

    Examples:
        >>> import torch
        >>> from torchvote.functional import inverted_dot_product_routing
        >>> _ = torch.manual_seed(0)
        >>> votes = torch.randn(2, 10, 32, 16)  # (batch, out_caps, in_caps, out_dim)
        >>> poses, couplings = inverted_dot_product_routing(votes, iterations=3)
        >>> poses.shape, couplings.shape
        (torch.Size([2, 10, 16]), torch.Size([2, 10, 32]))
        >>> torch.allclose(couplings.sum(dim=-2), torch.ones(2, 32))  # normalised over the out_caps
        True
        >>> torch.allclose(poses.mean(dim=-1), torch.zeros(2, 10), atol=1e-5)  # layer-normalised poses
        True
    """
    routed = as_routing_votes(votes)
    check_flag(all_passes, "all_passes")
    result = vote(
        routed,
        None,  # b_ij = 0: zero logits, finite in every pass (vote takes its fused softmax)
        normalize_over="receivers",
        iterations=iterations,
        agreement="dot",
        update="replace",
        nonlinearity=_as_update(normalization, "normalization"),
        record=True,
    )
    return routed_in_dtype(routed.dtype, result.outputs, _couplings(result, all_passes))


def self_attention_routing(
    votes: RoutingVotes,
    *,
    log_prior: Tensor | None = None,
    nonlinearity: str | Callable[[Tensor], Tensor] = "efficient_squash",
) -> tuple[Tensor, Tensor]:
    """Efficient-CapsNet's self-attention routing: Mazzia, Salvetti & Chiaberge 2021, eqs. 3-6.

    For every output capsule ``i`` the votes of all input capsules ``j`` attend to each other,
    ``A_i = U_i U_i^T / sqrt(d)``, and each vote's logit is its row sum (the paper writes ``n``
    for the output and ``l`` for the input)::

        c_ij = softmax_i( sum_k u_ij . u_ik / sqrt(d) )     over the OUTPUT capsules i
        s_i  = sum_j u_ij (c_ij + b_ij)                     (b: the learned log prior)
        v_i  = squash_eff(s_i)

    As voting: one pass, ``vote(votes, logits, normalize_over="receivers", bias=sum_j b_ij u_ij,
    nonlinearity=efficient_squash)`` with ``logits = votes.dot(votes.weighted_sum(1)) / sqrt(d)``
    (agreement of each vote with the sum of its column: the self-attention matrix's row sums,
    without forming the ``(in_caps, in_caps)`` matrix; formed as ``in_caps`` times the dot products
    with the column means, that factor applied in float32 for half-precision votes, whose sums
    pass float16's 65504 at CapsNet's 1152 inputs). The prior is added after the softmax, as in
    the authors' code, so it enters as a bias ``sum_j b_ij u_ij`` on the aggregate. What differs
    from attention: the softmax runs over the receivers and the agreement needs no queries.

    Args:
        votes: ``(batch..., out_caps, in_caps, out_dim)`` or a votes object.
        log_prior: ``(out_caps, in_caps)`` (or with batch dimensions), the ``b_ij``; ``None``
            for none.
        nonlinearity: ``"efficient_squash"`` (eq. 6, default), ``"squash"``, ``"identity"``, or a
            callable on ``(batch..., out_caps, out_dim)``.

    Returns:
        ``(outputs, couplings)``: ``(batch..., out_caps, out_dim)`` and the softmax couplings
        ``(batch..., out_caps, in_caps)`` (without the prior).

    Raises:
        ValueError: a ``log_prior`` that does not broadcast to ``(batch..., out_caps, in_caps)``
            or is on another device than the votes, an unknown nonlinearity, votes with
            ``out_dim = 0`` (the scale ``1 / sqrt(d)`` would make every output NaN).
        TypeError: a ``log_prior`` not of the votes' floating dtype (outside ``torch.autocast``);
            votes that are not floating point (an ``ArgumentTypeError``, a ``ValueError`` too).
    """
    routed = as_routing_votes(votes)
    shape = _votes_shape(routed)
    if shape is not None and shape[-1] == 0:
        raise ValueError(
            f"votes must have at least one feature (out_dim > 0) for self-attention routing, got shape "
            f"{shape}"
        )
    zeros = routed.zero_logits()  # (..., i, j)
    senders = zeros.shape[-1]
    # u_ij . sum_k u_ik as senders * (u_ij . mean_k u_ik), the factor applied in float32 at least:
    # in float16 the column sums and their dot products passed 65504 at CapsNet's 1152 senders
    means = torch.full_like(zeros, 1 / max(senders, 1))  # (..., i, j)
    column_means = routed.weighted_sum(means)  # mean_k u_ik: (..., i, d)
    factor = senders / math.sqrt(column_means.shape[-1])
    logits = _upcast(routed.dot(column_means)) * factor  # (..., i, j)
    bias = None
    if log_prior is not None:
        check_input_dtype(log_prior, routed.dtype, "log_prior", "the votes")
        _check_devices(routed, None, log_prior=log_prior)
        _check_fits(log_prior, tuple(zeros.shape), "log_prior", "(batch..., out_caps, in_caps)")
        prior = log_prior.expand_as(zeros)  # (..., i, j)
        bias = routed.weighted_sum(prior)  # sum_j b_ij u_ij: (..., i, d)
    result = vote(
        routed,
        logits,
        normalize_over="receivers",
        iterations=1,
        nonlinearity=_as_update(nonlinearity, "nonlinearity"),
        bias=bias,
        record=True,
    )
    return routed_in_dtype(routed.dtype, result.outputs, _couplings(result, False))


def _check_returned(value: object, expected: tuple[int, ...], call: str, axes: tuple[str, str]) -> None:
    """Refuse what a caller's function returned unless it is a tensor of the ``expected`` shape
    (``(..., slots, features)``, whose last two axes are named ``axes``)."""
    if not isinstance(value, Tensor) or tuple(value.shape) != expected:
        described = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        layout = f"(batch..., {axes[0]}, {axes[1]}={expected[-1]})"
        raise ValueError(f"{call} must return shape {layout} = {expected}, got {described}")


def _slot_loop(
    votes: Votes,
    slots: Tensor,
    *,
    query: Callable[[Tensor], Tensor],
    score: Callable[[Tensor], Tensor],
    query_dim: int,
    update: Callable[[Tensor, Tensor], Tensor],
    axes: tuple[str, str, str],
    iterations: int,
    all_passes: bool,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The loop :func:`slot_attention` and :func:`slot_routing` share: logits
    ``score(query(slots))`` ``(..., i, j)`` normalised over the slots (receivers), a weighted
    mean, ``update``, and the fresh scores of the new slots as the next pass's logits
    (``update="replace"``). The caller's ``query`` and ``update`` are checked here: callables, and
    every result's shape right after the call (a wrong one was returned as the slots, or blamed
    on ``query`` a pass later).

    Args:
        votes: what the slots aggregate.
        slots: ``(..., i, slot_dim)`` the initial slots.
        query: the caller's ``slots -> (..., i, query_dim)``.
        score: ``(..., i, query_dim)`` queries -> ``(..., i, j)`` logits.
        query_dim: the features ``query`` must give.
        update: the caller's ``(updates (..., i, d), previous slots) -> (..., i, slot_dim)``.
        axes: the caller's names of the slot axis, the queries' features and the slots'
            features, for the messages, e.g. ``("num_slots", "key_dim", "slot_dim")``.

    Returns:
        ``(slots, couplings)``: the last slots and :func:`_couplings` of the passes.

    Raises:
        TypeError: ``query`` or ``update`` not callable.
        ValueError: ``query`` or ``update`` returning another shape than the slots' with
            ``query_dim`` or ``slot_dim`` features.
    """
    for function, argument in ((query, "query"), (update, "update")):
        if not callable(function):
            raise TypeError(f"{argument} must be a callable, got {function!r}")
    slot_dim = slots.shape[-1]

    def scores(current: Tensor) -> Tensor:
        queries = query(current)  # (..., i, query_dim)
        expected = (*current.shape[:-1], query_dim)
        _check_returned(queries, expected, "query(slots)", (axes[0], axes[1]))
        return score(queries)  # (..., i, j)

    def checked_update(updates: Tensor, previous: Tensor) -> Tensor:
        expected = (*updates.shape[:-1], slot_dim)  # (..., i, slot_dim)
        # initial slots given broadcastable ((i, slot_dim) for a batch): the update sees every
        # pass's slots with the batch's shape, as a GRUCell over (batch * i) rows needs them
        new_slots = update(updates, previous.expand(expected))
        _check_returned(new_slots, expected, "update(updates, slots)", (axes[0], axes[2]))
        return new_slots

    result = vote(
        votes,
        scores(slots),
        normalize_over="receivers",
        iterations=iterations,
        agreement=lambda state: scores(state.outputs),
        update="replace",
        aggregation="mean",
        nonlinearity=checked_update,
        initial_outputs=slots,
        mask=mask,
        record=True,
    )
    return result.outputs, _couplings(result, all_passes)


def slot_attention(
    keys: Tensor,
    values: Tensor,
    slots: Tensor,
    *,
    query: Callable[[Tensor], Tensor],
    update: Callable[[Tensor, Tensor], Tensor],
    iterations: int = 3,
    scale: float | None = None,
    mask: Tensor | None = None,
    all_passes: bool = False,
) -> tuple[Tensor, Tensor]:
    """Slot attention: Locatello et al. 2020, "Object-Centric Learning with Slot Attention", Alg. 1.

    With inputs ``j`` (senders) and slots ``i`` (receivers)::

        repeat T times:
            attn_ij  = softmax_i( q(slots_i) . k_j / sqrt(D) )     over the SLOTS (receivers)
            update_i = sum_j attn_ij v_j / sum_j attn_ij           (weighted mean over inputs)
            slots_i  = update(update_i, slots_i)                   (GRU, then + MLP(LN(.)))

    As voting: ``vote(SharedVotes(values), logits_0, normalize_over="receivers", iterations=T,
    aggregation="mean", nonlinearity=update, agreement=q(slots) . k / sqrt(D),
    update="replace")``: routing's axis (inputs compete for slots) with attention's shared values
    and queries. The logits are re-scored from the new slots in every pass (``update="replace"``:
    the fresh scores are the new logits). As in the paper, ``eps = 1e-8`` is added to every
    weight before the mean: a slot every input left takes the plain mean of the values.

    Args:
        keys: ``(batch..., inputs, key_dim)``: ``k(LayerNorm(inputs))``.
        values: ``(batch..., inputs, slot_dim)``: ``v(LayerNorm(inputs))``, of the slots' size
            (Algorithm 1 projects keys, queries and values to the slots' ``D``; the update takes a
            weighted mean of the values and returns slots of the same size).
        slots: ``(batch..., num_slots, slot_dim)``: the initial slots.
        query: ``slots -> (batch..., num_slots, key_dim)``, e.g. ``q(LayerNorm(slots))``.
        update: ``(updates, previous slots) -> new slots``, e.g. a GRU cell and a residual MLP.
        iterations: ``T``; at least 1.
        scale: multiplies the scores; default ``1 / sqrt(key_dim)``.
        mask: boolean ``(batch..., inputs)``, ``True`` for real inputs (padding takes no part).
        all_passes: return the attention of every pass stacked on a new leading axis.

    Returns:
        ``(slots, attention)``: ``(batch..., num_slots, slot_dim)`` and the last pass's
        ``(batch..., num_slots, inputs)`` attention (each input's column sums to 1 over the slots).

    Raises:
        ValueError: ``iterations`` < 1 or mismatched shapes (``slots`` whose batch axes do not
            broadcast to the keys' without growing them, ``values`` of another size than the
            slots), a ``mask`` of the wrong shape, a bad
            ``scale``; ``values``, ``slots`` or ``mask`` on another device than the keys; a
            ``query`` that does not return ``(batch..., num_slots, key_dim)`` of its slots, an
            ``update`` that does not return ``(batch..., num_slots, slot_dim)``.
        TypeError: ``keys``, ``values`` or ``slots`` not floating-point tensors or not of one
            dtype (outside ``torch.autocast``); a ``mask`` that is not a boolean tensor (for a
            tensor of another dtype an ``ArgumentTypeError``, a ``ValueError`` too, as before); a
            ``scale`` that is not a real number, an ``all_passes`` that is not a bool; ``query``
            or ``update`` not callable.

    Examples:
        >>> import torch
        >>> from torchvote.functional import slot_attention
        >>> _ = torch.manual_seed(0)
        >>> keys, values = torch.randn(2, 6, 8), torch.randn(2, 6, 8)  # (batch, inputs, key/value_dim)
        >>> slots = torch.randn(2, 3, 8)  # (batch, num_slots, slot_dim)
        >>> new_slots, attention = slot_attention(
        ...     keys, values, slots, query=lambda s: s, update=lambda updates, previous: updates)
        >>> new_slots.shape, attention.shape
        (torch.Size([2, 3, 8]), torch.Size([2, 3, 6]))
        >>> torch.allclose(attention.sum(dim=-2), torch.ones(2, 6))  # the slots compete for each input
        True
    """
    check_float_tensor(keys, "keys")  # first: the others are checked against its dtype and device
    given = (("values", values), ("slots", slots))  # a CPU tensor beside "meta" keys: uninitialised memory
    check_inputs_beside(keys, given, masks=(("mask", mask),), where="the keys")
    if keys.dim() < 2 or keys.shape[:-1] != values.shape[:-1]:
        raise ValueError(
            f"keys and values must have the same (batch..., inputs), got {tuple(keys.shape)} and "
            f"{tuple(values.shape)}"
        )
    if slots.dim() < 2 or broadcast_shape(slots.shape[:-2], keys.shape[:-2]) != tuple(keys.shape[:-2]):
        raise ValueError(
            f"slots must have shape (batch..., num_slots, slot_dim) with batch axes that broadcast "
            f"to the keys' {tuple(keys.shape[:-2])}, got {tuple(slots.shape)}"
        )
    if values.shape[-1] != slots.shape[-1]:  # the update's input is a mean of values, its output slots
        raise ValueError(
            f"values and slots must have the same features (Algorithm 1's D: an update of the slots' "
            f"size), got value_dim={values.shape[-1]} and slot_dim={slots.shape[-1]}; project the "
            f"values to {slots.shape[-1]} features"
        )
    check_flag(all_passes, "all_passes")
    scale = check_scale(scale)
    scale = 1.0 / math.sqrt(keys.shape[-1]) if scale is None else scale

    def score(queries: Tensor) -> Tensor:
        return torch.einsum("...ie,...je->...ij", queries, keys) * scale  # (..., i, j)

    bool_mask = None
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"mask must be a boolean tensor or None, got {type(mask).__name__}")
        if mask.dtype != torch.bool:  # a TypeError as every key mask's, a ValueError as before
            raise ArgumentTypeError(
                f"mask must be a boolean tensor (True = a real input), got dtype {mask.dtype}"
            )
        if mask.shape != keys.shape[:-1]:
            raise ValueError(
                f"mask must have shape {tuple(keys.shape[:-1])} (batch..., inputs), got "
                f"{tuple(mask.shape)}"
            )
        bool_mask = mask.unsqueeze(-2)  # (..., 1, j)
    return _slot_loop(
        SharedVotes(values), slots, query=query, score=score, query_dim=keys.shape[-1], update=update,
        axes=("num_slots", "key_dim", "slot_dim"), iterations=iterations, mask=bool_mask,
        all_passes=all_passes,
    )


def slot_routing(
    votes: RoutingVotes,
    slots: Tensor,
    *,
    query: Callable[[Tensor], Tensor],
    update: Callable[[Tensor, Tensor], Tensor],
    iterations: int = 3,
    scale: float | None = None,
    all_passes: bool = False,
) -> tuple[Tensor, Tensor]:
    """Slot attention's loop as a capsule router: the output capsules are the slots.

    :func:`slot_attention` with the layer's per-pair votes ``u_ij`` as both keys and values
    (a capsule layer has already projected every input once per output), and one learned initial
    slot per output capsule instead of sampled exchangeable slots (output capsules are distinct
    entities)::

        repeat T times:
            c_ij  = softmax_i( q(slot_i) . u_ij * scale )         over the OUTPUT capsules
            m_i   = sum_j (c_ij + eps) u_ij / sum_j (c_ij + eps)  (weighted mean, eps = 1e-8 as
                                                                  in Locatello et al.'s Algorithm 1)
            slot_i = update(m_i, slot_i)

    Args:
        votes: ``(batch..., out_caps, in_caps, out_dim)`` or a votes object.
        slots: ``(batch..., out_caps, out_dim)`` initial slots (broadcastable).
        query: ``slots -> (batch..., out_caps, out_dim)``.
        update: ``(means, previous slots) -> slots``.
        iterations: ``T``; at least 1.
        scale: multiplies the scores; default ``1 / sqrt(out_dim)``.
        all_passes: return the couplings of every pass stacked on a new leading axis.

    Returns:
        ``(slots, couplings)``: ``(batch..., out_caps, out_dim)`` and
        ``(batch..., out_caps, in_caps)``.

    Raises:
        ValueError: ``iterations`` < 1, bad votes, ``slots`` that do not broadcast to
            ``(batch..., out_caps, out_dim)`` or are on another device than the votes; a
            ``query`` or an ``update`` that does not return ``(batch..., out_caps, out_dim)``
            (``query`` of the slots it is given).
        TypeError: ``slots`` not of the votes' floating dtype (outside ``torch.autocast``); a
            ``scale`` that is not a real number, an ``all_passes`` that is not a bool; ``query``
            or ``update`` not callable.
    """
    routed = as_routing_votes(votes)
    check_input_dtype(slots, routed.dtype, "slots", "the votes")
    _check_devices(routed, None, slots=slots)
    shape = _votes_shape(routed)
    if shape is not None:
        _check_fits(slots, (*shape[:-3], shape[-3], shape[-1]), "slots", "(batch..., out_caps, out_dim)")
    check_flag(all_passes, "all_passes")
    scale = check_scale(scale)
    scale = 1.0 / math.sqrt(slots.shape[-1]) if scale is None else scale

    def score(queries: Tensor) -> Tensor:
        return routed.dot(queries) * scale  # (..., i, j)

    # the slots have the votes' out_dim (checked above where the votes tell their shape)
    outputs, couplings = _slot_loop(
        routed, slots, query=query, score=score, query_dim=slots.shape[-1], update=update,
        axes=("out_caps", "out_dim", "out_dim"), iterations=iterations, all_passes=all_passes,
    )
    return routed_in_dtype(routed.dtype, outputs, couplings)
