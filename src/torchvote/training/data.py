"""From a data set name to deterministic, shardable batches.

Every data set becomes a :class:`TaskData`: a few tensors aligned along their first axis
(``images``/``targets``, ``tokens``, ``source``/``target``) plus the fields a model config takes
from the data (``image_size``, ``num_classes``, ``vocab_size`` ...). The order of the examples is
a function of ``(seed, epoch)`` alone and every augmentation a function of ``(seed, epoch,
step)``; data drawn afresh each epoch (MultiMNIST's training pairs, :class:`DrawnData`) is a
function of ``(seed, epoch)`` too. So:

* a resumed run continues exactly where the killed one stopped (the "sampler state" is just
  ``(seed, epoch, position)``), and
* N data-parallel processes see the same global batches as one process: each builds the global
  batch and keeps its contiguous ``1 / N`` slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from torchvote.validation import check_bool_fields, check_positive_int

__all__ = [
    "BatchPlan",
    "DrawnData",
    "TaskData",
    "build_task_data",
    "derive_seed",
    "iterate_batches",
    "load_raw_dataset",
    "pin_memory_for",
    "prepare_images",
]

# Tags that keep the seeds of different random streams apart.
ORDER_STREAM, AUGMENT_STREAM, STEP_STREAM, DRAW_STREAM = 1, 2, 3, 4


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed from ``seed`` and integers (epoch, step, rank ...), well mixed (numpy's
    ``SeedSequence``), so neighbouring steps get unrelated random streams."""
    words = np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, *parts]).generate_state(2, np.uint32)
    return int(words[0]) | (int(words[1] & 0x7FFFFFFF) << 32)


@dataclass
class TaskData:
    """One split, ready for batching.

    Attributes:
        name: the data set's registry name.
        split: the split.
        tensors: tensors aligned along the first axis.
        fields: values the model config takes from the data (``image_size`` ...).
        extras: other things the data set came with (a ``CharVocab`` ...).
        redraw: for data drawn afresh each epoch, ``redraw(seed)`` gives a new draw of as many
            examples (built, limited and fitted to the model as these were: see :meth:`map`);
            ``None`` for fixed data.
    """

    name: str
    split: str
    tensors: dict[str, Tensor]
    fields: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    redraw: Callable[[int], TaskData] | None = None

    def __post_init__(self) -> None:
        lengths = {key: len(tensor) for key, tensor in self.tensors.items()}
        if not lengths or len(set(lengths.values())) > 1:  # its length was the first tensor's
            raise ValueError(
                f"tensors must be one or more tensors aligned along the first axis, got lengths {lengths}"
            )

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def select(self, indices: Tensor) -> dict[str, Tensor]:
        return {key: tensor[indices] for key, tensor in self.tensors.items()}

    def map(self, transform: Callable[[TaskData], TaskData]) -> TaskData:
        """``transform(self)``; drawn data also transforms each of its later draws the same way."""
        result = transform(self)
        if self.redraw is None:
            return result
        redraw = self.redraw
        return replace(result, redraw=lambda seed: transform(redraw(seed)))

    def for_epoch(self, seed: int, epoch: int) -> TaskData:
        """The examples of ``epoch``: these, or for drawn data a draw seeded from ``(seed, epoch)``."""
        if self.redraw is None:
            return self
        drawn = self.redraw(derive_seed(seed, DRAW_STREAM, epoch))
        assert len(drawn) == len(self) and drawn.redraw is None, "a draw has as many examples, once"
        return drawn


@runtime_checkable
class DrawnData(Protocol):
    """What a data set returns when its examples are drawn afresh from a seed
    (:class:`~torchvote.data.MultiMNISTSource`, the ``multimnist`` training split): ``draw()``
    gives the draw of the data set's own seed, ``draw(seed)`` another one; each draw is what a
    data set of fixed examples returns."""

    def draw(self, seed: int | None = None) -> Any: ...


def build_task_data(handler: Any, name: str, split: str, raw: Any) -> TaskData:
    """``handler.build`` on what a data set returned; for :class:`DrawnData`, on its own draw,
    with :attr:`TaskData.redraw` building the draws of other seeds the same way.

    Args:
        handler: the task's :class:`~torchvote.training.tasks.TaskHandler`.
        name, split: the data set and split.
        raw: what ``torchvote.data.get_dataset`` returned.
    """
    if not isinstance(raw, DrawnData):
        return handler.build(name, split, raw)
    data = handler.build(name, split, raw.draw())
    return replace(data, redraw=lambda seed: handler.build(name, split, raw.draw(seed)))


def load_raw_dataset(
    name: str, split: str | None, *, options: dict[str, Any], root: str | None
) -> tuple[str, Any]:
    """Call ``torchvote.data.get_dataset``; ``split=None`` picks ``test``, else ``val``.

    Returns:
        ``(split, data)``: the split used and what the data set returned.

    Raises:
        ValueError: unknown data set or split (the message lists what exists), an option the
            data set does not take (the message lists those it takes), or a bad option value.
    """
    from torchvote.data import get_dataset

    kwargs = dict(options)
    if root is not None:
        kwargs["root"] = root
    splits = [split] if split is not None else ["test", "val"]
    for index, candidate in enumerate(splits):
        try:
            return candidate, get_dataset(name, candidate, **kwargs)
        except ValueError as err:
            if index + 1 < len(splits) and "split" in str(err):
                continue
            raise
        except TypeError as err:  # an option it does not take, or a value of the wrong type
            message = str(err) if repr(name) in str(err) else f"data set {name!r}: {err}"
            raise ValueError(message) from None
    raise AssertionError("unreachable")


def prepare_images(images: Tensor, image_size: int) -> Tensor:
    """Centre ``(n, c, h, w)`` images on a black ``image_size`` square (the model's input).

    Raises:
        ValueError: images larger than the model's input.
    """
    height, width = images.shape[-2:]
    if height == width == image_size:
        return images
    if height > image_size or width > image_size:
        raise ValueError(
            f"the model takes {image_size}x{image_size} images, the data has {height}x{width}; "
            f"train with data.canvas={max(height, width)} (or a model with image_size={max(height, width)}), "
            f"or generate the data at {image_size}x{image_size} if it takes a canvas "
            f"(e.g. affnist-style:canvas={image_size})"
        )
    from torchvote.data import pad_to

    return pad_to(images, image_size)


@dataclass(frozen=True)
class BatchPlan:
    """Which examples form each global batch, and which slice of it this process takes.

    The last incomplete batch of an epoch is dropped, so every step has exactly ``global_batch``
    examples and every process ``global_batch / world_size``.

    Args:
        num_examples: size of the training split.
        global_batch: examples per step over all processes (the config's ``batch_size``).
        seed: the run's seed; each epoch's order is drawn from ``(seed, epoch)``.
        world_size: number of processes; must divide ``global_batch``.
        rank: this process, ``0 .. world_size - 1``; it takes the ``rank``-th slice of a batch.
        shuffle: draw a new order every epoch; False keeps the examples in order.
        noun: what the examples are, for the message of a batch larger than them (a language
            model's: windows of characters).

    Raises:
        ValueError: ``global_batch`` or ``world_size`` not a positive integer, ``num_examples``
            or ``seed`` not a non-negative integer, ``rank`` not in ``0 .. world_size - 1``,
            ``global_batch`` not divisible by ``world_size``, or larger than ``num_examples`` (no
            full batch).
        TypeError: ``shuffle`` not ``True`` or ``False``.
    """

    num_examples: int
    global_batch: int
    seed: int
    world_size: int = 1
    rank: int = 0
    shuffle: bool = True
    noun: str = "training examples"

    def __post_init__(self) -> None:
        check_positive_int(self.num_examples, "num_examples", minimum=0)
        check_positive_int(self.global_batch, "global_batch")
        check_positive_int(self.seed, "seed", minimum=0)  # the seed streams take no negative seed
        check_positive_int(self.world_size, "world_size")
        check_positive_int(self.rank, "rank", minimum=0)
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank must be in 0 .. world_size - 1 = {self.world_size - 1}, got {self.rank!r}"
            )
        check_bool_fields(self)
        if self.global_batch % self.world_size:
            raise ValueError(
                f"batch_size={self.global_batch} is not divisible by the {self.world_size} processes; "
                "the global batch is split evenly between them"
            )
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"batch_size={self.global_batch} is larger than the {self.num_examples} {self.noun}"
            )

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world_size

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.global_batch

    def epoch_order(self, epoch: int) -> Tensor:
        """The permutation of the examples in ``epoch`` (identity without shuffling).

        Raises:
            ValueError: ``epoch`` not an integer >= 0 (-1 failed inside NumPy's seeding).
        """
        check_positive_int(epoch, "epoch", minimum=0)
        if not self.shuffle:
            return torch.arange(self.num_examples)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, ORDER_STREAM, epoch))
        return torch.randperm(self.num_examples, generator=generator)

    def global_indices(self, order: Tensor, position: int) -> Tensor:
        return order[position * self.global_batch : (position + 1) * self.global_batch]

    def local_slice(self) -> slice:
        return slice(self.rank * self.local_batch, (self.rank + 1) * self.local_batch)


class _EpochBatches(torch.utils.data.Dataset):
    """Map-style view of one epoch: item ``position`` is this process's part of that batch."""

    def __init__(self, data: TaskData, plan: BatchPlan, epoch: int, augment: Any) -> None:
        self.data = data.for_epoch(plan.seed, epoch)  # drawn data: this epoch's draw
        self.plan, self.epoch, self.augment = plan, epoch, augment
        self.order = plan.epoch_order(epoch)

    def __len__(self) -> int:
        return self.plan.steps_per_epoch

    def __getitem__(self, position: int) -> dict[str, Tensor]:
        indices = self.plan.global_indices(self.order, position)
        local = self.plan.local_slice()
        if self.augment is None:
            return self.data.select(indices[local])
        generator = torch.Generator().manual_seed(
            derive_seed(self.plan.seed, AUGMENT_STREAM, self.epoch, position)
        )
        if getattr(self.augment, "takes_rows", False):
            # the draws of the whole global batch, applied to this process's rows only: the same
            # examples as below, with 1 / N of the gathering and shifting on each of N processes
            return self.augment(self.data.select(indices[local]), generator, rows=local, total=len(indices))
        batch = self.augment(self.data.select(indices), generator)  # the global batch: same on 1 or N
        return {key: tensor[local] for key, tensor in batch.items()}


def pin_memory_for(device: torch.device) -> bool:
    """Whether batches bound for ``device`` should come in page-locked ("pinned") host memory.

    Only a copy from pinned memory to a CUDA device runs asynchronously: from ordinary
    (pageable) memory, ``.to(device, non_blocking=True)`` stages the batch through a driver
    buffer while the host waits. On the CPU there is nothing to copy, and pinning would only
    spend memory (without CUDA, PyTorch cannot pin at all). This only decides: it touches no
    device, so it answers for ``cuda`` on a machine without one.

    Args:
        device: the device the training step computes on.

    Returns:
        ``True`` for a CUDA device, ``False`` otherwise.
    """
    return device.type == "cuda"


def iterate_batches(
    data: TaskData,
    plan: BatchPlan,
    epoch: int,
    start: int = 0,
    *,
    augment: Any = None,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[dict[str, Tensor]]:
    """This process's batches of ``epoch`` from position ``start`` on, in order.

    Drawn data (:attr:`TaskData.redraw`) is drawn for the epoch first, from ``(seed, epoch)``.
    ``augment(batch, generator)`` transforms a global batch; its generator is seeded from
    ``(seed, epoch, position)``. With ``num_workers > 0`` batches are assembled in worker
    processes; the result is the same.

    Args:
        data: the training split.
        plan: which examples form each batch, and this process's slice of it.
        epoch: the epoch (its order, its draw and its augmentations).
        start: the first position (a resumed run starts mid-epoch).
        augment: ``augment(batch, generator) -> batch`` on each global batch, or ``None``.
        num_workers: ``DataLoader`` worker processes; 0 assembles the batches in this one.
        pin_memory: put each batch in pinned host memory, for an asynchronous copy to a CUDA
            device (:func:`pin_memory_for` decides); the values are the same.

    Returns:
        An iterator of ``name -> tensor`` batches (this process's ``plan.local_batch`` rows).
    """
    epoch_batches = _EpochBatches(data, plan, epoch, augment)
    positions = range(start, plan.steps_per_epoch)
    if num_workers == 0:
        for position in positions:
            batch = epoch_batches[position]
            yield {key: tensor.pin_memory() for key, tensor in batch.items()} if pin_memory else batch
        return
    # the loader pins in a thread of this process (on the current accelerator, where
    # pin_memory_device is deprecated), while the workers assemble the next batches
    loader = torch.utils.data.DataLoader(
        epoch_batches,
        batch_size=None,
        sampler=list(positions),
        num_workers=num_workers,
        pin_memory=pin_memory,
    )
    yield from loader
