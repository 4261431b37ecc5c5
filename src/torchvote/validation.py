"""Argument checks shared by every layer of torchvote: one message format, one place.

A parameter is checked once, where it enters the library (a public function or a constructor);
code further down trusts it. Every check raises ``ValueError`` (or ``TypeError`` for a value of
the wrong type) naming the argument and what was expected.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import torch

__all__ = [
    "check_choice",
    "check_input_dtype",
    "check_positive_float",
    "check_positive_int",
    "check_probability",
]


def check_positive_int(value: Any, argument: str, *, minimum: int = 1) -> int:
    """Return ``value`` if it is an integer (not a bool) of at least ``minimum``.

    Args:
        value: the value to check.
        argument: the argument's name, for the message.
        minimum: the smallest value allowed (1 unless given).

    Returns:
        ``value``, unchanged.

    Raises:
        ValueError: if ``value`` is not an integer or is smaller than ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{argument} must be {expected}, got {value!r}")
    return value


def check_positive_float(value: Any, argument: str) -> float:
    """Return ``value`` as a float if it is a finite number greater than zero.

    Raises:
        ValueError: if ``value`` is not a real number, not finite, or not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise ValueError(f"{argument} must be a positive finite number, got {value!r}")
    return float(value)


def check_probability(value: Any, argument: str) -> float:
    """Return ``value`` as a float if it lies in ``[0, 1)`` (a dropout probability).

    Raises:
        ValueError: if ``value`` is not a real number in ``[0, 1)``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{argument} must be in [0, 1), got {value!r}")
    return float(value)


def check_choice(value: Any, choices: Collection[Any], argument: str) -> Any:
    """Return ``value`` if it is one of ``choices``.

    Raises:
        ValueError: naming the argument and listing the choices.
    """
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{argument} must be one of {listed}, got {value!r}")
    return value


def check_input_dtype(tensor: torch.Tensor, dtype: torch.dtype, argument: str) -> None:
    """Refuse a floating-point input of another dtype than the module's parameters (``dtype``),
    unless ``torch.autocast`` is on for the input's device (it casts both).

    Raises:
        TypeError: naming the argument, both dtypes and the two ways to make them agree.
    """
    if tensor.dtype == dtype or torch.is_autocast_enabled(tensor.device.type):
        return
    raise TypeError(
        f"{argument} has dtype {tensor.dtype} but the module's parameters are {dtype}: convert "
        f"the input (e.g. {argument}.to({dtype})) or the module (module.to({tensor.dtype})), or "
        f"run under torch.autocast"
    )
