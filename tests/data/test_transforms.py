from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchvote.data import (
    AffineParams,
    apply_affine,
    bounding_boxes,
    pad_to,
    random_affine,
    random_shift,
    sample_affine_params,
    sample_shifts,
    shift_images,
)


def reference_shift(image: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """Zero-filled shift of one (C, H, W) image: roll, then blank what wrapped around."""
    height, width = image.shape[-2:]
    if abs(dy) >= height or abs(dx) >= width:
        return np.zeros_like(image)
    out = np.roll(image, (dy, dx), axis=(-2, -1))
    if dy > 0:
        out[..., :dy, :] = 0
    elif dy < 0:
        out[..., dy:, :] = 0
    if dx > 0:
        out[..., :, :dx] = 0
    elif dx < 0:
        out[..., :, dx:] = 0
    return out


def params(num: int, **values: float) -> AffineParams:
    base = {
        "rotation_deg": 0.0,
        "shear": 0.0,
        "scale_x": 1.0,
        "scale_y": 1.0,
        "translate_x": 0.0,
        "translate_y": 0.0,
    } | values
    return AffineParams(**{k: torch.full((num,), float(v)) for k, v in base.items()})


@pytest.fixture(scope="module")
def digits(mnist_test: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return mnist_test[0][:64]


# ---------------------------------------------------------------- shifts


@settings(max_examples=60, deadline=None)
@given(
    height=st.integers(1, 7),
    width=st.integers(1, 7),
    data=st.data(),
)
def test_shift_images_matches_roll_reference(height: int, width: int, data: st.DataObject) -> None:
    num = data.draw(st.integers(1, 4))
    shifts = torch.tensor(
        data.draw(st.lists(st.tuples(st.integers(-9, 9), st.integers(-9, 9)), min_size=num, max_size=num))
    )
    images = torch.rand(num, 2, height, width)
    out = shift_images(images, shifts)
    for image, got, (dy, dx) in zip(images.numpy(), out.numpy(), shifts.tolist(), strict=True):
        np.testing.assert_array_equal(got, reference_shift(image, dy, dx))


def test_random_shift_is_a_bounded_zero_filled_shift(digits: torch.Tensor) -> None:
    max_shift = 2
    out = random_shift(digits, max_shift, torch.Generator().manual_seed(0))
    candidates = list(itertools.product(range(-max_shift, max_shift + 1), repeat=2))
    for image, got in zip(digits.numpy(), out.numpy(), strict=True):
        assert any(np.array_equal(got, reference_shift(image, dy, dx)) for dy, dx in candidates)
    # Pixel mass is conserved for every digit whose ink keeps a margin of max_shift pixels.
    top, left, bottom, right = bounding_boxes(digits[:, 0]).T
    inside = (top >= max_shift) & (left >= max_shift) & (bottom < 28 - max_shift) & (right < 28 - max_shift)
    assert inside.sum() > len(digits) // 2
    torch.testing.assert_close(out[inside].sum(dim=(1, 2, 3)), digits[inside].sum(dim=(1, 2, 3)))


def test_random_shift_uses_the_generator_and_covers_the_range() -> None:
    images = torch.rand(500, 1, 5, 5)
    first = random_shift(images, 3, torch.Generator().manual_seed(7))
    second = random_shift(images, 3, torch.Generator().manual_seed(7))
    assert torch.equal(first, second)
    expected = shift_images(images, sample_shifts(500, 3, generator=torch.Generator().manual_seed(7)))
    assert torch.equal(first, expected)
    shifts = sample_shifts(5000, 3, generator=torch.Generator().manual_seed(1))
    assert shifts.dtype == torch.int64 and shifts.shape == (5000, 2)
    assert set(shifts.flatten().tolist()) == set(range(-3, 4))


def test_random_shift_follows_dtype_and_zero_shift_is_identity() -> None:
    images = torch.rand(4, 3, 6, 6, dtype=torch.float64)
    out = random_shift(images, 0)
    assert out.dtype == torch.float64 and out.device == images.device
    assert torch.equal(out, images)
    integer_images = torch.randint(0, 255, (2, 1, 4, 4), dtype=torch.uint8)
    assert random_shift(integer_images, 1).dtype == torch.uint8


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: random_shift(torch.zeros(2, 3, 3, 3), -1), ValueError, "max_shift"),
        (lambda: random_shift(torch.zeros(2, 3, 3, 3), 1.5), TypeError, "max_shift"),
        (lambda: random_shift(torch.zeros(3, 3, 3), 1), ValueError, r"\(N, C, H, W\)"),
        (
            lambda: shift_images(torch.zeros(2, 1, 3, 3), torch.zeros(3, 2, dtype=torch.long)),
            ValueError,
            "shifts",
        ),
        (lambda: shift_images(torch.zeros(2, 1, 3, 3), torch.zeros(2, 2)), TypeError, "shifts"),
        (lambda: pad_to(torch.zeros(1, 1, 28, 28), 27), ValueError, "size"),
    ],
)
def test_bad_arguments(call: Callable[[], object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------- padding


def test_pad_to_centres_and_puts_odd_excess_bottom_right() -> None:
    images = torch.rand(2, 3, 4, 5)
    out = pad_to(images, (9, 8))  # +5 rows: 2 top, 3 bottom; +3 cols: 1 left, 2 right
    assert out.shape == (2, 3, 9, 8)
    assert torch.equal(out[..., 2:6, 1:6], images)
    assert out.sum() == pytest.approx(images.sum().item())
    assert torch.equal(pad_to(images, (4, 5)), images)


# ---------------------------------------------------------------- affine warps


def test_identity_and_integer_translation_are_exact(digits: torch.Tensor) -> None:
    num = len(digits)
    torch.testing.assert_close(apply_affine(digits, params(num), 40), pad_to(digits, 40), atol=1e-5, rtol=0)
    moved = apply_affine(digits, params(num, translate_x=3, translate_y=-2))
    expected = shift_images(digits, torch.tensor([[-2, 3]]).expand(num, 2))
    torch.testing.assert_close(moved, expected, atol=1e-5, rtol=0)


def test_rotation_by_90_degrees_matches_rot90(digits: torch.Tensor) -> None:
    rotated = apply_affine(digits, params(len(digits), rotation_deg=90))
    torch.testing.assert_close(rotated, torch.rot90(digits, 1, dims=(-2, -1)), atol=1e-5, rtol=0)


def test_scale_and_shear_move_a_single_pixel_where_the_matrix_says() -> None:
    image = torch.zeros(1, 1, 21, 21)
    image[0, 0, 10 + 2, 10 + 3] = 1.0  # at (x, y) = (3, 2) from the centre
    # Scale first, then shear: x' = 2 * 3 + 0.5 * (1 * 2) = 7, y' = 1 * 2 = 2.
    moved = apply_affine(image, params(1, scale_x=2, shear=0.5, scale_y=1), mode="nearest")
    assert moved[0, 0, 10 + 2, 10 + 7] == 1.0
    assert moved.sum() == 1.0


def test_random_affine_params_stay_in_range_and_are_reproducible(digits: torch.Tensor) -> None:
    kwargs = {"rotation_deg": 20, "shear": 0.2, "scale": (0.8, 1.2), "translate": (3, 1)}
    out, drawn = random_affine(digits, out_size=40, generator=torch.Generator().manual_seed(0), **kwargs)
    assert out.shape == (len(digits), 1, 40, 40)
    assert drawn.rotation_deg.abs().max() <= 20 and drawn.shear.abs().max() <= 0.2
    for scale in (drawn.scale_x, drawn.scale_y):
        assert scale.min() >= 0.8 and scale.max() <= 1.2
    assert drawn.translate_x.abs().max() <= 3 and drawn.translate_y.abs().max() <= 1
    assert not torch.equal(drawn.scale_x, drawn.scale_y)  # independent per axis
    torch.testing.assert_close(out, apply_affine(digits, drawn, 40))
    again, _ = random_affine(digits, out_size=40, generator=torch.Generator().manual_seed(0), **kwargs)
    assert torch.equal(out, again)


def test_affine_ranges_are_validated() -> None:
    with pytest.raises(ValueError, match="rotation_deg"):
        sample_affine_params(3, rotation_deg=(5, -5))
    with pytest.raises(ValueError, match="shear"):
        sample_affine_params(3, shear=-0.1)
    with pytest.raises(ValueError, match="scale"):
        sample_affine_params(3, scale=(0.0, 1.0))
    with pytest.raises(TypeError, match="floating"):
        random_affine(torch.zeros(1, 1, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="params"):
        apply_affine(torch.zeros(2, 1, 4, 4), params(3))


def test_affine_params_select_rows_by_slice_or_index() -> None:
    params = sample_affine_params(5, rotation_deg=20, shear=0.2, scale=(0.8, 1.2), translate=3)
    head, picked = params[1:3], params[torch.tensor([4, 0])]
    assert len(head) == 2 and len(picked) == 2
    assert torch.equal(head.scale_y, params.scale_y[1:3])
    assert torch.equal(picked.translate_x, params.translate_x[torch.tensor([4, 0])])


# ---------------------------------------------------------------- argument checks at the entry


@pytest.mark.parametrize(
    "call",
    [
        lambda: sample_shifts(3, 2, generator=0),
        lambda: random_shift(torch.zeros(2, 1, 4, 4), 1, 0),
        lambda: sample_affine_params(3, generator=0),
        lambda: random_affine(torch.zeros(2, 1, 4, 4), generator=7),
    ],
)
def test_a_seed_given_as_the_generator_is_refused(call: Callable[[], object]) -> None:
    with pytest.raises(TypeError, match="generator"):
        call()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rotation_deg": float("nan")}, "rotation_deg"),
        ({"rotation_deg": True}, "rotation_deg"),
        ({"rotation_deg": "01"}, "rotation_deg"),  # a string is not a (low, high) pair
        ({"shear": (float("nan"), 0.1)}, r"shear\[0\]"),
        ({"shear": (0.0, 0.1, 0.2)}, "shear"),
        ({"scale": float("inf")}, "scale"),
        ({"scale": (0.5, 1.0, 1.5)}, "scale"),
        ({"translate": float("inf")}, "translate"),
        ({"translate": (1.0, 2.0, 3.0)}, "translate"),
        ({"translate": (1.0, float("nan"))}, r"translate\[1\]"),
    ],
)
def test_ranges_must_be_finite_numbers_or_pairs(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        sample_affine_params(3, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        random_affine(torch.rand(3, 1, 6, 6), **kwargs)  # type: ignore[arg-type]


def test_numpy_bounds_give_the_same_draw_as_floats() -> None:
    def draw(**ranges: object) -> AffineParams:
        return sample_affine_params(4, generator=torch.Generator().manual_seed(3), **ranges)  # type: ignore[arg-type]

    plain = draw(rotation_deg=10.0, scale=(0.5, 2.0), translate=(1.0, 2.0))
    numpy = draw(rotation_deg=np.float64(10.0), scale=np.array([0.5, 2.0]), translate=[np.int64(1), 2])
    for name in ("rotation_deg", "shear", "scale_x", "scale_y", "translate_x", "translate_y"):
        assert torch.equal(getattr(plain, name), getattr(numpy, name))


@pytest.mark.parametrize("size", [30.0, None])
def test_a_size_that_is_not_an_int_or_pair_is_named(size: object) -> None:
    images = torch.rand(2, 1, 28, 28)
    with pytest.raises(TypeError, match="size"):
        pad_to(images, size)  # type: ignore[arg-type]
    if size is not None:  # None is apply_affine's "the input size"
        with pytest.raises(TypeError, match="out_size"):
            apply_affine(images, sample_affine_params(2), size)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="out_size"):
            random_affine(images, out_size=size)  # type: ignore[arg-type]


@pytest.mark.parametrize("out_size", [None, 9, (5, 7)])
def test_affine_warps_of_an_empty_batch_are_empty(out_size: int | tuple[int, int] | None) -> None:
    images = torch.rand(0, 2, 6, 8, dtype=torch.float64)
    expected = {None: (6, 8), 9: (9, 9), (5, 7): (5, 7)}[out_size]
    warped, params = random_affine(images, rotation_deg=10.0, out_size=out_size)
    assert warped.shape == (0, 2, *expected) and warped.dtype == images.dtype and len(params) == 0
    direct = apply_affine(images, sample_affine_params(0), out_size)
    assert direct.shape == (0, 2, *expected) and direct.dtype == images.dtype


@pytest.mark.parametrize(
    ("values", "match"),
    [
        ({"scale_x": 0.0}, "invertible"),
        ({"shear": 1.0, "scale_x": 0.0, "scale_y": 0.0}, "invertible"),
        ({"rotation_deg": float("nan")}, "rotation_deg.*finite"),
        ({"translate_x": float("inf")}, "translate_x.*finite"),
    ],
)
def test_warping_with_params_that_cannot_be_applied_is_refused(values: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_affine(torch.rand(2, 1, 5, 5), params(2, **values))


def test_params_of_the_wrong_type_or_length_and_unknown_modes_are_named() -> None:
    images = torch.rand(2, 1, 5, 5)
    with pytest.raises(TypeError, match="params: expected AffineParams"):
        apply_affine(images, [0.0, 0.0])  # type: ignore[arg-type]
    uneven = dataclasses.replace(params(2), shear=torch.zeros(3))
    with pytest.raises(ValueError, match=r"params.shear: expected a tensor of shape \(2,\)"):
        apply_affine(images, uneven)
    for mode in ("bicubic", "area"):
        with pytest.raises(ValueError, match="mode"):
            apply_affine(images, params(2), mode=mode)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_warps_keep_the_dtype_and_match_a_hand_computed_case(dtype: torch.dtype) -> None:
    atol = 1e-5  # small integers are exact in every float dtype: only the float32 sampling shows
    image = torch.arange(1.0, 10.0).view(1, 1, 3, 3).to(dtype)
    # One pixel right, as a whole-pixel translation: the left column becomes zeros.
    moved = apply_affine(image, params(1, translate_x=1.0))
    assert moved.dtype == dtype
    expected = torch.tensor([[0.0, 1.0, 2.0], [0.0, 4.0, 5.0], [0.0, 7.0, 8.0]], dtype=dtype)
    torch.testing.assert_close(moved[0, 0], expected, atol=atol, rtol=0)
    # 90 degrees counter-clockwise as displayed: the pixel right of the centre goes to the top.
    dot = torch.zeros(1, 1, 3, 3, dtype=dtype)
    dot[0, 0, 1, 2] = 1.0
    turned = apply_affine(dot, params(1, rotation_deg=90.0))
    assert turned.dtype == dtype
    expected = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=dtype)
    torch.testing.assert_close(turned[0, 0], expected, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_warps_are_float32_warps_rounded(digits: torch.Tensor, dtype: torch.dtype) -> None:
    # A grid in bfloat16 misplaced the sample points (errors of 0.15 on [0, 1] digits): the warp
    # must be as good as the dtype can hold, i.e. within its rounding of values up to 1.
    warp = params(len(digits), rotation_deg=15.0, translate_x=3.0, translate_y=-2.0)
    reference = apply_affine(digits.double(), warp, 40)
    half = apply_affine(digits.to(dtype), warp, 40)
    assert half.dtype == dtype
    assert (half.double() - reference).abs().max().item() <= torch.finfo(dtype).eps


def test_a_numpy_integer_size_is_an_integer():
    """pad_to(x, np.int64(40)) and random_affine(out_size=np.int64(40)) were refused as
    "size: expected an int or (height, width), got np.int64(40)"."""
    images = torch.rand(2, 1, 28, 28)
    assert torch.equal(pad_to(images, np.int64(40)), pad_to(images, 40))
    generator = torch.Generator().manual_seed(0)
    warped = random_affine(images, out_size=np.int64(40), generator=generator)
    assert warped[0].shape == (2, 1, 40, 40)


def test_a_bool_shifts_tensor_is_refused():
    """True was read as a shift of 1 pixel."""
    expected = r"shifts must be an integer tensor of shape \(N, 2\), got torch.bool"
    with pytest.raises(TypeError, match=expected):
        shift_images(torch.rand(1, 1, 4, 4), torch.tensor([[True, False]]))


def test_shift_images_takes_int8_extremes_and_gives_a_contiguous_result() -> None:
    """The windowed path took ``abs`` of an int8 -128 shift in int8 (it overflows to -128: an
    IndexError), and kept a channels-last input's layout where the gather path gave a plain one."""
    images = torch.rand(2, 3, 5, 6)
    shifts = torch.tensor([[-128, 0], [1, -2]], dtype=torch.int8)
    out = shift_images(images, shifts)
    assert not out[0].any()  # moved out of the image entirely
    np.testing.assert_array_equal(out[1].numpy(), reference_shift(images[1].numpy(), 1, -2))
    channels_last = shift_images(images.to(memory_format=torch.channels_last), shifts.long().clamp(-2, 2))
    assert channels_last.is_contiguous()
    assert torch.equal(channels_last, shift_images(images, shifts.long().clamp(-2, 2)))
