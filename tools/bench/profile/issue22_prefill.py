"""Issue 22, packed prefill: where one prefill chunk's attention goes, and why the gathered
and partitioned arms of tests/engine/test_packed.py disagree on a GPU.

  python3 -m tools.bench.profile.issue22_prefill prefill --out p.json
      one layer of the 8B-shaped model (32 query / 8 KV heads of 128, bf16), a 2048-token
      chunk ending at 8K and 32K tokens: bf16 SDPA over dense K/V (what KVCache runs),
      the chunk's page write (encode + plane writes), the pages' dequantization
      (paging.gather_pages against prefill.dequantized_pages), and the whole
      "dequantized" call, for native and k4v4 pages; medians of 5, ms.
  python3 -m tools.bench.profile.issue22_prefill arms --out a.json
      test_gathered_and_partitioned_arms_agree's data: each arm's relative error against
      float64 attention over the same decoded K/V, and the arms against each other
      (run it once more under MLX_ENABLE_TF32=0 to see what float32 matmuls cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import numpy as np

from engine import BlockPool, PagedKVCache, PageSpec
from engine.attention import attend
from engine.cache import ROUTED_MODULES
from engine.formats import FORMATS
from kernels.paging import clean_block_ids, gather_pages
from kernels.prefill import dequantized_pages

Q_HEADS, KV_HEADS, DIM, CHUNK, BLOCK = 32, 8, 128, 2048, 128


def timed(fn, repeats: int = 5) -> float:
    mx.eval(fn())
    mx.synchronize()
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples) * 1e3


def format_row(name: str, context: int, keys, values, queries) -> dict:
    """One page format's timings for a chunk of CHUNK queries ending at `context`."""
    row = {}
    packed = FORMATS[name].packed
    spec = PageSpec(FORMATS[name], KV_HEADS, DIM, DIM, BLOCK, 64, 0 if packed else None)
    cache = PagedKVCache(BlockPool(spec, context // BLOCK + 1), attention_impl="dequantized")
    cache.routed_by = ("profile",)
    cache.update_and_fetch(keys[:, :, :-CHUNK], values[:, :, :-CHUNK])
    mx.eval(cache.state)

    def write():
        cache.trim(cache.offset - (context - CHUNK))
        cache.update_and_fetch(keys[:, :, -CHUNK:], values[:, :, -CHUNK:])
        return list(cache.pool.planes.values())

    row[f"{name}_write_ms"] = timed(write)
    ids = clean_block_ids(cache.block_table(), [context], BLOCK, 0, context // BLOCK)
    planes, layout = cache.pool.planes, spec.layout
    row[f"{name}_gather_pages_ms"] = timed(lambda: gather_pages(planes, layout, ids, mx.bfloat16))
    if packed:
        row[f"{name}_dequantized_pages_ms"] = timed(
            lambda: dequantized_pages(planes, layout, ids, mx.bfloat16))
        a = gather_pages(planes, layout, ids, mx.bfloat16)
        b = dequantized_pages(planes, layout, ids, mx.bfloat16)
        row[f"{name}_dequantized_pages_equal"] = all(
            mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))

    def attention():
        write()  # the chunk's write, as the routed update did (native: keeps the fresh K/V)
        return attend(cache, queries, scale=DIM ** -0.5, mask="causal")

    row[f"{name}_write_and_attention_ms"] = timed(attention)
    return row


def prefill_profile() -> dict:
    out = {}
    ROUTED_MODULES["profile"] = 1
    for context in (8192, 32768):
        mx.random.seed(0)
        keys = mx.random.normal((1, KV_HEADS, context, DIM)).astype(mx.bfloat16)
        values = mx.random.normal((1, KV_HEADS, context, DIM)).astype(mx.bfloat16)
        queries = mx.random.normal((1, Q_HEADS, CHUNK, DIM)).astype(mx.bfloat16)
        mx.eval(keys, values, queries)
        row = {"kvcache_sdpa_ms": timed(lambda k=keys, v=values, q=queries: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=DIM ** -0.5, mask="causal"))}
        for name in ("native-bf16", "k4v4"):
            row.update(format_row(name, context, keys, values, queries))
        out[context] = row
        print(context, json.dumps(row), flush=True)
    return out


def relative(x, ref) -> float:
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def arms_diagnostic() -> dict:
    from tests.engine.test_packed import DIM as T_DIM
    from tests.engine.test_packed import HEADS, SCALE, outlier_data
    out = {"MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32")}
    queries, keys, values = outlier_data(3)
    for name in ("k8v4", "k4v4", "native-f32"):
        rotate = FORMATS[name].packed
        spec = PageSpec(FORMATS[name], HEADS, T_DIM, T_DIM, 16, 64, 5 if rotate else None)
        cache = PagedKVCache(BlockPool(spec, 4), attention_impl="reference")
        cache.update_and_fetch(keys, values)
        gathered = attend(cache, queries, scale=SCALE)
        cache.attention_impl = "partitioned"
        partitioned = attend(cache, queries, scale=SCALE)
        k, v = (np.asarray(x, dtype=np.float64) for x in cache.keys_and_values(mx.float32))
        q = np.asarray(queries, dtype=np.float64)
        rep = q.shape[1] // k.shape[1]
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = q @ k.transpose(0, 1, 3, 2) * SCALE
        p = np.exp(s - s.max(-1, keepdims=True))
        exact = (p / p.sum(-1, keepdims=True)) @ v
        out[name] = {"partitioned_vs_gathered": relative(partitioned, gathered),
                     "gathered_vs_float64": relative(gathered, exact),
                     "partitioned_vs_float64": relative(partitioned, exact)}
        print(name, out[name], flush=True)
    a = mx.random.normal((256, 256))
    b = mx.random.normal((256, 256))
    out["float32_matmul_vs_float64"] = relative(a @ b, np.asarray(a, np.float64) @ np.asarray(b, np.float64))
    print(out, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["prefill", "arms"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {"device": str(mx.default_device()), "mlx": mx.__version__,
              **(prefill_profile() if args.what == "prefill" else arms_diagnostic())}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
