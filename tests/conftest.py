"""Shared fixtures: a tiny MNIST folder of real digits as IDX files, and tiny training runs on it.

Training runs read it through the ordinary ``mnist`` data set (``data.root=...``,
``data.options.source=idx``), so subprocesses (torchrun, signals) start in a blink.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchvote.training.config import TrainConfig, apply_overrides, config_from_dict

TINY_SIZES = {"train": 240, "test": 60}
IDX_NAMES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


@pytest.fixture(scope="session")
def tiny_mnist_root(tmp_path_factory) -> Path:
    """A folder with MNIST IDX files holding 240 train and 60 test real digits."""
    from torchvote.data import load_small_digits, write_idx

    root = tmp_path_factory.mktemp("tiny-mnist")
    for split, size in TINY_SIZES.items():
        images, labels = load_small_digits(split, size=size)
        pixels = (images[:, 0] * 255).round().to(torch.uint8)  # (n, 28, 28)
        write_idx(root / IDX_NAMES[split][0], pixels)
        write_idx(root / IDX_NAMES[split][1], labels.to(torch.uint8))
    return root


def tiny_config_values(root: Path, run_dir: Path, **extra) -> dict:  # used by the fixtures below
    """A few-second run of the tiny CNN on the tiny MNIST folder (as a YAML-like dict)."""
    values = {
        "model": {"name": "cnn-baseline", "preset": "tiny", "dropout": 0.2},
        "data": {"name": "mnist", "root": str(root), "options": {"source": "idx"}, "shift": 2},
        "optim": {"name": "adam", "lr": 0.003, "schedule": "cosine", "warmup_steps": 2},
        "batch_size": 40,
        "eval_batch_size": 50,
        "epochs": 2,
        "log_every": 2,
        "progress": False,
        "tensorboard": False,
        "run_dir": str(run_dir),
        "seed": 3,
    }
    for key, value in extra.items():
        section, _, name = key.partition("__")
        if name:
            values.setdefault(section, {})[name] = value
        else:
            values[key] = value
    return values


@pytest.fixture
def tiny_values(tiny_mnist_root):
    """``tiny_values(run_dir, **extra)`` -> the dict of :func:`tiny_config_values`."""

    def make(run_dir: Path, **extra) -> dict:
        return tiny_config_values(tiny_mnist_root, run_dir, **extra)

    return make


@pytest.fixture
def tiny_config(tiny_mnist_root, tmp_path):
    """``tiny_config(name, *overrides)`` -> a TrainConfig writing to ``tmp_path / name``."""

    def make(name: str = "run", *overrides: str, **extra) -> TrainConfig:
        config = config_from_dict(tiny_config_values(tiny_mnist_root, tmp_path / name, **extra))
        return apply_overrides(config, overrides)

    return make
