"""A run whose log reader goes away (``torchvote train ... 2>&1 | head -1``) trains to its end.

Its checkpoints and metrics are the run's record, the log on stderr only a view of it: the next
log line's BrokenPipeError killed the run with status 1 and no word, losing the steps since the
last checkpoint.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import yaml

from torchvote.training import find_checkpoint, read_metrics, train
from torchvote.training.checkpoint import checkpoint_name


class _ClosedPipe(io.StringIO):
    """A stderr whose reader left: every write and flush raises BrokenPipeError."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


@pytest.mark.parametrize("progress", [False, True], ids=["log-lines", "bar-too"])
def test_a_run_whose_log_stream_is_a_broken_pipe_trains_to_its_end(tiny_config, monkeypatch, progress):
    config = tiny_config("run", "epochs=2", "checkpoint_every=5", f"progress={progress}")
    monkeypatch.setattr(sys, "stderr", _ClosedPipe())
    result = train(config, verbose=True)
    total = 2 * (240 // 40)
    assert not result.interrupted and result.step == total
    assert find_checkpoint(result.run_dir).name == checkpoint_name(total)
    events = [(record["event"], record["step"]) for record in read_metrics(result.metrics_path)]
    assert ("final", total) in events


@pytest.mark.slow  # a fresh Python process importing torch
def test_train_piped_into_head_finishes_and_writes_its_last_checkpoint(tiny_values, tmp_path):
    """``torchvote train ... 2>&1 | head -1``: the reader closes the pipe after the first line."""
    run_dir = tmp_path / "run"
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump(tiny_values(run_dir, epochs=3, log_every=1, checkpoint_every=5)))
    process = subprocess.Popen(
        [sys.executable, "-m", "torchvote.cli", "train", str(preset)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        first = process.stderr.readline()
        process.stderr.close()  # as `head -1` exits: later writes get EPIPE
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert first.startswith(b"training ")
    total = 3 * (240 // 40)
    assert process.returncode == 0
    assert find_checkpoint(run_dir).name == checkpoint_name(total)
    assert ("final", total) in [(r["event"], r["step"]) for r in read_metrics(run_dir / "metrics.jsonl")]
