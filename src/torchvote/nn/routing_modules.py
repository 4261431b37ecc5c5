"""Routers: the parameters of each routing method around one configuration of ``vote``.

A router takes a layer's votes and returns the output capsules. The math lives in
:mod:`torchvote.functional.routing` and :mod:`torchvote.functional.em`; a router owns
what is learned (a bias, EM's ``beta_u`` and ``beta_a``, a layer norm, a log prior, a GRU) and is
chosen by name in :class:`~torchvote.nn.capsules.CapsuleLinear` through :func:`make_router`.

Every router's ``forward(votes, *, activations=None)`` takes votes either as a tensor
``(batch..., out_caps, in_caps, out_dim)`` (receivers first) or as a
:class:`~torchvote.functional.voting.Votes` object (e.g.
:class:`~torchvote.functional.routing_votes.LinearVotes`, which never materialises them), and
returns a :class:`RoutingResult`.

:class:`SlotAttention` is the standalone slot-attention module (Locatello et al. 2020) with its
own key, query and value projections.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from torchvote.functional.em import (
    InverseTemperature,
    default_inverse_temperature,
    em_routing,
)
from torchvote.functional.routing import (
    RoutingVotes,
    dynamic_routing,
    efficient_squash,
    inverted_dot_product_routing,
    list_routers,
    self_attention_routing,
    slot_attention,
    slot_routing,
    uniform_routing,
)
from torchvote.validation import check_positive_int

__all__ = [
    "DynamicRouter",
    "EMRouter",
    "InvertedDotProductRouter",
    "Router",
    "RoutingResult",
    "SelfAttentionRouter",
    "SlotAttention",
    "SlotRouter",
    "UniformRouter",
    "make_router",
]


@dataclass
class RoutingResult:
    """What a router returns.

    Attributes:
        outputs: ``(batch..., out_caps, out_dim)`` output capsules (poses for EM routing).
        couplings: ``(batch..., out_caps, in_caps)`` the couplings (EM: assignments) of the last
            pass, receivers first, summing to 1 over ``out_caps``.
        activations: ``(batch..., out_caps)`` output activations (EM routing), else ``None``.
    """

    outputs: Tensor
    couplings: Tensor
    activations: Tensor | None = None


class Router(nn.Module):
    """Base class: ``forward(votes, *, activations=None) -> RoutingResult``."""

    #: the name :func:`make_router` knows it by
    name: str = ""

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        raise NotImplementedError


def _optional_bias(
    bias: bool, out_caps: int | None, out_dim: int | None, factory: dict
) -> nn.Parameter | None:
    if not bias:
        return None
    if out_caps is None or out_dim is None:
        raise ValueError("bias=True needs out_caps and out_dim")
    return nn.Parameter(torch.zeros(out_caps, out_dim, **factory))


class DynamicRouter(Router):
    """Dynamic routing (Sabour, Frosst & Hinton 2017, Procedure 1): see
    :func:`~torchvote.functional.routing.dynamic_routing`.

    Args:
        iterations: routing iterations (3 in the paper).
        agreement: ``"dot"`` (the paper) or ``"distance"`` (negative squared distance).
        detach_votes: stop gradients through the votes in all but the last iteration.
        bias: learn a bias ``(out_caps, out_dim)`` added before the squash (the authors' code).
        out_caps: needed with ``bias``.
        out_dim: needed with ``bias``.

    Raises:
        ValueError: ``iterations`` < 1, an unknown agreement, ``bias`` without sizes.
    """

    name = "dynamic"

    def __init__(
        self,
        *,
        iterations: int = 3,
        agreement: str = "dot",
        detach_votes: bool = False,
        bias: bool = False,
        out_caps: int | None = None,
        out_dim: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_positive_int(iterations, "iterations")
        if agreement not in ("dot", "distance"):
            raise ValueError(f"agreement must be 'dot' or 'distance', got {agreement!r}")
        self.iterations = iterations
        self.agreement = agreement
        self.detach_votes = detach_votes
        self.bias = _optional_bias(bias, out_caps, out_dim, {"device": device, "dtype": dtype})

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        outputs, couplings = dynamic_routing(
            votes,
            iterations=self.iterations,
            agreement=self.agreement,
            detach_votes=self.detach_votes,
            bias=self.bias,
        )
        return RoutingResult(outputs, couplings)

    def extra_repr(self) -> str:
        return f"iterations={self.iterations}, agreement={self.agreement!r}, detach_votes={self.detach_votes}"


class UniformRouter(Router):
    """No routing: ``c_ij = 1 / out_caps`` (the control), see
    :func:`~torchvote.functional.routing.uniform_routing`.

    Args:
        nonlinearity: ``"squash"`` (default), ``"efficient_squash"``, ``"layer_norm"``,
            ``"identity"``.
        bias: learn a bias ``(out_caps, out_dim)`` added before the nonlinearity.
        out_caps: needed with ``bias``.
        out_dim: needed with ``bias``.
    """

    name = "uniform"

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
        if nonlinearity not in ("squash", "efficient_squash", "layer_norm", "identity"):
            raise ValueError(
                "nonlinearity must be 'squash', 'efficient_squash', 'layer_norm' or 'identity', "
                f"got {nonlinearity!r}"
            )
        self.nonlinearity = nonlinearity
        self.bias = _optional_bias(bias, out_caps, out_dim, {"device": device, "dtype": dtype})

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        outputs, couplings = uniform_routing(votes, nonlinearity=self.nonlinearity, bias=self.bias)
        return RoutingResult(outputs, couplings)


def _votes_tensor(votes: RoutingVotes) -> Tensor:
    """Votes as a tensor ``(..., out_caps, in_caps, d)`` (EM needs them elementwise)."""
    return votes if isinstance(votes, Tensor) else votes.materialize()


class EMRouter(Router):
    """EM routing (Hinton, Sabour & Frosst 2018, Procedure 1): see
    :func:`~torchvote.functional.em.em_routing`.

    Learns ``beta_u`` and ``beta_a`` per output capsule (type).

    Args:
        out_caps: output capsules (types), the length of ``beta_u`` and ``beta_a``.
        iterations: EM iterations (3 in the paper).
        inverse_temperature: the ``lambda_t`` schedule; default ``0.01 (1 - 0.95^(t+1))``.
        eps: variance floor.

    Raises:
        ValueError: ``iterations`` < 1.
    """

    name = "em"

    def __init__(
        self,
        *,
        out_caps: int,
        iterations: int = 3,
        inverse_temperature: InverseTemperature = default_inverse_temperature,
        eps: float = 1e-6,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_positive_int(iterations, "iterations")
        factory = {"device": device, "dtype": dtype}
        self.iterations = iterations
        self.inverse_temperature = inverse_temperature
        self.eps = eps
        self.beta_u = nn.Parameter(torch.zeros(out_caps, **factory))
        self.beta_a = nn.Parameter(torch.zeros(out_caps, **factory))

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        """Route; ``activations`` ``(batch..., in_caps)`` default to ones (all inputs present)."""
        tensor = _votes_tensor(votes)
        if activations is None:
            activations = tensor.new_ones(tensor.shape[:-3] + tensor.shape[-2:-1])  # (b..., in_caps)
        poses, out_activations, assignments = em_routing(
            tensor,
            activations,
            self.beta_u,
            self.beta_a,
            iterations=self.iterations,
            inverse_temperature=self.inverse_temperature,
            eps=self.eps,
            return_assignments=True,
        )
        return RoutingResult(poses, assignments, out_activations)

    def extra_repr(self) -> str:
        return f"out_caps={self.beta_u.shape[0]}, iterations={self.iterations}"


class InvertedDotProductRouter(Router):
    """Inverted dot-product attention routing (Tsai et al. 2020, Procedure 1): see
    :func:`~torchvote.functional.routing.inverted_dot_product_routing`.

    Args:
        out_dim: pose size, for the layer norm.
        iterations: passes, the first uniform.
        elementwise_affine: give the layer norm a learned gain and bias (as the authors' code).
    """

    name = "inverted_dot_product"

    def __init__(
        self, *, out_dim: int, iterations: int = 3, elementwise_affine: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__()
        check_positive_int(iterations, "iterations")
        self.iterations = iterations
        self.norm = nn.LayerNorm(out_dim, elementwise_affine=elementwise_affine, device=device, dtype=dtype)

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        outputs, couplings = inverted_dot_product_routing(
            votes, iterations=self.iterations, normalization=self.norm
        )
        return RoutingResult(outputs, couplings)


class SelfAttentionRouter(Router):
    """Efficient-CapsNet's self-attention routing (Mazzia et al. 2021): see
    :func:`~torchvote.functional.routing.self_attention_routing`.

    Args:
        in_caps: input capsules, for the log prior.
        out_caps: output capsules, for the log prior.
        log_prior: learn the ``(out_caps, in_caps)`` prior added to the couplings (zeros at start).
            A checkpoint's ``(in_caps, out_caps)`` prior (the layout before receivers came first)
            is transposed on loading.
    """

    name = "self_attention"

    def __init__(
        self, *, in_caps: int, out_caps: int, log_prior: bool = True, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.log_prior = (
            nn.Parameter(torch.zeros(out_caps, in_caps, device=device, dtype=dtype)) if log_prior else None
        )

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        key = prefix + "log_prior"
        prior = state_dict.get(key)
        if self.log_prior is not None and prior is not None and prior.shape != self.log_prior.shape \
                and prior.shape == self.log_prior.shape[::-1]:
            state_dict[key] = prior.transpose(0, 1)  # an (in_caps, out_caps) checkpoint
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        outputs, couplings = self_attention_routing(
            votes, log_prior=self.log_prior, nonlinearity=efficient_squash
        )
        return RoutingResult(outputs, couplings)


class _SlotUpdate(nn.Module):
    """Slot attention's update: ``slots = GRU(updates, slots); slots += MLP(LayerNorm(slots))``."""

    def __init__(self, dim: int, hidden_dim: int, factory: dict) -> None:
        super().__init__()
        self.gru = nn.GRUCell(dim, dim, **factory)
        self.norm = nn.LayerNorm(dim, **factory)
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden_dim, **factory), nn.ReLU(), nn.Linear(hidden_dim, dim, **factory)
        )

    def forward(self, updates: Tensor, previous: Tensor) -> Tensor:
        previous = previous.expand_as(updates)
        slots = self.gru(updates.reshape(-1, updates.shape[-1]), previous.reshape(-1, updates.shape[-1]))
        slots = slots.view_as(updates)  # (..., i, d)
        return slots + self.mlp(self.norm(slots))


class SlotRouter(Router):
    """Slot attention as a capsule router (see :func:`~torchvote.functional.routing.slot_routing`).

    Args:
        out_caps: output capsules (slots).
        out_dim: their size.
        iterations: passes (3 in the paper).
        hidden_dim: the update MLP's hidden size (default ``2 * out_dim``).
    """

    name = "slot"

    def __init__(
        self,
        *,
        out_caps: int,
        out_dim: int,
        iterations: int = 3,
        hidden_dim: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_positive_int(iterations, "iterations")
        factory = {"device": device, "dtype": dtype}
        self.iterations = iterations
        self.initial_slots = nn.Parameter(torch.randn(out_caps, out_dim, **factory) * out_dim**-0.5)
        self.norm = nn.LayerNorm(out_dim, **factory)
        self.to_query = nn.Linear(out_dim, out_dim, bias=False, **factory)
        self.update = _SlotUpdate(out_dim, hidden_dim or 2 * out_dim, factory)

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        outputs, couplings = slot_routing(
            votes,
            self.initial_slots,
            query=lambda slots: self.to_query(self.norm(slots)),
            update=self.update,
            iterations=self.iterations,
        )
        return RoutingResult(outputs, couplings)


def make_router(
    name: str,
    *,
    in_caps: int,
    out_caps: int,
    out_dim: int,
    iterations: int = 3,
    device=None,
    dtype=None,
    **options: Any,
) -> Router:
    """Build a router by name (``torchvote.functional.list_routers()`` lists them).

    Args:
        name: ``"dynamic"``, ``"em"``, ``"inverted_dot_product"``, ``"self_attention"``,
            ``"slot"`` or ``"uniform"``.
        in_caps: input capsules of the layer.
        out_caps: output capsules.
        out_dim: output capsule size.
        iterations: routing iterations (ignored by the one-pass routers).
        device: for the router's parameters.
        dtype: for the router's parameters.
        **options: passed to the router's constructor (e.g. ``agreement="distance"``,
            ``detach_votes=True``, ``bias=True`` for dynamic routing).

    Returns:
        The router module.

    Raises:
        ValueError: an unknown name or option.
    """
    factory = {"device": device, "dtype": dtype}
    builders: dict[str, Callable[[], Router]] = {
        "dynamic": lambda: DynamicRouter(
            iterations=iterations, out_caps=out_caps, out_dim=out_dim, **factory, **options
        ),
        "uniform": lambda: UniformRouter(out_caps=out_caps, out_dim=out_dim, **factory, **options),
        "em": lambda: EMRouter(out_caps=out_caps, iterations=iterations, **factory, **options),
        "inverted_dot_product": lambda: InvertedDotProductRouter(
            out_dim=out_dim, iterations=iterations, **factory, **options
        ),
        "self_attention": lambda: SelfAttentionRouter(
            in_caps=in_caps, out_caps=out_caps, **factory, **options
        ),
        "slot": lambda: SlotRouter(
            out_caps=out_caps, out_dim=out_dim, iterations=iterations, **factory, **options
        ),
    }
    assert set(builders) == set(list_routers()), "every listed router must be buildable"
    if name not in builders:
        raise ValueError(f"routing must be one of {sorted(builders)}, got {name!r}")
    try:
        return builders[name]()
    except TypeError as error:  # an option this router does not take
        raise ValueError(f"bad option for routing={name!r}: {error}") from None


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

    Raises:
        ValueError: ``iterations`` < 1 or non-positive sizes.
    """

    def __init__(
        self,
        num_slots: int,
        input_dim: int,
        *,
        slot_dim: int = 64,
        iterations: int = 3,
        hidden_dim: int = 128,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_positive_int(iterations, "iterations")
        for argument, value in (
            ("num_slots", num_slots),
            ("input_dim", input_dim),
            ("slot_dim", slot_dim),
            ("hidden_dim", hidden_dim),
        ):
            if value < 1:
                raise ValueError(f"{argument} must be >= 1, got {value}")
        factory = {"device": device, "dtype": dtype}
        self.num_slots = num_slots
        self.iterations = iterations
        self.slots_mu = nn.Parameter(torch.randn(1, 1, slot_dim, **factory) * slot_dim**-0.5)
        self.slots_log_sigma = nn.Parameter(torch.zeros(1, 1, slot_dim, **factory))
        self.norm_inputs = nn.LayerNorm(input_dim, **factory)
        self.norm_slots = nn.LayerNorm(slot_dim, **factory)
        self.to_key = nn.Linear(input_dim, slot_dim, bias=False, **factory)
        self.to_value = nn.Linear(input_dim, slot_dim, bias=False, **factory)
        self.to_query = nn.Linear(slot_dim, slot_dim, bias=False, **factory)
        self.update = _SlotUpdate(slot_dim, hidden_dim, factory)

    def initial_slots(
        self, batch: int, num_slots: int, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """``(batch, num_slots, slot_dim)`` slots sampled from ``N(mu, sigma^2)``."""
        mu = self.slots_mu.expand(batch, num_slots, -1)
        noise = torch.randn(mu.shape, generator=generator, device=mu.device, dtype=mu.dtype)
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
            num_slots: ``K`` for the sampled slots (default the constructor's).
            mask: boolean ``(batch, inputs)``, ``True`` for real inputs.
            return_attention: also return the last pass's ``(batch, K, inputs)`` attention.

        Returns:
            ``(batch, K, slot_dim)`` slots, and the attention if asked.

        Raises:
            ValueError: if ``inputs`` is not ``(batch, inputs, input_dim)``.
        """
        if inputs.dim() != 3 or inputs.shape[-1] != self.norm_inputs.normalized_shape[0]:
            raise ValueError(
                f"inputs must have shape (batch, inputs, {self.norm_inputs.normalized_shape[0]}), "
                f"got {tuple(inputs.shape)}"
            )
        if slots is None:
            slots = self.initial_slots(inputs.shape[0], num_slots or self.num_slots)
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
