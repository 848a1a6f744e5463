"""Engine benchmark: paged KV caches (native, k8v8, k8v4, k4v4) against mlx-lm's KVCache
and QuantizedKVCache, on one random-weight model, in one run.

Usage:
  python -m tools.bench.engine                 # scaled Qwen3-0.6B geometry, 1024-token prompt
  python -m tools.bench.engine --quick         # tiny model, 256-token prompt (about 30 s)
  python -m tools.bench.engine --size 0.6b     # the full ~0.6B model (slow on a CPU)
  python -m tools.bench.engine --prompt 2048 --decode 64 --repeats 3 --json
  python -m tools.bench.engine --size llama-8b --contexts 2048,8192,32768 --out e.json   # a GPU

Per arm and context: TTFT (the prompt in chunks of --prefill-step, evaluated after each
chunk as mlx-lm's generate_step does, through the first token's argmax; prefill tokens/s
is the prompt over it; the chunks' own times are kept), decode tokens/s at that context
(greedy, one token per step, evaluated every step; median over segments of 4), with
--interleaved N also every arm side by side, one step each per round (load from other
processes then falls on all arms alike: the fairer ratio on a shared CPU; and with
--interleaved-prefill N the TTFT with the arms taking turns, N rounds), the same
overlapped as mlx-lm's generate_step runs it (the next step built and launched before this
one's token is read; another --decode tokens), the Python
time to build one decode step's graph (the per-step work outside the kernels: block
tables, dispatch, one call per layer), and KV bytes per token: per token slot of the arrays
the cache holds and the physical bytes it holds at the end over the tokens it holds.
Ratios are against mlx-lm's KVCache measured in the same run. An arm that raises (mlx-lm's
QuantizedKVCache 4-bit decode on MLX 0.32.4 CUDA at 8K and 32K) is reported with its error.

The paged arms attend through engine.install() with make_cache's per-device default: on
the CPU native pages take the "reference" (bit-exact with KVCache) and packed pages the
kernels' dispatch ("partitioned"); on a GPU both take the direct kernels for decode and
the "dequantized" path for prefill chunks (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import engine
from engine import KVPolicy, PagedKVCache, make_cache
from tools.bench.common import machine_line

# Qwen3-0.6B's geometry (28 layers, hidden 1024, 16 query / 8 KV heads of 128, MLP 3072,
# vocab 151936); "scaled" keeps the per-layer attention geometry and cuts layers and vocab
# so the CPU run finishes in minutes; "quick" is a toy.
SIZES = {
    "0.6b": dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936),
    "scaled": dict(num_hidden_layers=4, hidden_size=1024, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=8192),
    "quick": dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128, intermediate_size=512, vocab_size=1024),
    # Llama-3.2-1B's and Llama-3.1-8B's geometry (the 1B and 8B-shaped models)
    "llama-1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256),
    "llama-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256),
}
PAGED_FORMATS = ("native", "k8v8", "k8v4", "k4v4")
BASELINE = "mlx-lm KVCache"
DECODE_SEGMENT = 4


def build_model(size: str, dtype: mx.Dtype):
    family = llama if size.startswith("llama") else qwen3
    config = dict(model_type=family.__name__.rsplit(".", 1)[-1], rms_norm_eps=1e-5 if family is llama else 1e-6,
                  rope_theta=5e5 if family is llama else 1e6, max_position_embeddings=131072,
                  tie_word_embeddings=family is qwen3, **SIZES[size])
    mx.random.seed(0)
    model = family.Model(family.ModelArgs.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return model, params


def arms(model, block_size: int):
    """name -> factory of a fresh cache list."""
    layers = len(model.layers)
    out = {
        "mlx-lm KVCache": lambda: [KVCache() for _ in range(layers)],
        "mlx-lm QuantizedKVCache 8-bit": lambda: [QuantizedKVCache(64, 8) for _ in range(layers)],
        "mlx-lm QuantizedKVCache 4-bit": lambda: [QuantizedKVCache(64, 4) for _ in range(layers)],
    }
    for name in PAGED_FORMATS:
        policy = KVPolicy(default_format=name, block_size_tokens=block_size)
        out[f"paged {name}"] = lambda policy=policy: make_cache(model, policy)
    return out


def slot_nbytes(cache) -> tuple[float, int]:
    """(bytes per token slot, physical bytes held) of one layer's cache."""
    if isinstance(cache, PagedKVCache):
        return cache.spec.page_nbytes(1), cache.nbytes
    arrays = [cache.keys, cache.values]
    flat = [a for x in arrays for a in (x if isinstance(x, (tuple, list)) else [x])]
    capacity = flat[0].shape[-2]
    return sum(a.nbytes for a in flat) / capacity, cache.nbytes


def prefill(model, cache, prompt: mx.array, step: int, chunk_s: list | None = None) -> mx.array:
    for start in range(0, prompt.size, step):
        began = time.perf_counter()
        logits = model(prompt[None, start:start + step], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        if chunk_s is not None:
            chunk_s.append(time.perf_counter() - began)
    return logits[0, -1]


def measure(model, factory, prompt: mx.array, decode: int, step: int, profile_steps: bool = False) -> dict:
    warm = factory()
    token = prefill(model, warm, prompt[:min(prompt.size, 2 * step)], step).argmax()
    for _ in range(2):
        token = model(token[None, None], cache=warm)[0, -1].argmax()
        mx.eval(token)
    del warm

    cache = factory()
    chunk_s: list[float] = []
    start = time.perf_counter()
    token = prefill(model, cache, prompt, step, chunk_s).argmax()
    mx.eval(token)
    prefill_s = time.perf_counter() - start
    # Decode in segments of 4 tokens and keep the median rate: the machine may be shared,
    # and one preempted segment should not move the result.
    rates, builds, evals = [], [], []
    for first in range(0, decode, DECODE_SEGMENT):
        count = min(DECODE_SEGMENT, decode - first)
        start = time.perf_counter()
        for _ in range(count):
            began = time.perf_counter()
            logits = model(token[None, None], cache=cache)
            built = time.perf_counter()
            builds.append(built - began)
            token = logits[0, -1].argmax()
            mx.eval(token)
            evals.append(time.perf_counter() - built)
        rates.append(count / (time.perf_counter() - start))
    profile = build_profile(model, cache, token) if profile_steps else None
    overlapped = overlapped_rate(model, cache, token, decode)
    tokens = prompt.size + 2 * decode + 1 + (PROFILE_STEPS if profile else 0)
    per_slot, held = zip(*(slot_nbytes(c) for c in cache), strict=True)
    return {"ttft_ms": prefill_s * 1e3, "prefill_tok_s": prompt.size / prefill_s,
            "decode_tok_s": statistics.median(rates), "decode_build_ms": statistics.median(builds) * 1e3,
            "decode_eval_ms": statistics.median(evals) * 1e3,
            "decode_overlap_tok_s": overlapped,
            "kv_bytes_per_token": sum(per_slot), "kv_physical_bytes_per_token": sum(held) / tokens,
            "chunk_ms": [round(t * 1e3, 2) for t in chunk_s],
            **({"decode_build_profile": profile} if profile else {})}


PROFILE_STEPS = 8


def build_profile(model, cache, token: mx.array, rows: int = 14) -> list:
    """cProfile of PROFILE_STEPS decode steps' graph building (each evaluated outside the
    profile): the top functions by own time, as [function, own ms per step, calls per step]."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    for _ in range(PROFILE_STEPS):
        profiler.enable()
        logits = model(token[None, None], cache=cache)
        profiler.disable()
        token = logits[0, -1].argmax()
        mx.eval(token)
    stats = pstats.Stats(profiler).stats
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:rows]
    return [[f"{path.rsplit('/', 2)[-1] if '/' in path else path}:{line}({name})",
             round(own * 1e3 / PROFILE_STEPS, 4), round(calls / PROFILE_STEPS, 1)]
            for (path, line, name), (_, calls, own, _, _) in top]


def overlapped_rate(model, cache, token: mx.array, decode: int) -> float:
    """Decode tokens/s as mlx-lm's generate_step runs it: step n+1's graph is built and
    launched (mx.async_eval) before step n's token is read, so Python overlaps the device."""
    y = model(token[None, None], cache=cache)[0, -1].argmax()
    mx.async_eval(y)
    start = time.perf_counter()
    for _ in range(decode):
        next_y = model(y[None, None], cache=cache)[0, -1].argmax()
        mx.async_eval(next_y)
        y.item()
        y = next_y
    y.item()
    return decode / (time.perf_counter() - start)


def safe_measure(model, factory, prompt: mx.array, decode: int, step: int, profile_steps: bool = False) -> dict:
    """measure(), or {"error": ...} where the arm raises (the run goes on)."""
    try:
        return measure(model, factory, prompt, decode, step, profile_steps)
    except Exception as error:  # an arm that cannot run is a result, not the end of the run
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}


def interleaved_decode(model, factories: dict, prompt: mx.array, rounds: int, step: int) -> dict:
    """Decode with every arm's cache alive at once, one step of each arm per round, so load
    from other processes on a shared machine falls on all arms alike. Per arm: the median
    step time and the median over rounds of KVCache's step time over the arm's (its
    tokens/s ratio within a round). Arms that raise are left out with their error."""
    state, out = {}, {}
    for name, factory in factories.items():
        try:
            cache = factory()
            token = prefill(model, cache, prompt, step).argmax()
            for _ in range(2):
                token = model(token[None, None], cache=cache)[0, -1].argmax()
                mx.eval(token)
            state[name] = [cache, token, []]
        except Exception as error:  # an arm that cannot run is a result
            out[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    for _ in range(rounds):
        for entry in state.values():
            began = time.perf_counter()
            entry[1] = model(entry[1][None, None], cache=entry[0])[0, -1].argmax()
            mx.eval(entry[1])
            entry[2].append(time.perf_counter() - began)
    base = state[BASELINE][2]
    for name, (_, _, times) in state.items():
        out[name] = {"step_ms": statistics.median(times) * 1e3,
                     "x_kvcache_within_rounds": statistics.median(b / t for b, t in zip(base, times, strict=True)),
                     "rounds_ms": [round(t * 1e3, 2) for t in times]}
    return out


def interleaved_prefill(model, factories: dict, prompt: mx.array, rounds: int, step: int) -> dict:
    """TTFT with the arms taking turns: each round prefills the whole prompt once into a
    fresh cache of every arm (the first arm moves by one each round, so none is always
    first or last), chunk by chunk through the first token's argmax as measure() does.
    Per arm: the median TTFT, the median over rounds of KVCache's TTFT over the arm's
    (above 1: faster) and each round's TTFT; per round the load average when it began.
    Arms that raise are left out with their error."""
    names, out = list(factories), {}
    for name in list(names):  # warm: every arm's graphs and compiled encoders once
        try:
            prefill(model, factories[name](), prompt[:min(prompt.size, 2 * step)], step)
        except Exception as error:  # an arm that cannot run is a result
            out[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            names.remove(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    loads = []
    for index in range(rounds):
        with open("/proc/loadavg") as handle:
            loads.append(handle.read().split()[:3])
        for name in names[index % len(names):] + names[:index % len(names)]:
            cache = factories[name]()
            began = time.perf_counter()
            mx.eval(prefill(model, cache, prompt, step).argmax())
            times[name].append(time.perf_counter() - began)
            del cache
            mx.clear_cache()
    base = times[BASELINE]
    for name in names:
        out[name] = {"ttft_ms": statistics.median(times[name]) * 1e3,
                     "x_kvcache_within_rounds": statistics.median(
                         b / t for b, t in zip(base, times[name], strict=True)),
                     "rounds_ms": [round(t * 1e3, 1) for t in times[name]]}
    out["loadavg_per_round"] = loads
    return out


def table(results: dict, baseline: str) -> str:
    """Markdown rows; TTFT "x" is KVCache's TTFT over the arm's (above 1: faster)."""
    base = results[baseline]
    lines = ["| cache | TTFT ms | x | prefill tok/s | decode tok/s | x | step build ms "
             "| overlapped decode tok/s | x | KV bytes/token | x smaller | held bytes/token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | {r['error']} |||||||||||")
            continue
        lines.append(
            f"| {name} | {r['ttft_ms']:.1f} | {base['ttft_ms'] / r['ttft_ms']:.2f} "
            f"| {r['prefill_tok_s']:.1f} "
            f"| {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / base['decode_tok_s']:.2f} "
            f"| {r['decode_build_ms']:.2f} "
            f"| {r['decode_overlap_tok_s']:.2f} | {r['decode_overlap_tok_s'] / base['decode_overlap_tok_s']:.2f} "
            f"| {r['kv_bytes_per_token']:.0f} "
            f"| {base['kv_bytes_per_token'] / r['kv_bytes_per_token']:.2f} "
            f"| {r['kv_physical_bytes_per_token']:.0f} |")
    return "\n".join(lines)


def median_result(runs: list[dict]) -> dict:
    """Medians over repeats of each number (chunk times: the first run's); an error wins."""
    errors = [r for r in runs if "error" in r]
    if errors:
        return errors[0]
    kept = ("chunk_ms", "decode_build_profile")  # the first run's
    out = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key not in kept}
    out.update({key: runs[0][key] for key in kept if key in runs[0]})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Full defaults are scaled for a 2-core CPU (5-11 minutes there): the 'scaled' "
               "model keeps Qwen3-0.6B's per-layer geometry with 4 layers and vocab 8192 "
               "(71M parameters). On a GPU: --size llama-8b --contexts 2048,8192,32768 "
               "--prefill-step 2048 --decode 32")
    parser.add_argument("--quick", action="store_true", help="tiny model, 256-token prompt, 16 decoded")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="scaled (default), quick (--quick), 0.6b, llama-1b, llama-8b")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (1024; 256 with --quick)")
    parser.add_argument("--contexts", default=None,
                        help="comma-separated prompt lengths, one table each (overrides --prompt)")
    parser.add_argument("--arms", default=None,
                        help="comma-separated arm names to run (default: all); KVCache always runs")
    parser.add_argument("--decode", type=int, default=None, help="decoded tokens (32; 16 with --quick)")
    parser.add_argument("--prefill-step", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all arms; medians")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--out", default=None, help="also write the JSON here, after each context")
    parser.add_argument("--interleaved", type=int, default=0, metavar="ROUNDS",
                        help="also decode all arms side by side for ROUNDS rounds, one step of "
                             "each per round (a fairer ratio on a shared machine)")
    parser.add_argument("--interleaved-prefill", type=int, default=0, metavar="ROUNDS",
                        help="also prefill every arm in turn for ROUNDS rounds (TTFT ratios "
                             "within rounds: the fairer prefill ratio on a shared machine)")
    parser.add_argument("--profile", action="store_true",
                        help="add each arm's cProfile of decode-step graph building (decode_build_profile)")
    args = parser.parse_args(argv)
    size = args.size or ("quick" if args.quick else "scaled")
    prompt_len = args.prompt or (256 if args.quick else 1024)
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else [prompt_len]
    decode = args.decode or (16 if args.quick else 32)
    dtype = getattr(mx, args.dtype)

    model, params = build_model(size, dtype)
    report = {"size": size, "params": params, "decode": decode, "dtype": args.dtype,
              "prefill_step": args.prefill_step, "block_size": args.block_size,
              "device": str(mx.default_device()), "contexts": {}}
    all_arms = arms(model, args.block_size)
    wanted = set(args.arms.split(",")) | {BASELINE} if args.arms else set(all_arms)
    unknown = wanted - set(all_arms)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; known: {sorted(all_arms)}")
    with engine.installed(model):
        for context in contexts:
            prompt = mx.random.randint(0, SIZES[size]["vocab_size"], (context,), dtype=mx.int32)
            samples: dict[str, list[dict]] = {}
            # Arms take turns within each repeat, so load from other processes on a shared
            # machine spreads over all of them instead of skewing the last ones.
            for repeat in range(args.repeats):
                for name, factory in all_arms.items():
                    if name not in wanted:
                        continue
                    samples.setdefault(name, []).append(
                        safe_measure(model, factory, prompt, decode, args.prefill_step,
                                     args.profile and repeat == 0))
                    print(f"  {context} tokens, repeat {repeat + 1}/{args.repeats}: {name}",
                          file=sys.stderr, flush=True)
                    mx.clear_cache()
            report["contexts"][context] = {name: median_result(runs) for name, runs in samples.items()}
            if args.interleaved_prefill:
                chosen = {name: f for name, f in all_arms.items() if name in wanted}
                report.setdefault("interleaved_prefill", {})[context] = interleaved_prefill(
                    model, chosen, prompt, args.interleaved_prefill, args.prefill_step)
                mx.clear_cache()
            if args.interleaved:
                chosen = {name: f for name, f in all_arms.items() if name in wanted}
                report.setdefault("interleaved_decode", {})[context] = interleaved_decode(
                    model, chosen, prompt, args.interleaved, args.prefill_step)
                mx.clear_cache()
            if args.out:
                with open(args.out, "w") as handle:
                    json.dump(report, handle, indent=2)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"## engine benchmark ({mx.default_device()}, {args.dtype})\n")
    print(f"model: random-weight {'llama' if size.startswith('llama') else 'qwen3'}, size '{size}', "
          f"{params / 1e6:.1f}M parameters, {SIZES[size]['num_hidden_layers']} layers")
    if size in ("scaled", "quick"):
        print("note: scaled down from the ~0.6B Qwen3 geometry (same heads and head dim per "
              "layer, fewer layers, smaller vocab) so the run fits a CPU; --size 0.6b runs "
              "the full model")
    print(f"decode {decode} tokens, prefill step {args.prefill_step}, block {args.block_size} "
          f"tokens, median of {args.repeats} round(s)\n\n{machine_line()}\n")
    for context, results in report["contexts"].items():
        print(f"### context {context} tokens\n")
        print(table(results, BASELINE) + "\n")
        turns = report.get("interleaved_prefill", {}).get(context)
        if turns:
            print(f"interleaved prefill, {args.interleaved_prefill} rounds (median TTFT ms; "
                  "x KVCache within rounds, above 1 faster):\n")
            for name, r in turns.items():
                if name != "loadavg_per_round":
                    print(f"- {name}: " + (r["error"] if "error" in r else
                          f"{r['ttft_ms']:.1f} ms, {r['x_kvcache_within_rounds']:.3f}x"))
            print()
        side = report.get("interleaved_decode", {}).get(context)
        if side:
            print(f"interleaved decode, {args.interleaved} rounds (median step ms; x KVCache "
                  "within rounds):\n")
            for name, r in side.items():
                print(f"- {name}: " + (r["error"] if "error" in r else
                      f"{r['step_ms']:.2f} ms, {r['x_kvcache_within_rounds']:.2f}x"))
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
