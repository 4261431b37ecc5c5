"""Training objectives: the configured loss (or the model's registered one) as
``objective(output, batch, step) -> (loss, parts)``.

One builder per loss (:data:`_BUILDERS`); what a batch's logits and targets are is the task
handler's business (:meth:`~torchvote.training.tasks.TaskHandler.logits_and_targets`), so no
objective looks at the task's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from torchvote import losses
from torchvote.models.registry import ClassifierOutput, ModelSpec
from torchvote.training.config import resolve_loss_name
from torchvote.training.schema import LossConfig

__all__ = ["Objective", "make_objective", "spread_margin_schedule"]

#: ``objective(output, batch, step) -> (loss, {name: value})``.
Objective = Callable[[Any, dict[str, Tensor], int], tuple[Tensor, dict[str, Tensor]]]


def make_objective(
    loss: LossConfig,
    spec: ModelSpec,
    total_steps: int,
    pad_id: int | None = None,
    *,
    model_config: Any = None,
    data: Sequence[Any] = (),
) -> Objective:
    """The training objective of a run: the configured loss, or with ``loss.name=auto`` the
    model's default (:func:`~torchvote.training.config.resolve_loss_name`: the spread loss for a
    model that routes by EM, else its registered loss).

    Args:
        loss: the loss section of the config.
        spec: the registered model (its task and default loss).
        total_steps: the run's length (the spread-loss margin schedule spans it, however the
            spread loss was chosen).
        pad_id: the padding id of sequence data (skipped by a seq2seq cross-entropy).
        model_config: the model's own config (its ``router`` decides ``auto``); ``None``: the
            registered loss.
        data: the run's data sets (:class:`~torchvote.training.data.TaskData`), whose targets the
            loss must take (MultiMNIST's label sets only the margin loss): refused before the run
            starts, not at its first step.

    Returns:
        ``objective(output, batch, step) -> (loss, parts)``; ``parts`` holds the terms of the
        loss (``margin``, ``reconstruction`` ...) and, for the spread loss, the current margin.

    Raises:
        ValueError: a loss that does not apply to the model's task or to the targets of ``data``.
    """
    from torchvote.training.tasks import get_task_handler

    name = resolve_loss_name(loss.name, spec, model_config)
    handler = get_task_handler(spec.task)
    handler.check_loss(name)
    for task_data in data:
        handler.check_loss(name, task_data)
    return _BUILDERS[name](loss, handler, total_steps, pad_id)


def _cross_entropy(loss: LossConfig, handler: Any, total_steps: int, pad_id: int | None) -> Objective:
    ignore_index = handler.ignore_index(pad_id)

    def cross_entropy(output: Any, batch: dict[str, Tensor], step: int) -> tuple[Tensor, dict[str, Tensor]]:
        logits, targets = handler.logits_and_targets(output, batch)
        value = losses.cross_entropy(
            logits, targets, label_smoothing=loss.label_smoothing, ignore_index=ignore_index
        )
        return value, {"cross_entropy": value.detach()}

    return cross_entropy


def _at_least_float32(tensor: Tensor) -> Tensor:
    """Half-precision scores (autocast) in float32 for the loss; float64 kept (``.float()`` cast a
    float64 model's scores down)."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def _margin(loss: LossConfig, handler: Any, total_steps: int, pad_id: int | None) -> Objective:
    def margin(
        output: ClassifierOutput, batch: dict[str, Tensor], step: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        targets = _multi_hot(batch["targets"], output.scores.shape[-1])
        value = losses.margin_loss(
            _at_least_float32(output.scores),
            targets,
            positive_margin=loss.positive_margin,
            negative_margin=loss.negative_margin,
            down_weight=loss.down_weight,
        )
        parts = {"margin": value.detach()}
        reference = _reconstruction_targets(output, batch)
        if reference is not None and loss.reconstruction_weight > 0:
            term = losses.reconstruction_loss(
                _at_least_float32(output.reconstructions), reference, weight=loss.reconstruction_weight
            )
            parts["reconstruction"] = term.detach()
            value = value + term
        return value, parts

    return margin


def spread_margin_schedule(loss: LossConfig, total_steps: int) -> losses.SpreadMarginSchedule:
    """The spread loss's margin ramp: over ``loss.spread_ramp_steps``, or the whole run."""
    return losses.SpreadMarginSchedule(
        steps=loss.spread_ramp_steps or max(total_steps, 1),
        start=loss.spread_margin_start,
        end=loss.spread_margin_end,
    )


def _spread(loss: LossConfig, handler: Any, total_steps: int, pad_id: int | None) -> Objective:
    schedule = spread_margin_schedule(loss, total_steps)

    def spread(
        output: ClassifierOutput, batch: dict[str, Tensor], step: int
    ) -> tuple[Tensor, dict[str, Tensor]]:
        scores, targets = handler.logits_and_targets(output, batch)  # refuses MultiMNIST's label sets
        margin_now = schedule(step)
        value = losses.spread_loss(_at_least_float32(scores), targets, margin=margin_now)
        return value, {"spread": value.detach(), "spread_margin": torch.tensor(margin_now, device="cpu")}

    return spread


#: Loss name -> ``builder(loss_config, handler, total_steps, pad_id) -> objective``.
_BUILDERS: dict[str, Callable[[LossConfig, Any, int, int | None], Objective]] = {
    "cross-entropy": _cross_entropy,
    "margin": _margin,
    "spread": _spread,
}


def _reconstruction_targets(output: ClassifierOutput, batch: dict[str, Tensor]) -> Tensor | None:
    """What the decoder's reconstructions are compared with, or ``None`` for no reconstruction term.

    One reconstruction per image ``(b, c, h, w)``: the image. One per digit ``(b, k, c, h, w)``
    (MultiMNIST in training, each from its own digit's capsule): each digit alone,
    ``batch["digits"]``. A single reconstruction of an image of several digits (MultiMNIST at
    evaluation, where the decoder reconstructs the longest capsule only) has nothing to be
    compared with: no term.
    """
    reconstructions = output.reconstructions
    if reconstructions is None:
        return None
    if "digits" not in batch:
        return batch["images"]
    return batch["digits"] if reconstructions.dim() == 5 else None


def _multi_hot(targets: Tensor, num_classes: int) -> Tensor:
    """``(b,)`` indices stay as they are; ``(b, k)`` label sets (MultiMNIST) become multi-hot."""
    if targets.dim() == 1:
        return targets
    hot = torch.zeros(len(targets), num_classes, device=targets.device)
    return hot.scatter_(1, targets.long(), 1.0)
