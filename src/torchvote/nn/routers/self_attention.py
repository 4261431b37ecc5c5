"""Efficient-CapsNet's self-attention routing (Mazzia et al. 2021, eqs. 3-6). See
:func:`torchvote.functional.routing.self_attention_routing`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchvote.functional.routing import RoutingVotes, efficient_squash, self_attention_routing
from torchvote.nn.routers.base import Router, RoutingResult, register_router
from torchvote.validation import check_flag, check_float_dtype, check_positive_int

__all__ = ["SelfAttentionRouter"]


@register_router
class SelfAttentionRouter(Router):
    """One pass: each vote's logit is its agreement with all the votes for the same output, plus
    a learned log prior; Efficient-CapsNet's squash.

    Not iterative (``iterative`` is False): its constructor takes no ``iterations``; a capsule
    layer given this router by name with ``iterations`` other than 1 warns that the count has no
    effect (:func:`~torchvote.nn.routers.base.layer_iterations`). The model configs and
    :func:`~torchvote.nn.routers.make_router`, which pass one count whatever the router, leave it
    unused without a word.

    Args:
        in_caps: input capsules, for the log prior.
        out_caps: output capsules, for the log prior.
        log_prior: learn the ``(out_caps, in_caps)`` prior added to the couplings (zeros at start).
            A checkpoint's ``(in_caps, out_caps)`` prior (the layout before receivers came first,
            e4e8d18) is transposed on loading when the two sizes differ; with ``in_caps ==
            out_caps`` the two layouts have one shape and the prior loads as saved (transpose
            such an old checkpoint's ``log_prior`` yourself).
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: non-positive sizes; (in ``forward``) ``activations``, which this routing does
            not use, or votes on another device than the log prior.
        TypeError: a ``log_prior`` that is not a bool; (in ``forward``) votes not of the log
            prior's dtype (outside ``torch.autocast``).
    """

    name = "self_attention"
    iterative = False

    def __init__(
        self,
        *,
        in_caps: int,
        out_caps: int,
        log_prior: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(in_caps, "in_caps")
        check_positive_int(out_caps, "out_caps")
        check_flag(log_prior, "log_prior")
        check_float_dtype(dtype)
        self.log_prior = (
            nn.Parameter(torch.zeros(out_caps, in_caps, device=device, dtype=dtype)) if log_prior else None
        )

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        self.refuse_activations(activations)
        self.check_vote_sizes(votes)
        votes = self.check_votes_beside(votes)  # the routing's own check blamed log_prior
        outputs, couplings = self_attention_routing(
            votes, log_prior=self.log_prior, nonlinearity=efficient_squash
        )
        return RoutingResult(outputs, couplings)

    def reset_parameters(self) -> None:
        """Zero the log prior, as the constructor does (after ``to_empty()`` of a module built on
        the ``"meta"`` device)."""
        if self.log_prior is not None:
            with torch.no_grad():
                self.log_prior.zero_()

    def extra_repr(self) -> str:
        return f"log_prior={self.log_prior is not None}"

    def layer_sizes(self) -> dict[str, int]:
        if self.log_prior is None:
            return {}
        return {"out_caps": self.log_prior.shape[0], "in_caps": self.log_prior.shape[1]}

    @classmethod
    def from_layer(cls, *, in_caps, out_caps, out_dim, iterations, factory, **options) -> SelfAttentionRouter:
        return cls(in_caps=in_caps, out_caps=out_caps, **factory, **options)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        key = prefix + "log_prior"
        prior = state_dict.get(key)
        if self.log_prior is not None and prior is not None and prior.shape != self.log_prior.shape \
                and prior.shape == self.log_prior.shape[::-1]:
            state_dict[key] = prior.transpose(0, 1)  # an (in_caps, out_caps) checkpoint
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
