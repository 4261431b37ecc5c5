from __future__ import annotations

import importlib.util
import itertools
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from torchvote.data import (
    AffineParams,
    apply_affine,
    load_affnist_mat,
    make_affnist_style,
    pad_and_translate_train,
    pad_to,
)
from torchvote.data.affnist import AFFNIST_RANGES

HAS_SCIPY = importlib.util.find_spec("scipy") is not None
Affnist = tuple[torch.Tensor, torch.Tensor, AffineParams]


@pytest.fixture(scope="module")
def test_digits(mnist_test: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return mnist_test[0][:500], mnist_test[1][:500]


@pytest.fixture(scope="module")
def affnist(test_digits: tuple[torch.Tensor, torch.Tensor]) -> Affnist:
    return make_affnist_style(*test_digits, seed=0)


def test_shapes_values_and_labels(test_digits: tuple[torch.Tensor, torch.Tensor], affnist: Affnist) -> None:
    warped, labels, params = affnist
    assert warped.shape == (500, 1, 40, 40) and warped.dtype == torch.float32
    assert warped.min() >= 0 and warped.max() <= 1
    assert torch.equal(labels, test_digits[1])
    assert len(params) == 500
    torch.testing.assert_close(warped, apply_affine(test_digits[0], params, 40).clamp(0, 1))


def test_parameters_cover_the_affnist_ranges(affnist: Affnist) -> None:
    params = affnist[2]
    for name, values in [
        ("rotation_deg", params.rotation_deg),
        ("shear", params.shear),
        ("scale", params.scale_x),
        ("scale", params.scale_y),
    ]:
        low, high = AFFNIST_RANGES[name]
        assert low <= values.min() and values.max() <= high
        # uniform over the range: 500 draws come within 5% of both ends
        assert values.min() < low + 0.05 * (high - low)
        assert values.max() > high - 0.05 * (high - low)
    assert params.translate_x.abs().max() > 3 and params.translate_y.abs().max() > 3


def test_every_digit_stays_inside_the_canvas(
    test_digits: tuple[torch.Tensor, torch.Tensor], affnist: Affnist
) -> None:
    """Render the same warps on a 60x60 canvas: nothing may land outside the central 40x40."""
    warped, _, params = affnist
    big = apply_affine(test_digits[0], params, 60)
    outside = big.clone()
    outside[..., 10:50, 10:50] = 0
    assert outside.abs().max() < 1e-4
    torch.testing.assert_close(big[..., 10:50, 10:50].clamp(0, 1), warped)
    # and the translation is not trivially small: many digits reach near the border
    edge_ink = warped[..., [0, 1, -2, -1], :].amax(dim=(1, 2, 3)) > 0.05
    assert edge_ink.any()


def test_deterministic_given_seed(test_digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    images, labels = test_digits[0][:20], test_digits[1][:20]
    first, _, params = make_affnist_style(images, labels, seed=5)
    again, _, params_again = make_affnist_style(images, labels, seed=5)
    other, _, _ = make_affnist_style(images, labels, seed=6)
    assert torch.equal(first, again)
    assert torch.equal(params.rotation_deg, params_again.rotation_deg)
    assert not torch.equal(first, other)


def test_bad_canvas() -> None:
    with pytest.raises(ValueError, match="canvas"):
        make_affnist_style(torch.zeros(2, 1, 28, 28), torch.zeros(2), seed=0, canvas=27)
    with pytest.raises(ValueError, match="canvas"):
        pad_and_translate_train(torch.zeros(2, 1, 28, 28), canvas=20)


# ---------------------------------------------------------------- training side


def test_train_side_places_the_whole_image_inside(
    test_digits: tuple[torch.Tensor, torch.Tensor],
) -> None:
    images = test_digits[0][:200]
    out = pad_and_translate_train(images, 40, torch.Generator().manual_seed(0))
    assert out.shape == (200, 1, 40, 40)
    offsets = []
    for image, placed in zip(images.numpy(), out.numpy(), strict=True):
        found = [
            (top, left)
            for top, left in itertools.product(range(13), repeat=2)
            if np.array_equal(placed[:, top : top + 28, left : left + 28], image)
            and np.count_nonzero(placed) == np.count_nonzero(image)
        ]
        assert found
        offsets += found[:1]
    tops, lefts = zip(*offsets, strict=True)
    assert min(tops) == 0 and max(tops) == 12 and min(lefts) == 0 and max(lefts) == 12
    again = pad_and_translate_train(images, 40, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_train_side_with_canvas_equal_to_image_is_identity() -> None:
    images = torch.rand(3, 1, 28, 28)
    assert torch.equal(pad_and_translate_train(images, 28), images)
    assert pad_to(images, 29).shape == pad_and_translate_train(images, 29).shape


# ---------------------------------------------------------------- real affNIST .mat files


def _affnist_record(images: np.ndarray, labels: np.ndarray) -> dict[str, np.ndarray]:
    """The layout of affNIST files: one 40x40 image per column, stored row by row."""
    return {"image": images.reshape(len(images), 1600).T.copy(), "label_int": labels}


def test_mat_loader_without_scipy_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "scipy", None)
    monkeypatch.setitem(sys.modules, "scipy.io", None)
    path = tmp_path / "test.mat"
    path.write_bytes(b"MATLAB 5.0")
    with pytest.raises(ImportError, match="pip install scipy"):
        load_affnist_mat(path)


def test_mat_loader_layout_with_a_stand_in_loadmat(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """scipy is optional; check our handling of what ``loadmat(..., simplify_cells=True)``
    returns for affNIST files, including the natural order of numbered batch files."""
    rng = np.random.default_rng(0)
    files = {}
    for number in (1, 2, 10):
        images = rng.integers(0, 256, (3, 40, 40), dtype=np.uint8)
        labels = rng.integers(0, 10, 3, dtype=np.uint8)
        files[f"{number}.mat"] = (images, labels)
        (tmp_path / f"{number}.mat").write_bytes(b"stand-in")

    def fake_loadmat(path: str, simplify_cells: bool = False) -> dict[str, object]:
        assert simplify_cells
        return {"__header__": b"", "affNISTdata": _affnist_record(*files[Path(path).name])}

    scipy_io = types.ModuleType("scipy.io")
    scipy_io.loadmat = fake_loadmat  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "scipy", types.ModuleType("scipy"))
    monkeypatch.setitem(sys.modules, "scipy.io", scipy_io)

    images, labels = load_affnist_mat(tmp_path / "2.mat")
    assert images.shape == (3, 1, 40, 40) and images.dtype == torch.float32
    np.testing.assert_array_equal((images[:, 0] * 255).round().numpy(), files["2.mat"][0])
    assert labels.dtype == torch.int64 and labels.tolist() == files["2.mat"][1].tolist()

    images, labels = load_affnist_mat(tmp_path)
    expected = np.concatenate([files[n][0] for n in ("1.mat", "2.mat", "10.mat")])
    np.testing.assert_array_equal((images[:, 0] * 255).round().numpy(), expected)

    files["2.mat"] = (files["2.mat"][0], files["2.mat"][1][:2])
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        load_affnist_mat(tmp_path / "2.mat")


def test_mat_loader_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_affnist_mat(tmp_path / "absent.mat")
    with pytest.raises(FileNotFoundError, match="no .mat files"):
        load_affnist_mat(tmp_path)


@pytest.mark.skipif(not HAS_SCIPY, reason="scipy (optional, for affNIST .mat files) not installed")
def test_mat_loader_reads_a_real_mat_v5_file(tmp_path: Path) -> None:
    from scipy.io import savemat

    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (4, 40, 40), dtype=np.uint8)
    labels = rng.integers(0, 10, 4, dtype=np.uint8)
    savemat(tmp_path / "test.mat", {"affNISTdata": _affnist_record(images, labels)})
    loaded, loaded_labels = load_affnist_mat(tmp_path / "test.mat")
    np.testing.assert_array_equal((loaded[:, 0] * 255).round().numpy(), images)
    assert loaded_labels.tolist() == labels.tolist()
