"""Uniform couplings, no routing: the control. See
:func:`torchvote.functional.routing.uniform_routing`."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from torchvote.functional.routing import RoutingVotes, uniform_routing
from torchvote.nn.routers.base import BiasedRouter, RoutingResult, register_router
from torchvote.validation import check_choice, check_keyword_options

__all__ = ["UniformRouter"]


@register_router
class UniformRouter(BiasedRouter):
    """No routing: ``c_ij = 1 / out_caps`` (the control), one pass.

    Not iterative (``iterative`` is False): its constructor takes no ``iterations``; a capsule
    layer given this router by name with ``iterations`` other than 1 warns that the count has no
    effect (:func:`~torchvote.nn.routers.base.layer_iterations`). The model configs and
    :func:`~torchvote.nn.routers.make_router`, which pass one count whatever the router, leave it
    unused without a word.

    Args:
        nonlinearity: ``"squash"`` (default), ``"efficient_squash"``, ``"layer_norm"``,
            ``"identity"``.
        **bias_options: ``bias`` (learn a bias ``(out_caps, out_dim)`` added before the
            nonlinearity), ``out_caps``, ``out_dim``, ``device``, ``dtype``: see
            :class:`~torchvote.nn.routers.base.BiasedRouter`.

    Raises:
        ValueError: an unknown nonlinearity, ``bias`` without sizes; (in ``forward``)
            ``activations``, which uniform couplings do not use, or votes on another device than
            the bias.
        TypeError: (in ``forward``) votes not of the bias's dtype (outside ``torch.autocast``).
    """

    name = "uniform"
    iterative = False

    def __init__(
        self,
        *,
        nonlinearity: str = "squash",
        **bias_options: Any,
    ) -> None:
        check_keyword_options(bias_options, BiasedRouter.__init__, type(self).__name__)
        super().__init__(**bias_options)
        self.nonlinearity = check_choice(
            nonlinearity, ("squash", "efficient_squash", "layer_norm", "identity"), "nonlinearity"
        )

    def extra_repr(self) -> str:
        return self._with_bias(f"nonlinearity={self.nonlinearity!r}")

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        self.refuse_activations(activations)
        self.check_vote_sizes(votes)  # the bias's own error named the bias
        votes = self.check_votes_beside(votes)  # its dtype and device too
        outputs, couplings = uniform_routing(votes, nonlinearity=self.nonlinearity, bias=self.bias)
        return RoutingResult(outputs, couplings)
