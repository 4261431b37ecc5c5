"""EM routing speed and memory: em_routing's strategies beside the pre-kernel em_routing and a naive loop.

The case is the routing of the paper's smallNORB ConvCaps1 (Hinton, Sabour & Frosst 2018: 32 -> 32
types, 14x14 -> 6x6, K=3, stride 2, 3 iterations): per image 36 patches, each routing
``j = 3*3*32 = 288`` input capsules to ``i = 32`` outputs with 4x4 poses, so votes
``(batch*36, 32, 288, 16)`` (680 MB in float32 at batch 32). One step is forward and backward
(gradients for the votes, the activations and both offsets) of the routing alone, on votes
already materialised. Implementations:

- ``old``: ``em_routing`` as it was before the kernel (its blocked ``_MomentVotes`` on ``vote``),
  loaded into this process from git (``--baseline``, default the commit before the change; the
  copy never enters ``src/``), on the same receivers-first votes;
- ``kernel-<strategy>``: ``torchvote.functional.em_routing(strategy=...)`` per strategy
  (``blocked``, ``vectorized``, ``compiled``), per-patch normalisation like ``old``;
  ``kernel-joint`` is ``strategy="auto"`` (blocked on CPU, vectorized on CUDA) with the joint
  normalisation over every parent (``conv_sender_groups``), the paper's form and
  ``ConvMatrixCapsules``' default;
- ``naive``: Procedure 1 as a plain eager loop over broadcast ``(n, j, i, h)`` tensors, the way
  public implementations write it (everything built on the votes' device), per patch.

Before timing, every implementation chosen (and ``old``) is checked against the naive loop in
float64 on a tiny case, ``kernel-joint`` against the same loop normalising jointly over every
parent (``naive_em(..., groups=...)``); the script stops if one disagrees (a wrong baseline would
make every ratio meaningless). ``kernel-joint`` computes another function than ``old`` (the joint
normalisation, not the per-patch one): its ratio is marked ``*`` and compares the paper's layer
with the per-patch one, not two implementations of one function. Timing runs every
implementation in this one process, interleaved, after one
warm-up step each, and reports medians and the ratio to ``old``. Peak memory: on CPU each
implementation runs once in a fresh spawned process that resets the kernel's resident-set
high-water mark (``/proc/self/clear_refs``, Linux only: elsewhere pass ``--no-memory``) after
building its inputs and reports ``VmHWM`` minus the resident set before the step
(``kernel-compiled`` first runs one untimed step at the size to compile, then returns freed heap
to the OS); on CUDA ``torch.cuda.max_memory_allocated`` minus the memory allocated before the step.

Usage::

    python benchmarks/em.py --quick                       # a tiny case, seconds (no memory column)
    python benchmarks/em.py --batch-size 32 --repeats 3   # the paper's config on CPU
    python benchmarks/em.py --device cuda --dtype bfloat16 --impls old,kernel-vectorized,kernel-compiled

With ``--dtype bfloat16`` the votes and activations are bfloat16 (the kernel keeps its statistics in
float32, ``old`` computes in bfloat16, ``naive`` upcasts the votes to float32 as a plain loop
under mixed precision does).
On a machine shared with other jobs run with ``OMP_NUM_THREADS=1`` (or ``OMP_WAIT_POLICY=PASSIVE``):
spinning OpenMP workers otherwise stall every small operation of a routing loop.
"""

from __future__ import annotations

import argparse
import gc
import math
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from _common import (
    add_batch_size_argument,
    add_device_argument,
    benchmark_parser,
    can_reset_peak_rss,
    chosen_device,
    parse_with_quick,
    peak_rss_growth_mib,
    positive_int,
    release_free_heap,
    synchronize,
)
from torchvote.functional.em import default_inverse_temperature, em_routing
from torchvote.functional.em_kernel import conv_sender_groups

IMPLEMENTATIONS = ["old", "kernel-blocked", "kernel-joint", "kernel-vectorized", "kernel-compiled",
                   "naive"]
ITERATIONS = 3
SCHEDULE = [default_inverse_temperature(t) for t in range(ITERATIONS)]
BASELINE = "9427b17"  # main before em_routing ran on the kernel
#: Largest difference from the naive loop (float64, tiny case) that counts as the same function.
AGREEMENT_TOLERANCE = 1e-8
_OLD: dict[str, Callable] = {}


def old_em_routing(baseline: str = BASELINE) -> Callable:
    """``em_routing`` of ``src/torchvote/functional/em.py`` at git revision ``baseline``, loaded
    as a module of its own (it imports ``vote`` and the validation helpers, unchanged since)."""
    if baseline not in _OLD:
        root = Path(__file__).resolve().parents[1]
        source = subprocess.run(["git", "show", f"{baseline}:src/torchvote/functional/em.py"], cwd=root,
                                check=True, capture_output=True, text=True).stdout
        module = types.ModuleType("old_em")
        exec(compile(source, f"{baseline}:em.py", "exec"), module.__dict__)  # noqa: S102
        _OLD[baseline] = module.em_routing
    return _OLD[baseline]


def naive_em(votes: Tensor, activations: Tensor, beta_u: Tensor, beta_a: Tensor, eps: float = 1e-6,
             groups: Tensor | None = None):
    """Procedure 1 as a plain loop: votes ``(n, j, i, h)``, activations ``(n, j)`` -> ``(n, i, h)``,
    ``(n, i)``. Log-space E-step, ``(beta_u + log sigma) sum R`` cost, no E-step after the last.
    ``groups`` (``(L, j)`` global input ids of each patch's senders, ``n = batch * L``): the E-step
    normalises each input's assignments over every parent of every patch it reaches (the paper's
    form), not within each patch, and starts at ``1 / (patches reaching it * i)``."""
    n, senders, receivers, _ = votes.shape
    votes = votes.float() if votes.dtype in (torch.bfloat16, torch.float16) else votes
    R = torch.full((n, senders, receivers, 1), 1.0 / receivers, dtype=votes.dtype, device=votes.device)
    if groups is not None:  # each input's unit of assignment is spread over every patch it is in
        reached = torch.bincount(groups.flatten())[groups]  # (L, j)
        R = (R.view(-1, *groups.shape, receivers, 1) / reached[..., None, None]).view_as(R)
    a = activations.to(votes.dtype).view(n, senders, 1, 1)
    for t in range(ITERATIONS):
        Ra = R * a  # (n, j, i, 1)
        total = Ra.sum(1, keepdim=True)  # (n, 1, i, 1)
        divisor = torch.where(total > 0, total, 1.0)  # the paper's sum; a receiver without data: pose 0
        mu = (Ra * votes).sum(1, keepdim=True) / divisor  # (n, 1, i, h)
        var = (Ra * (votes - mu) ** 2).sum(1, keepdim=True) / divisor + eps
        cost = (beta_u.view(1, 1, -1, 1) + 0.5 * torch.log(var)) * total
        logit = SCHEDULE[t] * (beta_a.view(1, 1, -1) - cost.sum(-1))  # (n, 1, i)
        if t == ITERATIONS - 1:
            break
        log_p = -((votes - mu) ** 2 / (2 * var)).sum(-1) - 0.5 * torch.log(2 * math.pi * var).sum(-1)
        log_r = F.logsigmoid(logit) + log_p  # (n, j, i)
        R = (torch.softmax(log_r, dim=2) if groups is None else _joint_softmax(log_r, groups)).unsqueeze(-1)
    return mu.squeeze(1), torch.sigmoid(logit.squeeze(1))


#: The kernels a check runs by default (``kernel-compiled`` is checked where chosen: it compiles).
KERNELS_IN_SECONDS = ("kernel-blocked", "kernel-joint", "kernel-vectorized")


def _joint_softmax(log_r: Tensor, groups: Tensor) -> Tensor:
    """Softmax of ``log_r`` ``(batch*L, j, i)`` over every ``(patch, parent)`` entry of one input
    (``groups`` ``(L, j)``: its global id), per image."""
    images = torch.arange(log_r.shape[0] // groups.shape[0], device=groups.device)
    ids = groups + (groups.max() + 1) * images[:, None, None]  # (batch, L, j)
    ids = ids.reshape(-1, groups.shape[1], 1).expand_as(log_r).reshape(-1)  # (n*j*i,): per image
    flat = log_r.reshape(-1)
    peak = torch.full((int(ids.max()) + 1,), -math.inf, dtype=flat.dtype, device=flat.device)
    peak = peak.scatter_reduce(0, ids, flat, "amax")
    weights = torch.exp(flat - peak[ids])
    total = torch.zeros_like(peak).scatter_add(0, ids, weights)
    return (weights / total[ids]).view_as(log_r)


def make_case(batch: int, quick: bool, device: str, dtype: torch.dtype, seed: int = 0):
    """Receivers-first votes ``(n, i, j, h)``, activations ``(n, j)``, offsets, and the grid."""
    grid, types, kernel, stride, pose_dim = ((5, 5), 4, 3, 2, 16) if quick else ((14, 14), 32, 3, 2, 16)
    positions = ((grid[0] - kernel) // stride + 1) * ((grid[1] - kernel) // stride + 1)
    generator = torch.Generator(device="cpu").manual_seed(seed)
    senders = kernel * kernel * types
    votes = torch.randn(batch * positions, types, senders, pose_dim, generator=generator)
    activations = torch.rand(batch * positions, senders, generator=generator)
    beta_u = 0.1 * torch.randn(types, generator=generator)
    beta_a = 0.1 * torch.randn(types, generator=generator)
    votes = votes.to(device=device, dtype=dtype)
    # em_routing takes the activations in the votes' dtype (a mixed pair is refused outside autocast)
    others = [activations.to(device=device, dtype=dtype), *(x.to(device) for x in (beta_u, beta_a))]
    groups = conv_sender_groups(*grid, types, kernel, stride, device=device)
    return votes, others, groups


def build(impl: str, batch: int, quick: bool, device: str, dtype: torch.dtype,
          baseline: str = BASELINE) -> Callable[[], None]:
    """A closure running one forward + backward step of ``impl`` on fresh leaves."""
    votes, (activations, beta_u, beta_a), groups = make_case(batch, quick, device, dtype)
    old = old_em_routing(baseline) if impl == "old" else None
    if impl == "naive":
        votes = rearrange(votes, "n i j h -> n j i h").contiguous()  # the papers' layout
    leaves = [votes.requires_grad_(True), activations.requires_grad_(True),
              beta_u.requires_grad_(True), beta_a.requires_grad_(True)]

    def forward():
        if impl == "old":
            return old(*leaves, iterations=ITERATIONS, inverse_temperature=SCHEDULE)
        if impl == "naive":
            return naive_em(*leaves)
        strategy = impl.removeprefix("kernel-")
        grouping = {"sender_groups": groups} if strategy == "joint" else {}
        strategy = "auto" if strategy == "joint" else strategy  # joint: the device's default
        return em_routing(*leaves, iterations=ITERATIONS, inverse_temperature=SCHEDULE, strategy=strategy,
                          **grouping)

    def step():
        poses, out_activations = forward()
        (poses.float().sum() + out_activations.float().sum()).backward()
        for leaf in leaves:
            leaf.grad = None

    return step


def _peak_worker(impl, batch, quick, device, dtype, baseline, queue) -> None:
    try:
        build(impl, 1, True, device, dtype, baseline)()  # warm the libraries up on a tiny case
        step = build(impl, batch, quick, device, dtype, baseline)
        if impl == "kernel-compiled":  # compile for this shape outside the measured step
            step()
            gc.collect()
            release_free_heap()
        if torch.device(device).type == "cuda":  # cuda or cuda:<index>
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            step()
            torch.cuda.synchronize(device)
            queue.put((torch.cuda.max_memory_allocated(device) - before) / 2**20)
            return
        queue.put(peak_rss_growth_mib(step))
    except Exception as error:  # reported in the table, not a crash of the whole run
        queue.put(f"{type(error).__name__}: {error}")


def peak_memory_mib(impl: str, batch: int, quick: bool, device: str, dtype: torch.dtype, baseline: str):
    """Extra peak memory of one step, in MiB, measured in a fresh spawned process."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_peak_worker, args=(impl, batch, quick, device, dtype, baseline, queue))
    process.start()
    process.join()
    return queue.get() if not queue.empty() else f"exit code {process.exitcode}"


def check_agreement(device: str, baseline: str | None, impls: tuple[str, ...] = KERNELS_IN_SECONDS) -> float:
    """Largest difference of the kernel ``impls`` (and ``old``, if ``baseline`` is given) from the
    naive loop, per patch or, for ``kernel-joint``, joint (float64, tiny case)."""
    votes, (activations, beta_u, beta_a), groups = make_case(2, True, device, torch.float64)
    beta_u, beta_a = beta_u.double(), beta_a.double()
    papers_layout = rearrange(votes, "n i j h -> n j i h")
    per_patch = naive_em(papers_layout, activations, beta_u, beta_a)
    worst = 0.0
    if baseline is not None:
        old = old_em_routing(baseline)(votes, activations, beta_u, beta_a, iterations=ITERATIONS,
                                       inverse_temperature=SCHEDULE)
        worst = max((x - y).abs().max().item() for x, y in zip(old, per_patch, strict=True))
    for impl in (name for name in impls if name.startswith("kernel-")):
        strategy = impl.removeprefix("kernel-")
        joint = strategy == "joint"
        ref = naive_em(papers_layout, activations, beta_u, beta_a, groups=groups) if joint else per_patch
        ours = em_routing(votes, activations, beta_u, beta_a, iterations=ITERATIONS,
                          inverse_temperature=SCHEDULE, strategy="auto" if joint else strategy,
                          **({"sender_groups": groups} if joint else {}))
        worst = max(worst, *((x - y).abs().max().item() for x, y in zip(ours, ref, strict=True)))
    return worst


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (``main`` parses ``argv`` with it)."""
    parser = benchmark_parser(__file__, __doc__.split("\n\n")[0])
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="cast: the votes and activations are cast to it (no autocast; the kernel "
                             "keeps its statistics in float32)")
    add_batch_size_argument(parser, ("--batch",), several=False, default=32,
                            help="images per step (2 with --quick)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed repeats (interleaved)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny case (5x5 grid, 4 types), batch 2 (options given beside it are kept)")
    parser.add_argument("--impls", default=None,
                        help=f"comma-separated subset of {IMPLEMENTATIONS} (default all; with --quick "
                             "all but kernel-compiled, whose compilation takes longer than the case)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip the peak-memory subprocesses (always skipped with --quick)")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the 'old' em_routing")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_with_quick(parser, argv, batch_size=2)  # --batch-size given beside --quick is kept
    default = [n for n in IMPLEMENTATIONS if not (args.quick and n == "kernel-compiled")]
    impls = [name for name in args.impls.split(",") if name] if args.impls else default
    unknown = sorted(set(impls) - set(IMPLEMENTATIONS))
    if unknown:
        parser.error(f"unknown --impls {unknown}; choose from {IMPLEMENTATIONS}")
    device = chosen_device(parser, args.device)
    args.device = str(device)  # cuda:1 stays cuda:1
    measure_memory = not (args.no_memory or args.quick)
    if measure_memory and device.type == "cpu" and not can_reset_peak_rss():
        parser.error("the CPU memory column needs Linux's /proc/self/clear_refs, which this system "
                     "does not offer: pass --no-memory")
    baseline = args.baseline if "old" in impls else None  # the old one needs this git history
    if baseline is not None:
        try:
            old_em_routing(baseline)
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", None) or error
            parser.error(f"the 'old' implementation is em_routing at git revision {baseline}, which "
                         f"could not be read ({str(detail).strip()}): run from a git clone with that "
                         f"history, name another revision with --baseline, or leave old out of --impls")
    dtype = getattr(torch, args.dtype)
    batch = args.batch_size
    print(f"torch {torch.__version__}, device {args.device}, dtype {args.dtype}, threads "
          f"{torch.get_num_threads()}, batch {batch}, {'quick case' if args.quick else 'ConvCaps1 config'}")
    agreement = check_agreement(args.device, baseline, tuple(impls))
    print(f"agreement with the naive loop{f' (and the old em_routing, {baseline})' if baseline else ''}"
          f" (float64, tiny): max |diff| {agreement:.2e}")
    if not agreement <= AGREEMENT_TOLERANCE:  # NaN fails too
        print(f"error: the implementations disagree with the naive loop by {agreement:.2e} "
              f"(> {AGREEMENT_TOLERANCE:g}): their timings would compare different functions",
              file=sys.stderr)
        return 1

    steps, times = {}, {name: [] for name in impls}
    for name in impls:
        try:
            steps[name] = build(name, batch, args.quick, args.device, dtype, args.baseline)
            steps[name]()  # warm-up (and compilation)
        except Exception as error:
            print(f"{name}: skipped ({type(error).__name__}: {str(error)[:120]})")
            steps.pop(name, None)
    for _ in range(args.repeats):  # interleaved: every implementation sees the same machine load
        for name, step in steps.items():
            synchronize(args.device)
            start = time.perf_counter()
            step()
            synchronize(args.device)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["old"]) if times.get("old") else None
    print(f"\n{'implementation':<20}{'fwd+bwd ms (median)':>22}{'x old':>11}{'peak MiB':>11}")
    for name in steps:
        median = statistics.median(times[name]) * 1e3
        ratio = f"{base * 1e3 / median:.2f}{'*' if name == 'kernel-joint' else ''}" if base else "-"
        memory = (peak_memory_mib(name, batch, args.quick, args.device, dtype, args.baseline)
                  if measure_memory else "-")
        memory = f"{memory:.0f}" if isinstance(memory, float) else str(memory)[:60]
        print(f"{name:<20}{median:>22.1f}{ratio:>11}{memory:>11}", flush=True)
    if base and "kernel-joint" in steps:
        print("* kernel-joint normalises jointly over every parent (the paper's form), old and naive per "
              "patch: that ratio compares the two layers, not two implementations of one function")
    return 0


if __name__ == "__main__":
    sys.exit(main())
