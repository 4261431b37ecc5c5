"""How a capsule layer computes its routing: one math, three kernels, chosen by device and size.

The votes ``u_hat_ij = W_ij u_j`` of :class:`~torchvote.nn.capsules.CapsuleLinear` can reach the
router in three ways, which give the same numbers (tested in float64 in
``tests/nn/test_routing_strategy.py``) at very different speeds:

- ``"materialize"``: the ``(batch, out_caps, in_caps, out_dim)`` votes formed by one einsum
  (a batched matrix product) and routed as a tensor. Each routing pass is then a few large,
  memory-bound kernels: the fast choice on a GPU (an H100 routes CapsNet's 1152 -> 10 capsules
  about 4x faster than the naive layer this way), at the cost of the votes and their gradient in
  memory.
- ``"stream"``: :class:`~torchvote.functional.routing_votes.LinearVotes`, which never forms the
  votes: every pass is one matrix product per receiver over cache-sized tiles, backward recomputes
  (dynamic routing runs them as one kernel, :mod:`torchvote.functional.dynamic_kernel`).
  The fast and frugal choice on a CPU, where small vote GEMMs (inner size ``in_dim``) run far below
  peak; on a GPU its many small tiles launch many small kernels, slower than the naive layer.
- ``"compiled"``: the materialised routing wrapped in ``torch.compile`` (compiled once per layer,
  on the first call), so the loop's elementwise steps fuse. Falls back to ``"materialize"`` with a
  warning where ``torch.compile`` fails (no compiler, an unsupported platform).

``"auto"`` (the default) takes ``"stream"`` on a CPU and ``"materialize"`` elsewhere, unless the
votes would exceed :func:`materialize_budget` (then ``"stream"``: it never holds them).

Index legend: ``b`` batch, ``i`` receivers (output capsules), ``j`` senders (input capsules),
``d`` output capsule features.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "MATERIALIZE_BUDGET_BYTES",
    "STRATEGIES",
    "RoutingStrategy",
    "choose_strategy",
    "compile_or_none",
    "materialize_budget",
]

RoutingStrategy = Literal["auto", "materialize", "stream", "compiled"]
STRATEGIES: tuple[str, ...] = ("auto", "materialize", "stream", "compiled")

#: Largest votes tensor (bytes) ``"auto"`` materialises off the CPU, at the least
#: (:func:`materialize_budget`). The materialised routing keeps about four votes-sized tensors
#: alive in a training step (the votes, their gradient, and the products of the agreement and
#: weighted sums), so 1 GiB of votes is about 4 GiB at the peak.
MATERIALIZE_BUDGET_BYTES = 1 << 30


def materialize_budget(device: torch.device) -> int:
    """The largest votes tensor (bytes) ``"auto"`` materialises on ``device``: a sixteenth of a
    CUDA device's memory (a quarter of it at the step's peak), at least
    :data:`MATERIALIZE_BUDGET_BYTES`; that on any other device. Above it the streamed kernels,
    tuned for a CPU's cache, launch thousands of small kernels per step (5,943 operators against
    127 for CapsNet's layer at batch 2048): a fixed 1 GiB sent a 141 GB GPU there at batch 2048.

    Args:
        device: where the votes live.

    Returns:
        The budget in bytes (the device's size is a host-side query: nothing waits on the device).
    """
    if device.type == "cuda" and torch.cuda.is_available():
        return max(MATERIALIZE_BUDGET_BYTES, torch.cuda.get_device_properties(device).total_memory // 16)
    return MATERIALIZE_BUDGET_BYTES


def choose_strategy(strategy: str, *, device: torch.device, vote_bytes: int) -> str:
    """The kernel to route with: ``strategy`` itself, or what ``"auto"`` picks.

    Args:
        strategy: one of :data:`STRATEGIES` (already validated).
        device: where the votes live.
        vote_bytes: the size the ``(batch, out_caps, in_caps, out_dim)`` votes would have.

    Returns:
        ``"materialize"``, ``"stream"`` or ``"compiled"``. ``"compiled"`` on the ``"meta"`` device
        is ``"materialize"``: there is no kernel to compile for it, and a failed attempt would
        leave the layer eager on the device it is later moved to. While ``torch.compile`` traces,
        ``"auto"`` materialises votes within the budget on a CPU too: the streamed kernels tile
        the batch in Python, which fixes the compiled graph's batch size (every new size compiled
        again, dynamic shapes never engaging); the materialised routing is one traced product.
        A batch traced as dynamic (a symbolic ``vote_bytes``) is materialised whatever its size.
    """
    if strategy == "compiled" and device.type == "meta":
        return "materialize"
    if strategy != "auto":
        return strategy
    if isinstance(vote_bytes, torch.SymInt):  # a dynamic batch being traced: no guard on its size
        return "materialize"  # (a comparison would bound it, and torch.export refuse the dynamic batch)
    if vote_bytes > materialize_budget(device):
        return "stream"
    if device.type == "cpu" and not torch.compiler.is_compiling():
        return "stream"
    return "materialize"


def compile_or_none(
    fn: Callable[..., object], *args: Tensor | None
) -> tuple[Callable[..., object] | None, object]:
    """``torch.compile(fn)`` and its first result on ``args``, or ``(None, fn(*args))`` with a
    warning if compiling fails.

    Args:
        fn: the function to compile.
        *args: its first arguments.

    Returns:
        ``(compiled function or None, fn(*args))``.
    """
    try:
        compiled = torch.compile(fn)
        return compiled, compiled(*args)
    except Exception as error:  # noqa: BLE001 (any failure of the compiler stack means: run eagerly)
        warnings.warn(
            f"strategy='compiled': torch.compile failed ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); routing with 'materialize' instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None, fn(*args)
