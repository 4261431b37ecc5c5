"""Capsule and vision pictures drawn from recorded tensors (never by re-running a model).

Routing couplings pass by pass, coupling entropy and agreement per pass, one output capsule's
votes in 2-D, reconstructions, the perturbation grid of Sabour et al. 2017 (Fig. 4), MultiMNIST
reconstructions in two colours (Sabour et al. 2017, sec. 6) and a ViT's attention over patches
(Dosovitskiy et al. 2021). Each returns a matplotlib Figure. Index legend: ``t`` passes, ``b``
batch, ``i`` output capsules (receivers), ``j`` input capsules (senders), ``d`` pose features.

Labels and titles are drawn as given (``$`` is not mathtext); a coupling that is NaN or infinite
is drawn grey, never as 0; figures stop growing at
:data:`~torchvote.explain.figures.MAX_INCHES` a side.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchvote.explain.figures import (
    colormap,
    finite_range,
    literal_labels,
    literal_text,
    new_figure,
    tick_positions,
)
from torchvote.explain.statistics import (
    PAPER_PERTURBATION_SPAN,
    checked_tensor,
    patch_attention_map,
    project_votes,
)
from torchvote.validation import check_flag, check_in_range

if TYPE_CHECKING:  # matplotlib is optional: imported when a picture is drawn
    from matplotlib.figure import Figure

__all__ = [
    "coupling_passes",
    "multimnist_reconstructions",
    "patch_attention_overlay",
    "perturbation_grid",
    "reconstructions",
    "routing_statistics",
    "vote_passes",
]


LABEL_LIMIT = 20  # most capsule labels along one coupling map's axis; beyond, every k-th
PASSES_PER_ROW = 3  # coupling maps side by side; more passes wrap onto further rows
VOTE_AREA = 24.0  # marker area (points^2) of a vote whose coupling is the uniform one
MIN_AREA = 2.0  # the smallest vote marker (a weight of 0 or below), still visible
DIVERGING = "RdBu_r"  # couplings: white at the uniform coupling, red above it, blue below
OVERLAY = "YlOrRd"  # patch attention: light to dark red, every shade visible on a dark image


def _channels(images: Tensor, name: str, *, image_dim: int) -> None:
    """A ``ValueError`` naming ``name`` unless ``images``' channel axis (when ``images`` has
    ``image_dim`` axes) holds 1 (gray) or 3 (RGB) channels."""
    if images.dim() == image_dim and images.shape[-3] not in (1, 3):
        raise ValueError(
            f"{name} must have 1 (gray) or 3 (RGB) channels, got {images.shape[-3]} in {tuple(images.shape)}"
        )


def _gray(image: Tensor) -> Tensor:
    """``(1, H, W)`` or ``(H, W)`` -> ``(H, W)``; ``(3, H, W)`` -> ``(H, W, 3)`` for imshow."""
    if image.dim() == 3:
        return image[0] if image.shape[0] == 1 else image.permute(1, 2, 0).clamp(0, 1)
    return image


def _image_rows(rows: Sequence[Sequence[Tensor]], names: Sequence[str], *, labels=None, title: str = ""):
    """Images in rows, one column per example, no ticks: ``rows[r][n]`` is ``(H, W)`` (gray, in
    ``[0, 1]``) or ``(H, W, 3)`` (colour); ``names[r]`` labels row ``r``, ``labels[n]`` (checked
    literal strings) column ``n``."""
    count = len(rows[0])
    figure, axes = new_figure(len(rows), count, size=(0.4 + 1.2 * count, 2.9))
    for n in range(count):
        for row, images in enumerate(rows):
            ax = axes[row, n]
            if images[n].dim() == 2:
                ax.imshow(images[n].numpy(), cmap="gray", vmin=0.0, vmax=1.0)
            else:
                ax.imshow(images[n].numpy())
            ax.set_xticks([])
            ax.set_yticks([])
        if labels is not None:
            axes[0, n].set_title(labels[n], fontsize=8)
    for row, name in enumerate(names):
        axes[row, 0].set_ylabel(name, fontsize=8)
    if title:
        figure.suptitle(literal_text(title))
    return figure


def coupling_passes(
    couplings: Tensor | Sequence[Tensor],
    *,
    title: str = "",
    input_labels=None,
    output_labels=None,
    totals: bool = False,
    xlabel: str = "input capsule j",
    ylabel: str = "output capsule i",
) -> Figure:
    """Routing couplings of one input, one heatmap per pass (outputs down, inputs across): how
    the votes settle.

    Pass ``t``'s map holds the couplings that pass used (dynamic routing's pass 1: the uniform
    ``1 / i`` of ``b_ij = 0``, before any agreement; slot and self-attention routing start from
    logits of their own). One diverging colour scale for every pass, centred (white) on the
    uniform coupling ``1 / i`` (couplings sum to 1 over the outputs), its limits symmetric at the
    largest finite deviation from it: red is more than uniform, blue less, whatever the number
    of passes. NaN and infinite couplings are grey. More
    than :data:`LABEL_LIMIT` labels on an axis: every k-th is shown. More than
    :data:`PASSES_PER_ROW` passes wrap onto further rows.

    Args:
        couplings: ``(t, i, j)``: pass ``t``'s coupling of input capsule ``j`` to output ``i``
            (or a sequence of ``t`` matrices ``(i, j)``, e.g. ``VoteResult.weights`` of one
            batch element); any real dtype or device.
        title: figure title, drawn as given.
        input_labels: optional ``j`` labels; output_labels: optional ``i`` labels (also the
            legend of ``totals``).
        totals: add a panel below the maps: each output's total received coupling per pass (the
            last axes of the figure, one line per output).
        xlabel: what the columns ``j`` are, drawn as given (e.g. test digits rather than input
            capsules).
        ylabel: what the rows ``i`` are, drawn as given.

    Returns:
        The Figure.

    Raises:
        ValueError: no passes, matrices of another rank or of different shapes, an empty matrix,
            or a label count that does not match.
        TypeError: not real tensors, or labels given as one string.
    """
    if not isinstance(couplings, Tensor):
        passes = [checked_tensor(c, f"couplings[{t}]", dims=(2,)) for t, c in enumerate(couplings)]
        if not passes:
            raise ValueError("couplings must hold at least one pass")
        for t, matrix in enumerate(passes):
            if matrix.shape != passes[0].shape:
                raise ValueError(
                    f"couplings[{t}] has shape {tuple(matrix.shape)}, unlike couplings[0] "
                    f"{tuple(passes[0].shape)}"
                )
        couplings = torch.stack(passes)
    couplings = checked_tensor(couplings, "couplings", dims=(3,), nonempty=True)
    outputs = literal_labels(output_labels, couplings.shape[1], "output_labels")
    inputs = literal_labels(input_labels, couplings.shape[2], "input_labels")
    passes = couplings.shape[0]
    uniform = 1.0 / couplings.shape[1]
    vmin, vmax, non_finite = _centred_range(couplings, uniform)
    cmap = colormap(DIVERGING)
    columns = min(passes, PASSES_PER_ROW)
    map_rows = math.ceil(passes / columns)
    rows = map_rows + (1 if check_flag(totals, "totals") else 0)
    figure, axes = new_figure(
        rows, columns, size=(1.2 + 3.0 * columns, 3.2 * map_rows + 2.0 * (rows - map_rows)), sharey="row",
        gridspec_kw={"height_ratios": [3] * map_rows + [2] * (rows - map_rows)},
    )
    maps = [axes[t // columns, t % columns] for t in range(passes)]
    for ax in axes[:map_rows].ravel()[passes:]:
        ax.remove()  # the last row of maps' empty cells
    for t, ax in enumerate(maps):
        image = ax.imshow(
            couplings[t].numpy(), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest"
        )
        ax.set_title(f"pass {t + 1}", fontsize=9)
        if t + columns >= passes:  # no map below this one
            ax.set_xlabel(literal_text(xlabel))
        if outputs is not None:
            positions = tick_positions(len(outputs), LABEL_LIMIT)
            ax.set_yticks(positions, [outputs[p] for p in positions], fontsize=7)
        elif couplings.shape[1] <= LABEL_LIMIT:
            ax.set_yticks(range(couplings.shape[1]))  # whole capsules, not the image's half steps
        if inputs is not None:
            positions = tick_positions(len(inputs), LABEL_LIMIT)
            ax.set_xticks(positions, [inputs[p] for p in positions], fontsize=7, rotation=90)
        if t % columns == 0:
            ax.set_ylabel(literal_text(ylabel))
    label = _centred_label("coupling c_ij", f"1/{couplings.shape[1]} = {uniform:.3g}", non_finite)
    figure.colorbar(image, ax=maps, shrink=0.8, label=label)
    if totals:
        _received_totals(figure, axes, couplings, outputs)
    if title:
        figure.suptitle(literal_text(title))
    return figure


def _centred_range(values: Tensor, centre: float) -> tuple[float, float, bool]:
    """Colour limits ``(centre - d, centre + d, has_non_finite)``, ``d`` the largest finite
    deviation of ``values`` from ``centre`` (a small span when none deviates)."""
    low, high, non_finite = finite_range(values, lowest=None)
    deviation = max(abs(low - centre), abs(high - centre), 1e-6)
    return centre - deviation, centre + deviation, non_finite


def _centred_label(name: str, centre: str, non_finite: bool) -> str:
    """A colour-bar label for :func:`_centred_range`'s scale: white is the uniform coupling
    ``centre`` (as text), the limits the largest deviation from it."""
    label = f"{name}\nwhite: uniform {centre}\nlimits: largest deviation"
    return label + "; grey: NaN or inf" if non_finite else label


def _received_totals(figure, axes, couplings: Tensor, output_labels) -> None:
    """Replace the bottom row of ``axes`` by one panel: each output's received total per pass."""
    for ax in axes[-1]:
        ax.remove()
    ax = figure.add_subplot(axes[0, 0].get_gridspec()[-1, :])
    received = couplings.sum(dim=-1)  # (t, i)
    steps = range(1, received.shape[0] + 1)
    for i in range(received.shape[1]):
        name = output_labels[i] if output_labels is not None else str(i)
        ax.plot(steps, received[:, i].numpy(), marker="o", label=name)
    ax.set_xlabel("pass")
    ax.set_ylabel("total coupling\nreceived")
    ax.set_xticks(list(steps))
    ax.grid(alpha=0.3)
    if received.shape[1] <= 12:  # beside the panel, not over its lines
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def routing_statistics(entropy: Tensor, agreement: Tensor | None = None, *, title: str = "") -> Figure:
    """Coupling entropy (and agreement) per pass, averaged over a set, as two line plots.

    Pass ``t`` (from 1) is drawn at x = ``t``; a NaN value leaves a gap in its line. A change
    under 1% of the values' size is drawn on an axis spanning 2% of it (autoscaling stretched a
    change of 2e-7 in an entropy of 2.3 over the whole panel, a steep line out of nothing).

    Args:
        entropy: ``(t,)`` from :func:`torchvote.explain.statistics.coupling_entropy`.
        agreement: ``(t,)`` from :func:`torchvote.explain.statistics.routing_agreement`, or None.
        title: figure title, drawn as given.

    Returns:
        The Figure.

    Raises:
        ValueError: not 1-D, no passes, or ``agreement`` of another shape than ``entropy``.
        TypeError: not real tensors.
    """
    entropy = checked_tensor(entropy, "entropy", dims=(1,), nonempty=True)
    if agreement is not None:
        agreement = checked_tensor(agreement, "agreement", dims=(1,))
        if agreement.shape != entropy.shape:
            raise ValueError(
                f"agreement must have entropy's shape {tuple(entropy.shape)}, got {tuple(agreement.shape)}"
            )
    panels = 1 if agreement is None else 2
    figure, axes = new_figure(1, panels, size=(3.6 * panels, 3.0))
    passes = range(1, entropy.shape[0] + 1)
    axes[0, 0].plot(passes, entropy.numpy(), marker="o", color="tab:purple")
    axes[0, 0].set_title("mean coupling entropy (nats)", fontsize=9)
    _small_changes_look_small(axes[0, 0], entropy)
    if agreement is not None:
        axes[0, 1].plot(passes, agreement.numpy(), marker="o", color="tab:green")
        axes[0, 1].set_title("mean agreement u_hat . v", fontsize=9)
        _small_changes_look_small(axes[0, 1], agreement)
    for ax in axes[0]:
        ax.set_xlabel("pass")
        ax.set_xticks(list(passes))
        ax.ticklabel_format(axis="y", useOffset=False)  # values as they are, not "1e-7+1.079e-3"
        ax.grid(alpha=0.3)
    if title:
        figure.suptitle(literal_text(title))
    return figure


def _small_changes_look_small(ax, values: Tensor, relative: float = 0.01) -> None:
    """Give ``ax`` a y-range of ``2 * relative`` times the values' size where they change by less
    than ``relative`` of it (else autoscaling, which fills the panel with any change, stays)."""
    finite = values[torch.isfinite(values)].double()
    if finite.numel() == 0:
        return
    low, high = float(finite.min()), float(finite.max())
    span = relative * max(abs(low), abs(high))
    if 0 < high - low < span:
        middle = (low + high) / 2
        ax.set_ylim(middle - span, middle + span)


def vote_passes(
    votes: Tensor,
    weights: Tensor,
    consensus: Tensor | None = None,
    *,
    uniform: float | None = None,
    title: str = "",
) -> Figure:
    """One output capsule's votes in 2-D (PCA), coloured and sized by their coupling, with the
    consensus they form marked, one panel per pass (equal scales on both axes).

    The consensus is the coupling-weighted mean of the votes, ``s_i / sum_j c_ij =
    sum_j c_ij u_hat_j|i / sum_j c_ij``: a point in vote space, in the direction of ``s_i``, and
    so of the output ``v_i = squash(s_i)`` where routing adds no bias (the output itself, a
    squashed *sum* of hundreds of votes, lies far outside them). Votes are coloured on one
    diverging scale for every pass, white at ``uniform`` (dynamic routing's coupling before any
    agreement), red above and blue below it, limits
    symmetric at the largest finite deviation (a colour bar); marker area is proportional to
    the weight over ``uniform``, at least :data:`MIN_AREA` (a weight of 0 or below). A vote whose
    weight is NaN or infinite is drawn as a grey cross, not left out, and counts for nothing
    in the mean; a pass whose finite weights sum to at most 0 has no mean drawn.

    Args:
        votes: ``(j, d)`` the input capsules' votes ``u_hat_{j|i}`` for one output ``i``, finite.
        weights: ``(t, j)`` each vote's coupling to that output in each pass (the couplings pass
            ``t`` used).
        consensus: deprecated and not drawn: the output capsules ``(t, d)`` this figure drew
            as its star until the star became the votes' weighted mean (which needs no
            argument); a FutureWarning says so.
        uniform: the coupling with no agreement, ``1 / (number of outputs)`` for routing over
            the outputs, a positive number; default the mean finite weight of pass 1 (1 when
            that is not positive).
        title: figure title, drawn as given.

    Returns:
        The Figure (the projection is :func:`torchvote.explain.statistics.project_votes`).

    Raises:
        ValueError: shapes that do not line up, no passes, votes not finite, or ``uniform``
            not a finite number > 0.
        TypeError: not real tensors.
    """
    if consensus is not None:
        warnings.warn(
            "vote_passes' consensus is no longer drawn (the star is the votes' coupling-weighted mean, "
            "made from votes and weights); drop the argument",
            FutureWarning,
            stacklevel=2,
        )
    votes = checked_tensor(votes, "votes", dims=(2,))
    weights = checked_tensor(weights, "weights", dims=(2,), nonempty=True)
    if weights.shape[1] != votes.shape[0]:
        raise ValueError(
            f"weights (t, j) must match votes (j, d) = {tuple(votes.shape)}, got {tuple(weights.shape)}"
        )
    known = weights.isfinite()  # (t, j)
    if uniform is None:
        first = weights[0][known[0]]
        uniform = float(first.mean()) if first.numel() and float(first.mean()) > 0 else 1.0
    uniform = check_in_range(uniform, "uniform", 0.0, include_low=False)
    counted = torch.where(known, weights, 0.0).clamp(min=0.0).double()  # (t, j)
    total = counted.sum(dim=1)  # (t,)
    means = (counted @ votes.double()) / total.clamp(min=1e-300)[:, None]  # (t, d) weighted means
    means = torch.where(total[:, None] > 0, means, votes.double().mean(dim=0)).float()
    points, centres, explained = project_votes(votes, means)  # (j, 2), (t, 2), (2,)
    passes = weights.shape[0]
    figure, axes = new_figure(1, passes, size=(1.4 + 3.1 * passes, 3.6), sharex=True, sharey=True)
    vmin, vmax, _ = _centred_range(weights, uniform)
    cmap = colormap(DIVERGING)
    for t in range(passes):
        ax = axes[0, t]
        drawn = ax.scatter(
            points[known[t], 0],
            points[known[t], 1],
            s=(VOTE_AREA * counted[t][known[t]] / uniform).clamp(min=MIN_AREA).numpy(),
            c=weights[t][known[t]].numpy(),
            cmap=cmap,
            vmin=vmin,
            vmax=vmax,
            edgecolors="0.35",
            linewidths=0.3,
            label="votes (area and colour: c_ij vs uniform)",
        )
        if float(total[t]) > 0:
            ax.scatter(
                centres[t, 0],
                centres[t, 1],
                marker="*",
                s=260,
                color="gold",
                edgecolors="black",
                linewidths=0.8,
                label="weighted mean of the votes,\nΣ c·û / Σ c (direction of s_i)",
                zorder=3,
            )
        if not known[t].all():
            ax.scatter(
                points[~known[t], 0],
                points[~known[t], 1],
                marker="x",
                s=30,
                color="0.45",
                label="vote, weight NaN or inf",
            )
        ax.set_title(f"pass {t + 1}", fontsize=9)
        ax.set_xlabel(f"PC1 ({100 * float(explained[0]):.0f}%)")
        ax.set_aspect("equal", adjustable="box")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(f"PC2 ({100 * float(explained[1]):.0f}%)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, labels, fontsize=7, loc="outside lower center", ncols=len(labels))  # off the votes
    label = _centred_label("coupling c_ij", f"{uniform:.3g}", False)
    figure.colorbar(drawn, ax=list(axes[0]), shrink=0.8, label=label)
    if title:
        figure.suptitle(literal_text(title))
    return figure


def _unit_images(images: Tensor, name: str, *, nonempty: bool = False) -> Tensor:
    """``images`` checked as a picture's ``(N, [C,] H, W)`` tensor with values in ``[0, 1]``;
    integer pixels (not bools) as ``k / 255``."""
    scale = 255.0 if isinstance(images, Tensor) and not images.is_floating_point() \
        and not images.is_complex() and images.dtype != torch.bool else 1.0
    images = checked_tensor(images, name, dims=(3, 4), nonempty=nonempty) / scale
    finite = images[torch.isfinite(images)]  # NaN / inf are drawn as the bad colour
    if finite.numel() and (finite.min() < -1e-3 or finite.max() > 1 + 1e-3):
        raise ValueError(
            f"{name} must hold values in [0, 1] (or 8-bit integers), got {finite.min().item():.4g} to "
            f"{finite.max().item():.4g}: divide 0-255 pixels by 255"
        )
    return images


def reconstructions(inputs: Tensor, outputs: Tensor, *, labels=None, title: str = "") -> Figure:
    """Inputs (top row) beside their reconstructions (bottom row).

    Args:
        inputs: ``(N, H, W)`` or ``(N, C, H, W)`` images in ``[0, 1]``, ``N >= 1``, ``C`` 1 or 3;
            integer (8-bit) pixels are read as ``k / 255``.
        outputs: reconstructions of the same shape, likewise.
        labels: optional ``N`` captions (e.g. predicted classes), drawn as given.
        title: figure title, drawn as given.

    Returns:
        The Figure.

    Raises:
        ValueError: shapes that differ, no images, another channel count, not ``N`` labels, or
            floating-point values outside ``[0, 1]`` (0-255 floats were clipped to white tiles).
        TypeError: not real tensors.
    """
    inputs = _unit_images(inputs, "inputs", nonempty=True)
    outputs = _unit_images(outputs, "outputs")
    if inputs.shape != outputs.shape:
        raise ValueError(f"outputs must have inputs' shape {tuple(inputs.shape)}, got {tuple(outputs.shape)}")
    _channels(inputs, "inputs", image_dim=4)
    labels = literal_labels(labels, inputs.shape[0], "labels")
    gray = [[_gray(images[n]) for n in range(images.shape[0])] for images in (inputs, outputs)]
    return _image_rows(gray, ("input", "reconstruction"), labels=labels, title=title)


def perturbation_grid(images: Tensor, *, span: float = PAPER_PERTURBATION_SPAN, title: str = "") -> Figure:
    """Decoder outputs for perturbed poses, one row per dimension (Sabour et al. 2017, Fig. 4).

    Drawn as one mosaic image (fast for 16 x 11 tiles) with a 1-pixel gap between tiles.

    Args:
        images: ``(d, s, H, W)`` reconstructions of
            :func:`~torchvote.explain.statistics.perturbation_poses` (16 dimensions x 11 steps in
            the paper), values in ``[0, 1]``.
        span: the largest perturbation, positive (for the column labels: ``s`` steps evenly
            spaced in ``[-span, span]``, as :func:`~torchvote.explain.statistics.perturbation_poses`
            makes them).
        title: figure title, drawn as given.

    Returns:
        The Figure.

    Raises:
        ValueError: not 4-D, fewer than 2 steps (no range to label), no dimensions or pixels, or
            ``span`` not a finite number > 0 (a wrong type is an ``ArgumentTypeError``, a
            ``TypeError`` too).
        TypeError: not a real tensor.
    """
    images = checked_tensor(images, "images", dims=(4,), nonempty=True)
    dims, steps, height, width = images.shape
    if steps < 2:
        raise ValueError(
            f"images must hold at least 2 steps per dimension (d, s, H, W), got {tuple(images.shape)}"
        )
    span = check_in_range(span, "span", 0.0, include_low=False)  # np.float32 was refused, inf taken
    mosaic = torch.ones(dims * (height + 1) - 1, steps * (width + 1) - 1)  # white gaps
    for k in range(dims):
        for s in range(steps):
            mosaic[
                k * (height + 1) : k * (height + 1) + height, s * (width + 1) : s * (width + 1) + width
            ] = images[k, s]
    figure, axes = new_figure(size=(1.2 + 0.5 * steps, 0.6 + 0.5 * dims))
    ax = axes[0, 0]
    ax.imshow(mosaic.numpy(), cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    deltas = torch.linspace(-span, span, steps)
    ax.set_xticks(
        [s * (width + 1) + width / 2 - 0.5 for s in range(steps)],
        [f"{round(float(v), 6) + 0.0:+.3g}" for v in deltas],  # +0.125, not +0.12
        fontsize=7,
    )
    ax.set_yticks(
        [k * (height + 1) + height / 2 - 0.5 for k in range(dims)],
        [f"dim {k}" for k in range(dims)],
        fontsize=7,
    )
    ax.set_xlabel("perturbation added to the dimension")
    ax.tick_params(length=0)
    if title:
        ax.set_title(literal_text(title), fontsize=9)
    return figure


def multimnist_reconstructions(
    inputs: Tensor, first: Tensor, second: Tensor, *, labels=None, title: str = ""
) -> Figure:
    """MultiMNIST inputs above both digits' reconstructions overlaid in two colours.

    The first digit's reconstruction goes in red, the second's in green (overlap shows yellow),
    as in Sabour et al. 2017, Fig. 5.

    Args:
        inputs: ``(N, H, W)`` overlapping-digit images in ``[0, 1]``.
        first: ``(N, H, W)`` reconstruction from the first digit's capsule.
        second: ``(N, H, W)`` reconstruction from the second digit's capsule.
        labels: optional ``N`` captions such as ``"3+7"``, drawn as given.
        title: figure title, drawn as given.

    Returns:
        The Figure.

    Raises:
        ValueError: shapes that differ, no images, or not ``N`` labels.
        TypeError: not real tensors.
    """
    inputs = checked_tensor(inputs, "inputs", dims=(3,), nonempty=True)
    first, second = checked_tensor(first, "first", dims=(3,)), checked_tensor(second, "second", dims=(3,))
    if first.shape != inputs.shape or second.shape != inputs.shape:
        raise ValueError(
            f"first and second must have inputs' shape {tuple(inputs.shape)}, got "
            f"{tuple(first.shape)} and {tuple(second.shape)}"
        )
    labels = literal_labels(labels, inputs.shape[0], "labels")
    colour = torch.stack([first, second, torch.zeros_like(first)], dim=-1).clamp(0, 1)  # (N, H, W, 3)
    return _image_rows([list(inputs), list(colour)], ("input", "red / green"), labels=labels, title=title)


def patch_attention_overlay(
    image: Tensor, weights: Tensor, grid: tuple[int, int], *, title: str = ""
) -> Figure:
    """A ViT's attention over image patches as an overlay on the image.

    The overlay's colour runs from 0 to the largest finite weight and its opacity grows with the
    weight (a patch of weight 0 leaves the image as it is); the colour bar is opaque, so a colour
    on the image can be read off it. NaN and infinite weights are grey.

    Args:
        image: ``(H, W)`` or ``(C, H, W)`` in ``[0, 1]``, ``C`` 1 or 3.
        weights: ``(patches,)`` attention from one token (e.g. [CLS]) to the patches, row-major;
            NaN or infinite weights are grey.
        grid: ``(rows, cols)`` of patches.
        title: axes title, drawn as given.

    Returns:
        The Figure (the map is :func:`torchvote.explain.statistics.patch_attention_map`).

    Raises:
        ValueError: sizes that do not line up, or another channel count.
        TypeError: not real tensors.
    """
    image = checked_tensor(image, "image", dims=(2, 3), nonempty=True)
    _channels(image, "image", image_dim=3)
    height, width = image.shape[-2:]
    heat = patch_attention_map(weights, grid, (height, width))  # (H, W)
    figure, axes = new_figure(1, 2, size=(6.0, 3.0))
    axes[0, 0].imshow(_gray(image).numpy(), cmap="gray", vmin=0.0, vmax=1.0)
    axes[0, 0].set_title("input", fontsize=9)
    axes[0, 1].imshow(_gray(image).numpy(), cmap="gray", vmin=0.0, vmax=1.0)
    vmin, vmax, non_finite = finite_range(heat)
    share = ((heat - vmin) / (vmax - vmin)).clamp(0.0, 1.0)  # (H, W)
    opacity = torch.where(heat.isfinite(), 0.9 * share.sqrt(), 0.8)  # NaN share is NaN: grey, 0.8
    overlay = axes[0, 1].imshow(
        heat.numpy(), cmap=colormap(OVERLAY), vmin=vmin, vmax=vmax, alpha=opacity.numpy(),
        interpolation="nearest",
    )
    axes[0, 1].set_title(literal_text(title) if title else "attention over patches", fontsize=9)
    for ax in axes[0]:
        ax.set_xticks([])
        ax.set_yticks([])
    label = "weight; grey: NaN or inf" if non_finite else "weight"
    from matplotlib.cm import ScalarMappable

    opaque = ScalarMappable(norm=overlay.norm, cmap=overlay.cmap)  # the overlay's colours, not see-through
    figure.colorbar(opaque, ax=axes[0, 1], shrink=0.8, label=label)
    return figure
