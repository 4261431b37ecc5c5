"""Argument checks shared by every layer of torchvote: one message format, one place.

A parameter is checked once, where it enters the library (a public function or a constructor);
code further down trusts it. Every check raises ``ValueError`` (or ``TypeError`` for a value of
the wrong type) naming the argument and what was expected. Checks of a tensor's *values* go
through :func:`check_tensor_values`, which never makes an accelerator wait for the host, and are
skipped where values cannot be read (:func:`values_are_traced`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import math
import numbers
import os
import re
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from torchvote.tracing import under_autograd_transforms

__all__ = [
    "ArgumentTypeError",
    "as_path",
    "autocast_available",
    "autocast_enabled",
    "broadcast_shape",
    "caller_stacklevel",
    "check_bool_fields",
    "check_choice",
    "auto_device_name",
    "check_device_exists",
    "check_device_name",
    "check_dim",
    "check_factory_device",
    "check_flag",
    "check_float_dtype",
    "check_float_tensor",
    "check_index_range",
    "check_input_dtype",
    "check_inputs_beside",
    "check_integer_tensor",
    "first_parameter",
    "check_keyword_options",
    "check_positive_float",
    "check_in_range",
    "check_positive_int",
    "check_probability",
    "check_scale",
    "check_seed",
    "check_tensor_values",
    "check_texts",
    "computes_in_float16",
    "is_integer",
    "is_real",
    "resolve_device",
    "values_are_traced",
]


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (``num_heads=2.0``, ``dropout="0.1"``): a ``TypeError``, as
    Python reports a wrong type, and a ``ValueError`` too, which these checks raised for it
    before and callers (a config loader turning it into its own error) may catch."""


def check_positive_int(value: Any, argument: str, *, minimum: int = 1) -> int:
    """Return ``value`` if it is an integer (not a bool) of at least ``minimum``.

    Args:
        value: the value to check.
        argument: the argument's name, for the message.
        minimum: the smallest value allowed (1 unless given).

    Returns:
        ``value`` as a Python int (a NumPy integer is taken as its value).

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) if ``value`` is not an integer.
        ValueError: if it is smaller than ``minimum``.
    """
    if not is_integer(value) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        error = ValueError if is_integer(value) else ArgumentTypeError
        raise error(f"{argument} must be {expected}, got {value!r}")
    return int(value)


def check_seed(value: Any, argument: str = "seed") -> int:
    """Return ``value`` if it is a seed: an integer in ``[0, 2**64)``, what
    ``torch.manual_seed`` and ``torch.Generator.manual_seed`` take (a larger one fails there,
    naming nothing, at the first draw).

    Args:
        value: the value to check.
        argument: the argument's name, for the message.

    Returns:
        ``value`` as a Python int.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) if ``value`` is not an integer.
        ValueError: if it is negative or at least ``2**64``.
    """
    if not is_integer(value) or not 0 <= value < 2**64:
        error = ValueError if is_integer(value) else ArgumentTypeError
        raise error(f"{argument} must be an integer in [0, 2**64), got {value!r}")
    return int(value)


def as_path(value: object, argument: str) -> Path:
    """Return ``value`` as a :class:`~pathlib.Path` (``~`` expanded) if it is a path.

    Args:
        value: A ``str`` or an :class:`os.PathLike` of ``str``.
        argument: The argument's name, for the message.

    Returns:
        ``Path(value).expanduser()``.

    Raises:
        TypeError: If ``value`` is not a ``str`` or ``os.PathLike`` (``bytes`` paths included),
            naming ``argument``.
        ValueError: If ``value`` is the empty string.
    """
    if not isinstance(value, (str, os.PathLike)) or isinstance(os.fspath(value), bytes):
        raise TypeError(f"{argument}: expected a path (str or os.PathLike), got {type(value).__name__}")
    if os.fspath(value) == "":
        raise ValueError(f"{argument}: expected a path, got an empty string")
    return Path(value).expanduser()


def check_positive_float(value: Any, argument: str) -> float:
    """Return ``value`` as a float if it is a finite number greater than zero.

    Args:
        value: the value to check.
        argument: the argument's name, for the message.

    Returns:
        ``value`` as a float.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) if ``value`` is not a real number.
        ValueError: if it is not finite or not positive.
    """
    if not is_real(value) or not math.isfinite(value) or value <= 0:
        error = ValueError if is_real(value) else ArgumentTypeError
        raise error(f"{argument} must be a positive finite number, got {value!r}")
    return float(value)


def check_in_range(
    value: Any,
    argument: str,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    include_low: bool = True,
    include_high: bool = True,
) -> float:
    """Return ``value`` as a float if it is a finite real number between ``low`` and ``high``.

    Args:
        value: the value to check.
        argument: the argument's name, for the message.
        low, high: the bounds (infinite bounds leave that side open).
        include_low, include_high: whether each bound itself is allowed.

    Returns:
        ``value`` as a float.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) if ``value`` is not a real
            number (bools are not).
        ValueError: if it is not finite or outside the interval, with the interval in the message.
    """
    above = (low <= value if include_low else low < value) if is_real(value) else False
    below = (value <= high if include_high else value < high) if is_real(value) else False
    if not (above and below and math.isfinite(value)):
        left = "[" if include_low and math.isfinite(low) else "("
        right = "]" if include_high and math.isfinite(high) else ")"
        error = ValueError if is_real(value) else ArgumentTypeError
        raise error(f"{argument} must be a finite number in {left}{low}, {high}{right}, got {value!r}")
    return float(value)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number that is not a bool: Python's int and float, NumPy's
    integer and float scalars (``numbers.Real``; ``np.float32(0.5)`` from an array is as good as
    ``0.5``).

    Args:
        value: the value to test.

    Returns:
        True for a real number, False for a bool, a 0-d tensor, an array or anything else.
    """
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_integer(value: Any) -> bool:
    """Whether ``value`` is an integer that is not a bool: Python's int or a NumPy integer scalar
    (``numbers.Integral``; ``np.int64(3)`` from an array is as good as ``3``).

    Args:
        value: the value to test.

    Returns:
        True for an integer, False for a bool, a float, a tensor or anything else.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_probability(value: Any, argument: str) -> float:
    """Return ``value`` as a float if it lies in ``[0, 1)`` (a dropout probability).

    Args:
        value: the value to check.
        argument: the argument's name, for the message.

    Returns:
        ``value`` as a float.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) if ``value`` is not a real number.
        ValueError: if it is outside ``[0, 1)``.
    """
    if not is_real(value) or not 0.0 <= value < 1.0:
        error = ValueError if is_real(value) else ArgumentTypeError
        raise error(f"{argument} must be in [0, 1), got {value!r}")
    return float(value)


def check_choice(value: Any, choices: Collection[Any], argument: str) -> Any:
    """Return ``value`` if it is one of ``choices``.

    Args:
        value: the value to check.
        choices: the values allowed (compared with ``in``), listed in the message; a collection
            of values such as a tuple, never a ``str`` (``in`` would match substrings).
        argument: the argument's name, for the message.

    Returns:
        ``value``, unchanged.

    Raises:
        TypeError: ``choices`` is a ``str`` or ``bytes``.
        ValueError: naming the argument and listing the choices.
    """
    if isinstance(choices, (str, bytes)):
        raise TypeError(
            f"choices: expected a collection of allowed values such as a tuple, not a "
            f"{type(choices).__name__} ({choices!r}) whose substrings would match"
        )
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{argument} must be one of {listed}, got {value!r}")
    return value


def check_float_dtype(dtype: Any, argument: str = "dtype") -> torch.dtype | None:
    """A factory ``dtype`` argument: ``None`` (the default dtype) or a floating-point
    ``torch.dtype`` (parameters, tables and weights hold real numbers).

    Args:
        dtype: the value given.
        argument: its name, for the message.

    Returns:
        ``dtype``.

    Raises:
        TypeError: anything else, naming the argument.
    """
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{argument} must be a floating-point torch.dtype or None, got {dtype!r}")
    return dtype


def check_float_tensor(value: Any, argument: str) -> None:
    """Refuse anything but a floating-point tensor (reads the dtype, never the values): an integer
    tensor would be computed in integers, a list fail inside PyTorch naming no argument.

    Args:
        value: the input to check.
        argument: its name, for the message.

    Raises:
        TypeError: ``value`` not a tensor (``"{argument} must be a floating-point tensor, got
            list"``) or not floating point (``"{argument} must be floating point, got dtype
            torch.int64"``).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{argument} must be a floating-point tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{argument} must be floating point, got dtype {value.dtype}")


def _read_autocast_availability() -> dict[str, bool]:
    available = {}
    for device_type in ("cpu", "cuda", "xpu", "mps", "hpu", "mtia", "xla", "privateuseone", "meta"):
        with contextlib.suppress(RuntimeError):  # a device type this PyTorch does not know
            available[device_type] = torch.amp.is_autocast_available(device_type)
    return available


#: ``torch.amp.is_autocast_available`` of the usual device types, read once at import: before
#: PyTorch 2.13, ``torch.compile`` cannot trace that call (a graph break in every product run
#: with autocast off, seen on torch 2.11 with CUDA), while a dictionary lookup traces.
_AUTOCAST_AVAILABLE = _read_autocast_availability()


def autocast_available(device_type: str) -> bool:
    """Whether ``torch.autocast`` exists for ``device_type`` (not for ``"meta"``, say), without a
    graph break under ``torch.compile``.

    Args:
        device_type: a ``device.type``, e.g. ``"cuda"``.

    Returns:
        ``torch.amp.is_autocast_available(device_type)``.
    """
    known = _AUTOCAST_AVAILABLE.get(device_type)
    return torch.amp.is_autocast_available(device_type) if known is None else known


def computes_in_float16(*operands: torch.Tensor) -> bool:
    """Whether an op on ``operands`` computes in float16: one of them is float16, or float16
    autocast is on for their device and one is float32 (autocast casts float32, not float64).

    Args:
        operands: tensors on one device.

    Returns:
        True where a product of them would pass float16's 65504 as ``inf``.
    """
    device_type = operands[0].device.type
    return any(x.dtype == torch.float16 for x in operands) or (
        autocast_enabled(device_type)
        and torch.get_autocast_dtype(device_type) == torch.float16
        and any(x.dtype == torch.float32 for x in operands)
    )


def autocast_enabled(device_type: str) -> bool:
    """Whether ``torch.autocast`` is on for ``device_type``.

    Args:
        device_type: a ``device.type``, e.g. ``"cuda"``.

    Returns:
        ``False`` also where autocast does not exist for the device (``"meta"``, on which
        ``torch.is_autocast_enabled`` raises).
    """
    return autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def check_input_dtype(
    tensor: Any, dtype: torch.dtype, argument: str, reference: str | None = None
) -> None:
    """Refuse a ``tensor`` that is not floating point, or whose dtype is not ``dtype``, unless
    ``torch.autocast`` is on for its device (it computes in mixed dtypes). Reads only the dtype,
    never the values.

    Args:
        tensor: the input to check.
        dtype: the dtype it must have: a module's parameters' (the default ``reference``) or that
            of the tensor it is combined with.
        argument: its name, for the message.
        reference: what ``dtype`` belongs to, e.g. ``"the votes"``; ``None`` for a module's
            parameters (the message then also suggests converting the module).

    Raises:
        TypeError: naming the argument, its dtype and the one expected.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        described = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise TypeError(f"{argument} must be a floating-point tensor, got {described}")
    if tensor.dtype == dtype or autocast_enabled(tensor.device.type):
        return
    if reference is None:
        raise TypeError(
            f"{argument} has dtype {tensor.dtype} but the module's parameters are {dtype}: convert "
            f"the input (e.g. {argument}.to({dtype})) or the module (module.to({tensor.dtype})), or "
            f"run under torch.autocast"
        )
    raise TypeError(
        f"{argument} has dtype {tensor.dtype} but {reference} are {dtype}: convert one of them "
        f"(e.g. {argument}.to({dtype})), or run under torch.autocast"
    )


def check_device(
    tensor: torch.Tensor, device: torch.device, argument: str, reference: str | None = None
) -> None:
    """Refuse a ``tensor`` on another device than ``device``, before an operation fails on it with
    an error that names no argument (or, for some pairs such as a CPU tensor beside a ``meta``
    one, computes on uninitialised memory without a word).

    Args:
        tensor: the input to check.
        device: where it must be: a module's parameters' device (the default ``reference``) or that
            of the tensor it is combined with.
        argument: its name, for the message.
        reference: what ``device`` belongs to, e.g. ``"the inputs"``; ``None`` for a module's
            parameters.

    Raises:
        ValueError: naming the argument, its device and the one expected.
    """
    if tensor.device == device:
        return
    where = "the module's parameters" if reference is None else reference
    raise ValueError(
        f"{argument} is on {tensor.device} but {where} are on {device}: move one of them "
        f"(e.g. {argument}.to({str(device)!r}))"
    )


def check_device_exists(device: torch.device, name: str | None = None) -> torch.device:
    """Return ``device`` if this machine has it: a CUDA device needs CUDA and an index below the
    device count (else ``.to(device)`` fails deep in torch, "Torch not compiled with CUDA enabled"
    an AssertionError); other types are returned as they are.

    Args:
        device: the device to check.
        name: the name the user gave, for the message (default ``str(device)``).

    Returns:
        ``device``.

    Raises:
        ValueError: CUDA requested but not available, or a CUDA index past the last device.
    """
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {name or str(device)!r} requested but CUDA is not available; use the CPU "
            "('cpu') or 'auto'"  # the caller's own spelling: --device cpu, device=cpu, device="cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"device {str(device)!r} requested but this machine has {count} CUDA device(s), "
            f"cuda:0 .. cuda:{count - 1}"
        )
    return device


def check_device_name(name: object, argument: str = "device") -> str:
    """Return ``name`` if it has the form of a device torchvote runs on (whether that device
    exists is :func:`resolve_device`'s question).

    Args:
        name: the device name given.
        argument: its name, for the message (``"--device"`` on the command line).

    Returns:
        ``name``.

    Raises:
        ValueError: anything but ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``.
    """
    if not isinstance(name, str) or re.fullmatch(r"auto|cpu|cuda(:\d+)?", name) is None:
        raise ValueError(f"{argument} must be auto, cpu, cuda or cuda:<index>, got {name!r}")
    return name


def auto_device_name(name: str) -> str:
    """The device ``auto`` means here: ``cuda`` where torch sees a CUDA device, else ``cpu``; any
    other name as it is. The one place of that rule (:func:`resolve_device`, the benchmarks, the
    commands' ``--device``).

    Args:
        name: a device name (``auto``, ``cpu``, ``cuda``, ``cuda:<index>``).

    Returns:
        ``name``, ``auto`` replaced.
    """
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` if CUDA is available, else ``cpu``; other names as given
    (``cuda`` becomes ``cuda:<local_rank>``).

    Args:
        name: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``.
        local_rank: the process's GPU under DDP, for ``auto`` and ``cuda``.

    Returns:
        The ``torch.device``, one this machine has.

    Raises:
        ValueError: an unknown device name, CUDA requested but not available, or a CUDA index
            past the last device.
    """
    check_device_name(name)
    name = auto_device_name(name)
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
    return check_device_exists(device, name)


def check_factory_device(device: Any, argument: str = "device") -> torch.device | None:
    """Return ``device`` as a ``torch.device`` (``None`` as it is) if it names one this machine
    has: what a factory (``create_model``, ``load_pretrained``) checks before it builds anything.

    Args:
        device: ``None``, a ``torch.device``, a name torch reads (``"cpu"``, ``"cuda:1"``,
            ``"meta"``) or a CUDA index (as torch takes it).
        argument: its name, for the message.

    Returns:
        The device, or ``None``.

    Raises:
        ArgumentTypeError: (a ``TypeError`` and a ``ValueError``) anything else (``3.5``).
        ValueError: a name torch does not read ("gpu" was torch's RuntimeError from inside the
            first layer, or after a model loaded), or a CUDA device this machine lacks
            (:func:`check_device_exists`).
    """
    if device is None or isinstance(device, torch.device):
        return None if device is None else check_device_exists(device)
    expected = f"{argument} must be a torch.device or its name ('cpu', 'cuda:0', 'meta'), got {device!r}"
    if not isinstance(device, str) and not is_integer(device):
        raise ArgumentTypeError(expected)
    try:
        parsed = torch.device(device if isinstance(device, str) else int(device))
    except RuntimeError as error:
        if not isinstance(device, str):  # torch: "Cannot access accelerator device when none is ..."
            raise ValueError(f"{argument}={device} names an accelerator, and this machine has none") from None
        raise ValueError(f"{expected} ({error})") from None
    return check_device_exists(parsed)


def first_parameter(module: torch.nn.Module) -> torch.Tensor | None:
    """The first of ``module``'s parameters, the reference of :func:`check_inputs_beside` for its
    inputs' dtype and device; ``None`` for a module without parameters.

    Built as a list, not ``next(module.parameters(), None)``: the dynamo of torch 2.7.1 cannot
    trace ``next`` with a default (every capsule layer's graph broke there; 2.13 traces both).

    Args:
        module: any module.

    Returns:
        The parameter, or ``None``.
    """
    parameters = list(module.parameters())
    return parameters[0] if parameters else None


def check_inputs_beside(
    reference: torch.Tensor,
    inputs: Collection[tuple[str, Any]],
    *,
    masks: Collection[tuple[str, Any]] = (),
    where: str | None = None,
) -> None:
    """Refuse inputs of another dtype (outside ``torch.autocast``) or device than ``reference``
    (a module's parameter, or the input the others go with), and masks on another device: the
    checks a module makes of what it is given, before PyTorch fails naming no argument, or (a CPU
    tensor beside ``meta`` weights) computes on uninitialised memory.

    Args:
        reference: the tensor whose dtype and device rule.
        inputs: ``(name, tensor)`` pairs of floating-point inputs.
        masks: ``(name, mask or None)`` pairs, checked for the device only.
        where: what ``reference`` is, e.g. ``"the queries"``; ``None`` for a module's parameters.

    Raises:
        TypeError: an input of another dtype (:func:`check_input_dtype`).
        ValueError: a tensor on another device (:func:`check_device`).
    """
    for name, tensor in inputs:
        check_input_dtype(tensor, reference.dtype, name, where)
    for name, tensor in (*inputs, *masks):
        if isinstance(tensor, torch.Tensor):
            check_device(tensor, reference.device, name, where)


def check_integer_tensor(value: Any, argument: str, expected: str) -> None:
    """Refuse anything but a tensor of integers (not bool): ids and class indices, which a float
    tensor would reach truncated. Reads only the dtype.

    Args:
        value: the input to check.
        argument: its name, for the message.
        expected: what it should hold, e.g. ``"a 1-D integer tensor of ids"``.

    Raises:
        TypeError: ``"{argument} must be {expected}, got {dtype or type}"``.
    """
    if (
        not isinstance(value, torch.Tensor)
        or value.is_floating_point()
        or value.is_complex()
        or value.dtype == torch.bool
    ):
        described = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"{argument} must be {expected}, got {described}")


def check_keyword_options(options: Collection[str], passed_to: Callable, owner: str) -> None:
    """Refuse keyword ``options`` that ``passed_to`` (a parent's ``__init__``) does not take, by
    ``owner``'s name: Python's own error names the parent (``BiasedRouter.__init__() got an
    unexpected keyword argument``), which the user never called.

    Args:
        options: the names of the keyword options the user gave ``owner``.
        passed_to: the callable they are passed on to.
        owner: the class or function the user called, for the message.

    Raises:
        TypeError: ``"{owner} got unexpected keyword argument(s) ...; besides its own arguments it
            takes ..."`` (the keyword-only parameters of ``passed_to``).
    """
    parameters = inspect.signature(passed_to).parameters.values()
    accepted = [p.name for p in parameters if p.kind == p.KEYWORD_ONLY]
    unknown = [name for name in options if name not in accepted]
    if unknown:
        raise TypeError(
            f"{owner} got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; besides "
            f"its own arguments it takes {', '.join(accepted)}"
        )


def check_texts(value: Any, argument: str) -> tuple[str, ...]:
    """Return ``value`` as a tuple if it is a sequence of strings; refuse one string, which
    iteration would read as its characters (``"uniform"`` as the seven filters ``u``, ``n``, ...).

    Args:
        value: a list or tuple of strings.
        argument: its name, for the message.

    Returns:
        The strings, as a tuple.

    Raises:
        ArgumentTypeError: ``value`` a single ``str`` (the message suggests ``[value]``) or
            ``bytes``, no iterable, or an element that is not a ``str``.
    """
    if isinstance(value, (str, bytes)):
        raise ArgumentTypeError(
            f"{argument} must be a list of strings, got the single string {value!r} (give "
            f"[{value!r}])"
        )
    try:
        texts = tuple(value)
    except TypeError:
        raise ArgumentTypeError(
            f"{argument} must be a list of strings, got {type(value).__name__}"
        ) from None
    wrong = [text for text in texts if not isinstance(text, str)]
    if wrong:
        raise ArgumentTypeError(f"{argument} must be a list of strings, got {wrong[0]!r} in it")
    return texts


def check_flag(value: Any, argument: str) -> bool:
    """Return ``value`` if it is ``True`` or ``False``.

    A string such as ``"no"`` or ``None`` would otherwise be read by its truthiness and switch the
    option on or off silently (``is_causal="no"`` made attention causal).

    Args:
        value: the value to check.
        argument: the argument's name, for the message.

    Returns:
        ``value``, unchanged.

    Raises:
        TypeError: ``"{argument} must be True or False, got {value!r}"``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{argument} must be True or False, got {value!r}")
    return value


def check_scale(value: Any, argument: str = "scale") -> float | None:
    """Return ``value`` as a float (``None`` kept) if it is a finite real number.

    Args:
        value: ``None`` (the callee's default) or the multiplier of the scores.
        argument: the argument's name, for the message.

    Returns:
        ``None`` or ``float(value)``.

    Raises:
        TypeError: ``value`` is not a real number (a bool, a string, a tensor).
        ValueError: ``value`` is NaN or infinite (every weight would be NaN).
    """
    if value is None:
        return None
    if not is_real(value):
        raise TypeError(f"{argument} must be a real number or None, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{argument} must be finite, got {value!r}")
    return float(value)


def check_dim(dim: Any, rank: int, argument: str = "dim") -> int:
    """Return ``dim`` if it is an axis of a tensor of ``rank`` dimensions.

    Args:
        dim: the axis (negative counts from the end).
        rank: the tensor's number of dimensions.
        argument: the argument's name, for the message.

    Returns:
        ``dim``, unchanged.

    Raises:
        ValueError: ``dim`` outside ``[-rank, rank)`` (``[-1, 1)`` for a 0-D tensor, which torch's
            reductions read as one entry).
        ArgumentTypeError: ``dim`` not an integer (bools are not), a ``TypeError`` and a
            ``ValueError``.
    """
    axes = max(rank, 1)
    if not is_integer(dim):
        raise ArgumentTypeError(
            f"{argument} must be an axis of the {rank}-D input, an integer in [{-axes}, {axes}), "
            f"got {dim!r}"
        )
    if not -axes <= dim < axes:
        raise ValueError(
            f"{argument} must be an axis of the {rank}-D input, in [{-axes}, {axes}), got {dim!r}"
        )
    return dim


def check_bool_fields(config: Any) -> None:
    """Refuse a dataclass ``config`` whose ``bool`` fields hold anything but ``True``/``False``:
    a string ``"no"`` is truthy and would switch the option on.

    Args:
        config: a dataclass instance; only the fields annotated ``bool`` are checked.

    Raises:
        TypeError: naming the first such field and its value.
    """
    for field in dataclasses.fields(config):
        if field.type in ("bool", bool):
            check_flag(getattr(config, field.name), field.name)


def broadcast_shape(*shapes: Collection[int]) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to, or ``None`` when they do not broadcast (what every
    "does this mask / bias / batch fit" check asks; shapes only, nothing is allocated).

    NumPy's rule (as ``torch.broadcast_shapes``), in plain Python: that function costs about
    0.1 ms a call on a CPU, which an attention layer's checks would pay on every forward pass.
    """
    # the common case: nothing to broadcast (ranks first: under torch.export, a size compared
    # with another axis's would put a guard on it)
    if all(len(shape) == len(shapes[0]) and shape == shapes[0] for shape in shapes[1:]):
        return tuple(shapes[0]) if shapes else ()
    result = []
    for sizes in itertools.zip_longest(*(reversed(tuple(shape)) for shape in shapes), fillvalue=1):
        size = 1
        for other in sizes:
            if other != 1:
                if size != 1 and other != size:
                    return None
                size = other
        result.append(size)
    return tuple(reversed(result))


def check_tensor_values(
    valid: torch.Tensor, message: str, *, detail: Callable[[], str] | None = None
) -> None:
    """Refuse bad tensor values without stalling an accelerator.

    Shapes and dtypes cost nothing to check; values do: reading a flag computed on a GPU makes
    the host wait for every kernel queued before it, at every step. So the check is a boolean
    tensor ``valid`` (True when the values are fine), enforced by where it lives:

    * on the CPU, eagerly: read at once (free there); False raises ``ValueError``;
    * on an accelerator, or while ``torch.compile`` traces: queued with
      ``torch._assert_async``, nothing is read back. A False fails the device's stream with
      ``message`` (a RuntimeError at the next synchronisation), as PyTorch's own index checks of
      ``nll_loss``, ``embedding`` and ``one_hot`` do on CUDA;
    * under a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ``jvp``): skipped. Inside
      ``vmap`` ``valid`` holds one flag per example, which can be neither read (a
      data-dependent branch) nor queued (``_assert_async`` has no batching rule); the eager call
      of the same function checks the values.

    Args:
        valid: a one-element boolean tensor (e.g. ``(ids >= 0).all()``).
        message: what is wrong, naming the argument and what was expected.
        detail: called only for the CPU's ``ValueError`` (the values may be read there): text
            appended to ``message``, e.g. the offending values.

    Raises:
        ValueError: on the CPU, ``valid`` is False (not under a ``torch.func`` transform).
    """
    if under_autograd_transforms():  # one flag per example under vmap: no read, no queued assert
        return
    if _reads_are_free(valid):
        if not bool(valid):
            raise ValueError(message if detail is None else f"{message}{detail()}")
        return
    torch._assert_async(valid, message)


def check_index_range(indices: torch.Tensor, size: int, message: str) -> None:
    """Refuse integer ``indices`` outside ``[0, size)`` through :func:`check_tensor_values`; on the
    CPU the ValueError adds the smallest and largest index. An empty tensor passes.

    Args:
        indices: integer ids or class indices, any shape.
        size: the number of valid indices.
        message: what is wrong, naming the argument and the range.

    Raises:
        ValueError: on the CPU, an index outside the range.
    """
    if indices.numel() == 0:  # nothing to check (and aminmax refuses an empty tensor)
        return

    def extremes() -> str:
        low, high = (int(value) for value in torch.aminmax(indices))
        return f": smallest {low}, largest {high}"

    check_tensor_values(((indices >= 0) & (indices < size)).all(), message, detail=extremes)


def values_are_traced() -> bool:
    """Whether a tensor's values must not be read here: ``torch.compile`` or ``torch.export`` is
    tracing (a read is a graph break, and fails ``fullgraph=True`` and export), or a
    ``torch.func`` transform is running (inside ``vmap`` a value is one per example: ``bool`` or
    ``.item()`` of it raises "data-dependent control flow"; ``grad``, ``jacrev`` and ``jvp`` are
    treated alike, so that nesting them in ``vmap`` changes nothing).

    The one predicate of every read of values that the library may leave out: the mask reads of
    :mod:`torchvote.functional.masks` (a causal mask turned into ``is_causal=True``, the warning
    for ``torch.nn.MultiheadAttention``'s mask convention, a causal mask refused with a softmax
    over the receivers) are skipped here with the same numbers, and :func:`check_tensor_values`
    reads nothing (it queues its check on the device while compiled, skips it under a transform);
    the eager call of the same code reads them.

    Returns:
        True while traced or transformed.
    """
    return torch.compiler.is_compiling() or under_autograd_transforms()


def _reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor``'s values costs nothing: eager code on the CPU (not traced)."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def _internal_folders() -> tuple[str, ...]:
    """torch's and torchvote's package folders, each with a separator (``.../torch`` alone would
    also match torchvision's files)."""
    packages = (torch, sys.modules["torchvote"])
    return tuple(os.path.join(Path(module.__file__).parent, "") for module in packages)


def caller_stacklevel() -> int:
    """The ``stacklevel`` at which a warning raised by the function calling this one names the
    first frame outside torchvote and torch: the user's line, however many of torchvote's
    functions and torch's module wrappers (``Module.__call__``) lie between.

    Returns:
        The level for ``warnings.warn(..., stacklevel=...)`` in the caller.
    """
    internal = _internal_folders()
    frame, level = sys._getframe(2), 2  # level 1: the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level
