"""Run on the H200: kernel variants side by side with dense SDPA, timed as tools/bench/attention.py
times them (interleaved rounds, each sample a chain of calls filling ~10 ms, each call's output
the next call's queries; "vs dense" is the median of within-round ratios), with each variant's
relative error against exact float32 attention over the same K/V.

Decode, 32 query heads, 8 KV heads, head dim 128, batch 1, block size 16 (--block-size), bf16,
as the benchmark. Variants are DirectTuning values (kernels/tuning.py) passed to paged_attention.

From the repository root, with PYTHONPATH=$PWD:
  python3 tools/bench/profile/h200_variants.py [--contexts 32768,131072] [--repeats 7]
      [--formats native,k4v4] [--block-size 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx

from kernels.attention import paged_attention
from kernels.tuning import DirectTuning
from tools.bench.attention import (
    FORMATS,
    HEAD_DIM,
    N_KV_HEADS,
    N_Q_HEADS,
    build_pages,
    timed_rounds,
)

BASE = DirectTuning()
VARIANTS = {
    "native": {
        "lane (shipped)": BASE,
        "lane 2,4,264,8": replace(BASE, dims_per_lane=8),
        "lane 4,4,264,8": replace(BASE, unroll=4, dims_per_lane=8),
        "lane 2,8,264,8": replace(BASE, num_warps=8, dims_per_lane=8),
        "mma 4w 3st 264": replace(BASE, native_mma=True),
        "mma 4w 2st 396": replace(BASE, native_mma=True, native_stages=2, native_target_blocks=396),
        "mma 8w 2st 132": replace(BASE, native_mma=True, native_warps=8, native_stages=2, native_target_blocks=132),
        "mma 6w 2st 264": replace(BASE, native_mma=True, native_warps=6, native_stages=2),
        "mma 4w 4st 132": replace(BASE, native_mma=True, native_stages=4, native_target_blocks=132),
    },
    "k4v4": {
        "mma 6w (shipped)": BASE,
        "mma 8w lb2": replace(BASE, mma_warps=8, mma_min_blocks=2),
        "mma 8w 3st lb2": replace(BASE, mma_warps=8, mma_stages=3, mma_min_blocks=2),
        "mma 4w lb4 528": replace(BASE, mma_warps=4, mma_min_blocks=4, mma_target_blocks=528),
    },
}


def bench(tokens: int, fmt: str, repeats: int, rows: list, block_size: int = 16) -> None:
    scale = HEAD_DIM**-0.5
    mx.random.seed(tokens)
    keys = mx.random.normal((1, N_KV_HEADS, tokens, HEAD_DIM)).astype(mx.bfloat16)
    values = mx.random.normal((1, N_KV_HEADS, tokens, HEAD_DIM)).astype(mx.bfloat16)
    queries = mx.random.normal((1, N_Q_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
    mx.eval(keys, values, queries)
    exact = mx.fast.scaled_dot_product_attention(
        queries.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32), scale=scale)
    layout = FORMATS[fmt]
    planes, tables = build_pages(keys, values, layout, block_size, seed=tokens)
    fns = {"dense": lambda q: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)}
    for name, tuning in VARIANTS[fmt].items():
        fns[name] = lambda q, tuning=tuning: paged_attention(q, planes, tables, [tokens], layout, scale=scale,
                                                              impl="cuda", tuning=tuning)
    errors = {}
    for name, fn in list(fns.items()):
        try:  # a variant that does not compile or launch is reported and left out
            out = fn(queries).astype(mx.float32)
            diff = out - exact
            errors[name] = (mx.sqrt((diff * diff).sum()) / mx.sqrt((exact * exact).sum())).item()
        except Exception as error:  # noqa: BLE001
            print(f"| {tokens} | {fmt} | {name} | failed: {type(error).__name__}: {str(error)[:300]} |", flush=True)
            del fns[name]
    samples, calls = timed_rounds(fns, repeats, 10, 0.01, chain_from=queries)
    dense = statistics.median(t for t, _ in samples["dense"]) * 1e6
    for name in fns:
        us = statistics.median(t for t, _ in samples[name]) * 1e6
        ratio = statistics.median(d[0] / m[0] for d, m in zip(samples["dense"], samples[name], strict=True))
        spread = (min(t for t, _ in samples[name]) * 1e6, max(t for t, _ in samples[name]) * 1e6)
        rows.append(dict(context=tokens, format=fmt, block_size=block_size, variant=name, us=us, vs_dense=ratio, dense_us=dense,
                         min_us=spread[0], max_us=spread[1], calls=calls[name], rel_err=errors[name]))
        print(f"| {tokens} | {fmt} | {name} | {us:.1f} | {ratio:.2f}x | {spread[0]:.1f}-{spread[1]:.1f} | "
              f"{calls[name]} | {errors[name]:.1e} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--formats", default="native,k4v4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per page block (the benchmark's 16)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    print(f"device {mx.default_device()}")
    print("| context | format | variant | eval us | vs dense | min-max us | calls/sample | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    rows: list = []
    for tokens in (int(x) for x in args.contexts.split(",")):
        for fmt in args.formats.split(","):
            bench(tokens, fmt, args.repeats, rows, args.block_size)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
