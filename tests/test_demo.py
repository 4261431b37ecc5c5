"""The demo's two experiments: attention as retrieval, routing as clustering, on real digits."""

from __future__ import annotations

import torch

from torchvote.data import load_small_digits
from torchvote.demo import attention_retrieval, routing_clustering, run_demo


def test_attention_retrieval_returns_the_own_label_when_the_query_is_among_the_keys():
    images, labels = load_small_digits("test")
    distribution, weights = attention_retrieval(images[:50], images[:200], labels[:200],
                                                bandwidth=0.5)
    assert torch.equal(distribution.argmax(-1), labels[:50])
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    torch.testing.assert_close(distribution, weights @ torch.eye(10)[labels[:200]])


def test_routing_clustering_couplings_split_each_digits_vote():
    images, labels = load_small_digits("test")
    picked = torch.cat([(labels == d).nonzero().squeeze(1)[:20] for d in (0, 1)])
    seeds = torch.stack([images[(labels == d).nonzero()[-1, 0]] for d in (0, 1)])
    passes = routing_clustering(images[picked], seeds, iterations=4)
    assert len(passes) == 4
    for couplings in passes:
        assert couplings.shape == (2, 40)
        torch.testing.assert_close(couplings.sum(0), torch.ones(40))
    # 0s and 1s are far apart in pixel space: routing separates them.
    assignment = passes[-1].argmax(0)
    assert (assignment[:20] == assignment[0]).float().mean() > 0.9
    assert (assignment[20:] != assignment[0]).float().mean() > 0.9


def test_run_demo_end_to_end(tmp_path, capsys):
    report = run_demo(output_dir=tmp_path, num_queries=200, num_keys=2000, cluster_size=50,
                      iterations=3, make_plots=True)
    out = capsys.readouterr().out
    assert "softmax over senders" in out and "softmax over receivers" in out
    assert report.retrieval_accuracy > 0.8  # kernel regression on real MNIST, far above chance
    assert len(report.purity_per_pass) == 3
    assert all(p.exists() for p in report.plots)


def test_demo_command_runs_from_the_cli(monkeypatch, tmp_path):
    from torchvote import cli, demo

    seen = {}
    monkeypatch.setattr(demo, "run_demo", lambda **kw: seen.update(kw))
    assert cli.main(["demo", "--output-dir", str(tmp_path), "--no-plots"]) == 0
    assert seen == {"output_dir": str(tmp_path), "make_plots": False}
