"""What every router shares: the :class:`Router` base class, :class:`RoutingResult`, and the
registry behind :func:`make_router`.

A router owns what a routing method learns (a bias, EM's ``beta_u`` and ``beta_a``, a layer norm,
a log prior, a GRU) around one call of the method's pure function in
:mod:`torchvote.functional.routing` or :mod:`torchvote.functional.em`.

**To add a router**, copy the shortest file of this package (``uniform.py``), then:

1. write the math as a function of ``torchvote.functional`` (votes ``(batch..., out_caps,
   in_caps, dim)`` in, ``(outputs, couplings (batch..., out_caps, in_caps))`` out) and add its
   name to :func:`torchvote.functional.routing.list_routers`;
2. give the class a ``name``, ``iterative`` (does ``iterations`` mean anything to it) and
   ``uses_activations`` (does it weigh votes by the input capsules' activations, as EM routing),
   a keyword-only ``__init__`` that validates its options, ``forward`` (a router that does not use
   activations refuses them with :meth:`Router.refuse_activations`), ``from_layer`` (how
   :func:`make_router` builds it from a capsule layer's sizes) and ``layer_sizes`` (the sizes its
   parameters fix, which a layer given the router checks); a router with an optional bias
   subclasses :class:`BiasedRouter`, which has the bias, ``from_layer`` and ``layer_sizes``;
3. decorate it with :func:`register_router` and import it in ``routers/__init__.py``.

Layout: receivers first, as everywhere in torchvote: votes ``(batch..., out_caps, in_caps,
dim)``, couplings ``(batch..., out_caps, in_caps)``, input activations ``(batch..., in_caps)``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from torchvote.functional.routing import RoutingVotes, _votes_shape, as_routing_votes, list_routers
from torchvote.functional.voting import Votes, _votes_device, routed_in_dtype
from torchvote.tracing import register_output
from torchvote.validation import (
    ArgumentTypeError,
    autocast_enabled,
    check_flag,
    check_float_dtype,
    check_positive_int,
    first_parameter,
    is_integer,
)

__all__ = [
    "BiasedRouter",
    "Router",
    "RoutingResult",
    "is_iterative",
    "is_redefinition",
    "layer_iterations",
    "make_router",
    "register_router",
    "registered_routers",
]

#: The routing iterations of an iterative router built by name when none are given.
DEFAULT_ITERATIONS = 3


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


register_output(RoutingResult)  # a pytree node: torch.export can return it


def result_in_dtype(result: RoutingResult, dtype: torch.dtype) -> RoutingResult:
    """``result`` with its outputs, couplings and activations in ``dtype`` where ``torch.autocast``
    made them another (:func:`~torchvote.functional.voting.routed_in_dtype`).

    Args:
        result: a router's result.
        dtype: the dtype the call returns without autocast.

    Returns:
        ``result``, or a copy with those three tensors cast.
    """
    outputs, couplings, activations = routed_in_dtype(dtype, result.outputs, result.couplings,
                                                      result.activations)
    if outputs is result.outputs and couplings is result.couplings and activations is result.activations:
        return result
    return dataclasses.replace(result, outputs=outputs, couplings=couplings, activations=activations)


class Router(nn.Module):
    """Base class: ``forward(votes, *, activations=None) -> RoutingResult``.

    ``votes`` is a tensor ``(batch..., out_caps, in_caps, out_dim)`` or a
    :class:`~torchvote.functional.voting.Votes` object (e.g.
    :class:`~torchvote.functional.routing_votes.LinearVotes`, never materialised).

    Under ``torch.autocast`` a router returns its outputs, couplings and activations in the votes'
    dtype, as without autocast (float32 for float32 votes): the routing functions do, and a router
    whose own steps run under autocast (a layer norm of materialised votes, EM's materialised
    votes) casts its result back with :func:`result_in_dtype`.
    """

    #: the name :func:`make_router` knows it by
    name: ClassVar[str] = ""
    #: whether ``iterations`` means anything to it (False: one pass, and a layer given the router
    #: by name warns of an explicit ``iterations`` other than 1: :func:`layer_iterations`)
    iterative: ClassVar[bool] = False
    #: whether it weighs each vote by its input capsule's activation (``activations=``)
    uses_activations: ClassVar[bool] = False

    def forward(self, votes: RoutingVotes, *, activations: Tensor | None = None) -> RoutingResult:
        raise NotImplementedError

    def refuse_activations(self, activations: Tensor | None) -> None:
        """What ``forward`` of a router that does not use activations calls first.

        Raises:
            ValueError: if ``activations`` were given (they would be silently ignored).
        """
        if activations is not None:
            raise ValueError(
                f"activations apply only to routers that use them (uses_activations, e.g. the 'em' "
                f"router); the {self.name!r} router would ignore them"
            )

    def check_votes_for_norm(self, votes: RoutingVotes, norm: nn.LayerNorm) -> Votes:
        """What ``forward`` of a router that layer-normalises the votes (or the poses formed from
        them) calls before the norm, whose own errors name no argument of the router.

        Args:
            votes: the router's ``votes``.
            norm: the router's layer norm over the votes' features.

        Returns:
            ``votes`` as a votes object (:func:`~torchvote.functional.routing.as_routing_votes`).

        Raises:
            ValueError: votes of another ``out_dim`` than ``norm`` normalises; a votes tensor of
                fewer than 3 dimensions; votes on another device than ``norm``'s parameters.
            TypeError: votes neither a tensor nor a votes object; votes not of ``norm``'s dtype
                (outside ``torch.autocast``).
            ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) a votes tensor that is not
                floating point.
        """
        votes = as_routing_votes(votes)
        shape, size = _votes_shape(votes), norm.normalized_shape[0]
        if shape is not None and shape[-1] != size:
            raise ValueError(f"votes must have out_dim={size} features (the layer norm's), got shape {shape}")
        return self.check_votes_beside(votes, norm.weight)

    def check_votes_beside(self, votes: RoutingVotes, parameter: Tensor | None = None) -> Votes:
        """What ``forward`` of a router with parameters calls before routing: votes of the
        parameters' dtype (outside ``torch.autocast``) and on their device, refused by the votes'
        name. The routing function's own checks blamed the parameter (``log_prior has dtype
        torch.float32 but the votes are torch.float16``), a layer norm failed naming nothing, and
        ``meta`` votes beside CPU parameters were routed without a word.

        Args:
            votes: the router's ``votes``.
            parameter: the parameter to compare with (default: the router's first; a router
                without parameters takes any dtype and device).

        Returns:
            ``votes`` as a votes object (:func:`~torchvote.functional.routing.as_routing_votes`).

        Raises:
            TypeError: votes neither a tensor nor a votes object, or not of the parameters' dtype
                (outside ``torch.autocast``).
            ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) a votes tensor that is not
                floating point.
            ValueError: a votes tensor of fewer than 3 dimensions; votes on another device than
                the parameters.
        """
        votes = as_routing_votes(votes)
        if parameter is None:
            parameter = first_parameter(self)
        if parameter is None:
            return votes
        if votes.dtype != parameter.dtype and not autocast_enabled(parameter.device.type):
            raise TypeError(  # votes may be a Votes object: its dtype, not check_input_dtype's tensor
                f"votes have dtype {votes.dtype} but the router's parameters are {parameter.dtype}: "
                f"convert the votes or the router, or run under torch.autocast"
            )
        device = _votes_device(votes)
        if device is not None and device != parameter.device:
            raise ValueError(
                f"votes are on {device} but the router's parameters are on {parameter.device}: move "
                f"one of them (e.g. router.to({str(device)!r}))"
            )
        return votes

    def layer_sizes(self) -> dict[str, int]:
        """The layer sizes (of ``in_caps``, ``out_caps``, ``out_dim``) this router's parameters were
        built for; empty if it fits any layer."""
        return {}

    def first_passes(self, passes: int) -> Router:
        """This router stopped after its first ``passes`` passes: a shallow copy sharing the
        parameters (what the pictures of each pass route with). A router that does not iterate
        is returned as it is.

        Raises:
            ValueError: ``passes`` not in ``1 .. iterations``.
        """
        if not self.iterative:
            return self
        total = self.iterations  # type: ignore[attr-defined]  # every iterative router has it
        if not (is_integer(passes) and 1 <= passes <= total):
            raise ValueError(f"passes must be an integer in [1, {total}], got {passes!r}")
        router = copy.copy(self)
        router.iterations = int(passes)
        return router

    def check_vote_sizes(self, votes: RoutingVotes) -> None:
        """What ``forward`` of a router with sized parameters calls first: votes ``(batch...,
        out_caps, in_caps, out_dim)`` of the sizes of :meth:`layer_sizes` (the parameters' own
        broadcast errors named ``beta_u``, ``slots`` or ``log_prior``, no argument of the call).

        Raises:
            ValueError: naming the first size that differs and the votes' shape.
        """
        shape = _votes_shape(as_routing_votes(votes))
        if shape is None or len(shape) < 3:
            return  # a votes object that does not say, or too few axes: the routing's own checks
        given = {"out_caps": shape[-3], "in_caps": shape[-2], "out_dim": shape[-1]}
        for name, built in self.layer_sizes().items():
            if given[name] not in (built, -1):  # -1: shared votes, receivers from the logits
                raise ValueError(
                    f"votes must have {name}={built} (what the {self.name!r} router was built for; "
                    f"votes are (batch..., out_caps, in_caps, out_dim)), got shape {shape}"
                )

    def check_layer_sizes(self, argument: str, **sizes: int) -> None:
        """Refuse to serve a layer of other ``sizes`` than :meth:`layer_sizes`.

        Args:
            argument: the name the layer took the router by, for the message.
            **sizes: the layer's ``in_caps``, ``out_caps``, ``out_dim`` (those it knows).

        Raises:
            ValueError: naming the first size that differs.
        """
        for name, built in self.layer_sizes().items():
            if name in sizes and sizes[name] != built:
                raise ValueError(
                    f"{argument} was built for {name}={built}, but the layer has {name}={sizes[name]}"
                )

    @classmethod
    def from_layer(
        cls, *, in_caps: int, out_caps: int, out_dim: int, iterations: int, factory: dict, **options: Any
    ) -> Router:
        """Build the router for a capsule layer of these sizes (what :func:`make_router` calls)."""
        raise NotImplementedError


_REGISTRY: dict[str, type[Router]] = {}


def registered_routers() -> list[str]:
    """The names :func:`make_router` builds: torchvote's own
    (:func:`~torchvote.functional.routing.list_routers`) and any a user registered.

    Returns:
        The names, sorted.
    """
    return sorted(_REGISTRY)


def is_redefinition(registered: type, new: type) -> bool:
    """Whether ``new`` is the class ``registered`` defined again: the same module and qualified
    name, as a notebook cell run again or a module reloaded makes it (a new class object each
    time). The registries (:func:`register_router`,
    :func:`~torchvote.models.registry.register_model`) let such a class replace the one they hold
    under its name, where another class taking the name is refused.

    Args:
        registered: the class a registry holds under a name.
        new: the class being registered under that name.

    Returns:
        ``True`` where ``new`` may replace ``registered``.
    """
    return (registered.__module__, registered.__qualname__) == (new.__module__, new.__qualname__)


def register_router(cls: type[Router]) -> type[Router]:
    """Class decorator: make ``cls`` buildable by ``make_router(cls.name, ...)``, and so by
    ``CapsuleLinear(routing=cls.name)`` and every capsule model's ``router=`` (a run of such a
    model needs the registration again where its checkpoint is loaded); a user's own router is
    registered the same way as torchvote's.

    Args:
        cls: a :class:`Router` subclass with a ``name``.

    Returns:
        ``cls``, registered.

    Raises:
        ValueError: ``cls`` has no ``name`` (a non-empty string), or another class is registered
            under that name (a class of the same module and qualified name, such as a notebook
            cell run again defines, replaces the one registered: :func:`is_redefinition`).
    """
    if not isinstance(cls.name, str) or not cls.name:
        raise ValueError(
            f"{cls.__name__} needs a non-empty `name` (a class attribute, the name make_router "
            f"knows it by) to be registered, got {cls.name!r}"
        )
    registered = _REGISTRY.get(cls.name)
    if registered is not None and not is_redefinition(registered, cls):
        raise ValueError(f"a router named {cls.name!r} is already registered by {registered!r}")
    _REGISTRY[cls.name] = cls
    return cls


class BiasedRouter(Router):
    """Base class of the routers with an optional learned bias added to the weighted sum of the
    votes before the nonlinearity (dynamic routing, uniform couplings): its keyword arguments and
    ``from_layer``. A subclass takes its own options and passes ``**bias_options`` on.

    Args:
        bias: learn a zero-initialised bias ``(out_caps, out_dim)`` (the authors' code of Sabour
            et al. 2017); ``self.bias`` is ``None`` without it.
        out_caps: needed with ``bias``.
        out_dim: needed with ``bias``.
        device: for the bias.
        dtype: for the bias.

    Raises:
        ValueError: ``bias`` without ``out_caps`` and ``out_dim``, or with sizes that are not
            positive integers.
        TypeError: a ``bias`` that is not a bool.
    """

    def __init__(
        self,
        *,
        bias: bool = False,
        out_caps: int | None = None,
        out_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.bias: nn.Parameter | None = None
        check_float_dtype(dtype)
        if check_flag(bias, "bias"):
            if out_caps is None or out_dim is None:
                raise ValueError("bias=True needs out_caps and out_dim")
            check_positive_int(out_caps, "out_caps")
            check_positive_int(out_dim, "out_dim")
            self.bias = nn.Parameter(torch.zeros(out_caps, out_dim, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """Zero the bias, as the constructor does (after ``to_empty()`` of a module built on the
        ``"meta"`` device)."""
        if self.bias is not None:
            with torch.no_grad():
                self.bias.zero_()

    def layer_sizes(self) -> dict[str, int]:
        if self.bias is None:
            return {}
        return {"out_caps": self.bias.shape[0], "out_dim": self.bias.shape[1]}

    def extra_repr(self) -> str:
        """``bias=True`` where the router learns one (a parameter: ``repr`` lists no parameter)."""
        return "" if self.bias is None else "bias=True"

    def _with_bias(self, options: str) -> str:
        """A subclass's ``extra_repr``: its ``options``, then the bias where there is one."""
        return ", ".join(text for text in (options, BiasedRouter.extra_repr(self)) if text)

    @classmethod
    def from_layer(
        cls, *, in_caps: int, out_caps: int, out_dim: int, iterations: int, factory: dict, **options: Any
    ) -> Router:
        """The router with the layer's output sizes (for ``bias``) and, if it is ``iterative``, its
        ``iterations``."""
        if cls.iterative:
            options = {"iterations": iterations, **options}
        return cls(out_caps=out_caps, out_dim=out_dim, **factory, **options)


def is_iterative(name: str) -> bool:
    """Whether the registered router ``name`` iterates, read from its class (nothing is built).

    Args:
        name: a router name (:func:`registered_routers`).

    Returns:
        The class's ``iterative``; ``False`` for a name that is not registered (whose build
        fails with :func:`make_router`'s own error).
    """
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    return cls is not None and cls.iterative


def layer_iterations(name: str, iterations: int | None) -> int:
    """The ``iterations`` a layer's own argument gives the router it builds by ``name`` (what
    :class:`~torchvote.nn.capsules.CapsuleLinear` calls before :func:`make_router`).

    A one-pass router (``iterative = False``: ``"uniform"``, ``"self_attention"``) runs once
    whatever ``iterations`` says. A count other than 1 set for it explicitly therefore changes
    nothing, and says so with a ``UserWarning`` (once per layer built). Not an error: code that
    sweeps every router with one ``iterations`` setting (a router swap) builds the one-pass
    routers too, and they are right to run once. ``None`` (not given) and ``1`` are silent.

    Args:
        name: the router's name (an unknown one is left to :func:`make_router`'s own error).
        iterations: the layer's ``iterations`` argument, ``None`` when not given.

    Returns:
        ``iterations``, or :data:`DEFAULT_ITERATIONS` (3) when ``None``.

    Raises:
        ValueError: ``iterations`` that is not a positive integer.

    Warns:
        UserWarning: ``iterations`` other than 1 for a one-pass router, naming both.
    """
    if iterations is None:
        return DEFAULT_ITERATIONS
    check_positive_int(iterations, "iterations")
    if iterations != 1 and isinstance(name, str) and name in _REGISTRY and not is_iterative(name):
        warnings.warn(
            f"iterations={iterations} has no effect on the {name!r} router, which routes in one "
            f"pass (it is not iterative): leave iterations unset (or 1), or choose an iterative "
            f"router ({', '.join(repr(n) for n in registered_routers() if is_iterative(n))})",
            UserWarning,
            stacklevel=3,  # the caller of the layer's constructor
        )
    return int(iterations)


def make_router(
    name: str,
    *,
    in_caps: int,
    out_caps: int,
    out_dim: int,
    iterations: int = DEFAULT_ITERATIONS,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **options: Any,
) -> Router:
    """Build a router by name (``torchvote.functional.list_routers()`` lists them).

    Args:
        name: ``"dynamic"``, ``"em"``, ``"inverted_dot_product"``, ``"self_attention"``,
            ``"slot"`` or ``"uniform"``.
        in_caps: input capsules of the layer.
        out_caps: output capsules.
        out_dim: output capsule size.
        iterations: routing iterations of an iterative router. The one-pass routers
            (``"uniform"``, ``"self_attention"``: ``iterative`` is False) ignore it: this is the
            factory a model config calls with its one ``iterations`` field whichever router it
            names (e.g. ``EMCapsNet``'s, whose ``iterations`` also counts its EM layers'
            passes). A layer's own ``iterations`` argument goes through
            :func:`layer_iterations`, which warns when it is set for a one-pass router.
        device: for the router's parameters.
        dtype: for the router's parameters.
        **options: passed to the router's constructor (e.g. ``agreement="distance"``,
            ``detach_votes=True``, ``bias=True`` for dynamic routing).

    Returns:
        The router module.

    Raises:
        ValueError: an unknown name or option (one the router does not take, or ``factory``,
            which ``device`` and ``dtype`` make), ``iterations`` < 1 (checked for the one-pass
            routers too, which ignore it).

    Examples:
        >>> import torch
        >>> from torchvote.nn import make_router
        >>> _ = torch.manual_seed(0)
        >>> router = make_router("dynamic", in_caps=32, out_caps=10, out_dim=16, bias=True)
        >>> type(router).__name__, tuple(router.bias.shape)
        ('DynamicRouter', (10, 16))
        >>> result = router(torch.randn(2, 10, 32, 16))  # votes (batch, out_caps, in_caps, out_dim)
        >>> result.outputs.shape, result.couplings.shape
        (torch.Size([2, 10, 16]), torch.Size([2, 10, 32]))
    """
    # torchvote's own routers are all registered; a user's (register_router) may join them. Not an
    # assert: `python -O` would drop it, and a contributor's missing registration with it
    unregistered = sorted(set(list_routers()) - set(_REGISTRY))
    if unregistered:
        raise AssertionError(f"every listed router must be registered: {unregistered} are not")
    check_positive_int(iterations, "iterations")
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"routing must be one of {sorted(_REGISTRY)}, got {name!r}")
    factory = {"device": device, "dtype": check_float_dtype(dtype)}
    layer = {"in_caps": in_caps, "out_caps": out_caps, "out_dim": out_dim, "iterations": iterations}
    return build_router(
        _REGISTRY[name].from_layer, name, fixed={**layer, "factory": factory}, options=options,
        argument="options",
    )


def build_router(
    build: Callable[..., Router],
    name: str,
    *,
    fixed: Mapping[str, Any],
    options: Mapping[str, Any],
    argument: str,
) -> Router:
    """``build(**fixed, **options)``: a router from what a layer sets with its own arguments and
    the options a user gave it, with every bad option a ``ValueError`` that names it (what
    :func:`make_router` and the layers that build their router call; Python's own error of a
    repeated or unknown keyword names none of the user's arguments).

    Args:
        build: the router's class, its ``from_layer``, or :func:`make_router` of a name.
        name: the router's name, for the message.
        fixed: the keyword arguments the layer sets itself (sizes, ``iterations``, ``device``,
            ``dtype``).
        options: the user's options.
        argument: the name the user gave ``options`` by, for the message (``"router_options"``).

    Returns:
        The router.

    Raises:
        ValueError: an option that ``fixed`` already sets (naming ``argument`` and the key), or
            one the router does not take (its constructor's ``TypeError``).
    """
    clashes = sorted(set(options) & set(fixed))
    if clashes:
        raise ValueError(
            f"{argument} must not set {clashes[0]!r}: the layer's own argument sets it (for "
            f"routing={name!r})"
        )
    try:
        return build(**fixed, **options)
    except ArgumentTypeError:  # a value of the wrong type: its own message names it
        raise
    except TypeError as error:  # an option this router does not take
        raise ValueError(f"bad option for routing={name!r}: {error}") from None
