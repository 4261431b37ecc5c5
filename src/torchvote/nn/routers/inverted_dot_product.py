"""Inverted dot-product attention routing (Tsai et al. 2020, Procedure 1). See
:func:`torchvote.functional.routing.inverted_dot_product_routing`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchvote.functional.routing import RoutingVotes, inverted_dot_product_routing
from torchvote.nn.routers.base import Router, RoutingResult, register_router
from torchvote.validation import check_flag, check_float_dtype, check_positive_int

__all__ = ["InvertedDotProductRouter"]


@register_router
class InvertedDotProductRouter(Router):
    """Passes that replace the logits with the votes' agreement with the current poses, then a
    layer norm.

    Args:
        out_dim: pose size, for the layer norm.
        iterations: passes, the first uniform.
        elementwise_affine: give the layer norm a learned gain and bias (as the authors' code).
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``iterations`` < 1, a non-positive ``out_dim``; (in ``forward``)
            ``activations``, which this routing does not use, votes of another ``out_dim`` or on
            another device than the layer norm.
        TypeError: an ``elementwise_affine`` that is not a bool; (in ``forward``) votes not of
            the layer norm's dtype (outside ``torch.autocast``).
    """

    name = "inverted_dot_product"
    iterative = True

    def __init__(
        self,
        *,
        out_dim: int,
        iterations: int = 3,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.iterations = check_positive_int(iterations, "iterations")
        check_positive_int(out_dim, "out_dim")
        check_flag(elementwise_affine, "elementwise_affine")
        check_float_dtype(dtype)
        self.norm = nn.LayerNorm(out_dim, elementwise_affine=elementwise_affine, device=device, dtype=dtype)

    def extra_repr(self) -> str:
        return f"iterations={self.iterations}"

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        self.refuse_activations(activations)
        votes = self.check_votes_for_norm(votes, self.norm)
        outputs, couplings = inverted_dot_product_routing(
            votes, iterations=self.iterations, normalization=self.norm
        )
        return RoutingResult(outputs, couplings)

    def layer_sizes(self) -> dict[str, int]:
        return {"out_dim": self.norm.normalized_shape[0]}

    @classmethod
    def from_layer(cls, *, in_caps, out_caps, out_dim, iterations, factory, **options) -> Router:
        return cls(out_dim=out_dim, iterations=iterations, **factory, **options)
