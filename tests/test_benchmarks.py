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


def test_routing_benchmark_em_strategy_rows_route_with_that_strategy(load_benchmark, monkeypatch):
    """``--em-strategies`` rows: ``torchvote-STRATEGY`` builds the layer with that strategy, and
    every strategy gives the auto row's number on the same seed."""
    routing = load_benchmark("routing")
    chosen = []
    route = routing.ConvMatrixCapsules.forward

    def spy(layer, capsules):
        chosen.append(layer.routing.strategy)
        return route(layer, capsules)

    monkeypatch.setattr(routing.ConvMatrixCapsules, "forward", spy)
    build = routing.CASES["em-conv2"].build
    values = {}
    for impl in ("torchvote", "torchvote-blocked", "torchvote-vectorized"):
        run, _ = build(impl, 2, 0, torch.device("cpu"))
        values[impl] = run().item()
    assert chosen == ["auto", "blocked", "vectorized"]
    for value in values.values():
        assert abs(value - values["torchvote"]) <= 1e-4 * abs(values["torchvote"])
