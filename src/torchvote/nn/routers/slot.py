"""Slot attention's loop as a capsule router (Locatello et al. 2020, Algorithm 1). See
:func:`torchvote.functional.routing.slot_routing`."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from torchvote.functional.routing import RoutingVotes, slot_routing
from torchvote.nn.routers.base import Router, RoutingResult, register_router
from torchvote.tracing import under_autograd_transforms
from torchvote.validation import check_float_dtype, check_positive_int

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

    Args:
        out_caps: output capsules (slots).
        out_dim: their size.
        iterations: passes (3 in the paper).
        hidden_dim: the update MLP's hidden size (default ``2 * out_dim``).
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``iterations`` < 1 or non-positive sizes; (in ``forward``) ``activations``,
            which slot routing does not use.
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
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.iterations = check_positive_int(iterations, "iterations")
        check_positive_int(out_caps, "out_caps")
        check_positive_int(out_dim, "out_dim")
        hidden_dim = 2 * out_dim if hidden_dim is None else check_positive_int(hidden_dim, "hidden_dim")
        self.initial_slots = nn.Parameter(torch.randn(out_caps, out_dim, **factory) * out_dim**-0.5)
        self.norm = nn.LayerNorm(out_dim, **factory)
        self.to_query = nn.Linear(out_dim, out_dim, bias=False, **factory)
        self.update = SlotUpdate(out_dim, hidden_dim, factory)

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        self.refuse_activations(activations)
        outputs, couplings = slot_routing(
            votes,
            self.initial_slots,
            query=lambda slots: self.to_query(self.norm(slots)),
            update=self.update,
            iterations=self.iterations,
        )
        return RoutingResult(outputs, couplings)

    def layer_sizes(self) -> dict[str, int]:
        return {"out_caps": self.initial_slots.shape[0], "out_dim": self.initial_slots.shape[1]}

    @classmethod
    def from_layer(cls, *, in_caps, out_caps, out_dim, iterations, factory, **options) -> SlotRouter:
        return cls(out_caps=out_caps, out_dim=out_dim, iterations=iterations, **factory, **options)
