"""Data-parallel runs under ``torchrun``: process group set-up and the few collectives we need.

``torchrun --nproc_per_node=N ...`` starts N copies of the same command with ``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` in their environment. Without those variables the run is a
single process and every function here is a no-op, so the training loop has one code path.
"""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# the device names' rules live in validation (no omegaconf there, for the commands that train
# nothing); imported here too, where they were before
from torchvote.validation import auto_device_name, check_device_name, resolve_device

__all__ = [
    "DistributedContext",
    "all_reduce_sum",
    "any_process",
    "any_processes",
    "auto_device_name",
    "check_device_name",
    "max_over_processes",
    "resolve_device",
    "setup_distributed",
]


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
        control_group: a gloo group for the flags of :func:`any_process` when the default group
            is not gloo (nccl), so that a flag is exchanged between the hosts without waiting for
            the device; ``None``: the default group.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    initialized_here: bool = False
    control_group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def close(self, *, together: bool = False) -> None:
        """Leave the process group this run made (a caller's stays; its control group goes).

        Args:
            together: every process is known to get here (a run that ended normally): wait for
                all of them before tearing the group down. A process that destroyed its group
                while another was still inside its own teardown made that one abort at exit
                under load ("terminate called without an active exception", exit -6) after a
                finished run. Not after an error: the other processes may never come.
        """
        if not dist.is_initialized():
            return
        if self.initialized_here:
            if together and self.is_distributed:
                dist.barrier(group=self.control_group)  # gloo: the host only, on any device
            _free_gloo_backends_last(dist.group.WORLD, self.control_group)
            dist.destroy_process_group()  # and every group made from it
        elif self.control_group is not None:
            _free_gloo_backends_last(self.control_group)
            dist.destroy_process_group(self.control_group)


def _free_gloo_backends_last(*groups: Any) -> None:
    """Keep each group's gloo backend until the group's Python object is gone, then free it without
    the GIL; call before the groups are destroyed (``None`` entries are skipped).

    A gloo backend's destructor joins its worker threads. A worker that has just finished a
    collective may still hold its tensors, and where this process has freed their Python objects
    since (:func:`max_over_processes`' flags, freed on return), the worker needs the GIL to free
    them. Before torch 2.8 (pytorch/pytorch#154976) a process group freed its backend holding the
    GIL: the worker waited for the GIL and the process for the worker, forever (a finished run's
    torchrun process hung at exit in 2 of 11 runs on torch 2.7.1; py-spy showed both threads). Torch
    frees a gloo backend's own Python object without the GIL: holding that object past the group
    makes it the last reference.
    """
    for group in groups:
        if group is None:
            continue
        try:
            backend = group._get_backend(torch.device("cpu"))
        except (AttributeError, RuntimeError):  # no CPU backend (nccl), or a torch without the method
            continue
        weakref.finalize(group, list.clear, [backend])  # freed when the group is: its last reference


def setup_distributed(device_name: str = "auto") -> DistributedContext:
    """Join the process group ``torchrun`` describes (gloo on CPU, nccl on GPU), if any.

    A process started without ``WORLD_SIZE`` (or with ``WORLD_SIZE=1``) gets a single-process
    context and no process group. A process group the caller initialised already (say under
    ``torch.multiprocessing.spawn``) is used as it is: its rank and size count, whatever the
    environment says; the GPU is ``LOCAL_RANK``'s, else the current one.

    Args:
        device_name: ``auto``, ``cpu``, ``cuda`` or ``cuda:<index>``, resolved by
            :func:`resolve_device` with the process's ``LOCAL_RANK``.

    Returns:
        This process's context; ``initialized_here`` tells whether it created the process group.

    Raises:
        ValueError: an unknown device name, CUDA requested but not available, or one GPU named
            (``cuda:<index>``) for the several processes ``torchrun`` started on this machine.
    """
    initialized_here = False
    if dist.is_initialized():  # by the caller: two processes must not both think they are rank 0
        world_size, rank = dist.get_world_size(), dist.get_rank()
        default_local = torch.cuda.current_device() if torch.cuda.is_available() else 0
        local_rank = int(os.environ.get("LOCAL_RANK", default_local))
    else:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1 and re.fullmatch(r"cuda:\d+", str(device_name)):
        raise ValueError(
            f"device={device_name} would put every process on this machine on one GPU; under "
            "torchrun use device=cuda (or auto): each process takes the GPU of its LOCAL_RANK "
            "(CUDA_VISIBLE_DEVICES chooses which GPUs)"
        )
    device = resolve_device(device_name, local_rank)
    if world_size <= 1:
        return DistributedContext(device=device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        initialized_here = True
    # every process calls this (new_group is collective): the stop flag checked after each step
    # then travels host to host, and reading it does not wait for the step's kernels
    control_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    return DistributedContext(rank, world_size, local_rank, device, initialized_here, control_group)


def all_reduce_sum(values: torch.Tensor, context: DistributedContext) -> torch.Tensor:
    """Sum a tensor over all processes (identity for a single process)."""
    if context.is_distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def any_process(flag: bool, context: DistributedContext) -> bool:
    """True on every process if ``flag`` is true on any; used to stop all processes together.

    The loop asks after every step, so the flag never goes to the device: a CPU tensor over a
    gloo group (:attr:`DistributedContext.control_group`) is one exchange between the hosts, where
    reading a device tensor would make the host wait for every kernel queued so far (and the
    device wait, idle, for the next step to be queued).
    """
    return any_processes((flag,), context)[0]


def any_processes(flags: Sequence[bool], context: DistributedContext) -> tuple[bool, ...]:
    """:func:`any_process` for several flags in one exchange: each true on every process if it
    is true on any."""
    return tuple(value > 0 for value in max_over_processes([int(bool(flag)) for flag in flags], context))


def max_over_processes(values: Sequence[int], context: DistributedContext) -> tuple[int, ...]:
    """Each value's maximum over all processes, in one exchange (the values themselves for a
    single process).

    The flags of :func:`any_processes` are its 0s and 1s; the training loop sends the number of
    the signal that stopped a process beside them, so that every process also agrees on which
    signal it was (and exits with its status). Like :func:`any_process`, a CPU tensor over
    :attr:`DistributedContext.control_group`: no wait for the device.

    Args:
        values: integers in the int32 range, one per quantity; every process sends as many.
        context: this process's place in the run.

    Returns:
        The maxima, in the order of ``values``.
    """
    if not context.is_distributed:
        return tuple(int(value) for value in values)
    tensor = torch.tensor([int(value) for value in values], dtype=torch.int32)  # on the CPU
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=context.control_group)
    return tuple(tensor.tolist())
