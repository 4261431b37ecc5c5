"""Nadaraya-Watson regression against the estimator written as a loop, and its limits."""

from __future__ import annotations

import math

import pytest
import torch

from torchvote.nn import NadarayaWatson

F64 = torch.float64


def _loop_estimate(queries, keys, values, bandwidth):
    """f(x) = sum_i K(x - x_i) y_i / sum_k K(x - x_k), Gaussian K(u) = exp(-||u||^2 / (2 h^2))."""
    batch, target_len = queries.shape[0], queries.shape[1]
    predictions = torch.zeros(batch, target_len, *values.shape[2:], dtype=F64)
    for b in range(batch):
        for i in range(target_len):
            kernels = [math.exp(-float(((queries[b, i] - keys[b, j]) ** 2).sum()) / (2 * bandwidth**2))
                       for j in range(keys.shape[1])]
            total = sum(kernels)
            for j, kernel in enumerate(kernels):
                predictions[b, i] += kernel / total * values[b, j]
    return predictions


def _d2l_data(seed=0):
    """d2l's toy problem: y = 2 sin(x) + x^0.8 + noise on sorted x in [0, 5)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.sort(torch.rand(2, 20, generator=generator, dtype=F64) * 5).values
    values = 2 * torch.sin(keys) + keys**0.8 + 0.5 * torch.randn(2, 20, generator=generator, dtype=F64)
    queries = torch.arange(0, 5, 0.5, dtype=F64).expand(2, -1)
    return queries, keys, values


@pytest.mark.parametrize("bandwidth", [0.3, 1.0, 2.5])
def test_scalar_regression_matches_loop(bandwidth):
    queries, keys, values = _d2l_data()
    predictions, weights = NadarayaWatson(bandwidth=bandwidth)(queries, keys, values)
    assert predictions.shape == (2, 10) and weights.shape == (2, 10, 20)
    torch.testing.assert_close(predictions, _loop_estimate(queries, keys, values, bandwidth),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 10, dtype=F64))


def test_vector_inputs_and_outputs_match_loop():
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(2, 4, 3, generator=generator, dtype=F64)
    keys = torch.randn(2, 6, 3, generator=generator, dtype=F64)
    values = torch.randn(2, 6, 5, generator=generator, dtype=F64)
    predictions, _ = NadarayaWatson(bandwidth=0.8)(queries, keys, values)
    assert predictions.shape == (2, 4, 5)
    torch.testing.assert_close(predictions, _loop_estimate(queries, keys, values, 0.8),
                               rtol=1e-10, atol=1e-12)


def test_bandwidth_limits_nearest_neighbour_and_mean():
    queries, keys, values = _d2l_data()
    narrow, _ = NadarayaWatson(bandwidth=1e-3)(queries, keys, values)
    nearest = (queries.unsqueeze(-1) - keys.unsqueeze(-2)).abs().argmin(-1)
    torch.testing.assert_close(narrow, values.gather(1, nearest))
    wide, _ = NadarayaWatson(bandwidth=1e4)(queries, keys, values)
    torch.testing.assert_close(wide, values.mean(-1, keepdim=True).expand(-1, 10))


@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("bandwidth", [1e-20, 1e-170])
def test_a_width_whose_inverse_square_overflows_still_picks_the_nearest_point(bandwidth, learnable):
    """Below h = 4e-20, 0.5 / h^2 is past float32: every score was -inf (predictions 0) and a key
    on the query 0 * -inf = NaN; below h = 2e-162, h**2 underflowed and raised ZeroDivisionError.
    The limit is the nearest point's value, also where a padded point lies nearer."""
    queries = torch.tensor([[0.0, 1.0]])
    keys = torch.tensor([[0.0, 0.9, 5.0, 1.0]])  # the first query sits on a key
    values = torch.tensor([[10.0, 30.0, 50.0, 70.0]])
    key_mask = torch.tensor([[True, True, True, False]])  # the exact match of the second is padding
    model = NadarayaWatson(bandwidth=bandwidth, learnable=learnable)
    predictions, weights = model(queries, keys, values, key_mask=key_mask)
    assert predictions.tolist() == [[10.0, 30.0]]
    assert weights.tolist() == [[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]]
    if learnable:  # an optimiser step must not write NaN into the width (0 * inf in exp's backward)
        predictions.sum().backward()
        assert bool(torch.isfinite(model.log_bandwidth.grad))


def test_key_mask_equals_dropping_the_points():
    queries, keys, values = _d2l_data()
    key_mask = torch.ones(2, 20, dtype=torch.bool)
    key_mask[:, 12:] = False
    module = NadarayaWatson(bandwidth=0.7)
    masked, weights = module(queries, keys, values, key_mask=key_mask)
    truncated, _ = module(queries, keys[:, :12], values[:, :12])
    torch.testing.assert_close(masked, truncated)
    assert torch.all(weights[..., 12:] == 0)


def test_learnable_bandwidth_gets_a_gradient_and_fixed_does_not():
    queries, keys, values = _d2l_data()
    learnable = NadarayaWatson(bandwidth=0.5, learnable=True)
    assert [name for name, _ in learnable.named_parameters()] == ["log_bandwidth"]
    learnable(queries.float(), keys.float(), values.float())[0].pow(2).sum().backward()
    assert learnable.log_bandwidth.grad is not None and learnable.log_bandwidth.grad != 0
    fixed = NadarayaWatson(bandwidth=0.5)
    assert list(fixed.parameters()) == [] and fixed.bandwidth == 0.5
    assert learnable.bandwidth == pytest.approx(0.5)


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, float("inf"), float("nan")])
def test_bad_bandwidth(bandwidth):
    with pytest.raises(ValueError, match="bandwidth must be a positive finite number"):
        NadarayaWatson(bandwidth=bandwidth)


@pytest.mark.parametrize(("shapes", "match"), [
    (((2, 5), (2, 6, 1), (2, 6)), "keys must have the rank"),
    (((2, 5, 3), (2, 6, 2), (2, 6)), "keys must have the rank and feature size"),
    (((2, 5), (2, 6), (2, 7)), "share the batch size"),
    (((5,), (6,), (6,)), r"queries must have shape \(b, n\)"),
])
def test_shape_errors(shapes, match):
    with pytest.raises(ValueError, match=match):
        NadarayaWatson()(*(torch.zeros(shape) for shape in shapes))


def test_integer_inputs_are_refused():
    # Integer targets once gave integer predictions: every weight truncated to 0.
    with pytest.raises(TypeError, match="values must be floating point"):
        NadarayaWatson()(
            torch.tensor([[0.2, 2.7]]), torch.tensor([[0.0, 1, 2, 3]]), torch.tensor([[10, 20, 30, 40]])
        )


@pytest.mark.parametrize("learnable", [False, True])
def test_float16_points_far_apart_keep_their_weights(learnable):
    """float16 squared distances overflowed past a distance of 256: every score -inf and a
    prediction of 0, where the formula's weights are near uniform (a width of 1000)."""
    queries, keys, values = torch.tensor([[0.0]]), torch.tensor([[300.0, 400.0]]), torch.tensor([[1.0, 2.0]])
    expected = _loop_estimate(queries.double(), keys.double(), values.double(), 1000.0)  # (1, 1)
    module = NadarayaWatson(bandwidth=1000.0, learnable=learnable, dtype=torch.float16 if learnable else None)
    predictions, weights = module(queries.half(), keys.half(), values.half())
    assert predictions.dtype == torch.float16 and weights.dtype == torch.float16
    torch.testing.assert_close(predictions.double(), expected, rtol=2e-3, atol=0)  # float16's rounding
    torch.testing.assert_close(weights.double().sum(-1), torch.ones(1, 1, dtype=F64), rtol=2e-3, atol=0)
    # a narrow width: scores of -4.2e4 and -7.6e4 (float16 ends at -65504): the nearest point's value
    nearest, _ = NadarayaWatson(bandwidth=1.0)(torch.tensor([[10.0]]).half(), keys.half(), values.half())
    assert nearest.item() == 1.0


def test_inputs_of_another_dtype_or_device_than_the_learnable_width_are_named():
    """A float64 learnable width took float32 inputs in silence (the width cast down); a key mask
    or width on another device failed inside PyTorch naming no argument."""
    queries, keys, values = torch.rand(1, 3), torch.rand(1, 4), torch.rand(1, 4)
    message = "queries has dtype torch.float32 but the module's parameters are torch.float64"
    with pytest.raises(TypeError, match=message):
        NadarayaWatson(learnable=True, dtype=F64)(queries, keys, values)
    with pytest.raises(ValueError, match="key_mask is on meta but the queries are on cpu"):
        NadarayaWatson()(queries, keys, values, key_mask=torch.ones(1, 4, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="queries is on cpu but the module's parameters are on meta"):
        NadarayaWatson(learnable=True, device="meta")(queries, keys, values)
