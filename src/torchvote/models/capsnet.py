"""CapsNet: Sabour, Frosst & Hinton 2017, "Dynamic Routing Between Capsules" (NeurIPS).

The network of sec. 4 (Fig. 1 and 2), every size from :class:`CapsNetConfig`:

1. ``Conv1``: a ``conv_kernel x conv_kernel`` convolution, stride 1, ``conv_channels`` ReLU maps
   (256 @ 9x9 in the paper);
2. ``PrimaryCaps``: :class:`~torchvote.nn.capsules.PrimaryCapsules`, ``primary_types`` types of
   ``primary_dim``-D squashed capsules from a ``primary_kernel`` convolution of stride
   ``primary_stride`` (32 types of 8-D, 9x9, stride 2: a 6x6 grid, 1152 capsules on 28x28 inputs;
   the count is computed from the convolution arithmetic, :attr:`CapsNetConfig.num_primary_caps`);
3. ``DigitCaps``: :class:`~torchvote.nn.capsules.CapsuleLinear`, one ``class_dim``-D capsule per
   class (10 x 16-D), votes ``u_hat_j|i = W_ij u_i`` (eq. 2) routed by ``router`` (dynamic
   routing, Procedure 1, ``iterations`` = 3, by default; any name of
   :func:`torchvote.functional.routing.list_routers`);
4. the class scores are the lengths ``||v_j||`` of the class capsules (sec. 3: "the length of the
   output vector of a capsule [is] the probability that the entity ... exists"), trained with the
   margin loss (eq. 4, ``loss="margin"``);
5. the decoder (sec. 4.1, Fig. 2): all class capsules but one are masked to zero, and three fully
   connected layers (512 and 1024 ReLU units, then ``in_channels * image_size**2`` sigmoid units)
   reconstruct the image. The kept capsule is the true class during training (``targets`` given)
   and the longest capsule otherwise. Its loss (sum of squared errors, scaled by 0.0005) is
   ``LossConfig.reconstruction_weight`` of the training config, not a model field.

MultiMNIST (sec. 6): with ``targets`` of shape ``(b, k)`` (the ``k`` digits of each image) the
decoder reconstructs each digit from its own capsule, ``reconstructions`` ``(b, k, c, h, w)``,
which the training loop compares with each digit alone.

**Routers.** Every name of ``list_routers()`` works. With ``router="em"`` the class capsules are
EM routing's means and the scores are EM's output activations (the primary capsules' lengths are
the input activations); train it with the spread loss (``loss.name=spread``), which EM's
activations were made for: the margin loss's absolute targets push every sigmoid activation to
zero and the network stops learning (tiny preset, 100 steps on small digits: 9% training accuracy
with the margin loss, 97% with the spread loss). Every other router gives vectors whose length is
the score; those whose outputs are not squashed (``inverted_dot_product``: layer-normalised;
``slot``: GRU states) train with the margin loss too, more slowly, their lengths not being
bounded by 1.

Paper size (the ``paper`` preset, the defaults): 8,215,568 parameters with the decoder (6,804,224
without), the paper's "8.2M" and "6.8M" (sec. 5). ``small`` is a CPU-sized preset (64 @ 9x9,
8 types of 8-D, 288 capsules, a 256-512 decoder) and ``tiny`` is for tests.

Index legend: ``b`` batch, ``k`` reconstructed capsules per image, ``i`` class capsules
(receivers), ``j`` primary capsules (senders), ``d`` capsule features.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchvote.functional.routing import list_routers
from torchvote.models.registry import ClassifierOutput, register_model
from torchvote.nn.capsules import CapsuleLinear, PrimaryCapsules
from torchvote.nn.routers import RoutingResult

__all__ = [
    "CAPSNET_PRESETS",
    "CapsNet",
    "CapsNetConfig",
    "CapsuleDecoder",
    "build_class_capsules",
    "check_images",
    "check_positive",
    "check_router",
    "class_scores",
    "decoder_classes",
    "reconstruct",
]


# --- helpers shared by the capsule models ----------------------------------------------------------


def check_positive(config: Any, names: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the first field of ``names`` that is not a positive integer."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


#: What the capsule layer passes to its router itself; router_options may not repeat them.
_LAYER_ARGUMENTS = frozenset({"in_caps", "out_caps", "out_dim", "iterations", "device", "dtype"})


def check_router(
    router: str, router_options: Mapping[str, Any], *, supported: tuple[str, ...] | None = None
) -> None:
    """Check a model config's ``router`` against :func:`~torchvote.functional.routing.list_routers`.

    Args:
        router: the configured router name.
        router_options: the configured options (must be a mapping).
        supported: the routers this model can use, when not all of them.

    Raises:
        ValueError: an unknown router (the message lists ``list_routers()``), one this model does
            not support (the message lists those it does), or options that are not a mapping or
            that repeat what the layer passes (``iterations``, the sizes, ``device``, ``dtype``).
    """
    names = sorted(list_routers())
    if router not in names:
        raise ValueError(f"router must be one of {names}, got {router!r}")
    if supported is not None and router not in supported:
        raise ValueError(
            f"router={router!r} is not supported by this model; it works with {sorted(supported)}"
        )
    if not isinstance(router_options, Mapping):
        raise ValueError(f"router_options must be a mapping of keyword arguments, got {router_options!r}")
    reserved = sorted(set(router_options) & _LAYER_ARGUMENTS)
    if reserved:
        raise ValueError(
            f"router_options must not set {reserved}: the capsule layer passes them "
            "(iterations is a config field of its own)"
        )


def build_class_capsules(
    *,
    in_caps: int,
    in_dim: int,
    out_caps: int,
    out_dim: int,
    router: str,
    iterations: int,
    router_options: Mapping[str, Any],
    shared_weights: bool = False,
    init_std: float = 0.01,
) -> CapsuleLinear:
    """A :class:`~torchvote.nn.capsules.CapsuleLinear` whose router errors name the config fields.

    Raises:
        ValueError: ``router_options`` the router does not take (the message names the field).
    """
    try:
        return CapsuleLinear(
            in_caps,
            in_dim,
            out_caps,
            out_dim,
            routing=router,
            iterations=iterations,
            shared_weights=shared_weights,
            router_options=dict(router_options),
            init_std=init_std,
        )
    except ValueError as err:
        raise ValueError(
            f"router_options={dict(router_options)!r} do not fit router={router!r}: {err}"
        ) from None


def class_scores(routed: RoutingResult) -> Tensor:
    """``(b, num_classes)`` class scores: EM's activations if the router gives them, else the
    lengths of the class capsules (Sabour et al. 2017, sec. 2)."""
    if routed.activations is not None:
        return routed.activations
    return torch.linalg.vector_norm(routed.outputs, dim=-1)  # (b, i); zero vectors: zero gradient


def decoder_classes(scores: Tensor, targets: Tensor | None) -> Tensor:
    """The classes whose capsules the decoder reconstructs, ``(b, k)``.

    Args:
        scores: ``(b, num_classes)`` class scores.
        targets: ``(b,)`` true classes, ``(b, k)`` the classes present in each image
            (MultiMNIST), or ``None`` (evaluation: the highest score, the longest capsule).

    Returns:
        ``(b, 1)`` for ``(b,)`` or ``None`` targets, ``(b, k)`` for ``(b, k)`` targets.

    Raises:
        ValueError: targets of another shape or batch size.
    """
    if targets is None:
        return scores.argmax(dim=-1, keepdim=True)  # (b, 1)
    if targets.dim() not in (1, 2) or targets.shape[0] != scores.shape[0]:
        raise ValueError(
            f"targets must be (b,) class indices or (b, k) classes per image with b={scores.shape[0]}, "
            f"got {tuple(targets.shape)}"
        )
    return targets.long().reshape(scores.shape[0], -1)  # (b, k)


class CapsuleDecoder(nn.Module):
    """The masked reconstruction network of Sabour et al. 2017, sec. 4.1 and Fig. 2.

    Every class capsule but the chosen one is set to zero; the ``num_classes * caps_dim`` masked
    vector goes through ReLU layers of ``hidden`` units and a sigmoid layer with one unit per
    pixel (512, 1024, 784 on MNIST).

    Args:
        num_classes: class capsules.
        caps_dim: features per class capsule.
        image_shape: ``(channels, height, width)`` of the reconstructed images.
        hidden: widths of the hidden layers.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(
        self, num_classes: int, caps_dim: int, image_shape: tuple[int, int, int], *, hidden: tuple[int, ...]
    ) -> None:
        super().__init__()
        if any(size < 1 for size in (num_classes, caps_dim, *image_shape, *hidden)):
            raise ValueError(
                f"decoder sizes must be positive, got num_classes={num_classes}, caps_dim={caps_dim}, "
                f"image_shape={image_shape}, hidden={hidden}"
            )
        self.image_shape = tuple(image_shape)
        layers: list[nn.Module] = []
        width = num_classes * caps_dim
        for units in hidden:
            layers += [nn.Linear(width, units), nn.ReLU(inplace=True)]
            width = units
        layers += [nn.Linear(width, image_shape[0] * image_shape[1] * image_shape[2]), nn.Sigmoid()]
        self.layers = nn.Sequential(*layers)

    @staticmethod
    def mask(poses: Tensor, classes: Tensor) -> Tensor:
        """``(b, i, d)`` capsules, ``(b, k)`` classes -> ``(b, k, i * d)``: all but one capsule zero."""
        keep = F.one_hot(classes, poses.shape[1]).to(poses.dtype)  # (b, k, i)
        return torch.einsum("bki,bid->bkid", keep, poses).flatten(2)  # (b, k, i*d)

    def forward(self, poses: Tensor, classes: Tensor) -> Tensor:
        """Reconstruct the image of each chosen capsule.

        Args:
            poses: ``(b, num_classes, caps_dim)`` class capsules.
            classes: ``(b, k)`` the capsule kept for each of ``k`` reconstructions.

        Returns:
            ``(b, k, c, h, w)`` reconstructions in ``[0, 1]``.
        """
        pixels = self.layers(self.mask(poses, classes))  # (b, k, c*h*w)
        return pixels.unflatten(-1, self.image_shape)  # (b, k, c, h, w)


def reconstruct(
    decoder: CapsuleDecoder | None, poses: Tensor, scores: Tensor, targets: Tensor | None
) -> Tensor | None:
    """The decoder's output in the registry's layout: ``(b, c, h, w)`` for one class per image,
    ``(b, k, c, h, w)`` for ``(b, k)`` targets; ``None`` without a decoder."""
    if decoder is None:
        return None
    images = decoder(poses, decoder_classes(scores, targets))  # (b, k, c, h, w)
    return images if targets is not None and targets.dim() == 2 else images.squeeze(1)


def check_images(images: Tensor, config: Any) -> None:
    """Raise ``ValueError`` unless ``images`` is ``(b, in_channels, image_size, image_size)``."""
    expected = (config.in_channels, config.image_size, config.image_size)
    if images.dim() != 4 or tuple(images.shape[1:]) != expected:
        raise ValueError(
            f"expected images of shape (b, {', '.join(map(str, expected))}), got {tuple(images.shape)}"
        )


# --- CapsNet ---------------------------------------------------------------------------------------


@dataclass
class CapsNetConfig:
    """Every size of CapsNet; the defaults are the paper's (Sabour et al. 2017, sec. 4).

    Args:
        image_size: side of the square input images (filled from the data set when training).
        in_channels: channels of the input images (filled from the data set).
        num_classes: class capsules (filled from the data set).
        conv_channels: ReLU maps of Conv1 (256).
        conv_kernel: Conv1's kernel side (9), stride 1, no padding.
        primary_types: primary capsule types (32).
        primary_dim: features per primary capsule (8).
        primary_kernel: PrimaryCaps' kernel side (9).
        primary_stride: PrimaryCaps' stride (2).
        class_dim: features per class capsule (16).
        iterations: routing iterations (3); ignored by the one-pass routers.
        router: the class layer's routing, a name of ``list_routers()`` (``"dynamic"``).
        router_options: keyword arguments of the router (e.g. ``{"bias": True}`` for the
            authors' code's bias, ``{"agreement": "distance"}``).
        shared_weights: one transformation matrix per class shared by every primary capsule.
        init_std: standard deviation of the class layer's normal initialisation.
        decoder: add the reconstruction network (its loss weight is
            ``LossConfig.reconstruction_weight``, 0.0005).
        decoder_hidden: widths of the decoder's hidden layers (512, 1024).

    Raises:
        ValueError: a bad field, naming it (sizes that leave no capsule name the geometry).
    """

    image_size: int = 28
    in_channels: int = 1
    num_classes: int = 10
    conv_channels: int = 256
    conv_kernel: int = 9
    primary_types: int = 32
    primary_dim: int = 8
    primary_kernel: int = 9
    primary_stride: int = 2
    class_dim: int = 16
    iterations: int = 3
    router: str = "dynamic"
    router_options: dict[str, Any] = field(default_factory=dict)
    shared_weights: bool = False
    init_std: float = 0.01
    decoder: bool = True
    decoder_hidden: tuple[int, ...] = (512, 1024)

    def __post_init__(self) -> None:
        self.decoder_hidden = tuple(self.decoder_hidden)
        check_positive(
            self,
            (
                "image_size",
                "in_channels",
                "num_classes",
                "conv_channels",
                "conv_kernel",
                "primary_types",
                "primary_dim",
                "primary_kernel",
                "primary_stride",
                "class_dim",
                "iterations",
            ),
        )
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {self.num_classes}")
        check_router(self.router, self.router_options)
        if not self.init_std > 0:
            raise ValueError(f"init_std must be positive, got {self.init_std!r}")
        if any(isinstance(u, bool) or not isinstance(u, int) or u < 1 for u in self.decoder_hidden):
            raise ValueError(f"decoder_hidden must hold positive integers, got {self.decoder_hidden}")
        if self.primary_grid < 1:
            raise ValueError(
                f"image_size={self.image_size} is too small: conv_kernel={self.conv_kernel} leaves a "
                f"{self.conv_grid}x{self.conv_grid} map, smaller than primary_kernel={self.primary_kernel}"
            )

    @property
    def conv_grid(self) -> int:
        """Side of Conv1's output map: ``image_size - conv_kernel + 1`` (20 on MNIST)."""
        return self.image_size - self.conv_kernel + 1

    @property
    def primary_grid(self) -> int:
        """Side of the primary capsule grid: ``(conv_grid - primary_kernel) // primary_stride + 1``."""
        if self.conv_grid < self.primary_kernel:
            return 0
        return (self.conv_grid - self.primary_kernel) // self.primary_stride + 1

    @property
    def num_primary_caps(self) -> int:
        """Primary capsules, the class layer's ``in_caps``: ``primary_types * primary_grid**2``."""
        return self.primary_types * self.primary_grid**2


#: Presets: the paper's sizes, a CPU size, and a test size.
CAPSNET_PRESETS: dict[str, dict[str, Any]] = {
    "paper": {},
    "small": {
        "conv_channels": 64,
        "primary_types": 8,
        "primary_dim": 8,
        "decoder_hidden": (256, 512),
    },
    "tiny": {
        "conv_channels": 16,
        "primary_types": 4,
        "primary_dim": 4,
        "class_dim": 8,
        "iterations": 2,
        "decoder_hidden": (32,),
    },
}


@register_model(
    "capsnet",
    config=CapsNetConfig,
    presets=CAPSNET_PRESETS,
    task="image-classification",
    loss="margin",
)
class CapsNet(nn.Module):
    """CapsNet (Sabour et al. 2017): Conv1, primary capsules, routed class capsules, masked decoder.

    Args:
        config: the sizes; see :class:`CapsNetConfig`.

    Raises:
        ValueError: ``router_options`` the router does not take.
    """

    def __init__(self, config: CapsNetConfig) -> None:
        super().__init__()
        self.config = config
        self.conv = nn.Conv2d(config.in_channels, config.conv_channels, config.conv_kernel)
        self.primary = PrimaryCapsules(
            config.conv_channels,
            config.primary_types,
            config.primary_dim,
            kernel_size=config.primary_kernel,
            stride=config.primary_stride,
        )
        self.class_capsules = build_class_capsules(
            in_caps=config.num_primary_caps,
            in_dim=config.primary_dim,
            out_caps=config.num_classes,
            out_dim=config.class_dim,
            router=config.router,
            iterations=config.iterations,
            router_options=config.router_options,
            shared_weights=config.shared_weights,
            init_std=config.init_std,
        )
        # EM routing weighs each vote by its sender's activation: a vector capsule's length.
        self.uses_activations = self.class_capsules.router.uses_activations
        image_shape = (config.in_channels, config.image_size, config.image_size)
        self.decoder = (
            CapsuleDecoder(config.num_classes, config.class_dim, image_shape, hidden=config.decoder_hidden)
            if config.decoder
            else None
        )

    def forward(self, images: Tensor, targets: Tensor | None = None) -> ClassifierOutput:
        """Classify (and reconstruct) a batch of images.

        Args:
            images: ``(b, in_channels, image_size, image_size)``.
            targets: ``(b,)`` true classes or ``(b, k)`` classes per image: the decoder
                reconstructs those capsules (the training loop passes them in training mode);
                ``None``: the longest capsule.

        Returns:
            :class:`~torchvote.models.registry.ClassifierOutput` with ``scores`` ``(b,
            num_classes)`` (capsule lengths; EM activations with ``router="em"``),
            ``reconstructions`` ``(b, c, h, w)`` (``(b, k, c, h, w)`` for ``(b, k)`` targets;
            ``None`` without decoder), ``poses`` ``(b, num_classes, class_dim)`` and
            ``couplings`` ``(b, num_classes, num_primary_caps)`` (receivers first, each sender's
            column summing to 1).

        Raises:
            ValueError: images or targets of the wrong shape.
        """
        check_images(images, self.config)
        features = F.relu(self.conv(images))  # (b, conv_channels, g, g)
        primary = self.primary(features)  # (b, j, primary_dim), squashed
        activations = torch.linalg.vector_norm(primary, dim=-1) if self.uses_activations else None  # (b, j)
        routed = self.class_capsules(primary, activations=activations, return_routing=True)
        poses = routed.outputs  # (b, i, class_dim)
        scores = class_scores(routed)  # (b, i)
        return ClassifierOutput(
            scores=scores,
            reconstructions=reconstruct(self.decoder, poses, scores, targets),
            poses=poses,
            couplings=routed.couplings,  # (b, i, j): receivers first
        )
