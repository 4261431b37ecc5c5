"""The capsule classifier head shared by every capsule network: class capsules, their router,
the class scores, and the masked decoder that reconstructs the image.

Each capsule model is a stem (convolutions), primary capsules and one :class:`CapsuleHead`:

- :class:`~torchvote.models.capsnet.CapsNet` and
  :class:`~torchvote.models.efficient_capsnet.EfficientCapsNet`: vector capsules, a
  :class:`~torchvote.nn.capsules.CapsuleLinear` class layer and the decoder of Sabour et al. 2017,
  sec. 4.1 (:meth:`CapsuleHead.from_config`);
- :class:`~torchvote.models.em_capsnet.EMCapsNet`: matrix capsules, a
  :class:`~torchvote.nn.em_capsules.ClassMatrixCapsules` class layer, no decoder.

The scores are the router's output activations when it has them (EM routing), else the class
capsules' lengths (Sabour et al. 2017, sec. 2); or, with a linear scorer (``scores="linear"``, Tsai
et al. 2020), logits that one linear map shared by every class capsule makes of its pose. A router
that weighs votes by activations (``router.uses_activations``) gets, from vector capsules, their
lengths.

Each model subclasses :class:`CapsuleClassifier`, which owns ``forward`` (check the images, run
the model's stem and primary capsules, :meth:`CapsuleClassifier.capsules`, then the head) and the
renaming of older checkpoints' keys. The checks every capsule model config shares are in
:mod:`torchvote.models.capsule_config`.

Index legend: ``b`` batch, ``k`` reconstructed capsules per image, ``i`` class capsules
(receivers), ``j`` primary capsules (senders), ``d`` capsule features.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from torchvote.models.capsule_config import check_images, check_targets, router_options_errors
from torchvote.models.registry import ClassifierOutput
from torchvote.nn.capsules import CapsuleLinear
from torchvote.nn.routers import Router, RoutingResult
from torchvote.nn.routers.base import is_iterative
from torchvote.validation import (
    check_float_dtype,
    check_index_range,
)

__all__ = [
    "CLASS_SCORES",
    "VECTOR_HEAD_RENAMES",
    "CapsuleClassifier",
    "CapsuleDecoder",
    "CapsuleHead",
    "build_class_capsules",
    "class_scores",
    "decoder_classes",
    "reconstruct",
    "rename_state_dict_keys",
]

# --- the head's parts -------------------------------------------------------------------------------

#: How class capsules become class scores (``scores`` of the vector-capsule model configs).
CLASS_SCORES = ("length", "linear")


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
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> CapsuleLinear:
    """A :class:`~torchvote.nn.capsules.CapsuleLinear` whose router errors name the config fields;
    ``device`` and ``dtype`` are its (and its router's) parameters'.

    ``iterations`` is a model config's one field, set whichever router the config names (the
    router swap of ``torchvote reproduce`` row f keeps the preset's); it reaches an iterative
    router only. A one-pass router (``"uniform"``, ``"self_attention"``) ignores it, as the
    configs document: the layer, which warns of an explicit count for such a router, is built
    without one.

    Raises:
        ValueError: ``router_options`` the router does not take (the message names the field).
    """
    with router_options_errors(router, router_options):
        return CapsuleLinear(
            in_caps,
            in_dim,
            out_caps,
            out_dim,
            routing=router,
            iterations=iterations if is_iterative(router) else None,
            shared_weights=shared_weights,
            router_options=dict(router_options),
            init_std=init_std,
            device=device,
            dtype=dtype,
        )


def class_scores(routed: RoutingResult, scorer: nn.Module | None = None) -> Tensor:
    """``(b, num_classes)`` class scores: with a ``scorer`` (``(b, i, d) -> (b, i, 1)``, shared by
    every class capsule: Tsai et al. 2020's linear readout) its logits; else EM's activations if
    the router gives them, else the lengths of the class capsules (Sabour et al. 2017, sec. 2)."""
    if scorer is not None:
        return scorer(routed.outputs).squeeze(-1)  # (b, i, d) -> (b, i)
    if routed.activations is not None:
        return routed.activations
    return torch.linalg.vector_norm(routed.outputs, dim=-1)  # (b, i); zero vectors: zero gradient


def decoder_classes(scores: Tensor, targets: Tensor | None) -> Tensor:
    """The classes whose capsules the decoder reconstructs, ``(b, k)``.

    Args:
        scores: ``(b, num_classes)`` class scores.
        targets: ``(b,)`` true classes, ``(b, k)`` the classes present in each image
            (MultiMNIST), or ``None`` (evaluation: the highest score: the longest capsule
            unless EM activations or a linear scorer give the scores).

    Returns:
        ``(b, 1)`` for ``(b,)`` or ``None`` targets, ``(b, k)`` for ``(b, k)`` targets.

    Raises:
        TypeError: targets that are not a tensor of integer class indices (float one-hot
            targets would be read as lists of classes 0 and 1).
        ValueError: targets of another shape or batch size, integer one-hot targets (a
            ``(b, num_classes)`` row of only 0 and 1, for more than 2 classes), or a class index
            outside ``[0, num_classes)`` (checked by :func:`~torchvote.validation.check_tensor_values`: on
            an accelerator an assertion queued on the device, nothing read back).
    """
    if targets is None:
        return scores.argmax(dim=-1, keepdim=True)  # (b, 1)
    check_targets(targets, scores.shape[0], scores.shape[-1])
    classes = targets.long()
    return classes if classes.dim() == 2 else classes[:, None]  # (b, k); reshape fails on b = 0


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
        device: where to create the parameters.
        dtype: the parameters' dtype.

    Raises:
        ValueError: non-positive sizes.
        TypeError: a ``dtype`` that is not a floating-point ``torch.dtype``.
    """

    def __init__(
        self,
        num_classes: int,
        caps_dim: int,
        image_shape: tuple[int, int, int],
        *,
        hidden: tuple[int, ...],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if any(size < 1 for size in (num_classes, caps_dim, *image_shape, *hidden)):
            raise ValueError(
                f"decoder sizes must be positive, got num_classes={num_classes}, caps_dim={caps_dim}, "
                f"image_shape={image_shape}, hidden={hidden}"
            )
        self.image_shape = tuple(image_shape)
        factory = {"device": device, "dtype": check_float_dtype(dtype)}
        layers: list[nn.Module] = []
        width = num_classes * caps_dim
        for units in hidden:
            layers += [nn.Linear(width, units, **factory), nn.ReLU(inplace=True)]
            width = units
        pixels = image_shape[0] * image_shape[1] * image_shape[2]
        layers += [nn.Linear(width, pixels, **factory), nn.Sigmoid()]
        self.layers = nn.Sequential(*layers)

    @staticmethod
    def mask(poses: Tensor, classes: Tensor) -> Tensor:
        """``(b, i, d)`` capsules, ``(b, k)`` classes -> ``(b, k, i * d)``: all but one capsule zero.

        The one-hot rows are a comparison with ``arange(i)``, not ``F.one_hot``, whose range check
        reads the classes' values: ``vmap`` cannot, with per-example classes (per-sample
        gradients of a model, whose decoder keeps each image's own argmax).
        A class outside ``[0, i)`` is refused by :func:`~torchvote.validation.check_index_range`
        (a ValueError on the CPU, not under a ``torch.func`` transform), as ``F.one_hot`` refused
        it; a model's ``targets`` were already checked.

        Raises:
            ValueError: on the CPU, a class outside ``[0, i)``.
        """
        capsules = poses.shape[1]
        check_index_range(classes, capsules, f"classes must be capsule indices in [0, {capsules})")
        keep = classes.unsqueeze(-1) == torch.arange(capsules, device=poses.device)  # (b, k, i)
        return torch.einsum("bki,bid->bkid", keep.to(poses.dtype), poses).flatten(2)  # (b, k, i*d)

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
    ``(b, k, c, h, w)`` for ``(b, k)`` targets; ``None`` without a decoder (the targets checked
    all the same: a model without a decoder took float or out-of-range labels in silence)."""
    if decoder is None:
        check_targets(targets, scores.shape[0], scores.shape[-1])
        return None
    images = decoder(poses, decoder_classes(scores, targets))  # (b, k, c, h, w)
    return images if targets is not None and targets.dim() == 2 else images.squeeze(1)


# --- the head ---------------------------------------------------------------------------------------


class CapsuleHead(nn.Module):
    """Class capsules + router + masked decoder + reconstruction.

    Args:
        class_capsules: the class layer: ``forward(capsules, *, return_routing=True)`` gives a
            :class:`~torchvote.nn.routers.RoutingResult` with couplings ``(b, num_classes,
            in_caps)``, and ``.router`` is its router
            (:class:`~torchvote.nn.capsules.CapsuleLinear`,
            :class:`~torchvote.nn.em_capsules.ClassMatrixCapsules`).
        decoder: the reconstruction network, or ``None``.
        lengths_as_activations: for vector capsules ``(b, in_caps, dim)``: hand their lengths to a
            router that uses activations (``router.uses_activations``, EM routing).
        scorer: ``None`` (lengths or activations score the classes) or a module ``(b, i, d) ->
            (b, i, 1)`` applied to every class capsule (see :func:`class_scores`).
    """

    def __init__(
        self, class_capsules: nn.Module, *, decoder: CapsuleDecoder | None = None,
        lengths_as_activations: bool = False, scorer: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.class_capsules = class_capsules
        self.decoder = decoder
        self.lengths_as_activations = lengths_as_activations
        self.scorer = scorer

    @property
    def router(self) -> Router:
        """The class layer's router."""
        return self.class_capsules.router

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        init_std: float,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> CapsuleHead:
        """The head of a vector-capsule network, every size from its model config: a
        :class:`~torchvote.nn.capsules.CapsuleLinear` class layer and, with ``config.decoder``,
        Sabour et al.'s decoder for the config's images.

        Args:
            config: reads ``num_primary_caps``, ``primary_dim``, ``num_classes``, ``class_dim``,
                ``router``, ``iterations``, ``router_options``, ``decoder``, ``decoder_hidden``,
                ``in_channels``, ``image_size`` and, when the config has them, ``shared_weights``
                and ``scores`` (``"linear"``: a shared ``nn.Linear(class_dim, 1)`` scorer).
            init_std: the class layer's initialisation scale (each model derives its own).
            device: where to create the parameters.
            dtype: the parameters' dtype.

        Raises:
            ValueError: ``router_options`` the router does not take, bad decoder sizes.
        """
        class_capsules = build_class_capsules(
            in_caps=config.num_primary_caps, in_dim=config.primary_dim, out_caps=config.num_classes,
            out_dim=config.class_dim, router=config.router, iterations=config.iterations,
            router_options=config.router_options, init_std=init_std,
            shared_weights=getattr(config, "shared_weights", False), device=device, dtype=dtype,
        )
        decoder = None
        if config.decoder:
            image_shape = (config.in_channels, config.image_size, config.image_size)
            decoder = CapsuleDecoder(
                config.num_classes, config.class_dim, image_shape, hidden=config.decoder_hidden,
                device=device, dtype=dtype,
            )
        scorer = None
        if getattr(config, "scores", "length") == "linear":
            scorer = nn.Linear(config.class_dim, 1, device=device, dtype=dtype)
        return cls(class_capsules, decoder=decoder, lengths_as_activations=True, scorer=scorer)

    def input_activations(self, capsules: Any) -> Tensor | None:
        """The activations :meth:`forward` gives the router with ``capsules``: the vector
        capsules' lengths ``(b, in_caps)`` for a router that weighs votes by activations (EM), else
        ``None`` (the router's default)."""
        if self.lengths_as_activations and self.router.uses_activations:
            return torch.linalg.vector_norm(capsules, dim=-1)  # (b, j): a vector's length
        return None

    def forward(self, capsules: Any, targets: Tensor | None = None) -> ClassifierOutput:
        """Route the capsules to the classes, score them and reconstruct.

        Args:
            capsules: what the class layer takes: ``(b, in_caps, in_dim)`` vector capsules or
                :class:`~torchvote.nn.em_capsules.MatrixCapsules`.
            targets: ``(b,)`` or ``(b, k)`` classes whose capsules the decoder reconstructs;
                ``None``: the highest score.

        Returns:
            :class:`~torchvote.models.registry.ClassifierOutput` with ``scores`` ``(b,
            num_classes)``, ``reconstructions`` (``None`` without decoder), ``poses`` ``(b,
            num_classes, d)`` and ``couplings`` ``(b, num_classes, in_caps)`` (receivers first).

        Raises:
            TypeError: targets that are not integer class indices.
            ValueError: targets of the wrong shape, or a class index outside ``[0,
                num_classes)`` (with a decoder, the only part that reads them).
        """
        activations = self.input_activations(capsules)
        if activations is not None:
            routed = self.class_capsules(capsules, activations=activations, return_routing=True)
        else:
            routed = self.class_capsules(capsules, return_routing=True)
        scores = class_scores(routed, self.scorer)  # (b, i)
        return ClassifierOutput(
            scores=scores,
            reconstructions=reconstruct(self.decoder, routed.outputs, scores, targets),
            poses=routed.outputs,  # (b, i, d)
            couplings=routed.couplings,  # (b, i, j)
        )


def rename_state_dict_keys(module: nn.Module, renames: Mapping[str, str]) -> None:
    """Let ``module`` load state dicts saved under older key prefixes.

    Args:
        module: the model.
        renames: ``{old prefix: new prefix}`` of top-level keys (e.g. ``{"decoder.":
            "head.decoder."}``), applied when the old key is present and the new one is not.
    """

    module._register_load_state_dict_pre_hook(_RenameKeys(dict(renames)))


class _RenameKeys:
    """The load-state-dict pre-hook of :func:`rename_state_dict_keys`. A module-level class, not a
    closure: the model keeps its hooks, and ``torch.save(model)`` (pickle) cannot save a local
    function."""

    def __init__(self, renames: dict[str, str]) -> None:
        self.renames = renames

    def __call__(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for key in list(state_dict):
            for old, new in self.renames.items():
                if key.startswith(prefix + old) and prefix + new + key[len(prefix + old):] not in state_dict:
                    state_dict[prefix + new + key[len(prefix + old):]] = state_dict.pop(key)
                    break


#: Where the vector-capsule models kept the head's parts before the shared head.
VECTOR_HEAD_RENAMES: Mapping[str, str] = {
    "class_capsules.": "head.class_capsules.",
    "decoder.": "head.decoder.",
}


class CapsuleClassifier(nn.Module):
    """A capsule model: a stem and primary capsules (:meth:`capsules`) feeding one
    :class:`CapsuleHead` (``self.head``); a subclass builds both and writes only :meth:`capsules`.
    A subclass is built as ``Model(config, *, device=None, dtype=None)`` and passes the factory
    keywords to every part it builds (:meth:`CapsuleHead.from_config` takes them too).

    Args:
        config: the model config (``in_channels`` and ``image_size`` fix the input shape).

    Class attributes:
        legacy_renames: ``{old prefix: new prefix}`` of state-dict keys that older checkpoints
            used (see :func:`rename_state_dict_keys`).
    """

    legacy_renames: ClassVar[Mapping[str, str]] = {}
    head: CapsuleHead

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        if self.legacy_renames:
            rename_state_dict_keys(self, self.legacy_renames)

    def capsules(self, images: Tensor) -> tuple[Any, dict[str, Tensor]]:
        """The stem and primary capsules.

        Args:
            images: ``(b, in_channels, image_size, image_size)``, checked.

        Returns:
            What ``self.head`` routes (``(b, in_caps, dim)`` vectors or matrix capsules) and
            intermediates for :attr:`ClassifierOutput.intermediates` (may be empty).
        """
        raise NotImplementedError

    def forward(self, images: Tensor, targets: Tensor | None = None) -> ClassifierOutput:
        """Classify (and, with a decoder, reconstruct) a batch of images.

        Args:
            images: ``(b, in_channels, image_size, image_size)``.
            targets: ``(b,)`` true classes or ``(b, k)`` classes per image: the decoder
                reconstructs those capsules (the training loop passes them in training mode);
                ``None``: the highest score. Not used without a decoder.

        Returns:
            :class:`~torchvote.models.registry.ClassifierOutput` with ``scores`` ``(b,
            num_classes)`` (EM activations if the router gives them, else capsule lengths),
            ``reconstructions`` ``(b, c, h, w)`` (``(b, k, c, h, w)`` for ``(b, k)`` targets;
            ``None`` without decoder), ``poses`` ``(b, num_classes, d)``, ``couplings`` ``(b,
            num_classes, in_caps)`` (receivers first) and the intermediates of :meth:`capsules`.

        Raises:
            TypeError: images that are not a floating-point tensor of the parameters' dtype
                (outside ``torch.autocast``), or targets that are not integer class indices.
            ValueError: images or targets of the wrong shape, or (with a decoder) a class index
                outside ``[0, num_classes)``.
        """
        check_images(images, self.config, next(self.parameters()))
        capsules, intermediates = self.capsules(images)
        output = self.head(capsules, targets)
        output.intermediates.update(intermediates)
        return output
