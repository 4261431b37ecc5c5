"""Batch image transforms on tensors: integer shifts, centre padding, random affine warps.

Every function takes a batch ``images`` of shape (N, C, H, W) and works on the whole batch at
once (no Python loop over images), on the device of ``images``. Randomness comes only from the
``generator`` argument (or torch's global generator when it is ``None``); random numbers are
drawn on the generator's device and then moved to the images' device, so a CPU generator with a
fixed seed gives the same result on every device.

Coordinates: ``x`` runs right along the width, ``y`` runs down along the height; shifts are
given as (rows, columns) = (down, right).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from torchvote.validation import (
    check_in_range,
    check_integer_tensor,
    check_positive_float,
    check_tensor_values,
    is_integer,
)

__all__ = [
    "AffineParams",
    "affine_matrices",
    "apply_affine",
    "pad_to",
    "random_affine",
    "random_shift",
    "sample_affine_params",
    "sample_shifts",
    "shift_images",
]


# --------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------


def _check_images(images: Tensor, *, floating: bool = False) -> None:
    if not isinstance(images, Tensor):
        raise TypeError(f"images: expected a torch.Tensor, got {type(images).__name__}")
    if images.ndim != 4:
        raise ValueError(f"images: expected shape (N, C, H, W), got {tuple(images.shape)}")
    if floating and not images.is_floating_point():
        raise TypeError(f"images: expected a floating-point tensor, got {images.dtype}")


def _check_int(value: object, name: str, *, minimum: int = 0) -> int:
    if not is_integer(value):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    return int(value)


def _check_generator(generator: object) -> torch.Generator | None:
    """``generator`` if it is a ``torch.Generator`` or ``None`` (not a seed)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator: expected a torch.Generator or None, got {type(generator).__name__} "
            f"(for a seed s, pass torch.Generator().manual_seed(s))"
        )
    return generator


def _size_pair(size: int | Sequence[int], name: str) -> tuple[int, int]:
    if is_integer(size):  # a NumPy integer too, as every other size here takes
        pair: tuple[object, ...] = (size, size)
    elif isinstance(size, Sequence) and not isinstance(size, (str, bytes)):
        pair = tuple(size)
    else:
        raise TypeError(f"{name}: expected an int or (height, width), got {size!r}")
    if len(pair) != 2:
        raise ValueError(f"{name}: expected an int or (height, width), got {size!r}")
    return _check_int(pair[0], name, minimum=1), _check_int(pair[1], name, minimum=1)


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_pair(
    value: object, name: str, expected: str = "a number or a (low, high) pair"
) -> tuple[object, object]:
    """A two-element ``value`` (list, tuple, array) as a tuple; anything else is refused, the
    message saying what ``name`` takes (``expected``)."""
    if isinstance(value, (str, bytes)):
        pair: tuple[object, ...] = ()
    else:
        try:
            pair = tuple(value)  # type: ignore[arg-type]
        except TypeError:
            pair = ()
    if len(pair) != 2:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return pair[0], pair[1]


def _finite(value: object, name: str, low: float = -math.inf, *, include_low: bool = True) -> float:
    """``value`` as a float if it is a finite real number (numpy scalars too) above ``low``."""
    number = float(value) if _is_number(value) else value  # type: ignore[arg-type]
    return check_in_range(number, name, low, include_low=include_low)


def _sym_range(value: float | Sequence[float], name: str) -> tuple[float, float]:
    """``v`` -> ``(-v, v)``; ``(lo, hi)`` -> itself. Checks finiteness and ``lo <= hi``."""
    if _is_number(value):
        bound = _finite(value, name, 0.0)
        return -bound, bound
    first, second = _as_pair(value, name)
    low, high = _finite(first, f"{name}[0]"), _finite(second, f"{name}[1]")
    if low > high:
        raise ValueError(f"{name}: expected low <= high, got ({low}, {high})")
    return low, high


def _scale_range(value: float | Sequence[float]) -> tuple[float, float]:
    if _is_number(value):
        fixed = check_positive_float(float(value), "scale")  # type: ignore[arg-type]
        return fixed, fixed
    first, second = _as_pair(value, "scale")
    low = _finite(first, "scale[0]", 0.0, include_low=False)
    high = _finite(second, "scale[1]", 0.0, include_low=False)
    if low > high:
        raise ValueError(f"scale: expected 0 < low <= high, got ({low}, {high})")
    return low, high


def _uniform(
    num: int,
    low: float,
    high: float,
    generator: torch.Generator | None,
    device: torch.device,
) -> Tensor:
    """``num`` float64 draws from U[low, high], drawn on the generator's device."""
    draw_device = generator.device if generator is not None else device
    u = torch.rand(num, generator=generator, device=draw_device, dtype=torch.float64)
    return (low + (high - low) * u).to(device)


# --------------------------------------------------------------------------------------------
# integer shifts and padding
# --------------------------------------------------------------------------------------------


def sample_shifts(
    num: int,
    max_shift: int,
    *,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """Draw integer shifts uniformly from ``[-max_shift, max_shift]`` for both axes.

    Args:
        num: Number of shift pairs.
        max_shift: Largest absolute shift in pixels, >= 0.
        generator: Source of randomness.
        device: Device of the result (default: CPU).

    Returns:
        int64 tensor of shape (num, 2) holding (rows down, columns right).

    Raises:
        TypeError, ValueError: If ``num`` or ``max_shift`` is not an int >= 0.
        TypeError: If ``generator`` is not a ``torch.Generator`` or ``None``.
    """
    _check_int(num, "num")
    _check_int(max_shift, "max_shift")
    _check_generator(generator)
    device = torch.device("cpu") if device is None else torch.device(device)
    draw_device = generator.device if generator is not None else device
    shifts = torch.randint(-max_shift, max_shift + 1, (num, 2), generator=generator, device=draw_device)
    return shifts.to(device)


def shift_images(images: Tensor, shifts: Tensor) -> Tensor:
    """Translate each image by a whole number of pixels, filling with zeros.

    Equivalent to ``torch.roll(image, (dy, dx), dims=(-2, -1))`` with the wrapped-around pixels
    set to zero, done for the whole batch with one gather.

    Args:
        images: Tensor of shape (N, C, H, W), any dtype.
        shifts: Integer tensor of shape (N, 2): (rows down, columns right) per image.

    Returns:
        Tensor like ``images``.

    Raises:
        TypeError: If ``images`` is not a tensor or ``shifts`` is not an integer tensor.
        ValueError: If the shapes do not match.
    """
    _check_images(images)
    num, channels, height, width = images.shape
    check_integer_tensor(shifts, "shifts", "an integer tensor of shape (N, 2)")  # a bool True moved 1 px
    if shifts.shape != (num, 2):
        raise ValueError(f"shifts: expected shape ({num}, 2), got {tuple(shifts.shape)}")
    if num == 0:
        return images.clone()
    if shifts.device.type == "cpu":  # the largest shift is read where reading is free
        margin = int(shifts.long().abs().max())  # long first: abs of int8's -128 overflows
        if margin < min(height, width):
            return _shift_by_windows(images, shifts.to(device=images.device, dtype=torch.long), margin)
    shifts = shifts.to(device=images.device, dtype=torch.long)
    # Output pixel (r, c) reads input pixel (r - dy, c - dx) when that lies inside the image.
    rows = torch.arange(height, device=images.device) - shifts[:, :1]  # (N, H)
    cols = torch.arange(width, device=images.device) - shifts[:, 1:]  # (N, W)
    inside = ((rows >= 0) & (rows < height))[:, :, None] & ((cols >= 0) & (cols < width))[
        :, None, :
    ]  # (N, H, W)
    source = rows.clamp(0, height - 1)[:, :, None] * width + cols.clamp(0, width - 1)[:, None, :]
    source = source.view(num, 1, height * width).expand(num, channels, height * width)
    out = images.reshape(num, channels, height * width).gather(2, source)  # (N, C, H*W)
    return out.view(num, channels, height, width).masked_fill(~inside[:, None], 0)


def _shift_by_windows(images: Tensor, shifts: Tensor, margin: int) -> Tensor:
    """:func:`shift_images` for shifts of at most ``margin`` pixels: the images padded with
    ``margin`` zeros, and each output the window of the padded image its shift points to (one pad
    and one indexed copy; no index or mask per pixel, 2-3x faster on a CPU)."""
    num, _, height, width = images.shape
    padded = F.pad(images, (margin, margin, margin, margin))  # (N, C, H + 2m, W + 2m)
    windows = padded.unfold(2, height, 1).unfold(3, width, 1)  # (N, C, 2m + 1, 2m + 1, H, W): a view
    rows, cols = margin - shifts[:, 0], margin - shifts[:, 1]  # (N,) each: the window of each image
    picked = windows[torch.arange(num, device=images.device), :, rows, cols]  # (N, C, H, W)
    return picked.contiguous()  # as the gather path's (a channels-last input kept its layout)


def random_shift(images: Tensor, max_shift: int = 2, generator: torch.Generator | None = None) -> Tensor:
    """Shift each image by a random whole number of pixels, with zero padding.

    The CapsNet augmentation (Sabour et al. 2017, "Dynamic Routing Between Capsules", sec. 5:
    "shifted by up to 2 pixels in each direction with zero padding"): each image gets its own
    (dy, dx), each drawn uniformly from ``{-max_shift, ..., max_shift}``.

    Args:
        images: Tensor of shape (N, C, H, W).
        max_shift: Largest shift in pixels along each axis, >= 0.
        generator: Source of randomness.

    Returns:
        Tensor like ``images``.

    Raises:
        TypeError, ValueError: If ``images`` is not (N, C, H, W) or ``max_shift`` is not an
            int >= 0.
        TypeError: If ``generator`` is not a ``torch.Generator`` or ``None``.
    """
    _check_images(images)
    _check_int(max_shift, "max_shift")
    _check_generator(generator)
    shifts = sample_shifts(len(images), max_shift, generator=generator, device=images.device)
    return shift_images(images, shifts)


def pad_to(images: Tensor, size: int | Sequence[int]) -> Tensor:
    """Zero-pad images to ``size``, centred; an odd excess goes to the bottom/right.

    Args:
        images: Tensor of shape (N, C, H, W).
        size: Target ``S`` (square) or ``(height, width)``; each at least the current size.

    Returns:
        Tensor of shape (N, C, height, width).

    Raises:
        TypeError, ValueError: If ``images`` is not (N, C, H, W), or ``size`` is not a positive
            int or a pair of them.
        ValueError: If ``size`` is smaller than the images.
    """
    _check_images(images)
    height, width = _size_pair(size, "size")
    in_h, in_w = images.shape[-2:]
    if height < in_h or width < in_w:
        raise ValueError(f"size: expected at least the image size ({in_h}, {in_w}), got ({height}, {width})")
    top, left = (height - in_h) // 2, (width - in_w) // 2
    return F.pad(images, (left, width - in_w - left, top, height - in_h - top))


# --------------------------------------------------------------------------------------------
# affine warps
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AffineParams:
    """Per-image parameters of an affine warp; every field has shape (N,).

    The forward map (input pixel -> output pixel, both measured from the image centre, ``x``
    right, ``y`` down) is ``p_out = R(rotation) @ Shear(shear) @ diag(scale_x, scale_y) @ p_in
    + (translate_x, translate_y)``: scale first, then a horizontal shear ``x += shear * y``,
    then a rotation by ``rotation_deg`` degrees counter-clockwise as displayed, then the
    translation in output pixels.

    Attributes:
        rotation_deg: (N,) rotation in degrees, counter-clockwise as displayed.
        shear: (N,) horizontal shear factor (``x += shear * y``).
        scale_x: (N,) horizontal scale factor.
        scale_y: (N,) vertical scale factor.
        translate_x: (N,) horizontal shift in output pixels (right is positive).
        translate_y: (N,) vertical shift in output pixels (down is positive).
    """

    rotation_deg: Tensor
    shear: Tensor
    scale_x: Tensor
    scale_y: Tensor
    translate_x: Tensor
    translate_y: Tensor

    def __len__(self) -> int:
        return len(self.rotation_deg)

    def __getitem__(self, index: slice | Tensor) -> AffineParams:
        """Return the parameters of the images selected by ``index`` (a slice or an index tensor)."""
        return AffineParams(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def to(self, device: torch.device | str) -> AffineParams:
        """Return the same parameters on ``device``."""
        return AffineParams(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def linear(self) -> Tensor:
        """Return the linear part ``R @ Shear @ Scale`` as float64 of shape (N, 2, 2)."""
        angle = torch.deg2rad(self.rotation_deg.double())
        cos, sin = torch.cos(angle), torch.sin(angle)
        one, zero = torch.ones_like(cos), torch.zeros_like(cos)
        # Counter-clockwise on screen with y pointing down: (1, 0) -> (cos, -sin).
        rotation = torch.stack([cos, sin, -sin, cos], -1).view(-1, 2, 2)
        shear = torch.stack([one, self.shear.double(), zero, one], -1).view(-1, 2, 2)
        scale = torch.diag_embed(torch.stack([self.scale_x, self.scale_y], -1).double())
        return rotation @ shear @ scale  # (N, 2, 2)


def affine_matrices(params: AffineParams) -> Tensor:
    """Return the forward maps as float64 (N, 2, 3) matrices ``[A | t]`` in centred pixels."""
    translation = torch.stack([params.translate_x, params.translate_y], -1).double()
    return torch.cat([params.linear(), translation[..., None]], dim=-1)


def sample_affine_params(
    num: int,
    *,
    rotation_deg: float | Sequence[float] = 0.0,
    shear: float | Sequence[float] = 0.0,
    scale: float | Sequence[float] = 1.0,
    translate: float | Sequence[float] = 0.0,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> AffineParams:
    """Draw affine parameters uniformly and independently.

    Args:
        num: Number of parameter sets.
        rotation_deg: Bound ``r`` for U[-r, r] degrees, or a ``(low, high)`` pair.
        shear: Bound ``s`` for U[-s, s], or a ``(low, high)`` pair.
        scale: ``(low, high)``; ``scale_x`` and ``scale_y`` are drawn independently. A single
            number fixes both.
        translate: Bound ``t`` (pixels) for U[-t, t] on both axes, or ``(max_x, max_y)``.
        generator: Source of randomness.
        device: Device of the result (default CPU).

    Returns:
        :class:`AffineParams` with float64 fields of shape (num,).

    Raises:
        ValueError: If a range is reversed, not a number or a ``(low, high)`` pair, or holds a
            value that is not a finite real number (NaN, infinity, a string, a bool); if a bound
            is negative or a scale not positive; if ``translate`` is not a number or a pair.
        TypeError, ValueError: If ``num`` is not an int >= 0.
        TypeError: If ``generator`` is not a ``torch.Generator`` or ``None``.
    """
    _check_int(num, "num")
    _check_generator(generator)
    device = torch.device("cpu") if device is None else torch.device(device)
    rot = _sym_range(rotation_deg, "rotation_deg")
    shr = _sym_range(shear, "shear")
    scl = _scale_range(scale)
    if _is_number(translate):
        tx = ty = _sym_range(translate, "translate")
    else:
        max_x, max_y = _as_pair(translate, "translate")
        tx, ty = _sym_range(max_x, "translate[0]"), _sym_range(max_y, "translate[1]")  # type: ignore[arg-type]
    draws = [rot, shr, scl, scl, tx, ty]  # one field of AffineParams each, in order
    values = [_uniform(num, low, high, generator, device) for low, high in draws]
    return AffineParams(*values)


_SAMPLING_MODES = ("bilinear", "nearest")


def _check_params(params: object, num: int) -> None:
    """``params`` must be :class:`AffineParams` of ``num`` finite, invertible transforms."""
    if not isinstance(params, AffineParams):
        raise TypeError(f"params: expected AffineParams, got {type(params).__name__}")
    for f in fields(params):
        value = getattr(params, f.name)
        if not isinstance(value, Tensor) or value.shape != (num,):
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"params.{f.name}: expected a tensor of shape ({num},), got {shape}")
        check_tensor_values(  # read at once on the CPU, queued on an accelerator
            torch.isfinite(value).all(),
            f"params.{f.name}: expected finite values",
            detail=lambda value=value: f", got {value.tolist()[:5]}",
        )
    if num:
        check_tensor_values(
            (torch.linalg.det(params.linear()).abs() > 1e-12).all(),
            "params: every transform must be invertible (a zero scale collapses an axis)",
        )


def apply_affine(
    images: Tensor,
    params: AffineParams,
    out_size: int | Sequence[int] | None = None,
    *,
    mode: str = "bilinear",
) -> Tensor:
    """Warp images with given affine parameters, sampling with ``F.grid_sample``.

    The input and output centres coincide before translation; pixels mapped from outside the
    input are zero. With the identity, an integer translation and an output whose size differs
    from the input's by an even number of pixels per axis, the result is a zero-filled shift
    (output pixel centres land on input pixel centres; exact up to the float32 grid's rounding,
    about 1e-6). An odd difference (28 -> 41) puts the centres half a pixel apart, so even the
    identity interpolates between neighbours: :func:`pad_to` places a digit exactly. The sampling grid is
    built in float64 and applied in float32 or better, so float16 and bfloat16 images are
    warped as accurately as float32 ones and only rounded to their dtype at the end.

    Args:
        images: Floating tensor of shape (N, C, H, W).
        params: :class:`AffineParams` of length N.
        out_size: Output ``S`` or ``(height, width)``; default the input size.
        mode: ``"bilinear"`` (default) or ``"nearest"``, passed to ``F.grid_sample``.

    Returns:
        Tensor of shape (N, C, out_height, out_width), dtype and device of ``images``.

    Raises:
        TypeError: If ``images`` is not floating point or ``params`` is not :class:`AffineParams`.
        TypeError, ValueError: If ``out_size`` is not a positive int or a pair of them.
        ValueError: If ``params`` does not hold N values per field, holds a NaN or infinity,
            or a transform that cannot be inverted (e.g. a zero scale); if ``mode`` is not
            ``"bilinear"`` or ``"nearest"``.
    """
    _check_images(images, floating=True)
    num, channels, in_h, in_w = images.shape
    out_h, out_w = (in_h, in_w) if out_size is None else _size_pair(out_size, "out_size")
    if mode not in _SAMPLING_MODES:
        raise ValueError(f"mode: expected one of {_SAMPLING_MODES}, got {mode!r}")
    _check_params(params, num)
    if num == 0:  # F.affine_grid refuses an empty batch
        return images.new_zeros(0, channels, out_h, out_w)
    matrices = affine_matrices(params.to(images.device))  # (N, 2, 3) float64
    inverse = torch.linalg.inv(matrices[..., :2])  # output -> input, centred pixels
    to_norm_in = torch.tensor([2.0 / in_w, 2.0 / in_h], dtype=torch.float64, device=images.device)
    from_norm_out = torch.tensor([out_w / 2.0, out_h / 2.0], dtype=torch.float64, device=images.device)
    # theta maps normalised output coords q to normalised input coords (align_corners=False):
    # p_in = A^-1 (diag(from_norm_out) q - t);  q_in = diag(to_norm_in) p_in.
    linear = to_norm_in[:, None] * inverse * from_norm_out[None, :]  # (N, 2, 2)
    offset = -to_norm_in * (inverse @ matrices[..., 2:]).squeeze(-1)  # (N, 2)
    # A half-precision grid would misplace the sample points by up to a tenth of a pixel
    # (bfloat16 keeps 8 bits of a coordinate): the grid and the sampling run in float32 at least.
    work = torch.promote_types(images.dtype, torch.float32)
    theta = torch.cat([linear, offset[..., None]], dim=-1).to(work)  # (N, 2, 3)
    grid = F.affine_grid(theta, [num, channels, out_h, out_w], align_corners=False)
    warped = F.grid_sample(images.to(work), grid, mode=mode, padding_mode="zeros", align_corners=False)
    return warped.to(images.dtype)


def random_affine(
    images: Tensor,
    *,
    rotation_deg: float | Sequence[float] = 0.0,
    shear: float | Sequence[float] = 0.0,
    scale: float | Sequence[float] = 1.0,
    translate: float | Sequence[float] = 0.0,
    out_size: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, AffineParams]:
    """Warp each image with its own random affine transform.

    Args:
        images: Floating tensor of shape (N, C, H, W).
        rotation_deg, shear, scale, translate: Ranges as in :func:`sample_affine_params`.
        out_size: Output ``S`` or ``(height, width)``; default the input size.
        generator: Source of randomness.

    Returns:
        ``(warped, params)``: warped of shape (N, C, out_height, out_width) and the sampled
        :class:`AffineParams` (on the images' device), e.g. for tests or for undoing the warp.

    Raises:
        TypeError, ValueError: On malformed images, ranges or ``out_size`` (as in
            :func:`sample_affine_params` and :func:`apply_affine`).
        TypeError: If ``generator`` is not a ``torch.Generator`` or ``None``.
    """
    _check_images(images, floating=True)
    if out_size is not None:
        _size_pair(out_size, "out_size")  # before drawing anything
    params = sample_affine_params(
        len(images),
        rotation_deg=rotation_deg,
        shear=shear,
        scale=scale,
        translate=translate,
        generator=generator,
        device=images.device,
    )
    return apply_affine(images, params, out_size), params
