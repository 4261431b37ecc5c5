"""Benchmark: torchvote's MultiHeadAttention vs raw SDPA with the same projections vs torch's MHA.

Three implementations of one multi-head self-attention layer (embed 512, 8 heads of 64), sharing
the same weights:

- ``ours``: ``torchvote.nn.MultiHeadAttention``, causal given as ``is_causal=True``;
- ``sdpa``: the fewest lines that do the job: a packed qkv ``Linear``,
  ``F.scaled_dot_product_attention`` and the output ``Linear`` (the bar ours must meet);
- ``mha``: ``torch.nn.MultiheadAttention(need_weights=False)``, given the causal mask as
  ``attn_mask`` (``nn.Transformer.generate_square_subsequent_mask``), as its users pass it.

Modes: ``infer`` (eval mode under ``torch.inference_mode``) and ``train`` (forward + backward of
``output.sum()`` to the input and the parameters, train mode, dropout 0).

Time: all in this one process; after one warm-up call each, the three implementations are run in
turn (interleaved) ``--repeats`` times and the median is reported.

Memory: the peak resident-set growth during one call, measured in a fresh process per
(configuration, implementation) started with multiprocessing's ``spawn``: after the module and
inputs are built, ``/proc/self/clear_refs`` resets the kernel's high-water mark (``VmHWM``), one
call runs, and ``VmHWM - VmRSS_before`` is reported (a warm-up call on 8 tokens first takes
the one-time costs: lazy imports, kernel initialisation). This sees every allocation torch makes
(tracemalloc would not). It needs Linux's ``/proc/self/clear_refs``; elsewhere the script stops
and asks for ``--no-memory``. The child's address space is capped at ~``--mha-limit-gb`` above
its baseline, so an ``nn.MultiheadAttention`` that needs more fails cleanly in the child (reported
as skipped, and not timed) instead of driving the machine out of memory; any other failure of a
child stops the run with the child's error.

``--weights`` asks ``ours`` and ``mha`` for the head-averaged attention weights
(``need_weights=True``): what a user pays to see the votes. ``--device cuda`` runs everything on
the GPU (time with ``torch.cuda.synchronize``; memory = ``torch.cuda.max_memory_allocated``
growth during one call, in this process); ``--dtype bfloat16`` casts modules and inputs.

Run: ``python benchmarks/attention.py`` (full; ~20-40 min on 2 CPU cores) or ``--quick`` (tiny
smoke run without the memory column, seconds).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import resource
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from _common import (
    add_batch_size_argument,
    add_device_argument,
    benchmark_parser,
    can_reset_peak_rss,
    chosen_device,
    error_line,
    parse_with_quick,
    peak_rss_growth_mib,
    positive_float,
    positive_int,
    status_kib,
    synchronize,
)
from torchvote.nn import MultiHeadAttention

IMPLEMENTATIONS = ("ours", "sdpa", "mha")


class RawSDPA(nn.Module):
    """Packed qkv projection, F.scaled_dot_product_attention, output projection; nothing else."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.out = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor, is_causal: bool) -> Tensor:
        batch, length, embed_dim = x.shape
        q, k, v = self.qkv(x).split(embed_dim, dim=2)
        q, k, v = (t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (b, h, T, d)
        return self.out(y.transpose(1, 2).reshape(batch, length, embed_dim))


@dataclass(frozen=True)
class Config:
    batch: int
    length: int
    causal: bool
    mode: str  # "infer" or "train"
    weights: bool = False  # ours and mha return the head-averaged weights
    device: str = "cpu"
    dtype: str = "float32"


def build(impl: str, config: Config, embed_dim: int, num_heads: int, seed: int = 0):
    """The module and a zero-argument callable running one measured call (same weights for all)."""
    torch.manual_seed(seed)
    reference = nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)
    if impl == "mha":
        module: nn.Module = reference
    elif impl == "ours":
        module = MultiHeadAttention.from_torch(reference)
    else:
        module = RawSDPA(embed_dim, num_heads)
        with torch.no_grad():
            module.qkv.weight.copy_(reference.in_proj_weight)
            module.qkv.bias.copy_(reference.in_proj_bias)
            module.out.load_state_dict(reference.out_proj.state_dict())
    dtype = getattr(torch, config.dtype)
    module.to(device=config.device, dtype=dtype).train(config.mode == "train")
    x = torch.randn(config.batch, config.length, embed_dim,
                    generator=torch.Generator().manual_seed(1)).to(config.device, dtype)
    mask = (nn.Transformer.generate_square_subsequent_mask(config.length, device=config.device,
                                                           dtype=dtype)
            if config.causal and impl == "mha" else None)

    def forward(inputs: Tensor) -> Tensor:
        if impl == "mha":
            out, weights = module(inputs, inputs, inputs, attn_mask=mask, need_weights=config.weights)
        elif impl == "ours":
            out, weights = module(inputs, is_causal=config.causal, need_weights=config.weights)
        else:
            return module(inputs, config.causal)
        return out if weights is None else out + 0 * weights.sum()  # the weights are used

    if config.mode == "infer":
        def call() -> None:
            with torch.inference_mode():
                forward(x)
    else:
        x.requires_grad_(True)

        def call() -> None:
            forward(x).sum().backward()
            # freed here, not at the next call's start: a memory reading after a warm-up call
            # would otherwise count the gradients as held before the measured call
            x.grad = None
            module.zero_grad(set_to_none=True)

    return module, call


def cuda_peak_memory_mb(impl: str, config: Config, embed_dim: int, num_heads: int) -> float:
    """Growth of ``torch.cuda.max_memory_allocated`` during one call, in this process."""
    _, call = build(impl, config, embed_dim, num_heads)
    call()  # warm-up: workspace and autograd buffers
    torch.cuda.synchronize(config.device)
    torch.cuda.reset_peak_memory_stats(config.device)
    before = torch.cuda.memory_allocated(config.device)
    call()
    torch.cuda.synchronize(config.device)
    return (torch.cuda.max_memory_allocated(config.device) - before) / 2**20


def _memory_child(impl: str, config: Config, embed_dim: int, num_heads: int,
                  limit_gb: float | None, queue) -> None:
    try:
        # One-time costs are not the call's: lazy imports (einops' first torch call imports
        # torch._dynamo, ~40 MB) and kernel initialisation happen in a warm-up on 8 tokens.
        warm = Config(config.batch, 8, config.causal, config.mode, config.weights, config.device,
                      config.dtype)
        build(impl, warm, embed_dim, num_heads)[1]()
        _, call = build(impl, config, embed_dim, num_heads)
        if limit_gb is not None:
            limit = status_kib("VmSize") * 1024 + int(limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        queue.put(("ok", peak_rss_growth_mib(call)))
    except Exception as error:
        # Under the address-space cap torch's CPU allocator raises "can't allocate memory" (a
        # RuntimeError); any other failure is a failure, never "needs more memory".
        out_of_memory = isinstance(error, MemoryError) or (
            isinstance(error, RuntimeError) and "allocate" in str(error))
        queue.put(("oom" if out_of_memory else "error", error_line(error)))


def peak_memory_mb(impl: str, config: Config, embed_dim: int, num_heads: int,
                   limit_gb: float | None) -> tuple[str, float | str]:
    """("ok", peak RSS growth in MB), ("oom", message) when the child ran out of the memory it
    was allowed, or ("error", message) when it failed otherwise; from a fresh spawned process."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_memory_child,
                              args=(impl, config, embed_dim, num_heads, limit_gb, queue))
    process.start()
    process.join()
    if queue.empty():  # killed, or crashed before it could report
        if process.exitcode == -signal.SIGKILL:  # the kernel's OOM killer sends SIGKILL
            return "oom", "killed by SIGKILL (out of memory?)"
        return "error", f"child exited with code {process.exitcode}"
    return queue.get()


def time_interleaved(calls: dict[str, Callable[[], None]], repeats: int,
                     device: str = "cpu") -> dict[str, float]:
    """Median seconds per call; the implementations take turns so drift hits all alike."""
    for call in calls.values():
        call()  # warm-up
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.1f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (``main`` parses ``argv`` with it)."""
    parser = benchmark_parser(__file__, __doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny smoke run: batch 1, T 128, embed 64, 4 heads, 3 repeats, no memory "
                             "(options given beside it are kept)")
    add_batch_size_argument(parser, ("--batches", "--batch"), several=True, default=[1, 8],
                            help="batch sizes timed")
    parser.add_argument("--lengths", type=positive_int, nargs="+", default=[512, 2048, 8192],
                        help="sequence lengths T timed")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed repeats (interleaved)")
    parser.add_argument("--slow-repeats", type=positive_int, default=3,
                        help="repeats when one call takes more than --slow-seconds")
    parser.add_argument("--slow-seconds", type=positive_float, default=2.0,
                        help="a first call longer than this uses --slow-repeats")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory children")
    parser.add_argument("--mha-limit-gb", type=positive_float, default=12.0,
                        help="memory above which nn.MultiheadAttention is skipped")
    parser.add_argument("--embed-dim", type=positive_int, default=512, help="features (embed_dim)")
    parser.add_argument("--num-heads", type=positive_int, default=8, help="attention heads")
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="cast: the modules and inputs are cast to it (no autocast)")
    parser.add_argument("--weights", action="store_true",
                        help="ours and nn.MultiheadAttention return the head-averaged weights")
    parser.add_argument("--modes", nargs="+", choices=["infer", "train"], default=["infer", "train"],
                        help="infer: forward under inference_mode; train: forward and backward")
    parser.add_argument("--causal", nargs="+", choices=["no", "yes"], default=["no", "yes"],
                        help="without and/or with a causal mask")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    # --quick: seconds, no memory column (its spawned processes took over a minute); options given
    # beside it are kept
    args = parse_with_quick(parser, argv, batch_size=[1], lengths=[128], repeats=3, embed_dim=64, num_heads=4,
                            no_memory=True)
    device = chosen_device(parser, args.device)
    args.device = str(device)  # cuda:1 stays cuda:1
    on_cuda = device.type == "cuda"
    if args.embed_dim % args.num_heads:
        parser.error(f"--embed-dim {args.embed_dim} must be divisible by --num-heads {args.num_heads}")
    if not on_cuda and not args.no_memory and not can_reset_peak_rss():
        parser.error("the CPU memory column needs Linux's /proc/self/clear_refs, which this system "
                     "does not offer: pass --no-memory")

    where = torch.cuda.get_device_name(device) if on_cuda else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {args.device} ({where}), {args.dtype}, weights "
          f"{'requested of ours and mha (sdpa forms none)' if args.weights else 'not requested'}; "
          f"embed {args.embed_dim}, "
          f"{args.num_heads} heads; median of {args.repeats} interleaved repeats "
          f"({args.slow_repeats} when a call exceeds {args.slow_seconds:g} s); memory = "
          + ("torch.cuda.max_memory_allocated growth during one call" if on_cuda else
             "peak RSS growth during one call in a fresh spawned process (VmHWM after clear_refs)"))
    header = (f"{'batch':>5} {'T':>5} {'causal':>6} {'mode':>5} | {'ours ms':>8} {'sdpa ms':>8} "
              f"{'mha ms':>8} | {'ours/sdpa':>9} {'ours/mha':>8} | {'ours MB':>8} {'sdpa MB':>8} "
              f"{'mha MB':>8} {'ours/sdpa':>9} {'ours/mha':>8}")
    print(header)
    print("-" * len(header))
    notes = []
    for batch in args.batch_size:
        for length in args.lengths:
            for causal in (c == "yes" for c in args.causal):
                for mode in args.modes:
                    config = Config(batch, length, causal, mode, args.weights, args.device, args.dtype)
                    memory: dict[str, float | None] = dict.fromkeys(IMPLEMENTATIONS)
                    skip_mha = False
                    if not args.no_memory and on_cuda:
                        for impl in IMPLEMENTATIONS:
                            try:
                                memory[impl] = cuda_peak_memory_mb(impl, config, args.embed_dim,
                                                                   args.num_heads)
                            except torch.OutOfMemoryError:
                                if impl != "mha":
                                    raise
                                skip_mha = True
                                notes.append(f"b={batch} T={length}: nn.MultiheadAttention out of memory")
                            torch.cuda.empty_cache()
                    elif not args.no_memory:
                        for impl in IMPLEMENTATIONS:
                            limit = args.mha_limit_gb if impl == "mha" else None
                            status, value = peak_memory_mb(impl, config, args.embed_dim,
                                                           args.num_heads, limit)
                            if status == "ok":
                                memory[impl] = value
                            elif impl == "mha" and status == "oom":
                                skip_mha = True
                                notes.append(f"b={batch} T={length} causal={causal} {mode}: "
                                             f"nn.MultiheadAttention skipped, needs > "
                                             f"{args.mha_limit_gb:g} GB ({value})")
                            else:
                                raise RuntimeError(f"{impl} failed for {config}: {value}")
                    calls = {}
                    for impl in IMPLEMENTATIONS:
                        if impl == "mha" and skip_mha:
                            continue
                        calls[impl] = build(impl, config, args.embed_dim, args.num_heads)[1]
                    start = time.perf_counter()
                    calls["ours"]()
                    synchronize(args.device)
                    repeats = (args.slow_repeats if time.perf_counter() - start > args.slow_seconds
                               else args.repeats)
                    times: dict[str, float | None] = dict.fromkeys(IMPLEMENTATIONS)
                    times.update(time_interleaved(calls, repeats, args.device))
                    del calls
                    ours, sdpa, mha = times["ours"], times["sdpa"], times["mha"]
                    mem_ratio = (memory["ours"] / memory["sdpa"]
                                 if memory["ours"] is not None and memory["sdpa"] else None)
                    mem_mha = (memory["ours"] / memory["mha"]
                               if memory["ours"] is not None and memory["mha"] else None)
                    print(f"{batch:>5} {length:>5} {str(causal):>6} {mode:>5} | "
                          f"{_fmt_time(ours):>8} {_fmt_time(sdpa):>8} "
                          f"{_fmt_time(mha) if not skip_mha else 'skipped':>8} | "
                          f"{ours / sdpa:>9.3f} {_fmt(ours / mha if mha else None, '.2f'):>8} | "
                          f"{_fmt(memory['ours'], '.0f'):>8} {_fmt(memory['sdpa'], '.0f'):>8} "
                          f"{_fmt(memory['mha'], '.0f') if not skip_mha else 'skipped':>8} "
                          f"{_fmt(mem_ratio, '.2f'):>9} {_fmt(mem_mha, '.2f'):>8}", flush=True)
    for note in notes:
        print("note:", note)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
