"""The figure review's findings, checked through the drawn matplotlib objects: what each picture
says (titles, axis and colour-bar labels), where it puts the marks and on which colour scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib", reason='the pictures need matplotlib: pip install "torchvote[plots]"')

from torchvote.explain import attention_plots, capsule_plots, sentences  # noqa: E402
from torchvote.explain.figures import close_figure  # noqa: E402
from torchvote.explain.record import explain_record  # noqa: E402
from torchvote.explain.statistics import project_votes  # noqa: E402

TOKENS = ["[CLS]", "the", "train", "left", "[SEP]"]


def _colour_bar(figure):
    """The colour bar's axes (the one whose label was set by ``figure.colorbar``)."""
    (bar,) = [ax for ax in figure.axes if ax.get_label() == "<colorbar>"]
    return bar


def _votes(outputs: int = 10):
    """Votes far from the origin (their squashed sum lies far outside them) and couplings that
    move away from the uniform ``1 / outputs``."""
    torch.manual_seed(0)
    votes = torch.randn(40, 8) * 0.05 + torch.linspace(0.1, 0.8, 8)  # (j, d)
    uniform = torch.full((40,), 1.0 / outputs)
    moved = uniform * (1 + 0.2 * torch.randn(40)).clamp(min=0.1)
    return votes, torch.stack([uniform, moved, moved.square() * outputs])  # (t, j)


# -------------------------------------------------------------------- 1. votes-2d


def test_votes_star_is_the_weighted_mean_of_the_votes_not_the_squashed_sum():
    votes, weights = _votes()
    figure = capsule_plots.vote_passes(votes, weights, uniform=0.1)
    means = (weights @ votes) / weights.sum(dim=1, keepdim=True)  # (t, d): s_i / sum_j c_ij
    points, centres, _ = project_votes(votes, means)
    for t in range(3):
        ax = figure.axes[t]
        star = next(c for c in ax.collections if "weighted mean of the votes" in c.get_label())
        np.testing.assert_allclose(star.get_offsets()[0], centres[t].numpy(), rtol=1e-4, atol=1e-5)
        assert "direction of s_i" in star.get_label()
        np.testing.assert_allclose(ax.collections[0].get_offsets(), points.numpy(), rtol=1e-5, atol=1e-6)
        assert ax.get_aspect() == 1.0  # equal scales: distances in the plane are distances
    close_figure(figure)


def test_votes_colour_and_size_show_the_coupling_against_the_uniform_one():
    votes, weights = _votes()
    figure = capsule_plots.vote_passes(votes, weights, uniform=0.1)
    for t in range(3):
        drawn = figure.axes[t].collections[0]
        np.testing.assert_allclose(drawn.get_array(), weights[t].numpy(), rtol=1e-6)  # coloured by c
        np.testing.assert_allclose(drawn.get_sizes(), capsule_plots.VOTE_AREA * weights[t].numpy() / 0.1,
                                   rtol=1e-5)  # area relative to the uniform coupling: 1 x at 0.1
    low, high = figure.axes[0].collections[0].get_clim()
    assert (low + high) / 2 == pytest.approx(0.1)  # white at the uniform coupling
    assert high == pytest.approx(float(weights.max()))
    assert "uniform 0.1" in _colour_bar(figure).get_ylabel()
    close_figure(figure)


# -------------------------------------------------------------------- 2, 3. couplings


def test_couplings_diverge_from_the_uniform_coupling_on_symmetric_limits():
    couplings = torch.full((3, 10, 6), 0.1)  # pass 1: uniform
    couplings[1, 3] = 0.12
    couplings[2, 3] = 0.2
    couplings[2, 4] = 0.07
    figure = capsule_plots.coupling_passes(couplings)
    images = [ax.images[0] for ax in figure.axes if ax.images]
    assert all(image.get_clim() == pytest.approx((0.0, 0.2), abs=1e-6) for image in images)  # 0.1 +- 0.1
    label = _colour_bar(figure).get_ylabel()
    assert "uniform 1/10" in label and "largest deviation" in label
    one_pass = capsule_plots.coupling_passes(couplings[:1])  # 0.1 is the same colour in both
    np.testing.assert_allclose(one_pass.axes[0].images[0].to_rgba(np.array([0.1])),
                               images[0].to_rgba(np.array([0.1])))
    close_figure(figure)
    close_figure(one_pass)


def test_couplings_take_axis_labels_and_wrap_many_passes():
    figure = capsule_plots.coupling_passes(torch.softmax(torch.randn(6, 3, 12), 1), totals=True,
                                           xlabel="test digit j", ylabel="receiver i")
    maps = [ax for ax in figure.axes if ax.images]
    assert [ax.get_xlabel() for ax in maps] == [""] * 3 + ["test digit j"] * 3  # under the last row
    assert maps[0].get_ylabel() == maps[3].get_ylabel() == "receiver i"
    rows = sorted({round(ax.get_position().y0, 3) for ax in maps})
    assert len(rows) == 2  # 6 passes on 2 rows of 3, not one 18-inch row
    assert figure.get_size_inches()[0] < 12
    close_figure(figure)


# -------------------------------------------------------------------- 4, 5, 6. heatmaps


def test_attention_heatmap_reads_0_to_1_and_says_so():
    weights = torch.softmax(torch.randn(5, 5), dim=-1) * 0.5
    figure = attention_plots.attention_heatmap(weights, TOKENS)
    assert figure.axes[0].images[0].get_clim() == pytest.approx((0.0, 1.0))
    assert "0 to 1" in _colour_bar(figure).get_ylabel()
    close_figure(figure)
    own = attention_plots.attention_heatmap(weights, TOKENS, vmax=None)
    assert own.axes[0].images[0].get_clim() == pytest.approx((0.0, float(weights.max())))
    assert "this map's max" in _colour_bar(own).get_ylabel()
    close_figure(own)


def test_rollout_is_labelled_as_tokens_through_layers_not_queries_and_keys():
    rollout = torch.softmax(torch.randn(5, 5), dim=-1)
    figure = sentences.attention_rollout_figure(rollout, TOKENS, crop=" (tokens 1-5 of 9)")
    ax = figure.axes[0]
    assert ax.get_xlabel() == "input token j"
    assert ax.get_ylabel() == "token i after the last layer"
    assert ax.get_title() == "attention rollout through all layers (tokens 1-5 of 9)"
    close_figure(figure)
    assert sentences._crop_note(40, 200) == " (tokens 1-40 of 200)"
    assert sentences._crop_note(9, 9) == ""


@pytest.mark.parametrize("count", [10, 40])
def test_square_heatmap_has_no_blank_band(count):
    figure = attention_plots.attention_heatmap(torch.softmax(torch.randn(count, count), -1),
                                               [f"tok{k}" for k in range(count)], title="title")
    figure.canvas.draw()
    drawn = figure.get_tightbbox(figure.canvas.get_renderer())  # inches
    width, height = figure.get_size_inches()
    assert height - drawn.height < 0.45 and width - drawn.width < 0.45
    assert max(width, height) <= attention_plots.HEATMAP_INCHES + 3.0
    close_figure(figure)


def test_routed_title_counts_passes_in_words():
    assert sentences._routed_title(5, 1, "") == "layer 5 after 1 pass (senders): the softmax attention itself"
    title = sentences._routed_title(2, 3, " (tokens 1-40 of 99)")
    assert title == "layer 2 after 3 passes (senders) (tokens 1-40 of 99)"


# -------------------------------------------------------------------- 7, 8. grid and lines


def test_grid_names_its_axes_and_labels_tokens_readably():
    figure = attention_plots.attention_grid(torch.softmax(torch.randn(2, 3, 5, 5), -1), TOKENS)
    assert "query i" in figure._supylabel.get_text() and "key j" in figure._supxlabel.get_text()
    corner = figure.axes[3]  # bottom-left
    assert [t.get_text() for t in corner.get_yticklabels()] == TOKENS
    assert min(t.get_fontsize() for t in corner.get_xticklabels() + corner.get_yticklabels()) >= 7
    close_figure(figure)


def test_lines_widths_follow_the_weight_itself_and_columns_are_headed():
    weights = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.2, 0.3]])
    widths = []
    for query in (0, 1):
        figure = attention_plots.token_attention_lines(weights, ["a", "b"], query, key_tokens=["x", "y", "z"])
        widths.append([line.get_linewidth() for line in figure.axes[0].lines])
        texts = [t.get_text() for t in figure.axes[0].texts]
        assert "query" in texts and "keys (weight)" in texts
        close_figure(figure)
    assert widths[0][0] == pytest.approx(widths[1][0])  # 0.5 in both rows, though row 0's largest
    assert widths[1][1] < widths[1][2] < widths[1][0]


# -------------------------------------------------------------------- 15, 17. the record's pictures


class _Report:
    """What :func:`explain_record` adds, kept (figures closed)."""

    def __init__(self):
        self.figures, self.texts = {}, []

    def heading(self, text):
        pass

    def text(self, text, *, notice=False):
        self.texts.append(text)

    def figure(self, figure, name, *, caption="", table=None):
        self.figures[name] = (figure, caption)


def test_record_captions_labels_and_notices_name_what_they_show():
    torch.manual_seed(0)
    couplings = torch.softmax(torch.randn(3, 2, 4, 6), dim=2)  # (t, b, i, j)
    record = {
        "couplings": couplings,
        "votes": torch.randn(2, 4, 6, 5),
        "outputs": torch.randn(3, 2, 4, 5),
        "winners": torch.tensor([2, 1]),
        "inputs": torch.rand(2, 8, 8),
        "reconstructions": torch.rand(2, 8, 8),
        "perturbations": torch.rand(3, 11, 8, 8),
        "multimnist_inputs": torch.rand(2, 8, 8),
    }
    report = _Report()
    notices = explain_record(record, report)
    figure, caption = report.figures["couplings"]
    assert "used in pass t" in caption and "pass 1: uniform" in caption
    figure, caption = report.figures["votes-2d"]
    assert "weighted mean of the votes" in caption and "star = output" not in caption
    assert "uniform 0.25" in _colour_bar(figure).get_ylabel()  # 1 / 4 outputs
    figure, _ = report.figures["reconstructions"]
    assert [figure.axes[n].get_title() for n in range(2)] == ["pred 2", "pred 1"]
    figure, _ = report.figures["perturbations"]
    assert figure.axes[0].get_title().startswith("capsule 2 (the prediction) of input 0")
    assert len(notices) == 1 and notices[0].startswith("Picture MultiMNIST skipped")
    assert "multimnist_first" in notices[0]
    for figure, _ in report.figures.values():
        close_figure(figure)


# -------------------------------------------------------------------- 14. patch overlay


def test_patch_overlay_starts_at_0_shows_weight_as_opacity_and_has_an_opaque_colour_bar():
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4])  # the smallest is not 0
    figure = capsule_plots.patch_attention_overlay(torch.rand(4, 4), weights, (2, 2))
    overlay = figure.axes[1].images[1]
    assert overlay.get_clim() == pytest.approx((0.0, 0.4))
    opacity = np.asarray(overlay.get_alpha())  # (H, W): one value per pixel, growing with the weight
    assert opacity.shape == (4, 4) and opacity[0, 0] < opacity[0, 2] < opacity[2, 0] < opacity[2, 2]
    assert _colour_bar(figure).collections[-1].get_alpha() in (None, 1.0)  # not see-through
    close_figure(figure)
