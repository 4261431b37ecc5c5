"""EM routing of matrix capsules: the public function, its schedule and its documentation.

Hinton, Sabour & Frosst 2018, "Matrix capsules with EM routing", Procedure 1, written in
torchvote's legend: ``i`` output capsule (``Omega_{L+1}``, the receiver) and ``j`` input capsule
(``Omega_L``, the sender); the paper swaps the letters::

    R_ij = 1 / |parents of j|                 (1 / |Omega_{L+1}| for one patch)
    repeat t = 0 .. r-1:
        M-step, for every output i:
            R_ij    <- R_ij * a_j                                    (NOT renormalised over i)
            mu_i^h  <- sum_j R_ij V_ij^h / sum_j R_ij
            s2_i^h  <- sum_j R_ij (V_ij^h - mu_i^h)^2 / sum_j R_ij
            cost^h  <- (beta_u + log sigma_i^h) sum_j R_ij
            a_i     <- logistic(lambda_t (beta_a - sum_h cost^h))
        E-step, for every input j (not after the last M-step: it changes nothing returned):
            p_ij    <- N(V_ij | mu_i, diag s2_i)
            R_ij    <- a_i p_ij / sum_k a_k p_kj        (normalised over the PARENTS of j)

Layout: votes ``(batch..., out_caps, in_caps, pose_dim)`` and assignments ``(batch..., out_caps,
in_caps)``, receivers first as everywhere in torchvote; the input activations, per-input data,
are ``(batch..., in_caps)``.

**Which outputs an input's assignments are normalised over.** Every batch element routes on its
own by default: each input's assignments sum to 1 over the ``out_caps`` of its own row. For a
convolutional capsule layer, whose rows are the patches, that is the *per-patch* form. The paper
normalises jointly over every output capsule an input capsule reaches, in every patch that
contains it (IBM's public implementation does the same); ``sender_groups`` says which rows' senders
are the same input capsule, and the E-step's softmax then runs over all their parents
(:func:`~torchvote.functional.em_kernel.conv_sender_groups` builds it for a convolutional layer;
:class:`~torchvote.nn.em_capsules.ConvMatrixCapsules` uses it by default).

**As voting.** Per patch, EM routing is a configuration of
:func:`~torchvote.functional.voting.vote`::

    vote(votes carrying the statistics (1, c, c^2) of the centred votes c = V - m, 0,
         normalize_over="receivers", sender_weights=a_in, aggregation="sum", update="replace",
         agreement=E-step log-likelihood, iterations=r)

- the softmax over the receivers of ``log a_i + log p_ij`` *is* the E-step's normalisation, and
  it is the whole new logit (``update="replace"``: nothing of the previous pass is kept);
- ``sender_weights=a_in`` multiplies the assignments by the input activations after the softmax,
  the M-step's ``R_ij a_j`` (never renormalised over the outputs: doing so, as one popular
  implementation does, makes ``sum_i R_ij a_j = 1`` and cancels the activations);
- one weighted sum of the statistics gives every receiver's ``(sum R, sum R c, sum R c^2)``, the
  M-step's weighted mean and variance; the E-step's log-likelihood is one dot product of the
  same statistics with ``(const, mu / s2, -1 / (2 s2))``.

The library runs that loop as one fused kernel (:mod:`torchvote.functional.em_kernel`): the same
numbers (``tests/functional/test_em_kernel.py`` keeps the ``vote`` configuration as its
reference), with the joint normalisation added and a choice of strategy (``"blocked"``,
``"vectorized"``, ``"compiled"``; ``"auto"`` picks by device). Everything is kept in log space:
``log sigma = log(s2 + eps) / 2`` and the E-step works with ``log a_j + log p_ij`` (``log a`` as
``logsigmoid``), so no variance, probability or activation underflows to zero and no gradient
becomes NaN. Gradients are exact for any order and subset of ``backward`` /
``torch.autograd.grad`` calls; double backward works with ``strategy="vectorized"`` and raises a
clear ``RuntimeError`` with ``"blocked"`` (the CPU default) and ``"compiled"``, as batched gradients
(``is_grads_batched=True``, ``jacobian`` with ``vectorize=True``) do with ``"blocked"``. ``torch.func``
transforms (``vmap``, ``grad``, ``jacrev``, ``jvp``, per-sample gradients) and forward-mode AD run
the vectorized loop: ``"auto"`` picks it under them, and ``"blocked"``, asked for by name, raises.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Literal, overload

import torch
from torch import Tensor

from torchvote.functional.em_kernel import STRATEGIES, EMStrategy, PerSenderVotes, SenderGroups, route
from torchvote.validation import (
    ArgumentTypeError,
    check_choice,
    check_flag,
    check_inputs_beside,
    check_positive_float,
    check_positive_int,
    is_real,
)

__all__ = [
    "EMStrategy",
    "InverseTemperature",
    "default_inverse_temperature",
    "em_routing",
    "inverse_temperature_schedule",
]

InverseTemperature = Callable[[int], float] | Sequence[float] | float


def default_inverse_temperature(iteration: int) -> float:
    """``lambda_t = 0.01 (1 - 0.95^(t + 1))`` for the 0-based iteration ``t``.

    The schedule the authors gave for the inverse temperature in their reply on OpenReview (the
    paper only says lambda is increased at each iteration), as used by the public
    implementations: 0.0005, 0.000975, 0.00143, ... rising towards 0.01.

    Args:
        iteration: 0-based routing iteration.

    Returns:
        The inverse temperature of that iteration.

    Raises:
        ValueError: ``iteration`` not an integer >= 0.
    """
    check_positive_int(iteration, "iteration", minimum=0)
    return 0.01 * (1.0 - 0.95 ** (iteration + 1))


def default_schedule_ending_at(final: float, iterations: int) -> list[float]:
    """The authors' ``lambda_t`` schedule (:func:`default_inverse_temperature`) rescaled so that its
    last pass has ``final``.

    The authors' schedule was written for 3 iterations; with fewer it ends lower (1 iteration:
    0.0005, about a third of the 3-iteration 0.00143), and since an output's activation logit is
    ``lambda (beta_a - cost)`` the activations then barely depend on the votes. Holding the last
    value fixed while the number of iterations changes compares the routing passes alone.

    Args:
        final: the inverse temperature of the last pass, positive.
        iterations: passes, at least 1.

    Returns:
        ``iterations`` floats, rising like the authors' schedule, the last equal to ``final``.

    Raises:
        ValueError: ``final`` not positive and finite, or ``iterations`` < 1.
    """
    final = check_positive_float(final, "final")
    check_positive_int(iterations, "iterations")
    scale = final / default_inverse_temperature(iterations - 1)
    return [scale * default_inverse_temperature(t) for t in range(iterations)]


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
        TypeError: ``inverse_temperature`` neither a callable, a real number nor a sequence of
            them (a bool is not a number here: ``True`` would have been a constant 1.0); a tensor
            that requires a gradient or is traced by a ``torch.func`` transform (the schedule is
            made of floats: no gradient could reach it).
    """
    def as_value(value: object, returned_by: int | None = None) -> float:
        if isinstance(value, Tensor) and (
            value.requires_grad or torch._C._functorch.is_functorch_wrapped_tensor(value)
        ):
            raise TypeError(
                "inverse_temperature is a schedule of constants: a tensor that requires a gradient (or "
                "is traced by a torch.func transform) would silently get none; pass float(value), and "
                "learn the activations' scale through beta_a"
            )
        if not isinstance(value, (bool, str, bytes)):
            try:
                return float(value)  # type: ignore[arg-type]  # numpy and 0-d tensor scalars too
            except (TypeError, ValueError):
                pass
        if returned_by is not None:  # the callable's value, not the callable, is what is wrong
            raise TypeError(
                f"inverse_temperature({returned_by}) must return a real number, got {value!r}"
            )
        raise TypeError(
            f"inverse_temperature must be a callable of the iteration, a real number or a sequence "
            f"of one per iteration, got {inverse_temperature!r}"
        )

    if callable(inverse_temperature):
        values = [as_value(inverse_temperature(t), returned_by=t) for t in range(iterations)]
    elif (
        isinstance(inverse_temperature, (numbers.Real, bool, str, bytes))
        or not hasattr(inverse_temperature, "__iter__")
        or getattr(inverse_temperature, "ndim", None) == 0  # a 0-d tensor or array: not iterable
    ):
        values = [as_value(inverse_temperature)] * iterations  # a constant (refused if not a number)
    else:
        values = [as_value(v) for v in inverse_temperature]
        if len(values) != iterations:
            raise ValueError(
                f"inverse_temperature must give one value per iteration ({iterations}), got {len(values)}"
            )
    if any(not math.isfinite(v) or v < 0 for v in values):
        source = " (the callable's values for iterations 0, 1, ...)" if callable(inverse_temperature) else ""
        raise ValueError(f"inverse_temperature must be finite and >= 0, got {values}{source}")
    return values


@overload
def em_routing(
    votes: Tensor | PerSenderVotes,
    activations: Tensor,
    beta_u: Tensor | float,
    beta_a: Tensor | float,
    *,
    iterations: int = 3,
    inverse_temperature: InverseTemperature = default_inverse_temperature,
    eps: float = 1e-6,
    sender_groups: Tensor | SenderGroups | None = None,
    strategy: EMStrategy = "auto",
    return_assignments: Literal[False] = False,
    all_passes: bool = False,
) -> tuple[Tensor, Tensor]: ...


@overload
def em_routing(
    votes: Tensor | PerSenderVotes,
    activations: Tensor,
    beta_u: Tensor | float,
    beta_a: Tensor | float,
    *,
    iterations: int = 3,
    inverse_temperature: InverseTemperature = default_inverse_temperature,
    eps: float = 1e-6,
    sender_groups: Tensor | SenderGroups | None = None,
    strategy: EMStrategy = "auto",
    return_assignments: Literal[True],
    all_passes: bool = False,
) -> tuple[Tensor, Tensor, Tensor]: ...


@overload
def em_routing(
    votes: Tensor | PerSenderVotes,
    activations: Tensor,
    beta_u: Tensor | float,
    beta_a: Tensor | float,
    *,
    iterations: int = 3,
    inverse_temperature: InverseTemperature = default_inverse_temperature,
    eps: float = 1e-6,
    sender_groups: Tensor | SenderGroups | None = None,
    strategy: EMStrategy = "auto",
    return_assignments: bool = False,
    all_passes: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]: ...


def em_routing(
    votes: Tensor | PerSenderVotes,
    activations: Tensor,
    beta_u: Tensor | float,
    beta_a: Tensor | float,
    *,
    iterations: int = 3,
    inverse_temperature: InverseTemperature = default_inverse_temperature,
    eps: float = 1e-6,
    sender_groups: Tensor | SenderGroups | None = None,
    strategy: EMStrategy = "auto",
    return_assignments: bool = False,
    all_passes: bool = False,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """EM routing (Hinton, Sabour & Frosst 2018, Procedure 1), receivers first.

    The cost is Procedure 1's form, ``cost^h = (beta_u + log sigma_i^h) sum_j R_ij`` with ``R``
    already multiplied by the input activations, and ``a_i = logistic(lambda (beta_a - sum_h
    cost^h))``; the paper's other form (sec. 3, ``(log sigma + (1 + log 2 pi) / 2) sum R`` from the
    Gaussian's entropy, with beta_u absorbing the constant) is not used. No normalisation of the
    cost across capsules is applied (the paper has none). Gradients flow through every
    iteration.

    Args:
        votes: ``(batch..., out_caps, in_caps, pose_dim)``: ``V_ij = M_j W_ij`` flattened (16 for
            4x4 poses); any strides; float64, float32, bfloat16 or float16 (the last two are
            routed with float32 statistics). Or
            :class:`~torchvote.functional.em_kernel.PerSenderVotes` of that shape: votes not yet
            formed, which the ``"blocked"`` and (on a CPU) ``"compiled"`` strategies form one
            block at a time (``"compiled"`` keeps 512 MiB of them per call for backward and
            forms later blocks again there).
        activations: ``(batch..., in_caps)`` input activations ``a_j`` in ``[0, 1]``, of the
            votes' dtype (outside ``torch.autocast``) and on their device. The range
            is the caller's contract and is not checked: checking it would read the values back
            from the device on every call of every EM layer (a synchronisation, and a graph break
            under ``torch.compile``) for activations the modules make with a sigmoid. A value
            of 0 or below gives its votes no weight (the weights are normalised in log space; the
            gradient with respect to an activation of exactly 0 is 0, as a sigmoid's own is
            there), above 1 more than the model's, and NaN gives NaN outputs.
        beta_u: the per-dimension cost offset, a finite real number or a tensor broadcastable to
            ``(batch..., out_caps)`` (learned per output capsule type in the modules; a tensor's
            values are not checked, which would read them back from the device).
        beta_a: the activation offset, as ``beta_u``.
        iterations: EM iterations (the paper uses 3); at least 1.
        inverse_temperature: ``lambda_t``: a callable of the 0-based iteration, a sequence of one
            value per iteration, or a constant; numbers, not learned (a tensor that requires a
            gradient is refused). Default :func:`default_inverse_temperature`,
            ``0.01 (1 - 0.95^(t+1))``.
        eps: added to every variance, so that a single vote or identical votes give a finite
            ``log sigma`` (the weighted mean divides by ``sum_j R_ij a_j`` itself; a receiver no
            vote reaches has pose 0).
        sender_groups: ``None`` (every batch element routes on its own: per patch), or an integer
            tensor ``(L, in_caps)`` with ``L`` dividing the number ``n`` of batch elements (all
            batch dimensions flattened, row-major): element ``r``'s senders are the input capsules
            ``sender_groups[r % L]`` of the ``r // L``-th period (image). The E-step then
            normalises each input capsule's assignments jointly over every output capsule of every
            element of its period that holds it, and the initial ``R`` is ``1 / |parents|``,
            its number of parents (Procedure 1 writes ``1 / |Omega_L+1|``, the layer's
            outputs, without spelling it out for convolutional capsules; this is the reading
            of Gritzman 2019 and IBM's implementation, under which the assignments of each
            input sum to 1 from the start).
            :func:`~torchvote.functional.em_kernel.conv_sender_groups` builds it for votes
            ``(batch, L, out_caps, in_caps, pose_dim)``. Checking and compacting the ids reads
            from the device; a layer that routes on one grid every call passes them once through
            :func:`~torchvote.functional.em_kernel.prepare_sender_groups` and then the
            :class:`~torchvote.functional.em_kernel.SenderGroups` it returns.
        strategy: ``"auto"`` (``"blocked"`` on CPU; ``"vectorized"`` on CUDA, while
            ``torch.compile`` traces and under ``torch.func`` transforms or forward-mode AD),
            ``"blocked"`` (an eager kernel: one graph break under ``torch.compile``; no
            ``torch.func`` transforms, no forward-mode AD), ``"vectorized"`` or ``"compiled"``
            (``torch.compile``, about 10-30 s per new shape on CPU, where it runs in blocks of
            rows; the fastest on either device); the same numbers from each (see
            :mod:`torchvote.functional.em_kernel`). ``"compiled"`` is specialised on every size,
            the number of rows routed (batch elements) included: each distinct batch size
            compiles once more, and on a CPU each distinct remainder too (the last, partial
            block of a batch split into blocks). Compilations are kept up to torch's recompile
            limit, raised to 64 per process (every layer's shapes, with and without gradient,
            count towards it); past it dynamo logs ``hit config.recompile_limit`` and the loop
            runs eagerly, with the same numbers, slower. So with ``"compiled"`` feed batches of
            one size: torchvote's training loop drops an epoch's last incomplete batch, a
            ``DataLoader`` does with ``drop_last=True``; an evaluation's last, smaller batch
            compiles once more.
        return_assignments: also return the assignments ``R`` of the final M-step.
        all_passes: with ``return_assignments``, the assignments of every iteration stacked on a
            new leading axis.

    An empty batch (any batch dimension 0) gives empty outputs of the shapes below.

    Returns:
        ``(poses, activations)``: ``(batch..., out_caps, pose_dim)`` the means ``mu_i``, and
        ``(batch..., out_caps)`` the activations ``a_i``; with ``return_assignments`` also
        ``(batch..., out_caps, in_caps)`` ``R_ij`` (``(iterations, batch..., out_caps, in_caps)``
        with ``all_passes``), summing to 1 over each input's parents (over ``out_caps`` without
        ``sender_groups``), before the input activations multiply them. All in the votes' dtype
        (routed with float32 statistics for float16 and bfloat16, with ``torch.autocast`` off).

    Raises:
        ValueError: ``iterations`` < 1, mismatched shapes, votes without input capsules (or
            without output capsules or pose entries), a bad schedule, ``eps``, ``strategy`` or
            ``sender_groups``; ``activations`` on another device than the votes; a ``beta_u`` or
            ``beta_a`` given as a number that is not finite (NaN or infinite: every output NaN).
        TypeError: ``votes`` neither a tensor nor :class:`PerSenderVotes`, ``activations`` not a
            tensor; ``beta_u`` or ``beta_a`` neither a real number nor a tensor; ``activations``
            not floating point, or not of the votes' dtype (outside ``torch.autocast``: float64
            activations beside float32 votes were taken silently); ``return_assignments`` or
            ``all_passes`` not a bool; an ``inverse_temperature`` that is not made of numbers, or a
            tensor that requires a gradient (:func:`inverse_temperature_schedule`).
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``, as every routing function's)
            a votes tensor that is not floating point; ``sender_groups`` that are not an int32 or
            int64 tensor.
        RuntimeError: (at double backward) differentiating the ``"blocked"`` or ``"compiled"``
            strategy's gradient again (for ``"compiled"``, torch's own error); (at a batched
            backward) ``"blocked"``'s gradients asked for in a batch; (at backward)
            ``"compiled"`` on a CPU after the factors of :class:`PerSenderVotes` whose blocks it
            forms again (past 512 MiB) were modified in place since forward;
            ``strategy="blocked"`` under ``torch.export``, a ``torch.func`` transform (``vmap``,
            ``grad``, ``jacrev``, ``jvp``, ...) or forward-mode AD. Use ``strategy="vectorized"``
            for both.

    Examples:
        >>> import torch
        >>> from torchvote.functional import em_routing
        >>> _ = torch.manual_seed(0)
        >>> votes = torch.randn(2, 5, 12, 16)  # (batch, out_caps, in_caps, pose_dim): 4x4 poses
        >>> activations = torch.rand(2, 12)  # (batch, in_caps), in [0, 1]
        >>> poses, out_activations, assignments = em_routing(
        ...     votes, activations, beta_u=0.0, beta_a=0.0, return_assignments=True)
        >>> poses.shape, out_activations.shape, assignments.shape
        (torch.Size([2, 5, 16]), torch.Size([2, 5]), torch.Size([2, 5, 12]))
        >>> torch.allclose(assignments.sum(dim=-2), torch.ones(2, 12))  # each input's parents share it
        True
        >>> bool(((out_activations > 0) & (out_activations < 1)).all())
        True
    """
    check_positive_int(iterations, "iterations")
    check_positive_float(eps, "eps")
    check_choice(strategy, STRATEGIES, "strategy")
    check_flag(return_assignments, "return_assignments")
    check_flag(all_passes, "all_passes")
    factored = isinstance(votes, PerSenderVotes)
    if not factored and not isinstance(votes, Tensor):
        raise TypeError(f"votes must be a tensor or PerSenderVotes, got {type(votes).__name__}")
    if not isinstance(activations, Tensor):
        raise TypeError(f"activations must be a tensor, got {type(activations).__name__}")
    if not factored and not votes.is_floating_point():  # a TypeError as vote's, a ValueError as before
        raise ArgumentTypeError(f"votes must be floating point, got dtype {votes.dtype}")
    if not factored and votes.dim() < 3:
        raise ValueError(
            f"votes must be a floating tensor of shape (..., out_caps, in_caps, pose_dim), got "
            f"{tuple(votes.shape)}"
        )
    batch_shape, (out_caps, in_caps, pose_dim) = votes.shape[:-3], votes.shape[-3:]
    if 0 in (out_caps, in_caps, pose_dim):
        raise ValueError(
            f"votes must have at least one output capsule, input capsule and pose entry, shape "
            f"(..., out_caps, in_caps, pose_dim), got {tuple(votes.shape)}"
        )
    if activations.shape != (*batch_shape, in_caps):
        raise ValueError(
            f"activations must have shape (batch..., in_caps) = {(*batch_shape, in_caps)} to match "
            f"votes {tuple(votes.shape)}, got {tuple(activations.shape)}"
        )
    if not activations.is_floating_point():  # bool or integer: 0/1 weights, surely not meant
        raise TypeError(f"activations must be floating point (in [0, 1]), got dtype {activations.dtype}")
    check_inputs_beside(votes, (("activations", activations),), where="the votes")  # beside "meta": garbage
    schedule = inverse_temperature_schedule(inverse_temperature, iterations)
    if math.prod(batch_shape) == 0:  # nothing to cut into blocks or to compile
        strategy = "vectorized"  # whose loop gives empty outputs
    offsets = []
    for value, argument in ((beta_u, "beta_u"), (beta_a, "beta_a")):
        if not (is_real(value) or isinstance(value, Tensor)):  # NumPy's scalars too
            raise TypeError(f"{argument} must be a real number or a tensor, got {type(value).__name__}")
        if not isinstance(value, Tensor) and not math.isfinite(value):  # a tensor's: not read
            raise ValueError(f"{argument} must be finite, got {value!r} (every output would be NaN)")
        if isinstance(value, Tensor):
            tensor = value.to(votes.device)
            if not tensor.is_floating_point():
                tensor = tensor.to(votes.dtype)
        else:  # filled on the device (no copy from the host: that waits for the GPU), exact in float64
            tensor = torch.full((), float(value), dtype=torch.promote_types(votes.dtype, torch.float32),
                                device=votes.device)
        try:
            offsets.append(tensor.expand(*batch_shape, out_caps).reshape(-1, out_caps))  # (n, i)
        except RuntimeError:
            raise ValueError(
                f"{argument} must broadcast to (batch..., out_caps) = {(*batch_shape, out_caps)}, "
                f"got {tuple(tensor.shape)}"
            ) from None
    outputs = route(
        votes.flattened() if factored else votes.reshape(-1, out_caps, in_caps, pose_dim),  # (n, i, j, h)
        activations.reshape(-1, in_caps),  # (n, j)
        *offsets,
        schedule=schedule,
        eps=eps,
        sender_groups=sender_groups,
        strategy=strategy,
        return_assignments=return_assignments,
        all_passes=all_passes,
    )
    poses = outputs[0].view(*batch_shape, out_caps, pose_dim)
    out_activations = outputs[1].view(*batch_shape, out_caps)
    if not return_assignments:
        return poses, out_activations
    leading = outputs[2].shape[:-3]  # (iterations,) with all_passes
    return poses, out_activations, outputs[2].view(*leading, *batch_shape, out_caps, in_caps)
