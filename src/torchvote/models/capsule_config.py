"""What every capsule model config shares: the image fields (:class:`CapsuleClassifierConfig`)
and the checks: positive sizes, at least two classes, tuples of positive integers, positive
finite scales, a known router whose options do not repeat what the capsule layer passes itself,
and images of the configured shape and the model's dtype.

Each check raises ``ValueError`` naming the offending field and value.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from torchvote.validation import (
    ArgumentTypeError,
    check_device,
    check_index_range,
    check_input_dtype,
    check_integer_tensor,
    check_positive_float,
    check_positive_int,
    check_tensor_values,
)

__all__ = [
    "CapsuleClassifierConfig",
    "check_classifier_fields",
    "check_images",
    "check_positive",
    "check_positive_scale",
    "check_positive_tuples",
    "check_router",
    "router_options_errors",
    "to_tuple",
]


@dataclass
class CapsuleClassifierConfig:
    """The fields every capsule model config starts with; the data set fills them when training.

    Args:
        image_size: side of the square input images.
        in_channels: channels of the input images.
        num_classes: class capsules.
    """

    image_size: int = 28
    in_channels: int = 1
    num_classes: int = 10


def check_positive(config: Any, names: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the first field of ``names`` that is not a positive integer."""
    for name in names:
        check_positive_int(getattr(config, name), name)


def check_classifier_fields(config: CapsuleClassifierConfig, positive: tuple[str, ...]) -> None:
    """The checks every capsule model config starts with.

    Args:
        config: the model config.
        positive: its fields, beyond those of :class:`CapsuleClassifierConfig`, that must be
            positive integers.

    Raises:
        ValueError: the first field (``image_size``, ``in_channels``, ``num_classes``, then those
            of ``positive``) that is not a positive integer, or ``num_classes`` below 2.
    """
    check_positive(config, ("image_size", "in_channels", "num_classes", *positive))
    if config.num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {config.num_classes}")


def to_tuple(value: Any, name: str) -> tuple[Any, ...]:
    """``value``, a list or tuple (any iterable but a string or a mapping), as a tuple.

    Raises:
        ValueError: naming ``name``, for anything else, e.g. a single number (``(64,)`` is the
            one-entry tuple); the entries are checked by the caller.
    """
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ValueError(f"{name} must be a tuple (or list) of integers, one per layer, got {value!r}")
    return tuple(value)


def check_positive_scale(value: Any, name: str, *, optional: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite real number above zero
    (or ``None`` when ``optional``)."""
    if optional and value is None:
        return
    try:
        check_positive_float(value, name)
    except ValueError as err:
        raise ValueError(f"{err} (or None)" if optional else str(err)) from None


def check_positive_tuples(config: Any, names: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the first field of ``names`` that holds anything but positive
    integers."""
    for name in names:
        values = getattr(config, name)
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name} must hold positive integers, got {values}")


#: What the capsule layer passes to its router itself; router_options may not repeat them.
_LAYER_ARGUMENTS = frozenset({"in_caps", "out_caps", "out_dim", "iterations", "device", "dtype"})


def check_router(
    router: str, router_options: Mapping[str, Any], *, supported: tuple[str, ...] | None = None
) -> None:
    """Check a model config's ``router`` against the routers :func:`~torchvote.nn.routers.make_router`
    builds: torchvote's (:func:`~torchvote.functional.routing.list_routers`) and a user's
    (:func:`~torchvote.nn.routers.register_router`).

    Args:
        router: the configured router name.
        router_options: the configured options (must be a mapping).
        supported: the routers this model can use, when not all of them.

    Raises:
        ValueError: an unknown router (the message lists the registered ones), one this model does
            not support (the message lists those it does), or options that are not a mapping or
            that repeat what the layer passes (``iterations``, the sizes, ``device``, ``dtype``).
    """
    from torchvote.nn.routers import registered_routers  # the models import the layers anyway

    names = registered_routers()
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


@contextmanager
def router_options_errors(router: str, router_options: Mapping[str, Any]) -> Iterator[None]:
    """Re-raise a ``ValueError`` of building a router as one that names the config fields.

    Raises:
        ValueError: ``router_options`` the router does not take (the message names the field);
            an :class:`~torchvote.validation.ArgumentTypeError` for a value of the wrong type.
    """
    try:
        yield
    except ValueError as err:  # a value of the wrong type stays an ArgumentTypeError
        error = ArgumentTypeError if isinstance(err, ArgumentTypeError) else ValueError
        raise error(f"router_options={dict(router_options)!r} do not fit router={router!r}: {err}") from None


def check_images(images: Tensor, config: Any, parameter: Tensor | None = None) -> None:
    """Check that ``images`` is a ``(b, in_channels, image_size, image_size)`` tensor of floats
    (of the dtype of ``parameter``, one of the model's, and on its device, when given). Reads the
    shape, dtype and device only.

    Raises:
        TypeError: ``images`` is not a tensor, not floating point (e.g. ``uint8`` pixels), or of
            another dtype than ``parameter`` outside ``torch.autocast`` (the message names both).
        ValueError: another shape, or another device than ``parameter`` (a CPU batch for a model
            on ``meta`` computed on uninitialised memory; on a GPU, torch's error named nothing).
    """
    if not isinstance(images, Tensor):
        raise TypeError(f"images must be a floating-point tensor, got {type(images).__name__}")
    expected = (config.in_channels, config.image_size, config.image_size)
    if images.dim() != 4 or tuple(images.shape[1:]) != expected:
        raise ValueError(
            f"images must have shape (b, {', '.join(map(str, expected))}), got {tuple(images.shape)}"
        )
    check_input_dtype(images, images.dtype if parameter is None else parameter.dtype, "images")
    if parameter is not None:
        check_device(images, parameter.device, "images")


def check_targets(targets: Tensor | None, batch: int, num_classes: int) -> None:
    """Check an image classifier's ``targets``: ``None``, or ``(b,)`` class indices or ``(b, k)``
    classes per image (MultiMNIST), integers in ``[0, num_classes)``, for ``batch`` images. Every
    classifier runs it, also one that does not read the targets (a float or out-of-range label
    is the caller's mistake whichever model takes it).

    Raises:
        TypeError: targets that are not a tensor of integer class indices (float one-hot
            targets would be read as lists of classes 0 and 1).
        ValueError: another shape or batch size, integer one-hot targets (a ``(b, num_classes)``
            row of only 0 and 1, for more than 2 classes), or a class index outside
            ``[0, num_classes)`` (:func:`~torchvote.validation.check_tensor_values`: on an
            accelerator an assertion queued on the device, nothing read back).
    """
    if targets is None:
        return
    expected = "a tensor of integer class indices, (b,) or (b, k), not one-hot scores"
    check_integer_tensor(targets, "targets", expected)
    if targets.dim() not in (1, 2) or targets.shape[0] != batch:
        raise ValueError(
            f"targets must be (b,) class indices or (b, k) classes per image with b={batch}, "
            f"got {tuple(targets.shape)}"
        )
    message = f"targets holds class indices outside [0, num_classes={num_classes})"
    check_index_range(targets, num_classes, message)
    if targets.dim() == 2 and targets.shape[1] == num_classes > 2:
        # F.one_hot's int64 rows would be read as num_classes classes, each 0 or 1
        check_tensor_values(
            ~((targets == 0) | (targets == 1)).all(dim=1).any(),
            f"targets (b, {num_classes}) of only 0 and 1 look one-hot; pass targets.argmax(-1), or "
            "(b, k) lists of the k classes in each image",
        )
