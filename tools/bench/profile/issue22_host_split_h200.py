"""Issue 22, decode on the H200: where a decode step's graph building goes, per piece, on the
real host, without cProfile (whose per-call overhead inflates every Python function alike).

Each piece below is wrapped in a timer that adds its inclusive wall time (perf_counter around
the call, about 0.3 us of overhead each); the model's own Linear calls too. The arms (mlx-lm
KVCache, paged native, paged k4v4 on the 8B-shaped Llama) take turns, `--rounds` rounds of
`--steps` decode steps each, first without the timers (the plain build time), then with them.
Per arm it prints the median ms per step of the plain build and eval, then each piece's
inclusive ms per step and calls per step. Pieces nest (the kernel calls are inside
run_split_merge, inside cuda.launch, inside kernels.attention.attend, inside
engine.attention.attend): read each as "this and what it calls".
    python tools/bench/profile/issue22_host_split_h200.py [--size llama-8b --contexts 8192,32768]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

import engine.attention as engine_attention  # noqa: E402
import engine.cache as engine_cache  # noqa: E402
import kernels.attention as kernel_attention  # noqa: E402
import kernels.cuda as kernel_cuda  # noqa: E402
import kernels.direct as kernel_direct  # noqa: E402
from engine import installed  # noqa: E402
from engine.pool import BlockPool  # noqa: E402
from tools.bench import engine as bench  # noqa: E402

ORDER: list[str] = []  # the pieces as wrapped: the order they print in
TOTALS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
ON = [False]


def timed(name: str, function):
    ORDER.append(name)
    def wrapper(*args, **kwargs):
        if not ON[0]:
            return function(*args, **kwargs)
        began = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - began
            CALLS[name] += 1
    wrapper.__wrapped__ = function
    return wrapper


def wrap(owner, attribute: str, name: str) -> None:
    setattr(owner, attribute, timed(name, getattr(owner, attribute)))


def wrap_pieces(model) -> None:
    module = sys.modules[type(model.layers[0].self_attn).__module__]
    wrap(module, "scaled_dot_product_attention", "sdpa as the model calls it (router; KVCache: mx.fast SDPA)")
    wrap(nn.Linear, "__call__", "model: nn.Linear calls")
    wrap(KVCache, "update_and_fetch", "KVCache.update_and_fetch")
    wrap(engine_cache.PagedKVCache, "update_and_fetch", "PagedKVCache.update_and_fetch")
    wrap(engine_cache, "encode_tokens", "  encode_tokens (k4v4: quantize kernel)")
    wrap(BlockPool, "write", "  BlockPool.write (slice updates)")
    wrap(engine_attention, "attend", "engine.attention.attend")
    wrap(engine_attention, "paged_attention", "  kernels paged_attention (call object + attend)")
    wrap(kernel_attention, "attend", "    kernels.attention.attend")
    wrap(kernel_attention, "_route", "      _route (signature, key, lookup)")
    wrap(kernel_attention, "with_call_inputs", "      with_call_inputs")
    wrap(kernel_cuda, "launch", "      cuda.launch")
    wrap(kernel_cuda, "run_split_merge", "        run_split_merge")


def wrap_kernel_objects() -> None:
    """The compiled kernel objects of every cached plan (made by the warm-up steps)."""
    for plan in kernel_direct._PLANS.values():
        kernels = plan.kernels
        for role in ("split", "merge"):
            if role in kernels and not hasattr(kernels[role], "__wrapped__"):
                kernels[role] = timed(f"          mx.fast.cuda_kernel call: {role}", kernels[role])


def steps(model, cache, token, count: int) -> tuple[list, list, mx.array]:
    builds, evals = [], []
    for _ in range(count):
        began = time.perf_counter()
        logits = model(token[None, None], cache=cache)
        built = time.perf_counter()
        token = logits[0, -1].argmax()
        mx.eval(token)
        builds.append(built - began)
        evals.append(time.perf_counter() - built)
    return builds, evals, token


def measure(model, factories: dict, context: int, rounds: int, count: int, vocab: int) -> dict:
    """The plain and the timed steps of every arm at one context; prints and returns them."""
    prompt = mx.random.randint(0, vocab, (context,), dtype=mx.int32)
    state = {}
    for name, factory in factories.items():
        cache = factory()
        token = bench.prefill(model, cache, prompt, 2048).argmax()
        _, _, token = steps(model, cache, token, 3)  # plans, kernels, first-step checks
        state[name] = [cache, token]
    if not ORDER:
        wrap_pieces(model)
    wrap_kernel_objects()
    plain = {name: ([], []) for name in state}
    pieces = {name: defaultdict(list) for name in state}
    counts = {name: {} for name in state}
    for _ in range(rounds):
        for name, entry in state.items():
            builds, evals, entry[1] = steps(model, entry[0], entry[1], count)
            plain[name][0].extend(builds)
            plain[name][1].extend(evals)
            ON[0] = True
            try:
                for _ in range(count):
                    TOTALS.clear()
                    CALLS.clear()
                    _, _, entry[1] = steps(model, entry[0], entry[1], 1)
                    for piece, seconds in TOTALS.items():
                        pieces[name][piece].append(seconds)
                    counts[name] = dict(CALLS)
            finally:
                ON[0] = False
    out = {}
    for name in state:
        build, run = (statistics.median(v) * 1e3 for v in plain[name])
        print(f"\n{name}, {context} tokens: plain build {build:.2f} ms, eval {run:.2f} ms per step "
              f"(medians of {len(plain[name][0])} steps); timed pieces, inclusive ms per step "
              f"(median), calls per step:")
        rows = {}
        for piece in ORDER:
            if piece in pieces[name]:
                rows[piece] = {"ms": statistics.median(pieces[name][piece]) * 1e3,
                               "calls": counts[name].get(piece, 0)}
                print(f"  {rows[piece]['ms']:7.3f}  {rows[piece]['calls']:4d}  {piece}")
        out[name] = {"build_ms": build, "eval_ms": run, "pieces": rows}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="llama-8b")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    model, _ = bench.build_model(args.size, mx.bfloat16)
    contexts = [int(c) for c in args.contexts.split(",")]
    report = {"size": args.size, "rounds": args.rounds, "steps": args.steps, "contexts": {}}
    with installed(model):
        factories = {name: f for name, f in bench.arms(model, block_size=128).items()
                     if name in ("mlx-lm KVCache", "paged native", "paged k4v4")}
        for context in contexts:
            report["contexts"][context] = measure(model, factories, context, args.rounds, args.steps,
                                                  bench.SIZES[args.size]["vocab_size"])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
