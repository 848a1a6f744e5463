"""Run on a GPU: prefill TTFT with a chunk's whole blocks written by slice updates
against the scatter they replaced (issue 22).

A prefill chunk writes its whole blocks with BlockPool.write_blocks. It used to scatter
them (one `planes[ids] = values` per plane: two for native pages, six for k4v4); it now
writes one slice update per run of consecutive block ids (engine/pool.py _write_runs),
and a chunk's fresh blocks are one run. engine.pool.MAX_SLICE_RUNS = -1 brings the
scatter back, so both ways run in one process: the arms take turns in every round
(tools/bench/engine.py interleaved_prefill: each arm prefills the whole prompt into a fresh
cache in chunks of --prefill-step, through the first token's argmax), and each arm's TTFT
is given against mlx-lm's KVCache of the same round. From the repository root:

  PYTHONPATH=$PWD python3 tools/bench/profile/issue22_chunk_writes.py --size llama-8b \
      --contexts 8192 --rounds 7 [--json F]

--quick: the tiny model at 512 tokens, a smoke run on any machine (its figures mean
nothing). --writes: only BlockPool.write_blocks itself, one 8B-shaped layer's chunk of
--prefill-step tokens (8 KV heads of 128) into a 64-block pool, both ways, evaluated
each time; medians of --rounds (runs on the CPU in seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

import engine.pool
from engine import BlockPool, KVPolicy, PageSpec, make_cache
from engine.formats import FORMATS
from tools.bench.engine import BASELINE, SIZES, arms, build_model, interleaved_prefill


def factories(model, block_size: int, formats: list[str]) -> dict:
    """KVCache and, per format, the paged arm with slice-update writes and with scatters."""
    out = {BASELINE: arms(model, block_size)[BASELINE]}
    for fmt in formats:
        policy = KVPolicy(default_format=fmt, block_size_tokens=block_size)
        for label, runs in (("slice updates", 4), ("scatter", -1)):
            def make(policy=policy, runs=runs):
                engine.pool.MAX_SLICE_RUNS = runs  # in force until the next arm's factory
                return make_cache(model, policy)
            out[f"paged {fmt}, {label}"] = make
    return out


def writes(formats: list[str], tokens: int, block_size: int, rounds: int) -> dict:
    """Median ms of one write_blocks of `tokens` tokens (whole blocks), slice updates
    against the scatter, per format."""
    out = {}
    for fmt in formats:
        name = "native-bf16" if fmt == "native" else fmt
        spec = PageSpec(FORMATS[name], 8, 128, 128, block_size, 64 if fmt == "native" else 128)
        pool = BlockPool(spec, 64)
        blocks = pool.allocate(tokens // block_size)
        values = {n: mx.random.randint(0, 100, (len(blocks), *p.shape[1:])).astype(p.dtype)
                  for n, p in pool.planes.items()}
        mx.eval(values)
        times: dict[str, list[float]] = {"slice updates": [], "scatter": []}
        for r in range(rounds + 2):  # two warm-up rounds
            for label, runs in (("slice updates", 4), ("scatter", -1)):
                engine.pool.MAX_SLICE_RUNS = runs
                began = time.perf_counter()
                pool.write_blocks(blocks, values)
                mx.eval(pool.planes)
                if r >= 2:
                    times[label].append((time.perf_counter() - began) * 1e3)
        out[fmt] = {label: round(statistics.median(t), 3) for label, t in times.items()}
        print(f"write_blocks {fmt:>6}, {len(blocks)} blocks: " + ", ".join(
            f"{label} {ms:.3f} ms" for label, ms in out[fmt].items()), file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="llama-8b")
    parser.add_argument("--contexts", default="8192")
    parser.add_argument("--formats", nargs="+", default=["native", "k4v4"])
    parser.add_argument("--prefill-step", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="tiny model, 512 tokens (a smoke run)")
    parser.add_argument("--writes", action="store_true", help="only write_blocks, one layer's chunk")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    default = engine.pool.MAX_SLICE_RUNS  # the arms set it; put back whatever happens
    try:
        out = run(args)
    finally:
        engine.pool.MAX_SLICE_RUNS = default
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def run(args: argparse.Namespace) -> dict:
    print(f"device {mx.default_device()}, mlx {mx.__version__}", file=sys.stderr)
    if args.writes:
        return {"device": str(mx.default_device()),
                "writes": writes(args.formats, args.prefill_step, args.block_size, args.rounds)}
    size, contexts = ("quick", [512]) if args.quick else (args.size, [int(c) for c in args.contexts.split(",")])
    step = 128 if args.quick else args.prefill_step
    model, _ = build_model(size, mx.bfloat16)
    out: dict = {"size": size, "prefill_step": step, "block_size": args.block_size}
    for context in contexts:
        prompt = mx.random.randint(0, SIZES[size]["vocab_size"], (context,), key=mx.random.key(context))
        result = interleaved_prefill(model, factories(model, args.block_size, args.formats), prompt,
                                     args.rounds, step)
        out[str(context)] = result
        for name, row in result.items():
            if isinstance(row, dict) and "ttft_ms" in row:
                print(f"{context:>6} {name:<28} TTFT {row['ttft_ms']:9.1f} ms, "
                      f"KVCache's / this {row['x_kvcache_within_rounds']:.3f} "
                      f"(rounds {row['rounds_ms']})", file=sys.stderr)
            elif isinstance(row, dict):
                print(f"{context:>6} {name:<28} {row}", file=sys.stderr)
    return out

if __name__ == "__main__":
    raise SystemExit(main())
