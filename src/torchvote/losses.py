"""The losses of the capsule and attention papers, as plain functions of tensors.

Every loss returns the mean over the batch of a per-example loss, so that it does not change with
the batch size (or with the number of data-parallel processes sharing one global batch); the
cross-entropy of token sequences is the mean over the counted tokens instead (padding excluded),
so a longer sequence weighs more, as in every language-model trainer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from torchvote.validation import (
    ArgumentTypeError,
    check_device,
    check_float_tensor,
    check_in_range,
    check_index_range,
    check_positive_int,
    check_tensor_values,
    is_integer,
    is_real,
)

__all__ = [
    "SpreadMarginSchedule",
    "check_margin_options",
    "cross_entropy",
    "margin_loss",
    "one_hot_targets",
    "reconstruction_loss",
    "spread_loss",
]


def one_hot_targets(targets: Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Class indices ``(b,)`` -> one-hot ``(b, num_classes)``; a ``(b, num_classes)`` tensor is taken
    as already (multi-)hot, e.g. the two digits of a MultiMNIST image, and must hold only 0 and 1.

    Args:
        targets: integer class indices ``(b,)``, or 0/1 targets ``(b, num_classes)``.
        num_classes: the number of classes.
        dtype: the dtype of the result.

    Returns:
        ``(b, num_classes)`` 0/1 targets of ``dtype``.

    Raises:
        ValueError: ``num_classes`` < 1, targets of another shape, class indices out of range, or
            (multi-)hot targets with a value other than 0 or 1 (values are checked with
            :func:`~torchvote.validation.check_tensor_values`: at once on the CPU, on the device's
            stream elsewhere).
        TypeError: class indices ``(b,)`` that are not integers (bools included; a bool
            ``(b, num_classes)`` multi-hot tensor is taken).
    """
    check_positive_int(num_classes, "num_classes")
    if targets.dim() == 1:
        if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
            raise TypeError(f"targets: class indices must be integers, got dtype {targets.dtype}")
        check_index_range(targets, num_classes, f"class indices must be in [0, {num_classes})")
        # a comparison, not F.one_hot: that reads the largest index, which vmap(grad) cannot do
        # with per-example targets (the range is checked above, where values can be read)
        classes = torch.arange(num_classes, device=targets.device)  # (k,)
        return (targets.long().unsqueeze(-1) == classes).to(dtype)  # (b, k)
    if targets.dim() == 2 and targets.shape[1] == num_classes:
        # T_k of the margin loss is 0 or 1; a 7 (or a smoothed 0.9) would scale the loss silently
        check_tensor_values(
            ((targets == 0) | (targets == 1)).all(),
            f"multi-hot targets (b, {num_classes}) must hold only 0 and 1",
            detail=lambda: f", got values {targets.unique().tolist()}",
        )
        return targets.to(dtype)
    raise ValueError(
        f"targets must be class indices (b,) or multi-hot (b, {num_classes}), got {tuple(targets.shape)}"
    )


def _check_targets_tensor(targets: Any) -> None:
    """A TypeError naming ``targets`` for what is no tensor (a list failed on ``.dim()``)."""
    if not isinstance(targets, Tensor):
        raise TypeError(f"targets must be a tensor of class indices, got {type(targets).__name__}")


def _check_class_scores(scores: Tensor, targets: Tensor, argument: str) -> None:
    """Raise unless ``scores`` is a floating-point ``(b, num_classes)`` tensor with ``b >= 1``
    (integer lengths were taken) and ``targets`` a tensor with ``b`` rows (the mean over an
    empty batch is NaN)."""
    check_float_tensor(scores, argument)
    _check_targets_tensor(targets)
    if scores.dim() != 2:
        raise ValueError(f"{argument} must be (batch, num_classes), got shape {tuple(scores.shape)}")
    if scores.shape[0] == 0:
        raise ValueError(f"{argument} must hold at least one example, got shape {tuple(scores.shape)}")
    if targets.dim() == 0 or targets.shape[0] != scores.shape[0]:
        raise ValueError(
            f"targets {tuple(targets.shape)} and {argument} {tuple(scores.shape)} must hold the same "
            "number of examples"
        )
    check_device(targets, scores.device, "targets", argument)


def check_margin_options(
    positive_margin: Any, negative_margin: Any, down_weight: Any, *, prefix: str = ""
) -> None:
    """Check the margin loss's options: ``0 <= m- < m+ <= 1`` (capsule lengths lie in
    ``[0, 1)``) and a finite ``lambda >= 0``.

    Args:
        positive_margin, negative_margin, down_weight: as :func:`margin_loss` takes them.
        prefix: put before each name in the message (``"loss."`` for the training config).

    Raises:
        ValueError: naming the option and the range.
    """
    check_in_range(positive_margin, f"{prefix}positive_margin", 0.0, 1.0, include_low=False)
    check_in_range(negative_margin, f"{prefix}negative_margin", 0.0, 1.0, include_high=False)
    if negative_margin >= positive_margin:
        raise ValueError(
            f"{prefix}negative_margin must be below {prefix}positive_margin, got "
            f"{negative_margin} >= {positive_margin}"
        )
    check_in_range(down_weight, f"{prefix}down_weight", 0.0)


def margin_loss(
    lengths: Tensor,
    targets: Tensor,
    *,
    positive_margin: float = 0.9,
    negative_margin: float = 0.1,
    down_weight: float = 0.5,
) -> Tensor:
    """The margin loss of Sabour et al. 2017, eq. 4, summed over classes and averaged over the batch.

    ``L_k = T_k max(0, m+ - ||v_k||)^2 + lambda (1 - T_k) max(0, ||v_k|| - m-)^2``

    Args:
        lengths: ``(b, num_classes)`` lengths of the class capsules, in [0, 1].
        targets: ``(b,)`` class indices or ``(b, num_classes)`` multi-hot (several digits present),
            holding only 0 and 1.
        positive_margin: ``m+``, the length a present class must reach.
        negative_margin: ``m-``, the length an absent class must stay under.
        down_weight: ``lambda``, which stops the absent classes from shrinking every length early on.

    Returns:
        the scalar loss.

    Raises:
        ValueError: ``lengths`` not ``(b, num_classes)`` or an empty batch, targets for another
            batch size, class indices out of range, or multi-hot targets other than 0 and 1;
            margins outside ``0 <= m- < m+ <= 1`` or a negative ``down_weight``; targets on
            another device than ``lengths``.
        TypeError: class indices that are not integers.

    Examples:
        >>> import torch
        >>> from torchvote.losses import margin_loss
        >>> margin_loss(torch.tensor([[0.95, 0.05]]), torch.tensor([0]))  # both margins met
        tensor(0.)
        >>> lengths = torch.tensor([[0.5, 0.5]])  # class 1 present: (0.9 - 0.5)^2 + 0.5 (0.5 - 0.1)^2
        >>> round(margin_loss(lengths, torch.tensor([1])).item(), 4)
        0.24
    """
    check_margin_options(positive_margin, negative_margin, down_weight)
    _check_class_scores(lengths, targets, "lengths")
    present = one_hot_targets(targets, lengths.shape[-1], lengths.dtype)  # (b, k)
    loss_present = present * F.relu(positive_margin - lengths).square()
    loss_absent = down_weight * (1.0 - present) * F.relu(lengths - negative_margin).square()
    return (loss_present + loss_absent).sum(dim=-1).mean()


def reconstruction_loss(reconstructions: Tensor, images: Tensor, *, weight: float = 0.0005) -> Tensor:
    """Sum of squared differences per image, scaled by ``weight``, averaged over the batch.

    Sabour et al. 2017, sec. 4.1: the scale 0.0005 keeps the reconstruction from dominating the
    margin loss. ``reconstructions`` may be flat ``(b, c*h*w)`` or shaped like ``images``.

    Args:
        reconstructions: ``(b, c*h*w)`` or shaped like ``images``.
        images: ``(b, c, h, w)``, or ``(b, k, c, h, w)`` with one image per digit (MultiMNIST).
        weight: the scale of the loss, a finite number >= 0.

    Returns:
        The scalar loss, in the dtype of ``reconstructions`` (summed in at least float32).

    Raises:
        ValueError: a ``weight`` that is negative, NaN or infinite (it would reward reconstructing
            badly, or poison the loss).
        ValueError: either without a batch axis (a single image needs one: ``image[None]``), an
            empty batch, the two do not have the same number of values per image, or both are
            shaped as images whose trailing axes differ (channels last against channels first), or
            the two on different devices.
        TypeError: either not floating point (``uint8`` pixels of 0-255 against reconstructions
            in [0, 1] gave a loss 255^2 too large: divide them by 255).
    """
    check_in_range(weight, "weight", 0.0)
    for name, tensor in (("reconstructions", reconstructions), ("images", images)):
        check_float_tensor(tensor, name)
        if tensor.dim() < 2:
            raise ValueError(
                f"{name} must be batched, (b, c*h*w) or (b, c, h, w), got shape {tuple(tensor.shape)}; "
                "add a batch axis for a single image"
            )
        if tensor.shape[0] == 0:
            raise ValueError(f"{name} must hold at least one image, got shape {tuple(tensor.shape)}")
    check_device(images, reconstructions.device, "images", "reconstructions")
    image_axes = min(reconstructions.dim(), images.dim()) - 1  # the image axes both have
    if image_axes >= 2 and reconstructions.shape[-image_axes:] != images.shape[-image_axes:]:
        raise ValueError(  # the same number of values in another layout: (b, h, w, c) vs (b, c, h, w)
            f"reconstructions {tuple(reconstructions.shape)} are not laid out as images "
            f"{tuple(images.shape)}: their last {image_axes} axes differ (channels first or last?)"
        )
    flat_reconstructions = reconstructions.flatten(1)  # (b, c*h*w)
    flat_images = images.flatten(1).to(flat_reconstructions.dtype)  # (b, c*h*w)
    if flat_reconstructions.shape != flat_images.shape:
        raise ValueError(
            f"reconstructions {tuple(reconstructions.shape)} do not match images {tuple(images.shape)}"
        )
    # squared errors summed in at least float32: a float16 image's sum passes 65504 (784 pixels
    # off by 10) while the weighted loss is a float16 number; returned in the inputs' dtype
    compute = torch.promote_types(flat_reconstructions.dtype, torch.float32)
    differences = flat_reconstructions.to(compute) - flat_images.to(compute)  # (b, c*h*w)
    loss = weight * differences.square().sum(dim=1).mean()
    return loss.to(flat_reconstructions.dtype)


def spread_loss(activations: Tensor, targets: Tensor, *, margin: float) -> Tensor:
    """The spread loss of Hinton, Sabour and Frosst 2018 (matrix capsules with EM routing), sec. 3.1.

    ``L = sum_{i != t} max(0, m - (a_t - a_i))^2``: every wrong class must trail the target class
    ``t`` by at least the margin ``m``. Averaged over the batch.

    Args:
        activations: ``(b, num_classes)`` class activations.
        targets: ``(b,)`` class indices.
        margin: ``m`` in ``(0, 1]``; see :class:`SpreadMarginSchedule` for the paper's 0.2 -> 0.9
            schedule.

    Returns:
        The scalar loss, averaged over the batch.

    Raises:
        ValueError: targets that are not ``(b,)`` class indices in range, ``activations`` not
            ``(b, num_classes)`` for the same batch or on its device, an empty batch, or a margin
            outside (0, 1].
        TypeError: class indices that are not integers, a margin that is not a number.

    Examples:
        >>> import torch
        >>> from torchvote.losses import spread_loss
        >>> activations = torch.tensor([[0.9, 0.1, 0.3]])  # class 0 leads by 0.8 and 0.6
        >>> spread_loss(activations, torch.tensor([0]), margin=0.2)
        tensor(0.)
        >>> round(spread_loss(activations, torch.tensor([0]), margin=0.9).item(), 4)  # 0.1^2 + 0.3^2
        0.1
    """
    _check_margin(margin, "margin")
    _check_targets_tensor(targets)
    if targets.dim() != 1:
        raise ValueError(f"spread loss takes (b,) class indices, got targets of shape {tuple(targets.shape)}")
    _check_class_scores(activations, targets, "activations")
    is_target = one_hot_targets(targets, activations.shape[-1], torch.bool)  # (b, k)
    target_activation = activations.gather(1, targets.long()[:, None])  # (b, 1)
    per_class = F.relu(margin - (target_activation - activations)).square()  # (b, k)
    return per_class.masked_fill(is_target, 0.0).sum(dim=-1).mean()


def _check_margin(value: Any, argument: str) -> None:
    """Raise unless ``value`` is a real number in ``(0, 1]``: the spread loss compares class
    activations in ``[0, 1]``, so a larger margin can never be met and a margin <= 0 asks nothing."""
    if not is_real(value):  # NumPy's scalars too
        raise TypeError(
            f"{argument} must be a number (a margin in (0, 1]), got {value!r} ({type(value).__name__})"
        )
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{argument} must be a margin in (0, 1], got {value!r}")


@dataclass(frozen=True)
class SpreadMarginSchedule:
    """The spread-loss margin, raised linearly from ``start`` to ``end`` over ``steps`` steps.

    Hinton et al. 2018: "starting with a small margin of 0.2 and linearly increasing it during
    training to 0.9 avoids dead capsules in the earlier layers". After ``steps`` the margin stays at
    ``end``.

    Args:
        steps: the number of training steps over which the margin rises, a positive integer.
        start: the margin at step 0, in ``(0, 1]``.
        end: the margin from step ``steps`` on, in ``(0, 1]``.

    Raises:
        TypeError: ``steps`` not an integer, ``start`` or ``end`` not a real number.
        ValueError: ``steps`` smaller than 1, ``start`` or ``end`` outside ``(0, 1]``.
    """

    steps: int
    start: float = 0.2
    end: float = 0.9

    def __post_init__(self) -> None:
        if not is_integer(self.steps):  # NumPy's integers too
            raise TypeError(
                f"steps must be an integer (a number of training steps), got {self.steps!r} "
                f"({type(self.steps).__name__})"
            )
        check_positive_int(self.steps, "steps")
        _check_margin(self.start, "start")
        _check_margin(self.end, "end")

    def __call__(self, step: int) -> float:
        fraction = min(max(step, 0), self.steps) / self.steps
        return self.start * (1.0 - fraction) + self.end * fraction  # exactly end from `steps` on


def cross_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> Tensor:
    """``F.cross_entropy`` with label smoothing, for ``(b, k)`` or sequence ``(b, t, k)`` logits.

    The class axis is last: ``(b, t, k)``, not ``F.cross_entropy``'s ``(b, k, t)``.

    Args:
        logits: ``(b, k)`` or ``(b, t, k)`` unnormalised class scores.
        targets: ``(b,)`` or ``(b, t)`` integer class indices, ``logits.shape[:-1]``; soft labels
            (class probabilities) are not taken.
        label_smoothing: the weight ``e`` of the uniform distribution mixed into each target.
        ignore_index: the target of positions that do not count (padding).

    Returns:
        the scalar mean over the counted positions, in at least float32 (float16 and bfloat16
        logits give a float32 loss, as ``F.cross_entropy`` gives under ``torch.autocast``). With
        none counted (a batch of padding only) the loss is 0, still a function of ``logits``:
        ``backward`` works and gives zero gradients.

    Raises:
        ValueError: ``logits`` without a batch and a class axis, an empty batch, ``targets``
            whose shape is not ``logits.shape[:-1]``, a target outside ``[0, k)`` that is not
            ``ignore_index`` (checked with :func:`~torchvote.validation.check_tensor_values`),
            targets on another device than ``logits``, or a ``label_smoothing`` outside [0, 1].
        TypeError: ``logits`` not floating point, ``targets`` that are not integer class indices
            (bools included), an ``ignore_index`` that is no integer.
    """
    check_in_range(label_smoothing, "label_smoothing", 0.0, 1.0)
    check_float_tensor(logits, "logits")
    if logits.dim() < 2:
        raise ValueError(f"logits must be (b, k) or (b, t, k), got shape {tuple(logits.shape)}")
    if logits.shape[0] == 0:
        raise ValueError(f"logits must hold at least one example, got shape {tuple(logits.shape)}")
    _check_targets_tensor(targets)
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(  # 2.7 would be truncated to class 2, True read as class 1
            f"targets must be integer class indices, got dtype {targets.dtype} (soft labels, class "
            "probabilities, are not taken)"
        )
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets {tuple(targets.shape)} must have the shape of logits {tuple(logits.shape)} "
            f"without the class axis, {tuple(logits.shape[:-1])}; the classes are the last axis of "
            "logits, (b, t, k) not (b, k, t)"
        )
    check_device(targets, logits.device, "targets", "logits")
    if not is_integer(ignore_index):
        raise ArgumentTypeError(f"ignore_index must be an integer class index, got {ignore_index!r}")
    logits = logits.flatten(0, -2)  # (b*t, k), in at least float32, as reconstruction_loss sums
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    targets = targets.flatten().long()  # (b*t,)
    classes = logits.shape[-1]
    counted_ok = (targets == ignore_index) | ((targets >= 0) & (targets < classes))  # (b*t,)
    check_tensor_values(  # torch's IndexError on the CPU, a device-side assert on CUDA otherwise
        counted_ok.all(),
        f"targets must be class indices in [0, {classes}) or ignore_index={ignore_index}",
        detail=lambda: f", got {sorted(set(targets[~counted_ok].tolist()))[:5]}",
    )
    total = F.cross_entropy(
        logits, targets, label_smoothing=label_smoothing, ignore_index=ignore_index, reduction="sum"
    )
    # Sum over the counted positions / their number, at least 1: F.cross_entropy's mean is 0/0 =
    # NaN with every position ignored. No value is read back to the host.
    counted = (targets != ignore_index).sum().clamp(min=1)
    return total / counted
