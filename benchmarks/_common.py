"""What every benchmark script shares: its parser (help showing defaults, the program name the user
typed), argparse types, device synchronisation and the Linux resident-set readings behind the CPU
memory columns.

The scripts run as files (by their path, or through the ``bench`` command), so this
folder is on ``sys.path`` and they import this module by its bare name.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from torchvote.validation import (
    auto_device_name,
    check_device_exists,
    check_device_name,
    check_positive_float,
    check_positive_int,
)

__all__ = [
    "HelpFormatter",
    "add_batch_size_argument",
    "add_device_argument",
    "benchmark_parser",
    "can_reset_peak_rss",
    "chosen_device",
    "device_name",
    "error_line",
    "max_rss_kib",
    "parse_with_quick",
    "peak_rss_growth_mib",
    "positive_float",
    "positive_int",
    "program_name",
    "release_free_heap",
    "reset_peak_rss",
    "status_kib",
    "synchronize",
]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse's error names the option).

    Raises:
        argparse.ArgumentTypeError: anything else, quoting ``text``.
    """
    try:
        return check_positive_int(int(text), "value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (argparse's error names the option).

    Raises:
        argparse.ArgumentTypeError: anything else, quoting ``text``.
    """
    try:
        return check_positive_float(float(text), "value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}") from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default after its help (a list as its words, ``1 8``), except
    where the help already says its default, or for a flag (default off) or a ``None`` default (the
    help says what no value means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if ("default" in text or action.option_strings == [] or default is None or default is False
                or default is argparse.SUPPRESS):
            return action.help
        if isinstance(default, (list, tuple)):
            shown = " ".join(map(str, default)).replace("%", "%%")
            return f"{text} (default: {shown})".lstrip()
        return f"{text} (default: %(default)s)".lstrip()


def program_name(script: str) -> str:
    """The command that ran the benchmark ``script`` (a path), for its parser's ``prog`` (what its
    usage errors start with): ``torchvote bench NAME`` when that command ran it (it runs the script
    as a child process with ``TORCHVOTE_BENCH_PROG`` set to those words), else the file's name
    (``routing.py``)."""
    given = os.environ.get("TORCHVOTE_BENCH_PROG", "")
    return given if given == f"torchvote bench {Path(script).stem}" else Path(script).name


def benchmark_parser(script: str, description: str) -> argparse.ArgumentParser:
    """The parser of the benchmark ``script`` (its ``__file__``): named as the user ran it (see
    :func:`program_name`), its help showing each option's default (:class:`HelpFormatter`)."""
    return argparse.ArgumentParser(prog=program_name(script), description=description,
                                   formatter_class=HelpFormatter)


def add_batch_size_argument(parser: argparse.ArgumentParser, old: tuple[str, ...], *, several: bool,
                            default: object, help: str) -> None:
    """``--batch-size`` (the spelling of ``torchvote train`` and every script), with the script's
    earlier spellings ``old`` (``--batches``, and ``--batch``, which argparse took as its
    abbreviation) kept as aliases of the same option; ``several``: one or more sizes (a list),
    else one."""
    extra = f"; {' and '.join(old)} {'are its old spellings' if len(old) > 1 else 'is its old spelling'}"
    parser.add_argument("--batch-size", *old, dest="batch_size", type=positive_int,
                        nargs="+" if several else None, default=default, metavar="N",
                        help=help + (extra if old else ""))


def device_name(text: str) -> str:
    """argparse type: a device name as ``torchvote train --device`` takes it (``auto``, ``cpu``,
    ``cuda``, ``cuda:<index>``; checked by ``check_device_name``), so argparse's error names
    ``--device``.

    Raises:
        argparse.ArgumentTypeError: any other name, quoting it.
    """
    try:
        return check_device_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device auto|cpu|cuda|cuda:<index>`` (default ``auto``: CUDA when torch sees a device), the
    same in every script and as in the ``torchvote`` commands; read it back with :func:`chosen_device`."""
    parser.add_argument("--device", type=device_name, default="auto",
                        help="auto, cpu, cuda or cuda:<index> (as torchvote train takes it); auto: cuda if "
                             "torch sees a CUDA device, else cpu")


def chosen_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """The device ``--device name`` means here: ``auto`` is CUDA where torch sees one (the rule of
    ``torchvote train --device``: :func:`torchvote.validation.auto_device_name`); a CUDA
    index (``cuda:1``) becomes torch's current device too, for the calls that take none.

    Args:
        parser: the script's parser, whose ``error`` reports a device this machine lacks.
        name: the ``--device`` value (checked by :func:`device_name`).

    Returns:
        The device.

    Raises:
        SystemExit: through ``parser.error`` (a usage error, exit 2) for CUDA without a device, or
            an index past the last one.
    """
    device = torch.device(auto_device_name(name))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name}: torch sees no CUDA device here")
    try:
        check_device_exists(device, name)
    except ValueError as error:
        parser.error(f"--device {name}: {error}")
    if device.index is not None:
        torch.cuda.set_device(device)
    return device


def parse_with_quick(parser: argparse.ArgumentParser, argv: list[str] | None, **quick: object):
    """``parser.parse_args(argv)``, where ``--quick`` changes the defaults to ``quick``: an option
    the user gives keeps its value (``--quick --steps 1`` runs one step; ``--quick`` set them all).

    Returns:
        The parsed namespace.
    """
    args = parser.parse_args(argv)
    if not args.quick:
        return args
    parser.set_defaults(**quick)
    return parser.parse_args(argv)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA); a no-op on the CPU. Call before reading a timer."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_rss() -> None:
    """Reset this process's resident-set high-water mark (``VmHWM``) to its current resident set
    (Linux >= 4.0, ``/proc/self/clear_refs``).

    Raises:
        OSError: the system offers no such file.
    """
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def can_reset_peak_rss() -> bool:
    """Whether this process may reset its resident-set high-water mark (Linux's
    ``/proc/self/clear_refs``), which the CPU memory columns need."""
    try:
        reset_peak_rss()
    except OSError:
        return False
    return True


def release_free_heap() -> None:
    """Return freed heap memory to the OS (glibc's ``malloc_trim``), so that the resident set
    before a measured step is what is live, not what an earlier step (a warm-up that compiled at
    the measured size) left cached: otherwise the step reuses that memory and shows no growth."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to trim
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rss_growth_mib(call: Callable[[], object]) -> float:
    """Run ``call`` once and return the extra resident memory it needed at its peak, in MiB:
    ``VmHWM`` after the run minus ``VmRSS`` before it, the high-water mark reset first. It sees
    every allocation (tracemalloc would not).

    Raises:
        OSError: no ``/proc/self/clear_refs`` or ``/proc/self/status`` (not Linux).
    """
    reset_peak_rss()
    before = status_kib("VmRSS")
    call()
    return (status_kib("VmHWM") - before) / 1024


def error_line(error: BaseException) -> str:
    """``"TypeName: first line of the message"`` (200 characters at most), for a table's notes; a
    ``MemoryError`` has no message."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``).

    Raises:
        KeyError: the field is missing (``OSError`` where there is no ``/proc``).
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/self/status")


def max_rss_kib() -> float:
    """``ru_maxrss`` of this process in KiB (Linux reports KiB, macOS bytes)."""
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max_rss / 1024 if sys.platform == "darwin" else max_rss
