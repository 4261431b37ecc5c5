"""Uniform couplings, no routing: the control. See
:func:`torchvote.functional.routing.uniform_routing`."""

from __future__ import annotations

from torch import Tensor

from torchvote.functional.routing import RoutingVotes, uniform_routing
from torchvote.nn.routers.base import Router, RoutingResult, optional_bias, register_router
from torchvote.validation import check_choice

__all__ = ["UniformRouter"]


@register_router
class UniformRouter(Router):
    """No routing: ``c_ij = 1 / out_caps`` (the control), one pass.

    Args:
        nonlinearity: ``"squash"`` (default), ``"efficient_squash"``, ``"layer_norm"``,
            ``"identity"``.
        bias: learn a bias ``(out_caps, out_dim)`` added before the nonlinearity.
        out_caps: needed with ``bias``.
        out_dim: needed with ``bias``.

    Raises:
        ValueError: an unknown nonlinearity, ``bias`` without sizes.
    """

    name = "uniform"
    iterative = False

    def __init__(
        self,
        *,
        nonlinearity: str = "squash",
        bias: bool = False,
        out_caps: int | None = None,
        out_dim: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.nonlinearity = check_choice(
            nonlinearity, ("squash", "efficient_squash", "layer_norm", "identity"), "nonlinearity"
        )
        self.bias = optional_bias(bias, out_caps, out_dim, {"device": device, "dtype": dtype})

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        outputs, couplings = uniform_routing(votes, nonlinearity=self.nonlinearity, bias=self.bias)
        return RoutingResult(outputs, couplings)

    @classmethod
    def from_layer(cls, *, in_caps, out_caps, out_dim, iterations, factory, **options) -> UniformRouter:
        return cls(out_caps=out_caps, out_dim=out_dim, **factory, **options)
