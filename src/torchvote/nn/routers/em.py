"""EM routing of matrix capsules (Hinton, Sabour & Frosst 2018, Procedure 1). See
:func:`torchvote.functional.em.em_routing`.

One module for every layer that routes by EM: :class:`~torchvote.nn.capsules.CapsuleLinear`
(``routing="em"``) and the matrix-capsule layers of :mod:`torchvote.nn.em_capsules`, which call
:meth:`EMRouter.route` on all their patches at once (with ``sender_groups`` for the joint
normalisation of a convolutional layer).

**What the router learns, and in which units.** Procedure 1's output activation is
``a_i = logistic(lambda (beta_a - sum_h cost_i^h))`` with ``lambda`` tiny (the authors' schedule
``0.01 (1 - 0.95^(t+1))`` is 0.0005, 0.00098, 0.0014 over three iterations). An output capsule
that receives no votes has no cost, so its activation is ``logistic(lambda beta_a)``: with the
paper's ``beta_a`` as the parameter, that is 0.5 at initialisation and stays there, because a unit
step of ``beta_a`` moves the logit by ``lambda`` (Adam moves a parameter by about the learning rate
per step: 1e-3 x 0.0014 per step). Every absent class then sits at about 0.5 or above, and the
spread loss ``sum_{i != t} max(0, m - (a_t - a_i))^2`` cannot fall below ``9 (m - 0.5)^2`` for ten
classes (1.44 at the final margin 0.9), however well the model classifies. So the router keeps
``beta_a`` in the units it acts in, the logit: the parameter is ``activation_bias``, the logit of
an empty capsule at the last iteration (``beta_a = activation_bias / lambda_T``, exposed as the
:attr:`EMRouter.beta_a` property, the paper's value), and it starts at
``logit(empty_activation)``, an empty capsule at 0.1 by default. The authors' released code does
the same with a constant: ``logit = lambda (win - 5000 activation_bias)`` with the bias
initialised to 1.0 (class capsules) and 0.5 (convolutional capsules), an empty capsule's logit of
-1.8 and -3.6 at the last iteration (google-research/google-research, ``capsule_em/em_layers.py``);
IBM's implementation draws ``beta_a`` from a truncated normal of mean -1000 (logit about -1 to
-1.4) for the same reason (Gritzman 2019, IBM/matrix-capsules-with-em-routing, ``em_routing.py``).
``beta_u`` stays in the paper's units (nats per pose entry and unit of data), in which it already
moves the logit by ``lambda_T * pose_dim * sum_j R_ij a_j`` per unit.

**The amount of data per parent.** ``sum_j R_ij a_j`` grows with the layer's fan-in over fan-out:
a convolutional capsule of the small network gets a few votes' worth of data per patch where the
paper's class capsules get about a hundred, so with one ``lambda`` for every layer the cost, and
with it every activation, barely moves away from ``logistic(activation_bias)`` in the small layers.
``data_per_parent`` rescales the data to that many units for a parent that receives its uniform
share of fully active inputs (the cost is multiplied by ``data_per_parent * out_caps /
in_caps``), Gritzman 2019, "Avoiding implementation pitfalls of 'Matrix capsules with EM
routing'", sec. 2.2, and IBM's ``layer_norm_factor = 100 / (child_caps / parent_caps)``. The
factor counts the capsules of one patch: under a convolutional layer's joint normalisation
(the default of :class:`~torchvote.nn.ConvMatrixCapsules`) an input's assignments are shared among
the parents of every patch that holds it, up to ``ceil(K / stride)^2`` patches, so a parent
receives ``data_per_parent`` times the mean over its patch of one over the patches that hold each
input: inside the grid 11.1 of 100 at K = 3, stride 1 (every input in 9 patches), 44.4 at stride 2
(inputs in 1, 2 or 4 patches), more at the border. It is
applied as the equivalent scaling of ``lambda`` (so the routing function is untouched), and is off
by default (``None``): vector capsules routed by EM (CapsNet's class layer) already receive about
29 inputs per parent, and their tiny votes (variances at the ``eps`` floor) saturate every
activation when the cost is scaled up; :class:`~torchvote.models.em_capsnet.EMCapsNet` turns it on
for its matrix capsules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from torchvote.functional.em import (
    EMStrategy,
    InverseTemperature,
    default_inverse_temperature,
    em_routing,
    inverse_temperature_schedule,
)
from torchvote.functional.em_kernel import STRATEGIES, PerSenderVotes, SenderGroups
from torchvote.functional.routing import RoutingVotes, as_routing_votes
from torchvote.nn.routers.base import Router, RoutingResult, register_router, result_in_dtype
from torchvote.validation import (
    check_choice,
    check_float_dtype,
    check_in_range,
    check_inputs_beside,
    check_positive_float,
    check_positive_int,
)

__all__ = ["EMRouter"]


@register_router
class EMRouter(Router):
    """EM routing; learns ``beta_u`` and the activation bias per output capsule (type).

    Args:
        out_caps: output capsules (types), the length of ``beta_u`` and ``activation_bias``.
        iterations: EM iterations (3 in the paper).
        inverse_temperature: the ``lambda_t`` schedule (a callable of the 0-based iteration, one
            value per iteration, or a constant); default ``0.01 (1 - 0.95^(t+1))``.
        eps: variance floor.
        strategy: how the routing runs (:func:`~torchvote.functional.em.em_routing`):
            ``"auto"`` (``"blocked"`` on CPU, ``"vectorized"`` on CUDA), ``"blocked"``,
            ``"vectorized"`` (double backward) or ``"compiled"`` (``torch.compile``, compiles per
            shape); the same numbers from each.
        empty_activation: the initial activation of an output capsule that receives no votes,
            in (0, 1): ``activation_bias`` starts at its logit (0.1: -2.197). See the module
            docstring for why not 0.5.
        data_per_parent: rescale the data each parent receives so that a uniform share of fully
            active inputs counts as this many units (100 in IBM's implementation) when each input
            is shared by the parents of one patch; jointly normalised convolutional inputs are
            shared by several patches and give a fraction of it (see the module docstring);
            ``None``: the paper's raw ``sum_j R_ij a_j``.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``iterations`` < 1, a bad schedule, ``eps``, ``strategy``,
            ``empty_activation`` or ``data_per_parent``.

    Examples:
        >>> import torch
        >>> from torchvote.nn import EMRouter
        >>> _ = torch.manual_seed(0)
        >>> router = EMRouter(out_caps=10, iterations=3)
        >>> votes = torch.randn(2, 10, 32, 16)  # (batch, out_caps, in_caps, pose_dim)
        >>> result = router(votes, activations=torch.rand(2, 32))  # input activations (batch, in_caps)
        >>> result.outputs.shape, result.activations.shape, result.couplings.shape
        (torch.Size([2, 10, 16]), torch.Size([2, 10]), torch.Size([2, 10, 32]))
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
        empty_activation: float = 0.1,
        data_per_parent: float | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.iterations = check_positive_int(iterations, "iterations")
        schedule = inverse_temperature_schedule(inverse_temperature, iterations)  # checked where it enters
        # a callable is kept (it may read its own state); anything else as the values checked, once:
        # an iterator given here was consumed by the check, and routing found it empty
        self.inverse_temperature = inverse_temperature if callable(inverse_temperature) else schedule
        self.eps = check_positive_float(eps, "eps")
        self.strategy = check_choice(strategy, STRATEGIES, "strategy")
        check_positive_int(out_caps, "out_caps")
        check_float_dtype(dtype)
        self.empty_activation = check_in_range(empty_activation, "empty_activation", 0.0, 1.0,
                                               include_low=False, include_high=False)
        if data_per_parent is not None:
            check_positive_float(data_per_parent, "data_per_parent")
        self.data_per_parent = data_per_parent
        # beta_a = activation_bias / lambda_T; a schedule that ends at 0 makes beta_a irrelevant.
        self._final_inverse_temperature = schedule[-1] if schedule[-1] > 0 else 1.0
        self.beta_u = nn.Parameter(torch.empty(out_caps, device=device, dtype=dtype))  # per output
        self.activation_bias = nn.Parameter(torch.empty(out_caps, device=device, dtype=dtype))
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(self._convert_beta_a)

    @property
    def beta_a(self) -> Tensor:
        """The paper's ``beta_a`` ``(out_caps,)``: ``activation_bias / lambda_T``, the value that
        :func:`~torchvote.functional.em.em_routing` takes (without ``data_per_parent``)."""
        return self.activation_bias / self._final_inverse_temperature

    def _convert_beta_a(self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args) -> None:
        """Checkpoints from before ``activation_bias`` kept the paper's ``beta_a``: convert it
        exactly (``activation_bias = lambda_T beta_a``), so they load to the same function."""
        if prefix + "beta_a" in state_dict and prefix + "activation_bias" not in state_dict:
            state_dict[prefix + "activation_bias"] = (  # type: ignore[index]
                state_dict.pop(prefix + "beta_a") * self._final_inverse_temperature  # type: ignore[attr-defined]
            )

    def route(
        self,
        votes: Tensor | PerSenderVotes,
        activations: Tensor,
        *,
        sender_groups: Tensor | SenderGroups | None = None,
        return_assignments: bool = False,
    ) -> tuple[Tensor, ...]:
        """:func:`~torchvote.functional.em.em_routing` with this router's offsets and options.

        Args:
            votes: ``(batch..., out_caps, in_caps, pose_dim)``, or a convolutional layer's
                :class:`~torchvote.functional.em_kernel.PerSenderVotes` (not yet formed).
            activations: ``(batch..., in_caps)``.
            sender_groups: ``None`` (each batch element on its own), or ``(L, in_caps)`` input
                capsule ids for the joint normalisation or their prepared
                :class:`~torchvote.functional.em_kernel.SenderGroups` (see ``em_routing``).
            return_assignments: also return ``R``.

        Returns:
            poses ``(batch..., out_caps, pose_dim)``, activations ``(batch..., out_caps)`` (and
            the assignments ``(batch..., out_caps, in_caps)``).
        """
        beta_a, inverse_temperature = self.beta_a, self.inverse_temperature
        if self.data_per_parent is not None:
            # cost * k with lambda, beta_a  ==  cost with k lambda, beta_a / k (same logit)
            scale = self.data_per_parent * votes.shape[-3] / votes.shape[-2]  # k = kappa I / J
            schedule = inverse_temperature_schedule(inverse_temperature, self.iterations)
            beta_a, inverse_temperature = beta_a / scale, [scale * value for value in schedule]
        return em_routing(
            votes,
            activations,
            self.beta_u,
            beta_a,
            iterations=self.iterations,
            inverse_temperature=inverse_temperature,
            eps=self.eps,
            sender_groups=sender_groups,
            strategy=self.strategy,
            return_assignments=return_assignments,
        )

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        """Route; ``activations`` ``(batch..., in_caps)`` default to ones (all inputs present).

        Raises:
            TypeError, ValueError: votes neither a floating-point tensor ``(batch..., out_caps,
                in_caps, pose_dim)`` nor a votes object; votes not of the router's dtype (outside
                ``torch.autocast``) or not on its device, as every router refuses them; what
                :func:`~torchvote.functional.em.em_routing` raises.
        """
        self.check_vote_sizes(votes)
        tensor = as_routing_votes(votes).materialize()  # EM reads them elementwise
        # float64 votes made float64 outputs of a float32 router: a layer silently of two precisions
        # (and on "meta" beside CPU parameters, garbage)
        check_inputs_beside(self.beta_u, (("votes", tensor),), where="the router's parameters")
        if activations is None:
            activations = tensor.new_ones(tensor.shape[:-3] + tensor.shape[-2:-1])  # (batch..., in_caps)
        poses, out_activations, assignments = self.route(tensor, activations, return_assignments=True)
        # in the votes' dtype: LinearVotes materialise in autocast's dtype under autocast
        return result_in_dtype(RoutingResult(poses, assignments, out_activations), votes.dtype)

    def reset_parameters(self) -> None:
        """``beta_u = 0`` and the activation bias at ``logit(empty_activation)``, as the constructor
        sets them (after ``to_empty()`` of a module built on the ``"meta"`` device)."""
        with torch.no_grad():
            self.beta_u.zero_()
            self.activation_bias.fill_(math.log(self.empty_activation / (1.0 - self.empty_activation)))

    def layer_sizes(self) -> dict[str, int]:
        return {"out_caps": self.beta_u.shape[0]}

    def first_passes(self, passes: int) -> EMRouter:
        """As :meth:`Router.first_passes`; a schedule given as one value per pass is cut to its
        first ``passes`` values (``beta_a`` stays the full router's: the same logits)."""
        router = super().first_passes(passes)
        if not callable(router.inverse_temperature):
            router.inverse_temperature = list(router.inverse_temperature)[: router.iterations]
        return router

    @classmethod
    def from_layer(cls, *, in_caps, out_caps, out_dim, iterations, factory, **options) -> EMRouter:
        return cls(out_caps=out_caps, iterations=iterations, **factory, **options)

    def extra_repr(self) -> str:
        text = (f"out_caps={self.beta_u.shape[0]}, iterations={self.iterations}, strategy={self.strategy!r}, "
                f"eps={self.eps}, empty_activation={self.empty_activation}")
        if self.data_per_parent is not None:
            text += f", data_per_parent={self.data_per_parent}"
        return text
