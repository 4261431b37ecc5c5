"""The benchmarks time torchvote against baselines written the way popular repositories write
them; each benchmark first checks that the baseline computes what torchvote computes. These tests
run those checks (no timing), so that a change to a layer's parametrisation cannot leave a
benchmark comparing two different functions, or failing before it prints anything."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str, monkeypatch: pytest.MonkeyPatch):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec.loader.exec_module(module)
    return module


def test_routing_benchmark_baselines_agree_with_torchvote_layers(monkeypatch):
    """Dynamic routing, convolutional and class EM capsules against the repo-style layers with the
    same weights and activation bias (assert_close inside; raises on a mismatch)."""
    _load("routing", monkeypatch).check_agreement(torch.device("cpu"))


def test_em_benchmark_strategies_agree_with_the_naive_loop(monkeypatch):
    worst = _load("em", monkeypatch).check_agreement("cpu", baseline=None)
    assert worst < 1e-10
