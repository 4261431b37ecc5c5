"""Slot attention (Locatello et al. 2020): the standalone module with its own key, query and
value projections and sampled slots. The loop is :func:`torchvote.functional.routing.slot_attention`;
as a capsule router see :mod:`torchvote.nn.routers.slot`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchvote.functional.routing import slot_attention
from torchvote.nn.initialization import scaled_normal_
from torchvote.nn.routers.slot import SlotUpdate
from torchvote.validation import (
    check_flag,
    check_float_dtype,
    check_input_dtype,
    check_inputs_beside,
    check_positive_int,
)

__all__ = ["SlotAttention"]


class SlotAttention(nn.Module):
    """Slot attention (Locatello et al. 2020, "Object-Centric Learning with Slot Attention").

    Algorithm 1: inputs are layer-normalised and projected once to keys and values; the slots are
    sampled from a learned Gaussian, then for ``iterations`` passes they compete for the inputs
    (softmax over the slots), take the weighted mean of the values, and are updated by a GRU and
    a residual MLP. The loop is one call of ``vote`` (see
    :func:`~torchvote.functional.routing.slot_attention`).

    Args:
        num_slots: slots ``K`` (can be overridden per call).
        input_dim: input features.
        slot_dim: slot (and key, query, value) size ``D``.
        iterations: ``T`` (3 in the paper).
        hidden_dim: the update MLP's hidden size (128 in the paper).
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``iterations`` < 1 or non-positive sizes.

    Examples:
        >>> import torch
        >>> from torchvote.nn import SlotAttention
        >>> _ = torch.manual_seed(0)
        >>> module = SlotAttention(num_slots=4, input_dim=32, slot_dim=16, hidden_dim=32)
        >>> inputs = torch.randn(2, 10, 32)  # (batch, inputs, input_dim)
        >>> slots, attention = module(inputs, return_attention=True)
        >>> slots.shape, attention.shape
        (torch.Size([2, 4, 16]), torch.Size([2, 4, 10]))
        >>> torch.allclose(attention.sum(dim=1), torch.ones(2, 10))  # the slots compete for each input
        True
    """

    def __init__(
        self,
        num_slots: int,
        input_dim: int,
        *,
        slot_dim: int = 64,
        iterations: int = 3,
        hidden_dim: int = 128,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(iterations, "iterations")
        for argument, value in (
            ("num_slots", num_slots),
            ("input_dim", input_dim),
            ("slot_dim", slot_dim),
            ("hidden_dim", hidden_dim),
        ):
            check_positive_int(value, argument)
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.num_slots = num_slots
        self.iterations = iterations
        self.slots_mu = nn.Parameter(torch.empty(1, 1, slot_dim, **factory))
        self.slots_log_sigma = nn.Parameter(torch.empty(1, 1, slot_dim, **factory))
        self.reset_parameters()  # here, before the layers below draw theirs: seeded runs draw as before
        self.norm_inputs = nn.LayerNorm(input_dim, **factory)
        self.norm_slots = nn.LayerNorm(slot_dim, **factory)
        self.to_key = nn.Linear(input_dim, slot_dim, bias=False, **factory)
        self.to_value = nn.Linear(input_dim, slot_dim, bias=False, **factory)
        self.to_query = nn.Linear(slot_dim, slot_dim, bias=False, **factory)
        self.update = SlotUpdate(slot_dim, hidden_dim, factory)

    def reset_parameters(self) -> None:
        """Draw the slots' mean again from ``N(0, 1 / slot_dim)`` and set their log deviation to 0,
        as the constructor does (after ``to_empty()`` of a module built on the ``"meta"`` device;
        the layers' parameters are theirs to reset)."""
        scaled_normal_(self.slots_mu, self.slots_mu.shape[-1] ** -0.5)
        with torch.no_grad():
            self.slots_log_sigma.zero_()

    def initial_slots(
        self, batch: int, num_slots: int, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(batch, num_slots, slot_dim)`` slots sampled from ``N(mu, sigma^2)``; the noise is
        drawn on ``generator``'s device (a CPU generator serves a CUDA module) and moved."""
        mu = self.slots_mu.expand(batch, num_slots, -1)  # (batch, K, slot_dim)
        if generator is None:  # as drawn below, and a symbolic batch (torch.export) stays symbolic
            noise = torch.randn_like(mu, memory_format=torch.contiguous_format)
        else:
            noise = torch.randn(mu.shape, generator=generator, device=generator.device, dtype=mu.dtype)
            noise = noise.to(mu.device)
        return mu + self.slots_log_sigma.exp() * noise

    def forward(
        self,
        inputs: Tensor,
        *,
        slots: Tensor | None = None,
        num_slots: int | None = None,
        mask: Tensor | None = None,
        return_attention: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Bind the inputs to slots.

        Args:
            inputs: ``(batch, inputs, input_dim)``.
            slots: ``(batch, K, slot_dim)`` initial slots; sampled when ``None``.
            num_slots: ``K`` for the sampled slots (default the constructor's), a positive
                integer; with ``slots``, it must be their ``K``.
            mask: boolean ``(batch, inputs)``, ``True`` for real inputs.
            return_attention: also return the last pass's ``(batch, K, inputs)`` attention.

        Returns:
            ``(batch, K, slot_dim)`` slots, and the attention if asked.

        Raises:
            ValueError: if ``inputs`` is not ``(batch, inputs, input_dim)``, ``slots`` not
                ``(batch, K, slot_dim)``, ``num_slots`` not a positive integer (or not ``slots``'
                ``K``), a ``mask`` not of shape ``(batch, inputs)``; ``inputs``, ``slots`` or
                ``mask`` on another device than the parameters.
            TypeError: ``inputs`` or ``slots`` not floating point or not of the parameters' dtype
                (outside ``torch.autocast``), a ``mask`` that is not a boolean tensor (for a
                tensor of another dtype an ``ArgumentTypeError``, a ``ValueError`` too), a
                ``return_attention`` that is not a bool.
        """
        check_flag(return_attention, "return_attention")
        dtype, slot_dim = self.slots_mu.dtype, self.slots_mu.shape[-1]
        for name, tensor in (("inputs", inputs), ("slots", slots)):
            if tensor is None:
                continue
            check_input_dtype(tensor, dtype, name)
        given = (("inputs", inputs),) if slots is None else (("inputs", inputs), ("slots", slots))
        check_inputs_beside(self.slots_mu, given, masks=(("mask", mask),))  # devices: dtypes above
        if inputs.dim() != 3 or inputs.shape[-1] != self.norm_inputs.normalized_shape[0]:
            raise ValueError(
                f"inputs must have shape (batch, inputs, {self.norm_inputs.normalized_shape[0]}), "
                f"got {tuple(inputs.shape)}"
            )
        if num_slots is not None:
            check_positive_int(num_slots, "num_slots")
        if slots is None:
            slots = self.initial_slots(inputs.shape[0], self.num_slots if num_slots is None else num_slots)
        elif slots.dim() != 3 or slots.shape[0] != inputs.shape[0] or slots.shape[-1] != slot_dim:
            raise ValueError(
                f"slots must have shape (batch={inputs.shape[0]}, K, slot_dim={slot_dim}), got "
                f"{tuple(slots.shape)}"
            )
        elif num_slots is not None and num_slots != slots.shape[1]:
            raise ValueError(
                f"num_slots={num_slots} does not match the K={slots.shape[1]} of the given slots"
            )
        normed = self.norm_inputs(inputs)
        keys, values = self.to_key(normed), self.to_value(normed)  # (b, n, D) each
        slots, attention = slot_attention(
            keys,
            values,
            slots,
            query=lambda s: self.to_query(self.norm_slots(s)),
            update=self.update,
            iterations=self.iterations,
            mask=mask,
        )
        return (slots, attention) if return_attention else slots
