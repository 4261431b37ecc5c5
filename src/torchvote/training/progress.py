"""The progress bar and the window of training metrics between two log lines."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from torchvote.files import discard_output
from torchvote.training.distributed import DistributedContext, all_reduce_sum

__all__ = ["LOG_STREAM", "Progress"]


class _LogStream:
    """``sys.stderr`` as a run writes its log lines and its bar there: looked up at each write (so
    that a redirect made after the run started, pytest's capture, is followed), and a reader that
    went away (``torchvote train ... 2>&1 | head -1``) does not stop the run. The checkpoints and
    metrics are the run's record, the log only a view of it: a BrokenPipeError from the next log
    line killed the run and lost the steps since its last checkpoint. Every write of the loop
    goes through here (:meth:`Progress.write`, the bar's redraws, the loop's ``_log``), so the
    broken pipe is handled once."""

    def write(self, text: str) -> int:
        try:
            return sys.stderr.write(text)
        except BrokenPipeError:
            discard_output(sys.stderr)
            return len(text)

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except BrokenPipeError:
            discard_output(sys.stderr)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding ... as tqdm reads them
        return getattr(sys.stderr, name)

    def __eq__(self, other: object) -> bool:
        # tqdm.write clears the bars whose file equals the one written to: a callback's
        # tqdm.write(..., file=sys.stderr) (or stdout's, which tqdm pairs with stderr) must clear
        # this bar too, not land at the end of its line
        return other is self or other is sys.stderr

    __hash__ = object.__hash__


#: The stream of a run's log lines and progress bar: ``sys.stderr``, surviving a reader that left.
LOG_STREAM = _LogStream()


def _interactive() -> bool:
    """Whether someone watches the bar redraw: a terminal, or a notebook (whose stderr is no tty)."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


class Progress:
    """A tqdm bar plus the metric sums of the steps since the last log line.

    Args:
        total: the run's steps.
        initial: steps already done (a resumed run).
        enabled: draw the bar (rank 0 with ``progress=True``).
    """

    def __init__(self, *, total: int, initial: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            initial=initial,
            unit="step",
            dynamic_ncols=True,
            file=LOG_STREAM,  # the same object as the log lines': tqdm.write clears the bar for them
            disable=not enabled,
            leave=True,
            # a log file or CI (no terminal, no notebook) keeps every redraw: one every 30 s, not
            # ten a second (maxinterval too: tqdm's monitor would redraw every 10 s between)
            **({} if _interactive() else {"mininterval": 30.0, "maxinterval": 30.0}),
        )
        self._reset()

    def _reset(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.items = 0
        self.start = time.perf_counter()
        self.paused_seconds = 0.0  # evaluations and checkpoints of the window: not training

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the time spent inside out of the throughput (an evaluation, a checkpoint)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_seconds += time.perf_counter() - start

    def add(self, loss: Tensor, sums: dict[str, Tensor], items: int) -> None:
        """Add one step: its loss, its metric sums (with ``count``), its images / tokens.

        Nothing is read from the device here: the sums stay where the step computed them until
        :meth:`report` or :meth:`window_totals` reads them, once for many steps."""
        count = sums["count"]
        for key, value in {**sums, "loss_sum": loss.float() * count, "loss_count": count}.items():
            self.sums[key] = self.sums.get(key, 0) + value.float()
        self.items += items
        self.bar.update(1)

    def report(self, handler: Any, context: DistributedContext, *, lr: float) -> dict[str, float]:
        """Close the window: its metrics summed over the processes, shown beside the bar; the
        next window starts now.

        Args:
            handler: the task handler (its ``summarize`` and ``unit``).
            context: the data-parallel context.
            lr: the learning rate of the window's last step, for the record.

        Returns:
            The metrics record: ``loss``, ``accuracy``, ``lr`` and ``<unit>_per_second`` (over
            the window's time less what :meth:`paused` left out).
        """
        seconds = time.perf_counter() - self.start - self.paused_seconds  # training steps only
        keys = sorted(self.sums)
        totals = all_reduce_sum(torch.stack([self.sums[k] for k in keys]), context)
        metrics = handler.summarize(dict(zip(keys, totals.tolist(), strict=True)))
        rate = self.items * context.world_size / max(seconds, 1e-9)
        self._reset()
        unit = handler.unit
        self.bar.set_postfix(
            {
                "loss": f"{metrics['loss']:.4f}",
                "acc": f"{100 * metrics['accuracy']:.2f}%",
                f"{unit}/s": f"{rate:,.0f}",
            },
            refresh=False,
        )
        return {
            "loss": metrics["loss"],
            "accuracy": metrics["accuracy"],
            "lr": lr,
            f"{unit}_per_second": rate,
        }

    def window_totals(self, context: DistributedContext) -> dict[str, Tensor]:
        """The sums of the steps since the last report, added up over the processes, on the CPU
        (one all-reduce and one read: call it where the run is about to keep its weights). A
        checkpoint stores them, so that the run resumed from it reports the same next record as
        the unbroken run; :meth:`restore` puts them back.

        Returns:
            ``name -> 0-dim float tensor`` (``loss_sum``, ``loss_count`` and the task's sums);
            empty when no step was added since the last report.
        """
        if not self.sums:
            return {}
        keys = sorted(self.sums)
        totals = all_reduce_sum(torch.stack([self.sums[k] for k in keys]), context).cpu()
        return dict(zip(keys, totals.unbind(), strict=True))

    def restore(self, totals: dict[str, Tensor], device: torch.device) -> None:
        """Start the window with the sums :meth:`window_totals` gave a checkpoint (on one process
        only: the next report adds up the processes). Its images / tokens are not restored: the
        throughput counts the steps of this process since it started."""
        self.sums = {key: value.to(device) for key, value in totals.items()}

    def write(self, message: str) -> None:
        """A line above the bar (on stderr; a reader gone is survived, see :data:`LOG_STREAM`)."""
        self.bar.write(message, file=LOG_STREAM)

    def close(self) -> None:
        """Close the bar (idempotent)."""
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
