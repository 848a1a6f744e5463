"""Engine benchmark: paged KV caches (native, k8v8, k8v4, k4v4) against mlx-lm's KVCache
and QuantizedKVCache, on one random-weight model, in one run.

Usage:
  python -m tools.bench.engine                 # scaled Qwen3-0.6B geometry, 1024-token prompt
  python -m tools.bench.engine --quick         # tiny model, 256-token prompt (about 30 s)
  python -m tools.bench.engine --size 0.6b     # the full ~0.6B model (slow on a CPU)
  python -m tools.bench.engine --prompt 2048 --decode 64 --repeats 3 --json

Per arm: prefill tokens/s (the prompt in chunks of --prefill-step, evaluated after each
chunk, as mlx-lm's generate_step does), decode tokens/s (greedy, one token per step,
evaluated every step), and KV bytes per token: per token slot of the arrays the cache
holds (its own nbytes over its capacity in tokens, all layers) and the physical bytes it
holds at the end over the tokens it holds (block or step rounding included).
Ratios are against mlx-lm's KVCache measured in the same run.

The paged arms attend through engine.install(): native pages with the "reference" arm
(bit-exact with KVCache), packed pages with the kernels' dispatch ("partitioned" on CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3
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
}
PAGED_FORMATS = ("native", "k8v8", "k8v4", "k4v4")
DECODE_SEGMENT = 4


def build_model(size: str, dtype: mx.Dtype):
    config = dict(model_type="qwen3", rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=32768, tie_word_embeddings=True, **SIZES[size])
    mx.random.seed(0)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
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


def prefill(model, cache, prompt: mx.array, step: int) -> mx.array:
    for start in range(0, prompt.size, step):
        logits = model(prompt[None, start:start + step], cache=cache)
        mx.eval(logits, [c.state for c in cache])
    return logits[0, -1]


def measure(model, factory, prompt: mx.array, decode: int, step: int) -> dict:
    warm = factory()
    token = prefill(model, warm, prompt[:32], step).argmax()
    for _ in range(2):
        token = model(token[None, None], cache=warm)[0, -1].argmax()
        mx.eval(token)
    del warm

    cache = factory()
    start = time.perf_counter()
    token = prefill(model, cache, prompt, step).argmax()
    mx.eval(token)
    prefill_s = time.perf_counter() - start
    # Decode in segments of 4 tokens and keep the median rate: the machine may be shared,
    # and one preempted segment should not move the result.
    rates = []
    for first in range(0, decode, DECODE_SEGMENT):
        count = min(DECODE_SEGMENT, decode - first)
        start = time.perf_counter()
        for _ in range(count):
            token = model(token[None, None], cache=cache)[0, -1].argmax()
            mx.eval(token)
        rates.append(count / (time.perf_counter() - start))
    tokens = prompt.size + decode
    per_slot, held = zip(*(slot_nbytes(c) for c in cache), strict=True)
    return {"prefill_tok_s": prompt.size / prefill_s, "decode_tok_s": statistics.median(rates),
            "kv_bytes_per_token": sum(per_slot), "kv_physical_bytes_per_token": sum(held) / tokens}


def table(results: dict, baseline: str) -> str:
    base = results[baseline]
    lines = ["| cache | prefill tok/s | x | decode tok/s | x | KV bytes/token | x smaller "
             "| held bytes/token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['prefill_tok_s']:.1f} | {r['prefill_tok_s'] / base['prefill_tok_s']:.2f} "
            f"| {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / base['decode_tok_s']:.2f} "
            f"| {r['kv_bytes_per_token']:.0f} "
            f"| {base['kv_bytes_per_token'] / r['kv_bytes_per_token']:.2f} "
            f"| {r['kv_physical_bytes_per_token']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Full defaults are scaled for a 2-core CPU (5-11 minutes there): the 'scaled' "
               "model keeps Qwen3-0.6B's per-layer geometry with 4 layers and vocab 8192 "
               "(71M parameters). On a bigger machine: --size 0.6b --prompt 2048 --decode 64 "
               "--repeats 3")
    parser.add_argument("--quick", action="store_true", help="tiny model, 256-token prompt, 16 decoded")
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="scaled (default), quick (--quick), 0.6b (the full geometry)")
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (1024; 256 with --quick)")
    parser.add_argument("--decode", type=int, default=None, help="decoded tokens (32; 16 with --quick)")
    parser.add_argument("--prefill-step", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over all arms; medians")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    size = args.size or ("quick" if args.quick else "scaled")
    prompt_len = args.prompt or (256 if args.quick else 1024)
    decode = args.decode or (16 if args.quick else 32)
    dtype = getattr(mx, args.dtype)

    model, params = build_model(size, dtype)
    prompt = mx.random.randint(0, SIZES[size]["vocab_size"], (prompt_len,), dtype=mx.int32)
    samples: dict[str, list[dict]] = {}
    with engine.installed(model):
        # Arms take turns within each repeat, so load from other processes on a shared
        # machine spreads over all of them instead of skewing the last ones.
        for repeat in range(args.repeats):
            for name, factory in arms(model, args.block_size).items():
                samples.setdefault(name, []).append(
                    measure(model, factory, prompt, decode, args.prefill_step))
                print(f"  repeat {repeat + 1}/{args.repeats}: {name}", file=sys.stderr, flush=True)
    results = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for name, runs in samples.items()}
    if args.json:
        print(json.dumps({"size": size, "params": params, "prompt": prompt_len, "decode": decode,
                          "dtype": args.dtype, "results": results}, indent=2))
        return 0
    print(f"## engine benchmark ({mx.default_device()}, {args.dtype})\n")
    print(f"model: random-weight qwen3, size '{size}', {params / 1e6:.1f}M parameters, "
          f"{SIZES[size]['num_hidden_layers']} layers")
    if size != "0.6b":
        print("note: scaled down from the ~0.6B Qwen3 geometry (same heads and head dim per "
              "layer, fewer layers, smaller vocab) so the run fits a CPU; --size 0.6b runs "
              "the full model")
    print(f"prompt {prompt_len} tokens (prefill step {args.prefill_step}), decode {decode} "
          f"tokens, block {args.block_size} tokens, median of {args.repeats} round(s)\n\n{machine_line()}\n")
    print(table(results, "mlx-lm KVCache"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
