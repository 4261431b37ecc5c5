"""What the training loop does differently per task: batches in, loss and metrics out.

One :class:`TaskHandler` per registered task (``image-classification``, ``language-model``,
``seq2seq``). The loop only calls these methods, so a new model of an existing task trains
without any change here; see :mod:`torchvote.models.registry` for the conventions a model
follows (config field names, ``forward`` signature, output record).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchvote.models.registry import ClassifierOutput, SequenceOutput
from torchvote.training.data import TaskData, prepare_images

__all__ = [
    "ClassificationHandler",
    "LanguageModelHandler",
    "Objective",
    "RandomShifts",
    "Seq2SeqHandler",
    "TaskHandler",
    "get_task_handler",
    "make_objective",
]


def _check_output(output: Any, expected: type, model: nn.Module) -> None:
    if not isinstance(output, expected):
        raise TypeError(
            f"{type(model).__name__}.forward returned {type(output).__name__}; "
            f"models of this task return torchvote.models.{expected.__name__}"
        )


def _unwrapped(model: nn.Module) -> tuple[nn.Module, str]:
    """The module a ``torch.compile`` (``_orig_mod``) or DDP / DataParallel (``module``) wrapper
    runs, unwrapped to the model itself; and what the wrappers do to a tensor argument:
    ``"keep"``, ``"move"`` (DDP given ``device_ids``, as on GPUs: a CPU tensor would reach the
    model on the GPU) or ``"split"`` (DataParallel over several devices: the batch's rows are
    split between replicas, any other argument copied whole to each)."""
    handling = "keep"
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, nn.DataParallel):
            inner = model.module
            handling = "split" if len(model.device_ids or ()) > 1 else handling
        elif inner is None and isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
            handling = "move" if model.device_ids and handling == "keep" else handling
        if inner is None:
            return model, handling
        model = inner


@functools.cache
def _forward_takes(model_class: type, name: str) -> bool:
    """Whether ``model_class.forward`` has a parameter ``name`` (read once per class)."""
    return name in inspect.signature(model_class.forward).parameters


class TaskHandler:
    """Base class: the per-task parts of the training loop."""

    task: str = ""
    #: the tensors a finalised batch of the task holds (what ``forward`` reads)
    batch_keys: tuple[str, ...] = ()
    #: the model config fields its data fill (``TaskData.fields``, unless an override sets them)
    data_fields: tuple[str, ...] = ()
    unit: str = "items"  # what "per second" counts

    def build(self, name: str, split: str, raw: Any, model_config: Any | None = None) -> TaskData:
        """Turn what ``torchvote.data.get_dataset`` returned into a :class:`TaskData`."""
        raise NotImplementedError

    def finalize(self, data: TaskData, model_config: Any) -> TaskData:
        """Fit the data to the model once its config is known (pad images, cut token windows)."""
        return data

    def forward(self, model: nn.Module, batch: dict[str, Tensor], **host_arguments: Any) -> Any:
        """The model's output on ``batch`` (on the model's device).

        Args:
            model: the model (or its DDP / ``torch.compile`` wrapper).
            batch: the task's tensors, on the model's device.
            **host_arguments: what :meth:`host_arguments` returned for the host copy of the batch,
                passed on to the model's ``forward``.

        Returns:
            The model's output record (a :class:`~torchvote.models.ClassifierOutput` or
            :class:`~torchvote.models.SequenceOutput`).
        """
        raise NotImplementedError

    def host_arguments(self, model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Any]:
        """Keyword arguments of the model's ``forward`` that the loop computes from the batch on
        the host, before the batch moves to the device (so that the model need not read them back
        from an accelerator); passed to :meth:`forward`. None by default.

        Args:
            model: the model (or its DDP / ``torch.compile`` wrapper).
            batch: the batch's host (CPU) copy.

        Returns:
            name -> value, empty for a model that takes none.
        """
        return {}

    def logits_and_targets(self, output: Any, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """What a cross-entropy (and, for image classification, the spread loss) compares:
        ``(logits (..., classes), targets (...))``.

        Raises:
            ValueError: the batch has no single target per prediction.
        """
        raise NotImplementedError

    def ignore_index(self, pad_id: int | None) -> int:
        """The target id a cross-entropy skips (``-100``: none; seq2seq: the padding)."""
        return -100

    def metric_sums(self, output: Any, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Sums over the batch (``correct``, ``count`` ...), added up over batches and processes."""
        raise NotImplementedError

    def loss_units(self, batch: dict[str, Tensor]) -> Tensor | None:
        """How many targets the loss of ``batch`` is a mean over, where that may differ between
        the processes' shares of a global batch (seq2seq: its real target tokens); ``None`` where
        every share has as many (images, LM windows of one length)."""
        return None

    def items(self, batch: dict[str, Tensor]) -> int:
        """How many images / tokens the batch holds (for the throughput). The loop asks before
        the batch moves to the device, so that counting reads nothing back from an accelerator."""
        raise NotImplementedError

    def augment(
        self, data_config: Any, data: TaskData
    ) -> Callable[[dict[str, Tensor], torch.Generator], dict[str, Tensor]] | None:
        """The random augmentation of training batches, or ``None``."""
        return None

    def training_examples(self, model_config: Any) -> str:
        """What one training example is, in words, for messages that count them."""
        return "training examples"

    def example_batch(self, config: Any, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        """A random batch that fits a model config (for the registry sweep and benchmarks)."""
        raise NotImplementedError

    def check_loss(self, loss_name: str, data: TaskData | None = None) -> None:
        """Refuse a loss that does not apply to this task, or (``data`` given) to its targets."""
        if loss_name != "cross-entropy":
            raise ValueError(f"loss {loss_name!r} does not apply to {self.task}; use cross-entropy")

    @staticmethod
    def summarize(sums: dict[str, float]) -> dict[str, float]:
        """Metric sums -> reported metrics (``accuracy`` = ``correct / count``, ...)."""
        count = max(sums.get("count", 0.0), 1.0)
        metrics = {"accuracy": sums.get("correct", 0.0) / count}
        if "loss_sum" in sums:
            metrics["loss"] = sums["loss_sum"] / max(sums.get("loss_count", 1.0), 1.0)
        for key, value in sums.items():
            if key.endswith("_correct"):
                metrics[key[: -len("_correct")] + "_accuracy"] = value / max(
                    sums.get(key[:-8] + "_count", 1.0), 1.0
                )
        metrics["count"] = sums.get("count", 0.0)  # what the accuracy counts: images or tokens
        metrics["examples"] = sums.get("examples", metrics["count"])  # images or sequences
        return metrics


_ONE_LABEL = (
    "cross-entropy and the spread loss take one label per image, got targets of shape {shape}; "
    "use loss.name=margin for MultiMNIST's label sets"
)


@dataclass(frozen=True)
class RandomShifts:
    """Shift each image of a batch by a random whole number of pixels, up to ``max_shift`` in each
    direction (Sabour et al. 2017, sec. 5: "shifted by up to 2 pixels"), each of its digits
    (MultiMNIST's ``digits``) with it. A module-level class, not a closure, so that
    ``DataLoader`` workers started by ``spawn`` or ``forkserver`` (macOS, Windows, and Linux from
    Python 3.14) can be given it: they receive their dataset, this included, pickled.

    Args:
        max_shift: the largest shift in pixels, at least 1.
    """

    max_shift: int
    #: :meth:`__call__` takes ``rows`` and ``total``: the batch loader passes a process's rows only
    takes_rows = True

    def __call__(
        self,
        batch: dict[str, Tensor],
        generator: torch.Generator,
        *,
        rows: slice | None = None,
        total: int | None = None,
    ) -> dict[str, Tensor]:
        """Shift ``batch``; with ``rows`` and ``total``, ``batch`` holds the rows ``rows`` of a
        global batch of ``total`` images, and gets the shifts those rows get in the global batch
        (the draws of all ``total`` are made, in the same order)."""
        from torchvote.data import sample_shifts, shift_images

        images = batch["images"]
        shifts = sample_shifts(len(images) if total is None else total, self.max_shift, generator=generator)
        if rows is not None:
            shifts = shifts[rows]  # (b, 2)
        shifted = {**batch, "images": shift_images(images, shifts)}
        if "digits" in batch:  # each digit moves with its image
            digits = batch["digits"]  # (b, k, c, h, w)
            per_digit = shifts.repeat_interleave(digits.shape[1], dim=0)  # (b * k, 2)
            shifted["digits"] = shift_images(digits.flatten(0, 1), per_digit).unflatten(0, digits.shape[:2])
        return shifted


class ClassificationHandler(TaskHandler):
    """Images in, class scores out. Single labels ``(n,)`` or several per image ``(n, k)``
    (MultiMNIST: two distinct digits; accuracy counts an image as right when the top-k classes
    are exactly its labels). A data set that also gives each digit alone, ``(n, k, c, h, w)``
    (MultiMNIST), passes them on as ``batch["digits"]``: the reconstruction targets."""

    task = "image-classification"
    batch_keys = ("images", "targets")
    data_fields = ("image_size", "in_channels", "num_classes")
    unit = "img"

    def build(self, name: str, split: str, raw: Any, model_config: Any | None = None) -> TaskData:
        images = raw[0] if isinstance(raw, tuple) and len(raw) >= 2 else None
        if not isinstance(images, Tensor) or images.dim() != 4:
            shape = f" (it gives {tuple(images.shape)})" if isinstance(images, Tensor) else ""
            raise ValueError(
                f"data set {name!r} does not give (images (n, c, h, w), labels){shape}; "
                "image classifiers need an image data set"
            )
        labels = raw[1]
        tensors = {"images": images.float(), "targets": labels.long()}
        if len(raw) >= 3 and isinstance(raw[2], Tensor) and raw[2].dim() == 5:
            tensors["digits"] = raw[2].float()
        # Digit sets have 10 classes even when a small subset happens to miss the last ones.
        num_classes = max(int(labels.max()) + 1 if labels.numel() else 0, 10)
        height, width = images.shape[-2:]
        fields = {
            "image_size": max(height, width),
            "in_channels": images.shape[1],
            "num_classes": num_classes,
        }
        return TaskData(name, split, tensors, fields)

    def finalize(self, data: TaskData, model_config: Any) -> TaskData:
        tensors = dict(data.tensors)
        tensors["images"] = prepare_images(tensors["images"], model_config.image_size)
        if "digits" in tensors:  # (n, k, c, h, w): centred like the images
            digits = tensors["digits"]
            padded = prepare_images(digits.flatten(0, 1), model_config.image_size)
            tensors["digits"] = padded.unflatten(0, digits.shape[:2])
        if tensors["images"].shape[1] != model_config.in_channels:
            raise ValueError(
                f"the model takes {model_config.in_channels}-channel images, {data.name} has "
                f"{tensors['images'].shape[1]}"
            )
        if int(tensors["targets"].max()) >= model_config.num_classes:
            raise ValueError(
                f"{data.name} has labels up to {int(tensors['targets'].max())}, "
                f"the model has {model_config.num_classes} classes"
            )
        return TaskData(data.name, data.split, tensors, data.fields, data.extras)

    def augment(
        self, data_config: Any, data: TaskData
    ) -> Callable[[dict[str, Tensor], torch.Generator], dict[str, Tensor]] | None:
        """Random whole-pixel shifts: up to ``data.shift`` pixels (the CapsNet augmentation), or,
        with ``data.canvas``, a random placement on the canvas (the affNIST training recipe, Sabour
        et al. 2017 sec. 5.2: "placed randomly on a black background"). The images arrive
        centred on the model's input, so a placement anywhere on a canvas ``c`` for an ``s``-pixel
        image is a shift of up to ``(c - s) // 2`` pixels, which holds every smaller shift; the
        two were added before, and 0.7% of the digits lost ink past the canvas's edge."""
        max_shift = data_config.shift
        if data_config.canvas is not None:
            max_shift = max(max_shift, (data_config.canvas - data.fields["image_size"]) // 2)
        if max_shift == 0:
            return None
        return RandomShifts(max_shift)

    def forward(self, model: nn.Module, batch: dict[str, Tensor]) -> ClassifierOutput:
        output = model(batch["images"], batch["targets"] if model.training else None)
        _check_output(output, ClassifierOutput, model)
        return output

    def logits_and_targets(self, output: ClassifierOutput, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        targets = batch["targets"]
        if targets.dim() != 1:  # what cross-entropy and the spread loss both need
            raise ValueError(_ONE_LABEL.format(shape=tuple(targets.shape)))
        return output.scores, targets

    def metric_sums(self, output: ClassifierOutput, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        targets = batch["targets"]
        scores = output.scores.detach()
        if targets.dim() == 1:
            correct = (scores.argmax(dim=-1) == targets).sum()
        else:  # several labels per image: the top-k classes must be exactly the labels
            k = targets.shape[1]
            predicted = scores.topk(k, dim=-1).indices.sort(dim=-1).values
            correct = (predicted == targets.sort(dim=-1).values).all(dim=-1).sum()
        # Counts are filled on the device: torch.tensor(n, device=cuda) copies from the host and
        # waits for the stream, once per training step.
        count = torch.full((), float(len(targets)), device=scores.device)
        return {"correct": correct.float(), "count": count}

    def items(self, batch: dict[str, Tensor]) -> int:
        return len(batch["images"])

    def check_loss(self, loss_name: str, data: TaskData | None = None) -> None:
        # every loss applies to images; a label set per image (MultiMNIST) only to the margin loss
        targets = None if data is None else data.tensors.get("targets")
        if loss_name != "margin" and targets is not None and targets.dim() != 1:
            raise ValueError(_ONE_LABEL.format(shape=tuple(targets.shape)))

    def example_batch(self, config: Any, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        images = torch.rand(
            batch_size, config.in_channels, config.image_size, config.image_size, generator=generator
        )
        targets = torch.randint(config.num_classes, (batch_size,), generator=generator)
        return {"images": images, "targets": targets}


class LanguageModelHandler(TaskHandler):
    """A token stream cut into windows of ``context_length + 1``; predict every next token.

    Besides the accuracy, ``bits_per_char``: the mean negative log2-likelihood of the next token
    (the tokens are characters, :class:`~torchvote.data.CharVocab`), the figure character LMs are
    compared by. It is the model's own likelihood, in fp32, whatever the loss's label smoothing,
    so it equals ``loss / ln 2`` only where the loss is the plain cross-entropy.
    """

    task = "language-model"
    batch_keys = ("tokens",)
    data_fields = ("vocab_size",)
    unit = "tok"

    def build(self, name: str, split: str, raw: Any, model_config: Any | None = None) -> TaskData:
        if not isinstance(raw, tuple) or len(raw) != 2 or not isinstance(raw[0], Tensor) or raw[0].dim() != 1:
            raise ValueError(
                f"data set {name!r} does not give (token ids, vocabulary); it is not a text data set"
            )
        tokens, vocab = raw
        return TaskData(name, split, {"stream": tokens.long()}, {"vocab_size": len(vocab)}, {"vocab": vocab})

    def finalize(self, data: TaskData, model_config: Any) -> TaskData:
        stream = data.tensors.get("stream")
        if stream is None:
            return data
        if int(stream.max()) >= model_config.vocab_size:
            raise ValueError(
                f"{data.name} has token ids up to {int(stream.max())}, the model's vocabulary has "
                f"{model_config.vocab_size}"
            )
        length = model_config.context_length
        count = (len(stream) - 1) // length
        if count < 1:
            raise ValueError(
                f"{data.name} ({data.split}) has {len(stream)} characters, fewer than one window of "
                f"{length + 1} (model.context_length + 1)"
            )
        # Consecutive windows share one token, so every token after the first is a target once,
        # but for the last (len - 1) % t, too few for a window: at most t - 1 tokens of the split
        # are never targets (and not in the evaluation's count).
        starts = torch.arange(count) * length
        windows = stream[starts[:, None] + torch.arange(length + 1)]  # (n, t + 1)
        return TaskData(data.name, data.split, {"tokens": windows}, data.fields, data.extras)

    def forward(self, model: nn.Module, batch: dict[str, Tensor]) -> SequenceOutput:
        output = model(batch["tokens"][:, :-1])
        _check_output(output, SequenceOutput, model)
        return output

    def logits_and_targets(self, output: SequenceOutput, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return output.logits, batch["tokens"][:, 1:]  # every next token

    def metric_sums(self, output: SequenceOutput, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        logits, targets = self.logits_and_targets(output, batch)  # (b, t, vocab), (b, t)
        logits = logits.detach()
        correct = (logits.argmax(dim=-1) == targets).sum().float()
        nll = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")  # nats
        return {
            "correct": correct,
            "count": torch.full((), float(targets.numel()), device=targets.device),
            "examples": torch.full((), float(len(targets)), device=targets.device),
            "nll_sum": nll,
        }

    @staticmethod
    def summarize(sums: dict[str, float]) -> dict[str, float]:
        metrics = TaskHandler.summarize(sums)
        if "nll_sum" in sums:  # a window resumed from a checkpoint of an older version has none
            metrics["bits_per_char"] = sums["nll_sum"] / max(sums.get("count", 0.0), 1.0) / math.log(2.0)
        return metrics

    def items(self, batch: dict[str, Tensor]) -> int:
        return batch["tokens"][:, 1:].numel()

    def training_examples(self, model_config: Any) -> str:
        return (
            f"training windows of {model_config.context_length + 1} characters (data.limit counts "
            "characters, not windows)"
        )

    def example_batch(self, config: Any, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        tokens = torch.randint(
            config.vocab_size, (batch_size, config.context_length + 1), generator=generator
        )
        return {"tokens": tokens}


class Seq2SeqHandler(TaskHandler):
    """Padded ``(source, target)`` pairs; the decoder reads ``target[:, :-1]`` and predicts
    ``target[:, 1:]``. Padding (``pad_id``) counts neither in the loss nor in the accuracy;
    ``sequence_accuracy`` counts targets predicted entirely right."""

    task = "seq2seq"
    batch_keys = ("source", "target")
    data_fields = ("src_vocab_size", "tgt_vocab_size", "pad_id", "max_len")
    unit = "tok"

    def build(self, name: str, split: str, raw: Any, model_config: Any | None = None) -> TaskData:
        if (
            not isinstance(raw, tuple)
            or len(raw) != 2
            or not all(isinstance(t, Tensor) and t.dim() == 2 for t in raw)
        ):
            raise ValueError(f"data set {name!r} does not give padded (source, target) ids")
        source, target = raw
        vocab = int(max(source.max(), target.max())) + 1
        try:
            from torchvote.data import PAD, SEQ_SYMBOLS

            vocab, pad_id = max(vocab, len(SEQ_SYMBOLS)), PAD
        except ImportError:  # pragma: no cover
            pad_id = 0
        fields = {
            "src_vocab_size": vocab,
            "tgt_vocab_size": vocab,
            "pad_id": pad_id,
            "max_len": max(source.shape[1], target.shape[1]),
        }
        return TaskData(name, split, {"source": source.long(), "target": target.long()}, fields)

    def finalize(self, data: TaskData, model_config: Any) -> TaskData:
        max_len = getattr(model_config, "max_len", None)
        widths = (data.tensors["source"].shape[1], data.tensors["target"].shape[1])
        if max_len is not None and max(widths) > max_len:
            raise ValueError(
                f"{data.name} has sequences of {max(widths)} tokens, the model takes at most "
                f"max_len={max_len}; generate shorter ones (data.options.max_len=N when training, "
                "--data-option max_len=N for torchvote evaluate)"
            )
        for key, field in (("source", "src_vocab_size"), ("target", "tgt_vocab_size")):
            largest = int(data.tensors[key].max())
            if largest >= getattr(model_config, field):
                raise ValueError(
                    f"{data.name} has {key} token ids up to {largest}, the model's {field} is "
                    f"{getattr(model_config, field)}"
                )
        return data

    def forward(self, model: nn.Module, batch: dict[str, Tensor], **host_arguments: Any) -> SequenceOutput:
        output = model(batch["source"], batch["target"][:, :-1], **host_arguments)
        _check_output(output, SequenceOutput, model)
        return output

    def host_arguments(self, model: nn.Module, batch: dict[str, Tensor]) -> dict[str, Any]:
        """``source_lengths`` ``(b,)`` (each source's tokens, not the model's ``pad_id``, counted
        on the host copy) for a model whose ``forward`` takes them (``rnn-attention-seq2seq``:
        its packing needs them on the CPU, and counted on a GPU they are read back at every
        step); nothing for the others (``transformer-seq2seq``), nor for a source already on an
        accelerator (the model counts it then), nor through a DataParallel over several devices
        (it would hand every replica the whole batch's lengths). A NumPy array where ``model`` is
        a DDP wrapper that moves its tensor arguments to its GPU (a list would make
        ``torch.compile`` guard on its values and compile again for every batch), a ``(b,)`` CPU
        tensor otherwise."""
        module, handling = _unwrapped(model)
        if (
            handling == "split"
            or batch["source"].device.type != "cpu"
            or not _forward_takes(type(module), "source_lengths")
        ):
            return {}
        lengths = (batch["source"] != module.config.pad_id).sum(dim=1)  # (b,) on the CPU
        return {"source_lengths": lengths.numpy() if handling == "move" else lengths}

    @staticmethod
    def _pad_id(batch: dict[str, Tensor]) -> int:
        return int(batch["pad_id"]) if "pad_id" in batch else 0

    def logits_and_targets(self, output: SequenceOutput, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        return output.logits, batch["target"][:, 1:]  # the decoder read target[:, :-1]

    def ignore_index(self, pad_id: int | None) -> int:
        return pad_id if pad_id is not None else -100

    def loss_units(self, batch: dict[str, Tensor]) -> Tensor:
        return (batch["target"][:, 1:] != self._pad_id(batch)).sum()  # () the loss's tokens

    def metric_sums(self, output: SequenceOutput, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """Token accuracy and exact match, teacher-forced, with the prediction chosen as greedy
        decoding chooses it (never ``<pad>`` nor the row's ``<bos>``, ``target[:, 0]``): a target
        is all right here exactly when greedy decoding reproduces it."""
        logits, targets = self.logits_and_targets(output, batch)  # (b, t, vocab), (b, t)
        pad = self._pad_id(batch)
        real = targets != pad
        never = torch.cat([torch.full_like(targets[:, :1], pad), batch["target"][:, :1]], dim=1)  # (b, 2)
        scores = logits.detach().scatter(-1, never[:, None, :].expand(-1, targets.shape[1], -1), -math.inf)
        right = (scores.argmax(dim=-1) == targets) & real
        return {
            "correct": right.sum().float(),
            "count": real.sum().float(),
            "sequence_correct": (right | ~real).all(dim=-1).sum().float(),
            "sequence_count": torch.full((), float(len(targets)), device=targets.device),
            "examples": torch.full((), float(len(targets)), device=targets.device),
        }

    def items(self, batch: dict[str, Tensor]) -> int:
        return int(self.loss_units(batch))  # the real target tokens, counted on the host copy

    def example_batch(self, config: Any, batch_size: int, generator: torch.Generator) -> dict[str, Tensor]:
        length = min(getattr(config, "max_len", 8), 8)
        pad = getattr(config, "pad_id", 0)
        source = torch.randint(pad + 1, config.src_vocab_size, (batch_size, length), generator=generator)
        target = torch.randint(pad + 1, config.tgt_vocab_size, (batch_size, length), generator=generator)
        return {"source": source, "target": target}


_HANDLERS: dict[str, TaskHandler] = {
    handler.task: handler for handler in (ClassificationHandler(), LanguageModelHandler(), Seq2SeqHandler())
}


def get_task_handler(task: str) -> TaskHandler:
    """The training loop's handler of a model task.

    Args:
        task: ``"image-classification"``, ``"seq2seq"`` or ``"language-model"``.

    Returns:
        The task's :class:`TaskHandler` (one shared instance per task).

    Raises:
        ValueError: a task with no handler; the message lists those there are.
    """
    try:
        return _HANDLERS[task]
    except KeyError:
        raise ValueError(f"no training support for task {task!r}; tasks: {', '.join(_HANDLERS)}") from None


# The objectives build on the handlers; imported last (they look a handler up by task).
from torchvote.training.objectives import Objective, make_objective  # noqa: E402
