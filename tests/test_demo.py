"""The demo's two experiments: attention as retrieval, routing as clustering, on real digits."""

from __future__ import annotations

import sys

import pytest
import torch

from torchvote.data import load_small_digits
from torchvote.demo import attention_retrieval, routing_clustering, run_demo


def test_attention_retrieval_returns_the_own_label_when_the_query_is_among_the_keys():
    images, labels = load_small_digits("test")
    distribution, weights = attention_retrieval(images[:50], images[:200], labels[:200],
                                                bandwidth=0.5)
    assert torch.equal(distribution.argmax(-1), labels[:50])
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    torch.testing.assert_close(distribution, weights @ torch.eye(10)[labels[:200]])


def test_routing_clustering_couplings_split_each_digits_vote():
    images, labels = load_small_digits("test")
    picked = torch.cat([(labels == d).nonzero().squeeze(1)[:20] for d in (0, 1)])
    seeds = torch.stack([images[(labels == d).nonzero()[-1, 0]] for d in (0, 1)])
    passes = routing_clustering(images[picked], seeds, iterations=4)
    assert len(passes) == 4
    for couplings in passes:
        assert couplings.shape == (2, 40)
        torch.testing.assert_close(couplings.sum(0), torch.ones(40))
    # 0s and 1s are far apart in pixel space: routing separates them.
    assignment = passes[-1].argmax(0)
    assert (assignment[:20] == assignment[0]).float().mean() > 0.9
    assert (assignment[20:] != assignment[0]).float().mean() > 0.9


def test_run_demo_end_to_end(tmp_path, capsys):
    report = run_demo(output_dir=tmp_path, num_queries=200, num_keys=2000, cluster_size=50,
                      iterations=3, make_plots=True)
    out = capsys.readouterr().out
    assert "softmax over senders" in out and "softmax over receivers" in out
    assert report.retrieval_accuracy > 0.8  # kernel regression on real MNIST, far above chance
    assert len(report.purity_per_pass) == 3
    assert all(p.exists() for p in report.plots)


def test_demo_command_runs_from_the_cli(monkeypatch, tmp_path):
    from torchvote import cli, demo

    seen = {}
    monkeypatch.setattr(demo, "run_demo", lambda **kw: seen.update(kw))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # --device auto: the CPU here
    assert cli.main(["demo", "--output-dir", str(tmp_path), "--no-plots"]) == 0
    assert seen == {"output_dir": str(tmp_path), "make_plots": False, "device": torch.device("cpu")}
    # --out, as explain and reproduce spell it: an option of its own (argparse took "--out" as an
    # abbreviation of --output-dir before, which --help did not show)
    demo_parser = cli.build_parser()._subparsers._group_actions[0].choices["demo"]
    assert "--out" in demo_parser._option_string_actions
    assert cli.main(["demo", "--out", str(tmp_path / "b"), "--device", "cpu"]) == 0
    assert seen == {"output_dir": str(tmp_path / "b"), "make_plots": True, "device": torch.device("cpu")}


# --- what a first-time user meets ----------------------------------------------------------------


@pytest.fixture
def tiny_mnist_data(tiny_mnist_root, tmp_path, monkeypatch):
    """``load_mnist`` reads the 240 train / 60 test real digits of ``tiny_mnist_root`` (as
    ``$TORCHVOTE_DATA/mnist``), so a whole demo runs in a blink."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "mnist").symlink_to(tiny_mnist_root, target_is_directory=True)
    monkeypatch.setenv("TORCHVOTE_DATA", str(data))
    return data


SMALL = {"num_queries": 3, "num_keys": 5, "cluster_size": 4, "iterations": 2}


def test_run_demo_without_matplotlib_says_that_no_plot_was_written(tiny_mnist_data, tmp_path, capsys,
                                                                   monkeypatch):
    """Without the plots extra the demo still runs, and says why there are no pictures (it used to
    print ``plots:`` followed by nothing)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    report = run_demo(output_dir=tmp_path / "out", make_plots=True, **SMALL)
    out = capsys.readouterr().out
    assert report.plots == []
    assert "plots: none written" in out and "torchvote[plots]" in out
    assert not (tmp_path / "out").exists()


def test_run_demo_draws_few_queries_and_keys_and_labels_receivers_by_their_seed(
    tiny_mnist_data, tmp_path, monkeypatch
):
    """Fewer than 8 queries and 12 keys still give both pictures (the labels used to assume 8 and
    12), and the routing picture names each receiver by the digit that seeded it, not 0, 1, 2."""
    from torchvote.explain import capsule_plots

    seen = {}
    draw = capsule_plots.coupling_passes

    def spy(couplings, **kwargs):
        seen.update(kwargs)
        return draw(couplings, **kwargs)

    monkeypatch.setattr(capsule_plots, "coupling_passes", spy)
    report = run_demo(output_dir=tmp_path, make_plots=True, cluster_digits=(0, 1, 7), **SMALL)
    assert [p.name for p in report.plots] == ["attention.png", "routing.png"]
    assert all(p.is_file() for p in report.plots)
    assert seen["output_labels"] == ["seed 0", "seed 1", "seed 7"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"num_queries": 0}, "num_queries must be a positive integer"),
        ({"num_keys": 2.5}, "num_keys must be a positive integer"),
        ({"iterations": 0}, "iterations must be a positive integer"),
        ({"cluster_digits": (0, 10)}, "cluster_digits must be distinct digits 0 to 9"),
        ({"cluster_digits": (1, 1)}, "cluster_digits must be distinct digits 0 to 9"),
        ({"cluster_digits": ()}, "cluster_digits must be distinct digits 0 to 9"),
        # more digits than the split holds: the printed counts would overstate what ran
        ({"num_queries": 61}, r"num_queries must be at most 60 \(the MNIST test split\), got 61"),
        ({"num_keys": 241}, r"num_keys must be at most 240 \(the MNIST train split\), got 241"),
        # was: each class cut at its own end, unequal classes (3143 digits for 5000 x 3)
        ({"cluster_size": 61}, r"cluster_size must be at most \d+ \(the test split.s digits of the smallest"),
    ],
)
def test_run_demo_refuses_bad_arguments_by_name(tiny_mnist_data, tmp_path, arguments, message):
    values = {**SMALL, "make_plots": False, **arguments}
    with pytest.raises(ValueError, match=message):
        run_demo(output_dir=tmp_path, **values)


def test_run_demo_refuses_a_file_as_output_dir_before_the_work(tmp_path, monkeypatch):
    """Said before MNIST is even loaded, not after the experiments ran."""
    from torchvote import data

    monkeypatch.setattr(data, "load_mnist", lambda *a, **k: pytest.fail("loaded MNIST first"))
    target = tmp_path / "a-file"
    target.write_text("")
    with pytest.raises(ValueError, match="output_dir: .* is a file"):
        run_demo(output_dir=target, **SMALL)
    # a file above the folder too: it was said after the work
    with pytest.raises(ValueError, match=f"output_dir: '{target}' is a file"):
        run_demo(output_dir=target / "plots", **SMALL)


def test_attention_retrieval_refuses_a_bandwidth_that_is_not_positive():
    images, labels = load_small_digits("test")
    with pytest.raises(ValueError, match="bandwidth must be a positive finite number"):
        attention_retrieval(images[:2], images[:5], labels[:5], bandwidth=0.0)


def test_attention_picture_shows_every_query_its_most_heard_training_digits(tmp_path, monkeypatch):
    """The columns were the 12 keys with the largest weight summed over the queries: a test digit
    whose weight was spread thin showed a row of zeros (review finding)."""
    pytest.importorskip("matplotlib")
    from torchvote import demo
    from torchvote.explain import attention_plots

    shown = {}
    heatmap = attention_plots.attention_heatmap

    def capture(matrix, rows, columns, **kwargs):
        shown["matrix"], shown["columns"] = matrix, columns
        return heatmap(matrix, rows, columns, **kwargs)

    monkeypatch.setattr(attention_plots, "attention_heatmap", capture)
    weights = torch.zeros(3, 40)
    weights[0, :2] = 0.5  # two queries that lean on few keys, heavily
    weights[1, 2:4] = 0.5
    weights[2] = 1 / 40  # one spread over all 40 keys: its largest weight is 0.025
    weights[2, 39] += 0.001
    passes = [torch.full((2, 6), 0.5)]
    demo._plots(tmp_path, weights, torch.arange(40) % 10, torch.tensor([0, 1, 2]), passes,
                torch.tensor([0, 0, 0, 1, 1, 1]), (0, 1))
    matrix = shown["matrix"]
    for query in range(3):
        assert matrix[query].max() == weights[query].max()  # each row holds its own largest weight
    assert matrix.shape[1] <= 6 and "train 9" in shown["columns"]  # key 39 (label 9): query 2's own


def test_demo_pictures_say_what_they_show(tmp_path, monkeypatch):
    """Review findings 12-13: the routing maps spoke of capsules for test digits and did not mark
    the classes; the attention map did not say it shows a few of many keys, and its query labels
    repeated."""
    pytest.importorskip("matplotlib")
    from torchvote import demo
    from torchvote.explain import figures

    drawn = {}
    save = figures.save_figure

    def keep(figure, stem, **kwargs):
        drawn[stem.name] = {
            "titles": [ax.get_title() for ax in figure.axes],
            "xlabels": [ax.get_xlabel() for ax in figure.axes if ax.images],
            "ylabels": [[t.get_text() for t in ax.get_yticklabels()] for ax in figure.axes if ax.images],
            "boundaries": [[line.get_xdata()[0] for line in ax.lines] for ax in figure.axes if ax.images],
        }
        return save(figure, stem, **kwargs)

    monkeypatch.setattr(figures, "save_figure", keep)
    weights = torch.softmax(torch.randn(3, 40), dim=-1)
    passes = [torch.full((2, 6), 0.5)] * 2
    demo._plots(tmp_path, weights, torch.arange(40) % 10, torch.tensor([1, 1, 4]), passes,
                torch.tensor([7, 0, 7, 0, 0, 7]), (0, 7))
    attention = drawn["attention"]
    assert "of 40 training digits shown" in attention["titles"][0]
    assert attention["ylabels"][0] == ["#0 test 1", "#1 test 1", "#2 test 4"]
    routing = drawn["routing"]
    assert routing["xlabels"][-1] == "test digit j, by class: 0 | 7"  # the bottom row of maps
    assert all(lines == [2.5] for lines in routing["boundaries"])  # between the 3 zeros and the 3 sevens
