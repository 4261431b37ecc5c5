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
    """A stderr whose reader left: every write raises BrokenPipeError. Its flush does not, as a
    real stream's with nothing buffered does not (tqdm flushes sys.stderr itself when its bar is
    made on it); this one buffers nothing, having no descriptor for a write to be redirected to."""

    def write(self, text: str) -> int:
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


@pytest.mark.parametrize("target", ["stderr", "stdout"])
def test_a_callers_tqdm_write_still_clears_the_runs_bar(monkeypatch, target):
    """tqdm.write clears the bars whose file equals the one written to (stdout and stderr count as
    one); the bar's file became LOG_STREAM, which equalled neither, so a callback's line landed at
    the end of the bar's line instead of above it."""
    from tqdm import tqdm

    from torchvote.training.progress import LOG_STREAM

    terminal = io.StringIO()  # stderr and stdout both: one terminal
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", terminal)
    bar = tqdm(total=10, file=LOG_STREAM, mininterval=0, ascii=True)
    try:
        bar.update(3)
        tqdm.write("USER LINE", file=getattr(sys, target))
    finally:
        bar.close()
    before = terminal.getvalue().split("USER LINE")[0]
    # the bar's line cleared first (then the cursor moved to the bar's row, where other bars are
    # open in the process): without, the line followed the bar's "3/10 [...]" on its own line
    assert "3/10" not in before.rsplit("\r", 1)[-1], repr(before[-60:])
