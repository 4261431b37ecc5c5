"""The CNN baseline of the CapsNet paper (Sabour, Frosst and Hinton 2017, sec. 5).

"The baseline is a standard CNN with three convolutional layers of 256, 256, 128 channels. Each
has 5x5 kernels and stride of 1. The last convolutional layers are followed by two fully connected
layers of size 328, 192. The last fully connected layer is connected with dropout to a 10 class
softmax layer with cross entropy loss." The paper gives 35.4M parameters for it, which is what
"same" padding and no pooling give on 28x28 inputs; the defaults below reproduce that count.

The ``small`` preset (narrow convolutions, two 2x2 max-pools) is the CPU-sized variant.

The paper does not give the initialisation. PyTorch's default (uniform with variance
``1 / (3 fan_in)``) shrinks the signal by a factor of about 6 in variance at each ReLU layer; on the
40x40 canvas of the affNIST experiment the paper-size network then never left the uniform
prediction (loss 2.301 for 20 epochs on a GPU). The layers followed by a ReLU are therefore
initialised as He et al. 2015 derive for ReLU networks (sec. 2.2, eq. 10: normal with variance
``2 / fan_in``), the classifier as Glorot and Bengio 2010 (eq. 16), every bias at zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchvote.models.capsule_config import check_images, check_positive_tuples, check_targets, to_tuple
from torchvote.models.registry import ClassifierOutput, register_model
from torchvote.validation import check_float_dtype, check_positive_int, check_probability

__all__ = ["CNNBaseline", "CNNBaselineConfig"]


@dataclass
class CNNBaselineConfig:
    """Sizes of the CNN baseline; the defaults are the paper's.

    Args:
        image_size: side of the square input images.
        in_channels: channels of the input images.
        num_classes: number of output classes.
        channels: output channels of each 5x5 convolution.
        kernel_size: side of every convolution kernel (stride 1, "same" padding).
        pool_after: indices of the convolutions followed by a 2x2 max-pool (none in the paper).
        hidden: widths of the fully connected layers after the convolutions.
        dropout: dropout probability before the classifier (the paper does not give it).

    Raises:
        ValueError: a bad field, naming it: sizes that are not positive integers (bools and
            floats included), ``num_classes`` below 2, ``channels``, ``hidden`` or ``pool_after``
            that are not tuples of such integers (a zero width would cut the classifier off its
            input), an even kernel, pools that leave nothing, a dropout outside ``[0, 1)``.
    """

    image_size: int = 28
    in_channels: int = 1
    num_classes: int = 10
    channels: tuple[int, ...] = (256, 256, 128)
    kernel_size: int = 5
    pool_after: tuple[int, ...] = ()
    hidden: tuple[int, ...] = (328, 192)
    dropout: float = 0.5

    def __post_init__(self) -> None:
        for name in ("image_size", "in_channels", "kernel_size"):
            check_positive_int(getattr(self, name), name)
        check_positive_int(self.num_classes, "num_classes", minimum=2)
        self.channels = to_tuple(self.channels, "channels")
        self.pool_after = to_tuple(self.pool_after, "pool_after")
        self.hidden = to_tuple(self.hidden, "hidden")
        if not self.channels:
            raise ValueError(f"channels must be a non-empty tuple of positive ints, got {self.channels}")
        check_positive_tuples(self, ("channels", "hidden"))
        if self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd and positive ('same' padding), got {self.kernel_size}")
        bad = [
            i for i in self.pool_after
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(self.channels)
        ]
        if bad:
            raise ValueError(f"pool_after indices {bad} are not convolutions 0..{len(self.channels) - 1}")
        if self.image_size // 2 ** len(set(self.pool_after)) < 1:
            raise ValueError(
                f"{len(set(self.pool_after))} pools shrink {self.image_size}x{self.image_size} to nothing"
            )
        check_probability(self.dropout, "dropout")

    @property
    def feature_size(self) -> int:
        """Side of the feature map after the convolutions (each 2x2 pool floors the side by 2)."""
        side = self.image_size
        for _ in sorted(set(self.pool_after)):
            side //= 2
        return side


@register_model(
    "cnn-baseline",
    config=CNNBaselineConfig,
    presets={
        "paper": {},
        "small": {"channels": (32, 64, 64), "pool_after": (0, 1), "hidden": (328, 192), "dropout": 0.3},
        "tiny": {"channels": (8, 16), "pool_after": (0, 1), "hidden": (32,), "dropout": 0.0},
    },
    task="image-classification",
    loss="cross-entropy",
)
class CNNBaseline(nn.Module):
    """Three 5x5 convolutions, two fully connected layers, dropout and a softmax classifier.

    Args:
        config: the sizes; see :class:`CNNBaselineConfig`.
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    def __init__(
        self,
        config: CNNBaselineConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        layers: list[nn.Module] = []
        in_channels = config.in_channels
        for index, out_channels in enumerate(config.channels):
            layers += [
                nn.Conv2d(
                    in_channels, out_channels, config.kernel_size, padding=config.kernel_size // 2, **factory
                ),
                nn.ReLU(inplace=True),
            ]
            if index in config.pool_after:
                layers.append(nn.MaxPool2d(2))
            in_channels = out_channels
        self.features = nn.Sequential(*layers)

        fully_connected: list[nn.Module] = [nn.Flatten()]
        width = in_channels * config.feature_size**2
        for hidden in config.hidden:
            fully_connected += [nn.Linear(width, hidden, **factory), nn.ReLU(inplace=True)]
            width = hidden
        self.fully_connected = nn.Sequential(*fully_connected)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(width, config.num_classes, **factory)
        self._initialise()

    def _initialise(self) -> None:
        """He-normal weights before each ReLU, Glorot-uniform classifier, zero biases (module docstring)."""
        for module in [*self.features, *self.fully_connected]:
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(module.weight, mode="fan_in", nonlinearity="relu")
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.classifier.weight)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, images: Tensor, targets: Tensor | None = None) -> ClassifierOutput:
        """``(b, c, h, w)`` images -> :class:`ClassifierOutput` with ``(b, num_classes)`` logits.

        ``targets`` is accepted for the common classifier signature, checked as every classifier
        checks them (:func:`~torchvote.models.capsule_config.check_targets`), and not used.

        Raises:
            TypeError: images that are not a floating-point tensor of the parameters' dtype
                (outside ``torch.autocast``), e.g. ``uint8`` pixels; targets that are not
                integer class indices.
            ValueError: images of another shape than ``(b, in_channels, image_size, image_size)``;
                targets of the wrong shape or range.
        """
        check_images(images, self.config, self.classifier.weight)
        check_targets(targets, images.shape[0], self.config.num_classes)
        features = self.features(images)  # (b, channels[-1], s, s)
        hidden = self.fully_connected(features)  # (b, hidden[-1])
        return ClassifierOutput(scores=self.classifier(self.dropout(hidden)))
