"""``pytest --device cpu|cuda|cuda:N`` and the ``device`` fixture and marker (tests/conftest.py).

A bad ``--device``, or CUDA asked for where torch sees none, stops pytest at start-up with a usage
error naming the option (not one failure per test); a test that takes the fixture is marked
``device``, so ``-m device`` selects exactly those tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import _chosen_device

ROOT = Path(__file__).resolve().parents[1]


def _pytest(*arguments: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:randomly", *arguments],
        cwd=ROOT,
        env={**os.environ, **environment},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _cuda(monkeypatch, count: int, current: int = 0) -> None:
    """torch answers as if it saw ``count`` CUDA devices, ``current`` the current one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_cpu_is_the_cpu():
    assert _chosen_device("cpu") == torch.device("cpu")


def test_with_device_cpu_no_test_sees_a_gpu(pytestconfig):
    """``--device cpu`` hides CUDA from this process and the subprocesses of the tests, so that
    ``device="auto"`` means the CPU here as in CI."""
    if pytestconfig.getoption("device") != "cpu":
        pytest.skip("--device is not cpu")
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert not torch.cuda.is_available()


@pytest.mark.parametrize(("value", "expected"), [("cuda", 1), ("cuda:0", 0), ("cuda:1", 1)])
def test_cuda_gets_the_index_a_tensor_on_it_reports(monkeypatch, value, expected):
    _cuda(monkeypatch, count=2, current=1)
    assert _chosen_device(value) == torch.device("cuda", expected)


@pytest.mark.parametrize("value", ["mps", "meta", "gpu", "cuda:x", ""])
def test_another_device_is_a_usage_error_naming_the_option(value):
    with pytest.raises(pytest.UsageError, match=rf"--device must be cpu, cuda or cuda:N, got {value!r}"):
        _chosen_device(value)


def test_cuda_without_cuda_is_a_usage_error_naming_the_option(monkeypatch):
    _cuda(monkeypatch, count=0)
    with pytest.raises(pytest.UsageError, match=r"--device cuda: this torch \(.*\) sees no CUDA device"):
        _chosen_device("cuda")


def test_a_cuda_device_beyond_the_last_is_a_usage_error(monkeypatch):
    _cuda(monkeypatch, count=2)
    with pytest.raises(pytest.UsageError, match=r"--device cuda:2: there is no CUDA device 2 \(there are 2"):
        _chosen_device("cuda:2")


def test_pytest_stops_at_start_up_when_cuda_is_asked_for_and_torch_sees_none():
    hidden = {"CUDA_VISIBLE_DEVICES": ""}  # and a GPU this machine may have
    result = _pytest("--device", "cuda", "-m", "device", "tests/test_device_option.py", **hidden)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "--device cuda: this torch" in result.stderr and "passed" not in result.stdout


def test_the_device_marker_selects_the_tests_that_take_the_fixture():
    """The marker is set before ``-m`` deselects (a marker set after it would select nothing)."""
    result = _pytest("--collect-only", "-q", "-m", "device", "tests/test_device_option.py")
    assert result.returncode == 0, result.stdout + result.stderr
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert collected == ["tests/test_device_option.py::test_a_test_that_takes_the_fixture_is_marked_device"]


def test_a_test_that_takes_the_fixture_is_marked_device(request, device):
    assert request.node.get_closest_marker("device") is not None
    assert device.type == torch.device(request.config.getoption("device")).type


@pytest.mark.parametrize("device", ["cpu"])
def test_a_test_with_its_own_device_argument_is_not_marked(request, device):
    assert request.node.get_closest_marker("device") is None


def test_a_test_without_the_fixture_is_not_marked(request):
    assert request.node.get_closest_marker("device") is None
