"""The ``torchvote`` command line, called in-process through its entry function."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from torchvote import cli

FAST = ["progress=false", "tensorboard=false"]


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_train_then_evaluate_end_to_end(tmp_path, capsys):
    run_dir = tmp_path / "smoke"
    code, out, err = run(capsys, "train", "smoke", "data.limit=400", "epochs=1", f"run_dir={run_dir}", *FAST)
    assert code == 0, err
    assert "small-digits/test" in out and "accuracy" in out
    assert f"checkpoint: {run_dir}/checkpoints/step-00000004.safetensors" in out
    assert f"metrics:    {run_dir}/metrics.jsonl" in out

    code, out, err = run(capsys, "evaluate", str(run_dir), "--on", "small-digits,mnist", "--limit", "200")
    assert code == 0, err
    assert "cnn-baseline at step 4" in out
    lines = out.splitlines()
    assert lines[1].split() == ["data", "accuracy", "loss", "examples"]
    assert any(line.startswith("small-digits/test") for line in lines)
    assert any(line.startswith("mnist/test") and line.endswith("200") for line in lines)

    # --resume continues (here: a longer run); the preset may be named again.
    code, out, err = run(capsys, "train", "smoke", "--resume", str(run_dir), "epochs=2", *FAST)
    assert code == 0, err
    assert "step-00000008.safetensors" in out
    code, out, err = run(capsys, "train", "mnist-cnn", "--resume", str(run_dir))
    assert code == 2 and "was started from preset 'smoke', not 'mnist-cnn'" in err


def test_evaluate_reports_the_loss_training_reported(tmp_path, capsys, tiny_mnist_root):
    # `torchvote evaluate` printed no loss column while training's table had one, so a user
    # comparing the two missed it; the loss is the run's own objective at the checkpoint's step
    run_dir = tmp_path / "r"
    sizes = ["data.limit=200", "data.eval_limit=100", "data.canvas=36"]
    code, trained, err = run(capsys, "train", "smoke", "max_steps=2", *sizes, f"run_dir={run_dir}", *FAST)
    assert code == 0, err
    code, out, err = run(capsys, "evaluate", str(run_dir), "--on", "small-digits", "--limit", "100")
    assert code == 0, err
    table = out.splitlines()[1:]
    assert table[0].split() == ["data", "accuracy", "loss", "examples"]
    row = next(line for line in trained.splitlines() if line.startswith("small-digits/test"))
    assert table[2] == row  # the same numbers, as training printed them

    # a data set whose labels the run's cross-entropy does not take (MultiMNIST's pairs): its
    # accuracy without a loss, said in one line; the loss column stays where it is
    pairs = f"multimnist:num_pairs=20,source=idx,root={tiny_mnist_root}"
    code, out, err = run(capsys, "evaluate", str(run_dir), "--on", pairs, "--on", "small-digits")
    assert code == 0, err
    note, header, _, first, second = out.splitlines()[1:]
    assert note.startswith("loss: not reported on multimnist/test: the run's loss does not apply to it")
    assert header.split() == ["data", "accuracy", "loss", "examples"]
    assert first.split()[0::2] == ["multimnist/test", "-"] and second.startswith("small-digits/test")

    # the evaluate command training prints reads the data as the run read it (data.root and
    # data.options: it named the sets only, and found no IDX files; data.eval_limit and
    # data.eval_split: it evaluated all of the test split) and prints the run's own rows
    idx_dir = tmp_path / "idx"
    code, trained, err = run(capsys, "train", "smoke", "max_steps=2", "data.name=mnist", "data.limit=100",
                             "data.eval_limit=50", "data.eval_split=train", f"data.root={tiny_mnist_root}",
                             "data.options.source=idx", f"run_dir={idx_dir}", *FAST)
    assert code == 0, err
    hint = shlex.split(next(line for line in trained.splitlines() if line.startswith("evaluate:"))[9:])
    assert hint[hint.index("--root") + 1] == str(tiny_mnist_root)
    assert hint[hint.index("--data-option") + 1] == "source=idx"
    assert hint[hint.index("--on") + 1] == "mnist:split=train" and hint[hint.index("--limit") + 1] == "50"
    code, out, err = run(capsys, *hint[1:])
    assert code == 0, err
    row = next(line for line in trained.splitlines() if line.startswith("mnist/train"))
    assert row.split()[-1] == "50" and out.splitlines()[-1] == row  # the same numbers
    # without --on (nor --root, --limit, --data-option): the same, read from the run's own record
    code, out, err = run(capsys, "evaluate", str(idx_dir))
    assert code == 0, err
    # the flags shown are those that apply, the run's limit, root and options too (copied, the
    # limit-less line evaluated every example)
    shown = f"--on mnist:split=train --limit 50 --root {tiny_mnist_root} --data-option source=idx"
    assert f"data:       the run's own ({shown})" in out and out.splitlines()[-1] == row
    # data.options went to the evaluated set only, never to the eval_on entries (mnist takes no
    # seed): beside those, they stand in the evaluated set's own entry
    seeded = tmp_path / "seeded"
    code, trained, err = run(capsys, "train", "smoke", "max_steps=2", "data.options.seed=1",
                             "data.eval_limit=40", f"eval_on=[mnist:root={tiny_mnist_root},source=idx]",
                             f"run_dir={seeded}", *FAST)
    assert code == 0, err
    hint = shlex.split(next(line for line in trained.splitlines() if line.startswith("evaluate:"))[9:])
    assert hint[hint.index("--on") + 1] == "small-digits:seed=1" and "--data-option" not in hint
    code, out, err = run(capsys, *hint[1:])
    assert code == 0, err
    code, own, err = run(capsys, "evaluate", str(seeded))  # the run's own sets, unnamed
    assert code == 0, err
    for name in ("small-digits/test", "mnist/test"):
        row = next(line for line in trained.splitlines() if line.startswith(name))
        assert next(line for line in out.splitlines() if line.startswith(name)) == row
        assert next(line for line in own.splitlines() if line.startswith(name)) == row

    # a weights file copied on its own: the same row, loss included (the weights record the
    # run's loss settings and length; the training state used to be the only record of them)
    bare = tmp_path / "copied" / "model.safetensors"
    bare.parent.mkdir()
    bare.write_bytes(next((run_dir / "checkpoints").glob("*.safetensors")).read_bytes())
    code, out, err = run(capsys, "evaluate", str(bare), "--on", "small-digits", "--limit", "100")
    assert code == 0, err
    assert out.splitlines()[1:] == table
    # ... which records no data sets: without --on it asks for them, saying why
    code, out, err = run(capsys, "evaluate", str(bare))
    assert code == 2 and "name the data sets with --on (data sets: addition, affnist" in err
    state = bare.parent / "model.state.pt"
    assert f"{state}, the run's training state that records them, does not exist" in err


def test_evaluate_and_resume_read_the_data_sets_a_resume_added_without_a_checkpoint(tmp_path, capsys):
    # a finished run resumed only to evaluate a new eval_on entry writes no checkpoint, only its
    # config.yaml: `evaluate RUN` then read the checkpoint's record and left the new set out, and a
    # later resume dropped it too
    run_dir = tmp_path / "r"
    code, _, err = run(capsys, "train", "smoke", "max_steps=2", "data.limit=100", "data.eval_limit=40",
                       f"run_dir={run_dir}", *FAST)
    assert code == 0, err
    checkpoints = sorted((run_dir / "checkpoints").iterdir())
    code, resumed, err = run(capsys, "train", "--resume", str(run_dir), "eval_on=[small-digits:split=train]")
    assert code == 0, err
    added = next(line for line in resumed.splitlines() if line.startswith("small-digits/train"))
    assert sorted((run_dir / "checkpoints").iterdir()) == checkpoints  # none written
    code, out, err = run(capsys, "evaluate", str(run_dir))
    assert code == 0, err
    assert "--on small-digits --on small-digits:split=train --limit 40" in out
    assert next(line for line in out.splitlines() if line.startswith("small-digits/train")) == added
    # a longer resume keeps it (and says the run's length changed, against the checkpoint's record)
    code, out, err = run(capsys, "train", "--resume", str(run_dir), "max_steps=3")
    assert code == 0, err
    assert any(line.startswith("small-digits/train") for line in out.splitlines())

    # a config.yaml of another run (another seed) is not read: the checkpoint's record is
    other = tmp_path / "other"
    code, _, err = run(capsys, "train", "smoke", "max_steps=1", "data.limit=100", "data.eval_limit=40",
                       "eval_on=[small-digits:split=train]", "seed=7", f"run_dir={other}", *FAST)
    assert code == 0, err
    (run_dir / "config.yaml").write_bytes((other / "config.yaml").read_bytes())
    ignored = r"config.yaml is not read: it differs from its checkpoint's config .*seed"  # said, not silent
    with pytest.warns(UserWarning, match=ignored):
        code, out, err = run(capsys, "evaluate", str(run_dir))
    assert code == 0, err
    assert "the run's own (--on small-digits --limit 40)" in out


def test_warnings_read_as_one_line_each_while_the_command_runs(capsys, monkeypatch):
    """Python's format put a source path before torchvote's notes and a line of its code after."""
    import warnings

    seen = []

    def format_both(args):
        seen.append(warnings.formatwarning("config.yaml is not read", UserWarning, cli.__file__, 627))
        seen.append(warnings.formatwarning("x", RuntimeWarning, "/site-packages/torch/nn/f.py", 7))
        # a checkout named torchvote holds other packages too (its .venv): not ours
        seen.append(warnings.formatwarning("y", UserWarning, "/home/u/torchvote/.venv/lib/numpy/f.py", 3))
        return 0

    monkeypatch.setattr(cli, "_list", format_both)
    default = warnings.formatwarning
    code, _, _ = run(capsys, "list")
    assert code == 0 and seen == [
        "torchvote: warning: config.yaml is not read\n",
        "warning: x (RuntimeWarning, /site-packages/torch/nn/f.py:7)\n",
        "warning: y (UserWarning, /home/u/torchvote/.venv/lib/numpy/f.py:3)\n",
    ]
    assert warnings.formatwarning is default  # put back when the command ends


def test_evaluate_and_reproduce_help_say_what_they_print_and_how_to_continue(capsys):
    # `evaluate --help` did not say what the table holds (nor why a loss can be missing), and
    # `reproduce --help` neither where the runs go by default nor what to do after Ctrl-C
    with pytest.raises(SystemExit):
        cli.main(["evaluate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "The loss is the run's own objective at the checkpoint's step" in text
    assert "a .safetensors file copied alone reports it too" in text
    with pytest.raises(SystemExit):
        cli.main(["reproduce", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    default = cli.build_parser().parse_args(["reproduce"]).out
    assert f"(default: {default})" in text
    assert "after Ctrl-C (or a killed process) run the same command again" in text


def test_main_job_trains_evaluates_and_says_where_things_went(tmp_path, capsys):
    code, out, err = run(
        capsys,
        "main",
        "model.preset=tiny",
        "data.limit=256",
        "data.eval_limit=50",
        f"run_dir={tmp_path / 'main run'}",  # a space: the printed commands must quote it
        *FAST,
    )
    assert code == 0, err
    assert "mnist/test" in out and "affnist-style/test" in out
    for label in ("checkpoint:", "metrics:", "plots:"):
        assert label in out
    assert (tmp_path / "main run" / "plots" / "training_curves.png").is_file()
    # The evaluate command it prints names every set the run was tested on, and runs as printed.
    hint = next(line for line in out.splitlines() if line.startswith("evaluate:"))
    argv = shlex.split(hint.removeprefix("evaluate:"))
    assert argv[:2] == ["torchvote", "evaluate"] and argv.count("--on") == 2
    code, again, err = run(capsys, *argv[1:], "--limit", "50")
    assert code == 0, err
    assert "mnist/test" in again and "affnist-style/test" in again
    # It ends with the explain report of the trained CapsNet (its routing passes included).
    page = tmp_path / "main run" / "explain" / "index.html"
    assert f"report: {page.resolve()}" in out
    assert (tmp_path / "main run" / "explain" / "couplings.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "nope"], "unknown preset 'nope'; presets: "),
        (
            ["train", "smoke", "model.name=transformer-xyz"],
            "unknown model 'transformer-xyz'; models: ",
        ),
        (["train", "smoke", "model.preset=huge"], "presets: paper, small, tiny"),
        (["train", "smoke", "optim.lrr=1"], "unknown key 'optim.lrr' (did you mean 'optim.lr'?); valid keys"),
        (["train", "smoke", "epochs=many"], "epochs: expected int, got 'many'"),
        (["train", "smoke", "optim.name=lion"], "'lion' is not one of: adam, adamw, sgd"),
        (["train", "smoke", "model.routers=3"], "valid keys: model.name, model.preset, model.image_size"),
        (["train", "smoke", "data.name=cifar"], "data.name: unknown data set 'cifar'; data sets: addition"),
        (["train", "smoke", "stray"], "expected key=value after the preset, got 'stray'"),
        (["train"], "name a preset (torchvote list presets) or --resume RUN_DIR"),
        (["train", "--resume", "/nonexistent/run"], "--resume: /nonexistent/run does not exist"),
        (["evaluate", "/nonexistent/run", "--on", "mnist"], "checkpoint: /nonexistent/run does not exist"),
        (["train", "smoke", "bf16=perhaps"], "bf16: expected bool, got 'perhaps'"),
        (["train", "smoke", "model.channels=8,x"], "model.channels[1]: expected int, got 'x'"),
        (["train", "smoke", "model.dropout=1.5"], "dropout must be in [0, 1), got 1.5"),
        (["train", "capsnet-mnist", "model.router_options={iterations:2}"], "must not set ['iterations']"),
        (["train", "smoke", "eval_on=affnist:canvas"], "eval_on entry 'affnist:canvas': options must be"),
        # options that were silently ignored
        (["train", "seq2seq-reverse", "data.canvas=40"], "data.canvas: only image models take it"),
        (["data", "shakespeare", "--pip"], "--pip changes how --download downloads; give --download too"),
        (["data", "affnist", "--force"], "--force changes how --download downloads; give --download too"),
        # values that trained on silently or failed deep inside
        (["train", "smoke", "optim.lr=inf"], "optim.lr must be a finite number in (0.0, inf), got inf"),
        (["train", "smoke", "optim.grad_clip=-1"], "optim.grad_clip must be a finite number in (0.0, inf)"),
        (["train", "smoke", "seed=-1"], "seed must be an integer in [0, 2**64), got -1"),
        (["train", "smoke", "--device", ""], "device must be auto, cpu, cuda or cuda:<index>, got ''"),
        (["train", "smoke", "run_dir="], "run_dir must name a folder"),
        (
            ["evaluate", "/nonexistent/run", "--on", "mnist", "--data-option", "max_len"],
            "--data-option: options must be key=value, got 'max_len'",
        ),
    ],
)
def test_bad_input_is_one_line_listing_what_exists(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [["list", "gadgets"], ["bench", "everything"], ["frobnicate"], ["evaluate"], ["data", "cifar"]],
)
def test_usage_errors_exit_with_status_2_in_one_line(capsys, argv):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "error:" in err


def test_evaluate_on_images_that_do_not_fit_suggests_the_fix(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "r"
    assert run(capsys, "train", "smoke", "max_steps=1", "eval_every=0", f"run_dir={run_dir}", *FAST)[0] == 0
    code, _, err = run(capsys, "evaluate", str(run_dir), "--on", "affnist-style", "--limit", "10")
    assert code == 2 and "the model takes 28x28 images, the data has 40x40; train with data.canvas=40" in err
    assert "affnist-style:canvas=28" in err
    # the suggested fix works: per-data-set options as in eval_on, beside a data set without them
    both = "mnist,affnist-style:canvas=28"
    code, out, _ = run(capsys, "evaluate", str(run_dir), "--on", both, "--limit", "10")
    assert code == 0 and "mnist/test" in out and "affnist-style/test" in out
    monkeypatch.setenv("TORCHVOTE_DATA", str(tmp_path / "empty-data"))  # no real affNIST there
    code, out, err = run(capsys, "evaluate", str(run_dir), "--on", "affnist", "--limit", "10")
    assert code == 1 and "torchvote data affnist --download" in out + err and "affnist-style" in out + err
    code, _, err = run(capsys, "evaluate", str(run_dir), "--on", "copy", "--limit", "10")
    assert code == 2 and "does not give (images (n, c, h, w), labels)" in err
    # a limit of 0 found no examples (a RuntimeError from an empty max); -3 dropped the last three
    for flag, value in (("--limit", "0"), ("--limit", "-3"), ("--batch-size", "0")):
        code, _, err = run(capsys, "evaluate", str(run_dir), "--on", "mnist", flag, value)
        assert code == 2 and f"{flag} must be a positive integer, got {value}" in err


def test_evaluate_out_of_device_memory_is_one_line_that_says_what_to_lower(tmp_path, capsys, monkeypatch):
    # torch's paragraph and a traceback; now one line naming --batch-size and its value
    import importlib

    import torch

    evaluation = importlib.import_module("torchvote.training.evaluation")  # the module, not the function
    run_dir = tmp_path / "r"
    assert run(capsys, "train", "smoke", "max_steps=1", "eval_every=0", f"run_dir={run_dir}", *FAST)[0] == 0

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nGPU 0 has ...")

    monkeypatch.setattr(evaluation, "evaluate_loss_where_it_applies", out_of_memory)
    code, _, err = run(capsys, "evaluate", str(run_dir), "--on", "mnist", "--batch-size", "256")
    assert code == 1 and "Traceback" not in err  # a failure while running: 1 (2 is a usage error)
    (line,) = err.splitlines()
    expected = "torchvote evaluate: error: the device ran out of memory: lower --batch-size (now 256)"
    assert line.startswith(expected)
    assert line.endswith("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ...")


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert run(capsys, "train", "smoke", "max_steps=1", "eval_every=0", f"run_dir={run_dir}", *FAST)[0] == 0
    code, _, err = run(capsys, "evaluate", str(run_dir), "--on", "mnist", "--device", "bogus")
    assert code == 2 and "device must be auto, cpu, cuda or cuda:<index>, got 'bogus'" in err
    weights = next((run_dir / "checkpoints").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    code, _, err = run(capsys, "evaluate", str(run_dir), "--on", "mnist")
    assert code == 1 and "not a readable safetensors file" in err  # found while running: 1


@pytest.mark.parametrize(
    ("what", "expected"),
    [("models", "cnn-baseline"), ("presets", "main"), ("datasets", "small-digits"), ("routers", "")],
)
def test_list(capsys, what, expected):
    code, out, _ = run(capsys, "list", what)
    assert code == 0 and expected in out and out.strip()


def test_list_datasets_names_the_options_of_each_split(capsys):
    code, out, _ = run(capsys, "list", "datasets")
    lines = out.splitlines()
    after = {line.split()[0]: lines[i + 1].strip() for i, line in enumerate(lines) if not line[0].isspace()}
    assert code == 0 and len(after) == 10
    assert after["mnist"] == "options: limit, root, source"
    assert after["affnist"] == (
        "options (train): canvas, limit, root, seed, source; options (test): limit, root"
    )
    assert after["shakespeare"] == "options: archive, root, titles, val_fraction"


def test_list_everything(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    for header in ("models:", "routers:", "presets:", "datasets:"):
        assert header in out


def test_list_wraps_long_entries_on_a_terminal_only(capsys, monkeypatch):
    """A preset's line ran to 188 columns on an 80-column terminal; piped, one line per entry."""
    import shutil

    code, piped, _ = run(capsys, "list")
    assert code == 0 and max(map(len, piped.splitlines())) > 80  # else this test shows nothing
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *args: os.terminal_size((80, 24)))
    code, wrapped, _ = run(capsys, "list")
    assert code == 0 and max(map(len, wrapped.splitlines())) <= 80
    assert wrapped.split() == piped.split()  # the same words, in the same order
    continuation = next(line for line in wrapped.splitlines() if line.startswith(" " * 27))
    assert continuation[27] != " "  # under the description (margin 2, name column 25)


def test_data_verify_checks_the_real_mnist(capsys):
    code, out, err = run(capsys, "data", "mnist", "--verify")
    assert code == 0, err
    assert "train: 60000 images (1, 28, 28)" in out and "test: 10000 images" in out
    assert "MNIST verified: the published images per digit and pixel statistics" in out


def test_data_verify_refuses_a_copy_that_is_not_the_published_mnist(tmp_path, capsys):
    """All-black images under the right labels passed: only the counts and the size were checked."""
    import torch

    from torchvote.data import write_idx
    from torchvote.data.command import MNIST_CLASS_COUNTS

    for split, prefix in (("train", "train"), ("test", "t10k")):
        labels = torch.repeat_interleave(torch.arange(10), torch.tensor(MNIST_CLASS_COUNTS[split]))
        black = torch.zeros(len(labels), 28, 28, dtype=torch.uint8)
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", black)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", labels.to(torch.uint8))
    code, out, err = run(capsys, "data", "mnist", "--verify", "--root", str(tmp_path))
    assert code == 1 and "MNIST verification FAILED" in out
    assert "train pixels have mean 0.0000 and std 0.0000, published 0.1307 and 0.3081" in err
    # a .gz file that is not the published one is said; the contents decide (gzipped again: the same)
    assert f"note: {tmp_path / 'train-images-idx3-ubyte.gz'} is not the published file byte for byte" in out
    assert "test has per class" not in err  # the counts are right


def test_data_affnist_reports_what_is_missing_and_verifies_what_is_there(tmp_path, capsys):
    import numpy as np
    from scipy.io import savemat

    code, out, _ = run(capsys, "data", "affnist", "--root", str(tmp_path))
    assert code == 1 and "torchvote data affnist --download --root" in out and "affnist-style" in out
    pixels = np.zeros((1600, 20), dtype=np.uint8)
    savemat(tmp_path / "test.mat", {"affNISTdata": {"image": pixels, "label_int": np.arange(20) % 10}})
    code, out, err = run(capsys, "data", "affnist", "--verify", "--root", str(tmp_path))
    assert code == 1 and f"test: {tmp_path / 'test.mat'}" in out and "per class [2, 2, 2" in out
    assert "20 images, expected 320000" in err and "affNIST verification FAILED" in out


def test_data_without_a_name_lists_and_rejects_download(capsys):
    code, out, _ = run(capsys, "data")
    assert code == 0 and "mnist" in out and "shakespeare" in out
    code, _, err = run(capsys, "data", "--download")
    assert code == 2 and "name the data set to download or verify" in err


def test_bench_without_the_script_says_what_is_there(tmp_path, capsys, monkeypatch):
    (tmp_path / "attention.py").write_text("")
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: tmp_path)
    code, _, err = run(capsys, "bench", "routing")
    assert code == 1 and "present: attention" in err  # no usage error: the checkout lacks the script


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["data", "list", "--root", "x"], "--root applies to mnist, affnist and shakespeare, not to 'list'"),
        (["data", "list", "--dir", "x"], "--dir applies to mnist, affnist and shakespeare, not to 'list'"),
        (["data", "shakespeare", "--download", "--force"], "--force applies to mnist and affnist, not to"),
        (["data", "mnist", "--force"], "--force changes how --download downloads; give --download too"),
        (["data", "affnist", "--pip"], "--pip applies to shakespeare, not to 'affnist'"),
    ],
)
def test_data_refuses_options_of_another_data_set(capsys, argv, message):
    code, _, err = run(capsys, *argv)  # they were dropped without a word
    assert code == 2 and message in err


def test_bench_offers_every_benchmark_script():
    scripts = sorted(path.stem for path in cli._benchmarks_dir().glob("[!_]*.py"))  # not _common.py
    assert scripts and list(cli.BENCHMARKS) == scripts  # em and generation were missing


def test_make_bench_runs_every_benchmark_script():
    """README offers ``make bench`` beside ``torchvote bench NAME``: it skipped em and generation."""
    makefile = (Path(cli.__file__).resolve().parents[2] / "Makefile").read_text()
    recipe = makefile.split("\nbench:", 1)[1].split("\n\n", 1)[0]
    assert sorted(re.findall(r"benchmarks/(\w+)\.py", recipe)) == sorted(cli.BENCHMARKS)


def test_bench_runs_the_script_with_its_arguments(tmp_path, capsys, monkeypatch):
    (tmp_path / "training.py").write_text("import sys\nraise SystemExit(len(sys.argv) - 1)\n")
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: tmp_path)
    assert cli.main(["bench", "training", "--models", "cnn-baseline", "--steps", "2"]) == 4


@pytest.mark.parametrize(("before", "after"), [(None, "1"), ("0", "0")])
def test_command_line_asks_for_huge_pages_unless_told_not_to(monkeypatch, capsys, before, after):
    """PyTorch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation: the command line sets it
    first thing, and a user's own value wins."""
    if before is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", before)
    assert cli.main(["list"]) == 0
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == after


def test_file_system_errors_are_one_line(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    code, _, err = run(capsys, "train", "smoke", "max_steps=1", f"run_dir={a_file}/run", *FAST)
    assert code == 2 and f"run_dir: {a_file} is a file" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize("content", [b"garbage", b"\x80\x02garbage"])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_explain_with_an_unreadable_record_is_one_line(tmp_path, capsys, suffix, content):
    record = tmp_path / f"record{suffix}"
    record.write_bytes(content)
    out_dir = str(tmp_path / "out")
    code, _, err = run(capsys, "explain", "a sentence", "--checkpoint", str(record), "--out", out_dir)
    assert code == 1 and f"checkpoint '{record}' is not a" in err and "Traceback" not in err


def test_a_reader_that_leaves_early_is_no_error(tmp_path):
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-m", "torchvote", "list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    child.stdout.close()  # `torchvote list | head -0`: the reader is gone before the first line
    _, err = child.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()


# --- found by a new user's audit of the command line: each failed before its fix -----------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # the later value won without a word, and a bad earlier one was never checked
        (["train", "smoke", "epochs=1", "epochs=2"], "epochs is set twice ('epochs=1', then 'epochs=2')"),
        (["train", "smoke", "progress=maybe", "progress=false"], "progress is set twice"),
        (["main", "--no-report", "max_steps=1", "epochs=1", "epochs=2"], "epochs is set twice"),
        (
            ["train", "capsnet-mnist", "model.router_options={bias: true}", "model.router_options.bias=0"],
            "model.router_options.bias is set twice",
        ),
        (
            ["train", "capsnet-mnist", "model.router_options.bias=1", "model.router_options={bias: 0}"],
            "model.router_options is set twice",  # the mapping replaced the key set before it
        ),
        # an unreadable mapping was a yaml.parser.ParserError traceback
        (
            ["train", "capsnet-mnist", "model.router_options={iterations: 2"],
            "model.router_options: cannot read '{iterations: 2' as a value",
        ),
        (["train", "smoke", "data.options.size={a:"], "data.options.size: cannot read '{a:' as a value"),
        # an unclosed list was read as a data set named '[mnist'
        (["train", "smoke", "eval_on=[mnist"], "eval_on: expected comma-separated strs, got '[mnist'"),
        # data sets named by their key at load ("name: unknown data set ...; known: [...]" mid-run)
        (["train", "smoke", "data.eval_name=cifar"], "data.eval_name: unknown data set 'cifar'; data sets: "),
        (["train", "smoke", "eval_on=[mnist,cifar:x=1]"], "eval_on entry 'cifar:x=1': unknown data set"),
        (["train", "smoke", "data.eval_split=dev"], "data.eval_split: 'dev' is not a split of 'small-digits"),
        (["train", "smoke", "optim.lr=${nothing}"], "optim.lr: Interpolation key 'nothing' not found"),
        # "Overflow when unpacking long long" from torch.manual_seed, at the first step
        (["train", "smoke", f"seed={2**64}"], f"seed must be an integer in [0, 2**64), got {2**64}"),
        # --resume of what is not a run folder
        (["train", "--resume", ""], "--resume: expected a run folder, got ''"),
        # evaluate names the option, and checks it before reading the checkpoint
        (["evaluate", "/nonexistent/run", "--on", "cifar"], "--on: unknown data set 'cifar'; data sets: "),
        (["evaluate", "/nonexistent/run", "--on", "mnist:canvas"], "--on entry 'mnist:canvas': options must"),
        (["evaluate", "/nonexistent/run", "--on", "mnist", "--limit", "0"], "--limit must be a positive"),
        (["evaluate", "/nonexistent/run", "--on", "mnist", "--device", "gpu"], "--device must be auto, cpu"),
        (["reproduce", "capsnet-routing", "--dry-run", "--device", "gpu"], "--device must be auto, cpu"),
    ],
)
def test_audit_bad_input_is_one_line_naming_the_argument(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)  # what the old code trained on went to ./runs
    code, out, err = run(capsys, *argv)
    assert code == 2, err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and "checkpoint:" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "smoke", "--bogus"], "train: error: unrecognized arguments: --bogus (see torchvote train"),
        (["bench"], "the following arguments are required: name (see"),  # was "required: name, args"
        (["train", "smoke", "device=cpu", "--device", "cpu"], "--device and device= both given"),
    ],
)
def test_usage_errors_name_the_subcommand_and_only_what_is_required(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_resume_takes_only_a_run_folder_and_leaves_it_where_it_is(tmp_path, capsys):
    run_dir = tmp_path / "r"
    assert run(capsys, "train", "smoke", "max_steps=1", "eval_every=0", f"run_dir={run_dir}", *FAST)[0] == 0
    weights = next((run_dir / "checkpoints").glob("*.safetensors"))
    a_folder = tmp_path / "notes"
    a_folder.mkdir()
    resume_in = f"resume its run folder: --resume {run_dir}"
    cases = [
        # a missing folder was read as a checkpoint stem: "no checkpoint at X: X.safetensors ..."
        ([str(tmp_path / "missing")], f"--resume: {tmp_path / 'missing'} does not exist"),
        ([str(a_folder)], "is not a run folder (no checkpoints/ or config.yaml in it)"),
        # a checkpoint file: "[Errno 17] File exists"
        ([str(weights)], f"is a file, expected the folder of a run; {resume_in}"),
        # the checkpoints folder: a second run nested inside it, its metrics apart from the run's
        ([str(run_dir / "checkpoints")], f"is a run's checkpoints folder; {resume_in}"),
        # run_dir= and out_dir= were ignored without a word
        ([str(run_dir), f"run_dir={tmp_path / 'elsewhere'}"], "run_dir: a resumed run stays in its folder"),
        ([str(run_dir), f"out_dir={tmp_path / 'elsewhere'}"], "out_dir: a resumed run stays in its folder"),
        ([str(run_dir), "max_steps=2", "max_steps=3"], "max_steps is set twice"),
    ]
    saved = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for extra, message in cases:
        code, _, err = run(capsys, "train", "--resume", *extra, *FAST)
        assert code == 2 and message in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == saved, extra
    # run_dir= naming the run's own folder is no change
    argv = ["train", "--resume", str(run_dir), f"run_dir={run_dir}", "max_steps=2", *FAST]
    code, out, err = run(capsys, *argv)
    assert code == 0 and "step-00000002.safetensors" in out, err
    assert not (run_dir / "checkpoints" / "checkpoints").exists()


def test_a_yaml_preset_without_the_suffix_runs_inside_out_dir(tmp_path, capsys, monkeypatch):
    """A preset file named without .yaml kept its whole path as the preset's name, so its run
    folder <out_dir>/<preset>-<time> was the file's own path plus a time: beside the file."""
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "mine").write_text("model:\n  name: cnn-baseline\n  preset: tiny\ndata:\n  limit: 200\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "train", str(configs / "mine"), "max_steps=1", "out_dir=runs", *FAST)
    assert code == 0, err
    assert [p.name[: len("mine-")] for p in (tmp_path / "runs").iterdir()] == ["mine-"]
    assert sorted(p.name for p in configs.iterdir()) == ["mine"]


def _interrupt(*_args, **_kwargs):
    raise KeyboardInterrupt  # what Ctrl-C raises outside the training loop's own handler


def _main_catching_ctrl_c(*argv):
    try:
        return cli.main(list(argv))
    except KeyboardInterrupt:
        pytest.fail(f"Ctrl-C during `torchvote {' '.join(argv)}` ended in a traceback")


def test_ctrl_c_before_training_starts_is_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    # Ctrl-C in the first seconds of a run (MNIST loading) printed a KeyboardInterrupt traceback
    import torchvote.training

    monkeypatch.setattr(torchvote.training, "train", _interrupt)
    code = _main_catching_ctrl_c("train", "smoke", f"run_dir={tmp_path / 'r'}", *FAST)
    err = capsys.readouterr().err
    assert code == 130 and err.strip() == "torchvote train: interrupted"


def test_ctrl_c_during_evaluate_is_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    import importlib

    run_dir = tmp_path / "r"
    assert run(capsys, "train", "smoke", "max_steps=1", "eval_every=0", f"run_dir={run_dir}", *FAST)[0] == 0
    evaluate_module = importlib.import_module("torchvote.training.evaluation")  # not the function
    monkeypatch.setattr(evaluate_module, "evaluate_checkpoint", _interrupt)
    code = _main_catching_ctrl_c("evaluate", str(run_dir), "--on", "mnist")
    err = capsys.readouterr().err
    assert code == 130 and err.strip() == "torchvote evaluate: interrupted"


def test_ctrl_c_while_torch_imports_is_one_line_and_status_130():
    """Ctrl-C in a command's first second or two, while `import torch` runs, printed a traceback:
    the command line's module imported torch before `main` could catch anything."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "class CtrlC:\n"  # Ctrl-C arrives as torch starts to import
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, CtrlC())\n"
        "from torchvote.cli import main; sys.exit(main(sys.argv[1:]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, "list"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.strip()) == (cli.EXIT_INTERRUPTED, "torchvote: interrupted")


def test_reproduce_interrupted_before_its_run_trains_says_how_to_continue(tmp_path, capsys, monkeypatch):
    # the bare KeyboardInterrupt of Ctrl-C while a run loaded its data left "torchvote reproduce: "
    import torchvote.training

    monkeypatch.setattr(torchvote.training, "train", _interrupt)
    argv = ["reproduce", "router-swap", "--variant", "uniform / MNIST", "--seeds", "0"]
    code = _main_catching_ctrl_c(*argv, "--out", str(tmp_path / "out"))
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines()[-1] == (
        "torchvote reproduce: interrupted; rerun the same command to continue"
    )


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["train", "smoke", "--epochs", "3"], "overrides are key=value: epochs=3"),
        (["train", "smoke", "--batch-size=64"], "overrides are key=value: batch_size=64"),
        (["train", "smoke", "--optim.lr", "1e-3", "epochs=1"], "overrides are key=value: optim.lr=1e-3"),
        (["main", "--epochs", "1"], "overrides are key=value: epochs=1"),  # `1` went to the overrides
        (["train", "smoke", "--max-steps"], "overrides are key=value: max_steps=VALUE"),
    ],
)
def test_a_config_key_given_as_an_option_is_shown_as_key_value(capsys, argv, hint):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "unrecognized arguments: --" in err and hint in err


def test_an_unknown_option_that_is_no_config_key_gets_no_key_value_hint(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "smoke", "--frobnicate", "3"])
    assert "key=value" not in capsys.readouterr().err


def test_list_models_names_their_sizes_apart_from_the_training_presets(capsys):
    # "presets: paper, small, tiny" beside the training presets listed below it: `torchvote train
    # tiny` is an unknown preset, model.preset=tiny is what those names are for
    code, out, _ = run(capsys, "list", "models")
    capsnet = next(line for line in out.splitlines() if line.startswith("capsnet "))
    assert code == 0 and capsnet.endswith("model.preset: paper, small, tiny") and "presets:" not in capsnet


def test_a_missing_optional_dependency_is_one_line(tmp_path, capsys, monkeypatch):
    # affNIST needs scipy, which `make run` does not install: a traceback before (exit status 1:
    # the command line was fine, running it failed)
    import sys

    for module in ("scipy", "scipy.io", "scipy.io.matlab"):
        monkeypatch.setitem(sys.modules, module, None)  # `import scipy` fails as when not installed
    (tmp_path / "test.mat").write_bytes(b"not read")
    code, _, err = run(capsys, "data", "affnist", "--verify", "--root", str(tmp_path))
    assert code == 1 and err.strip().splitlines() == [
        "torchvote data: error: reading affNIST's .mat files needs scipy, the 'affnist' extra: pip install "
        '"torchvote[affnist]" (or pip install scipy)'
    ]


@pytest.mark.parametrize("status", [0, 1, 130], ids=["finished", "failed", "interrupted"])
def test_make_run_says_where_the_torchvote_command_is(tmp_path, status):
    """README's next command, `torchvote list`, was "command not found" after `make run`; a run
    stopped part way printed `torchvote train --resume ...` to go on, and no hint (printed only
    after a main job that finished). The hint now follows the main job however it ended, and make
    fails where it failed. Run with a stand-in venv whose `torchvote` ends with ``status``."""
    import os
    import shutil
    import subprocess
    import time
    from pathlib import Path

    makefile = Path(cli.__file__).resolve().parents[2] / "Makefile"
    if shutil.which("make") is None:
        pytest.fail("make is needed by the set-up the README describes")
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    for name, body in [("python", "exit 0"), ("torchvote", f'echo "torchvote $*"; exit {status}')]:
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    (venv / ".installed-run").touch()  # installed, after pyproject.toml and the venv's python
    later = time.time() + 60
    os.utime(venv / ".installed-run", (later, later))
    done = subprocess.run(
        # --no-print-directory: under `make test` this make is nested and would end its output
        # with "make[1]: Leaving directory ..."
        ["make", "--no-print-directory", "-f", str(makefile), "run", f"VENV={venv}"],
        cwd=makefile.parent, capture_output=True, text=True, timeout=60,
    )
    lines = done.stdout.splitlines()
    assert "torchvote main" in lines  # the stand-in ran
    assert f"{venv}/bin/activate" in lines[-1] and f"{venv}/bin/torchvote" in lines[-1]
    assert (done.returncode == 0) == (status == 0), done.stderr


def test_a_preset_file_under_a_folder_named_with_an_equals_sign_is_a_preset(tmp_path, capsys):
    """`torchvote train /runs/lr=0.1/p.yaml` was read as the override '/runs/lr' (sweep folders are
    often named so, and the commands a run prints name RUN/config.yaml)."""
    folder = tmp_path / "lr=0.1"
    folder.mkdir()
    preset = folder / "p.yaml"
    preset.write_text("model: {name: cnn-baseline, preset: tiny}\ndata: {name: small-digits}\n")
    quiet = ["max_steps=1", "batch_size=50", "progress=false", "tensorboard=false"]
    argv = ["train", str(preset), *quiet, f"run_dir={tmp_path / 'run'}"]
    assert cli.main(argv) == 0
    assert (tmp_path / "run" / "config.yaml").is_file()


def test_run_folders_expand_the_home_folder_and_name_a_file_in_the_way(tmp_path, capsys, monkeypatch):
    """run_dir='~/x' made a folder literally named '~'; out_dir naming a file said only
    '[Errno 17] File exists'."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    quiet = ["max_steps=1", "progress=false", "tensorboard=false"]
    assert cli.main(["train", "smoke", "run_dir=~/x", *quiet]) == 0
    assert (tmp_path / "home" / "x" / "config.yaml").is_file() and not (tmp_path / "~").exists()
    (tmp_path / "afile").write_text("mine")
    for key in ("out_dir", "run_dir"):
        value = tmp_path / "afile" / ("sub" if key == "run_dir" else "")
        assert cli.main(["train", "smoke", f"{key}={value}", *quiet]) == 2
        assert f"{key}: {tmp_path / 'afile'} is a file" in capsys.readouterr().err


@pytest.mark.parametrize("missing", [["omegaconf"], ["yaml", "omegaconf"]], ids=["omegaconf", "both"])
def test_commands_that_train_nothing_run_without_the_train_extra(missing):
    """The install explain's docs give (no train extra) ended every command, `list routers` and
    `explain` too, in a traceback: the command line imported the training loop (omegaconf) first.
    Now they run, and a command that trains names the extra. Without the extra PyYAML is missing
    too (omegaconf brings it), and the training config imports it first: the error named `yaml`
    and no extra."""
    import subprocess
    import sys

    script = (
        f"import sys; sys.modules.update(dict.fromkeys({missing!r}))\n"  # None: as if not installed
        "from torchvote.cli import main; sys.exit(main(sys.argv[1:]))\n"
    )

    def run(*argv):
        command = [sys.executable, "-c", script, *argv]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    listed = run("list")
    assert listed.returncode == 0, listed.stderr
    assert "dynamic" in listed.stdout and "the training presets need the train extra" in listed.stdout
    trained = run("train", "smoke", "max_steps=1")
    assert trained.returncode == cli.EXIT_FAILURE and "Traceback" not in trained.stderr  # a missing package
    assert 'pip install "torchvote[train]"' in trained.stderr


@pytest.mark.parametrize("missing", ["matplotlib", "matplotlib.pyplot"], ids=["absent", "broken"])
def test_main_without_matplotlib_stops_before_training_unless_told_no_report(tmp_path, capsys, monkeypatch,
                                                                             missing):
    """The main job ends with the explain report: without the plots extra it trained for minutes,
    then failed on the report; it stops at once now, naming the extra and --no-report. With
    --no-report it trains, and says why no training curves were drawn. An install whose pyplot
    does not import (a system library missing) is no matplotlib either: finding the package was
    not enough."""
    import sys
    from types import SimpleNamespace

    import torchvote.training as training
    import torchvote.training.plots as plots

    monkeypatch.setattr(training, "train", lambda *args, **kwargs: pytest.fail("trained before the check"))
    monkeypatch.setitem(sys.modules, missing, None)  # as when it is not installed, or fails to import
    assert cli.main(["main", "max_steps=1", "progress=false", "tensorboard=false"]) == cli.EXIT_FAILURE
    error = capsys.readouterr().err
    assert "need matplotlib" in error and "--no-report" in error
    assert 'pip install "torchvote[plots]"' in error
    run_dir = tmp_path / "run"  # a finished run, as train() returns it
    result = SimpleNamespace(interrupted=False, checkpoint=SimpleNamespace(weights=run_dir / "w"),
                             metrics_path=run_dir / "m", run_dir=run_dir, plots=[])
    monkeypatch.setattr(training, "train", lambda *args, **kwargs: result)
    monkeypatch.setattr(plots, "plot_run", lambda result: [])  # what it draws without matplotlib
    assert cli.main(["main", "--no-report", "progress=false", "tensorboard=false"]) == 0
    assert 'plots:      not drawn, no matplotlib (pip install "torchvote[plots]")' in capsys.readouterr().out


@pytest.mark.parametrize("installed", [True, False])
def test_a_run_says_where_its_tensorboard_events_went_or_why_none(tmp_path, capsys, monkeypatch, installed):
    """tensorboard=true is the default, and without the package a run wrote nothing and said
    nothing of it."""
    import types

    class EventWriter:  # the package's SummaryWriter makes its folder at once, as this does
        def __init__(self, log_dir, purge_step=None):
            Path(log_dir).mkdir(parents=True, exist_ok=True)

        def add_scalar(self, tag, value, step):
            pass

        flush = close = lambda self: None

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = EventWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake if installed else None)
    assert cli.main(["train", "smoke", "max_steps=1", "progress=false", f"run_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    if installed:
        assert f"tensorboard: {tmp_path / 'run' / 'tensorboard'}" in out
    else:
        assert 'tensorboard: not written, no tensorboard package (pip install "torchvote[tensorboard]"' in out
    assert cli.main(["train", "smoke", "max_steps=1", "progress=false", "tensorboard=false",
                     f"run_dir={tmp_path / 'quiet'}"]) == 0
    assert "tensorboard:" not in capsys.readouterr().out
