"""affNIST-style data: MNIST digits under random affine transforms on a 40x40 canvas.

The affNIST experiment of Sabour et al. 2017 ("Dynamic Routing Between Capsules", sec. 5.2)
trains on MNIST placed at random positions on a 40x40 black canvas (translation only) and tests
on affNIST (Tieleman 2013, https://www.cs.toronto.edu/~tijmen/affNIST/): MNIST test digits under
random affine transforms. The real affNIST files are not reachable offline, so
:func:`make_affnist_style` regenerates a test set with the affNIST ranges: rotation within
+/-20 degrees, shear within +/-0.2, scale 0.8 to 1.2 on each axis independently, and a
translation that keeps the whole digit inside the canvas. Users who have the real files read
them with :func:`load_affnist_mat`.
"""

from __future__ import annotations

from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from torchvote.data.multimnist import bounding_boxes
from torchvote.data.transforms import (
    AffineParams,
    _check_images,
    _check_int,
    apply_affine,
    pad_to,
    sample_affine_params,
    shift_images,
)

__all__ = [
    "AFFNIST_RANGES",
    "load_affnist_mat",
    "make_affnist_style",
    "pad_and_translate_train",
]

#: Ranges of the affNIST transforms (the translation is chosen to keep the digit inside).
AFFNIST_RANGES: dict[str, tuple[float, float]] = {
    "rotation_deg": (-20.0, 20.0),
    "shear": (-0.2, 0.2),
    "scale": (0.8, 1.2),
}


def _check_canvas(images: Tensor, canvas: int) -> None:
    _check_int(canvas, "canvas", minimum=1)
    if canvas < max(images.shape[-2:]):
        raise ValueError(f"canvas: expected at least the image size {max(images.shape[-2:])}, got {canvas}")


def _ink_corners(images: Tensor) -> Tensor:
    """Corners (N, 4, 2) of the support of each digit's ink, in centred (x, y) pixels.

    Bilinear sampling spreads a pixel at centre ``c`` over the open interval ``(c - 1, c + 1)``,
    so the box runs one pixel beyond the outermost inked pixel centres. Images without ink get
    a zero-size box at the centre.
    """
    height, width = images.shape[-2:]
    boxes = bounding_boxes(images[:, 0]).double()  # (N, 4) top, left, bottom, right
    empty = boxes[:, 2] < boxes[:, 0]
    cy, cx = (height - 1) / 2.0, (width - 1) / 2.0
    top, left = boxes[:, 0] - 1 - cy, boxes[:, 1] - 1 - cx
    bottom, right = boxes[:, 2] + 1 - cy, boxes[:, 3] + 1 - cx
    xs = torch.stack([left, right, right, left], dim=1)
    ys = torch.stack([top, top, bottom, bottom], dim=1)
    corners = torch.stack([xs, ys], dim=-1)  # (N, 4, 2)
    return corners.masked_fill(empty[:, None, None], 0.0)


def make_affnist_style(
    images: Tensor, labels: Tensor, *, seed: int, canvas: int = 40
) -> tuple[Tensor, Tensor, AffineParams]:
    """Build an affNIST-style test set from MNIST digits, deterministically given ``seed``.

    Each digit gets a rotation in [-20, 20] degrees, a horizontal shear in [-0.2, 0.2] and
    scales in [0.8, 1.2] for x and y, all uniform (see :class:`~torchvote.data.AffineParams`
    for the order of composition). The translation is then drawn uniformly, per axis, from the
    interval that keeps the whole warped digit (its interpolated ink) inside the canvas; if a
    digit cannot fit, it is centred on that axis.

    Args:
        images: MNIST digits, float tensor (N, 1, 28, 28) in [0, 1] (any H, W <= canvas works).
        labels: Tensor (N,); returned unchanged.
        seed: Seed of the private generator.
        canvas: Side of the square output (affNIST: 40).

    Returns:
        ``(warped, labels, params)``: warped float tensor (N, 1, canvas, canvas) clamped to
        [0, 1], the labels, and the :class:`AffineParams` used (translations in pixels from the
        canvas centre).

    Raises:
        TypeError, ValueError: On malformed images or ``canvas`` smaller than the images.
    """
    _check_images(images, floating=True)
    _check_canvas(images, canvas)
    if not isinstance(labels, Tensor) or labels.shape[:1] != images.shape[:1]:
        raise ValueError(f"labels: expected a tensor with {len(images)} rows")
    generator = torch.Generator().manual_seed(seed)
    num = len(images)
    draw = sample_affine_params(
        num,
        rotation_deg=AFFNIST_RANGES["rotation_deg"],
        shear=AFFNIST_RANGES["shear"],
        scale=AFFNIST_RANGES["scale"],
        generator=generator,
    )
    # Where the warped ink lands before translation, then the admissible translation range.
    corners = _ink_corners(images.detach().cpu())  # (N, 4, 2)
    warped_corners = corners @ draw.linear().transpose(1, 2)  # (N, 4, 2)
    half = canvas / 2.0 + 0.5  # first pixel centre outside the canvas is at +/- half
    low = -half - warped_corners.amin(dim=1)  # (N, 2)
    high = half - warped_corners.amax(dim=1)
    fits = low <= high
    u = torch.rand(num, 2, generator=generator, dtype=torch.float64)
    translation = torch.where(fits, low + u * (high - low), (low + high) / 2)
    params = AffineParams(
        draw.rotation_deg,
        draw.shear,
        draw.scale_x,
        draw.scale_y,
        translation[:, 0],
        translation[:, 1],
    ).to(images.device)
    warped = apply_affine(images, params, canvas).clamp_(0.0, 1.0)
    return warped, labels, params


def pad_and_translate_train(
    images: Tensor, canvas: int = 40, generator: torch.Generator | None = None
) -> Tensor:
    """Place each image at a random whole-pixel position on a larger black canvas.

    The training side of the affNIST experiment (Sabour et al. 2017, sec. 5.2: "each example is
    an MNIST digit placed randomly on a black background of 40x40 pixels"). The offset of the
    28x28 image's top-left corner is uniform over ``{0, ..., canvas - 28}`` on each axis, so
    the whole image, hence the digit, stays inside.

    Args:
        images: Tensor (N, C, H, W).
        canvas: Side of the square output, >= max(H, W).
        generator: Source of randomness.

    Returns:
        Tensor (N, C, canvas, canvas).

    Raises:
        TypeError, ValueError: On malformed images or ``canvas`` smaller than the images.
    """
    _check_images(images)
    _check_canvas(images, canvas)
    height, width = images.shape[-2:]
    draw_device = generator.device if generator is not None else images.device
    spare = torch.tensor([canvas - height, canvas - width], device=draw_device)
    u = torch.rand(len(images), 2, generator=generator, device=draw_device)
    offsets = (u * (spare + 1)).long().clamp(max=spare)  # uniform over {0, ..., spare}
    centred = torch.tensor([(canvas - height) // 2, (canvas - width) // 2], device=draw_device)
    return shift_images(pad_to(images, canvas), (offsets - centred).to(images.device))


def _field(record: Any, name: str, path: Path) -> np.ndarray:
    try:
        value = record[name] if isinstance(record, dict) else getattr(record, name)
    except (KeyError, AttributeError):
        raise ValueError(f"{path}: affNISTdata has no field {name!r}") from None
    return np.asarray(value)


def _read_one_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        from scipy.io import loadmat
    except ImportError as err:
        raise ImportError("load_affnist_mat needs scipy to read MATLAB files: pip install scipy") from err
    contents = loadmat(str(path), simplify_cells=True)
    if "affNISTdata" not in contents:
        keys = sorted(k for k in contents if not k.startswith("__"))
        raise ValueError(f"{path}: no 'affNISTdata' variable (found {keys})")
    record = contents["affNISTdata"]
    pixels = _field(record, "image", path)
    labels = _field(record, "label_int", path).reshape(-1)
    if pixels.ndim == 1:  # a file holding a single image is squeezed to (1600,)
        pixels = pixels[:, None]
    if pixels.ndim != 2 or pixels.shape[0] != 40 * 40:
        raise ValueError(f"{path}: expected 'image' of shape (1600, N), got {pixels.shape}")
    if pixels.shape[1] != len(labels):
        raise ValueError(f"{path}: {pixels.shape[1]} images but {len(labels)} labels in 'label_int'")
    # Each column is one image, stored row by row.
    return pixels.T.reshape(-1, 40, 40), labels


def load_affnist_mat(path: str | PathLike[str]) -> tuple[Tensor, Tensor]:
    """Read real affNIST ``.mat`` files (MATLAB v5, as distributed by Tieleman).

    Each file holds a struct ``affNISTdata`` whose field ``image`` is a (1600, N) uint8 matrix,
    one 40x40 image per column stored row by row, and ``label_int`` holds the N labels. Needs
    the optional dependency ``scipy`` (``scipy.io.loadmat``); it is imported only here.

    Args:
        path: One ``.mat`` file, or a directory whose ``*.mat`` files are read in natural
            order (``1.mat, 2.mat, ..., 32.mat``) and concatenated.

    Returns:
        ``(images, labels)``: float32 (N, 1, 40, 40) in [0, 1] (``uint8 / 255``) and
        int64 (N,).

    Raises:
        ImportError: If scipy is not installed (the message says how to install it).
        FileNotFoundError: If ``path`` does not exist or a directory has no ``.mat`` file.
        ValueError: If a file lacks the affNIST layout.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.mat"), key=lambda p: (len(p.stem), p.stem))
        if not files:
            raise FileNotFoundError(f"no .mat files in {path}")
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"affNIST file or directory not found: {path}")
    parts = [_read_one_mat(file) for file in files]
    pixels = np.concatenate([p for p, _ in parts])
    labels = np.concatenate([y for _, y in parts]).astype(np.int64)
    images = torch.from_numpy(pixels.astype(np.float32) / 255.0).unsqueeze(1)
    return images, torch.from_numpy(labels)
