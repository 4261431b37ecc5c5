"""Dynamic routing on a capsule layer's linear votes as one kernel, the votes never formed.

Dynamic routing (Sabour, Frosst & Hinton 2017, Procedure 1) reads the votes ``u_hat_ij = W_ij u_j``
twice in every pass: the weighted sum ``s_i = sum_j c_ij u_hat_ij`` and the agreement
``u_hat_ij . v_i``. :class:`~torchvote.functional.routing_votes.LinearVotes` computes each as a
product with ``W`` over cache-sized tiles (see that module); run by the voting loop, every product is
its own autograd node, with its own gradient buffers, layout copies and tile passes. This kernel
runs Procedure 1 on the same products as one autograd function:

- the first pass's couplings are uniform (``softmax(0) = 1 / out_caps``), so its sum is
  ``(1 / out_caps) sum_j W_ij u_j``: one matrix product ``(b, e*j) @ (e*j, i*d)`` shared by every
  receiver (:func:`uniform_sum`), with no scaled copy of the inputs and no coupling gradient; with
  one iteration that product is the whole routing;
- the logits and couplings stay in the products' ``(i, b, j)`` layout through every pass;
- backward walks the passes back once, with the sums and couplings forward saved: each pass's
  products give the gradient of its couplings, of the previous outputs, of the inputs and of
  ``W`` from the same tiles (``routing_votes.weighted_sum_backward``, ``agreement_backward``),
  all accumulated into one gradient of ``W``, laid out ``(i, d, e*j)`` so that its products stream
  the long rows (on this CPU 31 GFLOP/s against 23 for the transposed layout).

What forward keeps for backward is the sums ``(r, i, b, d)`` and the couplings of passes
``1 .. r-1``, ``(i, b, j)`` each: never the ``(b, i, j, d)`` votes (94 MB at CapsNet's shapes and
batch 128) nor their gradient. The kernel computes in the promoted dtype of weight and inputs, at
least float32, with autocast off, and gives the numbers of
:func:`~torchvote.functional.voting.vote` on the same votes (tested in float64 against the paper's
loop, outputs and gradients, in ``tests/functional/test_dynamic_kernel.py``). Under ``torch.func``
transforms and forward-mode AD, which the autograd function cannot serve, the same passes run with
the products as einsums (``tests/functional/test_func_transforms.py``).

Index legend: ``b`` batch, ``i`` receivers (output capsules), ``j`` senders (input capsules),
``d`` output (vote) features, ``e`` input features.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from torchvote.functional import routing_votes
from torchvote.functional.nonlinearities import squash
from torchvote.functional.routing_votes import LinearVotes
from torchvote.functional.voting import autocast_off
from torchvote.tracing import plain_ops_required

__all__ = ["linear_dynamic_routing", "uniform_sum"]


def _layouts(votes: LinearVotes) -> tuple[Tensor, Tensor]:
    """The inputs ``(b, e, j)`` and the weight ``(i, d, e*j)``, contiguous, in the kernel's dtype
    (the votes' promoted dtype, at least float32). Every product here reads the weight in this one
    layout: the first pass's as ``(i*d, e*j)``, the per-receiver ones through transposed views."""
    dtype = torch.promote_types(votes.dtype, torch.float32)
    flat = votes.weight.to(dtype).permute(0, 2, 3, 1)  # (i, d, e, j)
    return votes.gemm_inputs.to(dtype), flat.reshape(votes.receivers, votes.out_dim, -1).contiguous()


def uniform_sum(votes: LinearVotes) -> Tensor:
    """``(..., i, d)``: ``(1 / out_caps) sum_j W_ij u_j``, routing's first pass from zero logits,
    as one matrix product ``(b, e*j) @ (e*j, i*d)`` (the votes are never formed)."""
    with autocast_off(votes.inputs.device.type):
        x, flat = _layouts(votes)
        sums = (x.flatten(1) @ flat.flatten(0, 1).t()).div_(votes.receivers)  # (b, i*d)
    return sums.reshape(*votes.batch_shape, votes.receivers, votes.out_dim)


def linear_dynamic_routing(
    votes: LinearVotes,
    *,
    iterations: int,
    bias: Tensor | None = None,
    detach_votes: bool = False,
    all_passes: bool = False,
) -> tuple[Tensor, Tensor]:
    """Dynamic routing with the dot-product agreement on :class:`LinearVotes`, as one kernel.

    The numbers of :func:`~torchvote.functional.routing.dynamic_routing` with ``agreement="dot"``
    on these votes, which calls it (and checks the arguments).

    Under ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``, ``jvp``, per-sample gradients)
    and forward-mode AD, which cannot run the kernel's autograd Function, the same passes run
    with the products as einsums (:func:`~torchvote.tracing.plain_ops_required`):
    the same numbers, differentiable by every transform, with the memory of materialised votes.

    Args:
        votes: the layer's votes ``W_ij u_j``.
        iterations: routing passes, at least 1.
        bias: broadcastable to ``(batch..., out_caps, out_dim)``, added to every pass's sums.
        detach_votes: the votes take gradient from the last pass only (the bias from every pass).
        all_passes: return the couplings of every pass, stacked on a new leading axis.

    Returns:
        ``(outputs, couplings)``: ``(batch..., out_caps, out_dim)`` and
        ``(batch..., out_caps, in_caps)`` (with ``all_passes``: ``(iterations, batch..., out_caps,
        in_caps)``).
    """
    receivers, senders, out_dim = votes.receivers, votes.senders, votes.out_dim
    shape = (*votes.batch_shape, receivers, out_dim)
    with autocast_off(votes.inputs.device.type):
        x, flat = _layouts(votes)
        if bias is not None:
            bias = bias.to(x.dtype).expand(shape).reshape(-1, receivers, out_dim).transpose(0, 1)  # (i, b, d)
        if iterations == 1:
            sums = uniform_sum(votes).reshape(-1, receivers, out_dim).transpose(0, 1)  # (i, b, d)
            outputs, later = squash(sums if bias is None else sums + bias, dim=-1), []
        elif plain_ops_required(x, flat, bias):  # the kernel's passes in einsums
            early = (x.detach(), flat.detach()) if detach_votes else (x, flat)
            sums, later = _passes(x, flat, bias, iterations, routing_votes.plain_weighted_sum,
                                  routing_votes.plain_agreement, early=early)
            outputs = squash(sums[-1] if bias is None else sums[-1] + bias, dim=-1)
        else:
            outputs, *later = _Routing.apply(x, flat, bias, iterations, detach_votes)
    # contiguous, as every strategy returns them (a view of the (i, b, d) layout refused .view())
    outputs = outputs.transpose(0, 1).to(votes.dtype).reshape(shape).contiguous()  # (i, b, d) -> (..., i, d)
    coupling_shape = (*votes.batch_shape, receivers, senders)
    passes = [c.transpose(0, 1).to(votes.dtype).reshape(coupling_shape) for c in later]
    if all_passes or not passes:  # pass 0's couplings, uniform: formed only when returned
        passes.insert(0, outputs.new_full(coupling_shape, 1 / receivers))
    return outputs, torch.stack(passes) if all_passes else passes[-1].contiguous()


def _squash_grad(sums: Tensor, grad: Tensor) -> Tensor:
    """The gradient through :func:`squash` at ``sums`` (small ``(i, b, d)`` tensors: autograd).

    While ``torch.compile`` traces, through ``torch.func.vjp``: ``torch.autograd.grad`` in a
    backward is a graph break there (dynamo does not trace it; the whole kernel would run
    eagerly, between two graphs). Eagerly, through ``torch.autograd.grad``: the same numbers,
    and about 1.5x faster than ``vjp`` at CapsNet's ``(10, 128, 16)`` on a CPU.
    """
    if torch.compiler.is_compiling():
        _, pull_back = torch.func.vjp(lambda s: squash(s, dim=-1), sums)
        (result,) = pull_back(grad)
        return result
    with torch.enable_grad():
        sums = sums.detach().requires_grad_(True)
        (result,) = torch.autograd.grad(squash(sums, dim=-1), sums, grad)
    return result


def _passes(
    x: Tensor,
    flat: Tensor,
    bias: Tensor | None,
    iterations: int,
    weighted_sum: Callable[[Tensor, Tensor, Tensor], Tensor],
    agreement: Callable[[Tensor, Tensor, Tensor], Tensor],
    *,
    early: tuple[Tensor, Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor]]:
    """Procedure 1's passes on ``x`` ``(b, e, j)`` and ``flat`` ``(i, d, e*j)``: the sums ``s``
    ``(i, b, d)`` of every pass (before bias and squash) and the couplings ``(i, b, j)`` of passes
    ``1 .. r-1``.

    ``weighted_sum(c, x, w)`` and ``agreement(x, w, v)`` are the two products, on the weight as
    ``w`` ``(i, e*j, d)``: the tiled kernels of ``routing_votes`` (in :class:`_Routing`'s forward,
    without autograd) or their einsums (differentiable). ``early`` is the ``(x, flat)`` every
    pass but the last reads (detached votes; default ``(x, flat)``).
    """
    receivers, out_dim, _ = flat.shape
    x_early, flat_early = (x, flat) if early is None else early
    w, w_early = flat.transpose(1, 2), flat_early.transpose(1, 2)  # (i, e*j, d)
    # pass 0: c_ij = 1 / receivers, so s = W (x flattened) / receivers: one product, no votes
    s = (x_early.flatten(1) @ flat_early.flatten(0, 1).t()).div_(receivers)  # (b, i*d)
    s = s.view(x.shape[0], receivers, out_dim).transpose(0, 1)  # (i, b, d): receivers first, as below
    sums, couplings, logits = [s], [], None
    for t in range(1, iterations):
        v = squash(s if bias is None else s + bias, dim=-1)
        agreed = agreement(x_early, w_early, v.contiguous())  # (i, b, j)
        # out of place: on the plain path autograd (forward-mode and reverse-over-forward, as in
        # jacrev(jvp(...)) or a compiled jvp) keeps the previous pass's logits
        logits = agreed if logits is None else logits + agreed
        couplings.append(torch.softmax(logits, dim=0))  # over the outputs
        last = t == iterations - 1
        s = weighted_sum(couplings[-1], x if last else x_early, w if last else w_early)
        sums.append(s)
    return sums, couplings


class _Routing(torch.autograd.Function):
    """Procedure 1 on the votes ``W_ij u_j``, never formed: the ``(i, b, d)`` outputs and the
    ``(i, b, j)`` couplings of passes ``1 .. r-1`` (pass 0's are the uniform ``1 / receivers``).

    ``x`` ``(b, e, j)`` are the inputs, ``flat`` ``(i, d, e*j)`` the weight; the per-receiver
    products of ``routing_votes`` read it as ``(i, e*j, d)``, a transposed view.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: Tensor,
        flat: Tensor,
        bias: Tensor | None,
        iterations: int,
        detach: bool,
    ) -> tuple[Tensor, ...]:
        sums, couplings = _passes(x, flat, bias, iterations, routing_votes.weighted_sum,
                                  routing_votes.agreement)
        s = sums[-1]
        outputs = squash(s if bias is None else s + bias, dim=-1)
        ctx.save_for_backward(x, flat, bias, *sums, *couplings)
        ctx.detach = detach
        if detach and bias is None:  # then the couplings come from detached votes only
            ctx.mark_non_differentiable(*couplings)
        ctx.set_materialize_grads(False)
        return (outputs, *couplings)

    @staticmethod
    @routing_votes.differentiable_once
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_outputs: Tensor | None, *grad_couplings: Tensor | None):
        x, flat, bias, *saved = ctx.saved_tensors
        iterations = (len(saved) + 1) // 2
        sums, couplings = saved[:iterations], saved[iterations:]
        need_x, need_flat, need_bias = ctx.needs_input_grad[:3]
        detach = ctx.detach
        receivers, w = flat.shape[0], flat.transpose(1, 2)
        grad_x = torch.zeros_like(x) if need_x else None
        # every product with the weight adds its gradient here, in the weight's (i, d, e*j) layout
        grad_weight = torch.zeros_like(flat) if need_flat else None
        grad_bias = None
        # Detached votes take gradient from the last pass's sum only; the bias, from every pass.
        walk = not detach or need_bias
        grad_v = torch.zeros_like(sums[0]) if grad_outputs is None else grad_outputs.contiguous()
        total = None  # the logits' gradient, summed over the passes after t
        for t in range(iterations - 1, -1, -1):
            biased = sums[t] if bias is None else sums[t] + bias
            grad_s = _squash_grad(biased, grad_v).contiguous()  # (i, b, d)
            if need_bias:
                grad_bias = grad_s if grad_bias is None else grad_bias + grad_s
            to_votes = t == iterations - 1 or not detach  # does this pass's sum reach the votes?
            if t == 0:
                if to_votes:  # c = 1 / receivers: two products with the flat weight, shared by every receiver
                    grad_s = grad_s.transpose(0, 1).flatten(1).div(receivers)  # (b, i*d)
                    if grad_x is not None:
                        grad_x.flatten(1).addmm_(grad_s, flat.flatten(0, 1))
                    if grad_weight is not None:
                        grad_weight.flatten(0, 1).addmm_(grad_s.t(), x.flatten(1))
                break
            c = couplings[t - 1]
            grad_c = torch.empty_like(c) if walk else None
            routing_votes.weighted_sum_backward(
                grad_s,
                c,
                x,
                w,
                grad_couplings=grad_c,
                grad_inputs=grad_x if to_votes else None,
                grad_weight=grad_weight if to_votes else None,
            )
            if grad_c is None:
                break
            if grad_couplings[t - 1] is not None:
                grad_c += grad_couplings[t - 1]
            grad_c.sub_((c * grad_c).sum(0, keepdim=True)).mul_(c)  # through the softmax over i
            total = grad_c if total is None else total.add_(grad_c)
            v = squash(sums[t - 1] if bias is None else sums[t - 1] + bias, dim=-1).contiguous()
            grad_v = torch.empty_like(v)
            routing_votes.agreement_backward(
                total,
                x,
                w,
                v,
                grad_outputs=grad_v,
                grad_inputs=None if detach else grad_x,
                grad_weight=None if detach else grad_weight,
            )
        return grad_x, grad_weight, grad_bias, None, None
