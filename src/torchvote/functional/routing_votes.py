"""Capsule votes that are never materialised: ``u_ij = W_ij u_j`` kept as ``(W, u)``.

A capsule layer's votes are a linear map of its inputs, one matrix per (output, input) pair
(Sabour et al. 2017, eq. 2, ``u_hat_{j|i} = W_ij u_i``; in torchvote's legend, below, the output
capsule is the receiver ``i`` and the input capsule the sender ``j``, the paper's letters swapped). The
voting loop only ever needs two things from them (see :class:`torchvote.functional.voting.Votes`):

- the weighted sum ``s_i = sum_j c_ij W_ij u_j``, which is ``W`` contracted with the
  coupling-scaled inputs ``c_ij u_j``, one matrix product per receiver;
- the agreement ``u_hat_ij . v_i = u_j . (W_ij^T v_i)``, which is ``W`` contracted with the
  outputs, again one matrix product per receiver.

Neither needs the ``(batch, out_caps, in_caps, out_dim)`` tensor of votes. At the CapsNet shapes
(1152 x 8 -> 10 x 16, batch 128) that tensor is 94 MB, its gradient another 94 MB per pass, and
every pass of the routing loop reads and writes it: the layer is memory-bound. Here each pass
streams ``W`` past cache-sized blocks of the inputs (``_BLOCK_ELEMENTS``; larger tiles on an
accelerator, ``_DEVICE_BLOCK_ELEMENTS``), and the backward pass
recomputes its blocks instead of saving them, so the memory a forward pass keeps for backward is
a few ``(batch, out_caps, in_caps)`` coupling tensors (see ``benchmarks/routing.py`` for the
measured time and peak memory against materialised votes). Dynamic routing runs these products
as one kernel, :mod:`torchvote.functional.dynamic_kernel`; other routers call them through
:class:`LinearVotes`.
That is the right trade on a CPU; on a GPU the many small tiles launch many small kernels, and
materialised votes are faster: :class:`~torchvote.nn.capsules.CapsuleLinear` chooses by device
(``strategy=``, see :mod:`torchvote.nn.routing_strategy`). The kernels run with autocast off, in
the promoted dtype of weight and inputs.

The kernels write into buffers they allocate and reuse (``out=`` products, in-place gradients),
which ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``, ``jvp``, per-sample gradients)
and forward-mode AD cannot follow, and ``torch.export`` would fix in its program. Under them
(:func:`~torchvote.tracing.plain_ops_required`) the same two products run as einsums,
differentiable by every transform, with the numbers of the kernels (and the memory of
materialised votes).

Index legend (as everywhere in torchvote): ``b`` batch, ``i`` receivers (output capsules),
``j`` senders (input capsules), ``d`` output (vote) features, ``e`` input features.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from torchvote.functional.voting import (
    _einsum_at_least_float32,
    _einsum_without_float16,
    autocast_off,
    refuse_double_backward,
)
from torchvote.tracing import plain_ops_required, under_autograd_transforms
from torchvote.validation import check_float_tensor, check_inputs_beside

__all__ = ["LinearVotes", "SharedLinearVotes"]

_T = TypeVar("_T")

# Elements of one tile of coupling-scaled inputs on a CPU (4 MB in float32): small enough to stay in
# cache between being written and being read by the matrix product, large enough for a good GEMM
# and few Python steps (1 MB tiles measured no faster at the CapsNet shapes, 2 threads).
_BLOCK_ELEMENTS = 1 << 20
# The same on an accelerator (64 MB in float32, two scratch tiles at most): there no cache is
# kept warm between kernels, and each tile costs a few kernel launches, so the fewer the better
# within a bounded scratch memory. CPU-sized tiles made CapsNet's layer at batch 2048 (streamed
# on a GPU past the materialise budget) thousands of small kernels per step. Not measured on a GPU.
_DEVICE_BLOCK_ELEMENTS = 1 << 24


def _block_elements(device: torch.device) -> int:
    """The elements of one tile on ``device``: cache-sized on a CPU, larger on an accelerator."""
    return _BLOCK_ELEMENTS if device.type == "cpu" else _DEVICE_BLOCK_ELEMENTS


def _blocks(batch: int, receivers: int, per_row: int, elements: int) -> tuple[int, int]:
    """``(receivers per block, batch rows per block)`` so one block holds about ``elements``."""
    per_row = max(per_row, 1)
    if batch * per_row >= elements:
        pieces = math.ceil(batch * per_row / elements)
        return 1, max(1, math.ceil(batch / pieces))
    return max(1, min(receivers, elements // max(batch * per_row, 1))), max(batch, 1)


def _ranges(total: int, step: int) -> Iterator[slice]:
    for start in range(0, total, step):
        yield slice(start, min(total, start + step))


def _tiles(inputs: Tensor, receivers: int, buffers: int) -> Iterator[tuple[slice, slice, list[Tensor]]]:
    """The one blocking loop of every kernel here: tiles of (receivers, batch) (:func:`_block_elements`
    each: cache-sized on a CPU), all the
    receivers of a block of rows before the next block, so that the rows' inputs stay in cache
    while the weight streams past them (at CapsNet's shapes the weight is read twice per product
    instead of the inputs ten times; measured 3-6% faster on the CPU's dynamic routing).

    Args:
        inputs: ``(b, e, j)``.
        receivers: ``i``.
        buffers: how many scratch tiles each step needs.

    Yields:
        ``(receiver slice, batch slice, scratch)``: ``scratch`` holds ``buffers`` tiles of shape
        ``(receivers in tile, rows in tile, e, j)``, reused from one step to the next.
    """
    batch, features, senders = inputs.shape
    group, rows = _blocks(batch, receivers, features * senders, _block_elements(inputs.device))
    storage = [inputs.new_empty(group * rows * features * senders) for _ in range(buffers)]
    for b in _ranges(batch, rows):
        for r in _ranges(receivers, group):
            shape = (r.stop - r.start, b.stop - b.start, features, senders)
            yield r, b, [s[: math.prod(shape)].view(shape) for s in storage]


def _scale(out: Tensor, coefficients: Tensor, inputs: Tensor) -> Tensor:
    """``out[g, n, e, j] = coefficients[g, n, j] * inputs[n, e, j]``, returned as ``(g, n, e*j)``."""
    torch.mul(coefficients.unsqueeze(2), inputs, out=out)
    return out.flatten(2)


def _pull(out: Tensor, vectors: Tensor, weight: Tensor) -> Tensor:
    """``W^T v``: ``(g, n, d)`` vectors through ``(g, e*j, d)`` weight into ``out`` ``(g, n, e, j)``."""
    torch.bmm(vectors, weight.transpose(1, 2), out=out.flatten(2))
    return out


def _add_inputs_grad(grad_x: Tensor, coefficients: Tensor, pulled: Tensor) -> None:
    """``grad_x[n, e, j] += sum_g coefficients[g, n, j] * pulled[g, n, e, j]``."""
    for k in range(pulled.shape[0]):
        grad_x.addcmul_(coefficients[k].unsqueeze(1), pulled[k])


def _exact(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run a kernel with autocast off: its ``out=`` products must compute in the tensors' dtype
    (:class:`LinearVotes` hands them one dtype); under autocast they would turn to bfloat16."""

    @functools.wraps(method)
    def run(ctx: FunctionCtx, first: Tensor, *args: Tensor) -> _T:
        with autocast_off(first.device.type):
            return method(ctx, first, *args)

    return run


# Every streamed-votes backward: it recomputes the products and is not itself differentiable.
differentiable_once = refuse_double_backward(
    "capsule votes streamed without being formed (LinearVotes: CapsuleLinear's strategy='stream', "
    "what strategy='auto' picks on a CPU) can be differentiated once only, one gradient at a time: "
    "their backward recomputes the products and is neither differentiable nor batchable; use "
    "strategy='materialize' for double backward (create_graph=True) and batched gradients "
    "(is_grads_batched=True, jacobian or hessian with vectorize=True)"
)


def weighted_sum(couplings: Tensor, inputs: Tensor, weight: Tensor) -> Tensor:
    """``s[i, b, d] = sum_{e, j} c[i, b, j] x[b, e, j] w[i, (e j), d]``, tile by tile.

    Args:
        couplings: ``(i, b, j)``.
        inputs: ``(b, e, j)``.
        weight: ``(i, e*j, d)``.

    Returns:
        ``(i, b, d)`` (no autograd: :class:`LinearVotes` and the dynamic routing kernel wrap it).
    """
    out = inputs.new_empty(couplings.shape[0], couplings.shape[1], weight.shape[-1])
    for r, b, (scratch,) in _tiles(inputs, weight.shape[0], 1):
        torch.bmm(_scale(scratch, couplings[r, b], inputs[b]), weight[r], out=out[r, b])
    return out


def plain_weighted_sum(couplings: Tensor, inputs: Tensor, weight: Tensor) -> Tensor:
    """:func:`weighted_sum` in two plain products, differentiable by autograd, forward-mode AD and
    every ``torch.func`` transform: what runs :func:`~torchvote.tracing.plain_ops_required`. Two
    two-operand einsums in a fixed order, not one of three: with opt_einsum installed,
    ``torch.einsum`` picks a three-operand order from the sizes, which fixed the batch size of an
    exported program.

    Args:
        couplings: ``(i, b, j)``.
        inputs: ``(b, e, j)``.
        weight: ``(i, e*j, d)``.

    Returns:
        ``(i, b, d)``: ``s[i, b, d] = sum_{e, j} c[i, b, j] x[b, e, j] w[i, (e j), d]``.
    """
    _, features, senders = inputs.shape
    weight = weight.unflatten(1, (features, senders))  # (i, e, j, d)
    with autocast_off(inputs.device.type):  # in the arguments' dtype, as the kernel
        scaled = couplings.unsqueeze(2) * inputs  # (i, b, e, j): each input scaled by its coupling
        return torch.einsum("ibej,iejd->ibd", scaled, weight)


def plain_agreement(inputs: Tensor, weight: Tensor, outputs: Tensor) -> Tensor:
    """:func:`agreement` in two plain products, differentiable by autograd, forward-mode AD and
    every ``torch.func`` transform: what runs :func:`~torchvote.tracing.plain_ops_required` (two
    einsums in a fixed order, as :func:`plain_weighted_sum`).

    Args:
        inputs: ``(b, e, j)``.
        weight: ``(i, e*j, d)``.
        outputs: ``(i, b, d)``.

    Returns:
        ``(i, b, j)``: ``a[i, b, j] = sum_e x[b, e, j] sum_d w[i, (e j), d] v[i, b, d]``.
    """
    _, features, senders = inputs.shape
    weight = weight.unflatten(1, (features, senders))  # (i, e, j, d)
    with autocast_off(inputs.device.type):  # in the arguments' dtype, as the kernel
        projected = torch.einsum("iejd,ibd->ibej", weight, outputs)  # (i, b, e, j): w^T v per input
        return torch.einsum("ibej,bej->ibj", projected, inputs)


def weighted_sum_backward(
    grad: Tensor,
    couplings: Tensor,
    inputs: Tensor,
    weight: Tensor,
    *,
    grad_couplings: Tensor | None = None,
    grad_inputs: Tensor | None = None,
    grad_weight: Tensor | None = None,
) -> None:
    """The gradients of :func:`weighted_sum` for the output gradient ``grad`` ``(i, b, d)``.

    Writes ``grad_couplings`` ``(i, b, j)`` and adds into ``grad_inputs`` ``(b, e, j)`` and
    ``grad_weight`` ``(i, d, e*j)`` (the weight's layout transposed: its products then stream the
    long ``e*j`` rows, faster than the transposed ones), each where given. One pass over the
    tiles: ``W^T grad`` is pulled once for both the couplings' and the inputs' gradients.
    """
    for r, b, (scratch, back) in _tiles(inputs, weight.shape[0], 2):
        if grad_weight is not None:
            scaled = _scale(scratch, couplings[r, b], inputs[b])
            grad_weight[r].baddbmm_(grad[r, b].transpose(1, 2), scaled)  # (g, d, e*j)
        if grad_couplings is not None or grad_inputs is not None:
            pulled = _pull(back, grad[r, b], weight[r])  # W^T grad: (g, n, e, j)
            if grad_inputs is not None:
                _add_inputs_grad(grad_inputs[b], couplings[r, b], pulled)
            if grad_couplings is not None:
                torch.sum(pulled.mul_(inputs[b]), dim=2, out=grad_couplings[r, b])


def agreement(inputs: Tensor, weight: Tensor, outputs: Tensor) -> Tensor:
    """``a[i, b, j] = sum_e x[b, e, j] sum_d w[i, (e j), d] v[i, b, d]``, tile by tile.

    Args:
        inputs: ``(b, e, j)``.
        weight: ``(i, e*j, d)``.
        outputs: ``(i, b, d)``.

    Returns:
        ``(i, b, j)`` (no autograd: :class:`LinearVotes` and the dynamic routing kernel wrap it).
    """
    out = inputs.new_empty(weight.shape[0], inputs.shape[0], inputs.shape[2])
    for r, b, (scratch,) in _tiles(inputs, weight.shape[0], 1):
        pulled = _pull(scratch, outputs[r, b], weight[r]).mul_(inputs[b])
        torch.sum(pulled, dim=2, out=out[r, b])
    return out


def agreement_backward(
    grad: Tensor,
    inputs: Tensor,
    weight: Tensor,
    outputs: Tensor,
    *,
    grad_inputs: Tensor | None = None,
    grad_weight: Tensor | None = None,
    grad_outputs: Tensor | None = None,
) -> None:
    """The gradients of :func:`agreement` for the output gradient ``grad`` ``(i, b, j)``.

    Adds into ``grad_inputs`` ``(b, e, j)`` and ``grad_weight`` ``(i, d, e*j)`` and writes
    ``grad_outputs`` ``(i, b, d)``, each where given. One pass over the tiles: the scaled inputs
    ``grad * x`` serve both the outputs' and the weight's gradients.
    """
    for r, b, (scratch, back) in _tiles(inputs, weight.shape[0], 2):
        if grad_weight is not None or grad_outputs is not None:
            scaled = _scale(scratch, grad[r, b], inputs[b])  # (g, n, e*j)
            if grad_outputs is not None:
                torch.bmm(scaled, weight[r], out=grad_outputs[r, b])  # (g, n, d)
            if grad_weight is not None:
                grad_weight[r].baddbmm_(outputs[r, b].transpose(1, 2), scaled)  # (g, d, e*j)
        if grad_inputs is not None:
            _add_inputs_grad(grad_inputs[b], grad[r, b], _pull(back, outputs[r, b], weight[r]))


class _LinearWeightedSum(torch.autograd.Function):
    """:func:`weighted_sum` with its gradients: votes never formed, backward recomputes."""

    @staticmethod
    @_exact
    def forward(ctx: FunctionCtx, couplings: Tensor, inputs: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(couplings, inputs, weight)
        return weighted_sum(couplings, inputs, weight)

    @staticmethod
    @differentiable_once
    @once_differentiable
    @_exact
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        couplings, inputs, weight = ctx.saved_tensors
        need_c, need_x, need_w = ctx.needs_input_grad
        grad_c = torch.empty_like(couplings) if need_c else None
        grad_x = torch.zeros_like(inputs) if need_x else None
        grad_w = weight.new_zeros(weight.shape[0], weight.shape[2], weight.shape[1]) if need_w else None
        weighted_sum_backward(
            grad.to(inputs.dtype).contiguous(),
            couplings,
            inputs,
            weight,
            grad_couplings=grad_c,
            grad_inputs=grad_x,
            grad_weight=grad_w,
        )
        return grad_c, grad_x, None if grad_w is None else grad_w.transpose(1, 2)


class _LinearDot(torch.autograd.Function):
    """:func:`agreement` with its gradients: votes never formed, backward recomputes."""

    @staticmethod
    @_exact
    def forward(ctx: FunctionCtx, inputs: Tensor, weight: Tensor, outputs: Tensor) -> Tensor:
        ctx.save_for_backward(inputs, weight, outputs)
        return agreement(inputs, weight, outputs)

    @staticmethod
    @differentiable_once
    @once_differentiable
    @_exact
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        inputs, weight, outputs = ctx.saved_tensors
        need_x, need_w, need_v = ctx.needs_input_grad
        grad_x = torch.zeros_like(inputs) if need_x else None
        grad_w = weight.new_zeros(weight.shape[0], weight.shape[2], weight.shape[1]) if need_w else None
        grad_v = torch.empty_like(outputs) if need_v else None
        agreement_backward(
            grad.to(inputs.dtype).contiguous(),
            inputs,
            weight,
            outputs,
            grad_inputs=grad_x,
            grad_weight=grad_w,
            grad_outputs=grad_v,
        )
        return grad_x, None if grad_w is None else grad_w.transpose(1, 2), grad_v


class _WeightTimesInputs:
    """What both capsule-vote classes share: votes ``weight`` x ``inputs``, never materialised by
    the loop. Subclasses set ``weight``, ``inputs``, ``batch_shape``, ``receivers`` and ``senders``."""

    weight: Tensor
    inputs: Tensor
    batch_shape: tuple[int, ...]
    receivers: int
    senders: int

    def detach(self):
        """The same votes with ``weight`` and ``inputs`` cut from the autograd graph."""
        return type(self)(self.weight.detach(), self.inputs.detach())

    def zero_logits(self) -> Tensor:
        """``(..., i, j)`` zeros: routing's ``b_ij = 0`` start, in the votes' device and dtype."""
        return self.inputs.new_zeros(*self.batch_shape, self.receivers, self.senders, dtype=self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the votes compute in: the promotion of the weight's and the inputs' (as
        ``weight @ inputs`` would give; they differ only under ``torch.autocast``)."""
        return torch.promote_types(self.weight.dtype, self.inputs.dtype)

    @property
    def device(self) -> torch.device:
        """Where the votes live: the inputs' device (the weight's, checked when made)."""
        return self.inputs.device


def _check_weight_and_inputs(weight: Tensor, inputs: Tensor) -> None:
    """Floating-point ``weight`` and ``inputs`` of one dtype (outside ``torch.autocast``, under
    which they meet in their promotion) on one device: dtypes and devices only.

    Raises:
        TypeError: either not a floating-point tensor, or the two of different dtypes (a float16
            weight routed float32 inputs in float32, float64 inputs returned float64).
        ValueError: the two on different devices (beside ``meta`` inputs a CPU weight computed
            on uninitialised memory).
    """
    check_float_tensor(weight, "weight")
    check_float_tensor(inputs, "inputs")
    check_inputs_beside(inputs, (("weight", weight),), where="the inputs")


class LinearVotes(_WeightTimesInputs):
    """The votes ``u_hat[..., i, j, :] = weight[i, j] @ inputs[..., j, :]``, never materialised.

    The :class:`~torchvote.functional.voting.Votes` of a capsule layer with one transformation
    matrix per (output, input) pair (Sabour, Frosst & Hinton 2017, eq. 2:
    ``u_hat_{j|i} = W_ij u_i``; in torchvote's legend the output capsule is the receiver ``i`` and
    the input capsule the sender ``j``). :meth:`weighted_sum` and :meth:`dot` are computed from
    ``weight`` and ``inputs`` directly, each a batched matrix product per receiver over
    cache-sized blocks, with hand-written first-order gradients that recompute rather than store
    (double backward and batched gradients raise a RuntimeError that says so; use
    :meth:`materialize` and :class:`~torchvote.functional.voting.PairwiseVotes` for that). Under
    ``torch.func`` transforms and forward-mode AD the two products run as einsums instead (see
    :func:`~torchvote.tracing.plain_ops_required`): the same numbers, the memory of materialised
    votes.

    One object may be routed by several calls (``explain`` routes a layer's votes for each prefix
    of the passes): what it keeps between them is formed again whenever weight or inputs changed.
    With gradients on, the calls share the graph of what was kept, as calls on one votes tensor
    share the product that formed it: the squared norms a distance agreement reads keep their
    einsums' inputs, so a second call's backward after the first's needs ``retain_graph=True``
    there (autograd's "backward through the graph a second time" otherwise).

    Args:
        weight: ``(i, j, d, e)``: the matrix taking input capsule ``j`` (``e`` features) to its
            vote for output capsule ``i`` (``d`` features).
        inputs: ``(..., j, e)``: the input capsules.

    Raises:
        TypeError: if ``weight`` or ``inputs`` is not a floating-point tensor, or the two differ
            in dtype (outside ``torch.autocast``).
        ValueError: if ``weight`` is not 4-D, has a size 0, or its ``(j, e)`` do not match
            ``inputs``; the two on different devices.
    """

    def __init__(self, weight: Tensor, inputs: Tensor) -> None:
        _check_weight_and_inputs(weight, inputs)
        if weight.dim() != 4 or 0 in weight.shape:  # the blocked kernels need every size >= 1
            raise ValueError(
                "weight must have shape (out_caps, in_caps, out_dim, in_dim), every size >= 1, "
                f"got {tuple(weight.shape)}"
            )
        receivers, senders, out_dim, in_dim = weight.shape
        if inputs.dim() < 2 or inputs.shape[-2:] != (senders, in_dim):
            raise ValueError(
                f"inputs must have shape (..., in_caps={senders}, in_dim={in_dim}) to match weight "
                f"{tuple(weight.shape)}, got {tuple(inputs.shape)}"
            )
        self.weight = weight
        self.inputs = inputs
        self.batch_shape = tuple(inputs.shape[:-2])
        self.receivers, self.senders, self.out_dim, self.in_dim = receivers, senders, out_dim, in_dim
        # what _kept made, by name: (weight, inputs, key, their storages held, tensor)
        self._kept_tensors: dict[str, tuple[Tensor, Tensor, tuple, tuple[Tensor, ...], Tensor]] = {}

    # The GEMM layouts and the squared norms are small tensors made from weight and inputs that a
    # router reads several times per call (every pass's products read both layouts). They are
    # made once and kept while what they were made from is unchanged (_kept), so that a votes
    # object reused across router calls, as explain.from_run reuses the layer's votes for every
    # prefix of the passes, gives what fresh votes give: a copy kept under no_grad or inference
    # mode has no graph, and one kept before an optimizer step changed the weight in place has the
    # old values. Autograd flows back through the kept copies. The layouts are in one dtype: the
    # kernels run with autocast off, so bfloat16 inputs meet float32 weights in float32 (the
    # routing of a bf16-autocast model streams in float32).
    # Kept in a plain dict, not functools.cached_property: before Python 3.12 that takes a lock
    # on every first read, a context manager torch.compile cannot trace (a graph break).

    def _key(self) -> tuple | None:
        """What a kept tensor's validity depends on beyond the identity of weight and inputs, or
        None where it cannot be told (then nothing is kept).

        The grad mode decides whether a copy carries a graph, inference mode whether it is an
        inference tensor, ``requires_grad`` (a leaf may be switched) whether the graph reaches
        the sources; a version counter is bumped by every in-place change (an optimizer step,
        ``copy_`` under no_grad); the data pointer moves where ``.data`` is assigned (which
        ``Module.to``/``.double()`` do on parameters and which leaves the version as it was): an
        entry holds its sources' storages (:meth:`_kept`), so the allocator cannot hand their
        addresses to the new data while the entry could be read.
        In-place changes made through ``.data`` escape the version counter, as they escape
        autograd's own check of saved tensors: they are not seen here either.

        While ``torch.compile`` traces, the key is the grad mode and ``requires_grad`` only:
        dynamo refuses ``torch.is_inference_mode_enabled()`` (a graph break) and cannot compare
        ``_version`` (data-dependent), and without keeping, every pass's products put copies of
        their own in the graph (8 more at the tests' inverted dot-product layer; the graph does not
        merge them). A compiled module makes fresh votes on every call, so nothing kept outlives
        its trace; only votes made outside a compiled function and routed by it more than once,
        with the weight or inputs changed in place between, would read stale layouts (a key that
        eager reads never match, so nothing passes between eager and compiled calls).

        Never kept:

        - under a ``torch.func`` transform or from tensors with a forward-mode tangent: a copy
          is a tensor of the transform's (or the dual level's) level, wrong at any other;
        - from inference tensors, which have no version counter: an in-place change inside
          inference mode could not be seen (the layouts are then formed at every read, a few
          percent of one product each at CapsNet's shapes);
        - from tensors without storage (subclasses): no data pointer to tell a swap by.
        """
        weight, inputs = self.weight, self.inputs
        if torch.compiler.is_compiling():
            return ("compiling", torch.is_grad_enabled(), weight.requires_grad, inputs.requires_grad)
        if under_autograd_transforms(weight, inputs):
            return None
        if weight.is_inference() or inputs.is_inference():
            return None
        try:
            pointers = (weight.data_ptr(), inputs.data_ptr())
        except RuntimeError:  # a tensor subclass without storage
            return None
        return (
            torch.is_grad_enabled(),
            torch.is_inference_mode_enabled(),
            weight.requires_grad,
            inputs.requires_grad,
            weight._version,
            inputs._version,
            *pointers,
        )

    def _kept(self, name: str, form: Callable[[], Tensor]) -> Tensor:
        """``form()``, made once and kept under ``name`` while weight and inputs are the same
        tensors, unchanged, and the modes the same (:meth:`_key`); made again otherwise (and then
        kept in place of the old one, whose graph and held storages are let go).

        The entry holds detached aliases of weight and inputs: with their storages alive, data
        assigned through ``.data`` (a ``Module.to`` there and back, weight decay written as
        ``w.data = w.data * 0.9``) cannot land at the old address, where the key's data pointers
        and unchanged version would have read the old layouts as current."""
        key = self._key()
        if key is None:
            return form()
        kept = self._kept_tensors.get(name)
        if kept is not None and kept[0] is self.weight and kept[1] is self.inputs and kept[2] == key:
            return kept[4]
        tensor = form()
        held = () if key[0] == "compiling" else (self.weight.detach(), self.inputs.detach())
        self._kept_tensors[name] = (self.weight, self.inputs, key, held, tensor)
        return tensor

    @property
    def gemm_inputs(self) -> Tensor:
        """The inputs as the kernels read them: ``(b, e, j)``, contiguous, in :attr:`dtype`."""
        return self._kept("gemm_inputs", self._form_gemm_inputs)

    def _form_gemm_inputs(self) -> Tensor:
        x = self.inputs.reshape(-1, self.senders, self.in_dim).transpose(1, 2)  # (b, e, j)
        return x.to(self.dtype).contiguous()

    @property
    def gemm_weight(self) -> Tensor:
        """The weight as the kernels read it: ``(i, e*j, d)``, contiguous, in :attr:`dtype`."""
        return self._kept("gemm_weight", self._form_gemm_weight)

    def _form_gemm_weight(self) -> Tensor:
        w = self.weight.permute(0, 3, 1, 2)  # (i, e, j, d)
        w = w.reshape(self.receivers, self.in_dim * self.senders, self.out_dim)  # (i, e*j, d)
        return w.to(self.dtype).contiguous()

    def _flat(self, t: Tensor, last: int) -> Tensor:
        """``(..., i, last)`` -> ``(i, b, last)`` contiguous."""
        return t.reshape(-1, self.receivers, last).transpose(0, 1).contiguous()

    def _unflat(self, t: Tensor) -> Tensor:
        """``(i, b, k)`` -> ``(..., i, k)``."""
        return t.transpose(0, 1).reshape(*self.batch_shape, self.receivers, t.shape[-1])

    def weighted_sum(self, weights: Tensor) -> Tensor:
        """``(..., i, j)`` weights -> ``(..., i, d)``: ``sum_j w_ij W_ij u_j``."""
        weights = weights.expand(*self.batch_shape, self.receivers, self.senders)
        weights = weights.to(self.dtype)
        arguments = (self._flat(weights, self.senders), self.gemm_inputs, self.gemm_weight)
        if plain_ops_required(*arguments):
            return self._unflat(plain_weighted_sum(*arguments))
        return self._unflat(_LinearWeightedSum.apply(*arguments))

    def dot(self, outputs: Tensor) -> Tensor:
        """``(..., i, d)`` outputs -> ``(..., i, j)``: ``(W_ij u_j) . v_i``."""
        outputs = outputs.to(self.dtype).expand(*self.batch_shape, self.receivers, self.out_dim)
        arguments = (self.gemm_inputs, self.gemm_weight, self._flat(outputs, self.out_dim))
        if plain_ops_required(*arguments):
            return self._unflat(plain_agreement(*arguments))
        return self._unflat(_LinearDot.apply(*arguments))

    def squared_norm(self) -> Tensor:
        """``(..., i, j)``: ``||W_ij u_j||^2 = u_j^T (W_ij^T W_ij) u_j``, computed once and kept
        (every pass of a distance agreement reads it) while weight and inputs are unchanged."""
        return self._kept("squared_norm", self._form_squared_norm)

    def _form_squared_norm(self) -> Tensor:
        # in at least float32, autocast off: weight and inputs are small
        gram = _einsum_at_least_float32("ijde,ijdf->ijef", self.weight, self.weight)  # (i, j, e, e)
        x = self.inputs.reshape(-1, self.senders, self.in_dim)  # (b, j, e)
        outer = _einsum_at_least_float32("bje,bjf->bjef", x, x).flatten(-2)  # (b, j, e*e)
        norms = _einsum_at_least_float32("bjk,ijk->bij", outer, gram.flatten(-2))  # (b, i, j)
        return norms.reshape(*self.batch_shape, self.receivers, self.senders)

    def materialize(self) -> Tensor:
        """The votes as a tensor ``(..., i, j, d)`` (for routers that need them elementwise)."""
        return torch.einsum("ijde,...je->...ijd", self.weight.to(self.dtype), self.inputs.to(self.dtype))


class SharedLinearVotes(_WeightTimesInputs):
    """Votes with one matrix per output capsule, shared by every input: ``u_hat_ij = W_i u_j``.

    The weighted-voting article's parameter-sharing option (every input capsule is projected by
    the same matrix, as attention projects every token by the same ``W_V``). Sharing makes both
    contractions cheap: ``s_i = W_i (sum_j c_ij u_j)`` and ``u_hat_ij . v_i = u_j . (W_i^T v_i)``,
    so nothing of size ``(b, i, j, d)`` is formed.

    Args:
        weight: ``(i, d, e)``.
        inputs: ``(..., j, e)``.

    Raises:
        TypeError: if ``weight`` or ``inputs`` is not a floating-point tensor, or the two differ
            in dtype (outside ``torch.autocast``).
        ValueError: if ``weight`` is not 3-D or its ``e`` does not match ``inputs``; the two on
            different devices.
    """

    def __init__(self, weight: Tensor, inputs: Tensor) -> None:
        _check_weight_and_inputs(weight, inputs)
        if weight.dim() != 3:
            raise ValueError(f"weight must have shape (out_caps, out_dim, in_dim), got {tuple(weight.shape)}")
        if inputs.dim() < 2 or inputs.shape[-1] != weight.shape[-1]:
            raise ValueError(
                f"inputs must have shape (..., in_caps, in_dim={weight.shape[-1]}), got {tuple(inputs.shape)}"
            )
        self.weight = weight
        self.inputs = inputs
        self.receivers, self.out_dim, self.in_dim = weight.shape
        self.senders = inputs.shape[-2]
        self.batch_shape = tuple(inputs.shape[:-2])

    # Every product runs on operands cast to :attr:`dtype` (free where they have it): weight and
    # inputs of two dtypes (under torch.autocast only) meet in their promotion, as in LinearVotes;
    # the einsums then cast them again themselves.

    def weighted_sum(self, weights: Tensor) -> Tensor:
        """``(..., i, j)`` weights -> ``(..., i, d)``: ``W_i (sum_j w_ij u_j)``."""
        dtype = self.dtype
        pooled = torch.einsum("...ij,...je->...ie", weights.to(dtype), self.inputs.to(dtype))  # (..., i, e)
        return torch.einsum("ide,...ie->...id", self.weight.to(dtype), pooled)

    def dot(self, outputs: Tensor) -> Tensor:
        """``(..., i, j)``: ``u_j . (W_i^T v_i)``, never in float16 (the Votes contract)."""
        dtype = self.dtype
        weight, inputs = self.weight.to(dtype), self.inputs.to(dtype)
        pulled = _einsum_without_float16("ide,...id->...ie", weight, outputs.to(dtype))  # W_i^T v_i
        return _einsum_without_float16("...je,...ie->...ij", inputs, pulled)

    def squared_norm(self) -> Tensor:
        gram = _einsum_at_least_float32("ide,idf->ief", self.weight, self.weight)  # (i, e, e)
        outer = _einsum_at_least_float32("...je,...jf->...jef", self.inputs, self.inputs)  # (..., j, e, e)
        return _einsum_at_least_float32("...jk,ik->...ij", outer.flatten(-2), gram.flatten(-2))

    def materialize(self) -> Tensor:
        """The votes as a tensor ``(..., i, j, d)``."""
        return torch.einsum("ide,...je->...ijd", self.weight.to(self.dtype), self.inputs.to(self.dtype))
