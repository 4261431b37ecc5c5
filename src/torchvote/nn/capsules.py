"""Vector capsule layers: primary capsules and a routed fully connected capsule layer.

Sabour, Frosst & Hinton 2017, "Dynamic Routing Between Capsules", sec. 4: a convolution whose
channels at each position are grouped into capsules (``PrimaryCapsules``), then a layer where every
input capsule ``j`` votes ``u_hat_ij = W_ij u_j`` for every output capsule ``i`` and a router
reaches the consensus (``CapsuleLinear``).

Index legend: ``b`` batch, ``i`` receivers (output capsules), ``j`` senders (input capsules),
``d`` output capsule features, ``e`` input capsule features, ``t`` capsule types.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from torchvote.functional.nonlinearities import squash
from torchvote.functional.routing_votes import LinearVotes, SharedLinearVotes
from torchvote.nn.initialization import scaled_normal_
from torchvote.nn.routers import Router, RoutingResult, make_router
from torchvote.nn.routers.base import build_router, layer_iterations, result_in_dtype
from torchvote.nn.routing_strategy import STRATEGIES, RoutingStrategy, choose_strategy, compile_or_none
from torchvote.validation import (
    autocast_enabled,
    check_choice,
    check_device,
    check_flag,
    check_float_dtype,
    check_input_dtype,
    check_positive_float,
    check_positive_int,
)

__all__ = ["CapsuleLinear", "PrimaryCapsules", "check_feature_maps"]


def check_feature_maps(features: Tensor, conv: nn.Conv2d, argument: str = "features") -> None:
    """Refuse what ``conv`` (a capsule layer's input convolution) cannot take, before it does:
    the convolution's own errors name none of the layer's arguments, and an unbatched
    ``(channels, h, w)`` input passed it and failed in the capsule split. Shapes and dtypes only.

    Args:
        features: the layer's input, expected ``(b, in_channels, h, w)``.
        conv: the convolution that reads it.
        argument: the input's name, for the message.

    Raises:
        TypeError: ``features`` not a floating-point tensor of the convolution's dtype (outside
            ``torch.autocast``).
        ValueError: not 4-D, another channel count, a map smaller than the kernel (its
            dilated extent, after padding), or on another device than the convolution.
    """
    check_input_dtype(features, conv.weight.dtype, argument)
    check_device(features, conv.weight.device, argument)
    if features.dim() != 4 or features.shape[1] != conv.in_channels:
        raise ValueError(
            f"{argument} must have shape (batch, in_channels={conv.in_channels}, height, width), got "
            f"{tuple(features.shape)}"
        )
    if conv.padding == "same":  # any map: the output keeps its size
        return
    (ph, pw) = (0, 0) if conv.padding == "valid" else conv.padding
    # the extent a dilated kernel covers: dilation * (k - 1) + 1
    kh, kw = (d * (k - 1) + 1 for k, d in zip(conv.kernel_size, conv.dilation, strict=True))
    height, width = features.shape[-2:]
    if height + 2 * ph < kh or width + 2 * pw < kw:
        raise ValueError(
            f"{argument} of {height}x{width} (padding {ph}x{pw}) is smaller than the kernel's extent "
            f"{kh}x{kw}"
        )


class PrimaryCapsules(nn.Module):
    """A convolution whose output channels at each position are grouped into squashed capsules.

    Sabour et al. 2017, sec. 4 ("PrimaryCapsules"): 32 types of 8-D capsules from a 9x9, stride 2
    convolution. The ``num_types * caps_dim`` channels split as ``(type, feature)``: a capsule is
    ``caps_dim`` channels *at one position*, never neighbouring pixels of one channel (what
    ``out.view(batch, -1, caps_dim)`` on an NCHW tensor gives, a bug of one popular repository).
    Capsules are ordered type-major: ``(type, row, column)``.

    Args:
        in_channels: input feature maps.
        num_types: capsule types (channels of capsules), 32 in the paper.
        caps_dim: features per capsule, 8 in the paper.
        kernel_size: convolution kernel, 9 in the paper.
        stride: 2 in the paper.
        padding: 0 in the paper; at least 0.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: non-positive sizes, a negative ``padding``.
    """

    def __init__(
        self,
        in_channels: int,
        num_types: int,
        caps_dim: int,
        *,
        kernel_size: int = 9,
        stride: int = 2,
        padding: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(in_channels, "in_channels")
        check_positive_int(num_types, "num_types")
        check_positive_int(caps_dim, "caps_dim")
        check_positive_int(kernel_size, "kernel_size")
        check_positive_int(stride, "stride")
        check_positive_int(padding, "padding", minimum=0)
        check_float_dtype(dtype)
        self.num_types = num_types
        self.caps_dim = caps_dim
        self.conv = nn.Conv2d(
            in_channels,
            num_types * caps_dim,
            kernel_size,
            stride=stride,
            padding=padding,
            device=device,
            dtype=dtype,
        )

    def extra_repr(self) -> str:
        return f"num_types={self.num_types}, caps_dim={self.caps_dim}"

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """The ``(rows, columns)`` of the capsule grid for an input of ``height x width``.

        Raises:
            ValueError: ``height`` or ``width`` not a positive integer, or smaller than the kernel
                (after padding): ``forward`` refuses such an input (the sizes came out negative,
                and their product a plausible capsule count).
        """
        height, width = check_positive_int(height, "height"), check_positive_int(width, "width")
        (kh, kw), (sh, sw), (ph, pw) = self.conv.kernel_size, self.conv.stride, self.conv.padding
        if height + 2 * ph < kh or width + 2 * pw < kw:
            raise ValueError(
                f"an input of {height}x{width} (padding {ph}x{pw}) is smaller than the {kh}x{kw} kernel: "
                "the layer makes no capsule from it"
            )
        return (height + 2 * ph - kh) // sh + 1, (width + 2 * pw - kw) // sw + 1

    def num_capsules(self, height: int, width: int) -> int:
        """Capsules produced from an input of ``height x width`` (the next layer's ``in_caps``).

        Raises:
            ValueError: what :meth:`output_size` refuses.
        """
        rows, columns = self.output_size(height, width)
        return self.num_types * rows * columns

    def forward(self, features: Tensor) -> Tensor:
        """``(b, in_channels, h, w)`` -> ``(b, num_types * h' * w', caps_dim)`` squashed capsules.

        Raises:
            TypeError: ``features`` not a floating-point tensor of the parameters' dtype (outside
                ``torch.autocast``).
            ValueError: ``features`` not ``(b, in_channels, h, w)``, or smaller than the kernel.
        """
        check_feature_maps(features, self.conv)
        maps = self.conv(features)  # (b, t*d, h', w')
        capsules = rearrange(maps, "b (t d) h w -> b (t h w) d", t=self.num_types)  # channels at a position
        return squash(capsules, dim=-1)


class CapsuleLinear(nn.Module):
    """A fully connected capsule layer: votes ``u_hat_ij = W_ij u_j``, then a router.

    Sabour et al. 2017, eq. 2 for the votes; the router is any method of
    ``torchvote.functional.list_routers()`` (dynamic routing by default). The votes are handed to
    the router either as :class:`~torchvote.functional.routing_votes.LinearVotes` (or
    :class:`~torchvote.functional.routing_votes.SharedLinearVotes`), which never materialise the
    ``(batch, out_caps, in_caps, out_dim)`` tensor, or as that tensor, formed by one einsum:
    ``strategy`` chooses (see :mod:`torchvote.nn.routing_strategy`). Every strategy gives the same
    numbers; they differ in speed and memory by device, and in one more way: votes that are never
    formed (``"stream"``, what ``"auto"`` picks on a CPU) can be differentiated once only, so a
    gradient penalty or any double backward (``create_graph=True``), and batched gradients
    (``is_grads_batched=True``, ``jacobian`` or ``hessian`` with ``vectorize=True``), need
    ``"materialize"`` (``"stream"`` refuses them with a RuntimeError that says so; the slot router,
    which forms its own, is not concerned). EM routing, which needs the votes elementwise,
    materialises them whatever the strategy; its own kernel is differentiated once too, so a
    double or batched backward through it also needs ``router_options={"strategy": "vectorized"}``
    (its RuntimeError says so).

    Args:
        in_caps: input capsules ``j``.
        in_dim: input capsule size.
        out_caps: output capsules ``i``.
        out_dim: output capsule size.
        routing: a router name (``"dynamic"``, ``"em"``, ``"inverted_dot_product"``,
            ``"self_attention"``, ``"slot"``, ``"uniform"``) or a :class:`Router` module, whose
            parameters must have been built for this layer's sizes (see
            :meth:`Router.layer_sizes`).
        iterations: routing iterations of an iterative router given by name; at least 1;
            ``None`` (the default) means 3. A one-pass router (``"uniform"``,
            ``"self_attention"``, any whose ``iterative`` is False) runs once whatever the count:
            a count other than 1 warns that it has no effect (a ``UserWarning``, see
            :func:`~torchvote.nn.routers.base.layer_iterations`). Not with a :class:`Router`
            module, which has its own.
        shared_weights: one matrix ``W_i`` per output capsule shared by all inputs (the
            weighted-voting article's parameter sharing) instead of one per pair.
        router_options: extra keyword arguments for a router given by name (e.g.
            ``{"agreement": "distance"}``, ``{"detach_votes": True}``, ``{"bias": True}``); not
            the ones the layer's own arguments set (``in_caps``, ``out_caps``, ``out_dim``,
            ``iterations``, ``device``, ``dtype``).
        init_std: standard deviation of the normal initialisation of ``W``; positive and finite.
        strategy: how the votes reach the router, an implementation detail: ``"auto"`` (the
            default: ``"stream"`` on a CPU, where cache-tiled products beat small vote GEMMs;
            ``"materialize"`` on a GPU, where a few large kernels beat many small ones, unless the
            votes exceed :func:`~torchvote.nn.routing_strategy.materialize_budget`, and while
            ``torch.compile`` traces, so that a compiled layer takes any batch size in one graph:
            :func:`~torchvote.nn.routing_strategy.choose_strategy`), ``"materialize"``
            (votes formed by one einsum), ``"stream"`` (never formed) or ``"compiled"`` (the
            materialised routing under ``torch.compile``, compiled on the first call; falls back
            to ``"materialize"`` with a warning where compiling fails). Every strategy gives the
            same numbers and a contiguous layout. Under ``torch.autocast`` the materialised votes
            are formed in autocast's dtype (half the bytes), the streamed ones in the weights',
            but every strategy and every router returns its outputs, couplings and activations in
            the dtype it returns without autocast (the promotion of the inputs' and the weights':
            float32 for a float32 layer): routing is a normalisation.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: non-positive sizes or ``iterations``, a bad ``init_std``, an unknown router,
            option or strategy, a ``router_options`` key that one of the layer's own arguments
            sets, a :class:`Router` module built for other sizes or given with ``iterations`` or
            ``router_options``.
        TypeError: ``shared_weights`` not a bool, ``router_options`` not a mapping.

    Warns:
        UserWarning: ``iterations`` other than 1 for a one-pass router given by name (it has no
            effect).

    Examples:
        >>> import torch
        >>> from torchvote.nn import CapsuleLinear
        >>> _ = torch.manual_seed(0)
        >>> layer = CapsuleLinear(in_caps=32, in_dim=8, out_caps=10, out_dim=16)  # dynamic routing
        >>> inputs = torch.randn(2, 32, 8)  # (batch, in_caps, in_dim)
        >>> layer(inputs).shape
        torch.Size([2, 10, 16])
        >>> result = layer(inputs, return_routing=True)
        >>> result.couplings.shape, torch.allclose(result.couplings.sum(dim=-2), torch.ones(2, 32))
        (torch.Size([2, 10, 32]), True)
    """

    def __init__(
        self,
        in_caps: int,
        in_dim: int,
        out_caps: int,
        out_dim: int,
        *,
        routing: str | Router = "dynamic",
        iterations: int | None = None,
        shared_weights: bool = False,
        router_options: Mapping[str, Any] | None = None,
        init_std: float = 0.01,
        strategy: RoutingStrategy = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(in_caps, "in_caps")
        check_positive_int(in_dim, "in_dim")
        check_positive_int(out_caps, "out_caps")
        check_positive_int(out_dim, "out_dim")
        if iterations is not None:
            check_positive_int(iterations, "iterations")
        check_positive_float(init_std, "init_std")
        check_flag(shared_weights, "shared_weights")  # "no" would have shared the weights
        if router_options is not None and not isinstance(router_options, Mapping):
            raise TypeError(
                f"router_options must be a mapping of option names to values, got {router_options!r}"
            )
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.in_caps, self.in_dim, self.out_caps, self.out_dim = in_caps, in_dim, out_caps, out_dim
        self.shared_weights = shared_weights
        self.strategy = check_choice(strategy, STRATEGIES, "strategy")
        self._compiled: object = None  # the compiled routing: None until tried, False if it failed
        shape = (out_caps, out_dim, in_dim) if shared_weights else (out_caps, in_caps, out_dim, in_dim)
        self.init_std = float(init_std)
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        self.reset_parameters()
        if isinstance(routing, Router):
            if router_options:
                raise ValueError("router_options only apply when routing is given by name")
            if iterations is not None:  # it would be ignored: the router has its own
                raise ValueError(
                    "iterations only applies when routing is given by name; the Router module has "
                    "its own iterations: set them when building it"
                )
            routing.check_layer_sizes("routing", in_caps=in_caps, out_caps=out_caps, out_dim=out_dim)
            self.router = routing
        else:
            iterations = layer_iterations(routing, iterations)  # warns for a one-pass router
            layer = {"in_caps": in_caps, "out_caps": out_caps, "out_dim": out_dim, "iterations": iterations}
            self.router = build_router(
                functools.partial(make_router, routing), routing, fixed={**layer, **factory},
                options=router_options or {}, argument="router_options",
            )

    def reset_parameters(self) -> None:
        """Draw ``W`` again from ``N(0, init_std^2)``, as the constructor does (after ``to_empty()``
        of a module built on the ``"meta"`` device; the router's parameters are its own to reset)."""
        scaled_normal_(self.weight, self.init_std)

    def votes(self, inputs: Tensor) -> LinearVotes | SharedLinearVotes:
        """The votes of ``inputs`` ``(batch..., in_caps, in_dim)``, unmaterialised.

        Raises:
            ValueError: if ``inputs`` does not have ``in_caps`` capsules of ``in_dim`` features.
            TypeError: if ``inputs`` is not floating point or not of the weights' dtype (outside
                ``torch.autocast``).
        """
        self._check_inputs(inputs)
        if self.shared_weights:
            return SharedLinearVotes(self.weight, inputs)
        return LinearVotes(self.weight, inputs)

    def _check_inputs(self, inputs: Tensor) -> None:
        # Every strategy refuses what one of them cannot take: "stream" would promote the dtypes,
        # "materialize" fail in its einsum.
        check_input_dtype(inputs, self.weight.dtype, "inputs")
        check_device(inputs, self.weight.device, "inputs")
        if inputs.dim() < 2 or inputs.shape[-2] != self.in_caps:
            raise ValueError(
                f"inputs must have in_caps={self.in_caps} capsules, shape (batch..., {self.in_caps}, "
                f"{self.in_dim}), got {tuple(inputs.shape)}"
            )
        if inputs.shape[-1] != self.in_dim:
            raise ValueError(
                f"inputs must have in_dim={self.in_dim} features per capsule, got {tuple(inputs.shape)}"
            )

    def _check_activations(self, inputs: Tensor, activations: Tensor | None) -> None:
        if activations is None:
            return
        if not self.router.uses_activations:
            raise ValueError(
                f"activations apply only to routers that use them (router.uses_activations, e.g. "
                f"routing='em'); the {type(self.router).__name__} would ignore them"
            )
        if not isinstance(activations, Tensor) or activations.shape != inputs.shape[:-1]:
            described = (
                tuple(activations.shape) if isinstance(activations, Tensor) else type(activations).__name__
            )
            raise ValueError(
                f"activations must have shape (batch..., in_caps) = {tuple(inputs.shape[:-1])} to match "
                f"inputs {tuple(inputs.shape)}, got {described}"
            )
        if not activations.is_floating_point():  # bool or integer: 0/1 weights, surely not meant
            raise TypeError(f"activations must be floating point (in [0, 1]), got dtype {activations.dtype}")
        check_device(activations, inputs.device, "activations", "the inputs")

    def forward(
        self, inputs: Tensor, *, activations: Tensor | None = None, return_routing: bool = False
    ) -> Tensor | RoutingResult:
        """Route the input capsules to the output capsules.

        Args:
            inputs: ``(batch..., in_caps, in_dim)``, of the weights' dtype (or under
                ``torch.autocast``).
            activations: ``(batch..., in_caps)`` input activations, for a router that uses them
                (``router.uses_activations``: EM routing; default ones).
            return_routing: return the whole :class:`RoutingResult` (outputs, couplings
                ``(batch..., out_caps, in_caps)``, and EM's activations) instead of the outputs.

        Returns:
            ``(batch..., out_caps, out_dim)``, or the :class:`RoutingResult`.

        Raises:
            ValueError: if ``inputs`` does not match ``in_caps`` and ``in_dim`` or is on another
                device than the weights; ``activations`` given to a router that does not use them,
                not of shape ``(batch..., in_caps)`` or not on the inputs' device.
            TypeError: if ``inputs`` is not floating point or not of the weights' dtype (outside
                ``torch.autocast``); ``activations`` not floating point; a ``return_routing``
                that is not a bool.
        """
        self._check_inputs(inputs)
        self._check_activations(inputs, activations)
        check_flag(return_routing, "return_routing")
        vote_bytes = math.prod(inputs.shape[:-2]) * self.out_caps * self.in_caps * self.out_dim
        # under autocast the votes take its dtype (bf16: half the bytes); float64 it leaves alone
        device_type = inputs.device.type
        cast = autocast_enabled(device_type) and inputs.dtype != torch.float64  # (no graph break)
        vote_bytes *= (torch.get_autocast_dtype(device_type) if cast else inputs.dtype).itemsize
        strategy = choose_strategy(self.strategy, device=inputs.device, vote_bytes=vote_bytes)
        if strategy == "stream":
            result = self.router(self.votes(inputs), activations=activations)
        elif strategy == "materialize" or self._compiled is False:
            result = self._route_materialized(self.weight, inputs, activations)
        elif self._compiled is None:
            compiled, result = compile_or_none(self._route_materialized, self.weight, inputs, activations)
            self._compiled = compiled or False
        else:
            result = self._compiled(self.weight, inputs, activations)
        # under autocast, the dtype it has without: materialised votes (and so their routing) are
        # in autocast's dtype, the streamed kernels in the weight's (a cast of the small results)
        result = result_in_dtype(result, torch.promote_types(self.weight.dtype, inputs.dtype))
        # one layout from every strategy (the stream's were views of its (i, b, d) layout, which
        # refused .view(b, -1) where the materialised ones took it); a copy only for those
        if not return_routing:
            return result.outputs.contiguous()
        return dataclasses.replace(
            result,
            outputs=result.outputs.contiguous(),
            couplings=result.couplings.contiguous(),
            activations=None if result.activations is None else result.activations.contiguous(),
        )

    def _route_materialized(
        self, weight: Tensor, inputs: Tensor, activations: Tensor | None
    ) -> RoutingResult:
        """The router on the votes formed by one einsum ``(batch..., out_caps, in_caps, out_dim)``."""
        pattern = "ide,...je->...ijd" if self.shared_weights else "ijde,...je->...ijd"
        return self.router(torch.einsum(pattern, weight, inputs), activations=activations)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state = dict(state)
        state["_compiled"] = None  # a compiled function does not copy or pickle: compile again
        return state

    def extra_repr(self) -> str:
        return (
            f"in_caps={self.in_caps}, in_dim={self.in_dim}, out_caps={self.out_caps}, "
            f"out_dim={self.out_dim}, shared_weights={self.shared_weights}, strategy={self.strategy!r}"
        )
