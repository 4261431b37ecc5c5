"""A Vision Transformer image classifier (Dosovitskiy et al. 2021) with swappable attention.

Dosovitskiy, Beyer, Kolesnikov, Weissenborn, Zhai, Unterthiner, Dehghani, Minderer, Heigold,
Gelly, Uszkoreit & Houlsby 2021, "An Image is Worth 16x16 Words: Transformers for Image
Recognition at Scale": the image is cut into ``patch_size`` squares, each flattened and linearly
projected (eq. 1; a convolution with kernel and stride ``patch_size`` is that projection), a
learned ``[class]`` token is prepended, positions are added, a stack of pre-norm Transformer
layers (eq. 2, 3) runs, and the class token's final state, layer-normed (eq. 4), goes through a
linear head. ``pooling="mean"`` averages the patch states instead of using a class token.

Every self-attention is :class:`~torchvote.nn.MultiHeadAttention` (``attention="softmax"``) or
:class:`~torchvote.nn.routing_attention.RoutingAttention` (``attention="routing"``,
``routing_iterations`` passes of the voting operator), through the layers' ``attention=`` hook.

The defaults are ViT-Base/16 (Table 1: 12 layers, 768 features, MLP 3072, 12 heads) on 224x224
RGB images with 1000 classes; the ``small`` and ``tiny`` presets are for 28x28 MNIST on a CPU
(``image_size``, ``in_channels`` and ``num_classes`` come from the data set when training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from einops import rearrange
from torch import Tensor, nn

from torchvote.models.capsule_config import check_images, check_targets
from torchvote.models.registry import ClassifierOutput, register_model
from torchvote.models.transformer_backbone import TransformerBackboneFields, run_stack
from torchvote.nn.transformer_stack import TransformerEncoder
from torchvote.validation import check_choice, check_flag, check_float_dtype

__all__ = ["TransformerClassifier", "TransformerClassifierConfig"]


@dataclass
class TransformerClassifierConfig(TransformerBackboneFields):
    """Sizes and choices of the Vision Transformer; the defaults are ViT-Base/16.

    Args:
        image_size: side of the square input images (filled from the data set when training).
        in_channels: channels of the input images (filled from the data set).
        num_classes: output classes (filled from the data set).
        patch_size: side of the square patches; must divide ``image_size``.
        d_model: feature size ``E`` of the patch tokens.
        num_heads: attention heads; must divide ``d_model``.
        num_layers: Transformer layers.
        dim_feedforward: hidden size of the MLPs; ``None`` for ``4 * d_model``.
        dropout: on the embeddings, the attention weights and every sublayer's output.
        activation: ``"gelu"`` (ViT) or ``"relu"``.
        pooling: ``"cls"`` (a learned class token, ViT) or ``"mean"`` (average of the patches).
        positional: ``"learned"`` (ViT) or ``"sinusoidal"`` (1-D over the token sequence).
        attention: ``"softmax"`` (multi-head attention) or ``"routing"`` (iterative
            routing-style attention).
        routing_iterations: voting passes of the routing attention (1 equals softmax;
            unused by ``attention="softmax"``).
        routing_normalize_over: the routing attention's softmax axis: ``"senders"`` (attention)
            or ``"receivers"`` (capsule routing: every token spends one unit of vote over the
            tokens; needs ``attention="routing"``).

    Raises:
        ValueError: a field out of range or inconsistent, naming it.
    """

    image_size: int = 224
    in_channels: int = 3
    num_classes: int = 1000
    patch_size: int = 16
    d_model: int = 768
    num_heads: int = 12
    num_layers: int = 12
    dim_feedforward: int | None = 3072
    dropout: float = 0.1
    activation: Literal["relu", "gelu"] = "gelu"
    pooling: Literal["cls", "mean"] = "cls"
    positional: Literal["learned", "sinusoidal"] = "learned"
    attention: Literal["softmax", "routing"] = "softmax"
    routing_iterations: int = 3
    routing_normalize_over: Literal["senders", "receivers"] = "senders"

    def __post_init__(self) -> None:
        self.check_backbone("image_size", "in_channels", "num_classes", "patch_size", "num_layers")
        if self.num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {self.num_classes}")
        if self.image_size % self.patch_size:
            raise ValueError(f"patch_size ({self.patch_size}) must divide image_size ({self.image_size})")
        check_choice(self.pooling, ("cls", "mean"), "pooling")

    @property
    def num_patches(self) -> int:
        """Patches per image: ``(image_size / patch_size) ** 2``."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        """Length of the token sequence: the patches, plus the class token with ``pooling="cls"``."""
        return self.num_patches + (1 if self.pooling == "cls" else 0)


@register_model(
    "transformer-classifier",
    config=TransformerClassifierConfig,
    presets={
        "vit-base": {},
        "small": {
            "image_size": 28,
            "in_channels": 1,
            "num_classes": 10,
            "patch_size": 4,
            "d_model": 64,
            "num_heads": 4,
            "num_layers": 4,
            "dim_feedforward": 128,
            "dropout": 0.1,
        },
        "tiny": {
            "image_size": 28,
            "in_channels": 1,
            "num_classes": 10,
            "patch_size": 4,
            "d_model": 16,
            "num_heads": 2,
            "num_layers": 1,
            "dim_feedforward": 32,
            "dropout": 0.0,
        },
    },
    task="image-classification",
    loss="cross-entropy",
)
class TransformerClassifier(nn.Module):
    """Vision Transformer (Dosovitskiy et al. 2021): patches as tokens, softmax or routing attention.

    Args:
        config: a :class:`TransformerClassifierConfig`.
        device: where to create the parameters and buffers.
        dtype: their dtype.

    Raises:
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    def __init__(
        self,
        config: TransformerClassifierConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        # Flatten-and-project every patch (eq. 1), written as a strided convolution.
        self.patch_embedding = nn.Conv2d(
            config.in_channels,
            config.d_model,
            kernel_size=config.patch_size,
            stride=config.patch_size,
            **factory,
        )
        self.class_token: nn.Parameter | None = None
        if config.pooling == "cls":
            self.class_token = nn.Parameter(torch.empty(1, 1, config.d_model, **factory))
            self.reset_parameters()
        self.positions = config.make_positions(config.num_tokens, **factory)
        self.dropout = nn.Dropout(config.dropout)
        layer = config.layer_config(norm_first=True)
        self.encoder = TransformerEncoder(layer, config.num_layers, **factory)  # ends in a layer norm (eq. 4)
        self.head = nn.Linear(config.d_model, config.num_classes, **factory)

    def reset_parameters(self) -> None:
        """Draw the class token again from ``N(0, 0.02^2)``, as the constructor does (after
        ``to_empty()`` of a model built on the ``"meta"`` device; the layers' parameters are
        theirs to reset)."""
        if self.class_token is not None:
            nn.init.normal_(self.class_token, std=0.02)

    def forward(
        self, images: Tensor, targets: Tensor | None = None, *, need_weights: bool = False
    ) -> ClassifierOutput:
        """Class logits of a batch of images.

        Args:
            images: ``(b, in_channels, image_size, image_size)``.
            targets: accepted for the common classifier signature and checked as every
                classifier checks them (:func:`~torchvote.models.capsule_config.check_targets`);
                not used.
            need_weights: record every layer's attention weights (averaged over the heads).

        Returns:
            A :class:`~torchvote.models.ClassifierOutput` with ``scores`` ``(b, num_classes)``
            logits; with ``need_weights``, ``couplings`` is the last layer's ``(b, T, T)``
            attention over the ``T = num_tokens`` tokens (class token first, then the patches in
            row-major order) and ``intermediates`` every layer's, by module name.

        Raises:
            ValueError: images of the wrong shape; targets of the wrong shape or range.
            TypeError: targets that are not integer class indices; images that are not a
                floating-point tensor (e.g. ``uint8`` pixels, a list)
                or not of the parameters' dtype (outside ``torch.autocast``); a ``need_weights``
                that is not a bool.
        """
        check_images(images, self.config, self.patch_embedding.weight)
        check_targets(targets, images.shape[0], self.config.num_classes)
        check_flag(need_weights, "need_weights")
        patches = self.patch_embedding(images)  # (b, E, h / p, w / p)
        tokens = rearrange(patches, "b e h w -> b (h w) e")  # (b, N, E)
        if self.class_token is not None:
            # shape[0], not len(images): an int that would fix the batch size of an exported model
            class_token = self.class_token.expand(images.shape[0], -1, -1)  # (b, 1, E)
            tokens = torch.cat([class_token, tokens], dim=1)  # (b, 1 + N, E)
        x = self.dropout(self.positions(tokens))  # (b, T, E)
        hidden, record = run_stack(self.encoder, x, need_weights=need_weights)  # (b, T, E)
        pooled = hidden[:, 0] if self.class_token is not None else hidden.mean(dim=1)  # (b, E)
        scores = self.head(pooled)  # (b, num_classes)
        if record is None:
            return ClassifierOutput(scores=scores)
        return ClassifierOutput(scores=scores, couplings=record.last, intermediates=record.weights)
