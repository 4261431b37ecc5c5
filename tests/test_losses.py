"""Each loss against a plain per-example loop written from the paper's formula."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from torchvote.losses import (
    SpreadMarginSchedule,
    cross_entropy,
    margin_loss,
    one_hot_targets,
    reconstruction_loss,
    spread_loss,
)


def margin_loss_loop(lengths, present, m_plus=0.9, m_minus=0.1, lam=0.5):
    """Sabour et al. 2017, eq. 4, one example and one class at a time."""
    total = 0.0
    for b in range(lengths.shape[0]):
        for k in range(lengths.shape[1]):
            v = float(lengths[b, k])
            t = float(present[b, k])
            total += t * max(0.0, m_plus - v) ** 2 + lam * (1 - t) * max(0.0, v - m_minus) ** 2
    return total / lengths.shape[0]


def test_margin_loss_matches_loop_for_class_indices():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.rand(6, 10, generator=generator, dtype=torch.float64)
    targets = torch.randint(10, (6,), generator=generator)
    expected = margin_loss_loop(lengths, F.one_hot(targets, 10))
    assert margin_loss(lengths, targets).item() == pytest.approx(expected, rel=1e-12)


def test_margin_loss_multi_hot_and_custom_margins():
    generator = torch.Generator().manual_seed(1)
    lengths = torch.rand(4, 10, generator=generator, dtype=torch.float64)
    present = torch.zeros(4, 10)
    present[torch.arange(4), torch.tensor([1, 2, 3, 4])] = 1
    present[torch.arange(4), torch.tensor([5, 6, 7, 8])] = 1  # two digits per image (MultiMNIST)
    expected = margin_loss_loop(lengths, present, 0.95, 0.05, 0.25)
    actual = margin_loss(lengths, present, positive_margin=0.95, negative_margin=0.05, down_weight=0.25)
    assert actual.item() == pytest.approx(expected, rel=1e-12)


def test_margin_loss_hand_computed_case():
    # One image of class 0: ||v_0|| = 0.5 -> (0.9 - 0.5)^2 = 0.16;
    # ||v_1|| = 0.3 -> 0.5 * (0.3 - 0.1)^2 = 0.02; ||v_2|| = 0.05 is under m- -> 0.
    lengths = torch.tensor([[0.5, 0.3, 0.05]])
    assert margin_loss(lengths, torch.tensor([0])).item() == pytest.approx(0.18)


def test_margin_loss_zero_when_confident_and_has_gradient():
    lengths = torch.tensor([[0.95, 0.05, 0.0]], requires_grad=True)
    assert margin_loss(lengths, torch.tensor([0])).item() == 0.0
    wrong = torch.tensor([[0.2, 0.8, 0.0]], requires_grad=True)
    margin_loss(wrong, torch.tensor([0])).backward()
    assert wrong.grad[0, 0] < 0 and wrong.grad[0, 1] > 0


def test_reconstruction_loss_matches_loop():
    generator = torch.Generator().manual_seed(2)
    images = torch.rand(3, 1, 28, 28, generator=generator, dtype=torch.float64)
    reconstructions = torch.rand(3, 784, generator=generator, dtype=torch.float64)
    expected = 0.0
    for b in range(3):
        flat = images[b].flatten()
        expected += 0.0005 * sum((float(reconstructions[b, i]) - float(flat[i])) ** 2 for i in range(784))
    expected /= 3
    assert reconstruction_loss(reconstructions, images).item() == pytest.approx(expected, rel=1e-10)
    same_shape = reconstruction_loss(reconstructions.view(3, 1, 28, 28), images, weight=1.0)
    assert same_shape.item() == pytest.approx(expected / 0.0005, rel=1e-10)


def test_reconstruction_loss_rejects_mismatched_sizes():
    with pytest.raises(ValueError, match="do not match"):
        reconstruction_loss(torch.zeros(2, 100), torch.zeros(2, 1, 28, 28))


def spread_loss_loop(activations, targets, margin):
    """Hinton et al. 2018, sec. 3.1: sum over wrong classes of max(0, m - (a_t - a_i))^2."""
    total = 0.0
    for b in range(activations.shape[0]):
        t = int(targets[b])
        for i in range(activations.shape[1]):
            if i != t:
                total += max(0.0, margin - (float(activations[b, t]) - float(activations[b, i]))) ** 2
    return total / activations.shape[0]


@pytest.mark.parametrize("margin", [0.2, 0.55, 0.9])
def test_spread_loss_matches_loop(margin):
    generator = torch.Generator().manual_seed(3)
    activations = torch.rand(5, 10, generator=generator, dtype=torch.float64)
    targets = torch.randint(10, (5,), generator=generator)
    expected = spread_loss_loop(activations, targets, margin)
    assert spread_loss(activations, targets, margin=margin).item() == pytest.approx(expected, rel=1e-12)


def test_spread_loss_hand_computed_case():
    # Target 0 at 0.6; class 1 at 0.5 trails by 0.1 < 0.2 -> (0.2 - 0.1)^2 = 0.01; class 2 at 0.1 -> 0.
    activations = torch.tensor([[0.6, 0.5, 0.1]])
    assert spread_loss(activations, torch.tensor([0]), margin=0.2).item() == pytest.approx(0.01)


def test_spread_loss_needs_class_indices():
    with pytest.raises(ValueError, match="class indices"):
        spread_loss(torch.rand(2, 10), torch.zeros(2, 10), margin=0.2)


def test_spread_margin_schedule_goes_linearly_from_0_2_to_0_9():
    schedule = SpreadMarginSchedule(steps=100)
    assert schedule(0) == pytest.approx(0.2)
    assert schedule(50) == pytest.approx(0.55)
    assert schedule(100) == pytest.approx(0.9)
    assert schedule(1000) == pytest.approx(0.9)
    assert schedule(-5) == pytest.approx(0.2)
    with pytest.raises(ValueError):
        SpreadMarginSchedule(steps=0)


def cross_entropy_loop(logits, targets, smoothing, ignore_index=-100):
    """-(1 - e) log p_y - e / K sum_k log p_k, averaged over the counted positions."""
    total, count = 0.0, 0
    num_classes = logits.shape[-1]
    for row, target in zip(logits.reshape(-1, num_classes), targets.reshape(-1), strict=True):
        if int(target) == ignore_index:
            continue
        log_probs = [float(x) - math.log(sum(math.exp(float(v)) for v in row)) for x in row]
        total += -(1 - smoothing) * log_probs[int(target)] - smoothing / num_classes * sum(log_probs)
        count += 1
    return total / count


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_loop(smoothing):
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    targets = torch.randint(5, (6,), generator=generator)
    expected = cross_entropy_loop(logits, targets, smoothing)
    assert cross_entropy(logits, targets, label_smoothing=smoothing).item() == pytest.approx(
        expected, rel=1e-12
    )


def test_cross_entropy_on_sequences_ignores_padding():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 4, 7, generator=generator, dtype=torch.float64)
    targets = torch.randint(1, 7, (2, 4), generator=generator)
    targets[0, 3] = targets[1, 2] = 0  # padding
    expected = cross_entropy_loop(logits, targets, 0.1, ignore_index=0)
    actual = cross_entropy(logits, targets, label_smoothing=0.1, ignore_index=0)
    assert actual.item() == pytest.approx(expected, rel=1e-12)


def test_one_hot_targets_checks_range_and_shape():
    assert one_hot_targets(torch.tensor([2]), 3).tolist() == [[0.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="class indices"):
        one_hot_targets(torch.tensor([3]), 3)
    # the message names the extremes, not every index of the batch
    with pytest.raises(ValueError, match=r"in \[0, 3\): smallest -1, largest 5$"):
        one_hot_targets(torch.tensor([0, -1, 5, 1]), 3)
    with pytest.raises(ValueError, match="targets must be"):
        one_hot_targets(torch.zeros(2, 4), 3)


@pytest.mark.parametrize(
    "loss", [margin_loss, lambda scores, targets: spread_loss(scores, targets, margin=0.2)]
)
def test_class_losses_reject_targets_that_do_not_fit(loss):
    scores = torch.rand(4, 10)
    with pytest.raises(ValueError, match="must hold the same number of examples"):
        loss(scores, torch.tensor([0, 1, 2]))  # a broadcast would hide the missing example
    with pytest.raises(ValueError, match=r"must be \(batch, num_classes\)"):
        loss(torch.rand(10), torch.tensor([3]))
    with pytest.raises(TypeError, match="targets: class indices must be integers"):
        loss(scores, torch.tensor([0.0, 1.0, 2.0, 3.7]))  # would be truncated to class 3
    with pytest.raises(TypeError, match="targets must be a tensor of class indices, got list"):
        loss(scores, [0, 1, 2, 3])  # was: AttributeError 'list' object has no attribute 'dim'
    with pytest.raises(TypeError, match="must be floating point, got dtype torch.int64"):
        loss(torch.ones(4, 10, dtype=torch.long), torch.tensor([0, 1, 2, 3]))  # integer lengths were taken
    assert loss(scores, torch.tensor([0, 1, 2, 3])).dim() == 0


def test_cross_entropy_names_targets_that_are_no_tensor():
    with pytest.raises(TypeError, match="targets must be a tensor of class indices, got list"):
        cross_entropy(torch.rand(2, 3), [0, 1])  # was: AttributeError on is_floating_point


def test_cross_entropy_takes_the_class_axis_last():
    generator = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 4, 5, generator=generator)  # (b, t, k)
    targets = torch.randint(5, (2, 4), generator=generator)
    expected = F.cross_entropy(logits.transpose(1, 2), targets)  # torch's own layout is (b, k, t)
    assert cross_entropy(logits, targets).item() == pytest.approx(expected.item(), rel=1e-6)
    with pytest.raises(ValueError, match=r"\(b, t, k\) not \(b, k, t\)"):
        cross_entropy(logits.transpose(1, 2), targets)  # read as (b, t=5, k=4) before


def test_cross_entropy_rejects_targets_that_do_not_fit():
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 3, generator=generator)
    targets = torch.randint(3, (4,), generator=generator)
    with pytest.raises(ValueError, match=r"targets \(3, 4\) must have the shape of logits"):
        cross_entropy(torch.randn(2, 6, 3), torch.randint(3, (3, 4)))  # flattened to 12 = 12 before
    with pytest.raises(ValueError, match=r"targets \(3,\) must have the shape of logits"):
        cross_entropy(logits, targets[:3])
    with pytest.raises(ValueError, match=r"logits must be \(b, k\) or \(b, t, k\)"):
        cross_entropy(logits[0], targets[0])
    with pytest.raises(TypeError, match="targets must be integer class indices"):
        cross_entropy(logits, targets.float() + 0.7)  # truncated to targets before
    with pytest.raises(TypeError, match="targets must be integer class indices"):
        cross_entropy(logits, torch.softmax(torch.randn(4, 3, generator=generator), dim=-1))
    # torch's own IndexError on the CPU (a device-side assert on CUDA), and bools read as 0 and 1
    for bad in ([-1, 0, 1, 2], [3, 0, 1, 2]):
        with pytest.raises(ValueError, match=r"class indices in \[0, 3\) or ignore_index=-100, got \[-?3?"):
            cross_entropy(logits, torch.tensor(bad))
    with pytest.raises(TypeError, match="targets must be integer class indices, got dtype torch.bool"):
        cross_entropy(logits, torch.tensor([True, False, True, False]))
    padded = torch.tensor([0, -100, 2, -100])  # the ignored positions stay allowed
    expected = torch.nn.functional.cross_entropy(logits, padded)  # mean over the counted positions
    assert cross_entropy(logits, padded) == pytest.approx(float(expected))


def test_bool_class_indices_are_refused_and_bool_multi_hot_taken():
    scores = torch.rand(2, 3)
    with pytest.raises(TypeError, match="class indices must be integers, got dtype torch.bool"):
        margin_loss(scores, torch.tensor([True, False]))
    multi_hot = torch.tensor([[True, False, True], [False, True, False]])
    assert margin_loss(scores, multi_hot) == margin_loss(scores, multi_hot.long())


def test_reconstructions_laid_out_otherwise_than_the_images_are_refused():
    """Channels last against channels first: the same number of values per image, a wrong loss."""
    images = torch.rand(2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"not laid out as images .*last 3 axes differ"):
        reconstruction_loss(images.permute(0, 2, 3, 1).contiguous(), images)
    flat = reconstruction_loss(images.flatten(1), images)
    assert reconstruction_loss(images[:, None], images) == flat == 0  # (b, 1, c, h, w): one per image


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_with_every_position_ignored_is_a_zero_that_backpropagates(smoothing):
    # A batch of padding only: F.cross_entropy's mean is 0/0 = NaN, which would poison the weights.
    logits = torch.randn(2, 3, 4, requires_grad=True)
    padding = torch.zeros(2, 3, dtype=torch.long)
    loss = cross_entropy(logits, padding, ignore_index=0, label_smoothing=smoothing)
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_with_padding_matches_torch(smoothing):
    generator = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 5, 6, generator=generator)
    targets = torch.randint(1, 6, (3, 5), generator=generator)
    targets[0, 2:] = targets[2, 4] = 0  # padding
    expected = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=0, label_smoothing=smoothing)
    actual = cross_entropy(logits, targets, ignore_index=0, label_smoothing=smoothing)
    assert actual.item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize(
    ("loss", "argument"),
    [
        (margin_loss, "lengths"),
        (lambda scores, targets: spread_loss(scores, targets, margin=0.2), "activations"),
        (cross_entropy, "logits"),
    ],
)
def test_class_losses_reject_an_empty_batch(loss, argument):
    # The mean over no examples is NaN; a zero would hide a data pipeline that lost the batch.
    with pytest.raises(ValueError, match=f"{argument} must hold at least one example"):
        loss(torch.rand(0, 3), torch.zeros(0, dtype=torch.long))


def test_reconstruction_loss_needs_a_batch():
    with pytest.raises(ValueError, match=r"reconstructions must be batched, \(b, c\*h\*w\)"):
        reconstruction_loss(torch.rand(784), torch.rand(784))  # an IndexError from flatten(1) before
    with pytest.raises(ValueError, match="images must be batched"):
        reconstruction_loss(torch.rand(1, 784), torch.rand(784))
    with pytest.raises(ValueError, match="reconstructions must hold at least one image"):
        reconstruction_loss(torch.rand(0, 784), torch.rand(0, 1, 28, 28))  # NaN before
    image = torch.rand(784)
    assert reconstruction_loss(image[None], image[None] + 0.5, weight=1.0).item() == pytest.approx(196.0)


def test_margins_and_steps_may_be_numpy_scalars():
    """NumPy's scalars (read from an array or a config) were refused as 'not a number'."""
    assert SpreadMarginSchedule(np.int64(10), np.float32(0.25), 0.75)(5) == pytest.approx(0.5)
    activations, labels = torch.rand(2, 3, dtype=torch.float64), torch.tensor([0, 1])
    expected = spread_loss(activations, labels, margin=0.5)
    assert spread_loss(activations, labels, margin=np.float32(0.5)) == expected
    with pytest.raises(TypeError, match="steps must be an integer"):
        SpreadMarginSchedule(np.float64(10.0))


def test_spread_margin_schedule_checks_its_arguments():
    with pytest.raises(TypeError, match="steps must be an integer"):
        SpreadMarginSchedule("3")  # a TypeError from `"3" < 1` before
    with pytest.raises(TypeError, match="steps must be an integer"):
        SpreadMarginSchedule(1.5)  # accepted before
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        SpreadMarginSchedule(steps=-2)
    with pytest.raises(ValueError, match=r"start must be a margin in \(0, 1\]"):
        SpreadMarginSchedule(steps=10, start=1.5)  # activations in [0, 1] never trail by 1.5
    with pytest.raises(ValueError, match=r"end must be a margin in \(0, 1\]"):
        SpreadMarginSchedule(steps=10, end=0.0)
    with pytest.raises(ValueError, match=r"end must be a margin in \(0, 1\]"):
        SpreadMarginSchedule(steps=10, end=float("nan"))
    with pytest.raises(TypeError, match="start must be a number"):
        SpreadMarginSchedule(steps=10, start="0.2")
    assert SpreadMarginSchedule(steps=10, start=0.5, end=1)(5) == pytest.approx(0.75)


def test_margin_loss_multi_hot_targets_must_be_0_or_1():
    lengths = torch.rand(4, 3)
    with pytest.raises(ValueError, match="multi-hot targets .* must hold only 0 and 1"):
        margin_loss(lengths, torch.full((4, 3), 7.0))  # scaled the loss by 7 (and 1 - 7) before
    with pytest.raises(ValueError, match="must hold only 0 and 1"):
        margin_loss(lengths, torch.full((4, 3), 0.9))
    present = torch.tensor([[1, 0, 1], [0, 1, 0], [0, 0, 0], [1, 1, 1]])
    expected = margin_loss_loop(lengths, present)
    assert margin_loss(lengths, present).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(("margin", "error"), [
    (0.0, ValueError), (1.5, ValueError), (float("nan"), ValueError), ("0.2", TypeError),
])
def test_spread_loss_checks_its_margin(margin, error):
    with pytest.raises(error, match="margin"):
        spread_loss(torch.rand(2, 10), torch.tensor([0, 1]), margin=margin)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"positive_margin": -0.9}, r"positive_margin must be a finite number in \(0.0, 1.0\]"),
        ({"positive_margin": float("nan")}, "positive_margin must be a finite number"),
        ({"negative_margin": 0.95}, "negative_margin must be below positive_margin, got 0.95 >= 0.9"),
        ({"negative_margin": -0.1}, r"negative_margin must be a finite number in \[0.0, 1.0\)"),
        ({"down_weight": -0.5}, r"down_weight must be a finite number in \[0.0, inf\)"),
    ],
)
def test_margin_loss_checks_its_margins(options, message):
    # m- >= m+ punishes every length; a negative lambda rewards long wrong capsules without bound
    with pytest.raises(ValueError, match=message):
        margin_loss(torch.rand(2, 10), torch.tensor([0, 1]), **options)


@pytest.mark.parametrize("weight", [-0.0005, math.nan, math.inf, True])
def test_reconstruction_loss_refuses_a_weight_that_is_not_a_finite_number_at_least_zero(weight):
    images = torch.rand(2, 1, 4, 4)
    with pytest.raises(ValueError, match=rf"weight must be a finite number in \[0.0, inf\), got {weight!r}"):
        reconstruction_loss(images.flatten(1), images, weight=weight)


def test_one_hot_targets_refuses_zero_classes_by_name():
    with pytest.raises(ValueError, match="num_classes must be a positive integer, got 0"):
        one_hot_targets(torch.tensor([0]), 0)


def test_target_values_are_checked_without_a_read_off_the_cpu():
    """Meta tensors have no values to read (a read raises): the checks are queued, not read."""
    scores = torch.rand(3, 10, device="meta")
    loss = margin_loss(scores, torch.tensor([1, 2, 3], device="meta"))
    pairs = torch.zeros(3, 10, device="meta")
    assert loss.shape == () and margin_loss(scores, pairs).shape == ()
    assert spread_loss(scores, torch.tensor([1, 2, 3], device="meta"), margin=0.2).shape == ()


def test_the_spread_margin_reaches_its_end_exactly():
    schedule = SpreadMarginSchedule(steps=10)
    assert schedule(0) == schedule.start and schedule(10) == schedule(20) == schedule.end == 0.9


def test_cross_entropy_checks_label_smoothing_and_keeps_float64():
    logits, targets = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 2, 1, 1])
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(logits, targets, label_smoothing=1.5)
    loss = cross_entropy(logits, targets, label_smoothing=0.1)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, F.cross_entropy(logits, targets, label_smoothing=0.1))
    with pytest.raises(TypeError, match="logits must be floating point"):
        cross_entropy(torch.ones(4, 3, dtype=torch.int64), targets)


def test_reconstruction_loss_refuses_integer_pixels():
    """uint8 pixels of 0-255 against reconstructions in [0, 1] gave a loss 255^2 too large."""
    with pytest.raises(TypeError, match="images must be floating point, got dtype torch.uint8"):
        reconstruction_loss(torch.rand(2, 16), torch.randint(0, 256, (2, 1, 4, 4), dtype=torch.uint8))


@pytest.mark.parametrize("loss", ["margin", "spread", "cross_entropy", "reconstruction"])
def test_targets_on_another_device_are_refused_by_name(loss):
    """Targets on another device failed inside torch ("Tensor on device cpu is not on the expected
    device meta!"), naming no argument; the meta device stands for a GPU here."""
    scores, targets = torch.rand(3, 10, device="meta"), torch.tensor([1, 2, 3])
    calls = {
        "margin": lambda: margin_loss(scores, targets),
        "spread": lambda: spread_loss(scores, targets, margin=0.2),
        "cross_entropy": lambda: cross_entropy(scores, targets),
        "reconstruction": lambda: reconstruction_loss(
            torch.rand(3, 16, device="meta"), torch.rand(3, 1, 4, 4)
        ),
    }
    with pytest.raises(ValueError, match=r"(targets|images) is on cpu but \w+ are on meta"):
        calls[loss]()
