"""Every picture: written as non-empty PNG and SVG, and drawn from the numbers it was given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib", reason='the pictures need matplotlib: pip install "torchvote[plots]"')

from torchvote.explain import attention_plots, capsule_plots  # noqa: E402
from torchvote.explain.figures import close_figure, save_figure  # noqa: E402
from torchvote.explain.statistics import coupling_entropy, project_votes  # noqa: E402

TOKENS = ["[CLS]", "the", "train", "left", "[SEP]"]


def _saved(figure, tmp_path, name):
    paths = save_figure(figure, tmp_path / name)
    assert [p.suffix for p in paths] == [".png", ".svg"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in paths[1].read_bytes()[:2000]
    assert all(p.stat().st_size > 1000 for p in paths)
    return paths


@pytest.fixture
def weights():
    torch.manual_seed(0)
    return torch.softmax(torch.randn(3, 2, 5, 5), dim=-1)  # (layers, h, i, j)


def test_heatmap_shows_the_weights_and_labels(weights, tmp_path):
    figure = attention_plots.attention_heatmap(weights[0, 0], TOKENS, title="t")
    ax = figure.axes[0]
    np.testing.assert_allclose(ax.images[0].get_array(), weights[0, 0].numpy())
    assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS
    assert f"{float(weights[0, 0, 1, 2]):.2f}" in [t.get_text() for t in ax.texts]
    _saved(figure, tmp_path, "heatmap")
    with pytest.raises(ValueError, match="tokens must have 5"):
        attention_plots.attention_heatmap(weights[0, 0], TOKENS[:3])


def test_grid_has_one_panel_per_layer_and_head(weights, tmp_path):
    figure = attention_plots.attention_grid(weights, TOKENS)
    panels = [ax for ax in figure.axes if ax.images]
    assert len(panels) == 3 * 2
    np.testing.assert_allclose(panels[3].images[0].get_array(), weights[1, 1].numpy())  # row-major
    _saved(figure, tmp_path, "grid")


def test_lines_follow_the_weights(weights, tmp_path):
    row = weights[2].mean(0)[2]  # what query 2 ("train") gives every key
    figure = attention_plots.token_attention_lines(weights[2], TOKENS, 2)
    widths = [line.get_linewidth() for line in figure.axes[0].lines]
    assert len(widths) == 5
    assert np.argsort(widths).tolist() == np.argsort(row.numpy()).tolist()
    labels = [t.get_text() for t in figure.axes[0].texts]
    assert f"left  {float(row[3]):.2f}" in labels
    _saved(figure, tmp_path, "lines")
    with pytest.raises(ValueError, match="query must index"):
        attention_plots.token_attention_lines(weights[2], TOKENS, 7)


def test_coupling_passes_and_statistics(tmp_path):
    couplings = torch.softmax(torch.randn(3, 4, 10, 6), dim=-2)  # (t, b, i, j): over the outputs
    figure = capsule_plots.coupling_passes(couplings[:, 0])
    panels = [ax for ax in figure.axes if ax.images]
    assert len(panels) == 3
    np.testing.assert_allclose(panels[2].images[0].get_array(), couplings[2, 0].numpy())
    _saved(figure, tmp_path, "couplings")
    entropy = coupling_entropy(couplings)
    agreement = torch.tensor([0.1, 0.4, 0.5])
    figure = capsule_plots.routing_statistics(entropy, agreement)
    np.testing.assert_allclose(figure.axes[0].lines[0].get_ydata(), entropy.numpy())
    np.testing.assert_allclose(figure.axes[1].lines[0].get_ydata(), agreement.numpy())
    _saved(figure, tmp_path, "statistics")


def test_vote_passes_plot_the_projection(tmp_path):
    votes = torch.randn(30, 16)
    weights = torch.softmax(torch.randn(3, 30), dim=-1)  # (t, j)
    figure = capsule_plots.vote_passes(votes, weights)
    points, centres, _ = project_votes(votes, (weights @ votes) / weights.sum(-1, keepdim=True))
    scatters = figure.axes[1].collections  # pass 2: votes, then their weighted mean
    np.testing.assert_allclose(scatters[0].get_offsets(), points.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scatters[1].get_offsets()[0], centres[1].numpy(), rtol=1e-5, atol=1e-6)
    sizes = scatters[0].get_sizes()
    assert np.argmax(sizes) == int(weights[1].argmax())
    _saved(figure, tmp_path, "votes")


def test_vote_passes_still_take_the_outputs_it_no_longer_draws():
    """The star became the votes' weighted mean, which needs no argument: a caller that passes the
    outputs (the old third argument) gets the same figure and a FutureWarning, not a TypeError."""
    votes, weights = torch.randn(30, 16), torch.softmax(torch.randn(3, 30), dim=-1)
    with pytest.warns(FutureWarning, match="consensus is no longer drawn"):
        old_call = capsule_plots.vote_passes(votes, weights, torch.randn(3, 16))
    new_call = capsule_plots.vote_passes(votes, weights)
    for old_axes, new_axes in zip(old_call.axes, new_call.axes, strict=True):
        for old_points, new_points in zip(old_axes.collections, new_axes.collections, strict=True):
            np.testing.assert_array_equal(old_points.get_offsets(), new_points.get_offsets())
    close_figure(old_call)
    close_figure(new_call)


def test_images_reconstructions_perturbations_multimnist_patches(tmp_path):
    inputs, outputs = torch.rand(4, 28, 28), torch.rand(4, 28, 28)
    figure = capsule_plots.reconstructions(inputs, outputs, labels=[1, 2, 3, 4])
    np.testing.assert_allclose(figure.axes[4 + 1].images[0].get_array(), outputs[1].numpy())  # row 2, col 2
    _saved(figure, tmp_path, "reconstructions")
    grid = torch.rand(16, 11, 28, 28)
    figure = capsule_plots.perturbation_grid(grid)
    ticks = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert len(ticks) == 11 and ticks[0] == "-0.25" and ticks[5] == "+0" and ticks[10] == "+0.25"
    five = capsule_plots.perturbation_grid(torch.rand(2, 5, 4, 4))  # +-0.125 read "+-0.12"
    labels = [t.get_text() for t in five.axes[0].get_xticklabels()]
    assert labels == ["-0.25", "-0.125", "+0", "+0.125", "+0.25"]
    close_figure(five)
    mosaic = figure.axes[0].images[0].get_array()  # tiles 28 x 28 with 1-pixel gaps
    np.testing.assert_allclose(mosaic[2 * 29 : 2 * 29 + 28, 7 * 29 : 7 * 29 + 28], grid[2, 7].numpy())
    _saved(figure, tmp_path, "perturbations")
    first, second = torch.rand(3, 36, 36), torch.rand(3, 36, 36)
    figure = capsule_plots.multimnist_reconstructions(torch.rand(3, 36, 36), first, second)
    colour = figure.axes[3].images[0].get_array()  # row 2, column 1: (H, W, 3)
    np.testing.assert_allclose(colour[..., 0], first[0].numpy(), rtol=1e-6)
    np.testing.assert_allclose(colour[..., 1], second[0].numpy(), rtol=1e-6)
    _saved(figure, tmp_path, "multimnist")
    figure = capsule_plots.patch_attention_overlay(torch.rand(28, 28), torch.arange(16.0), (4, 4))
    heat = figure.axes[1].images[1].get_array()
    assert heat.shape == (28, 28) and heat[0, 0] == 0 and heat[27, 27] == 15
    _saved(figure, tmp_path, "patches")
