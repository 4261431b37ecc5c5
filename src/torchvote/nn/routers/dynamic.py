"""Dynamic routing by agreement (Sabour, Frosst & Hinton 2017, Procedure 1). See
:func:`torchvote.functional.routing.dynamic_routing`."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from torchvote.functional.routing import RoutingVotes, dynamic_routing
from torchvote.nn.routers.base import BiasedRouter, RoutingResult, register_router
from torchvote.validation import check_choice, check_flag, check_keyword_options, check_positive_int

__all__ = ["DynamicRouter"]


@register_router
class DynamicRouter(BiasedRouter):
    """Dynamic routing: ``iterations`` passes, the agreement accumulated into the logits.

    Args:
        iterations: routing iterations (3 in the paper).
        agreement: ``"dot"`` (the paper) or ``"distance"`` (negative squared distance).
        detach_votes: stop gradients through the votes in all but the last iteration.
        **bias_options: ``bias`` (learn a bias ``(out_caps, out_dim)`` added before the squash, as
            the authors' code), ``out_caps``, ``out_dim``, ``device``, ``dtype``: see
            :class:`~torchvote.nn.routers.base.BiasedRouter`.

    Raises:
        ValueError: ``iterations`` < 1, an unknown agreement, ``bias`` without sizes; (in
            ``forward``) ``activations``, which dynamic routing does not use, or votes on another
            device than the bias.
        TypeError: ``detach_votes`` or ``bias`` that is not a bool; (in ``forward``) votes not
            of the bias's dtype (outside ``torch.autocast``).

    Examples:
        >>> import torch
        >>> from torchvote.nn import DynamicRouter
        >>> _ = torch.manual_seed(0)
        >>> router = DynamicRouter(iterations=3, agreement="distance")
        >>> result = router(torch.randn(2, 10, 32, 16))  # votes (batch, out_caps, in_caps, out_dim)
        >>> result.outputs.shape, result.activations is None
        (torch.Size([2, 10, 16]), True)
        >>> torch.allclose(result.couplings.sum(dim=-2), torch.ones(2, 32))
        True
    """

    name = "dynamic"
    iterative = True

    def __init__(
        self,
        *,
        iterations: int = 3,
        agreement: str = "dot",
        detach_votes: bool = False,
        **bias_options: Any,
    ) -> None:
        check_keyword_options(bias_options, BiasedRouter.__init__, type(self).__name__)
        super().__init__(**bias_options)
        self.iterations = check_positive_int(iterations, "iterations")
        self.agreement = check_choice(agreement, ("dot", "distance"), "agreement")
        self.detach_votes = check_flag(detach_votes, "detach_votes")

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        self.refuse_activations(activations)
        self.check_vote_sizes(votes)  # the bias's own error named the bias
        votes = self.check_votes_beside(votes)  # its dtype and device too
        outputs, couplings = dynamic_routing(
            votes,
            iterations=self.iterations,
            agreement=self.agreement,
            detach_votes=self.detach_votes,
            bias=self.bias,
        )
        return RoutingResult(outputs, couplings)

    def extra_repr(self) -> str:
        return self._with_bias(
            f"iterations={self.iterations}, agreement={self.agreement!r}, detach_votes={self.detach_votes}"
        )
