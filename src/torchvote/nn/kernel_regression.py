"""Nadaraya-Watson kernel regression: attention pooling before attention had a name.

Nadaraya 1964 ("On Estimating Regression") and Watson 1964 ("Smooth Regression Analysis") predict
``f(x) = sum_i K(x - x_i) y_i / sum_k K(x - x_k)``. With the Gaussian kernel
``K(u) = exp(-||u||^2 / (2 h^2))`` the normalised kernel is a softmax, so this is attention with
the query ``x``, keys ``x_i``, values ``y_i`` and scores ``-||x - x_i||^2 / (2 h^2)`` (see d2l.ai,
"Attention Pooling by Similarity"): one pass of weighted voting, normalised over the senders.

Index legend: ``b`` batch, ``i`` receivers (queries, ``L``), ``j`` senders (training points,
``S``), ``d`` features.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from torchvote.functional import attend, merge_masks
from torchvote.validation import check_flag, check_float_dtype, check_inputs_beside, check_positive_float

__all__ = ["NadarayaWatson"]


class NadarayaWatson(nn.Module):
    """Gaussian-kernel Nadaraya-Watson regression as attention pooling.

    ``f(x) = sum_j softmax_j(-||x - x_j||^2 / (2 h^2)) y_j``.

    Args:
        bandwidth: the kernel width ``h`` (> 0). Small ``h``: the nearest points dominate;
            large ``h``: the prediction tends to the mean of the values.
        learnable: learn ``h`` (stored as ``log_bandwidth``, so it stays positive; the
            parametric variant of d2l's section learns ``w = 1 / h`` in the same role).
        device: where to create the parameter (a fixed width has none).
        dtype: the parameter's dtype.

    Raises:
        ValueError: ``bandwidth`` is not a positive finite number (a bool is not).
        TypeError: ``learnable`` is not a bool.
    """

    def __init__(
        self,
        *,
        bandwidth: float = 1.0,
        learnable: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_float(bandwidth, "bandwidth")
        self.learnable = check_flag(learnable, "learnable")
        check_float_dtype(dtype)
        # A fixed width stays a Python float, exact in every dtype (a float32 buffer would round
        # h and put a 1e-8 relative error into float64 regressions).
        self._fixed_bandwidth = float(bandwidth)
        self.log_bandwidth = (
            nn.Parameter(torch.tensor(math.log(bandwidth), device=device, dtype=dtype)) if learnable else None
        )

    @property
    def bandwidth(self) -> float:
        """The current kernel width ``h`` (a plain number, for display and logging)."""
        if self.log_bandwidth is None:
            return self._fixed_bandwidth
        return float(self.log_bandwidth.detach().exp())

    def reset_parameters(self) -> None:
        """A learnable width back to the ``bandwidth`` given, as the constructor sets it
        (after ``to_empty()`` of a module built on the ``"meta"`` device)."""
        if self.log_bandwidth is not None:
            with torch.no_grad():
                self.log_bandwidth.fill_(math.log(self._fixed_bandwidth))

    def extra_repr(self) -> str:
        if self.log_bandwidth is not None and self.log_bandwidth.is_meta:  # no value to show
            return f"learnable={self.learnable}"
        return f"bandwidth={self.bandwidth:.4g}, learnable={self.learnable}"

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        *,
        key_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Predict at ``queries`` from the pairs ``(keys, values)``.

        Args:
            queries: ``(b, L)`` scalar inputs or ``(b, L, D)`` vectors.
            keys: ``(b, S)`` or ``(b, S, D)``, the same rank as ``queries``.
            values: ``(b, S)`` scalar targets or ``(b, S, Dv)``.
            key_mask: boolean ``(b, S)``, True for a real data point, False for padding.

        Returns:
            ``(predictions, weights)``: predictions ``(b, L)`` for 2-D ``values``, else
            ``(b, L, Dv)``; weights ``(b, L, S)``.

        Raises:
            TypeError: inputs that are not floating-point tensors of one dtype, the learnable
                width's (outside ``torch.autocast``).
            ValueError: mismatched ranks, batch sizes, lengths or features; a bad ``key_mask``;
                a tensor on another device than the queries (or the learnable width).
        """
        for name, t in (("queries", queries), ("keys", keys), ("values", values)):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dim() not in (2, 3):
                raise ValueError(f"{name} must have shape (b, n) or (b, n, features), got {tuple(t.shape)}")
            if not t.is_floating_point():  # integer values would truncate the weighted mean
                raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
        inputs = (("queries", queries), ("keys", keys), ("values", values))
        key_masks = (("key_mask", key_mask),)
        check_inputs_beside(queries, inputs, masks=key_masks, where="the queries")
        if self.log_bandwidth is not None:  # and the learnable width's
            check_inputs_beside(self.log_bandwidth, inputs, masks=key_masks)
        if keys.dim() != queries.dim() or (queries.dim() == 3 and keys.shape[-1] != queries.shape[-1]):
            raise ValueError(
                f"keys must have the rank and feature size of queries {tuple(queries.shape)}, got "
                f"{tuple(keys.shape)}"
            )
        if keys.shape[0] != queries.shape[0] or values.shape[:2] != keys.shape[:2]:
            raise ValueError(
                f"queries, keys and values must share the batch size and keys and values the "
                f"length, got queries {tuple(queries.shape)}, keys {tuple(keys.shape)}, values "
                f"{tuple(values.shape)}"
            )
        if queries.dim() == 2:
            queries, keys = queries.unsqueeze(-1), keys.unsqueeze(-1)  # (b, i, 1), (b, j, 1)
        scalar_values = values.dim() == 2
        if scalar_values:
            values = values.unsqueeze(-1)  # (b, j, 1)
        mask = merge_masks(None, key_mask, (queries.shape[0], queries.shape[1], keys.shape[1]))

        # Differences rather than ||x||^2 + ||x_j||^2 - 2 x.x_j: exact when points nearly coincide;
        # in at least float32, where float16's squares overflow past a distance of 256 (every
        # score -inf: a prediction of 0 where the true weights are near uniform).
        working = torch.promote_types(queries.dtype, torch.float32)
        differences = queries.to(working).unsqueeze(-2) - keys.to(working).unsqueeze(-3)  # (b, i, j, d)
        squared_distances = differences.pow(2).sum(-1)  # (b, i, j)
        # Each row's nearest allowed point at distance 0 (a constant of the row: the softmax and
        # its gradient do not change), so that a width so small that 1 / h^2 overflows (clamped
        # to the largest finite number) still picks the nearest point, not 0 * inf = NaN.
        with torch.no_grad():
            allowed = squared_distances if mask is None else squared_distances.masked_fill(~mask, math.inf)
            nearest = allowed.amin(dim=-1, keepdim=True)  # (b, i, 1)
            nearest = torch.where(torch.isfinite(nearest), nearest, 0.0)
        squared_distances = squared_distances - nearest
        largest = torch.finfo(working).max
        if self.log_bandwidth is None:  # 0.5 / h / h: inf past the range (h**2 underflowed to 0, and raised)
            scores = squared_distances * -min(0.5 / self._fixed_bandwidth / self._fixed_bandwidth, largest)
        else:  # -d^2 / (2 h^2) = -d^2 * exp(-2 log h) / 2
            # clamped before the exp (a margin of 1: log(max) itself rounds up to inf): an inf
            # there gave the width a NaN gradient (0 * inf)
            exponent = (-2 * self.log_bandwidth).clamp(max=math.log(largest) - 1.0)
            scores = squared_distances * (-0.5 * torch.exp(exponent).to(squared_distances.dtype))  # (b, i, j)
        # the weighted mean in that dtype too (a width small beside the distances: scores far
        # below float16's range still pick the nearest point), returned in the values' dtype
        predictions, weights = attend(scores, values.to(working), attn_mask=mask)  # (b, i, d), (b, i, j)
        predictions, weights = predictions.to(values.dtype), weights.to(values.dtype)
        if scalar_values:
            predictions = predictions.squeeze(-1)  # (b, i)
        return predictions, weights
