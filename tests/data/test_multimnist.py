from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchvote.data import (
    MultiMNISTSource,
    bounding_box_overlap,
    bounding_boxes,
    get_dataset,
    make_multimnist,
    pad_to,
    shift_images,
)
from torchvote.data.multimnist import MultiMNIST, _place


@pytest.fixture(scope="module")
def source(mnist_test: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return mnist_test[0][:1000], mnist_test[1][:1000]


@pytest.fixture(scope="module")
def pairs(source: tuple[torch.Tensor, torch.Tensor]) -> MultiMNIST:
    return make_multimnist(*source, num_pairs=2000, seed=0)


def test_shapes_classes_and_overlay(pairs: MultiMNIST) -> None:
    images, labels, digits = pairs
    assert images.shape == (2000, 1, 36, 36) and images.dtype == torch.float32
    assert labels.shape == (2000, 2) and labels.dtype == torch.int64
    assert digits.shape == (2000, 2, 1, 36, 36)
    assert bool((labels[:, 0] != labels[:, 1]).all())
    assert images.min() >= 0 and images.max() <= 1
    assert torch.equal(images, torch.clamp(digits[:, 0] + digits[:, 1], max=1.0))
    assert bool((digits[:, 0] + digits[:, 1] > 1).any())  # the clamp does happen


def test_each_canvas_is_a_shifted_copy_of_a_source_digit_of_its_class(
    source: tuple[torch.Tensor, torch.Tensor], pairs: MultiMNIST
) -> None:
    """Undo every possible shift and look the 28x28 crop up among the source digits."""
    images, labels = source
    index = {images[i, 0].numpy().tobytes(): int(labels[i]) for i in range(len(images))}
    max_shift = 4
    canvases = pairs.digits[:200].flatten(0, 1)[:, 0].numpy()  # (400, 36, 36)
    for digit, label in zip(canvases, pairs.labels[:200].flatten().tolist(), strict=True):
        matches = set()
        for dy, dx in itertools.product(range(-max_shift, max_shift + 1), repeat=2):
            crop = digit[4 + dy : 32 + dy, 4 + dx : 32 + dx]
            key = np.ascontiguousarray(crop).tobytes()
            if key in index and np.count_nonzero(crop) == np.count_nonzero(digit):  # all ink
                matches.add(index[key])
        assert matches == {label}


def test_first_digits_cycle_through_the_source(
    source: tuple[torch.Tensor, torch.Tensor], pairs: MultiMNIST
) -> None:
    # 2000 pairs from 1000 digits: every digit is a first digit exactly twice.
    assert torch.equal(
        torch.bincount(pairs.labels[:, 0], minlength=10), 2 * torch.bincount(source[1], minlength=10)
    )


def test_deterministic_given_seed(source: tuple[torch.Tensor, torch.Tensor]) -> None:
    first = make_multimnist(*source, num_pairs=50, seed=3)
    again = make_multimnist(*source, num_pairs=50, seed=3)
    other = make_multimnist(*source, num_pairs=50, seed=4)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first.images, other.images)


def test_overlap_of_20x20_boxes_matches_the_closed_form() -> None:
    """Solid 20x20 squares: overlap = E[(20 - |dy|)(20 - |dx|)] / 400 with d the difference of
    two independent uniform shifts on {-4..4}; E|d| = (n^2 - 1) / (3n) with n = 9."""
    squares = torch.zeros(10, 1, 28, 28)
    squares[:, :, 4:24, 4:24] = 1.0
    generated = make_multimnist(squares, torch.arange(10), num_pairs=10000, seed=0)
    expected = (1 - (81 - 1) / (3 * 9) / 20) ** 2  # 0.7257
    assert bounding_box_overlap(generated.digits).mean().item() == pytest.approx(expected, abs=0.01)


def test_real_digits_overlap_close_to_the_paper(
    source: tuple[torch.Tensor, torch.Tensor], pairs: MultiMNIST
) -> None:
    # Sabour et al. 2017 report about 80%; real ink boxes give about 73% (see the test above).
    overlap = bounding_box_overlap(pairs.digits)
    assert overlap.min() >= 0 and overlap.max() <= 1
    assert 0.65 < overlap.mean().item() < 0.85
    wider = make_multimnist(*source, num_pairs=2000, seed=0, max_shift=6)
    assert bounding_box_overlap(wider.digits).mean() < overlap.mean() - 0.05


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=8), st.integers(1, 3))
def test_bounding_boxes_match_a_loop(points: list[tuple[int, int]], num: int) -> None:
    images = torch.zeros(num, 7, 7)
    for row, col in points:
        images[0, row, col] = 1.0
    boxes = bounding_boxes(images)
    if points:
        rows, cols = zip(*points, strict=True)
        assert boxes[0].tolist() == [min(rows), min(cols), max(rows), max(cols)]
    else:
        assert boxes[0].tolist() == [0, 0, -1, -1]
    assert (boxes[1:] == torch.tensor([0, 0, -1, -1])).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"canvas": 27}, ValueError, "canvas"),
        ({"max_shift": -1}, ValueError, "max_shift"),
        ({"num_pairs": 2.5}, TypeError, "num_pairs"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    images, labels = torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 0, 1])
    with pytest.raises(error, match=match):
        make_multimnist(images, labels, **{"num_pairs": 3, **kwargs})  # type: ignore[arg-type]


def test_needs_two_classes() -> None:
    with pytest.raises(ValueError, match="two different classes"):
        make_multimnist(torch.rand(4, 1, 28, 28), torch.zeros(4, dtype=torch.long), num_pairs=2)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 20), st.integers(28, 40), st.integers(0, 2**31 - 1))
def test_placing_is_padding_then_shifting(max_shift: int, canvas: int, seed: int) -> None:
    """The block copies equal ``shift_images(pad_to(...))``, digits cut at the edge included."""
    generator = torch.Generator().manual_seed(seed)
    sources = torch.rand(5, 1, 28, 28, generator=generator)
    index = torch.randint(5, (40,), generator=generator)
    shifts = torch.randint(-max_shift, max_shift + 1, (40, 2), generator=generator)
    expected = shift_images(pad_to(sources[index], canvas), shifts)
    assert torch.equal(_place(sources, index, shifts, canvas), expected)


def test_a_source_draws_new_pairs_for_each_seed(source: tuple[torch.Tensor, torch.Tensor]) -> None:
    pairs = MultiMNISTSource(*source, num_pairs=1000, max_shift=3, canvas=34, seed=9)
    assert len(pairs) == 1000 and "tensor" not in repr(pairs)
    own = make_multimnist(*source, num_pairs=1000, max_shift=3, canvas=34, seed=9)
    assert all(torch.equal(a, b) for a, b in zip(pairs.draw(), own, strict=True))
    first, second = pairs.draw(1), pairs.draw(2)
    assert first.images.shape == (1000, 1, 34, 34)
    assert all(torch.equal(a, b) for a, b in zip(first, pairs.draw(1), strict=True))
    assert not torch.equal(first.images, second.images)
    # Each draw pairs every source digit anew: the first digits are a new permutation of them.
    assert not torch.equal(first.labels[:, 0], second.labels[:, 0])
    for drawn in (first, second):
        assert torch.equal(drawn.labels[:, 0].sort().values, source[1].sort().values)


def test_a_source_checks_its_recipe_when_made() -> None:
    with pytest.raises(ValueError, match="canvas"):
        MultiMNISTSource(torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 0, 1]), num_pairs=2, canvas=20)
    with pytest.raises(TypeError, match="num_pairs"):
        MultiMNISTSource(torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 0, 1]), num_pairs=2.0)  # type: ignore[arg-type]


def test_registry_trains_on_fresh_pairs_and_tests_on_a_fixed_set(mnist_test) -> None:
    train = get_dataset("multimnist", "train", limit=100)
    assert isinstance(train, MultiMNISTSource) and len(train) == 100 and train.seed == 0
    first, again = (get_dataset("multimnist", "test", limit=100) for _ in range(2))
    assert len(first.images) == 100  # one pair per test digit, the same in every run
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


@pytest.mark.parametrize("seed", [0.5, None, "1", -1, 2**64])
def test_seed_must_be_an_int_that_seeds_a_generator(seed: object) -> None:
    images, labels = torch.rand(4, 1, 8, 8), torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match="seed"):
        make_multimnist(images, labels, num_pairs=3, canvas=10, seed=seed)  # type: ignore[arg-type]
    source = MultiMNISTSource(images, labels, num_pairs=3, canvas=10)
    if seed is not None:  # draw(None) is the source's own seed
        with pytest.raises(ValueError, match="seed"):
            source.draw(seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(), (5,)])
def test_bounding_boxes_need_a_height_and_a_width(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="images"):
        bounding_boxes(torch.ones(shape))


@pytest.mark.parametrize(("max_shift", "ok"), [(18, True), (19, False), (100, False)])
def test_a_shift_that_can_push_a_digit_off_the_canvas_is_refused(max_shift: int, ok: bool) -> None:
    # 28x28 digits start at offset 4 on 36x36: shifts up to 4 + 14 keep half of each digit on it.
    images, labels = torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 0, 1])
    canvas = 36
    if ok:
        generated = make_multimnist(images, labels, num_pairs=50, max_shift=max_shift, canvas=canvas)
        assert bool((generated.digits.flatten(2).amax(-1) > 0).all())  # every digit is visible
        return
    with pytest.raises(ValueError, match=f"max_shift: expected at most 18 .*got {max_shift}"):
        make_multimnist(images, labels, num_pairs=3, max_shift=max_shift, canvas=canvas)
    with pytest.raises(ValueError, match="max_shift"):
        MultiMNISTSource(images, labels, num_pairs=3, max_shift=max_shift, canvas=canvas)


def test_labels_must_be_classes_not_floats() -> None:
    images = torch.rand(4, 1, 28, 28)
    with pytest.raises(TypeError, match="labels"):  # 0.5 and 1.5 would both become class 0 and 1
        make_multimnist(images, torch.tensor([0.5, 1.5, 0.5, 1.5]), num_pairs=3)


@pytest.mark.parametrize("scale, shift, got", [(255.0, 0.0, "values in"), (1.0, -0.5, "values in"),
                                                (float("nan"), 0.0, "NaN")])
def test_pixels_outside_0_1_are_refused(scale: float, shift: float, got: str) -> None:
    """0-255 digits became white squares under min(a + b, 1), and centred ones (-0.5) went below
    0: the overlay was clamped from above only."""
    images = torch.rand(4, 1, 28, 28) * scale + shift
    with pytest.raises(ValueError, match=rf"images: expected pixel values in \[0, 1\], got {got}"):
        make_multimnist(images, torch.tensor([0, 1, 2, 3]), num_pairs=2)


def test_float32_rounding_past_1_is_taken_and_clamped() -> None:
    """An interpolated digit reaches 1 + 1e-7 by rounding: taken, and the overlay stays in [0, 1]."""
    images = torch.ones(4, 1, 28, 28) + 1e-7
    pairs = make_multimnist(images, torch.tensor([0, 1, 2, 3]), num_pairs=2)
    assert float(pairs.images.max()) == 1.0 and float(pairs.images.min()) == 0.0


def test_a_source_checks_its_seed_when_made() -> None:
    with pytest.raises(ValueError, match="seed"):  # not only at the first draw, epochs later
        MultiMNISTSource(torch.rand(4, 1, 28, 28), torch.tensor([0, 1, 0, 1]), num_pairs=2, seed=2**64)


def test_box_arguments_of_the_wrong_kind_are_named():
    """A list of digits was "'list' object has no attribute 'ndim'"; threshold='0.5' torch's
    "'>' not supported between instances of 'Tensor' and 'str'"."""
    with pytest.raises(TypeError, match="digits: expected a torch.Tensor, got list"):
        bounding_box_overlap([[1.0]])
    for threshold in ("0.5", None, float("nan")):
        with pytest.raises(ValueError, match="threshold must be a finite number"):
            bounding_boxes(torch.rand(2, 5, 5), threshold=threshold)


def test_a_tensor_threshold_compares_as_torch_does():
    """A 0-d threshold (images.mean()) or one per image: as the numbers it holds."""
    images = torch.rand(2, 5, 5)
    mean = images.mean()
    assert torch.equal(bounding_boxes(images, mean), bounding_boxes(images, mean.item()))
    per_image = torch.tensor([0.2, 0.9]).view(2, 1, 1)
    boxes = bounding_boxes(images, per_image)
    assert torch.equal(boxes[0], bounding_boxes(images[0], 0.2))
    assert torch.equal(boxes[1], bounding_boxes(images[1], 0.9))
