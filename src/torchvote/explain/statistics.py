"""The numbers behind the explanation pictures: pure functions on recorded tensors.

Nothing here runs a model. Index legend (as in :mod:`torchvote.functional.voting`): ``b`` batch,
``h`` heads, ``i`` receivers (queries, output capsules), ``j`` senders (keys, input capsules),
``d`` features, ``t`` passes of voting. Attention normalises over the senders ``j`` (rows sum to
one); dynamic routing normalises over the receivers ``i`` (every input capsule spends one unit of
coupling over the outputs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "attention_rollout",
    "coupling_entropy",
    "patch_attention_map",
    "perturbation_poses",
    "project_votes",
    "routing_agreement",
    "top_attended",
]


def checked_tensor(value, name: str, *, dims: Sequence[int]) -> Tensor:
    """``value`` detached, as float32 on the CPU, once it is a tensor of one of the ranks ``dims``:
    the check every statistic and picture makes of what it was given.

    Raises:
        TypeError: ``value`` is not a tensor (the message names ``name``).
        ValueError: another rank (the message names ``name`` and the shape).
    """
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if value.dim() not in dims:
        ranks = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {ranks}, got shape {tuple(value.shape)}")
    return value.detach().float().cpu()


def attention_rollout(attentions: Tensor | Sequence[Tensor], *, residual: float = 0.5) -> Tensor:
    """Attention rollout (Abnar & Zuidema 2020, "Quantifying Attention Flow in Transformers", eq. 1).

    Per layer ``A = residual * I + (1 - residual) * mean_h W_h``, rows renormalised to sum to one
    (the identity stands for the residual connection), then ``rollout = A_n ... A_2 A_1``: row
    ``i`` says how much of token ``i``'s last-layer state comes from each input token.

    Args:
        attentions: ``(layers, h, i, j)`` or ``(layers, i, j)`` (already head-averaged), or a list
            of per-layer ``(h, i, j)`` / ``(i, j)``; square, rows summing to one.
        residual: weight of the identity, in ``[0, 1]``; 0.5 as in the paper.

    Returns:
        ``(i, j)`` rollout, rows summing to one.

    Raises:
        ValueError: non-square or inconsistent shapes, no layers, ``residual`` outside ``[0, 1]``.
        TypeError: not tensors.
    """
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1], got {residual!r}")
    if isinstance(attentions, Tensor):
        attentions = list(attentions.unbind(0))
    if not attentions:
        raise ValueError("attentions must hold at least one layer")
    rollout = None
    for index, weights in enumerate(attentions):
        weights = checked_tensor(weights, f"attentions[{index}]", dims=(2, 3))
        if weights.dim() == 3:
            weights = weights.mean(dim=0)  # (i, j): average the heads
        if weights.shape[0] != weights.shape[1]:
            raise ValueError(
                f"attentions[{index}] must be square (self-attention), got {tuple(weights.shape)}"
            )
        mixed = residual * torch.eye(weights.shape[0]) + (1.0 - residual) * weights  # (i, j)
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

    Args:
        weights: ``(h, i, j)`` or ``(i, j)`` attention of one input.
        tokens: ``j`` key tokens.
        query: row ``i`` to read.
        k: how many keys per head.

    Returns:
        Per head, ``k`` ``(token, weight)`` pairs, largest first.

    Raises:
        ValueError: ``query`` out of range or ``tokens`` of the wrong length.
    """
    weights = checked_tensor(weights, "weights", dims=(2, 3))
    if weights.dim() == 2:
        weights = weights.unsqueeze(0)  # (1, i, j)
    if len(tokens) != weights.shape[-1]:
        raise ValueError(f"tokens must have {weights.shape[-1]} entries, got {len(tokens)}")
    if not -weights.shape[1] <= query < weights.shape[1]:
        raise ValueError(f"query must index one of {weights.shape[1]} rows, got {query}")
    values, indices = weights[:, query].topk(min(k, weights.shape[-1]), dim=-1)  # (h, k)
    return [
        [(tokens[j], float(v)) for v, j in zip(vs.tolist(), js.tolist(), strict=True)]
        for vs, js in zip(values, indices, strict=True)
    ]


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
        ValueError: wrong rank or ``normalize_over``.
    """
    couplings = checked_tensor(couplings, "couplings", dims=(3, 4))
    if couplings.dim() == 3:
        couplings = couplings.unsqueeze(1)  # (t, 1, i, j)
    dims = {"receivers": -2, "senders": -1}
    if normalize_over not in dims:
        raise ValueError(f"normalize_over must be 'receivers' or 'senders', got {normalize_over!r}")
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
    if cosine:
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
        ValueError: fewer than 2 votes or features, or mismatched ``d``.
    """
    votes = checked_tensor(votes, "votes", dims=(2,))
    if votes.shape[0] < 2 or votes.shape[1] < 2:
        raise ValueError(f"votes must be (j >= 2, d >= 2), got {tuple(votes.shape)}")
    mean = votes.mean(dim=0, keepdim=True)  # (1, d)
    _, singular, basis = torch.linalg.svd(votes - mean, full_matrices=False)  # basis (r, d)
    axes = basis[:2].T  # (d, 2)
    variance = singular.square()
    explained = variance[:2] / variance.sum().clamp(min=1e-12)  # (2,)
    points = None
    if consensus is not None:
        consensus = checked_tensor(consensus, "consensus", dims=(1, 2))
        consensus = consensus.unsqueeze(0) if consensus.dim() == 1 else consensus  # (t, d)
        if consensus.shape[1] != votes.shape[1]:
            raise ValueError(f"consensus must have d={votes.shape[1]} features, got {tuple(consensus.shape)}")
        points = (consensus - mean) @ axes  # (t, 2)
    return (votes - mean) @ axes, points, explained


def perturbation_poses(pose: Tensor, *, steps: int = 11, span: float = 0.25) -> Tensor:
    """Capsule poses with one dimension tweaked at a time (Sabour et al. 2017, sec. 5.1, Fig. 4).

    ``poses[k, s] = pose + delta_s * e_k`` with ``delta`` = ``steps`` evenly spaced values in
    ``[-span, span]`` (the paper: intervals of 0.05 in ``[-0.25, 0.25]``, 11 steps).

    Args:
        pose: ``(d,)`` the winning digit capsule's output (16-D in the paper).
        steps: perturbations per dimension, at least 2.
        span: largest absolute change, positive.

    Returns:
        ``(d, steps, d)`` poses to feed the decoder.

    Raises:
        ValueError: ``pose`` not 1-D, ``steps < 2`` or ``span <= 0``.
    """
    if not isinstance(pose, Tensor) or pose.dim() != 1:
        raise ValueError(f"pose must be a 1-D tensor (d,), got {getattr(pose, 'shape', type(pose).__name__)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an integer >= 2, got {steps!r}")
    if not span > 0:
        raise ValueError(f"span must be positive, got {span!r}")
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
        ValueError: sizes that do not line up.
    """
    weights = checked_tensor(weights, "weights", dims=(1,))
    rows, cols = grid
    if rows * cols != weights.shape[0]:
        raise ValueError(f"grid {grid} has {rows * cols} patches, weights has {weights.shape[0]}")
    height, width = size
    if height % rows or width % cols:
        raise ValueError(f"size {size} must be a multiple of grid {grid}")
    patches = weights.view(rows, cols)  # (rows, cols)
    return patches.repeat_interleave(height // rows, 0).repeat_interleave(width // cols, 1)  # (H, W)
