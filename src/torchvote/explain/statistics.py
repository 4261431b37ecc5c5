"""The numbers behind the explanation pictures: pure functions on recorded tensors.

Nothing here runs a model. Index legend (as in :mod:`torchvote.functional.voting`): ``b`` batch,
``h`` heads, ``i`` receivers (queries, output capsules), ``j`` senders (keys, input capsules),
``d`` features, ``t`` passes of voting. Attention normalises over the senders ``j`` (rows sum to
one); dynamic routing normalises over the receivers ``i`` (every input capsule spends one unit of
coupling over the outputs).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from torchvote.validation import check_choice, check_flag, check_in_range, is_integer

__all__ = [
    "attention_rollout",
    "coupling_entropy",
    "patch_attention_map",
    "perturbation_poses",
    "project_votes",
    "routing_agreement",
    "top_attended",
]


def checked_tensor(value, name: str, *, dims: Sequence[int], nonempty: bool = False) -> Tensor:
    """``value`` detached, as a dense float32 tensor on the CPU, once it is a real tensor of one of
    the ranks ``dims``: the check every statistic and picture makes of what it was given.

    Any real dtype is accepted (integers, bool, float16 and bfloat16, which matplotlib cannot
    take, are converted), from any device that holds values, strided or not, with or without
    ``requires_grad``.

    Args:
        value: the tensor.
        name: the argument's name, for the messages.
        dims: the accepted ranks.
        nonempty: refuse a tensor with no elements (a picture of nothing).

    Returns:
        The float32 CPU tensor.

    Raises:
        TypeError: ``value`` is not a tensor, or is complex (the message names ``name``).
        ValueError: another rank, no elements when ``nonempty``, or a tensor on the meta device,
            which has a shape but no values (the message names ``name``).
    """
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if value.is_complex():
        raise TypeError(f"{name} must be real, got a {value.dtype} tensor")
    if value.dim() not in dims:
        ranks = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {ranks}, got shape {tuple(value.shape)}")
    if value.is_meta:
        raise ValueError(f"{name} is on the meta device: it has a shape but no values to use")
    if nonempty and value.numel() == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(value.shape)}")
    value = value.detach()
    if value.layout != torch.strided:
        value = value.to_dense()  # sparse tensors: matplotlib and most ops need dense values
    return value.to(device="cpu", dtype=torch.float32)


def attention_rollout(attentions: Tensor | Sequence[Tensor], *, residual: float = 0.5) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", eq. 1).

    Per layer ``A = residual * I + (1 - residual) * mean_h W_h``, rows renormalised to sum to one
    (the identity stands for the residual connection), then ``rollout = A_n ... A_2 A_1``: row
    ``i`` says how much of token ``i``'s last-layer state comes from each input token.

    Args:
        attentions: ``(layers, h, i, j)`` or ``(layers, i, j)`` (already head-averaged), or a list
            of per-layer ``(h, i, j)`` / ``(i, j)``; square, rows summing to one. A 3-D tensor is
            read as layers: one layer's ``(h, i, j)`` goes in a list (``[weights]``). NaN marks a
            masked position, as the figures draw it: no attention there.
        residual: weight of the identity, in ``[0, 1]``; 0.5 as in the paper.

    Returns:
        ``(i, j)`` rollout, rows summing to one (a row of a layer that gives it no weight at all,
        every position masked with ``residual=0``, stays zero: nothing flows there).

    Raises:
        ValueError: non-square or inconsistent shapes, a tensor that is not 3-D or 4-D, no layers,
            infinite or negative weights, ``residual`` outside ``[0, 1]``.
        TypeError: not tensors, or a ``residual`` that is no number.
    """
    residual = check_in_range(residual, "residual", 0.0, 1.0)  # "a" and True were taken to '<='
    if isinstance(attentions, Tensor):
        attentions = list(checked_tensor(attentions, "attentions", dims=(3, 4)).unbind(0))
    elif isinstance(attentions, (str, bytes)) or not isinstance(attentions, Sequence):
        raise TypeError(f"attentions must be a tensor or a list of them, got {type(attentions).__name__}")
    if not attentions:
        raise ValueError("attentions must hold at least one layer")
    rollout = None
    for index, weights in enumerate(attentions):
        weights = checked_tensor(weights, f"attentions[{index}]", dims=(2, 3))
        if bool(torch.isinf(weights).any()):
            raise ValueError(f"attentions[{index}] holds infinite weights")
        if bool((weights < 0).any()):  # a softmax's weights: a negative one gave entries of -1e12
            raise ValueError(f"attentions[{index}] holds negative weights; attention weights are >= 0")
        weights = weights.nan_to_num(nan=0.0)  # a masked position: one NaN made the whole rollout NaN
        if weights.dim() == 3:
            weights = weights.mean(dim=0)  # (i, j): average the heads
        if weights.shape[0] != weights.shape[1]:
            raise ValueError(
                f"attentions[{index}] must be square (self-attention), got {tuple(weights.shape)}"
            )
        mixed = residual * torch.eye(weights.shape[0], device=weights.device) + (1.0 - residual) * weights
        mixed = mixed / mixed.sum(dim=-1, keepdim=True).clamp(min=1e-12)
        if rollout is not None and rollout.shape != mixed.shape:
            raise ValueError(
                f"attentions[{index}] has shape {tuple(weights.shape)}, unlike the layers before"
            )
        rollout = mixed if rollout is None else mixed @ rollout  # later layers act on the left
    return rollout


def top_attended(
    weights: Tensor, tokens: Sequence[str], query: int, *, k: int = 3
) -> list[list[tuple[str, float]]]:
    """The ``k`` keys each head weighs most for one query token.

    A weight that is NaN (a masked position) ranks as ``-inf``, below every number: it is listed
    only when fewer than ``k`` keys have one (ties keep the key order).

    Args:
        weights: ``(h, i, j)`` or ``(i, j)`` attention of one input.
        tokens: ``j`` key tokens.
        query: row ``i`` to read (negative counts from the end).
        k: how many keys per head, at least 1 (at most ``j`` are returned).

    Returns:
        Per head, ``min(k, j)`` ``(token, weight)`` pairs, largest first.

    Raises:
        ValueError: ``query`` out of range, ``k`` < 1, or ``tokens`` of the wrong length.
        TypeError: ``query`` or ``k`` not an integer.
    """
    weights = checked_tensor(weights, "weights", dims=(2, 3))
    if weights.dim() == 2:
        weights = weights.unsqueeze(0)  # (1, i, j)
    if len(tokens) != weights.shape[-1]:
        raise ValueError(f"tokens must have {weights.shape[-1]} entries, got {len(tokens)}")
    query = checked_index(query, weights.shape[1], "query")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an integer, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    row = weights[:, query]  # (h, j)
    key = torch.where(row.isnan(), torch.full_like(row, -math.inf), row)  # NaN ranks as -inf
    order = key.sort(dim=-1, descending=True, stable=True).indices[:, :k]  # (h, min(k, j))
    values = row.gather(-1, order)  # (h, k)
    return [
        [(tokens[j], float(v)) for v, j in zip(vs.tolist(), js.tolist(), strict=True)]
        for vs, js in zip(values, order, strict=True)
    ]


def checked_index(value, count: int, name: str) -> int:
    """``value`` as an index into ``count`` items (negative counts from the end).

    Raises:
        TypeError: not an integer (``bool`` included).
        ValueError: out of range.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer index, got {type(value).__name__} {value!r}")
    if not -count <= value < count:
        raise ValueError(f"{name} must index one of {count} rows, got {value}")
    return int(value) % count


def coupling_entropy(couplings: Tensor, *, normalize_over: str = "receivers") -> Tensor:
    """Mean entropy (nats) of the coupling distributions, pass by pass.

    For routing (``normalize_over="receivers"``) each input capsule ``j`` spreads one unit over
    the outputs ``i``: ``H_j = -sum_i c_ij log c_ij``, averaged over ``j`` and the batch. Low
    entropy means the inputs have chosen their parents (Sabour et al. 2017, sec. 2). For attention
    (``"senders"``) the distributions are the rows ``i`` over ``j``.

    Args:
        couplings: ``(t, b, i, j)`` stacked over passes (or ``(t, i, j)`` for one input).
        normalize_over: the axis each distribution runs over: ``"receivers"`` (``i``) or
            ``"senders"`` (``j``).

    Returns:
        ``(t,)`` mean entropy per pass.

    Raises:
        ValueError: wrong rank or ``normalize_over``, no couplings (the mean of none is NaN), or
            couplings outside ``[0, 1]`` (a negative one gave NaN, unnormalised scores a
            negative entropy).
    """
    couplings = checked_tensor(couplings, "couplings", dims=(3, 4), nonempty=True)
    if couplings.dim() == 3:
        couplings = couplings.unsqueeze(1)  # (t, 1, i, j)
    dims = {"receivers": -2, "senders": -1}
    check_choice(normalize_over, tuple(dims), "normalize_over")
    outside = (couplings < 0) | (couplings > 1 + 1e-3)  # NaN (a masked position) is neither
    if bool(outside.any()):
        finite = couplings.nan_to_num(nan=0.5)
        raise ValueError(
            f"couplings must be probabilities in [0, 1] (softmax weights), got values from "
            f"{finite.min().item():.4g} to {finite.max().item():.4g}"
        )
    terms = torch.special.xlogy(couplings, couplings)  # 0 log 0 = 0
    entropy = -terms.sum(dim=dims[normalize_over])  # (t, b, j) or (t, b, i)
    return entropy.flatten(1).mean(dim=1)  # (t,)


def routing_agreement(votes: Tensor, outputs: Tensor, *, cosine: bool = False) -> Tensor:
    """Mean agreement ``u_hat_{j|i} . v_i`` between votes and each pass's outputs.

    The quantity dynamic routing adds to its logits (Sabour et al. 2017, Procedure 1, line 7),
    averaged over the batch, the outputs ``i`` and the inputs ``j``: it rises as the outputs move
    towards the votes that agree.

    Args:
        votes: ``(b, i, j, d)`` prediction vectors (or ``(i, j, d)`` for one input).
        outputs: ``(t, b, i, d)`` output capsules after each pass (or ``(t, i, d)``).
        cosine: use cosine similarity instead of the dot product (scale-free).

    Returns:
        ``(t,)`` mean agreement per pass.

    Raises:
        ValueError: shapes that do not line up.
    """
    votes = checked_tensor(votes, "votes", dims=(3, 4))
    outputs = checked_tensor(outputs, "outputs", dims=(3, 4))
    if votes.dim() == 3:
        votes = votes.unsqueeze(0)  # (1, i, j, d)
    if outputs.dim() == 3:
        outputs = outputs.unsqueeze(1)  # (t, 1, i, d)
    if outputs.shape[1:] != (votes.shape[0], votes.shape[1], votes.shape[3]):
        raise ValueError(
            f"outputs (t, b, i, d) must match votes (b, i, j, d) = {tuple(votes.shape)}, got "
            f"{tuple(outputs.shape)}"
        )
    if check_flag(cosine, "cosine"):  # "no" was truthy
        votes, outputs = F.normalize(votes, dim=-1), F.normalize(outputs, dim=-1)
    agreement = torch.einsum("bijd,tbid->tbij", votes, outputs)  # (t, b, i, j)
    return agreement.flatten(1).mean(dim=1)  # (t,)


def project_votes(votes: Tensor, consensus: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """Project votes (and consensus points) onto the votes' first two principal components.

    PCA by ``torch.linalg.svd`` of the centred votes.

    Args:
        votes: ``(j, d)`` the votes for one output capsule.
        consensus: ``(t, d)`` that capsule's output after each pass, or None.

    Returns:
        ``(vote_coords (j, 2), consensus_coords (t, 2) | None, explained (2,))`` where
        ``explained`` is the fraction of variance along each component.

    Raises:
        ValueError: fewer than 2 votes or features, mismatched ``d``, or a vote or consensus
            value that is not finite (no principal components of NaN).
    """
    votes = checked_tensor(votes, "votes", dims=(2,))
    if votes.shape[0] < 2 or votes.shape[1] < 2:
        raise ValueError(f"votes must be (j >= 2, d >= 2), got {tuple(votes.shape)}")
    if not votes.isfinite().all():
        raise ValueError(f"votes must be finite, got {int((~votes.isfinite()).sum())} NaN or inf values")
    mean = votes.mean(dim=0, keepdim=True)  # (1, d)
    _, singular, basis = torch.linalg.svd(votes - mean, full_matrices=False)  # basis (r, d)
    axes = basis[:2].T  # (d, 2)
    variance = singular.square()
    total = variance.sum()  # a ratio whatever the votes' scale: no absolute floor (votes of 1e-8)
    explained = torch.where(total > 0, variance[:2] / torch.where(total > 0, total, 1.0), 0.0)  # (2,)
    points = None
    if consensus is not None:
        consensus = checked_tensor(consensus, "consensus", dims=(1, 2))
        consensus = consensus.unsqueeze(0) if consensus.dim() == 1 else consensus  # (t, d)
        if consensus.shape[1] != votes.shape[1]:
            raise ValueError(f"consensus must have d={votes.shape[1]} features, got {tuple(consensus.shape)}")
        if not consensus.isfinite().all():
            raise ValueError("consensus must be finite, got NaN or inf values")
        points = (consensus - mean) @ axes  # (t, 2)
    return (votes - mean) @ axes, points, explained


#: The largest change of a pose dimension in Sabour et al. 2017's Fig. 4 (intervals of 0.05 in
#: [-0.25, 0.25]).
PAPER_PERTURBATION_SPAN = 0.25


def perturbation_poses(pose: Tensor, *, steps: int = 11, span: float = PAPER_PERTURBATION_SPAN) -> Tensor:
    """Capsule poses with one dimension tweaked at a time (Sabour et al. 2017, sec. 5.1, Fig. 4).

    ``poses[k, s] = pose + delta_s * e_k`` with ``delta`` = ``steps`` evenly spaced values in
    ``[-span, span]`` (the paper: intervals of 0.05 in ``[-0.25, 0.25]``, 11 steps).

    Args:
        pose: ``(d,)`` the winning digit capsule's output (16-D in the paper); an integer or bool
            pose is perturbed in the default float dtype (in its own dtype every step rounded to 0).
        steps: perturbations per dimension, at least 2.
        span: largest absolute change, positive.

    Returns:
        ``(d, steps, d)`` poses to feed the decoder, on ``pose``'s device.

    Raises:
        TypeError: ``pose`` not a real tensor.
        ValueError: ``pose`` not 1-D, ``steps < 2`` or ``span`` not a finite number > 0 (a
            wrong type is an ``ArgumentTypeError``, a ``TypeError`` too).
    """
    if not isinstance(pose, Tensor) or pose.is_complex():
        raise TypeError(f"pose must be a real tensor, got {getattr(pose, 'dtype', type(pose).__name__)}")
    if pose.dim() != 1:
        raise ValueError(f"pose must be a 1-D tensor (d,), got {tuple(pose.shape)}")
    if not pose.is_floating_point():
        pose = pose.to(torch.get_default_dtype())
    if not is_integer(steps) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2, got {steps!r}")
    span = check_in_range(span, "span", 0.0, include_low=False)  # inf gave NaN poses, "0.25" torch's error
    deltas = torch.linspace(-span, span, steps, dtype=pose.dtype, device=pose.device)  # (s,)
    eye = torch.eye(pose.shape[0], dtype=pose.dtype, device=pose.device)  # (d, d)
    return pose + deltas[None, :, None] * eye[:, None, :]  # (d, s, d)


def patch_attention_map(weights: Tensor, grid: tuple[int, int], size: tuple[int, int]) -> Tensor:
    """Spread a ViT's per-patch attention over the image's pixels (nearest, no smoothing).

    Args:
        weights: ``(patches,)`` attention from one token (e.g. [CLS]) to the patches, row-major.
        grid: ``(rows, cols)`` of patches, ``rows * cols == patches``.
        size: ``(H, W)`` of the image; each must be a multiple of the grid.

    Returns:
        ``(H, W)`` map, each pixel carrying its patch's weight.

    Raises:
        ValueError: ``grid`` or ``size`` not two positive integers, or sizes that do not line up.
    """
    weights = checked_tensor(weights, "weights", dims=(1,))
    rows, cols = _pair(grid, "grid")
    if rows * cols != weights.shape[0]:
        raise ValueError(f"grid {grid} has {rows * cols} patches, weights has {weights.shape[0]}")
    height, width = _pair(size, "size")
    if height % rows or width % cols:
        raise ValueError(f"size {size} must be a multiple of grid {grid}")
    patches = weights.reshape(rows, cols)  # (rows, cols)
    return patches.repeat_interleave(height // rows, 0).repeat_interleave(width // cols, 1)  # (H, W)


def _pair(value, name: str) -> tuple[int, int]:
    """``value`` as two positive integers, or a ``ValueError`` naming ``name``."""
    try:
        first, second = value
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be two positive integers (rows, cols), got {value!r}") from None
    for number in (first, second):
        if isinstance(number, bool) or not isinstance(number, numbers.Integral) or number < 1:
            raise ValueError(f"{name} must be two positive integers (rows, cols), got {value!r}")
    return int(first), int(second)
