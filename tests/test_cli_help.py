"""What ``torchvote --help`` and the subcommands' help say: the exit statuses the code returns,
which folder ``--out`` names, and the defaults the options leave unstated otherwise."""

from __future__ import annotations

import re

import pytest

from torchvote import cli
from torchvote.training.stopping import exit_status


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The help text of ``torchvote ARGV --help``, its whitespace made single spaces."""
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--help"])
    assert info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_top_level_help_lists_the_exit_statuses_the_code_returns(capsys) -> None:
    """`torchvote --help` did not say what 1, 2, 130 or 143 mean."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    raw = capsys.readouterr().out
    head, table = raw.split("exit status", 1)[1].split("\n", 1)  # the epilog's table as written
    assert head == " (2: the command line itself is wrong; 1: it is fine, but running it failed):"
    rows: dict[str, str] = {}
    for line in table.splitlines():  # a row: "  STATUS  text", its text continued on indented lines
        if match := re.match(r"  (\d+) +(.*)", line):
            status, rows[match[1]] = match[1], match[2]
        elif line.startswith("       "):
            rows[status] += " " + line.strip()
    assert list(rows) == ["0", "1", "2", "130", "143"]
    assert rows[str(cli.EXIT_FAILURE)].startswith("a failure while running: missing data")
    assert cli.EXIT_BROKEN_PIPE == cli.EXIT_MISSING_DATA == cli.EXIT_FAILURE  # one row holds them all
    assert "--verify" in rows["1"] and "broken pipe" in rows["1"]
    assert rows[str(cli.EXIT_USAGE)].startswith("a usage error")
    for failure in ("training diverged", "out of memory", "download error", "optional package"):
        assert failure in rows["1"] and failure not in rows["2"]  # 2 was both, usage and failure
    assert rows[str(cli.EXIT_INTERRUPTED)].startswith("Ctrl-C")
    assert rows[str(cli.EXIT_TERMINATED)].startswith("SIGTERM: train, main and reproduce")
    # the numbers are the ones the code returns
    assert (cli.EXIT_FAILURE, cli.EXIT_USAGE) == (1, 2)
    assert cli.EXIT_INTERRUPTED == exit_status("SIGINT") == exit_status("") == 130
    assert cli.EXIT_TERMINATED == exit_status("SIGTERM") == 143


def test_the_exit_statuses_in_the_table_are_returned(tmp_path, capsys, monkeypatch) -> None:
    assert cli.main(["data", "affnist", "--root", str(tmp_path)]) == cli.EXIT_MISSING_DATA
    assert cli.main(["train", "no-such-preset"]) == cli.EXIT_USAGE

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_list", interrupted)
    assert cli.main(["list"]) == cli.EXIT_INTERRUPTED
    capsys.readouterr()


def test_out_says_whether_it_is_the_folder_or_its_parent(capsys) -> None:
    """--out is the folder itself for demo (and explain), the parent of the runs for reproduce."""
    assert "--out DIR, --output-dir DIR this folder: the plots go straight into it" in _help(capsys, "demo")
    assert "folder for index.html" in _help(capsys, "explain")
    text = _help(capsys, "reproduce")
    assert "--out OUT the parent folder: runs go to OUT/NAME/BUDGET/VARIANT/seed-N" in text
    assert "the summary to OUT/NAME/BUDGET/summary.md (default: runs/reproduce)" in text


def test_generate_help_states_the_sampling_defaults(capsys) -> None:
    text = _help(capsys, "generate")
    assert "(default: unseeded, a new text each time)" in text
    assert "the K most likely tokens (default: off, every token)" in text
    assert "(0 < P <= 1; default: off, every token)" in text
    defaults = cli.build_parser().parse_args(["generate", "run"])
    assert (defaults.seed, defaults.top_k, defaults.top_p) == (None, None, None)  # off, as said


def test_evaluate_and_data_help_state_the_root_and_limit_defaults(capsys) -> None:
    text = _help(capsys, "evaluate")
    assert "default: $TORCHVOTE_DATA/<data set>, else ~/.cache/torchvote/<data set>" in text
    assert "(without --on: the run's own data.root, if it set one)" in text
    assert "default: every example (without --on: the run's own data.eval_limit)" in text
    text = _help(capsys, "data")
    assert "--download writes into it (default: $TORCHVOTE_DATA/<data set>, else" in text
    assert "--dir DIR the old spelling of --root" in text
    assert "--force mnist, affnist: download again" in text


def test_bench_reports_a_script_a_signal_ended_as_a_shell_does(monkeypatch):
    """``subprocess.call`` gives -15 for a script SIGTERM ended: returned as it was, a shell saw
    241 (diff review); 128 + 15 is what the epilog and a shell say."""
    import subprocess

    from torchvote.cli import main

    monkeypatch.setattr(subprocess, "call", lambda *args, **kwargs: -15)
    assert main(["bench", "routing", "--quick"]) == 143
    monkeypatch.setattr(subprocess, "call", lambda *args, **kwargs: 3)
    assert main(["bench", "routing", "--quick"]) == 3
