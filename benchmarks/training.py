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
``torchvote bench training [args]``. ``--device cpu|cuda|cuda:<index>`` (default: cuda if there is
one; on CUDA each step is timed between ``torch.cuda.synchronize()`` calls), ``--dtype bfloat16`` runs the
forward pass and loss of both steps under ``torch.autocast`` (as ``bf16=true`` trains; ``float16``
also scales the loss through a ``torch.amp.GradScaler``, as ``fp16=true``), and
``--compile`` times our model under ``torch.compile`` (as ``compile=true`` trains).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from _common import (
    add_batch_size_argument,
    add_device_argument,
    benchmark_parser,
    chosen_device,
    parse_with_quick,
    positive_int,
    synchronize,
)
from torchvote.models import build_config, create_model, get_model_spec
from torchvote.training import get_task_handler, make_objective
from torchvote.training.config import LossConfig
from torchvote.training.evaluation import autocast
from torchvote.training.metrics import format_table


@dataclass(frozen=True)
class Setting:
    """Where and how a step runs: the device, bfloat16 or float16 autocast or neither, our model
    compiled or not."""

    device: torch.device
    bf16: bool = False
    compile: bool = False
    fp16: bool = False

    def autocast(self) -> AbstractContextManager:
        return autocast(self.device, self.bf16, self.fp16)

    def scaler(self) -> torch.amp.GradScaler:
        """A step's gradient scaler: float16's (as ``fp16=true`` trains), disabled otherwise."""
        return torch.amp.GradScaler(self.device.type, enabled=self.fp16)

    @staticmethod
    def backward_and_step(
        loss: Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
    ) -> None:
        """Backward and the optimiser's step through ``scaler`` (each call the plain one when it
        is disabled)."""
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()


#: ``build(batch_size, preset, setting) -> (step, items per step)``: ``step()`` runs one training step.
StepBuilder = Callable[[int, str | None, Setting], tuple[Callable[[], None], int]]


@dataclass(frozen=True)
class StepPair:
    """One benchmark line: our step for a registered model and a baseline step beside it."""

    model: str
    preset: str | None
    baseline: StepBuilder
    note: str = ""

    def ours(self, batch_size: int, preset: str | None, setting: Setting) -> tuple[Callable[[], None], int]:
        return registry_step(self.model, batch_size, preset, setting)


def registry_step(
    name: str, batch_size: int, preset: str | None, setting: Setting
) -> tuple[Callable[[], None], int]:
    """One training step of a registered model, as the training loop runs it."""
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = create_model(name, preset).to(setting.device)
    handler = get_task_handler(spec.task)
    batch = handler.example_batch(model.config, batch_size, torch.Generator().manual_seed(0))
    host_arguments = handler.host_arguments(model, batch)  # counted on the host, as the loop does
    batch = {key: value.to(setting.device) for key, value in batch.items()}
    objective = make_objective(LossConfig(), spec, total_steps=1000)
    optimizer, scaler = torch.optim.Adam(model.parameters(), lr=1e-3), setting.scaler()
    model.train()
    forward = torch.compile(model) if setting.compile else model

    def step() -> None:
        with setting.autocast():
            output = handler.forward(forward, batch, **host_arguments)
            loss, _ = objective(output, batch, 0)
        optimizer.zero_grad(set_to_none=True)
        setting.backward_and_step(loss, optimizer, scaler)

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


def cnn_baseline_reference(
    batch_size: int, preset: str | None, setting: Setting
) -> tuple[Callable[[], None], int]:
    config = create_model("cnn-baseline", preset).config
    torch.manual_seed(0)
    model = _PopularMnistCNN(config.channels, config.pool_after, config.hidden, config.dropout)
    model.to(setting.device)
    images = torch.rand(batch_size, 1, 28, 28).to(setting.device)
    labels = torch.randint(10, (batch_size,)).to(setting.device)
    optimizer, scaler = torch.optim.Adam(model.parameters(), lr=1e-3), setting.scaler()
    model.train()

    def step() -> None:
        optimizer.zero_grad()
        with setting.autocast():
            loss = F.nll_loss(model(images).float(), labels)
        setting.backward_and_step(loss, optimizer, scaler)

    return step, batch_size


def _popular_squash(s: Tensor, dim: int = -1) -> Tensor:
    squared_norm = (s**2).sum(dim=dim, keepdim=True)
    return squared_norm * s / ((1.0 + squared_norm) * torch.sqrt(squared_norm + 1e-8))


class _PopularCapsNet(nn.Module):
    """CapsNet as the most used PyTorch repositories write it (sizes from our config):

    primary capsules as a ``ModuleList`` of ``primary_dim`` convolutions of ``primary_types``
    channels each, stacked; digit capsules that repeat ``W`` over the batch (``torch.cat([W] *
    batch)``) and the inputs over the classes, ``u_hat = torch.matmul(W, x)``, a Python loop of
    routing iterations with the softmax over the classes (the correct axis) and per-example
    logits; lengths, an identity-matrix mask, the same decoder; margin loss and a summed MSE.
    """

    def __init__(self, config, *, one_primary_conv: bool = False) -> None:
        super().__init__()
        c = config
        self.num_classes, self.iterations, self.in_caps = c.num_classes, c.iterations, c.num_primary_caps
        self.conv1 = nn.Conv2d(c.in_channels, c.conv_channels, c.conv_kernel)
        # The popular repositories: one convolution per capsule dimension. With one_primary_conv,
        # a single convolution of all the channels instead (as ours), to isolate the capsule layer.
        self.primary_dim = c.primary_dim
        self.capsules = nn.ModuleList(
            [
                nn.Conv2d(
                    c.conv_channels,
                    c.primary_types * (c.primary_dim if one_primary_conv else 1),
                    c.primary_kernel,
                    stride=c.primary_stride,
                )
                for _ in range(1 if one_primary_conv else c.primary_dim)
            ]
        )
        self.W = nn.Parameter(0.01 * torch.randn(1, self.in_caps, c.num_classes, c.class_dim, c.primary_dim))
        layers: list[nn.Module] = []
        width = c.num_classes * c.class_dim
        for units in c.decoder_hidden:
            layers += [nn.Linear(width, units), nn.ReLU(inplace=True)]
            width = units
        layers += [nn.Linear(width, c.in_channels * c.image_size**2), nn.Sigmoid()]
        self.decoder = nn.Sequential(*layers)

    def forward(self, images: Tensor, labels_one_hot: Tensor) -> tuple[Tensor, Tensor]:
        batch = images.size(0)
        x = F.relu(self.conv1(images))
        u = torch.cat([capsule(x) for capsule in self.capsules], dim=1)  # (b, 8*32, 6, 6)
        u = _popular_squash(u.view(batch, self.primary_dim, -1).transpose(1, 2))  # (b, 1152, 8)
        x = torch.stack([u] * self.num_classes, dim=2).unsqueeze(4)  # (b, 1152, 10, 8, 1)
        W = torch.cat([self.W] * batch, dim=0)  # (b, 1152, 10, 16, 8)
        u_hat = torch.matmul(W, x)  # (b, 1152, 10, 16, 1)
        b_ij = torch.zeros(batch, self.in_caps, self.num_classes, 1, device=u_hat.device)
        for iteration in range(self.iterations):
            c_ij = F.softmax(b_ij, dim=2).unsqueeze(4)  # (b, 1152, 10, 1, 1): over the classes
            s_j = (c_ij * u_hat).sum(dim=1, keepdim=True)  # (b, 1, 10, 16, 1)
            v_j = _popular_squash(s_j, dim=3)
            if iteration < self.iterations - 1:
                a_ij = torch.matmul(u_hat.transpose(3, 4), torch.cat([v_j] * self.in_caps, dim=1))
                b_ij = b_ij + a_ij.squeeze(4)
        v = v_j.squeeze(1).squeeze(-1)  # (b, 10, 16)
        lengths = (v**2).sum(dim=-1) ** 0.5
        reconstructions = self.decoder((v * labels_one_hot[:, :, None]).view(batch, -1))
        return lengths, reconstructions


def _popular_capsule_loss(lengths: Tensor, labels: Tensor, images: Tensor, reconstructions: Tensor) -> Tensor:
    left = F.relu(0.9 - lengths) ** 2
    right = F.relu(lengths - 0.1) ** 2
    margin = (labels * left + 0.5 * (1.0 - labels) * right).sum()
    reconstruction = F.mse_loss(reconstructions, images.view(images.size(0), -1), reduction="sum")
    return (margin + 0.0005 * reconstruction) / images.size(0)


def _popular_step(model: nn.Module, batch_size: int, image_size: int, setting: Setting) -> Callable[[], None]:
    model.to(setting.device)
    images = torch.rand(batch_size, 1, image_size, image_size).to(setting.device)
    labels = torch.eye(10).index_select(dim=0, index=torch.randint(10, (batch_size,))).to(setting.device)
    optimizer, scaler = torch.optim.Adam(model.parameters(), lr=1e-3), setting.scaler()
    model.train()

    def step() -> None:
        optimizer.zero_grad()
        with setting.autocast():
            lengths, reconstructions = model(images, labels)
            loss = _popular_capsule_loss(lengths.float(), labels, images, reconstructions.float())
        setting.backward_and_step(loss, optimizer, scaler)

    return step


def capsnet_reference(
    batch_size: int, preset: str | None, setting: Setting
) -> tuple[Callable[[], None], int]:
    config = create_model("capsnet", preset).config
    torch.manual_seed(0)
    return _popular_step(_PopularCapsNet(config), batch_size, config.image_size, setting), batch_size


def capsnet_one_conv_reference(
    batch_size: int, preset: str | None, setting: Setting
) -> tuple[Callable[[], None], int]:
    config = create_model("capsnet", preset).config
    torch.manual_seed(0)
    model = _PopularCapsNet(config, one_primary_conv=True)
    return _popular_step(model, batch_size, config.image_size, setting), batch_size


class _PopularEfficientCapsNet(nn.Module):
    """Efficient-CapsNet as the PyTorch ports of the authors' Keras code write it: the same
    convolutions and batch norms (NCHW), the depthwise primary capsules as a grouped
    ``nn.Conv2d``, the efficient squash ``(1 - 1 / (exp(n) + eps)) x / (n + eps)``, the class
    layer's votes from ``W`` repeated over the batch and ``torch.matmul``, self-attention routing
    ``softmax(u u^T row sums / sqrt(d))`` over the classes plus the log prior, the same decoder."""

    def __init__(self, config) -> None:
        super().__init__()
        c = config
        layers: list[nn.Module] = []
        in_channels = c.in_channels
        for channels, kernel, stride in zip(c.conv_channels, c.conv_kernels, c.conv_strides, strict=True):
            layers += [
                nn.Conv2d(in_channels, channels, kernel, stride=stride),
                nn.ReLU(),
                nn.BatchNorm2d(channels),
            ]
            in_channels = channels
        self.convs = nn.Sequential(*layers)
        self.depthwise = nn.Conv2d(in_channels, in_channels, c.depthwise_kernel, groups=in_channels)
        self.primary_types, self.primary_dim, self.class_dim = c.primary_types, c.primary_dim, c.class_dim
        self.in_caps, self.num_classes = c.num_primary_caps, c.num_classes
        self.W = nn.Parameter(0.04 * torch.randn(1, c.num_classes, self.in_caps, c.class_dim, c.primary_dim))
        self.b = nn.Parameter(torch.zeros(c.num_classes, self.in_caps, 1))
        layers = []
        width = c.num_classes * c.class_dim
        for units in c.decoder_hidden:
            layers += [nn.Linear(width, units), nn.ReLU(inplace=True)]
            width = units
        layers += [nn.Linear(width, c.in_channels * c.image_size**2), nn.Sigmoid()]
        self.decoder = nn.Sequential(*layers)

    @staticmethod
    def squash(x: Tensor, eps: float = 1e-21) -> Tensor:
        n = torch.norm(x, dim=-1, keepdim=True)
        return (1 - 1 / (torch.exp(n) + eps)) * (x / (n + eps))

    def forward(self, images: Tensor, labels_one_hot: Tensor) -> tuple[Tensor, Tensor]:
        batch = images.size(0)
        x = self.depthwise(self.convs(images))  # (b, 128, 1, 1)
        u = self.squash(x.view(batch, self.primary_types, self.primary_dim))  # (b, 16, 8)
        x = torch.stack([u] * self.num_classes, dim=1).unsqueeze(4)  # (b, 10, 16, 8, 1)
        W = torch.cat([self.W] * batch, dim=0)  # (b, 10, 16, 16, 8)
        u_hat = torch.matmul(W, x).squeeze(4)  # (b, 10, 16, 16)
        c = torch.einsum("...ij,...kj->...i", u_hat, u_hat)[..., None] / self.class_dim**0.5  # (b, 10, 16, 1)
        c = F.softmax(c, dim=1) + self.b
        v = self.squash((u_hat * c).sum(dim=-2))  # (b, 10, 16)
        lengths = torch.sqrt((v**2).sum(dim=-1) + 1e-8)
        reconstructions = self.decoder((v * labels_one_hot[:, :, None]).view(batch, -1))
        return lengths, reconstructions


def efficient_capsnet_reference(
    batch_size: int, preset: str | None, setting: Setting
) -> tuple[Callable[[], None], int]:
    config = create_model("efficient-capsnet", preset).config
    torch.manual_seed(0)
    model = _PopularEfficientCapsNet(config)
    return _popular_step(model, batch_size, config.image_size, setting), batch_size


#: The benchmark lines; add one per model (capsnet, efficient-capsnet ... by their engineers).
PAIRS: dict[str, StepPair] = {
    "cnn-baseline": StepPair(
        "cnn-baseline", "small", cnn_baseline_reference, note="same network; shows the loop's overhead"
    ),
    "capsnet": StepPair(
        "capsnet",
        "paper",
        capsnet_reference,
        note="baseline: 8 primary convs, W repeated over the batch, matmul votes, loop",
    ),
    "capsnet-one-conv": StepPair(
        "capsnet",
        "paper",
        capsnet_one_conv_reference,
        note="the same baseline with one primary conv: the capsule layer's share",
    ),
    "capsnet-small": StepPair(
        "capsnet",
        "small",
        capsnet_reference,
        note="the small preset; same baseline style",
    ),
    "efficient-capsnet": StepPair(
        "efficient-capsnet",
        "paper",
        efficient_capsnet_reference,
        note="baseline: grouped depthwise conv, NCHW, W repeated over the batch",
    ),
}


# --- timing --------------------------------------------------------------------------------------


def time_pair(
    pair: StepPair, batch_size: int, preset: str | None, warmup: int, steps: int, setting: Setting
) -> dict:
    ours, items = pair.ours(batch_size, preset, setting)
    baseline, baseline_items = pair.baseline(batch_size, preset, setting)
    for _ in range(warmup):
        ours()
        baseline()
    times: dict[str, list[float]] = {"ours": [], "baseline": []}
    for _ in range(steps):
        for label, step in (("ours", ours), ("baseline", baseline)):
            synchronize(setting.device)
            start = time.perf_counter()
            step()
            synchronize(setting.device)
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


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (``main`` parses ``argv`` with it)."""
    parser = benchmark_parser(__file__, __doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(PAIRS), help=f"comma-separated, of: {', '.join(PAIRS)}")
    parser.add_argument("--preset", default=None, help="model preset (default: each pair's own)")
    add_batch_size_argument(parser, (), several=False, default=128, help="items per training step")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps of each (interleaved)")
    parser.add_argument("--warmup", type=positive_int, default=3,
                        help="untimed steps first (at least one: the first step initialises, or compiles)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--quick", action="store_true",
                        help="batch 16, 3 steps, 1 warm-up: a smoke run (options given beside it are kept)")
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="autocast: bfloat16 runs forward and loss under torch.autocast (bf16=true; "
                             "the model stays float32); float16: the same, gradients through a GradScaler "
                             "(fp16=true)")
    parser.add_argument("--compile", action="store_true", help="torch.compile our model (compile=true)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_with_quick(parser, argv, batch_size=16, steps=3, warmup=1)  # given options are kept
    setting = Setting(chosen_device(parser, args.device), args.dtype == "bfloat16", args.compile,
                      fp16=args.dtype == "float16")
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    if not names:
        parser.error(f"--models: name at least one pair of: {', '.join(PAIRS)}")
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        parser.error(f"no benchmark pair for {unknown}; pairs: {', '.join(PAIRS)}")
    for name in names:  # an unknown --preset is refused here, not after the first pairs ran
        try:
            build_config(PAIRS[name].model, args.preset or PAIRS[name].preset)
        except ValueError as error:
            parser.error(f"--preset: {error}")
    rows = []
    for name in names:
        pair = PAIRS[name]
        preset = args.preset or pair.preset
        timed = time_pair(pair, args.batch_size, preset, args.warmup, args.steps, setting)
        rows.append({"pair": name, **timed})  # the pair's name: two pairs may share model and preset
        print(f"{name}: {rows[-1]['speed-up']}", flush=True)
    print()
    print(format_table(rows))
    threads = f"CPU, {torch.get_num_threads()} threads"
    where = torch.cuda.get_device_name(setting.device) if setting.device.type == "cuda" else threads
    print(f"\n{where}, {args.dtype}{', ours compiled' if args.compile else ''}, torch {torch.__version__}, "
          f"median of {args.steps} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
