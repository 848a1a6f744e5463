"""Issue 22, decode end to end: the Python cost of building one decode step's graph on the
CUDA path, measured on a CPU-only machine.

On the H200 a decode step is host time: the graph's Python (build) and MLX's encoding of
it (eval) run one after the other on the calling thread, and the GPU waits on them. The
build is what this project's caches add over mlx-lm's KVCache. This probe measures it where
no GPU is: `kernels.attention.cuda_available` reports True and `mx.fast.cuda_kernel` hands
back stand-ins whose calls return fresh zero arrays of the kernel's output shapes (one graph
node each, as a real kernel call is), so the dispatch, the launch plans, the pool writes and
the quantize-on-write run exactly as on the device; only MLX's own cost of a kernel call
(about 11 us on the H200 host, docs/kernels.md run 5) is not in it. The stand-ins' outputs
are zeros: nothing here is a numerical result.

The model is the 8B-shaped Llama's attention geometry (32 layers, 32 query and 8 KV heads
of 128) with every other dimension cut to 256, so the model's own Python is that of the 8B
model while its matmuls stay small. Each of `--rounds` rounds builds one step of every arm
in turn; medians per arm, and each arm's ratio to KVCache's step of the same round (this
VM's speed shifts by 2-4x within seconds, so only neighbouring steps compare).

  python tools/bench/profile/issue22_build_cpu.py [--context 256] [--rounds 60] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

import engine.models as engine_models  # noqa: E402
import kernels.attention as kernel_attention  # noqa: E402
import kernels.prefill as kernel_prefill  # noqa: E402
import kernels.quantize as kernel_quantize  # noqa: E402
from engine import installed  # noqa: E402
from tools.bench import engine as bench_engine  # noqa: E402


class _StandInKernel:
    """What mx.fast.cuda_kernel returns, without CUDA: a call gives zeros of its outputs."""

    def __init__(self, **_):
        pass

    def __call__(self, *, inputs, output_shapes, output_dtypes, **_):
        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]


def stand_in_cuda() -> None:
    """The dispatch of a CUDA device: attention, quantize-on-write and prefill take their
    CUDA kernels, and native pages the direct kernel rather than the CPU's reference."""
    for module in (kernel_attention, kernel_quantize, kernel_prefill):
        module.cuda_available = lambda: True
    engine_models.default_attention_impl = lambda pool: None
    mx.fast.cuda_kernel = _StandInKernel


def build_model() -> llama.Model:
    args = llama.ModelArgs.from_dict(dict(
        model_type="llama", num_hidden_layers=32, hidden_size=256, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=256, vocab_size=256,
        rms_norm_eps=1e-5, rope_theta=5e5, max_position_embeddings=131072, tie_word_embeddings=False))
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def arms(model) -> dict:
    """tools/bench/engine.py's arms this probe compares: KVCache, paged native and k4v4."""
    every = bench_engine.arms(model, block_size=128)
    return {name: every[name] for name in ("mlx-lm KVCache", "paged native", "paged k4v4")}


def filled(model, factory, context: int):
    cache = factory()
    prompt = mx.zeros((1, context), dtype=mx.int32)
    for start in range(0, context, 2048):
        mx.eval(model(prompt[:, start:start + 2048], cache=cache), [c.state for c in cache])
    return cache


def builds(model, cache, steps: int, profiler: cProfile.Profile | None = None) -> list[float]:
    """Each step's build time; Python's collector runs before each step, not inside it."""
    token = mx.zeros((1, 1), dtype=mx.int32)
    times = []
    for _ in range(steps):
        gc.collect()
        began = time.perf_counter()
        if profiler:
            profiler.enable()
        logits = model(token, cache=cache)
        if profiler:
            profiler.disable()
        times.append(time.perf_counter() - began)
        mx.eval(logits)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=10, help="steps of each --profile")
    parser.add_argument("--profile", action="store_true", help="cProfile each arm's builds")
    args = parser.parse_args()
    stand_in_cuda()
    model = build_model()
    with installed(model):
        factories = arms(model)
        caches = {name: filled(model, f, args.context) for name, f in factories.items()}
        for cache in caches.values():
            builds(model, cache, 3)  # plans, compiled encoders, first-step checks
        # one step of each arm per round, arms in turn: this VM's speed shifts by 2-4x within
        # seconds (the same Python, even its thread CPU time), so only steps taken next to each
        # other compare; the collector runs between steps, not inside them
        times = {name: [] for name in caches}
        gc.disable()
        try:
            for _ in range(args.rounds):
                for name, cache in caches.items():
                    times[name].extend(builds(model, cache, 1))
        finally:
            gc.enable()
        base = times["mlx-lm KVCache"]
        print(f"decode-step build, {args.context}-token context, {args.rounds} rounds of one "
              f"step per arm (stand-in CUDA kernels), medians")
        print("| arm | build ms | x KVCache's time, within rounds | quartiles of that ratio |")
        print("|---|---:|---:|---|")
        for name, values in times.items():
            ratios = sorted(v / b for v, b in zip(values, base, strict=True))
            quartiles = statistics.quantiles(ratios, n=4)
            print(f"| {name} | {statistics.median(values) * 1e3:.3f} | {statistics.median(ratios):.2f}x | "
                  f"{quartiles[0]:.2f} - {quartiles[2]:.2f} |")
        if args.profile:
            for name, cache in caches.items():
                profiler = cProfile.Profile()
                builds(model, cache, args.steps, profiler)
                stats = pstats.Stats(profiler).stats
                calls = sum(entry[1] for entry in stats.values()) / args.steps
                print(f"\n{name}: {calls:.0f} function calls per step (deterministic, unlike "
                      f"the times here); own ms per step, top 16")
                top = sorted(stats.items(), key=lambda item: -item[1][2])[:16]
                for (path, line, func), (_, calls, own, _, _) in top:
                    where = f"{Path(path).name}:{line}({func})" if path != "~" else func
                    print(f"  {own * 1e3 / args.steps:7.3f}  {calls / args.steps:6.1f}  {where}")


if __name__ == "__main__":
    main()
