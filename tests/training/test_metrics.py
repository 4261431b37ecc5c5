"""Metrics: JSON lines, TensorBoard when importable, the result table, the benchmark script."""

from __future__ import annotations

import json
import sys
import types

import pytest

from torchvote.training.metrics import MetricsWriter, format_table, read_metrics


def test_metrics_are_json_lines_and_a_torn_last_line_is_skipped(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.write("train", 5, {"loss": 0.5, "accuracy": 0.75}, epoch=0)
        writer.write("eval", 5, {"loss": float("nan")}, dataset="mnist/test")
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"event": "train", "st')  # a crash mid-line
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["event"] for r in records] == ["train", "eval"]
    assert records[0]["loss"] == 0.5 and records[0]["epoch"] == 0 and "time" in records[0]
    assert records[1]["loss"] == "nan" and records[1]["dataset"] == "mnist/test"
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_scalars_when_the_package_is_importable(tmp_path, monkeypatch):
    scalars, purges = [], []

    class FakeWriter:
        def __init__(self, log_dir, purge_step=None):
            self.log_dir = log_dir
            purges.append(purge_step)

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = FakeWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        writer.write("train", 3, {"loss": 0.25, "lr": 0.001}, epoch=0)
        writer.write("eval", 3, {"accuracy": 0.5, "loss": float("inf")}, dataset="mnist/test")
    assert writer.tensorboard_dir == tmp_path / "tensorboard"
    assert scalars == [("train/loss", 0.25, 3), ("train/lr", 0.001, 3), ("eval/mnist/test/accuracy", 0.5, 3)]
    # resumed from step 4: TensorBoard drops the killed run's events after it, as metrics.jsonl
    with MetricsWriter(tmp_path, tensorboard=True, resume_step=4):
        pass
    assert purges == [None, 5]


def test_tensorboard_is_optional(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with MetricsWriter(tmp_path, tensorboard=True) as writer:
        writer.write("train", 1, {"loss": 1.0})
    assert writer.tensorboard_dir is None
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0


def test_format_table_aligns_and_formats():
    table = format_table(
        [
            {"data": "mnist/test", "accuracy": 0.99123, "loss": 0.031234, "examples": 10000},
            {"data": "affnist/test", "accuracy": 0.5, "loss": None, "examples": 10000},
        ]
    )
    lines = table.splitlines()
    assert lines[0].split() == ["data", "accuracy", "loss", "examples"]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split() == ["mnist/test", "99.12%", "0.0312", "10000"]
    assert lines[3].split() == ["affnist/test", "50.00%", "-", "10000"]
    assert len({len(line) for line in lines[:2]}) == 1
    assert format_table([]) == "(no results)"


def test_training_benchmark_runs_every_pair_quickly(capsys, load_benchmark):
    benchmark = load_benchmark("training")
    assert next(iter(benchmark.PAIRS)) == "cnn-baseline"
    assert benchmark.main(["--quick", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "ours img/s" in out and "baseline img/s" in out and "speed-up" in out
    with pytest.raises(SystemExit):
        benchmark.main(["--models", "nothing"])


def test_eval_on_entries_carry_data_set_options():
    from torchvote.training.evaluation import parse_eval_entry

    assert parse_eval_entry("affnist") == ("affnist", {})
    assert parse_eval_entry("affnist-style:canvas=28, seed=3") == ("affnist-style", {"canvas": 28, "seed": 3})
    assert parse_eval_entry("multimnist:split=test") == ("multimnist", {"split": "test"})
    import pytest

    with pytest.raises(ValueError, match="key=value"):
        parse_eval_entry("affnist:canvas")


def test_format_table_prints_whole_float_losses_with_decimals_like_the_rest():
    table = format_table(
        [
            {"data": "a", "accuracy": 1.0, "loss": 0.031234, "examples": 100},
            {"data": "b", "accuracy": 0.0, "loss": 2.0, "examples": 100},
            {"data": "c", "accuracy": 0.5, "loss": 0.0, "examples": 100},
        ]
    )
    lines = table.splitlines()
    assert lines[2].split() == ["a", "100.00%", "0.0312", "100"]
    assert lines[3].split() == ["b", "0.00%", "2.0000", "100"]  # not "2"
    assert lines[4].split() == ["c", "50.00%", "0.0000", "100"]  # not "0"
    assert format_table([{"top5_accuracy": 3.0}]).splitlines()[2] == "       3.0000"  # not in [0, 1]


def test_read_metrics_warns_about_a_corrupt_line_in_the_middle_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "train", "step": 1}\n{"event": "tr#in", "st\n{"event": "train", "step": 3}\n')
    with pytest.warns(RuntimeWarning, match=rf"{path}: line 2 is not JSON"):
        records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 3]


@pytest.mark.parametrize("line", ["[1, 2]", "3", '"train"', "null"])
def test_read_metrics_skips_json_that_is_no_record_naming_the_line(tmp_path, line):
    """A JSON array in the file reached the readers as a record: metric_curves stopped with
    "'list' object has no attribute 'items'"."""
    path = tmp_path / "metrics.jsonl"
    first, last = '{"event": "train", "step": 1, "loss": 0.5}', '{"event": "train", "step": 2, "loss": 0.4}'
    path.write_text(f"{first}\n{line}\n{last}\n")
    with pytest.warns(RuntimeWarning, match=rf"{path}: line 2 is a JSON \w+, not a record"):
        records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]
    from torchvote.explain.metric_plots import metric_curves

    with pytest.warns(RuntimeWarning):
        figure = metric_curves(path)
    assert len(figure.axes) == 1


def test_read_metrics_skips_a_torn_last_line_without_a_warning(tmp_path, recwarn):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "train", "step": 1}\n\n{"event": "train", "step": 2}\n{"event": "tr')
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_resumed_writer_drops_the_torn_line_and_keeps_every_new_record(tmp_path, recwarn):
    with MetricsWriter(tmp_path) as writer:
        writer.write("train", 1, {"loss": 1.0})
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"event": "train", "st')  # the run is killed mid-line
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    with MetricsWriter(tmp_path) as writer:  # the run resumed
        writer.write("train", 2, {"loss": 0.5})
        writer.write("train", 3, {"loss": 0.25})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]  # step 2 not lost
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_a_writer_resumed_from_a_step_cuts_the_records_after_it(tmp_path):
    """A run killed after its checkpoint of step 4 recorded steps 6 and 8 too: the resumed run
    takes them again, so its writer cuts them (a torn last line included) before appending."""
    with MetricsWriter(tmp_path) as writer:
        for step in (2, 4, 6, 8):
            writer.write("train", step, {"loss": 1.0 / step})
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"event": "train", "st')
    with MetricsWriter(tmp_path, resume_step=4) as writer:
        assert writer.dropped == 2
        writer.write("train", 6, {"loss": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [2, 4, 6]


def test_format_table_keeps_a_column_of_numbers_right_aligned_where_one_is_missing():
    """A row without a loss (evaluate on a set the run's loss does not take) printed its '-' and
    left-aligned the whole loss column under the others' numbers."""
    table = format_table([{"data": "mnist/test", "loss": 0.1234}, {"data": "multimnist/test", "loss": None}])
    header, _, first, second = table.splitlines()
    end = header.index("loss") + len("loss")
    assert first[:end].endswith("0.1234") and second[:end].endswith("-")


def test_throughput_leaves_out_the_evaluations_and_checkpoints_of_its_window(monkeypatch):
    """The window's clock ran through the evaluation after a log line: the next window's img/s
    counted it (60 -> 7.5 -> 970 images per second on one run)."""
    import torch

    from torchvote.training import progress as progress_module
    from torchvote.training.distributed import DistributedContext
    from torchvote.training.tasks import ClassificationHandler

    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: clock[0])
    progress = progress_module.Progress(total=10, initial=0, enabled=False)
    for _ in range(4):  # 4 steps of 50 images, 1 s each, then a 30-second evaluation
        progress.add(torch.tensor(2.0), {"count": torch.tensor(50.0), "correct": torch.tensor(5.0)}, 50)
        clock[0] += 1.0
        if _ == 1:
            with progress.paused():
                clock[0] += 30.0
    record = progress.report(ClassificationHandler(), DistributedContext(), lr=0.1)
    assert record["img_per_second"] == pytest.approx(200 / 4.0)
    progress.add(torch.tensor(2.0), {"count": torch.tensor(50.0), "correct": torch.tensor(5.0)}, 50)
    clock[0] += 2.0
    record = progress.report(ClassificationHandler(), DistributedContext(), lr=0.1)
    assert record["img_per_second"] == pytest.approx(50 / 2.0)  # the pause belonged to the last window


def test_format_table_and_the_writer_refuse_what_they_misread(tmp_path):
    """Review findings: columns="abc" made columns a, b, c; a dict of rows an AttributeError; an
    accuracy of np.float32(0.5) printed 0.5 and a tensor tensor(0.5000); a 2-element tensor
    metric torch's "cannot be converted to Scalar"; resume_step="3" a comparison TypeError."""
    import numpy as np
    import torch

    with pytest.raises(TypeError, match="columns must be a list of strings, got the single string 'abc'"):
        format_table([{"abc": 1}], columns="abc")
    with pytest.raises(TypeError, match="rows must be a list of mappings"):
        format_table({"data": "x"})
    table = format_table([{"accuracy": np.float32(0.5), "loss": torch.tensor(0.25)}])
    assert table.splitlines()[-1].split() == ["50.00%", "0.2500"]
    assert format_table([{"accuracy": 0.5, "loss": 0.25}]) == table  # as Python's numbers print
    with MetricsWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match=r"'loss' must be one number, got a tensor of shape \(2,\)"):
            writer.write("train", 1, {"loss": torch.ones(2)})
        writer.write("train", 1, {"loss": torch.tensor(0.5)})
    assert [record["loss"] for record in read_metrics(tmp_path / "metrics.jsonl")] == [0.5]
    with pytest.raises(TypeError, match="resume_step must be an integer >= 0, got '3'"):
        MetricsWriter(tmp_path, resume_step="3")


def test_a_value_json_cannot_hold_is_named_and_nothing_is_written(tmp_path):
    """json's "Object of type device is not JSON serializable" named no metric."""
    import torch

    with MetricsWriter(tmp_path) as writer:
        with pytest.raises(TypeError, match="metric 'where' must be a number, a string or a list or dict"):
            writer.write("eval", 1, {"accuracy": 0.5, "where": torch.device("cpu")})
        with pytest.raises(TypeError, match="context value 'dataset' must be .*, got set"):
            writer.write("eval", 1, {"accuracy": 0.5}, dataset={"mnist"})
        looped = []
        looped.append(looped)  # json: "Circular reference detected", a ValueError
        with pytest.raises(TypeError, match="metric 'path' must be"):
            writer.write("eval", 1, {"path": looped})
        with pytest.raises(TypeError, match=r"metric names must be strings, got \('mnist', 'test'\)"):
            writer.write("eval", 1, {("mnist", "test"): 0.5})  # a bare StopIteration once
        writer.write("eval", 2, {"accuracy": 0.5, "counts": [1, 2]}, dataset="mnist")
    assert [record["step"] for record in read_metrics(tmp_path / "metrics.jsonl")] == [2]


def test_format_table_takes_keys_that_are_not_strings():
    # an int key failed on len() and .endswith
    assert format_table([{1: 0.5, "accuracy": 0.25}]).splitlines()[0].split() == ["1", "accuracy"]
