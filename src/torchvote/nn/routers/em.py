"""EM routing of matrix capsules (Hinton, Sabour & Frosst 2018, Procedure 1). See
:func:`torchvote.functional.em.em_routing`.

One module for every layer that routes by EM: :class:`~torchvote.nn.capsules.CapsuleLinear`
(``routing="em"``) and the matrix-capsule layers of :mod:`torchvote.nn.em_capsules`, which call
:meth:`EMRouter.route` on all their patches at once (with ``sender_groups`` for the joint
normalisation of a convolutional layer).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchvote.functional.em import (
    EMStrategy,
    InverseTemperature,
    default_inverse_temperature,
    em_routing,
    inverse_temperature_schedule,
)
from torchvote.functional.em_kernel import STRATEGIES
from torchvote.functional.routing import RoutingVotes
from torchvote.nn.routers.base import Router, RoutingResult, register_router
from torchvote.validation import check_choice, check_positive_float, check_positive_int

__all__ = ["EMRouter"]


@register_router
class EMRouter(Router):
    """EM routing; learns ``beta_u`` and ``beta_a`` per output capsule (type).

    Args:
        out_caps: output capsules (types), the length of ``beta_u`` and ``beta_a``.
        iterations: EM iterations (3 in the paper).
        inverse_temperature: the ``lambda_t`` schedule (a callable of the 0-based iteration, one
            value per iteration, or a constant); default ``0.01 (1 - 0.95^(t+1))``.
        eps: variance floor.
        strategy: how the routing runs (:func:`~torchvote.functional.em.em_routing`):
            ``"auto"`` (``"blocked"`` on CPU, ``"vectorized"`` on CUDA), ``"blocked"``,
            ``"vectorized"`` (double backward) or ``"compiled"`` (``torch.compile``, compiles per
            shape); the same numbers from each.

    Raises:
        ValueError: ``iterations`` < 1, a bad schedule, ``eps`` or ``strategy``.
    """

    name = "em"
    iterative = True
    uses_activations = True

    def __init__(
        self,
        *,
        out_caps: int,
        iterations: int = 3,
        inverse_temperature: InverseTemperature = default_inverse_temperature,
        eps: float = 1e-6,
        strategy: EMStrategy = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.iterations = check_positive_int(iterations, "iterations")
        inverse_temperature_schedule(inverse_temperature, iterations)  # checked where it enters
        self.inverse_temperature = inverse_temperature
        self.eps = check_positive_float(eps, "eps")
        self.strategy = check_choice(strategy, STRATEGIES, "strategy")
        check_positive_int(out_caps, "out_caps")
        self.beta_u = nn.Parameter(torch.zeros(out_caps, device=device, dtype=dtype))  # per output
        self.beta_a = nn.Parameter(torch.zeros(out_caps, device=device, dtype=dtype))

    def route(
        self,
        votes: Tensor,
        activations: Tensor,
        *,
        sender_groups: Tensor | None = None,
        return_assignments: bool = False,
    ) -> tuple[Tensor, ...]:
        """:func:`~torchvote.functional.em.em_routing` with this router's offsets and options.

        Args:
            votes: ``(batch..., out_caps, in_caps, pose_dim)``.
            activations: ``(batch..., in_caps)``.
            sender_groups: ``None`` (each batch element on its own) or ``(L, in_caps)`` input
                capsule ids for the joint normalisation (see ``em_routing``).
            return_assignments: also return ``R``.

        Returns:
            poses ``(batch..., out_caps, pose_dim)``, activations ``(batch..., out_caps)`` (and
            the assignments ``(batch..., out_caps, in_caps)``).
        """
        return em_routing(
            votes,
            activations,
            self.beta_u,
            self.beta_a,
            iterations=self.iterations,
            inverse_temperature=self.inverse_temperature,
            eps=self.eps,
            sender_groups=sender_groups,
            strategy=self.strategy,
            return_assignments=return_assignments,
        )

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        """Route; ``activations`` ``(batch..., in_caps)`` default to ones (all inputs present)."""
        tensor = votes if isinstance(votes, Tensor) else votes.materialize()  # EM reads them elementwise
        if activations is None:
            activations = tensor.new_ones(tensor.shape[:-3] + tensor.shape[-2:-1])  # (batch..., in_caps)
        poses, out_activations, assignments = self.route(tensor, activations, return_assignments=True)
        return RoutingResult(poses, assignments, out_activations)

    @classmethod
    def from_layer(cls, *, in_caps, out_caps, out_dim, iterations, factory, **options) -> EMRouter:
        return cls(out_caps=out_caps, iterations=iterations, **factory, **options)

    def extra_repr(self) -> str:
        return f"out_caps={self.beta_u.shape[0]}, iterations={self.iterations}, strategy={self.strategy!r}"
