"""CapsNet: Sabour, Frosst & Hinton 2017, "Dynamic Routing Between Capsules" (NeurIPS).

The network of sec. 4 (Fig. 1 and 2), every size from :class:`CapsNetConfig`:

1. ``Conv1``: a ``conv_kernel x conv_kernel`` convolution, stride 1, ``conv_channels`` ReLU maps
   (256 @ 9x9 in the paper);
2. ``PrimaryCaps``: :class:`~torchvote.nn.capsules.PrimaryCapsules`, ``primary_types`` types of
   ``primary_dim``-D squashed capsules from a ``primary_kernel`` convolution of stride
   ``primary_stride`` (32 types of 8-D, 9x9, stride 2: a 6x6 grid, 1152 capsules on 28x28 inputs;
   the count is computed from the convolution arithmetic, :attr:`CapsNetConfig.num_primary_caps`);
3. ``DigitCaps``: :class:`~torchvote.nn.capsules.CapsuleLinear`, one ``class_dim``-D capsule per
   class (10 x 16-D), votes ``u_ij = W_ij u_j`` (eq. 2, with the paper's letters swapped: ``i`` the
   class capsule, ``j`` the primary capsule, as everywhere in torchvote) routed by ``router`` (dynamic
   routing, Procedure 1, ``iterations`` = 3, by default; any name of
   :func:`torchvote.functional.routing.list_routers`);
4. the class scores are the lengths ``||v_i||`` of the class capsules (sec. 2: "the length of the
   output vector of a capsule [is] the probability that the entity ... exists"), trained with the
   margin loss (eq. 4, ``loss="margin"``);
5. the decoder (sec. 4.1, Fig. 2): all class capsules but one are masked to zero, and three fully
   connected layers (512 and 1024 ReLU units, then ``in_channels * image_size**2`` sigmoid units)
   reconstruct the image. The kept capsule is the true class during training (``targets`` given)
   and the highest-scoring one otherwise (the longest capsule; the highest activation with
   ``router="em"``, the highest logit with ``scores="linear"``). Its loss (sum of squared
   errors, scaled by 0.0005) is ``LossConfig.reconstruction_weight`` of the training config, not
   a model field.

Steps 3 to 5 are the :class:`~torchvote.models.capsule_head.CapsuleHead` every capsule model
shares (``model.head``); the model itself is the stem (Conv1) and the primary capsules.

MultiMNIST (sec. 6): with ``targets`` of shape ``(b, k)`` (the ``k`` digits of each image) the
decoder reconstructs each digit from its own capsule, ``reconstructions`` ``(b, k, c, h, w)``,
which the training loop compares with each digit alone.

**Routers.** Every name of ``list_routers()`` works. With ``router="em"`` the class capsules are
EM routing's means and the scores are EM's output activations (the primary capsules' lengths are
the input activations); it trains with the spread loss (``loss.name=auto``, the default, picks
it for the EM router; an explicit ``loss.name`` wins), the loss EM's logistic activations were
made for (Hinton et al. 2018, sec. 3.1: they are compared with each other, not with absolute
targets). The margin loss trains it too: the tiny preset, 100 steps on small digits, 88% training
accuracy against 90% with the spread loss at 07757f2 (when the EM router was first added, d7d0d6f,
the margin loss stalled it at 9%); the small preset on MNIST, 156 steps, 3 seeds, 2.08% error
against 2.71% (``docs/results.md``, row f's controls). Every other router gives vectors whose
length is the score (``slot`` squashes its last slots for that, see
:class:`~torchvote.nn.routers.slot.SlotRouter`); ``inverted_dot_product``, whose outputs are
layer-normalised, not squashed, trains with the margin loss too, more slowly, its lengths not being
bounded by 1; ``scores="linear"`` gives it Tsai et al. 2020's own readout (row f of
``docs/results.md``: level with EM routing there).

Paper size (the ``paper`` preset, the defaults): 8,215,568 parameters with the decoder (6,804,224
without), the paper's "8.2M" and "6.8M" (sec. 5). ``small`` is a CPU-sized preset (64 @ 9x9,
8 types of 8-D, 288 capsules, a 256-512 decoder) and ``tiny`` is for tests.

Index legend: ``b`` batch, ``k`` reconstructed capsules per image, ``i`` class capsules
(receivers), ``j`` primary capsules (senders), ``d`` capsule features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchvote.models.capsule_config import (
    CapsuleClassifierConfig,
    check_classifier_fields,
    check_positive_scale,
    check_positive_tuples,
    check_router,
    to_tuple,
)
from torchvote.models.capsule_head import CLASS_SCORES, VECTOR_HEAD_RENAMES, CapsuleClassifier, CapsuleHead
from torchvote.models.registry import register_model
from torchvote.nn.capsules import PrimaryCapsules
from torchvote.validation import check_bool_fields, check_choice, check_float_dtype

__all__ = ["CAPSNET_PRESETS", "CapsNet", "CapsNetConfig"]


# --- CapsNet ---------------------------------------------------------------------------------------


@dataclass
class CapsNetConfig(CapsuleClassifierConfig):
    """Every size of CapsNet; the defaults are the paper's (Sabour et al. 2017, sec. 4).

    Args (after ``image_size``, ``in_channels``, ``num_classes`` of
    :class:`~torchvote.models.capsule_config.CapsuleClassifierConfig`):
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
        scores: how the class capsules become class scores: ``"length"`` (Sabour et al. 2017,
            sec. 2: their lengths, for the margin loss; EM routing's activations where the router
            gives them) or ``"linear"`` (Tsai et al. 2020, their classifier: one linear map ``R^d -> R``
            shared by every class capsule gives its logit, trained with cross-entropy, which
            ``loss.name=auto`` then picks; one label per image).

    Raises:
        ValueError: a bad field, naming it (sizes that leave no capsule name the geometry): among
            them ``decoder_hidden`` that is not a tuple of positive integers, an ``init_std``
            that is not a positive finite number and ``scores`` that is neither ``"length"`` nor
            ``"linear"``.
    """

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
    scores: str = "length"

    def __post_init__(self) -> None:
        check_bool_fields(self)
        check_choice(self.scores, CLASS_SCORES, "scores")
        self.decoder_hidden = to_tuple(self.decoder_hidden, "decoder_hidden")
        check_classifier_fields(
            self,
            (
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
        check_router(self.router, self.router_options)
        check_positive_scale(self.init_std, "init_std")
        check_positive_tuples(self, ("decoder_hidden",))
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
class CapsNet(CapsuleClassifier):
    """CapsNet (Sabour et al. 2017): Conv1, primary capsules, routed class capsules, masked decoder.

    ``forward(images, targets=None)`` (:meth:`CapsuleClassifier.forward`) gives the capsule
    lengths as scores (EM activations with ``router="em"``), ``poses`` ``(b, num_classes,
    class_dim)`` and ``couplings`` ``(b, num_classes, num_primary_caps)``, each sender's column
    summing to 1.

    Args:
        config: the sizes; see :class:`CapsNetConfig`.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: ``router_options`` the router does not take.
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    legacy_renames = VECTOR_HEAD_RENAMES

    def __init__(
        self,
        config: CapsNetConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(config)
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        self.conv = nn.Conv2d(config.in_channels, config.conv_channels, config.conv_kernel, **factory)
        self.primary = PrimaryCapsules(
            config.conv_channels,
            config.primary_types,
            config.primary_dim,
            kernel_size=config.primary_kernel,
            stride=config.primary_stride,
            **factory,
        )
        self.head = CapsuleHead.from_config(config, init_std=config.init_std, **factory)

    def capsules(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Conv1 and the primary capsules: ``(b, num_primary_caps, primary_dim)``, squashed."""
        features = F.relu(self.conv(images))  # (b, conv_channels, g, g)
        return self.primary(features), {}  # (b, j, primary_dim)
