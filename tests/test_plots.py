"""The vote pictures (:mod:`torchvote.explain`) draw exactly the recorded weights, and refuse what
they cannot draw."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib", reason="plots are an optional extra")

from torchvote.explain.attention_plots import attention_grid, attention_heatmap  # noqa: E402
from torchvote.explain.capsule_plots import coupling_passes  # noqa: E402
from torchvote.explain.figures import save_figure  # noqa: E402
from torchvote.explain.metric_plots import metric_curves  # noqa: E402
from torchvote.functional import PairwiseVotes, vote  # noqa: E402


def test_attention_map_shows_the_weights_it_was_given(tmp_path):
    weights = torch.softmax(torch.randn(4, 6), dim=-1)
    figure = attention_heatmap(weights, list("abcd"), list("uvwxyz"))
    image = figure.axes[0].images[0]
    torch.testing.assert_close(torch.as_tensor(image.get_array()), weights)
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == list("uvwxyz")
    [path] = save_figure(figure, tmp_path / "sub" / "attention", formats=("png",))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_routing_plot_has_one_map_per_pass_and_the_received_totals():
    result = vote(PairwiseVotes(torch.randn(1, 3, 5, 2)), None, normalize_over="receivers",
                  iterations=3, nonlinearity="squash", record=True)
    passes = [w[0] for w in result.weights]
    figure = coupling_passes(passes, output_labels=["x", "y", "z"], totals=True)
    maps = [ax for ax in figure.axes if ax.images]
    assert len(maps) == 3
    for ax, w in zip(maps, passes, strict=True):
        torch.testing.assert_close(torch.as_tensor(ax.images[0].get_array()), w)
    totals = figure.axes[-1].lines
    assert len(totals) == 3
    torch.testing.assert_close(torch.as_tensor(totals[0].get_ydata()).float(),
                               torch.stack([w[0].sum() for w in passes]))


def test_heads_and_metrics(tmp_path):
    figure = attention_grid(torch.softmax(torch.randn(5, 3, 3), -1))
    assert sum(1 for ax in figure.axes if ax.images) == 5
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": s, "loss": 1.0 / (s + 1), "split": "train"})
                                 for s in range(5)))
    figure = metric_curves(metrics)
    assert [ax.get_title() for ax in figure.axes] == ["loss"]
    with pytest.raises(ValueError, match="not in"):
        metric_curves(metrics, keys=["accuracy"])


def test_metric_curves_read_a_run_killed_mid_write(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / (s + 1)}) for s in range(4)]
    metrics.write_text("\n".join(lines) + '\n{"step": 4, "lo')  # the last record torn
    (panel,) = metric_curves(metrics).axes
    assert list(panel.lines[0].get_xdata()) == [0, 1, 2, 3]


def test_bad_input_is_refused_with_the_argument_named():
    with pytest.raises(ValueError, match="weights must be 2-D"):
        attention_heatmap(torch.rand(2, 3, 4))
    with pytest.raises(ValueError, match="expected 3 labels"):
        attention_heatmap(torch.rand(3, 3), ["a"])
    with pytest.raises(ValueError, match="at least one pass"):
        coupling_passes([])


def _lines(panel):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in panel.lines}


def test_metric_curves_draw_each_event_and_data_set_as_its_own_line(tmp_path):
    # what MetricsWriter writes: train records, an eval per epoch, final evaluations on two sets;
    # all of them on one line made a zigzag of training and test accuracy at the same step
    records = [
        {"event": "train", "step": 10, "epoch": 0, "time": 1.8e9, "loss": 0.8, "accuracy": 0.5, "ok": True},
        {"event": "train", "step": 20, "epoch": 0, "time": 1.8e9, "loss": "nan", "accuracy": 0.7},
        {"event": "eval", "step": 20, "epoch": 1, "dataset": "mnist/test", "time": 1.8e9, "accuracy": 0.9},
        {"event": "train", "step": 30, "epoch": 1, "time": 1.8e9, "loss": 0.3, "accuracy": 0.8},
        {"event": "final", "step": 30, "dataset": "mnist/test", "source": "", "eval_limit": None,
         "time": 1.8e9, "accuracy": 0.95, "loss": 0.2},
        {"event": "final", "step": 30, "dataset": "affnist-style/test", "source": "affnist-style",
         "eval_limit": 50, "time": 1.8e9, "accuracy": 0.7, "loss": 0.9},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    figure = metric_curves(metrics)
    panels = {ax.get_title(): ax for ax in figure.axes}
    assert sorted(panels) == ["accuracy", "loss"]  # not the wall clock, a flag or eval_limit
    assert _lines(panels["accuracy"]) == {  # in percent, as in training_curves.png
        "train": ([10, 20, 30], [50.0, 70.0, 80.0]),
        "eval mnist/test": ([20], [90.0]),
        "final mnist/test": ([30], [95.0]),
        "final affnist-style/test": ([30], [70.0]),
    }
    steps, losses = _lines(panels["loss"])["train"]
    # "nan" (a non-finite loss as MetricsWriter writes it) turned every value into a category
    assert steps == [10, 20, 30] and losses[0] == 0.8 and np.isnan(losses[1]) and losses[2] == 0.3
    assert panels["loss"].get_legend() is not None
    with pytest.raises(TypeError, match="keys must be a sequence"):
        metric_curves(metrics, keys="loss")
    with pytest.raises(ValueError, match="keys must name at least one field"):
        metric_curves(metrics, keys=[])


def test_metric_curves_wrap_many_fields_into_rows(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, **{f"m{k}": float(k) for k in range(9)}}) + "\n")
    figure = metric_curves(metrics)
    assert len(figure.axes) == 9
    assert max(figure.get_size_inches()) <= 16.0  # 4 panels a row, not 36 inches in one


def test_metric_curves_keep_the_last_value_of_a_step_logged_twice(tmp_path):
    """An older writer's log of a resumed run repeats steps: the line ran back from 30 to 20."""
    records = [{"event": "train", "step": s, "loss": v} for s, v in ((10, 1.0), (20, 0.8), (30, 0.6),
                                                                      (20, 0.7), (30, 0.5), (40, 0.4))]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    panels = {ax.get_title(): ax for ax in metric_curves(metrics).axes}
    assert _lines(panels["loss"]) == {"train": ([10, 20, 30, 40], [1.0, 0.7, 0.5, 0.4])}


def test_training_curves_read_each_panel_on_its_own_and_write_atomically(tmp_path):
    """Evaluation records without a loss lost their accuracy, an accuracy of "nan" became a text
    category, and a record without a step raised KeyError with its figure left open."""
    import matplotlib.pyplot as plt

    from torchvote.training.plots import plot_training_curves

    records = [
        {"event": "train", "step": 10, "loss": 0.9, "accuracy": 0.5},
        {"event": "train", "step": 20, "loss": 0.7, "accuracy": "nan"},
        {"event": "eval", "step": 20, "dataset": "multimnist/test", "accuracy": 0.6},  # no loss
        {"event": "train", "loss": 0.5},  # no step
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    figures_before = len(plt.get_fignums())
    path = plot_training_curves(metrics, tmp_path / "plots" / "training_curves.png")
    assert path == tmp_path / "plots" / "training_curves.png" and path.stat().st_size > 0
    assert len(plt.get_fignums()) == figures_before  # closed
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["training_curves.png"]

    import torchvote.explain.figures as figures

    drawn = []
    save = figures.save_figure

    def keep(figure, stem, **kwargs):
        drawn.append({ax.get_title(): _lines(ax) for ax in figure.axes})
        return save(figure, stem, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(figures, "save_figure", keep)
        plot_training_curves(metrics, tmp_path / "again.png")
    accuracy = drawn[0]["accuracy"]
    assert accuracy["eval multimnist/test"] == ([20.0], [60.0])  # drawn without a loss
    steps, values = accuracy["train"]
    assert steps == [10.0, 20.0] and values[0] == 50.0 and np.isnan(values[1])  # a gap, not a category
    assert drawn[0]["loss"]["train"] == ([3.0, 10.0, 20.0], [0.5, 0.9, 0.7])  # no step: its index


def test_training_curves_show_the_final_evaluation_and_a_single_point(tmp_path):
    """With eval_every=0 (the reproduce rows) the figure had no evaluation at all, and a run of
    one log line drew an empty figure: a line through one point is invisible."""
    import torchvote.explain.figures as figures
    from torchvote.training.plots import plot_training_curves

    records = [
        {"event": "train", "step": 4, "loss": 0.9, "accuracy": 0.5},
        {"event": "final", "step": 4, "dataset": "mnist/test", "loss": 0.8, "accuracy": 0.6},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    drawn = []
    save = figures.save_figure

    def keep(figure, stem, **kwargs):
        drawn.append({ax.get_title(): {line.get_label(): line for line in ax.lines} for ax in figure.axes})
        return save(figure, stem, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(figures, "save_figure", keep)
        plot_training_curves(metrics, tmp_path / "curves.png")
    accuracy = drawn[0]["accuracy"]
    assert list(accuracy["final mnist/test"].get_ydata()) == [60.0]
    assert all(line.get_marker() not in (None, "None", "") for line in accuracy.values())  # visible


def test_flags_suffixes_and_spans_are_checked_as_everywhere_else(tmp_path):
    """Review findings: a flag of "no" was truthy (annotations, the totals panel, cosine agreement),
    ``b.png`` was saved as ``b.png.png``, ``curves.svg`` as a PNG, a span of inf gave NaN poses."""
    import matplotlib.pyplot as plt

    from torchvote.explain.capsule_plots import perturbation_grid
    from torchvote.explain.statistics import perturbation_poses, routing_agreement
    from torchvote.training.plots import plot_training_curves

    with pytest.raises(TypeError, match="annotate must be True or False, got 'no'"):
        attention_heatmap(torch.rand(3, 3), annotate="no")
    with pytest.raises(TypeError, match="totals must be True or False, got 'no'"):
        coupling_passes([torch.rand(3, 4)], totals="no")
    with pytest.raises(TypeError, match="cosine must be True or False, got 'no'"):
        routing_agreement(torch.rand(3, 4, 5), torch.rand(2, 3, 5), cosine="no")
    tokens = ["a", "b", "c"]  # a generator was used up by the rows: "must have 3 entries, got 0"
    figure = attention_heatmap(torch.rand(3, 3), tokens=(token for token in tokens))
    assert [label.get_text() for label in figure.axes[0].get_xticklabels()] == tokens
    plt.close(figure)

    figure = plt.figure()
    with pytest.raises(ValueError, match=r"stem must be the path without its suffix \('.*b'"):
        save_figure(figure, tmp_path / "b.png")
    assert list(tmp_path.iterdir()) == []
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"event": "train", "step": 1, "loss": 0.5, "accuracy": 0.5}) + "\n")
    assert plot_training_curves(metrics, tmp_path / "curves.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(ValueError, match=r"out_path must end in one of \['.png', '.svg', '.pdf'\]"):
        plot_training_curves(metrics, tmp_path / "curves.v2")

    with pytest.raises(ValueError, match=r"span must be a finite number in \(0.0, inf\), got inf"):
        perturbation_poses(torch.zeros(4), span=float("inf"))
    with pytest.raises(TypeError, match="span must be a finite number"):
        perturbation_poses(torch.zeros(4), span="0.25")
    plt.close(perturbation_grid(torch.rand(2, 3, 4, 4), span=np.float32(0.25)))  # refused before


def test_reconstructions_read_8_bit_pixels_and_refuse_0_255_floats():
    """0-255 pixels were clipped to [0, 1]: white tiles without a word (review finding)."""
    import matplotlib.pyplot as plt

    from torchvote.explain.capsule_plots import reconstructions

    pixels = torch.randint(0, 256, (2, 1, 6, 6), dtype=torch.uint8)
    as_bytes = reconstructions(pixels, pixels)
    as_unit = reconstructions(pixels / 255.0, pixels / 255.0)
    for drawn, expected in zip(as_bytes.axes, as_unit.axes, strict=True):
        for image, reference in zip(drawn.images, expected.images, strict=True):
            np.testing.assert_allclose(np.asarray(image.get_array()), np.asarray(reference.get_array()))
    plt.close(as_bytes), plt.close(as_unit)
    with pytest.raises(ValueError, match=r"inputs must hold values in \[0, 1\].*divide 0-255 pixels by 255"):
        reconstructions(pixels.float(), pixels / 255.0)


def _training_figure(tmp_path, records):
    """The figure :func:`plot_training_curves` draws for ``records``, before it is saved."""
    import torchvote.explain.figures as figures
    from torchvote.training.plots import plot_training_curves

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    drawn = []
    save = figures.save_figure

    def keep(figure, stem, **kwargs):
        figure.canvas.draw()  # tick labels as they are shown
        drawn.append({ax.get_title(): ax for ax in figure.axes})
        return save(figure, stem, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(figures, "save_figure", keep)
        plot_training_curves(metrics, tmp_path / "curves.png")
    return drawn[0]


def test_training_curves_are_linear_within_a_decade_with_whole_steps_and_a_visible_final(tmp_path):
    """Review finding 10: losses 0.6 to 2 were drawn on a log axis labelled 6x10^-1, a one-step
    run had steps 0.96 ... 1.04, and the final star hid under the last evaluation's circle."""
    panels = _training_figure(tmp_path, [
        {"event": "train", "step": 1, "loss": 2.0, "accuracy": 0.2},
        {"event": "eval", "step": 1, "dataset": "mnist/test", "loss": 0.6, "accuracy": 0.6},
        {"event": "final", "step": 1, "dataset": "mnist/test", "loss": 0.6, "accuracy": 0.6},
    ])
    assert panels["loss"].get_yscale() == "linear"  # max / min = 3.3
    for ax in panels.values():
        ticks = [float(t.get_text().replace("\u2212", "-")) for t in ax.get_xticklabels() if t.get_text()]
        assert ticks and all(t == int(t) for t in ticks)
        lines = {line.get_label(): line for line in ax.lines}
        final, evaluation = lines["final mnist/test"], lines["eval mnist/test"]
        assert final.get_zorder() > evaluation.get_zorder()
        assert final.get_markersize() > evaluation.get_markersize()
    assert panels["accuracy"].get_ylabel() == "accuracy (%)"
    wide = _training_figure(tmp_path, [{"event": "train", "step": s, "loss": 10.0 ** -s} for s in range(4)])
    assert wide["loss"].get_yscale() == "log"  # three decades
    labels = [t.get_text() for t in wide["loss"].get_yticklabels() if t.get_text()]
    assert "0.01" in labels and not any("10^" in label for label in labels)


def test_metric_curves_colour_each_series_alike_and_skip_bookkeeping(tmp_path):
    """Review finding 11: 'eval mnist/test' was orange in one panel and blue in the next, and the
    example counts got panels of their own."""
    records = [
        {"event": "train", "step": 10, "loss": 0.8, "accuracy": 0.5, "count": 32, "examples": 320},
        {"event": "eval", "step": 10, "dataset": "mnist/test", "loss": 0.7, "accuracy": 0.6, "count": 500},
        {"event": "eval", "step": 20, "dataset": "mnist/test", "accuracy": 0.7, "count": 500},
        {"event": "train", "step": 20, "loss": 0.5, "accuracy": 0.7, "count": 32, "examples": 640},
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    figure = metric_curves(metrics)
    panels = {ax.get_title(): ax for ax in figure.axes}
    assert sorted(panels) == ["accuracy", "loss"]
    colours = [{line.get_label(): line.get_color() for line in ax.lines} for ax in panels.values()]
    assert colours[0] == colours[1] and len(set(colours[0].values())) == 2
    assert panels["accuracy"].get_ylabel() == "accuracy (%)" and panels["loss"].get_ylabel() == "loss"
