"""Benchmark: images (or tokens) per second of one training step, ours beside a baseline step.

For each entry of :data:`PAIRS`, two training steps on the same random batch:

- ``ours``: the registered model built by ``create_model(name, preset)``, its registered loss
  (:func:`torchvote.training.make_objective`) and Adam, exactly as ``torchvote train`` runs a step
  (``zero_grad(set_to_none=True)``, forward, loss, backward, step);
- ``baseline``: the same network written the way the popular repositories write it, with its
  own loss and Adam.

Each step is run ``--warmup`` times, then ``--steps`` times interleaved (ours, baseline, ours,
...); the median time per step gives the items per second. A new model gets its line by adding
one :class:`StepPair` to :data:`PAIRS` (the baseline is the part to write by hand).

Run: ``python benchmarks/training.py`` (every pair at batch 128) or ``--quick`` (seconds), or
``torchvote bench training [args]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchvote.config import LossConfig
from torchvote.models import create_model, get_model_spec
from torchvote.training import get_task_handler, make_objective
from torchvote.training.metrics import format_table

#: ``build(batch_size, preset) -> (step, items per step)``: ``step()`` runs one training step.
StepBuilder = Callable[[int, str | None], tuple[Callable[[], None], int]]


@dataclass(frozen=True)
class StepPair:
    """One benchmark line: our step for a registered model and a baseline step beside it."""

    model: str
    preset: str | None
    baseline: StepBuilder
    note: str = ""

    def ours(self, batch_size: int, preset: str | None) -> tuple[Callable[[], None], int]:
        return registry_step(self.model, batch_size, preset)


def registry_step(name: str, batch_size: int, preset: str | None) -> tuple[Callable[[], None], int]:
    """One training step of a registered model, as the training loop runs it."""
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = create_model(name, preset)
    handler = get_task_handler(spec.task)
    batch = handler.example_batch(model.config, batch_size, torch.Generator().manual_seed(0))
    objective = make_objective(LossConfig(), spec, total_steps=1000)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()

    def step() -> None:
        output = handler.forward(model, batch)
        loss, _ = objective(output, batch, 0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step, handler.items(batch)


# --- baselines -----------------------------------------------------------------------------------


class _PopularMnistCNN(nn.Module):
    """The CNN baseline as MNIST example code writes it: sizes typed in, ``view`` to flatten,
    ``log_softmax`` + ``nll_loss``."""

    def __init__(
        self, channels: tuple[int, ...], pool_after: tuple[int, ...], hidden: tuple[int, ...], dropout: float
    ) -> None:
        super().__init__()
        self.convs = nn.ModuleList()
        in_channels, side = 1, 28
        for index, out_channels in enumerate(channels):
            self.convs.append(nn.Conv2d(in_channels, out_channels, 5, padding=2))
            in_channels = out_channels
            if index in pool_after:
                side //= 2
        self.pool_after = pool_after
        self.flat = in_channels * side * side
        self.fcs = nn.ModuleList()
        width = self.flat
        for size in hidden:
            self.fcs.append(nn.Linear(width, size))
            width = size
        self.dropout = dropout
        self.out = nn.Linear(width, 10)

    def forward(self, x: Tensor) -> Tensor:
        for index, conv in enumerate(self.convs):
            x = F.relu(conv(x))
            if index in self.pool_after:
                x = F.max_pool2d(x, 2)
        x = x.view(-1, self.flat)
        for fc in self.fcs:
            x = F.relu(fc(x))
        x = F.dropout(x, self.dropout, training=self.training)
        return F.log_softmax(self.out(x), dim=1)


def cnn_baseline_reference(batch_size: int, preset: str | None) -> tuple[Callable[[], None], int]:
    config = create_model("cnn-baseline", preset).config
    torch.manual_seed(0)
    model = _PopularMnistCNN(config.channels, config.pool_after, config.hidden, config.dropout)
    images = torch.rand(batch_size, 1, 28, 28)
    labels = torch.randint(10, (batch_size,))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()

    def step() -> None:
        optimizer.zero_grad()
        loss = F.nll_loss(model(images), labels)
        loss.backward()
        optimizer.step()

    return step, batch_size


#: The benchmark lines; add one per model (capsnet, efficient-capsnet ... by their engineers).
PAIRS: dict[str, StepPair] = {
    "cnn-baseline": StepPair(
        "cnn-baseline", "small", cnn_baseline_reference, note="same network; shows the loop's overhead"
    ),
}


# --- timing --------------------------------------------------------------------------------------


def time_pair(pair: StepPair, batch_size: int, preset: str | None, warmup: int, steps: int) -> dict:
    ours, items = pair.ours(batch_size, preset)
    baseline, baseline_items = pair.baseline(batch_size, preset)
    for _ in range(warmup):
        ours()
        baseline()
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    for _ in range(steps):
        for label, step in (("ours", ours), ("baseline", baseline)):
            start = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - start)
    ours_rate = items / statistics.median(times["ours"])
    baseline_rate = baseline_items / statistics.median(times["baseline"])
    unit = get_task_handler(get_model_spec(pair.model).task).unit
    return {
        "model": pair.model,
        "preset": preset or "-",
        "batch": batch_size,
        f"ours {unit}/s": round(ours_rate),
        f"baseline {unit}/s": round(baseline_rate),
        "speed-up": f"{ours_rate / baseline_rate:.2f}x",
        "note": pair.note,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(PAIRS), help=f"comma-separated, of: {', '.join(PAIRS)}")
    parser.add_argument("--preset", default=None, help="model preset (default: each pair's own)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--quick", action="store_true", help="batch 16, 3 steps: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.steps, args.warmup = 16, 3, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        parser.error(f"no benchmark pair for {unknown}; pairs: {', '.join(PAIRS)}")
    rows = []
    for name in names:
        pair = PAIRS[name]
        rows.append(time_pair(pair, args.batch_size, args.preset or pair.preset, args.warmup, args.steps))
        print(f"{name}: {rows[-1]['speed-up']}", flush=True)
    print()
    print(format_table(rows))
    print(f"\n{torch.get_num_threads()} threads, torch {torch.__version__}, median of {args.steps} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
