"""The pictures at their edges: odd dtypes and devices, NaN and -inf (masked positions), long
sentences, label counts, ``$`` in text, and figures closed on every path (no leak across calls).

Every number is read back from the matplotlib artists and compared with the input tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib", reason='the pictures need matplotlib: pip install "torchvote[plots]"')

import matplotlib.colors  # noqa: E402

from torchvote.explain import attention_plots, capsule_plots, figures  # noqa: E402
from torchvote.explain.figures import pyplot, save_figure  # noqa: E402

plt = pyplot()
TOKENS = ["[CLS]", "the", "train", "left", "[SEP]"]
BAD_MATH = r"it costs $\frac{1$ now"  # two '$': mathtext, and a bad expression between them


@pytest.fixture(autouse=True)
def no_open_figures():
    """Every test here starts and must end without an open figure."""
    plt.close("all")
    yield
    assert plt.get_fignums() == [], "a figure was left open"


def _weights(rows=5, cols=5, seed=0):
    return torch.softmax(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)), dim=-1)


def _close(figure):
    plt.close(figure)


def _grey(rgba):
    return np.allclose(rgba[:3], rgba[0]) and 0.3 < rgba[0] < 0.9 and rgba[3] == 1


# ---------------------------------------------------------------- dtypes, devices, layouts


@pytest.mark.parametrize(
    "convert",
    [
        lambda w: w.half(),
        lambda w: w.bfloat16(),
        lambda w: w.double(),
        lambda w: w.t().contiguous().t(),  # non-contiguous
        lambda w: w.clone().requires_grad_(),
        lambda w: w.to_sparse(),
    ],
    ids=["float16", "bfloat16", "float64", "non-contiguous", "requires-grad", "sparse"],
)
def test_heatmap_draws_any_real_dtype_and_layout(convert):
    weights = _weights()
    expected = convert(weights)
    dense = expected.to_dense() if expected.is_sparse else expected
    expected_values = dense.detach().float()
    figure = attention_plots.attention_heatmap(expected, TOKENS)
    np.testing.assert_allclose(figure.axes[0].images[0].get_array(), expected_values.numpy())
    _close(figure)


def test_integer_and_bool_weights_are_drawn_as_numbers():
    counts = torch.tensor([[0, 3], [1, 2]])
    figure = attention_plots.attention_heatmap(counts, annotate=True)
    np.testing.assert_array_equal(figure.axes[0].images[0].get_array(), [[0.0, 3.0], [1.0, 2.0]])
    assert "3.00" in [t.get_text() for t in figure.axes[0].texts]
    _close(figure)
    figure = capsule_plots.coupling_passes(torch.eye(3, dtype=torch.bool)[None])
    np.testing.assert_array_equal(figure.axes[0].images[0].get_array(), np.eye(3))
    _close(figure)


def test_meta_complex_and_empty_tensors_are_refused_by_name():
    with pytest.raises(ValueError, match="weights is on the meta device"):
        attention_plots.attention_heatmap(torch.empty(3, 3, device="meta"))
    with pytest.raises(TypeError, match="weights must be real"):
        attention_plots.attention_heatmap(torch.randn(3, 3, dtype=torch.cfloat))
    with pytest.raises(ValueError, match="weights must not be empty"):
        attention_plots.attention_heatmap(torch.ones(0, 0))
    with pytest.raises(ValueError, match="couplings must not be empty"):
        capsule_plots.coupling_passes(torch.ones(0, 4, 3))
    with pytest.raises(ValueError, match="entropy must not be empty"):
        capsule_plots.routing_statistics(torch.ones(0))


# ---------------------------------------------------------------- NaN and -inf: masked positions


def test_heatmap_draws_masked_weights_grey_not_as_zero():
    weights = _weights()
    weights[0, 3:] = float("nan")
    weights[2, 1] = float("-inf")
    figure = attention_plots.attention_heatmap(weights, TOKENS)
    image = figure.axes[0].images[0]
    finite = weights[weights.isfinite()]
    assert float(finite.max()) < 1.0
    assert image.get_clim() == pytest.approx((0.0, 1.0))  # the weights' scale; NaN made it (-0.1, 0.1)
    rgba = image.to_rgba(image.get_array())  # (i, j, 4) as drawn
    assert _grey(rgba[0, 3]) and _grey(rgba[2, 1])
    zero = image.to_rgba(np.ma.masked_array([[0.0]]))[0, 0]
    assert not np.allclose(rgba[0, 3], zero)  # not the colour of weight 0 (white in Blues)
    texts = [t.get_text() for t in figure.axes[0].texts]
    assert "nan" in texts and "-inf" in texts
    assert "NaN or inf" in figure.axes[-1].get_ylabel()  # the colour bar says what grey means
    _close(figure)


def test_heatmap_scale_covers_negative_values():
    difference = _weights() - _weights(seed=1)  # e.g. attention after minus before: signed
    figure = attention_plots.attention_heatmap(difference, vmax=None)
    low, high = figure.axes[0].images[0].get_clim()
    assert low == pytest.approx(float(difference.min())) and high == pytest.approx(float(difference.max()))
    assert "-" in figure.axes[-1].get_ylabel()  # the colour bar names the signed range
    _close(figure)
    figure = attention_plots.attention_heatmap(difference)  # the default top: 1, the bottom still signed
    assert figure.axes[0].images[0].get_clim() == pytest.approx((float(difference.min()), 1.0))
    _close(figure)


def test_lines_skip_masked_keys_and_say_so():
    weights = _weights()
    weights[0, 3:] = float("nan")  # keys 3 and 4 masked for query 0
    weights[1] -= 0.5  # negative weights: no line width or opacity below the smallest
    figure = attention_plots.token_attention_lines(weights, TOKENS, 0)
    ax = figure.axes[0]
    assert len(ax.lines) == 3  # one per finite key
    widths = [line.get_linewidth() for line in ax.lines]
    assert np.argsort(widths).tolist() == np.argsort(weights[0, :3].numpy()).tolist()
    labels = [t.get_text() for t in ax.texts]
    assert "left  nan" in labels and "[SEP]  nan" in labels
    _close(figure)
    figure = attention_plots.token_attention_lines(weights, TOKENS, 1)
    assert all(0 <= line.get_alpha() <= 1 for line in figure.axes[0].lines)
    _close(figure)


def test_couplings_nan_grey_and_scale_from_the_finite_values():
    couplings = torch.softmax(torch.randn(2, 4, 3), dim=-2)
    couplings[1, 0, 0] = float("nan")
    figure = capsule_plots.coupling_passes(couplings)
    images = [ax.images[0] for ax in figure.axes if ax.images]
    finite = couplings[couplings.isfinite()]
    deviation = float((finite - 1 / 4).abs().max())  # from the uniform 1/4, the centre of the scale
    assert all(image.get_clim() == pytest.approx((0.25 - deviation, 0.25 + deviation)) for image in images)
    assert _grey(images[1].to_rgba(images[1].get_array())[0, 0])
    _close(figure)


def test_vote_passes_draw_a_vote_of_unknown_weight_as_a_cross():
    votes = torch.randn(6, 4)
    weights = torch.softmax(torch.randn(2, 6), dim=-1)
    weights[0, 2] = float("nan")
    figure = capsule_plots.vote_passes(votes, weights)
    first = figure.axes[0].collections
    assert np.isfinite(first[0].get_sizes()).all()  # NaN sizes made every vote invisible
    assert len(first[0].get_offsets()) == 5  # the other votes, coloured by their weight
    crosses = first[2]
    assert crosses.get_label() == "vote, weight NaN or inf"
    from torchvote.explain.statistics import project_votes

    points, _, _ = project_votes(votes)
    np.testing.assert_allclose(crosses.get_offsets(), points[2:3].numpy(), rtol=1e-5, atol=1e-6)
    assert len(figure.axes[1].collections) == 2  # pass 2 has every weight
    _close(figure)
    votes[1, 1] = float("inf")
    with pytest.raises(ValueError, match="votes must be finite"):
        capsule_plots.vote_passes(votes, weights)


def test_patch_overlay_draws_a_masked_patch_grey():
    weights = torch.arange(4.0)
    weights[1] = float("nan")
    figure = capsule_plots.patch_attention_overlay(torch.rand(4, 4), weights, (2, 2))
    overlay = figure.axes[1].images[1]
    assert overlay.get_clim() == pytest.approx((0.0, 3.0))
    assert matplotlib.colors.to_hex(overlay.cmap.get_bad()) != "#000000"
    assert _grey(overlay.cmap.get_bad())
    _close(figure)


# ---------------------------------------------------------------- long sentences stay legible


def test_a_long_sentence_keeps_the_heatmap_small_and_labels_every_kth_token():
    count = 300
    tokens = [f"t{n}" for n in range(count)]
    weights = torch.softmax(torch.randn(count, count), dim=-1)
    figure = attention_plots.attention_heatmap(weights, tokens)
    assert max(figure.get_size_inches()) <= figures.MAX_INCHES  # it was 128 x 127 inches
    ax = figure.axes[0]
    np.testing.assert_allclose(ax.images[0].get_array(), weights.numpy())
    labels = [t.get_text() for t in ax.get_xticklabels()]
    positions = list(ax.get_xticks())
    assert len(labels) <= attention_plots.LABEL_LIMIT
    assert labels == [tokens[int(p)] for p in positions] and positions[:2] == [0, 5]
    assert "1 in 5 labelled" in ax.get_xlabel() and "1 in 5 labelled" in ax.get_ylabel()
    _close(figure)


def test_long_sentences_keep_every_figure_within_bounds():
    count = 400
    tokens = [f"t{n}" for n in range(count)]
    weights = torch.softmax(torch.randn(count, count), dim=-1)
    figure = attention_plots.token_attention_lines(weights, tokens, 7)
    assert max(figure.get_size_inches()) <= figures.MAX_INCHES
    sizes = {t.get_fontsize() for t in figure.axes[0].texts if t.get_text() != figure.axes[0].get_title()}
    assert max(sizes) < 10  # the font shrinks so rows do not overlap
    _close(figure)
    figure = attention_plots.attention_grid(torch.softmax(torch.randn(4, 40, 6, 6), -1))
    assert max(figure.get_size_inches()) <= figures.MAX_INCHES
    _close(figure)
    figure = capsule_plots.reconstructions(torch.rand(60, 4, 4), torch.rand(60, 4, 4))
    assert max(figure.get_size_inches()) <= figures.MAX_INCHES
    _close(figure)


def test_many_capsule_labels_are_thinned_not_dropped():
    inputs = [f"in{n}" for n in range(50)]
    figure = capsule_plots.coupling_passes(torch.rand(1, 3, 50), input_labels=inputs)
    labels = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert labels == inputs[::3]  # more than 20 labels used to draw none
    _close(figure)


def test_one_token_one_head_one_pass():
    figure = attention_plots.attention_heatmap(torch.ones(1, 1), ["[CLS]"])
    assert figure.axes[0].images[0].get_array().tolist() == [[1.0]]
    _close(figure)
    figure = attention_plots.attention_grid(torch.ones(1, 1, 1), ["[CLS]"])
    assert sum(1 for ax in figure.axes if ax.images) == 1
    _close(figure)
    figure = attention_plots.token_attention_lines(torch.ones(1, 1, 1), ["[CLS]"], 0)
    assert len(figure.axes[0].lines) == 1
    _close(figure)
    figure = capsule_plots.coupling_passes([torch.full((2, 3), 0.5)], totals=True)
    assert list(figure.axes[-1].get_xticks()) == [1]
    _close(figure)
    figure = capsule_plots.routing_statistics(torch.tensor([0.7]), torch.tensor([0.2]))
    assert figure.axes[0].lines[0].get_xdata().tolist() == [1]
    _close(figure)


# ---------------------------------------------------------------- labels: counts and text


def test_grid_labels_match_rows_and_columns():
    attentions = torch.softmax(torch.randn(2, 3, 4, 5), dim=-1)  # (layers, h, i=4, j=5)
    with pytest.raises(ValueError, match="tokens must have 4 entries"):
        attention_plots.attention_grid(attentions, TOKENS)  # 5 labels for 4 rows used to pass
    figure = attention_plots.attention_grid(attentions, TOKENS[:4], key_tokens=TOKENS)
    corner = figure.axes[3]  # last layer, head 0
    assert [t.get_text() for t in corner.get_yticklabels()] == TOKENS[:4]
    assert [t.get_text() for t in corner.get_xticklabels()] == TOKENS
    colorbar = figure.axes[-1]
    assert not colorbar.images and colorbar.get_ylim() == pytest.approx((0.0, 1.0))
    _close(figure)


def test_label_counts_are_checked_by_name():
    couplings = torch.rand(2, 4, 3)
    with pytest.raises(ValueError, match="output_labels must have 4 entries, got 2"):
        capsule_plots.coupling_passes(couplings, output_labels=["a", "b"], totals=True)
    with pytest.raises(ValueError, match="output_labels must have 4 entries, got 2"):
        capsule_plots.coupling_passes(couplings, output_labels=["a", "b"])  # drew 2 of 4 rows
    with pytest.raises(ValueError, match="input_labels must have 3 entries"):
        capsule_plots.coupling_passes(couplings, input_labels=list("abcd"))
    with pytest.raises(TypeError, match="input_labels must be a sequence"):
        capsule_plots.coupling_passes(couplings, input_labels="abc")
    with pytest.raises(ValueError, match=r"couplings\[1\] has shape \(4, 2\)"):
        capsule_plots.coupling_passes([torch.rand(4, 3), torch.rand(4, 2)])
    with pytest.raises(ValueError, match="labels must have 2 entries, got 1"):
        capsule_plots.reconstructions(torch.rand(2, 4, 4), torch.rand(2, 4, 4), labels=["a"])
    with pytest.raises(ValueError, match="labels must have 2 entries, got 3"):
        capsule_plots.multimnist_reconstructions(*torch.rand(3, 2, 4, 4), labels=list("abc"))
    with pytest.raises(TypeError, match="tokens must be a sequence of the i query tokens"):
        attention_plots.token_attention_lines(_weights(), None, 0)
    with pytest.raises(TypeError, match="query must be an integer index"):
        attention_plots.token_attention_lines(_weights(), TOKENS, 1.5)
    with pytest.raises(ValueError, match="inputs must have 1 \\(gray\\) or 3 \\(RGB\\) channels"):
        capsule_plots.reconstructions(torch.rand(2, 2, 4, 4), torch.rand(2, 2, 4, 4))
    with pytest.raises(ValueError, match="inputs must not be empty"):
        capsule_plots.reconstructions(torch.rand(0, 4, 4), torch.rand(0, 4, 4))
    with pytest.raises(ValueError, match="at least 2 steps"):
        capsule_plots.perturbation_grid(torch.rand(3, 1, 4, 4))  # one column was labelled -0.25


def _every_picture(text):
    """Every picture with ``text`` as its title and, where it takes them, its labels."""
    couplings = torch.softmax(torch.randn(2, 3, 3), dim=-2)
    labels = [text, "b", "c"]
    images = torch.rand(2, 4, 4)
    return [
        attention_plots.attention_heatmap(_weights(3, 3), labels, title=text),
        attention_plots.attention_grid(torch.softmax(torch.randn(2, 2, 3, 3), -1), labels, title=text),
        attention_plots.token_attention_lines(_weights(3, 3), labels, 0, title=text),
        attention_plots.token_attention_lines(_weights(3, 3), labels, 0),
        capsule_plots.coupling_passes(
            couplings, input_labels=labels, output_labels=labels, totals=True, title=text
        ),
        capsule_plots.routing_statistics(torch.rand(2), torch.rand(2), title=text),
        capsule_plots.vote_passes(torch.randn(4, 3), torch.rand(2, 4), title=text),
        capsule_plots.reconstructions(images, images, labels=[text, "x"], title=text),
        capsule_plots.perturbation_grid(torch.rand(2, 3, 4, 4), title=text),
        capsule_plots.multimnist_reconstructions(*torch.rand(3, 2, 4, 4), labels=[text, "x"], title=text),
        capsule_plots.patch_attention_overlay(torch.rand(4, 4), torch.rand(4), (2, 2), title=text),
    ]


def test_dollar_signs_in_labels_and_titles_are_drawn_as_text(tmp_path):
    for index, figure in enumerate(_every_picture(BAD_MATH)):
        # a mathtext parse error at draw time failed the picture (and left it open)
        save_figure(figure, tmp_path / f"p{index}", formats=("svg",))
    image = torch.rand(1, 4, 4)
    figure = capsule_plots.reconstructions(image, image, labels=["$x$"], title="$y$")
    figure.canvas.draw()
    assert figure.axes[0].get_title() == r"\$x\$" and figure._suptitle.get_text() == r"\$y\$"
    _close(figure)


# ---------------------------------------------------------------- figures closed on every path


def test_no_figure_is_left_open_across_many_calls(tmp_path):
    for round_ in range(3):
        for index, figure in enumerate(_every_picture("a label")):
            save_figure(figure, tmp_path / f"r{round_}-{index}", formats=("png",), dpi=30)
        assert plt.get_fignums() == []
    with pytest.raises(ValueError, match="agreement must have entropy's shape"):
        capsule_plots.routing_statistics(torch.rand(3), torch.rand(2))  # left its figure open
    assert plt.get_fignums() == []


def test_save_figure_closes_the_figure_when_drawing_fails(tmp_path):
    figure = attention_plots.attention_heatmap(_weights())
    figure.text(0.5, 0.5, r"$\frac{1$")  # the caller's own mathtext: a parse error on drawing
    with pytest.raises(ValueError):
        save_figure(figure, tmp_path / "broken")
    assert plt.get_fignums() == []
    assert list(tmp_path.iterdir()) == []  # no half-written file, no temporary left behind


def test_save_figure_checks_every_format_before_writing(tmp_path):
    with pytest.raises(ValueError, match="formats must be distinct names"):
        save_figure(attention_plots.attention_heatmap(_weights()), tmp_path / "x", formats=("png", "jpeg"))
    assert list(tmp_path.iterdir()) == []  # x.png was written before 'jpeg' was refused
    with pytest.raises(TypeError, match="formats must be a sequence"):
        save_figure(attention_plots.attention_heatmap(_weights()), tmp_path / "x", formats="png")
    with pytest.raises(ValueError, match="dpi must be a positive integer"):
        save_figure(attention_plots.attention_heatmap(_weights()), tmp_path / "x", dpi=0)
    assert plt.get_fignums() == []
    mine = plt.figure()
    with pytest.raises(TypeError, match="figure must be a matplotlib Figure, got NoneType"):
        save_figure(None, tmp_path / "x")
    assert plt.get_fignums() == [mine.number]  # someone else's figure is left alone
    plt.close(mine)


def test_save_figure_replaces_a_file_whole(tmp_path):
    old = tmp_path / "x.png"
    old.write_bytes(b"old")
    [path] = save_figure(attention_plots.attention_heatmap(_weights()), tmp_path / "x", formats=("png",))
    assert path == old and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.png"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()  # not a temporary file's 0600


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_routing_statistics_label_nearly_equal_values_without_an_offset():
    """Agreement that moves by 1e-7 around 1e-3 was labelled "1e-7+1.079e-3" above the axis."""
    figure = capsule_plots.routing_statistics(torch.tensor([0.5, 0.4, 0.3]),
                                              torch.tensor([1.0790e-3, 1.0791e-3, 1.0792e-3]))
    figure.canvas.draw()
    for ax in figure.axes:
        assert ax.yaxis.get_offset_text().get_text() == ""
    pyplot().close(figure)


def test_routing_statistics_draw_a_tiny_change_flat_and_a_real_one_as_it_is():
    """An entropy moving from 2.3025851 to 2.3025853 filled the panel: a steep line out of a
    change of 2e-7 (review finding). A change under 1% of the values now spans at most half the
    axis; a real change is autoscaled as before."""
    tiny = torch.tensor([2.3025851, 2.3025852, 2.3025853], dtype=torch.float64)
    real = torch.tensor([2.30, 1.90, 1.20])
    figure = capsule_plots.routing_statistics(tiny, real)
    (low, high), (real_low, real_high) = figure.axes[0].get_ylim(), figure.axes[1].get_ylim()
    assert low < 2.3025851 and high > 2.3025853 and high - low >= 0.02 * 2.3025853 * 0.99
    assert real_low <= 1.20 and real_high >= 2.30 and real_high - real_low < 1.5  # autoscaled: no floor
    pyplot().close(figure)


def test_a_wide_matrix_gets_a_wide_heatmap():
    """Each side is sized by its own count of cells: an 8 x 16 matrix (the demo's) was drawn in a
    square figure by the larger count, a wide strip between two bands of white."""
    wide = attention_plots.attention_heatmap(torch.softmax(torch.randn(8, 16), dim=-1))
    square = attention_plots.attention_heatmap(torch.softmax(torch.randn(16, 16), dim=-1))
    wide_width, wide_height = wide.get_size_inches()
    square_width, square_height = square.get_size_inches()
    assert wide_width == pytest.approx(square_width)  # the same 16 keys across
    assert wide_height < 0.7 * square_height  # 8 queries down, not 16
    _close(wide)
    _close(square)
