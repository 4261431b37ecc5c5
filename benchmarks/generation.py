"""Benchmark: greedy generation from ``transformer-lm`` with and without the key/value cache.

One small language model (default: 4 layers, 4 heads, 128 features, a context of 1024 so that
512 new tokens fit), one random prompt, greedy decoding (``temperature=0``) of ``--new-tokens``
tokens with ``generate(use_cache=True)`` and ``generate(use_cache=False)``, in this one process.
After a warm-up call each, the two run in turn (interleaved) ``--repeats`` times; the median time
gives tokens per second (batch x new tokens / seconds). The two outputs are checked to be the
same tokens.

Run: ``python benchmarks/generation.py`` (512 new tokens, about a minute on 2 CPU cores) or
``--quick`` (a tiny model, 64 new tokens, seconds; options given beside it are kept). The script
exits with status 1 if the two outputs differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from _common import (
    add_batch_size_argument,
    add_device_argument,
    benchmark_parser,
    chosen_device,
    parse_with_quick,
    positive_int,
    synchronize,
)
from torchvote.models import create_model


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (``main`` parses ``argv`` with it)."""
    parser = benchmark_parser(__file__, __doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny model (d_model 32, 2 heads, 2 layers), 64 new tokens (options given "
                             "beside it are kept)")
    parser.add_argument("--new-tokens", type=positive_int, default=512, help="tokens generated per call")
    parser.add_argument("--prompt-length", type=positive_int, default=16, help="tokens of the random prompt")
    add_batch_size_argument(parser, ("--batch",), several=False, default=1, help="prompts generated at once")
    parser.add_argument("--d-model", type=positive_int, default=128, help="the model's width")
    parser.add_argument("--num-heads", type=positive_int, default=4, help="attention heads")
    parser.add_argument("--num-layers", type=positive_int, default=4, help="transformer blocks")
    parser.add_argument("--attention", choices=["softmax", "routing"], default="softmax",
                        help="the model's attention layer")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed calls of each (interleaved)")
    add_device_argument(parser)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="cast: the model is cast to it (no autocast)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse_with_quick(parser, argv, new_tokens=64, d_model=32, num_heads=2, num_layers=2)
    device = chosen_device(parser, args.device)
    args.device = str(device)  # cuda:1 stays cuda:1
    if args.d_model % args.num_heads:
        parser.error(f"--d-model {args.d_model} must be divisible by --num-heads {args.num_heads}")
    context = args.prompt_length + args.new_tokens

    torch.manual_seed(0)
    model = create_model(
        "transformer-lm", "small", context_length=context, d_model=args.d_model,
        num_heads=args.num_heads, num_layers=args.num_layers, dropout=0.0, attention=args.attention,
    ).to(args.device, getattr(torch, args.dtype)).eval()
    prompt = torch.randint(model.config.vocab_size, (args.batch_size, args.prompt_length),
                           generator=torch.Generator().manual_seed(1)).to(args.device)

    def run(use_cache: bool) -> torch.Tensor:
        tokens = model.generate(prompt, args.new_tokens, temperature=0.0, use_cache=use_cache)
        synchronize(args.device)
        return tokens

    outputs = {use_cache: run(use_cache) for use_cache in (True, False)}  # warm-up
    same = torch.equal(outputs[True], outputs[False])
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for use_cache in (True, False):
            start = time.perf_counter()
            run(use_cache)
            times[use_cache].append(time.perf_counter() - start)
    rate = {c: args.batch_size * args.new_tokens / statistics.median(t) for c, t in times.items()}

    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"cpu, {torch.get_num_threads()} threads")
    print(f"torch {torch.__version__}, {where}, {args.dtype}; transformer-lm {args.num_layers} layers, "
          f"{args.num_heads} heads, d_model {args.d_model}, {args.attention} attention; batch "
          f"{args.batch_size}, prompt {args.prompt_length}, {args.new_tokens} new tokens, greedy; median "
          f"of {args.repeats} interleaved repeats")
    print(f"{'use_cache':>9} | {'seconds':>8} | {'tokens/s':>9}")
    for use_cache in (True, False):
        print(f"{str(use_cache):>9} | {statistics.median(times[use_cache]):>8.3f} | "
              f"{rate[use_cache]:>9.1f}")
    print(f"speed-up (cached / uncached tokens per second): {rate[True] / rate[False]:.2f}x; "
          f"same tokens: {same}")
    if not same:  # the two timed different computations: a cache bug, and no speed-up to quote
        print("error: generate(use_cache=True) gave other tokens than use_cache=False", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
