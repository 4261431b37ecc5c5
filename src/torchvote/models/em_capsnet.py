"""Matrix capsules with EM routing: Hinton, Sabour & Frosst 2018 (ICLR), the small network.

Sec. 4 and Fig. 1 of "Matrix capsules with EM routing", the smaller smallNORB network (``A = 64,
B = 8, C = D = 16``), every size from :class:`EMCapsNetConfig`:

1. ``ReLU Conv1``: ``A`` maps from a 5x5 convolution of stride 2;
2. ``PrimaryCaps``: :class:`~torchvote.nn.em_capsules.PrimaryMatrixCapsules`, ``B`` types of
   4x4 pose matrices and sigmoid activations from 1x1 convolutions;
3. ``ConvCaps1`` / ``ConvCaps2``: :class:`~torchvote.nn.em_capsules.ConvMatrixCapsules`, ``C``
   and ``D`` types, 3x3 kernels of stride 2 and 1, routed by EM (Procedure 1, 3 iterations);
4. ``Class Capsules``: one matrix per (input type, class) shared across positions with
   coordinate addition (:class:`~torchvote.nn.em_capsules.ClassMatrixCapsules`), routed by
   ``router`` (EM by default), inside the :class:`~torchvote.models.capsule_head.CapsuleHead`
   every capsule model shares (no decoder here);
5. the class scores are the class capsules' activations, trained with the spread loss (sec. 3.1,
   ``loss="spread"``; the margin schedule 0.2 -> 0.9 is ``LossConfig.spread_margin_*``).

The paper's input is 32x32 smallNORB (14x14 -> 6x6 -> 4x4 grids); the geometry here follows
``image_size``: 28x28 MNIST gives 12x12 primary capsules, 5x5 and 3x3 convolutional capsule
grids; 40x40 (affNIST-style canvases) gives 18x18, 8x8 and 6x6.

**Routers.** ``router`` routes the class capsule layer and may be any name of
:func:`~torchvote.functional.routing.list_routers`: with ``"em"`` the votes and the input
activations go to EM routing and the scores are EM's output activations; every other router
(``dynamic``, ``inverted_dot_product``, ``self_attention``, ``slot``, ``uniform``) takes vectors
without activations, so each vote is scaled by its capsule's activation (an absent part casts a
weaker vote) and the scores are the lengths of the routed class capsules (bounded by 1 for the
squashing routers). The convolutional capsule layers always route by EM (each output position
routes its own patch, which only :class:`~torchvote.nn.em_capsules.ConvMatrixCapsules` does).

Parameters on 28x28 with 10 classes (the ``paper`` preset, the defaults): 68,444 (conv 1,664;
primary capsules 8,840; ConvCaps1 18,432 + 32; ConvCaps2 36,864 + 32; class capsules 2,560 + 20),
the paper's "68K" network (with its 5 classes: 67,154).

Index legend: ``b`` batch, ``i`` classes (receivers), ``j`` input capsules (senders),
``h w`` grid rows and columns, ``t`` capsule types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchvote.functional.em import (
    InverseTemperature,
    default_inverse_temperature,
    default_schedule_ending_at,
)
from torchvote.functional.em_kernel import STRATEGIES
from torchvote.models.capsule_config import (
    CapsuleClassifierConfig,
    check_classifier_fields,
    check_positive_scale,
    check_positive_tuples,
    check_router,
    router_options_errors,
    to_tuple,
)
from torchvote.models.capsule_head import CapsuleClassifier, CapsuleHead
from torchvote.models.registry import register_model
from torchvote.nn.em_capsules import (
    ClassMatrixCapsules,
    ConvMatrixCapsules,
    MatrixCapsules,
    PrimaryMatrixCapsules,
    pose_side,
)
from torchvote.nn.routers import make_router
from torchvote.validation import check_bool_fields, check_choice, check_float_dtype, check_positive_float

__all__ = ["EMCapsNet", "EMCapsNetConfig"]


@dataclass
class EMCapsNetConfig(CapsuleClassifierConfig):
    """Every size of the matrix-capsule network; the defaults are the paper's small network.

    Args (after ``image_size``, ``in_channels``, ``num_classes`` of
    :class:`~torchvote.models.capsule_config.CapsuleClassifierConfig`):
        conv_channels: ``A``, maps of the first convolution (64).
        conv_kernel: its kernel side (5).
        conv_stride: its stride (2).
        primary_types: ``B``, primary capsule types (8).
        conv_caps_types: ``(C, D)``: types of each convolutional capsule layer (16, 16).
        conv_caps_kernels: their kernel sides (3, 3).
        conv_caps_strides: their strides (2, 1).
        pose_dim: entries of a pose matrix, a perfect square (16: 4x4).
        iterations: EM iterations of every layer (3); also the class router's iterations.
        coordinate_addition: add the scaled grid coordinates to the class votes.
        router: the class layer's routing, a name of ``list_routers()`` (``"em"``).
        router_options: keyword arguments of that router.
        data_per_parent: the EM layers' amount of data per parent capsule (Gritzman 2019, sec.
            2.2; IBM's implementation: 100): each layer's ``sum_j R_ij a_j`` is rescaled so that
            a uniform share of fully active inputs of one patch counts as this many units, which
            moves the activations of the small convolutional layers (about 4.5 votes per parent)
            toward the scale ``lambda`` was chosen for (the paper's class capsules, about 100;
            their joint normalisation over overlapping patches leaves a parent inside the grid
            four ninths of it at K = 3, stride 2, a ninth at stride 1: see
            :class:`~torchvote.nn.routers.EMRouter`); ``None``: the
            paper's raw sums, with which every convolutional activation stays within 0.02 of its
            start. Given to the class router too when it is ``"em"`` (unless ``router_options``
            sets it). See :class:`~torchvote.nn.routers.EMRouter`.
        final_inverse_temperature: ``None``: every EM layer uses the authors' ``lambda_t``
            schedule (:func:`~torchvote.functional.default_inverse_temperature`), which ends at
            0.00143 after 3 iterations but at 0.0005 after 1; a positive number: that schedule
            rescaled to end at this value (:func:`~torchvote.functional.em.default_schedule_ending_at`),
            so that networks with different ``iterations`` keep the same activation scale (with
            the authors' schedule and 1 iteration the class activations vary by 2e-4 between
            classes at initialisation and the network does not learn). Given to the class router
            too when it is ``"em"`` (unless ``router_options`` sets ``inverse_temperature``).
        em_strategy: how every EM layer routes (:func:`~torchvote.functional.em.em_routing`):
            ``"auto"`` (blocked on a CPU, vectorized elsewhere), ``"blocked"``, ``"vectorized"``
            or ``"compiled"`` (the routing loop under ``torch.compile``, compiled on the first call
            of each shape: the paper-size ConvCaps1 layer 4.2x faster than ``"auto"`` on an H200,
            1.6-2.2x on a 2-core CPU, where it runs block by block: docs/performance.md). Given to
            the class router too when it is ``"em"`` (unless ``router_options`` sets ``strategy``).

    Raises:
        ValueError: a bad field, naming it (a grid the layers shrink to nothing names
            ``image_size``): among them a ``conv_caps_*`` field given as anything but a tuple
            (or list) of positive integers, and a ``data_per_parent`` that is neither ``None``
            nor a positive finite number.
    """

    conv_channels: int = 64
    conv_kernel: int = 5
    conv_stride: int = 2
    primary_types: int = 8
    conv_caps_types: tuple[int, ...] = (16, 16)
    conv_caps_kernels: tuple[int, ...] = (3, 3)
    conv_caps_strides: tuple[int, ...] = (2, 1)
    pose_dim: int = 16
    iterations: int = 3
    coordinate_addition: bool = True
    router: str = "em"
    router_options: dict[str, Any] = field(default_factory=dict)
    data_per_parent: float | None = 100.0
    final_inverse_temperature: float | None = None
    em_strategy: str = "auto"

    def __post_init__(self) -> None:
        check_bool_fields(self)
        for name in ("conv_caps_types", "conv_caps_kernels", "conv_caps_strides"):
            setattr(self, name, to_tuple(getattr(self, name), name))
        check_classifier_fields(
            self,
            (
                "conv_channels",
                "conv_kernel",
                "conv_stride",
                "primary_types",
                "iterations",
            ),
        )
        side = pose_side(self.pose_dim)
        if self.coordinate_addition and side < 2:
            raise ValueError(f"coordinate_addition needs poses of at least 2x2, got pose_dim={self.pose_dim}")
        check_router(self.router, self.router_options)
        check_positive_scale(self.data_per_parent, "data_per_parent", optional=True)
        if self.final_inverse_temperature is not None:
            check_positive_float(self.final_inverse_temperature, "final_inverse_temperature")
        check_choice(self.em_strategy, STRATEGIES, "em_strategy")
        check_positive_tuples(self, ("conv_caps_types", "conv_caps_kernels", "conv_caps_strides"))
        if not len(self.conv_caps_types) == len(self.conv_caps_kernels) == len(self.conv_caps_strides):
            raise ValueError(
                "conv_caps_types, conv_caps_kernels and conv_caps_strides must have one entry per layer, "
                f"got {len(self.conv_caps_types)}, {len(self.conv_caps_kernels)} and "
                f"{len(self.conv_caps_strides)}"
            )
        if min(self.grids) < 1:
            raise ValueError(
                f"image_size={self.image_size} is too small: the layers shrink it to the grids {self.grids} "
                f"(conv {self.conv_kernel}/{self.conv_stride}, capsule kernels {self.conv_caps_kernels}, "
                f"strides {self.conv_caps_strides})"
            )

    @property
    def inverse_temperature(self) -> InverseTemperature:
        """The ``lambda_t`` schedule of every EM layer (see ``final_inverse_temperature``)."""
        if self.final_inverse_temperature is None:
            return default_inverse_temperature
        return default_schedule_ending_at(self.final_inverse_temperature, self.iterations)

    @property
    def grids(self) -> tuple[int, ...]:
        """Sides of the primary capsule grid and of each convolutional capsule layer's output
        (12, 5, 3 on 28x28); a non-positive side means the layers do not fit."""
        side = (self.image_size - self.conv_kernel) // self.conv_stride + 1
        if self.image_size < self.conv_kernel:
            side = 0
        sides = [side]
        for kernel, stride in zip(self.conv_caps_kernels, self.conv_caps_strides, strict=True):
            side = (side - kernel) // stride + 1 if side >= kernel else 0
            sides.append(side)
        return tuple(sides)

    @property
    def class_in_caps(self) -> int:
        """Capsules voting for the classes: the last grid's positions times its types (144)."""
        last_types = self.conv_caps_types[-1] if self.conv_caps_types else self.primary_types
        return self.grids[-1] ** 2 * last_types


@register_model(
    "em-capsnet",
    config=EMCapsNetConfig,
    presets={
        "paper": {},
        "tiny": {
            "conv_channels": 16,
            "primary_types": 4,
            "conv_caps_types": (4, 4),
            "iterations": 2,
        },
    },
    task="image-classification",
    loss="spread",
)
class EMCapsNet(CapsuleClassifier):
    """Matrix capsules with EM routing (Hinton et al. 2018), the small A=64, B=8, C=D=16 network.

    ``forward(images, targets=None)`` (:meth:`CapsuleClassifier.forward`; ``targets`` is checked
    and not used, there is no decoder) gives EM's activations as scores (capsule lengths with the other
    routers), ``poses`` ``(b, num_classes, pose_dim)``, ``couplings`` ``(b, num_classes,
    class_in_caps)`` (EM's assignments) and ``intermediates["primary_activations"]`` ``(b, h, w,
    primary_types)``.

    Args:
        config: the sizes; see :class:`EMCapsNetConfig`.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``router_options`` the router does not take.
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    # Checkpoints from before the shared head kept the class votes and the router apart.
    legacy_renames = {"class_votes.": "head.class_capsules.", "router.": "head.class_capsules.routing."}

    def __init__(
        self,
        config: EMCapsNetConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(config)
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.conv = nn.Conv2d(
            config.in_channels, config.conv_channels, config.conv_kernel, stride=config.conv_stride, **factory
        )
        self.primary = PrimaryMatrixCapsules(
            config.conv_channels, config.primary_types, pose_dim=config.pose_dim, **factory
        )
        layers: list[nn.Module] = []
        in_types = config.primary_types
        for types, kernel, stride in zip(
            config.conv_caps_types, config.conv_caps_kernels, config.conv_caps_strides, strict=True
        ):
            layers.append(
                ConvMatrixCapsules(
                    in_types,
                    types,
                    kernel_size=kernel,
                    stride=stride,
                    pose_dim=config.pose_dim,
                    iterations=config.iterations,
                    inverse_temperature=config.inverse_temperature,
                    data_per_parent=config.data_per_parent,
                    strategy=config.em_strategy,
                    **factory,
                )
            )
            in_types = types
        self.conv_capsules = nn.ModuleList(layers)
        router_options = dict(config.router_options)
        if config.router == "em":
            router_options.setdefault("data_per_parent", config.data_per_parent)
            router_options.setdefault("inverse_temperature", config.inverse_temperature)
            router_options.setdefault("strategy", config.em_strategy)
        with router_options_errors(config.router, router_options):
            router = make_router(
                config.router,
                in_caps=config.class_in_caps,
                out_caps=config.num_classes,
                out_dim=config.pose_dim,
                iterations=config.iterations,
                **factory,
                **router_options,
            )
        class_capsules = ClassMatrixCapsules(
            in_types,
            config.num_classes,
            pose_dim=config.pose_dim,
            coordinate_addition=config.coordinate_addition,
            routing=router,
            **factory,
        )
        self.head = CapsuleHead(class_capsules)  # EM's activations, or a vector router's lengths

    def capsules(self, images: Tensor) -> tuple[MatrixCapsules, dict[str, Tensor]]:
        """Conv1, the primary capsules and the convolutional capsule layers: the last layer's
        poses ``(b, h, w, types, P, P)`` and activations ``(b, h, w, types)``, and the primary
        capsules' activations as ``"primary_activations"``."""
        features = F.relu(self.conv(images))  # (b, A, h, w)
        capsules = primary = self.primary(features)  # poses (b, h, w, B, P, P), activations (b, h, w, B)
        for layer in self.conv_capsules:
            capsules = layer(capsules)  # (b, h', w', types, P, P), (b, h', w', types)
        return capsules, {"primary_activations": primary.activations}
