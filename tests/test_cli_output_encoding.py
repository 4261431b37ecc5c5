"""The command line under an output encoding that lacks a path's characters (``PYTHONIOENCODING=
ascii``, a C or latin-1 locale): the path is written with backslash escapes, the command's status
is its own. A UnicodeEncodeError at the print failed a finished training (status 1, its last
lines lost) and made ``evaluate``'s output a usage error (status 2: it is a ValueError)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from torchvote.cli import main
from torchvote.training import find_checkpoint


@pytest.fixture
def unicode_root(tiny_mnist_root, tmp_path):
    root = tmp_path / "dünn 运行"
    shutil.copytree(tiny_mnist_root, root)
    return root


def _ascii_env() -> dict[str, str]:
    return {**os.environ, "PYTHONIOENCODING": "ascii"}


def test_a_path_the_output_cannot_encode_is_escaped(unicode_root):
    done = subprocess.run(
        [sys.executable, "-m", "torchvote.cli", "data", "mnist", "--root", str(unicode_root)],
        capture_output=True, env=_ascii_env(), timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode("ascii", "replace")
    assert b"d\\xfcnn \\u8fd0\\u884c" in done.stdout  # the path, escaped


def test_main_gives_the_callers_stream_its_setting_back(unicode_root, monkeypatch):
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="ascii")  # errors="strict"
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["data", "mnist", "--root", str(unicode_root)]) == 0
    assert stdout.errors == "strict"
    stdout.flush()
    assert "d\\xfcnn" in stdout.buffer.getvalue().decode("ascii")


@pytest.mark.slow  # a fresh Python process importing torch, then a tiny training
def test_a_training_into_a_folder_the_output_cannot_encode_ends_with_status_0(tiny_values, tmp_path):
    run_dir = tmp_path / "résultats" / "运行 1"
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump(tiny_values(run_dir, epochs=1), allow_unicode=True), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "torchvote.cli", "train", str(preset)],
        capture_output=True, env=_ascii_env(), timeout=600,
    )
    assert done.returncode == 0, done.stderr.decode("ascii", "replace")
    assert b"evaluate:   torchvote evaluate" in done.stdout and b"r\\xe9sultats" in done.stdout
    assert find_checkpoint(run_dir).weights.is_file()


def test_a_stream_that_writes_undecodable_bytes_back_is_left_as_it_is(tiny_mnist_root, tmp_path, monkeypatch):
    """Only a strict stream is changed: surrogateescape (stdout's under a C locale or PYTHONUTF8)
    writes a path's own bytes back, where backslashreplace printed ``\\udcff`` in their place."""
    root = tmp_path / "r\udcff"  # a folder named by the byte 0xff, as os.fsdecode reads it
    shutil.copytree(tiny_mnist_root, root)
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["data", "mnist", "--root", str(root)]) == 0
    stdout.flush()
    assert b"r\xff" in stdout.buffer.getvalue()  # the folder's own byte, reusable as a path
