"""Efficient-CapsNet: Mazzia, Salvetti & Chiaberge 2021, "Efficient-CapsNet: capsule network with
self-attention routing" (Scientific Reports 11, 14634).

The MNIST network of sec. "Methods" (Fig. 1), every size from :class:`EfficientCapsNetConfig`:

1. four convolutions, each followed by ReLU and batch normalisation in the authors' order
   (32 @ 5x5, 64 @ 3x3, 64 @ 3x3, 128 @ 3x3 stride 2: 28 -> 24 -> 22 -> 20 -> 9). The paper
   gives no settings for these; by default they are PyTorch's (batch normalisation's running
   statistics move by 0.1 a step, ``eps`` 1e-5, PyTorch's uniform initialisation of the
   convolutions). The ``authors`` preset takes the authors' Keras code's instead: momentum 0.99
   (``batch_norm_momentum=0.01`` in PyTorch's terms), ``eps`` 1e-3 and ``he_normal`` convolutions
   with zero biases. Its slower statistics lag behind the weights of a short CPU run;
2. depthwise primary capsules: a depthwise convolution whose kernel covers the whole
   last map (9x9 on MNIST) gives one value per channel, the 128 channels are 16 capsules of 8-D,
   squashed with the efficient squash (eq. 6, ``(1 - e^-||s||) s / ||s||``,
   :func:`~torchvote.functional.routing.efficient_squash`);
3. a fully connected capsule layer (:class:`~torchvote.nn.capsules.CapsuleLinear`, 10 x 16-D)
   routed by self-attention (eqs. 3-5: each vote's logit is its agreement with all the votes for
   the same class, ``softmax`` over the classes, plus a learned log prior; ``router=
   "self_attention"``) or any other router of :func:`~torchvote.functional.routing.list_routers`;
4. (3 and 4 are the :class:`~torchvote.models.capsule_head.CapsuleHead` of every capsule model)
   class scores = capsule lengths (EM's activations with ``router="em"``, trained with the
   spread loss that ``loss.name=auto``, the presets' choice, picks for it, see
   :mod:`torchvote.models.capsnet`), the
   margin loss and the optional masked decoder of CapsNet
   (512-1024-784, :class:`~torchvote.models.capsule_head.CapsuleDecoder`; its loss weight is
   ``LossConfig.reconstruction_weight``, 0.0005 for a sum of squares = the paper's 0.392 for a
   mean over 784 pixels).

Parameters in the paper's configuration (the ``paper`` preset): **161,824** without the decoder
(the paper's "161K"): convolutions 832 + 18,496 + 36,928 + 73,856, batch norms 64 + 128 + 128 +
256, depthwise primary capsules 10,496, class capsules 20,480 weights + the router's 160 log
prior. The decoder adds 1,411,344.

When the depthwise kernel covers the whole map (the paper's case) the convolution is computed as
the per-channel dot product it is (a multiply and a sum), several times faster on CPU than a
grouped convolution and its backward; the convolutions run in the channels-last layout oneDNN
prefers on CPU. Neither changes the numbers beyond float rounding.

Index legend: ``b`` batch, ``t`` primary capsule types, ``d`` capsule features, ``c`` channels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from einops import rearrange
from torch import Tensor, nn

from torchvote.functional.routing import efficient_squash
from torchvote.models.capsule_config import (
    CapsuleClassifierConfig,
    check_classifier_fields,
    check_positive,
    check_positive_scale,
    check_positive_tuples,
    check_router,
    to_tuple,
)
from torchvote.models.capsule_head import VECTOR_HEAD_RENAMES, CapsuleClassifier, CapsuleHead
from torchvote.models.registry import register_model
from torchvote.nn.capsules import check_feature_maps
from torchvote.validation import (
    check_bool_fields,
    check_choice,
    check_float_dtype,
    check_in_range,
    check_positive_float,
    check_positive_int,
)

__all__ = ["CONV_INITS", "DepthwisePrimaryCapsules", "EfficientCapsNet", "EfficientCapsNetConfig"]

#: The convolutions' initialisations: PyTorch's own, and Keras's that the authors' code uses.
CONV_INITS = ("uniform", "he_normal")

# Keras's truncated normal keeps values within two standard deviations; dividing the standard
# deviation by that truncation's own (0.8796...) restores the variance asked for.
_TRUNCATED_NORMAL_STD = 0.87962566103423978


class _HeNormalConv2d(nn.Conv2d):
    """A convolution initialised as Keras's ``he_normal`` (the authors' choice): weights from a
    normal of standard deviation ``sqrt(2 / fan_in)`` truncated at two of its standard deviations,
    rescaled to keep that variance; zero biases (Keras's default). ``reset_parameters`` draws them
    again, as PyTorch's modules do (after ``to_empty`` of a module built on ``"meta"``)."""

    def reset_parameters(self) -> None:
        fan_in = self.in_channels // self.groups * math.prod(self.kernel_size)
        std = math.sqrt(2.0 / fan_in) / _TRUNCATED_NORMAL_STD
        nn.init.trunc_normal_(self.weight, 0.0, std, -2.0 * std, 2.0 * std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


@dataclass
class EfficientCapsNetConfig(CapsuleClassifierConfig):
    """Every size of Efficient-CapsNet; the defaults are the paper's MNIST network.

    Args (after ``image_size``, ``in_channels``, ``num_classes`` of
    :class:`~torchvote.models.capsule_config.CapsuleClassifierConfig`):
        conv_channels: output channels of the convolutions (32, 64, 64, 128).
        conv_kernels: their kernel sides (5, 3, 3, 3), no padding.
        conv_strides: their strides (1, 1, 1, 2).
        primary_types: primary capsule types (16); ``primary_types * primary_dim`` must equal
            ``conv_channels[-1]`` (the depthwise convolution keeps the channels).
        primary_dim: features per primary capsule (8).
        primary_kernel: the depthwise kernel side; ``None`` for the whole last map (the paper:
            9, one capsule per type). A smaller kernel gives a grid of capsules per type.
        class_dim: features per class capsule (16).
        router: the class layer's routing, a name of ``list_routers()`` (``"self_attention"``).
        router_options: keyword arguments of the router (e.g. ``{"log_prior": False}``).
        iterations: routing iterations of the iterative routers (self-attention has one pass).
        init_std: standard deviation of the class layer's normal initialisation; ``None`` for
            He's ``sqrt(2 / fan_in)`` with the fan-in Keras computes for the authors' kernel,
            ``num_classes * in_caps * primary_dim`` (0.0395 on MNIST).
        decoder: add the reconstruction network.
        decoder_hidden: widths of the decoder's hidden layers (512, 1024).
        batch_norm_momentum: how far each training batch moves the batch norms' running
            statistics, in PyTorch's sense (0.1, PyTorch's default; the authors' Keras momentum
            0.99 is 0.01 here).
        batch_norm_eps: added to the batch norms' variances (1e-5; the authors' 1e-3).
        conv_init: the convolutions' initialisation: ``"uniform"`` (PyTorch's) or
            ``"he_normal"`` (Keras's, the authors': a normal of standard deviation
            ``sqrt(2 / fan_in)`` truncated at two of its standard deviations, rescaled to keep
            that variance, and zero biases).

    Raises:
        ValueError: a bad field, naming it: among them a tuple field given as anything but a
            tuple (or list) of positive integers, an ``init_std`` that is neither ``None`` nor
            a positive finite number, a ``batch_norm_momentum`` outside ``[0, 1]``, a
            ``batch_norm_eps`` that is not positive, and an unknown ``conv_init``.
    """

    conv_channels: tuple[int, ...] = (32, 64, 64, 128)
    conv_kernels: tuple[int, ...] = (5, 3, 3, 3)
    conv_strides: tuple[int, ...] = (1, 1, 1, 2)
    primary_types: int = 16
    primary_dim: int = 8
    primary_kernel: int | None = None
    class_dim: int = 16
    router: str = "self_attention"
    router_options: dict[str, Any] = field(default_factory=dict)
    iterations: int = 3
    init_std: float | None = None
    decoder: bool = True
    decoder_hidden: tuple[int, ...] = (512, 1024)
    batch_norm_momentum: float = 0.1
    batch_norm_eps: float = 1e-5
    conv_init: str = "uniform"

    def __post_init__(self) -> None:
        check_bool_fields(self)
        for name in ("conv_channels", "conv_kernels", "conv_strides", "decoder_hidden"):
            setattr(self, name, to_tuple(getattr(self, name), name))
        check_classifier_fields(
            self,
            (
                "primary_types",
                "primary_dim",
                "class_dim",
                "iterations",
            ),
        )
        check_router(self.router, self.router_options)
        check_positive_tuples(self, ("conv_channels", "conv_kernels", "conv_strides", "decoder_hidden"))
        if not self.conv_channels:
            raise ValueError("conv_channels must name at least one convolution")
        if not len(self.conv_channels) == len(self.conv_kernels) == len(self.conv_strides):
            raise ValueError(
                f"conv_channels, conv_kernels and conv_strides must have one entry per convolution, got "
                f"{len(self.conv_channels)}, {len(self.conv_kernels)} and {len(self.conv_strides)}"
            )
        if self.primary_types * self.primary_dim != self.conv_channels[-1]:
            raise ValueError(
                f"primary_types * primary_dim ({self.primary_types} * {self.primary_dim}) must equal "
                f"conv_channels[-1] ({self.conv_channels[-1]}): the depthwise convolution keeps the channels"
            )
        if self.feature_grid < 1:
            raise ValueError(
                f"image_size={self.image_size} is too small for conv_kernels={self.conv_kernels} and "
                f"conv_strides={self.conv_strides}"
            )
        if self.primary_kernel is not None:
            check_positive(self, ("primary_kernel",))
            if self.primary_kernel > self.feature_grid:
                raise ValueError(
                    f"primary_kernel={self.primary_kernel} is larger than the {self.feature_grid}x"
                    f"{self.feature_grid} map the convolutions leave"
                )
        check_positive_scale(self.init_std, "init_std", optional=True)
        self.batch_norm_momentum = check_in_range(self.batch_norm_momentum, "batch_norm_momentum", 0.0, 1.0)
        self.batch_norm_eps = check_positive_float(self.batch_norm_eps, "batch_norm_eps")
        check_choice(self.conv_init, CONV_INITS, "conv_init")

    @property
    def feature_grid(self) -> int:
        """Side of the last convolution's map (9 on MNIST); 0 if the convolutions do not fit."""
        side = self.image_size
        for kernel, stride in zip(self.conv_kernels, self.conv_strides, strict=True):
            if side < kernel:
                return 0
            side = (side - kernel) // stride + 1
        return side

    @property
    def depthwise_kernel(self) -> int:
        """The depthwise kernel side: ``primary_kernel``, or the whole map."""
        return self.feature_grid if self.primary_kernel is None else self.primary_kernel

    @property
    def num_primary_caps(self) -> int:
        """Primary capsules, the class layer's ``in_caps`` (16 on MNIST)."""
        return self.primary_types * (self.feature_grid - self.depthwise_kernel + 1) ** 2

    @property
    def class_init_std(self) -> float:
        """The class layer's initialisation scale (``init_std`` or He's, see the field)."""
        if self.init_std is not None:
            return self.init_std
        return math.sqrt(2.0 / (self.num_classes * self.num_primary_caps * self.primary_dim))


class DepthwisePrimaryCapsules(nn.Module):
    """Primary capsules from a depthwise convolution (Mazzia et al. 2021, "Primary capsules").

    Each channel is convolved with its own ``kernel_size`` kernel; the channels at each output
    position are grouped as ``(type, feature)`` into capsules and squashed with the efficient
    squash (eq. 6). With a kernel as large as the map (the paper) each type gives one capsule.

    Args:
        channels: input (and output) channels, ``num_types * caps_dim``.
        num_types: capsule types.
        caps_dim: features per capsule.
        kernel_size: the depthwise kernel side.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: a size that is not a positive integer, ``channels`` not
            ``num_types * caps_dim``.
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    def __init__(
        self,
        channels: int,
        num_types: int,
        caps_dim: int,
        *,
        kernel_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for argument, size in (
            ("channels", channels), ("num_types", num_types), ("caps_dim", caps_dim),
            ("kernel_size", kernel_size),
        ):
            check_positive_int(size, argument)
        if channels != num_types * caps_dim:
            raise ValueError(
                f"channels ({channels}) must equal num_types * caps_dim ({num_types} * {caps_dim})"
            )
        self.num_types = num_types
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.conv = nn.Conv2d(channels, channels, kernel_size, groups=channels, **factory)

    def forward(self, features: Tensor) -> Tensor:
        """``(b, channels, h, w)`` -> ``(b, num_types * h' * w', caps_dim)`` squashed capsules.

        Raises:
            TypeError, ValueError: ``features`` that the convolution cannot take (as
                :class:`~torchvote.nn.PrimaryCapsules` refuses them: the whole-map product below
                changed the dtype or failed inside einops).
        """
        check_feature_maps(features, self.conv)
        if features.shape[-2:] == self.conv.weight.shape[-2:]:
            # The kernel covers the map: one dot product per channel, no grouped convolution.
            dots = (features * self.conv.weight.squeeze(1)).sum(dim=(-2, -1)) + self.conv.bias  # (b, c)
            maps = dots[..., None, None]  # (b, c, 1, 1)
        else:
            maps = self.conv(features)  # (b, c, h', w')
        capsules = rearrange(maps, "b (t d) h w -> b (t h w) d", t=self.num_types)  # channels at a position
        return efficient_squash(capsules, dim=-1)


@register_model(
    "efficient-capsnet",
    config=EfficientCapsNetConfig,
    presets={
        "paper": {},
        "authors": {"batch_norm_momentum": 0.01, "batch_norm_eps": 1e-3, "conv_init": "he_normal"},
        "tiny": {
            "conv_channels": (8, 16, 16, 32),
            "primary_types": 4,
            "primary_dim": 8,
            "class_dim": 8,
            "decoder_hidden": (32,),
        },
    },
    task="image-classification",
    loss="margin",
)
class EfficientCapsNet(CapsuleClassifier):
    """Efficient-CapsNet (Mazzia et al. 2021): convolutions, depthwise primary capsules,
    self-attention routing.

    ``forward(images, targets=None)`` (:meth:`CapsuleClassifier.forward`) gives the capsule
    lengths as scores (EM activations with ``router="em"``), ``poses`` ``(b, num_classes,
    class_dim)`` and ``couplings`` ``(b, num_classes, num_primary_caps)``.

    Args:
        config: the sizes; see :class:`EfficientCapsNetConfig`.
        device: where to create the parameters and buffers.
        dtype: their dtype.

    Raises:
        ValueError: ``router_options`` the router does not take.
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    legacy_renames = VECTOR_HEAD_RENAMES

    def __init__(
        self,
        config: EfficientCapsNetConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(config)
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        layers: list[nn.Module] = []
        in_channels = config.in_channels
        for channels, kernel, stride in zip(
            config.conv_channels, config.conv_kernels, config.conv_strides, strict=True
        ):
            # The authors' order: convolution, ReLU, then batch normalisation.
            convolution = _HeNormalConv2d if config.conv_init == "he_normal" else nn.Conv2d
            layers += [
                convolution(in_channels, channels, kernel, stride=stride, **factory),
                nn.ReLU(),
                nn.BatchNorm2d(channels, eps=config.batch_norm_eps, momentum=config.batch_norm_momentum,
                               **factory),
            ]
            in_channels = channels
        self.features = nn.Sequential(*layers).to(memory_format=torch.channels_last)
        self.primary = DepthwisePrimaryCapsules(
            in_channels,
            config.primary_types,
            config.primary_dim,
            kernel_size=config.depthwise_kernel,
            **factory,
        )
        self.head = CapsuleHead.from_config(config, init_std=config.class_init_std, **factory)

    def capsules(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The convolutions and the depthwise primary capsules: ``(b, num_primary_caps,
        primary_dim)``."""
        features = self.features(images.contiguous(memory_format=torch.channels_last))  # (b, c, g, g)
        return self.primary(features), {}  # (b, j, primary_dim)
