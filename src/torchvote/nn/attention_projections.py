"""The input projections and input checks of :class:`~torchvote.nn.MultiHeadAttention`.

Three ways to turn the inputs into queries, keys and values, chosen once in the attention's
constructor: one packed ``(3E, E)`` matrix (torch's layout), three separate matrices (keys or
values of their own size), or one shared ``(E, E)`` matrix (``shared_qkv``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchvote.validation import check_float_tensor


class _PackedProjection(nn.Module):
    """Q, K and V from one ``(3E, E)`` matrix, so self-attention projects with a single matmul.

    Laid out as ``torch.nn.MultiheadAttention``'s ``in_proj_weight``: rows ``[0, E)`` make the
    queries, ``[E, 2E)`` the keys, ``[2E, 3E)`` the values.
    """

    def __init__(
        self,
        embed_dim: int,
        *,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        self.bias = nn.Parameter(torch.empty(3 * embed_dim, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights, zero biases (``torch.nn.MultiheadAttention``'s), as the
        constructor sets them (after ``to_empty()`` of a module built on the ``"meta"`` device)."""
        nn.init.xavier_uniform_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if key is query and value is query:  # self-attention: one (E -> 3E) matmul
            q, k, v = F.linear(query, self.weight, self.bias).chunk(3, dim=-1)  # 3 x (b, L, E)
            return q, k, v
        weights = self.weight.chunk(3)
        biases = self.bias.chunk(3) if self.bias is not None else (None, None, None)
        q = F.linear(query, weights[0], biases[0])  # (b, L, E)
        if value is key:  # keys and values from one memory: one (E -> 2E) matmul
            kv_bias = self.bias[self.embed_dim :] if self.bias is not None else None
            k, v = F.linear(key, self.weight[self.embed_dim :], kv_bias).chunk(2, dim=-1)
            return q, k, v  # (b, L, E), 2 x (b, S, E)
        k = F.linear(key, weights[1], biases[1])  # (b, S, E)
        v = F.linear(value, weights[2], biases[2])  # (b, S, E)
        return q, k, v

    def project_query(self, query: Tensor) -> Tensor:
        """The queries alone (keys and values come from a cache): ``(b, L, E) -> (b, L, E)``."""
        bias = self.bias[: self.embed_dim] if self.bias is not None else None
        return F.linear(query, self.weight[: self.embed_dim], bias)


class _SeparateProjections(nn.Module):
    """Q, K and V from three matrices, needed when keys or values have their own feature size."""

    def __init__(
        self,
        embed_dim: int,
        kdim: int,
        vdim: int,
        *,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.query = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.key = nn.Linear(kdim, embed_dim, bias=bias, **factory)
        self.value = nn.Linear(vdim, embed_dim, bias=bias, **factory)
        for linear in (self.query, self.key, self.value):
            nn.init.xavier_uniform_(linear.weight)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return self.query(query), self.key(key), self.value(value)

    def project_query(self, query: Tensor) -> Tensor:
        """The queries alone (keys and values come from a cache): ``(b, L, E) -> (b, L, E)``."""
        return self.query(query)


class _SharedProjection(nn.Module):
    """One ``(E, E)`` matrix makes queries, keys and values alike (``shared_qkv=True``).

    The parameter sharing proposed in "Self-Attention is fundamentally a Weighted Voting" (Mr.
    For Example, 2023): like a capsule layer whose capsules share one prediction matrix, every
    input is projected once and that one projection is query, key and value at the same time.
    Each input tensor is projected once, however many of the three roles it plays.
    """

    def __init__(
        self,
        embed_dim: int,
        *,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.shared = nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        nn.init.xavier_uniform_(self.shared.weight)
        if self.shared.bias is not None:
            nn.init.zeros_(self.shared.bias)

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = self.shared(query)  # (b, L, E)
        k = q if key is query else self.shared(key)  # (b, S, E)
        if value is key:
            v = k
        elif value is query:
            v = q
        else:
            v = self.shared(value)  # (b, S, E)
        return q, k, v

    def project_query(self, query: Tensor) -> Tensor:
        """The queries alone (keys and values come from a cache): ``(b, L, E) -> (b, L, E)``."""
        return self.shared(query)


def _same_map(fn, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Apply ``fn`` to each input, keeping identical inputs identical (self-attention detection)."""
    new_query = fn(query)
    new_key = new_query if key is query else fn(key)
    if value is key:
        new_value = new_key
    elif value is query:
        new_value = new_query
    else:
        new_value = fn(value)
    return new_query, new_key, new_value


def _check_inputs(query: Tensor, key: Tensor, value: Tensor, embed_dim: int, kdim: int, vdim: int) -> bool:
    """Validate ranks and sizes; return True for unbatched (2-D) inputs."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_float_tensor(t, name)
    if query.dim() not in (2, 3):
        raise ValueError(
            f"query must have shape (batch, L, {embed_dim}) (or (L, batch, {embed_dim}) with "
            f"batch_first=False, or unbatched (L, {embed_dim})), got {tuple(query.shape)}"
        )
    for name, t, features in (("query", query, embed_dim), ("key", key, kdim), ("value", value, vdim)):
        if t.dim() != query.dim():
            raise ValueError(
                f"{name} must have the rank of query ({query.dim()}), got shape {tuple(t.shape)}"
            )
        if t.shape[-1] != features:
            raise ValueError(f"{name} must have {features} features (last axis), got shape {tuple(t.shape)}")
    if query.dim() == 3:
        # The batch axis is 0 or 1 (batch_first); either way the non-feature axes of key and value
        # must agree, and query must share the batch axis with them.
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key and value must agree in batch and length, got shapes {tuple(key.shape)} "
                f"and {tuple(value.shape)}"
            )
    elif key.shape[0] != value.shape[0]:
        raise ValueError(
            f"key and value must have the same length, got shapes {tuple(key.shape)} and {tuple(value.shape)}"
        )
    return query.dim() == 2
