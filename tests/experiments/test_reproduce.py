"""`torchvote reproduce`: rows are valid configs, runs resume, summaries count every seed."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import statistics

import pytest
import yaml

from torchvote.cli import exit_status_of, main
from torchvote.data import CorruptDataError
from torchvote.experiments import (
    Metric,
    Row,
    Variant,
    get_row,
    list_rows,
    reproduce,
    run_dir_of,
    train_command,
)
from torchvote.experiments.report import UNRECORDED_CODE, metric_value, summarize, write_summary
from torchvote.experiments.runner import describe_code, plan_run
from torchvote.training import read_metrics, train
from torchvote.training.config import ConfigError, build_model_config, config_to_dict, load_config


def test_every_row_of_every_budget_loads_as_a_valid_config():
    """A typo in a row's override (a key, a model field, a router name) fails here, not after hours."""
    assert len(list_rows()) >= 8  # rows a to h: the loops below check every one
    for row in list_rows().values():
        for budget in row.budgets:
            for variant in row.variants:
                config = load_config(variant.preset, row.overrides(variant, budget, seed=0))
                assert config.seed == 0
                # the model config is checked against the model's own fields
                build_model_config(config.model, num_classes=10, image_size=config.data.canvas or 28)


def test_rows_cover_the_issue_letters_a_to_h():
    assert sorted({row.letter for row in list_rows().values()}) == list("abcdefgh")
    with pytest.raises(ValueError, match="unknown experiment 'nope'; known: capsnet-routing"):
        get_row("nope")
    row = get_row("router-swap")
    routers = {o.split("=", 1)[1] for v in row.variants for o in v.overrides if o.startswith("model.router=")}
    assert routers == {"dynamic", "em", "inverted_dot_product", "self_attention", "slot", "uniform"}


@pytest.mark.parametrize(
    ("metric", "expected"),
    [
        (Metric("e", transform="error_percent"), 100 * (1 - 0.97)),
        (Metric("p", transform="percent", dataset="b/test"), 50.0),
        (Metric("bpc", key="loss", transform="bits"), 0.6931471805599453 / math.log(2)),
        (Metric("v", key="loss", transform="value"), 0.6931471805599453),
        (Metric("missing", dataset="c/test"), None),
    ],
)
def test_metric_value_reads_the_named_evaluation(metric, expected):
    results = {"a/test": {"accuracy": 0.97, "loss": 0.6931471805599453}, "b/test": {"accuracy": 0.5}}
    value = metric_value(results, metric)
    assert value == pytest.approx(expected) if expected is not None else value is None


def test_write_summary_files_the_summary_under_its_own_budget(tmp_path):
    variants = (Variant("plain", "unused.yaml", ()),)
    row = Row("tiny", "z", "a tiny row", variants, (Metric("error (%)"),), {"cpu": (), "paper": ()})
    path = write_summary(row, tmp_path, summarize(row, "paper", tmp_path))
    assert path.read_text().startswith("### z. a tiny row (budget: paper)")
    assert json.loads((tmp_path / "summary.json").read_text())["budget"] == "paper"


def _tiny_row(tmp_path, tiny_values, **extra) -> Row:
    values = tiny_values(tmp_path / "unused", epochs=2)
    del values["run_dir"]
    preset = tmp_path / "tiny.yaml"
    preset.write_text(yaml.safe_dump(values))
    return Row(
        "tiny",
        "z",
        "a tiny row",
        (
            Variant("plain", str(preset), ("optim.lr=0.003",), paper="1.0"),
            Variant("slower", str(preset), ("optim.lr=0.001",)),
        ),
        (Metric("error (%)"),),
        {"cpu": ("max_steps=8",), "paper": ("max_steps=12",)},
        **extra,
    )


def _final_accuracy(run_dir) -> float:
    finals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == "final"]
    return finals[-1]["accuracy"]


def test_reproduce_runs_every_seed_and_summarises_all_of_them(tmp_path, tiny_values):
    row = _tiny_row(tmp_path, tiny_values)
    out = tmp_path / "out"
    lines: list[str] = []
    summary_path = reproduce(row, seeds=[0, 1, 2], out_dir=out, echo=lines.append)
    summary = json.loads((summary_path.parent / "summary.json").read_text())
    for variant, entry in zip(row.variants, summary["variants"], strict=True):
        errors = [100 * (1 - _final_accuracy(run_dir_of(out, row, "cpu", variant, s))) for s in range(3)]
        stats = entry["metrics"]["error (%)"]
        assert entry["seeds"] == [0, 1, 2]
        assert stats["n"] == 3
        # metrics.jsonl rounds to 6 digits; result.json keeps the full value
        assert stats["mean"] == pytest.approx(statistics.fmean(errors), abs=1e-3)
        assert stats["std"] == pytest.approx(statistics.stdev(errors), abs=1e-3)
        assert entry["commands"][0].startswith(f"torchvote train {variant.preset} ")
    markdown = summary_path.read_text()
    assert "torchvote reproduce tiny --budget cpu" in markdown and "| plain |" in markdown
    # every run records the code it was measured with; the summary names it
    code = describe_code()
    assert {json.loads(p.read_text())["code"] for p in out.rglob("result.json")} == {code}
    assert f"\nCode: {code}.\n" in markdown
    # a second call trains nothing: every run has its result
    before = {p: p.stat().st_mtime_ns for p in out.rglob("result.json")}
    lines.clear()
    reproduce(row, seeds=[0, 1, 2], out_dir=out, echo=lines.append)
    assert all(line.endswith(f"finished earlier ({code})") for line in lines) and len(lines) == 6
    assert before == {p: p.stat().st_mtime_ns for p in out.rglob("result.json")}
    # a run recorded before records named their code: said so, in the summary and as it is skipped
    old = run_dir_of(out, row, "cpu", row.variants[0], 0) / "result.json"
    old.write_text(json.dumps({k: v for k, v in json.loads(old.read_text()).items() if k != "code"}))
    lines.clear()
    markdown = reproduce(row, seeds=[0, 1, 2], out_dir=out, echo=lines.append).read_text()
    assert lines[0].endswith(f"finished earlier ({UNRECORDED_CODE})")
    assert f"\nCode: {'; '.join(sorted([code, UNRECORDED_CODE]))}.\n" in markdown


def test_the_code_of_a_run_is_torchvotes_version_and_its_checkouts_commit(tmp_path):
    import subprocess

    from torchvote import __version__

    checkout = tmp_path / "checkout"
    (checkout / "pkg").mkdir(parents=True)
    (checkout / "pkg" / "module.py").write_text("x = 1\n")
    assert describe_code(checkout / "pkg") == f"torchvote {__version__}"  # no checkout: the version

    def git(*words):
        command = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.com", *words]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    commit = git("rev-parse", "--short", "HEAD")
    assert describe_code(checkout / "pkg") == f"torchvote {__version__} at git {commit}"
    (checkout / "pkg" / "module.py").write_text("x = 2\n")
    (checkout / "pkg" / "new.py").write_text("")  # untracked: not the code that ran
    changed = f"torchvote {__version__} at git {commit}, with uncommitted changes"
    assert describe_code(checkout / "pkg") == changed
    # installed into an environment inside the checkout, untracked: not the checkout's code
    (checkout / "venv" / "site-packages" / "torchvote").mkdir(parents=True)
    (checkout / "venv" / "site-packages" / "torchvote" / "__init__.py").write_text("")
    assert describe_code(checkout / "venv" / "site-packages" / "torchvote") == f"torchvote {__version__}"


def test_an_interrupted_run_resumes_to_the_uninterrupted_numbers(tmp_path, tiny_values):
    row = _tiny_row(tmp_path, tiny_values)
    variant = row.variants[0]
    clean = tmp_path / "clean"
    reproduce(row, seeds=[0], out_dir=clean, variants=["plain"], echo=lambda _: None)

    stopped = tmp_path / "stopped"
    run_dir = run_dir_of(stopped, row, "cpu", variant, 0)
    config = load_config(
        variant.preset, [*row.overrides(variant, "cpu", 0), f"run_dir={run_dir}", "checkpoint_every=3"]
    )

    def stop_after_five(info):
        if info.step == 5:
            raise KeyboardInterrupt

    assert train(config, callbacks=[stop_after_five], verbose=False).interrupted
    assert not (run_dir / "result.json").exists()
    reproduce(row, seeds=[0], out_dir=stopped, variants=["plain"], echo=lambda _: None)
    record = json.loads((run_dir / "result.json").read_text())
    assert record["resumed"] and record["steps"] == 8
    assert _final_accuracy(run_dir) == _final_accuracy(run_dir_of(clean, row, "cpu", variant, 0))


def test_a_finished_run_is_evaluated_on_test_sets_the_row_gained(tmp_path, tiny_values, tiny_mnist_root):
    """Row b adds the real affNIST to eval_on once it is downloaded: every finished run was
    refused as "run with another configuration (the row was edited since)". Now the trained model
    is evaluated on the new set, without training again, its earlier results kept."""
    import dataclasses

    row = _tiny_row(tmp_path, tiny_values)
    out = tmp_path / "out"
    reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lambda _: None)
    run_dir = run_dir_of(out, row, "cpu", row.variants[0], 0)
    before = json.loads((run_dir / "result.json").read_text())
    entry = f"mnist:source=idx,limit=10,root={tiny_mnist_root}"
    budgets = {**row.budgets, "cpu": (*row.budgets["cpu"], f"eval_on=[{entry}]")}
    grown = dataclasses.replace(row, budgets=budgets)
    lines: list[str] = []
    reproduce(grown, seeds=[0], out_dir=out, variants=["plain"], echo=lines.append)
    said = next(line for line in lines if f"evaluates {entry} too" in line)
    assert f"torchvote train --resume {run_dir} 'eval_on=[{entry}]'" in said  # what does it by hand
    after = json.loads((run_dir / "result.json").read_text())
    assert after["steps"] == before["steps"] == 8  # nothing trained again
    for key, value in before["results"]["mnist/test"].items():  # read back from metrics.jsonl: 6 digits
        assert after["results"]["mnist/test"][key] == pytest.approx(value, abs=1e-6), key
    assert after["results"][f"mnist/test ({entry})"]["count"] == 10
    lines.clear()
    reproduce(grown, seeds=[0], out_dir=out, variants=["plain"], echo=lines.append)
    assert all("finished earlier" in line for line in lines)
    # without its last checkpoint the run would train again from an older one: refused
    entry_2 = f"mnist:source=idx,limit=12,root={tiny_mnist_root}"
    budgets = {**row.budgets, "cpu": (*row.budgets["cpu"], f"eval_on=[{entry},{entry_2}]")}
    for path in (run_dir / "checkpoints").glob("step-00000008.*"):
        path.write_bytes(b"torn")
    with pytest.raises(ConfigError, match="cannot be evaluated on .*limit=12.* without training again"):
        reproduce(dataclasses.replace(row, budgets=budgets), seeds=[0], out_dir=out, variants=["plain"],
                  echo=lines.append)
    assert json.loads((run_dir / "result.json").read_text()) == after  # its result kept


def test_a_run_folder_from_an_edited_row_is_refused_and_kept(tmp_path, tiny_values):
    row = _tiny_row(tmp_path, tiny_values)
    variant = row.variants[0]
    run_dir = run_dir_of(tmp_path / "out", row, "cpu", variant, 0)
    config = load_config(variant.preset, ["optim.lr=0.01", "max_steps=8", "seed=0", f"run_dir={run_dir}"])

    def stop(info):
        if info.step == 2:
            raise KeyboardInterrupt

    train(config, callbacks=[stop], verbose=False)
    files = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(ConfigError, match=r"optim.lr \(run: 0.01, row now: 0.003\)"):
        reproduce(row, seeds=[0], out_dir=tmp_path / "out", variants=["plain"], echo=lambda _: None)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == files


def test_unknown_budget_and_unmatched_variant_filters_are_refused(tmp_path, tiny_values):
    row = _tiny_row(tmp_path, tiny_values)
    with pytest.raises(ValueError, match=r"budget: expected one of \['cpu', 'paper'\], got 'gpu'"):
        reproduce(row, budget="gpu", out_dir=tmp_path)
    with pytest.raises(ValueError, match="variants: none of"):
        reproduce(row, variants=["nothing"], out_dir=tmp_path)


def test_cli_lists_rows_and_prints_the_training_commands(capsys):
    assert main(["reproduce", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in list_rows())
    assert main(["reproduce", "capsnet-routing", "--dry-run", "--seeds", "4"]) == 0
    commands = capsys.readouterr().out.strip().splitlines()
    in_out = " seed=4 run_dir=runs/reproduce/capsnet-routing/cpu/"
    assert len(commands) == 4 and all(in_out in c for c in commands)
    # --variant narrows the dry run as it narrows a run (it listed every variant before)
    argv = ["reproduce", "router-swap", "--dry-run", "--variant", "uniform / MNIST", "--seeds", "1"]
    assert main(argv) == 0
    commands = capsys.readouterr().out.strip().splitlines()
    row = get_row("router-swap")
    variant = next(v for v in row.variants if v.label == "uniform / MNIST")
    run_dir = run_dir_of("runs/reproduce", row, "cpu", variant, 1)
    assert commands == [train_command(row, variant, "cpu", 1, run_dir=run_dir)]
    assert main(["reproduce", "capsnet-routing", "--dry-run", "--variant", "nothing"]) == 2
    assert main(["reproduce", "no-such-row"]) == 2


def test_dry_run_commands_survive_a_shell():
    # eval_on=[affnist-style] unquoted is a glob pattern (zsh stops: "no matches found")
    row = get_row("affnist")
    for variant in row.variants:
        command = train_command(row, variant, "cpu", 0)
        expected = ["torchvote", "train", variant.preset, *row.overrides(variant, "cpu", 0)]
        assert shlex.split(command) == expected
        assert "'eval_on=[affnist-style]'" in command


def test_dry_run_prints_what_the_run_trains_where_it_trains_it(capsys, tmp_path, monkeypatch):
    """The dry run's lines left out the run folder and --device: run as printed, they trained into
    runs/<preset>-<time> (never summarised) on whatever device `auto` found."""
    out = tmp_path / "reproduced"
    argv = ["reproduce", "capsnet-routing", "--dry-run", "--seeds", "0", "--out", str(out), "--device", "cpu"]
    assert main(argv) == 0
    commands = [shlex.split(line) for line in capsys.readouterr().out.strip().splitlines()]
    row = get_row("capsnet-routing")
    assert len(commands) == len(row.variants)
    trained = []  # what reproduce() itself loads, for the same request
    monkeypatch.setattr("torchvote.experiments.runner.load_config", lambda p, o: trained.append([p, *o]))
    monkeypatch.setattr("torchvote.training.train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    for variant, command in zip(row.variants, commands, strict=True):
        run_dir = run_dir_of(out, row, "cpu", variant, 0)
        assert command[-2:] == [f"run_dir={run_dir}", "device=cpu"]
        with pytest.raises(KeyboardInterrupt):
            reproduce(row, seeds=[0], out_dir=out, device="cpu", variants=[variant.label], echo=print)
        assert trained[-1] == command[2:]  # preset and overrides, exactly as printed
    capsys.readouterr()
    monkeypatch.undo()
    # a finished run is marked: rerunning skips it
    finished = run_dir_of(out, row, "cpu", row.variants[0], 0)
    finished.mkdir(parents=True)
    _write_finished_run(finished, commands[0], row.variants[0].label)
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("# finished: torchvote train") and not lines[1].startswith("#")


def _write_finished_run(run_dir, command, label, **changes):
    """A finished run's two files, as reproduce leaves them, for the run ``command`` trains
    (``torchvote train PRESET OVERRIDES...``), its config changed by ``changes`` (dotted keys)."""
    config = load_config(command[2], [*command[3:], *(f"{k}={v}" for k, v in changes.items())])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
    record = {"variant": label, "seed": config.seed, "results": {}, "wall_s": 1.0, "command": ""}
    record["device"] = "cpu"
    (run_dir / "result.json").write_text(json.dumps(record))


def test_an_empty_variant_filter_is_refused(capsys):
    # `--variant ''` is in every label: it ran every variant as if no filter were given
    assert main(["reproduce", "capsnet-routing", "--dry-run", "--variant", ""]) == 2
    assert "variants: an empty text matches every label" in capsys.readouterr().err


def test_rows_are_found_by_their_letter_when_it_is_theirs_alone():
    assert get_row("h").name == "pretrained-routing"
    with pytest.raises(ValueError, match="row 'e' has several experiments; name one: em-iterations, em-"):
        get_row("e")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seeds", "-1"], "seeds[0] must be an integer in [0, 2**64), got -1"),
        (["--seeds", "0", "0"], "seeds must be distinct, got [0, 0]"),
        (["--device", "tpu"], "--device must be auto, cpu, cuda or cuda:<index>, got 'tpu'"),
        (["--budget", "paper", "--variant", "nothing"], "variants: none of ['nothing']"),
    ],
)
def test_dry_run_checks_what_a_run_checks(capsys, argv, message):
    assert main(["reproduce", "capsnet-routing", "--dry-run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_measuring_row_dry_runs_and_refuses_training_options(capsys, tmp_path):
    # pretrained-routing's dry run said "variants: none of [] is in a label of []"
    assert main(["reproduce", "pretrained-routing", "--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pretrained-routing trains nothing: it measures" in out and "# finished" not in out
    measured = tmp_path / "pretrained-routing" / "cpu" / "result.json"  # what a measurement writes
    measured.parent.mkdir(parents=True)
    measured.write_text("{}")
    assert main(["reproduce", "h", "--dry-run", "--out", str(tmp_path)]) == 0
    assert f"# finished: measured earlier, {measured}" in capsys.readouterr().out
    assert main(["reproduce", "h", "--dry-run", "--seeds", "1"]) == 2
    assert "--seeds: pretrained-routing trains nothing" in capsys.readouterr().err
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    assert main(["reproduce", "h", "--out", str(a_file)]) == 2
    assert "is a file" in capsys.readouterr().err and a_file.read_text() == "mine"
    for row in ("h", "capsnet-routing"):  # a parent: the first run failed to make its folder, the row went on
        assert main(["reproduce", row, "--dry-run", "--out", str(a_file / "rep")]) == 2
        assert f"out: {a_file} is a file; runs and summaries need a folder" in capsys.readouterr().err


def test_an_interrupted_reproduce_says_one_way_to_continue(tmp_path, tiny_values, capsys, monkeypatch):
    # Ctrl-C inside a run printed the loop's "resume with: torchvote train --resume <run>" and then
    # reproduce's "rerun the same command": two instructions, and the first one finishes the run
    # without its result.json, the other runs of the row and the summary
    import torchvote.experiments
    import torchvote.training

    row = _tiny_row(tmp_path, tiny_values)
    monkeypatch.setattr(torchvote.experiments, "get_row", lambda name: row)
    real_train = torchvote.training.train

    def ctrl_c_after_three_steps(config, **kwargs):  # what the loop does on Ctrl-C / SIGTERM
        def stop(info):
            if info.step == 3:
                raise KeyboardInterrupt

        return real_train(config, callbacks=[stop], **kwargs)

    monkeypatch.setattr(torchvote.training, "train", ctrl_c_after_three_steps)
    argv = ["reproduce", "tiny", "--seeds", "0", "--variant", "plain", "--out", str(tmp_path / "out")]
    assert main(argv) == 130
    err = capsys.readouterr().err
    run_dir = run_dir_of(tmp_path / "out", row, "cpu", row.variants[0], 0)
    instructions = [line for line in err.splitlines() if "resume" in line or "rerun" in line]
    assert instructions == [
        f"torchvote reproduce: run {run_dir} interrupted; rerun the same command to continue"
    ]
    assert "stopped at step 3 of 8; checkpoint saved at step 3" in err  # where it stopped: still said

    monkeypatch.setattr(torchvote.training, "train", real_train)
    assert main(argv) == 0  # the instruction given: the same command resumes and finishes the row
    assert json.loads((run_dir / "result.json").read_text())["resumed"]


def test_a_sigterm_stopped_reproduce_exits_143(tmp_path, tiny_values, capsys, monkeypatch):
    """A SIGTERM (a scheduler's) inside a run exited 130, Ctrl-C's status: 128 + 15 is the
    shell's, and the run's checkpoint is saved as on Ctrl-C."""
    import torchvote.experiments
    import torchvote.training

    row = _tiny_row(tmp_path, tiny_values)
    monkeypatch.setattr(torchvote.experiments, "get_row", lambda name: row)
    real_train = torchvote.training.train

    def sigterm_at_step_three(config, **kwargs):
        def stop(info):
            if info.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)  # the loop's handler: finish the step, save, stop

        return real_train(config, callbacks=[stop], **kwargs)

    monkeypatch.setattr(torchvote.training, "train", sigterm_at_step_three)
    argv = ["reproduce", "tiny", "--seeds", "0", "--variant", "plain", "--out", str(tmp_path / "out")]
    assert main(argv) == 143
    assert "SIGTERM: stopped at step 3 of 8; checkpoint saved at step 3" in capsys.readouterr().err


def test_each_run_is_announced_with_the_command_the_dry_run_prints(capsys, tmp_path, monkeypatch):
    # reproduce announced a run as `torchvote train ... seed=0`, without the run folder and device
    # it trains with: copied from the screen, it trained into runs/<preset>-<time> on any device
    argv = ["reproduce", "capsnet-routing", "--seeds", "0", "--out", str(tmp_path), "--device", "cpu"]
    argv += ["--variant", "1 iteration, no reconstruction"]
    assert main([*argv, "--dry-run"]) == 0
    dry_run = capsys.readouterr().out.strip()
    monkeypatch.setattr("torchvote.training.train", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(argv) == 130
    announced = capsys.readouterr().out.strip().splitlines()
    assert len(announced) == 1 and announced[0].endswith(f": {dry_run}")


def test_the_summary_names_the_seed_of_the_commands_it_shows(tmp_path):
    """It said "seed 0" over the command of seed 5 when --seeds 5 6 ran."""
    row = Row("tiny", "z", "a tiny row", (Variant("plain", "unused.yaml", ()),), (Metric("error (%)"),),
              {"cpu": (), "paper": ()})
    cell = {"n": 2, "mean": 1.0, "std": 0.5, "min": 0.5, "max": 1.5}
    variant = {"label": "plain", "paper": None, "seeds": [5, 6], "metrics": {"error (%)": cell},
               "wall_s": cell, "commands": ["torchvote train x seed=5", "torchvote train x seed=6"],
               "devices": ["cpu"]}
    summary = {"row": "tiny", "letter": "z", "title": "a tiny row", "budget": "cpu", "variants": [variant]}
    text = write_summary(row, tmp_path, summary).read_text()
    assert "Commands (seed 5; the other seeds change `seed=`)" in text and "seed 0" not in text


def test_dry_run_refuses_seeds_a_run_would_refuse(capsys):
    assert main(["reproduce", "capsnet-routing", "--dry-run", "--seeds", str(2**64)]) == 2
    assert "seeds[0] must be an integer in [0, 2**64)" in capsys.readouterr().err


def test_a_finished_run_of_an_edited_row_is_refused_not_averaged(tmp_path, tiny_values):
    """A finished run was skipped as 'finished earlier' and averaged with the new runs whatever
    the row said now (row e's data.limit went from 2000 to 10000 in one commit): a 3-step and a
    6-step run made one mean. Every finished run of the row is checked, chosen or not."""
    row = _tiny_row(tmp_path, tiny_values)
    out = tmp_path / "out"
    for variant in row.variants:
        run_dir = run_dir_of(out, row, "cpu", variant, 0)
        run_dir.mkdir(parents=True)
        command = shlex.split(train_command(row, variant, "cpu", 0, run_dir=run_dir))
        edits = {"max_steps": 3} if variant.label == "slower" else {}
        _write_finished_run(run_dir, command, variant.label, **edits)
    with pytest.raises(ConfigError, match=r"slower/seed-0 was run with .*max_steps \(run: 3, row now: 8\)"):
        reproduce(row, seeds=[0, 1], out_dir=out, variants=["plain"], echo=lambda _: None)
    # where a run ends is part of its numbers: a target it stopped at (row b's paper budget)
    # and how often it was checked were taken as free keys, the result counted as the row's
    target = {"stop_at_accuracy": 0.5, "eval_every": 1}
    edited = ((target, "stop_at_accuracy"), ({"eval_every": 3}, "eval_every"))
    for edits, key in edited:
        _write_finished_run(run_dir, command, "slower", **edits)
        with pytest.raises(ConfigError, match=rf"slower/seed-0 was run with .*{key} \(run: "):
            reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lambda _: None)
    assert not run_dir_of(out, row, "cpu", row.variants[0], 1).exists()  # refused before training
    # where and how a run ran may differ: device, logging, checkpoints
    slower = run_dir_of(out, row, "cpu", row.variants[1], 0)
    command = shlex.split(train_command(row, row.variants[1], "cpu", 0, run_dir=slower))
    free = {"device": "cpu", "log_every": 7, "checkpoint_every": 2, "progress": True}
    _write_finished_run(slower, command, "slower", **free)
    lines: list[str] = []
    reproduce(row, seeds=[0], out_dir=out, echo=lines.append)
    assert all("finished earlier" in line for line in lines) and len(lines) == 2


def test_a_finished_run_whose_eval_on_entry_the_row_replaced_is_refused(
    tmp_path, tiny_values, tiny_mnist_root
):
    """Only added eval_on entries are evaluated on resume: a finished run evaluated on an entry the
    row no longer has was counted as the row's (mutation review)."""
    import dataclasses

    entry = f"mnist:source=idx,limit=10,root={tiny_mnist_root}"
    row = _tiny_row(tmp_path, tiny_values)
    budgets = {**row.budgets, "cpu": (*row.budgets["cpu"], f"eval_on=[{entry}]")}
    row = dataclasses.replace(row, budgets=budgets)
    out = tmp_path / "out"
    run_dir = run_dir_of(out, row, "cpu", row.variants[0], 0)
    run_dir.mkdir(parents=True)
    command = shlex.split(train_command(row, row.variants[0], "cpu", 0, run_dir=run_dir))
    _write_finished_run(run_dir, command, "plain", eval_on=f"[{entry.replace('limit=10', 'limit=12')}]")
    with pytest.raises(ConfigError, match=r"plain/seed-0 was run with .*eval_on \(run: "):
        reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lambda _: None)


def test_a_finished_run_of_another_seed_of_an_edited_row_is_refused(tmp_path, tiny_values):
    """Every finished run of the row is checked, not only seed 0's: an edited row's seed-1 run was
    averaged with the new seed-0 one (mutation review)."""
    row = _tiny_row(tmp_path, tiny_values)
    out = tmp_path / "out"
    run_dir = run_dir_of(out, row, "cpu", row.variants[0], 1)
    run_dir.mkdir(parents=True)
    command = shlex.split(train_command(row, row.variants[0], "cpu", 1, run_dir=run_dir))
    _write_finished_run(run_dir, command, "plain", max_steps=3)
    with pytest.raises(ConfigError, match=r"plain/seed-1 was run with .*max_steps \(run: 3, row now: 8\)"):
        reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lambda _: None)
    assert not run_dir_of(out, row, "cpu", row.variants[0], 0).exists()  # refused before training


def test_a_stopped_runs_resume_command_names_its_device(tmp_path, tiny_values):
    """The printed `torchvote train --resume` line left out --device: run by hand, it resumed on
    whatever device `auto` found (mutation review)."""
    row = _tiny_row(tmp_path, tiny_values)
    variant = row.variants[0]
    run_dir = run_dir_of(tmp_path / "out", row, "cpu", variant, 0)
    config = load_config(variant.preset, [*row.overrides(variant, "cpu", 0), f"run_dir={run_dir}"])

    def stop(info):
        if info.step == 2:
            raise KeyboardInterrupt

    assert train(config, callbacks=[stop], verbose=False).interrupted
    planned = plan_run(row, variant, "cpu", 0, run_dir, "cpu")
    assert planned.state == "resume"
    assert shlex.split(planned.command) == ["torchvote", "train", "--resume", str(run_dir), "device=cpu"]
    assert shlex.split(plan_run(row, variant, "cpu", 0, run_dir, "auto").command)[-1] == str(run_dir)


@pytest.mark.parametrize("content", ['{"variant": "pl', "{}", "[1, 2]"])
def test_a_torn_or_foreign_result_file_is_refused_by_name(tmp_path, tiny_values, content):
    """A truncated result.json stopped the summary with 'Invalid control character at: line 1'
    (no file named); {} with KeyError: 'variant'; and either counted as a finished run."""
    row = _tiny_row(tmp_path, tiny_values)
    out = tmp_path / "out"
    run_dir = run_dir_of(out, row, "cpu", row.variants[1], 2)
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(content)
    with pytest.raises(ValueError, match=r"slower/seed-2/result.json .*delete it to run that seed again"):
        reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lambda _: None)
    with pytest.raises(CorruptDataError, match="seed-2/result.json"):  # a failure: exit status 1
        summarize(row, "cpu", out / "tiny" / "cpu")
    with pytest.raises(ValueError) as info:
        reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lambda _: None)
    assert exit_status_of(info.value) == 1  # the command line was fine; a file on disk is damaged


def test_a_stopped_run_is_shown_and_continued_as_a_resume(tmp_path, tiny_values, capsys, monkeypatch):
    """--dry-run (and the progress line) printed a fresh `torchvote train ... run_dir=DIR` for a
    run that reproduce resumes; pasted, it fails ('already holds a run')."""
    row = _tiny_row(tmp_path, tiny_values)
    variant = row.variants[0]
    out = tmp_path / "out"
    run_dir = run_dir_of(out, row, "cpu", variant, 0)
    overrides = [*row.overrides(variant, "cpu", 0), f"run_dir={run_dir}", "checkpoint_every=3"]
    config = load_config(variant.preset, overrides)

    def stop_after_four(info):
        if info.step == 4:
            raise KeyboardInterrupt

    assert train(config, callbacks=[stop_after_four], verbose=False).interrupted
    planned = plan_run(row, variant, "cpu", 0, run_dir, "auto")
    assert planned.state == "resume" and planned.command == f"torchvote train --resume {run_dir}"
    assert planned.note == "resumes from step 4"  # the checkpoint saved at the stop
    lines: list[str] = []
    reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lines.append)
    assert lines[0].endswith(f"torchvote train --resume {run_dir} (resumes from step 4)")
    assert json.loads((run_dir / "result.json").read_text())["resumed"]


def test_a_run_killed_while_writing_its_first_checkpoint_is_trained_afresh(tmp_path, tiny_values):
    """Weights written, training state not (a full disk, a kill): every rerun failed with 'no intact
    checkpoint' and no way on, while the folder holds nothing to resume."""
    row = _tiny_row(tmp_path, tiny_values)
    variant = row.variants[0]
    out = tmp_path / "out"
    reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lambda _: None)
    run_dir = run_dir_of(out, row, "cpu", variant, 0)
    expected = _final_accuracy(run_dir)
    (run_dir / "result.json").unlink()
    for state in (run_dir / "checkpoints").glob("*.state.pt"):
        state.unlink()
    (run_dir / "checkpoints" / "latest").unlink(missing_ok=True)
    lines: list[str] = []
    reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lines.append)
    assert "no intact checkpoint to resume" in lines[0] and "trained afresh" in lines[0]
    record = json.loads((run_dir / "result.json").read_text())
    assert not record["resumed"] and record["steps"] == 8
    assert _final_accuracy(run_dir) == expected  # the same seed's run, from the start


@pytest.mark.parametrize("config", [None, "epochs: [1\n"], ids=["missing", "torn"])
def test_a_finished_run_without_a_readable_config_is_a_damaged_folder(tmp_path, tiny_values, config):
    """A finished run whose config.yaml is gone or torn was refused with a ConfigError, which the
    command line reads as its own mistake (exit status 2): the folder is damaged, status 1."""
    row = _tiny_row(tmp_path, tiny_values)
    out = tmp_path / "out"
    run_dir = run_dir_of(out, row, "cpu", row.variants[0], 0)
    run_dir.mkdir(parents=True)
    command = shlex.split(train_command(row, row.variants[0], "cpu", 0, run_dir=run_dir))
    _write_finished_run(run_dir, command, row.variants[0].label)
    if config is None:
        (run_dir / "config.yaml").unlink()
    else:
        (run_dir / "config.yaml").write_text(config)
    with pytest.raises(CorruptDataError, match="no readable config.yaml") as info:
        reproduce(row, seeds=[0], out_dir=out, variants=["plain"], echo=lambda _: None)
    assert exit_status_of(info.value) == 1
