"""Slot attention's loop as a capsule router (Locatello et al. 2020, Algorithm 1). See
:func:`torchvote.functional.routing.slot_routing`."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from torchvote.functional.nonlinearities import squash
from torchvote.functional.routing import RoutingVotes, slot_routing
from torchvote.nn.initialization import scaled_normal_
from torchvote.nn.routers.base import Router, RoutingResult, register_router, result_in_dtype
from torchvote.tracing import under_autograd_transforms
from torchvote.validation import check_flag, check_float_dtype, check_positive_int

__all__ = ["SlotRouter", "SlotUpdate"]


class SlotUpdate(nn.Module):
    """Slot attention's update: ``slots = GRU(updates, slots); slots += MLP(LayerNorm(slots))``.

    Args:
        dim: slot size.
        hidden_dim: the MLP's hidden size.
    """

    def __init__(self, dim: int, hidden_dim: int, factory: dict) -> None:
        super().__init__()
        self.gru = nn.GRUCell(dim, dim, **factory)
        self.norm = nn.LayerNorm(dim, **factory)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden_dim, **factory), nn.ReLU(), nn.Linear(hidden_dim, dim, **factory)
        )

    def forward(self, updates: Tensor, previous: Tensor) -> Tensor:
        """``(..., i, d)`` updates and previous slots -> ``(..., i, d)`` new slots."""
        previous = previous.expand_as(updates)
        if under_autograd_transforms(updates, previous):
            slots = self._gru_step(updates, previous)
        else:
            slots = self.gru(updates.reshape(-1, updates.shape[-1]), previous.reshape(-1, updates.shape[-1]))
            slots = slots.view_as(updates)  # (..., i, d)
        return slots + self.mlp(self.norm(slots))

    def _gru_step(self, inputs: Tensor, hidden: Tensor) -> Tensor:
        """``self.gru``'s step in plain operations (Cho et al. 2014, as ``nn.GRUCell`` documents it,
        gates in the order reset, update, new), for ``torch.func`` transforms and forward-mode AD:
        CUDA's fused GRU cell has no forward-mode derivative, and ``vmap`` has no batching rule for
        ``gru_cell`` (a slow fallback, which fails for per-sample parameter gradients).

        Args:
            inputs: ``(..., d)``.
            hidden: ``(..., d)``, the previous slots.

        Returns:
            ``(..., d)``: the new hidden state.
        """
        gru = self.gru
        reset_in, update_in, new_in = F.linear(inputs, gru.weight_ih, gru.bias_ih).chunk(3, dim=-1)
        reset_h, update_h, new_h = F.linear(hidden, gru.weight_hh, gru.bias_hh).chunk(3, dim=-1)
        reset = torch.sigmoid(reset_in + reset_h)
        update = torch.sigmoid(update_in + update_h)
        new = torch.tanh(new_in + reset * new_h)
        return (1 - update) * new + update * hidden


@register_router
class SlotRouter(Router):
    """The output capsules are slots: one learned initial slot each, a query, a GRU update.

    Algorithm 1 of Locatello et al. 2020 with the layer's per-pair votes as keys and values
    (:func:`~torchvote.functional.routing.slot_routing`). Two steps make the slots usable as
    capsules:

    - the votes are layer-normalised over their features first, as Algorithm 1 normalises its
      inputs (``normalize_votes``). Without it the votes of a freshly initialised capsule layer
      (``init_std`` 0.01: lengths about 1e-3) are too small to move the GRU beside the learned
      initial slots (lengths about 1): the small CapsNet's class capsules then varied by 2e-5 from
      image to image against 0.2 from class to class, and training never left chance;
    - the last slots are squashed (Sabour et al. 2017, eq. 1; ``squash_outputs``), so that their
      lengths lie in ``[0, 1)`` as the capsule heads' length scores and the margin loss expect. A
      GRU state's length is not bounded by 1, and with the margin loss the network settled on one
      length (about 0.25) for every class and image.

    Either alone left the small CapsNet at chance; together they took it from 11.3% to 94.7% MNIST
    test accuracy in 156 steps (seed 0, the router-swap row's CPU budget; ``docs/results.md``,
    row f).

    The layer norm makes every vote count alike whatever its length, as slot attention's inputs
    do: an input capsule's length (or, in :class:`~torchvote.models.em_capsnet.EMCapsNet`, the
    activation that scales its votes) no longer weighs its vote beyond the layer norm's ``eps``;
    ``normalize_votes=False`` keeps it. Layer-normalising the votes needs them whole: this router
    materialises streamed votes (``(batch..., out_caps, in_caps, out_dim)``).

    Args:
        out_caps: output capsules (slots).
        out_dim: their size.
        iterations: passes (3 in the paper).
        hidden_dim: the update MLP's hidden size (default ``2 * out_dim``).
        normalize_votes: layer-normalise each vote over its features, with a learned gain and
            bias, before the loop (default ``True``; ``False`` with ``squash_outputs=False``
            rebuilds the router of slot-routed checkpoints saved before these options existed,
            whose state has no ``norm_votes``).
        squash_outputs: squash the last slots (default ``True``; ``False`` returns the GRU's
            states).
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``iterations`` < 1 or non-positive sizes; (in ``forward``) ``activations``,
            which slot routing does not use, votes of another ``out_dim`` or on another device
            than the parameters.
        TypeError: ``normalize_votes`` or ``squash_outputs`` not a bool; (in ``forward``) votes
            not of the parameters' dtype (outside ``torch.autocast``).
    """

    name = "slot"
    iterative = True

    def __init__(
        self,
        *,
        out_caps: int,
        out_dim: int,
        iterations: int = 3,
        hidden_dim: int | None = None,
        normalize_votes: bool = True,
        squash_outputs: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.iterations = check_positive_int(iterations, "iterations")
        check_positive_int(out_caps, "out_caps")
        check_positive_int(out_dim, "out_dim")
        hidden_dim = 2 * out_dim if hidden_dim is None else check_positive_int(hidden_dim, "hidden_dim")
        self.squash_outputs = check_flag(squash_outputs, "squash_outputs")
        self.initial_slots = nn.Parameter(torch.empty(out_caps, out_dim, **factory))
        self.reset_parameters()  # here, before the layers below draw theirs: seeded runs draw as before
        normalize_votes = check_flag(normalize_votes, "normalize_votes")
        self.norm_votes = nn.LayerNorm(out_dim, **factory) if normalize_votes else None
        self.norm = nn.LayerNorm(out_dim, **factory)
        self.to_query = nn.Linear(out_dim, out_dim, bias=False, **factory)
        self.update = SlotUpdate(out_dim, hidden_dim, factory)

    def reset_parameters(self) -> None:
        """Draw the initial slots again from ``N(0, 1 / out_dim)``, as the constructor does (after
        ``to_empty()`` of a module built on the ``"meta"`` device; the layers' parameters are
        theirs to reset)."""
        scaled_normal_(self.initial_slots, self.initial_slots.shape[1] ** -0.5)

    def extra_repr(self) -> str:
        return f"iterations={self.iterations}, squash_outputs={self.squash_outputs}"

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        self.refuse_activations(activations)
        self.check_vote_sizes(votes)
        votes = self.check_votes_beside(votes)  # without norm_votes, slot_routing blamed the slots
        dtype = votes.dtype
        if self.norm_votes is not None:
            votes = self.check_votes_for_norm(votes, self.norm_votes)
            votes = self.norm_votes(votes.materialize())  # (..., i, j, d)
        outputs, couplings = slot_routing(
            votes,
            self.initial_slots,
            query=lambda slots: self.to_query(self.norm(slots)),
            update=self.update,
            iterations=self.iterations,
        )
        if self.squash_outputs:
            outputs = squash(outputs, dim=-1)  # (..., i, d), lengths in [0, 1)
        # in the votes' dtype: under autocast the norm of the materialised votes runs in autocast's
        return result_in_dtype(RoutingResult(outputs, couplings), dtype)

    def layer_sizes(self) -> dict[str, int]:
        return {"out_caps": self.initial_slots.shape[0], "out_dim": self.initial_slots.shape[1]}

    @classmethod
    def from_layer(cls, *, in_caps, out_caps, out_dim, iterations, factory, **options) -> SlotRouter:
        return cls(out_caps=out_caps, out_dim=out_dim, iterations=iterations, **factory, **options)
