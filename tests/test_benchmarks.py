"""The benchmarks time torchvote against baselines written the way popular repositories write
them; each benchmark first checks that the baseline computes what torchvote computes. These tests
run those checks (no timing), so that a change to a layer's parametrisation cannot leave a
benchmark comparing two different functions, or failing before it prints anything."""

from __future__ import annotations

import torch


def test_routing_benchmark_baselines_agree_with_torchvote_layers(load_benchmark):
    """Dynamic routing, convolutional and class EM capsules against the repo-style layers with the
    same weights and activation bias (assert_close inside; raises on a mismatch)."""
    load_benchmark("routing").check_agreement(torch.device("cpu"))


def test_em_benchmark_strategies_agree_with_the_naive_loop(load_benchmark):
    worst = load_benchmark("em").check_agreement("cpu", baseline=None)
    assert worst < 1e-10
