"""Exit statuses of ``torchvote``: 2 when the command line itself is wrong (argparse's usage error),
1 when the command line is fine but running it failed (training diverged, out of memory, a damaged
checkpoint, a file or download error, a missing optional package). Status 2 covered both before,
and a script could not tell a typo from a full disk."""

from __future__ import annotations

import re

import pytest
import torch

from torchvote import cli
from torchvote.data.errors import CorruptDataError, DownloadError
from torchvote.training.checkpoint import CheckpointError
from torchvote.training.config import ConfigError
from torchvote.training.loop import TrainingDivergedError, TrainingOutOfMemoryError


def _rows(table: str) -> dict[str, str]:
    """The rows of the exit-status table, by status, continuation lines joined."""
    rows: dict[str, str] = {}
    status = None
    for line in table.splitlines()[1:]:
        found = re.match(r"  (\d+)\s+(.*)", line)
        if found:
            status, text = found.groups()
            rows[status] = text
        elif status is not None and line.startswith("     "):
            rows[status] += " " + line.strip()
        else:
            status = None
    return rows


def test_the_table_keeps_2_for_usage_errors_and_states_the_rule():
    rows = _rows(cli.EXIT_STATUSES)
    assert set(rows) == {"0", "1", "2", "130", "143"}
    assert "command line itself is wrong" in cli.EXIT_STATUSES.splitlines()[0]
    assert rows["2"].startswith("a usage error")
    for failure in ("diverged", "out of memory", "download", "package", "damaged checkpoint"):
        assert failure not in rows["2"], rows["2"]
        assert failure in rows["1"], rows["1"]
    assert cli.EXIT_USAGE == 2 and cli.EXIT_FAILURE == 1
    assert cli.EXIT_MISSING_DATA == cli.EXIT_BROKEN_PIPE == cli.EXIT_FAILURE


def test_help_ends_with_the_table(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.rstrip().endswith(cli.EXIT_STATUSES.splitlines()[-1])


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ValueError("--limit must be a positive integer, got 0"), 2),
        (ConfigError("unknown key 'epoch'; keys: epochs, ..."), 2),
        (OSError(28, "No space left on device"), 1),
        (FileNotFoundError("benchmark script benchmarks/em.py not found"), 1),
        (DownloadError("no mirror served train-images-idx3-ubyte.gz"), 1),
        (ModuleNotFoundError("No module named 'scipy'", name="scipy"), 1),
        (TrainingDivergedError("the training loss is nan at step 12"), 1),
        (TrainingOutOfMemoryError("out of memory at step 3; lower batch_size"), 1),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1),
        (CheckpointError("runs/r/checkpoints/step-1.safetensors is corrupt or not a safetensors file"), 1),
        (CorruptDataError("~/.cache/torchvote/mnist/train-images-idx3-ubyte.gz: truncated IDX data"), 1),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"), 1),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value),
)
def test_a_usage_error_exits_2_and_a_failure_while_running_exits_1(monkeypatch, capsys, error, status):
    def fails(args):
        raise error

    monkeypatch.setattr(cli, "_list", fails)
    assert cli.main(["list"]) == status
    err = capsys.readouterr().err
    assert err.startswith("torchvote list: error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (ValueError("x"), 2),
        (ConfigError("x"), 2),
        (CheckpointError("x"), 1),
        (CorruptDataError("x"), 1),
        (OSError("x"), 1),
        (ImportError("x"), 1),
        (TypeError("x"), 1),
        (TrainingDivergedError("x"), 1),
    ],
)
def test_exit_status_of(error, status):
    assert cli.exit_status_of(error, failures=(CheckpointError,)) == status


def test_exit_status_of_a_value_error_subclass_without_failures():
    assert cli.exit_status_of(CheckpointError("x")) == 2  # a ValueError unless named a failure
    assert cli.exit_status_of(CorruptDataError("x")) == 1  # a ValueError, but always a failure


def test_a_missing_checkpoint_is_a_usage_error_and_a_damaged_one_a_failure(tmp_path, capsys):
    """The rule at its edge: a path on the command line that names nothing is the command line's
    mistake (2); a file that is there but cannot be read is a failure while running (1)."""
    code = cli.main(["evaluate", str(tmp_path / "no-run"), "--on", "mnist"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    damaged = tmp_path / "step-1.safetensors"
    damaged.write_bytes(b"not a safetensors file")
    code = cli.main(["evaluate", str(damaged), "--on", "mnist"])
    err = capsys.readouterr().err
    assert code == 1 and "torchvote evaluate: error:" in err and "Traceback" not in err


def test_a_missing_benchmark_script_is_a_failure(tmp_path, capsys, monkeypatch):
    """``bench NAME`` with a NAME the parser accepts: the script missing here (an installed
    package, no checkout) is no mistake of the command line."""
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: tmp_path)
    assert cli.main(["bench", "routing"]) == 1
    assert "benchmark script" in capsys.readouterr().err


def test_explain_statuses(tmp_path, capsys, monkeypatch):
    """``explain`` returns its own status: 2 for its options' values (--out in the way, a
    --checkpoint that names nothing), 1 for a record that cannot be read or a missing package."""
    pytest.importorskip("matplotlib", reason='the report needs matplotlib: pip install "torchvote[plots]"')
    out = str(tmp_path / "out")
    code = cli.main(["explain", "x", "--out", out, "--checkpoint", str(tmp_path / "none.pt")])
    err = capsys.readouterr().err
    assert code == 2 and "--checkpoint: " in err and "does not exist" in err
    (tmp_path / "afile").write_text("mine")
    assert cli.main(["explain", "x", "--out", str(tmp_path / "afile")]) == 2
    assert "--out: " in capsys.readouterr().err
    garbage = tmp_path / "record.pt"
    garbage.write_bytes(b"garbage")
    assert cli.main(["explain", "x", "--out", out, "--checkpoint", str(garbage)]) == 1
    err = capsys.readouterr().err
    assert "--checkpoint: " in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    import torchvote.pretrained as pretrained

    def missing(*args, **kwargs):
        raise ModuleNotFoundError('the encoder needs "tokenizers": pip install "torchvote[pretrained]"')

    monkeypatch.setattr(pretrained, "load_pretrained", missing)
    assert cli.main(["explain", "x", "--out", out]) == 1
    assert "torchvote[pretrained]" in capsys.readouterr().err
