"""Optimisers and learning-rate schedules from an :class:`~torchvote.training.config.OptimConfig`.

Every schedule is stepped once per optimiser step. The multiplicative schedules are
``LambdaLR`` with closures (their state dict holds only numbers, so it loads with
``weights_only=True``); ``onecycle`` is PyTorch's ``OneCycleLR``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, OneCycleLR

from torchvote.training.config import ConfigError, OptimConfig

__all__ = ["build_optimizer", "build_scheduler", "lr_multiplier"]


def build_optimizer(parameters: Iterable[nn.Parameter], config: OptimConfig) -> torch.optim.Optimizer:
    """Adam, AdamW or SGD with momentum, as configured; with ``weight_decay_on="matrices"`` and a
    weight decay, the parameters of fewer than two dimensions form a second group, undecayed."""
    parameters = _parameter_groups([p for p in parameters if p.requires_grad], config)
    if config.name == "adam":
        return torch.optim.Adam(
            parameters, lr=config.lr, betas=(config.beta1, config.beta2), weight_decay=config.weight_decay
        )
    if config.name == "adamw":
        return torch.optim.AdamW(
            parameters, lr=config.lr, betas=(config.beta1, config.beta2), weight_decay=config.weight_decay
        )
    if config.name == "sgd":
        return torch.optim.SGD(
            parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    raise ValueError(f"unknown optimiser {config.name!r}; optimisers: adam, adamw, sgd")


def _parameter_groups(parameters: list[nn.Parameter], config: OptimConfig) -> list[Any]:
    """``parameters`` as one group, or, when only matrices decay, the decayed group (two or more
    dimensions) and the rest at ``weight_decay=0`` (empty groups left out)."""
    if config.weight_decay_on == "all" or config.weight_decay == 0:
        return parameters
    decayed = [p for p in parameters if p.dim() >= 2]
    exempt = [p for p in parameters if p.dim() < 2]
    groups = [{"params": decayed}, {"params": exempt, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def lr_multiplier(config: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """The learning rate at a step (from 0), relative to ``config.lr`` (constant / exponential /
    cosine), with the linear warm-up in front: ``(step + 1) / warmup_steps`` for the first
    ``warmup_steps`` steps, then the schedule counted from the warm-up's end."""
    warmup = config.warmup_steps

    def multiplier(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if config.schedule == "constant":
            return 1.0
        if config.schedule == "exponential":
            return config.decay_rate ** ((step - warmup) / config.decay_steps)
        if config.schedule == "cosine":
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        raise ValueError(f"schedule {config.schedule!r} has no multiplier")

    return multiplier


def build_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig, total_steps: int) -> LRScheduler:
    """The configured schedule over ``total_steps`` optimiser steps.

    ``onecycle`` (Smith & Topin 2017) has a warm-up of its own, the rise from ``lr / 25`` to
    ``lr``: ``warmup_steps`` sets its length (OneCycleLR's ``pct_start``), 30% of the run when 0.

    Raises:
        ConfigError: ``onecycle`` with ``warmup_steps`` of 1 (OneCycleLR's rise needs two steps,
            its first at ``lr / 25``) or not fewer than ``total_steps`` (no steps would be left
            for the annealing).
    """
    if config.schedule == "onecycle":
        total_steps = max(total_steps, 1)
        if config.warmup_steps == 1:  # OneCycleLR divides by the rise's length minus one
            raise ConfigError(
                "optim.warmup_steps=1: the onecycle schedule rises from lr / 25 to lr over at least "
                "2 steps (optim.warmup_steps=0: the first 30% of the run)"
            )
        if config.warmup_steps >= total_steps:
            raise ConfigError(
                f"optim.warmup_steps={config.warmup_steps} leaves no step of the onecycle schedule's "
                f"annealing: this run has {total_steps} steps (optim.warmup_steps=0: the first 30%)"
            )
        warmup_fraction = config.warmup_steps / total_steps if config.warmup_steps else 0.3
        return OneCycleLR(
            optimizer,
            max_lr=config.lr,
            total_steps=total_steps,
            pct_start=warmup_fraction,
            cycle_momentum=config.name == "sgd",
        )
    return LambdaLR(optimizer, lr_multiplier(config, total_steps))
