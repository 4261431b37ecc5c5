"""Data-parallel runs under ``torchrun``: process group set-up and the few collectives we need.

``torchrun --nproc_per_node=N ...`` starts N copies of the same command with ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` in their environment. Without those variables the run is a
single process and every function here is a no-op, so the training loop has one code path.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistributedContext", "all_reduce_sum", "any_process", "resolve_device", "setup_distributed"]


@dataclass(frozen=True)
class DistributedContext:
    """Where this process sits in the run.

    Attributes:
        rank: global index of this process (0 writes checkpoints, metrics and the progress bar).
        world_size: number of processes.
        local_rank: index on this machine (selects the GPU).
        device: the device this process computes on.
        initialized_here: whether :func:`setup_distributed` created the process group (and so
            must destroy it).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def close(self) -> None:
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


def check_device_name(name: object, argument: str = "device") -> str:
    """Return ``name`` if it has the form of a device torchvote runs on (whether that device
    exists is :func:`resolve_device`'s question).

    Raises:
        ValueError: anything but ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``.
    """
    if not isinstance(name, str) or re.fullmatch(r"auto|cpu|cuda(:\d+)?", name) is None:
        raise ValueError(f"{argument} must be auto, cpu, cuda or cuda:<index>, got {name!r}")
    return name


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> ``cuda:<local_rank>`` if CUDA is available, else ``cpu``; other names as given
    (``cuda`` becomes ``cuda:<local_rank>``).

    Raises:
        ValueError: an unknown device name, or CUDA requested but not available.
    """
    check_device_name(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but CUDA is not available; use device=cpu or auto")
        return torch.device(f"cuda:{local_rank}") if name == "cuda" else torch.device(name)
    return torch.device(name)


def setup_distributed(device_name: str = "auto") -> DistributedContext:
    """Join the process group ``torchrun`` describes (gloo on CPU, nccl on GPU), if any.

    A process started without ``WORLD_SIZE`` (or with ``WORLD_SIZE=1``) gets a single-process
    context and no process group.

    Args:
        device_name: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``, resolved by
            :func:`resolve_device` with the process's ``LOCAL_RANK``.

    Returns:
        This process's context; ``initialized_here`` tells whether it created the process group.

    Raises:
        ValueError: an unknown device name, or CUDA requested but not available.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if world_size <= 1:
        return DistributedContext(device=device)
    initialized_here = False
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        initialized_here = True
    return DistributedContext(rank, world_size, local_rank, device, initialized_here)


def all_reduce_sum(values: torch.Tensor, context: DistributedContext) -> torch.Tensor:
    """Sum a tensor over all processes (identity for a single process)."""
    if context.is_distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def any_process(flag: bool, context: DistributedContext) -> bool:
    """True on every process if ``flag`` is true on any; used to stop all processes together."""
    if not context.is_distributed:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=context.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)
