"""The generated affNIST stand-in (``affnist-style``) and the translated training canvases.

The sampler is checked against what the recipe says: every parameter uniform over its range
(Kolmogorov-Smirnov against the uniform distribution), the two scales independent, the
whole-pixel placement uniform over the positions that keep the warped digit's bounding box
inside the canvas, and the share of digits touching the border equal to what that uniform
placement implies. The seed is fixed, so each statistical check is deterministic; the bounds
are those of a test at about the 0.1% level.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from torchvote.data import (
    AffineParams,
    apply_affine,
    bounding_boxes,
    make_affnist_style,
    pad_and_translate_train,
    pad_to,
)
from torchvote.data.affnist_style import AFFNIST_RANGES

Affnist = tuple[torch.Tensor, torch.Tensor, AffineParams]
NUM = 4000  # digits in the statistical checks


def ks_distance(samples: torch.Tensor, low: float, high: float) -> float:
    """Kolmogorov-Smirnov distance between the samples and U[low, high]."""
    u = ((samples.double() - low) / (high - low)).sort().values
    n = len(u)
    above = torch.arange(1, n + 1, dtype=torch.float64) / n - u
    below = u - torch.arange(n, dtype=torch.float64) / n
    return float(torch.maximum(above, below).max())


KS_BOUND = 1.95 / NUM**0.5  # the 0.1% critical value for large n


def ink_boxes(images: torch.Tensor) -> torch.Tensor:
    """(N, 4) top, left, bottom, right of the pixels that are not zero."""
    return bounding_boxes(images[:, 0])


@pytest.fixture(scope="module")
def test_digits(mnist_test: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return mnist_test[0][:NUM], mnist_test[1][:NUM]


@pytest.fixture(scope="module")
def affnist(test_digits: tuple[torch.Tensor, torch.Tensor]) -> Affnist:
    return make_affnist_style(*test_digits, seed=0)


def test_shapes_levels_labels_and_reconstruction(
    test_digits: tuple[torch.Tensor, torch.Tensor], affnist: Affnist
) -> None:
    warped, labels, params = affnist
    assert warped.shape == (NUM, 1, 40, 40) and warped.dtype == torch.float32
    assert warped.min() >= 0 and warped.max() <= 1
    levels = warped * 255
    assert torch.equal(levels, levels.round())  # 8-bit levels, as the real files store
    assert torch.equal(labels, test_digits[1])
    assert len(params) == NUM
    # The returned parameters reproduce the images (up to one 8-bit level where float rounding
    # of the two sampling grids lands on a .5 boundary).
    again = (apply_affine(test_digits[0], params, 40).clamp(0, 1) * 255).round() / 255
    torch.testing.assert_close(again, warped, atol=1 / 255 + 1e-6, rtol=0)
    assert (again == warped).float().mean() > 0.9999


def test_parameters_are_uniform_over_the_affnist_ranges(affnist: Affnist) -> None:
    params = affnist[2]
    for name, values in [
        ("rotation_deg", params.rotation_deg),
        ("shear", params.shear),
        ("scale", params.scale_x),
        ("scale", params.scale_y),
    ]:
        low, high = AFFNIST_RANGES[name]
        assert low <= values.min() and values.max() <= high, name
        assert ks_distance(values, low, high) < KS_BOUND, name
        # the whole range is used: the 1% and 99% quantiles sit near the ends
        q01, q99 = torch.quantile(values.double(), torch.tensor([0.01, 0.99], dtype=torch.float64))
        assert abs(q01 - (low + 0.01 * (high - low))) < 0.01 * (high - low), name
        assert abs(q99 - (low + 0.99 * (high - low))) < 0.01 * (high - low), name


def test_x_and_y_scales_are_independent(affnist: Affnist) -> None:
    params = affnist[2]
    scale_x, scale_y = params.scale_x.double(), params.scale_y.double()
    assert not torch.equal(scale_x, scale_y)
    correlation = float(torch.corrcoef(torch.stack([scale_x, scale_y]))[0, 1])
    assert abs(correlation) < 3.3 / NUM**0.5
    # chi-square on a 3x3 table of terciles: df = 4, 0.1% critical value 18.47
    low, high = AFFNIST_RANGES["scale"]
    bins_x = ((scale_x - low) / (high - low) * 3).long().clamp(0, 2)
    bins_y = ((scale_y - low) / (high - low) * 3).long().clamp(0, 2)
    table = torch.bincount(bins_x * 3 + bins_y, minlength=9).double().view(3, 3)
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    assert float(((table - expected) ** 2 / expected).sum()) < 18.47


def test_placement_is_uniform_over_the_positions_that_keep_the_box_inside(affnist: Affnist) -> None:
    """Per axis, the box's first pixel is uniform over {0, ..., 40 - size}: its randomised
    probability integral transform (index + V) / positions is U[0, 1)."""
    warped = affnist[0]
    boxes = ink_boxes(warped)
    assert (boxes[:, 2] >= boxes[:, 0]).all()  # every digit has ink
    rng = torch.Generator().manual_seed(123)
    for first, last in [(boxes[:, 0], boxes[:, 2]), (boxes[:, 1], boxes[:, 3])]:
        positions = 40 - (last - first)
        fits = positions >= 1
        assert fits.float().mean() > 0.99
        index, positions = first[fits].double(), positions[fits].double()
        pit = (index + torch.rand(len(index), generator=rng, dtype=torch.float64)) / positions
        assert ks_distance(pit, 0.0, 1.0) < 1.95 / len(pit) ** 0.5


def test_digits_touch_the_border_as_often_as_uniform_placement_implies(affnist: Affnist) -> None:
    warped = affnist[0]
    ink = warped[:, 0] > 0
    touches = ink[:, 0].any(-1) | ink[:, -1].any(-1) | ink[:, :, 0].any(-1) | ink[:, :, -1].any(-1)
    boxes = ink_boxes(warped)
    heights, widths = (boxes[:, 2] - boxes[:, 0] + 1).double(), (boxes[:, 3] - boxes[:, 1] + 1).double()
    # On an axis with m = 41 - size positions, 2 of them touch an edge (1 if m == 1).
    miss_y = (1 - 2 / (41 - heights).clamp(min=1)).clamp(min=0)
    miss_x = (1 - 2 / (41 - widths).clamp(min=1)).clamp(min=0)
    expected = 1 - miss_y * miss_x  # (N,) probability of touching, per digit
    sd = float((expected * (1 - expected)).sum().sqrt()) / NUM
    observed = float(touches.double().mean())
    assert abs(observed - float(expected.mean())) < 4 * sd
    assert observed > 0.15  # the previous recipe reached 0.07 on MNIST test digits


def test_every_digit_stays_whole_inside_the_canvas(
    test_digits: tuple[torch.Tensor, torch.Tensor], affnist: Affnist
) -> None:
    """Render the same warps on an 80x80 canvas: nothing that rounds to a nonzero 8-bit level
    may land outside the central 40x40."""
    images, _ = test_digits
    warped, _, params = affnist
    big = apply_affine(images[:1000], params[:1000], 80)
    outside = big.clone()
    outside[..., 20:60, 20:60] = 0
    assert outside.max() < 0.5 / 255 + 1e-5
    assert torch.equal(
        ink_boxes(big[..., 20:60, 20:60].clamp(0, 1).mul(255).round()), ink_boxes(warped[:1000])
    )


def test_a_single_pixel_reaches_every_position_of_the_canvas() -> None:
    """Identity warp, one lit pixel: its box is 1x1, so all 40 rows and columns are admissible
    and each is equally likely; the translation says where the pixel went."""
    image = torch.zeros(1, 1, 28, 28)
    image[0, 0, 3, 5] = 1.0
    images = image.expand(2000, -1, -1, -1)
    identity = {"rotation_deg": (0.0, 0.0), "shear": (0.0, 0.0), "scale": (1.0, 1.0)}
    labels = torch.zeros(2000, dtype=torch.long)
    warped, _, params = make_affnist_style(images, labels, seed=3, ranges=identity)
    assert torch.equal(warped.sum(dim=(1, 2, 3)), torch.ones(2000))  # nothing blurred or cut
    rows = warped[:, 0].amax(dim=2).argmax(dim=1)
    cols = warped[:, 0].amax(dim=1).argmax(dim=1)
    # Pixel (3, 5) of the 28x28 image sits at (9, 11) of the centred 40x40 canvas.
    assert torch.equal(rows, 9 + params.translate_y.round().long())
    assert torch.equal(cols, 11 + params.translate_x.round().long())
    for position in (rows, cols):
        counts = torch.bincount(position, minlength=40).double()
        assert len(counts) == 40 and (counts > 0).all()
        chi2 = float(((counts - 50) ** 2 / 50).sum())
        assert chi2 < 72.1  # df = 39, 0.1% critical value


def test_rotation_by_90_degrees_stands_a_bar_on_its_end() -> None:
    """Hand-computed: pixel centres of a 28x28 image sit at half-integers from its centre
    (13.5, 13.5). Row 13, columns 10..17 is the bar x in {-3.5, ..., 3.5}, y = -0.5. The
    counter-clockwise quarter turn maps (x, y) -> (y, -x) (y points down): x = -0.5, y from
    3.5 to -3.5, i.e. column 13, rows 10..17, whole pixel centres, so no blur. The box is then
    8 rows by 1 column: 33 vertical and 40 horizontal positions."""
    image = torch.zeros(1, 1, 28, 28)
    image[0, 0, 13, 10:18] = 1.0
    quarter = {"rotation_deg": (90.0, 90.0), "shear": (0.0, 0.0), "scale": (1.0, 1.0)}
    warped, _, params = make_affnist_style(
        image.expand(600, -1, -1, -1), torch.zeros(600, dtype=torch.long), seed=0, ranges=quarter
    )
    boxes = ink_boxes(warped)
    assert torch.equal(boxes[:, 2] - boxes[:, 0], torch.full((600,), 7))  # 8 rows
    assert torch.equal(boxes[:, 3] - boxes[:, 1], torch.zeros(600, dtype=torch.long))  # 1 column
    assert torch.equal(warped.sum(dim=(1, 2, 3)), torch.full((600,), 8.0))
    # Where the bar is: rows 10..17, column 13 of the 28x28 frame, i.e. 16..23 and 19 of the
    # centred 40x40 canvas, moved by the translation.
    assert torch.equal(boxes[:, 0], 16 + params.translate_y.round().long())
    assert torch.equal(boxes[:, 1], 19 + params.translate_x.round().long())
    assert boxes[:, 0].min() == 0 and boxes[:, 2].max() == 39  # both ends reached in 600 draws
    assert boxes[:, 1].min() == 0 and boxes[:, 3].max() == 39
    assert torch.equal(params.rotation_deg, torch.full((600,), 90.0, dtype=torch.float64))


def test_a_digit_larger_than_the_canvas_is_centred() -> None:
    image = torch.zeros(1, 1, 28, 28)
    image[0, 0, 2:26, 4] = 1.0  # 24 rows
    image[0, 0, 2, 4:8] = 1.0
    identity = {"rotation_deg": (0.0, 0.0), "shear": (0.0, 0.0), "scale": (1.0, 1.0)}
    warped, _, params = make_affnist_style(
        image.expand(5, -1, -1, -1), torch.zeros(5, dtype=torch.long), seed=0, canvas=28, ranges=identity
    )
    assert torch.equal(warped.sum(dim=(1, 2, 3)), torch.full((5,), 27.0))  # fits on 28: nothing cut
    tall = {"scale": (1.5, 1.5), "rotation_deg": (0.0, 0.0), "shear": (0.0, 0.0)}
    warped, _, params = make_affnist_style(
        image.expand(5, -1, -1, -1), torch.zeros(5, dtype=torch.long), seed=0, canvas=28, ranges=tall
    )
    boxes = ink_boxes(warped)
    assert (boxes[:, 0] == 0).all() and (boxes[:, 2] == 27).all()  # cut on both ends
    assert torch.equal(params.translate_y, torch.zeros(5, dtype=torch.float64))  # centred
    assert len(set(params.translate_x.tolist())) > 1  # the other axis is still drawn


def test_canvas_option_and_determinism(test_digits: tuple[torch.Tensor, torch.Tensor]) -> None:
    images, labels = test_digits[0][:50], test_digits[1][:50]
    first, _, params = make_affnist_style(images, labels, seed=5)
    again, _, params_again = make_affnist_style(images, labels, seed=5)
    other, _, _ = make_affnist_style(images, labels, seed=6)
    assert torch.equal(first, again)
    assert torch.equal(params.translate_x, params_again.translate_x)
    assert not torch.equal(first, other)
    small, _, small_params = make_affnist_style(images, labels, seed=5, canvas=28)
    assert small.shape == (50, 1, 28, 28)
    assert torch.equal(small_params.rotation_deg, params.rotation_deg)  # same draws, other canvas


def test_bad_arguments() -> None:
    images, labels = torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="canvas"):
        make_affnist_style(images, labels, seed=0, canvas=27)
    with pytest.raises(ValueError, match="canvas"):
        pad_and_translate_train(images, canvas=20)
    with pytest.raises(ValueError, match="unknown keys \\['tilt'\\]"):
        make_affnist_style(images, labels, seed=0, ranges={"tilt": (0, 1)})
    with pytest.raises(ValueError, match="low <= high"):
        make_affnist_style(images, labels, seed=0, ranges={"shear": (0.2, -0.2)})
    with pytest.raises(ValueError, match="labels"):
        make_affnist_style(images, torch.zeros(3, dtype=torch.long), seed=0)
    with pytest.raises(TypeError, match="labels must be an integer tensor of classes, got torch.float32"):
        make_affnist_style(images, torch.zeros(2), seed=0)  # float classes were passed on as given


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


@pytest.mark.parametrize("seed", [1.5, None, "0", -1, 2**64])
def test_seed_must_be_an_int_that_seeds_a_generator(seed: object) -> None:
    images, labels = torch.rand(2, 1, 28, 28), torch.tensor([3, 7])
    with pytest.raises(ValueError, match="seed"):
        make_affnist_style(images, labels, seed=seed)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("ranges", "match"),
    [
        ({"shear": 0.3}, r"ranges\['shear'\]"),  # a bound, not a (low, high) pair
        ({"shear": (-0.1, 0.0, 0.1)}, r"ranges\['shear'\]"),
        ({"rotation_deg": "05"}, r"ranges\['rotation_deg'\]"),
        ({"rotation_deg": (float("nan"), 10.0)}, r"ranges\['rotation_deg'\]\[0\]"),
        ({"scale": (0.8, float("inf"))}, r"ranges\['scale'\]\[1\]"),
    ],
)
def test_malformed_ranges_are_named(ranges: dict[str, object], match: str) -> None:
    images, labels = torch.rand(2, 1, 28, 28), torch.tensor([3, 7])
    with pytest.raises(ValueError, match=match):
        make_affnist_style(images, labels, seed=0, ranges=ranges)  # type: ignore[arg-type]


def test_ranges_may_be_lists_or_numpy_numbers() -> None:
    images, labels = torch.rand(3, 1, 28, 28), torch.tensor([3, 7, 1])
    as_tuple, _, _ = make_affnist_style(images, labels, seed=4, ranges={"shear": (-0.1, 0.1)})
    as_list, _, _ = make_affnist_style(images, labels, seed=4, ranges={"shear": [np.float64(-0.1), 0.1]})
    assert torch.equal(as_tuple, as_list)


def test_pad_and_translate_train_wants_a_generator_not_a_seed() -> None:
    with pytest.raises(TypeError, match="generator"):
        pad_and_translate_train(torch.rand(2, 1, 28, 28), 40, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("labels", [torch.zeros(4, 3, dtype=torch.long), torch.zeros(4, 0, dtype=torch.long)])
def test_labels_must_be_one_class_per_image(labels):
    """Labels of shape (4, 3) or (4, 0) were accepted and returned unchanged."""
    with pytest.raises(ValueError, match=r"labels: expected a tensor of shape \(4,\), got \(4, [03]\)"):
        make_affnist_style(torch.rand(4, 1, 28, 28), labels, seed=0)


def test_ranges_messages_say_what_each_range_takes():
    """ranges={'rotation_deg': 30} said "must be a number or a (low, high) pair, got 30"; a
    negative scale was named scale[0], not the ranges entry the user gave."""
    images, labels = torch.rand(2, 1, 28, 28), torch.tensor([3, 7])
    with pytest.raises(ValueError, match=r"ranges\['rotation_deg'\] must be a \(low, high\) pair, got 30"):
        make_affnist_style(images, labels, seed=0, ranges={"rotation_deg": 30})
    with pytest.raises(ValueError, match=r"ranges\['scale'\]\[0\] must be a finite number in \(0.0, inf\)"):
        make_affnist_style(images, labels, seed=0, ranges={"scale": (-1.0, 1.0)})
    generator = torch.Generator().manual_seed(0)
    assert pad_and_translate_train(images, np.int64(40), generator).shape == (2, 1, 40, 40)
