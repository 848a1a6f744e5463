"""Decode attention benchmark: paged (native and packed) pages against dense and mlx-lm peers.

Usage:
  python -m tools.bench.attention              # 4K/32K/128K, batch 1 and 8 (GPU sizes)
  python -m tools.bench.attention --quick      # fewer sizes and repeats
  python -m tools.bench.attention --contexts 4096,32768 --batches 1 --repeats 5

Shape: 32 query heads, 8 KV heads, head dim 128, one query (decode), bf16 model dtype.
Measured in one run, per (batch, context):
  dense        mx.fast.scaled_dot_product_attention over contiguous bf16 K/V
  mlx-lm q4    mlx_lm.models.base.quantized_scaled_dot_product_attention, mx.quantize'd 4-bit K/V
  reference    paged_attention(impl="reference") per page format (gather, dequantize, SDPA)
  direct       paged_attention with the direct path per page format (cuda/metal kernel on a
               GPU, the partitioned MLX-ops path on the CPU)
Times are medians over repeats; each sample evaluates a chain of calls (each call's output is
the next call's queries, as in decode, layer after layer) and divides: on a GPU as many calls
as fill about 10 ms (--sample-ms; the printed calls per sample), on the CPU --inner (1).
The methods of a case are timed in interleaved rounds (one sample of each in turn), and "vs
dense" is the median over rounds of the ratio within a round, so slow drift of the machine
(clocks, other load) falls on dense and the method alike.
"rel err" is each output's error against SDPA over the same K/V in float32:
||out - exact|| / ||exact|| over the batch (what a page format costs in accuracy).
"eval" times evaluation of graphs built before the clock starts; "build+eval" adds the
Python that builds them (see timed()).
GB/s counts the page bytes one call must read (K/V planes of the visible tokens); "% copy"
compares it with an elementwise copy measured in the same run (bytes read + written).
On the CPU the default contexts are scaled down (see the printed note).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from kernels.attention import default_impl, paged_attention
from kernels.hadamard import rotate
from kernels.layout import PageLayout
from kernels.quant import quantize
from kernels.tuning import environment_tuning
from tools.bench.common import machine_line

N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 32, 8, 128
FORMATS = {
    "native": PageLayout(),
    "k8v8": PageLayout(8, 8, rotation_seed=1),
    "k8v4": PageLayout(8, 4, rotation_seed=1),
    "k4v4": PageLayout(4, 4, rotation_seed=1),
}


def load_mlx_lm_quantized_sdpa():
    """mlx_lm.models.base.quantized_scaled_dot_product_attention, loaded from its file so the
    package __init__ (which pulls in transformers) is not needed."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / "base.py"
    module_spec = importlib.util.spec_from_file_location("_mlx_lm_base", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.quantized_scaled_dot_product_attention


def _calls(fn, inner: int, chain_from=None) -> list:
    """The outputs of `inner` calls of fn: independent calls of fn() (chain_from None), or a
    chain in which each call's output is the next call's queries, fn(chain_from) first."""
    if chain_from is None:
        return [fn() for _ in range(inner)]
    x = chain_from
    for _ in range(inner):
        x = fn(x)
    return [x]


def _warm(fn, inner: int, chain_from=None) -> None:
    for _ in range(2):
        mx.eval(_calls(fn, inner, chain_from))
    mx.synchronize()


def _sample(fn, inner: int, chain_from=None) -> tuple[float, float]:
    """Seconds per call of one sample of `inner` calls (see _calls): (eval only, build + eval)."""
    outputs = _calls(fn, inner, chain_from)
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(outputs)
    mx.synchronize()
    eval_only = (time.perf_counter() - start) / inner
    start = time.perf_counter()
    mx.eval(_calls(fn, inner, chain_from))
    mx.synchronize()
    return eval_only, (time.perf_counter() - start) / inner


def timed(fn, repeats: int, inner: int) -> tuple[float, float]:
    """Median seconds per call of fn(), as (eval only, build + eval).

    Each sample evaluates `inner` independent calls together. "eval only" builds the lazy
    graphs before the clock starts (device work and launches); "build + eval" also counts
    the Python that builds them, which a real model overlaps with the previous layer's
    device work through async evaluation.
    """
    _warm(fn, inner)
    samples = [_sample(fn, inner) for _ in range(repeats)]
    return statistics.median(x for x, _ in samples), statistics.median(y for _, y in samples)


def timed_rounds(fns: dict, repeats: int, inner: int, sample_s: float = 0.0,
                 chain_from=None) -> tuple[dict, dict]:
    """Samples (as timed()'s) of every function in fns, interleaved: each of `repeats` rounds
    takes one sample of each in turn. Returns (samples, calls per sample) by name. With
    chain_from, the functions take queries and each sample is a chain of calls (_calls).

    With sample_s, a method's calls per sample are as many as fill sample_s of evaluation
    (at least 1, at most 1000; estimated from one sample of `inner` calls after warm-up),
    so the cost of starting a sample is spread thin for fast and slow methods alike. On the
    H200 an empty kernel measured 50-74 us per call at 1 call per sample, 4-6 us at 40, and
    dense SDPA at 128K 175.7 us per call with 10 calls per sample against 148.0 us with 20
    (that run also warmed each sample up with 20 untimed calls; docs/kernels.md)."""
    calls = {}
    for name, fn in fns.items():
        _warm(fn, inner, chain_from)
        calls[name] = inner
        if sample_s:
            calls[name] = max(1, min(1000, math.ceil(sample_s / _sample(fn, inner, chain_from)[0])))
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_sample(fn, calls[name], chain_from))
    return samples, calls


def copy_bandwidth(nbytes: int, repeats: int, sample_s: float = 0.0) -> float:
    """Bytes per second of an elementwise copy (counting read + write); samples sized as the
    attention methods' (timed_rounds)."""
    x = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(x)
    samples, _ = timed_rounds({"copy": lambda: x * 1.5}, repeats, 1, sample_s)
    return 2 * nbytes / statistics.median(t for t, _ in samples["copy"])


def page_nbytes_per_token(layout: PageLayout, dtype_nbytes: int = 2) -> int:
    """Bytes of K and V pages one token of one KV head occupies."""
    if not layout.packed:
        return 2 * HEAD_DIM * dtype_nbytes
    groups = HEAD_DIM // layout.group_size
    return HEAD_DIM * (layout.k_bits + layout.v_bits) // 8 + 2 * groups * 8


def build_pages(keys: mx.array, values: mx.array, layout: PageLayout, block_size: int, seed: int):
    """keys/values [B, Hkv, T, D] bf16 -> (planes, shuffled block table)."""
    batch, heads, tokens, dim = keys.shape
    per_seq = math.ceil(tokens / block_size)
    pad = per_seq * block_size - tokens
    if pad:
        widen = [(0, 0), (0, 0), (0, pad), (0, 0)]
        keys, values = mx.pad(keys, widen), mx.pad(values, widen)

    def blocked(x):  # [B, H, per_seq*bs, W] -> [B*per_seq, H, bs, W]
        x = x.reshape(batch, heads, per_seq, block_size, x.shape[-1]).transpose(0, 2, 1, 3, 4)
        return x.reshape(batch * per_seq, heads, block_size, x.shape[-1])

    # block i of the flattened history lives at pool block order[i]
    order = mx.random.permutation(batch * per_seq, key=mx.random.key(seed)).astype(mx.int32)
    inverse = mx.argsort(order)
    if layout.packed:
        k_in = rotate(keys, layout.rotation_seed) if layout.rotated_keys else keys
        planes = {}
        for half, x, bits in (("k", k_in, layout.k_bits), ("v", values, layout.v_bits)):
            for name, part in zip(("codes", "scales", "offsets"), quantize(x, bits, layout.group_size), strict=True):
                planes[f"{half}_{name}"] = blocked(part)[inverse]
    else:
        planes = {"k": blocked(keys)[inverse], "v": blocked(values)[inverse]}
    tables = order.reshape(batch, per_seq)
    mx.eval(planes, tables)
    return planes, tables


def bench_case(batch, tokens, args, direct_impl, quantized_sdpa, rows, copy_bps):
    scale = HEAD_DIM**-0.5
    mx.random.seed(tokens + batch)
    keys = mx.random.normal((batch, N_KV_HEADS, tokens, HEAD_DIM)).astype(mx.bfloat16)
    values = mx.random.normal((batch, N_KV_HEADS, tokens, HEAD_DIM)).astype(mx.bfloat16)
    queries = mx.random.normal((batch, N_Q_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
    mx.eval(keys, values, queries)
    exact = mx.fast.scaled_dot_product_attention(
        queries.astype(mx.float32), keys.astype(mx.float32), values.astype(mx.float32), scale=scale)

    def rel_err(out) -> float:
        diff = out.astype(mx.float32) - exact
        return (mx.sqrt((diff * diff).sum()) / mx.sqrt((exact * exact).sum())).item()

    cases = {}  # name -> (method, format, page bytes, fn), timed together below

    # Every method takes the queries as its argument: a sample chains its calls, each call's
    # output [B, Hq, 1, D] the next call's queries, as decode runs layer after layer. (MLX
    # runs independent calls of one evaluation concurrently on a GPU, which measured
    # throughput, not the latency a decode step sees.)
    dense_bytes = batch * tokens * N_KV_HEADS * page_nbytes_per_token(PageLayout())
    def dense(q):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)

    cases["dense"] = ("dense", "bf16", dense_bytes, dense)
    if quantized_sdpa is not None:
        q_keys = mx.quantize(keys, group_size=64, bits=4)
        q_values = mx.quantize(values, group_size=64, bits=4)
        mx.eval(q_keys, q_values)
        q4_bytes = sum(x.nbytes for x in (*q_keys, *q_values))
        def mlx_lm_q4(q):
            # mlx-lm scales its queries argument in place (`queries *= scale`): the case's own
            # queries go in as a copy (a chain's later calls get fresh outputs)
            return quantized_sdpa(mx.array(q) if q is queries else q, q_keys, q_values, scale=scale,
                                  mask=None, group_size=64, bits=4)

        cases["mlx-lm"] = ("mlx-lm", "q4", q4_bytes, mlx_lm_q4)
    for fmt in args.formats:
        layout = FORMATS[fmt]
        planes, tables = build_pages(keys, values, layout, args.block_size, seed=tokens)
        page_bytes = batch * tokens * N_KV_HEADS * page_nbytes_per_token(layout)
        lens = [tokens] * batch
        for method, impl in (("reference", "reference"), ("direct", direct_impl)):
            if method == "reference" and args.skip_reference:
                continue
            def call(q, planes=planes, tables=tables, lens=lens, layout=layout, impl=impl):
                return paged_attention(q, planes, tables, lens, layout, scale=scale, impl=impl,
                                       partition_tokens=args.partition_tokens, tuning=args.direct_tuning)

            name = method if method == "reference" else f"direct:{impl}"
            cases[f"{name} {fmt}"] = (name, fmt, page_bytes, call)

    samples, calls = timed_rounds({key: case[3] for key, case in cases.items()}, args.repeats, args.inner,
                                  args.sample_ms / 1e3, chain_from=queries)
    dense_samples = samples["dense"]
    for key, (method, fmt, page_bytes, fn) in cases.items():
        seconds = statistics.median(x for x, _ in samples[key])
        with_build = statistics.median(y for _, y in samples[key])
        rows.append(dict(batch=batch, context=tokens, method=method, format=fmt,
                         us=seconds * 1e6, call_us=with_build * 1e6, calls_per_sample=calls[key],
                         page_bytes=page_bytes,
                         gbps=page_bytes / seconds / 1e9 if page_bytes else None,
                         copy_fraction=page_bytes / seconds / copy_bps if page_bytes else None,
                         vs_dense=statistics.median(d[0] / m[0] for d, m in zip(dense_samples, samples[key], strict=True)),
                         vs_dense_build=statistics.median(d[1] / m[1] for d, m in zip(dense_samples, samples[key], strict=True)),
                         rel_err=rel_err(fn(queries))))
        print(f"  B={batch} T={tokens} {method:<10} {fmt:<7} {seconds * 1e6:10.1f} us "
              f"(with graph build {with_build * 1e6:.1f} us; {calls[key]} calls per sample)",
              file=sys.stderr, flush=True)


def print_table(rows, copy_bps):
    print(f"\nmemory copy bandwidth (read + write): {copy_bps / 1e9:.1f} GB/s\n\n{machine_line()}\n")
    print("| batch | context | method | format | eval (us) | vs dense | page GB/s | % of copy "
          "| build+eval (us) | vs dense | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gbps = "-" if not r["gbps"] else f"{r['gbps']:.0f}" if r["gbps"] >= 10 else f"{r['gbps']:.2f}"
        frac = f"{100 * r['copy_fraction']:.0f}%" if r["copy_fraction"] else "-"
        print(f"| {r['batch']} | {r['context']} | {r['method']} | {r['format']} | "
              f"{r['us']:.1f} | {r['vs_dense']:.2f}x | {gbps} | {frac} | {r['call_us']:.1f} | "
              f"{r['vs_dense_build']:.2f}x | {r['rel_err']:.1e} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="On a CPU the contexts are scaled down from the GPU's 4K/32K/128K to 4K/16K/32K "
               "at batch 1 (about 3-5 minutes on 2 cores); on a bigger machine: "
               "--contexts 4096,32768,131072 --batches 1,8")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    parser.add_argument("--contexts", help="comma-separated context lengths (GPU 4096,32768,131072; "
                                           "CPU 4096,16384,32768; --quick on a CPU 1024,2048,4096)")
    parser.add_argument("--batches", help="comma-separated batch sizes (GPU 1,8; CPU and --quick 1)")
    parser.add_argument("--formats", default=",".join(FORMATS), help="page formats (all four)")
    parser.add_argument("--repeats", type=int, help="timed samples per case (GPU 11, CPU 5, --quick 3)")
    parser.add_argument("--inner", type=int, help="calls per sample (GPU 10, CPU 1); with --sample-ms, "
                                                  "the calls of the sample that sizes it")
    parser.add_argument("--sample-ms", type=float,
                        help="size each method's samples to this much evaluation (GPU 10; CPU 0: --inner calls)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--partition-tokens", type=int, default=1024)
    parser.add_argument("--impl", help="direct implementation (default: dispatch)")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--tuning", help="direct kernel launch parameters over the environment's: "
                                         "unroll,warps,target_blocks[,dims_per_lane[,mma_warps,...]] "
                                         "(kernels/tuning.py)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    on_gpu = mx.default_device() == mx.gpu
    args.direct_tuning = environment_tuning().parse(args.tuning) if args.tuning else None
    direct_impl = args.impl or default_impl()
    if args.contexts:
        contexts = [int(x) for x in args.contexts.split(",")]
    elif on_gpu:
        contexts = [4096, 32768, 131072]
    else:
        # --quick stays at short contexts so the whole `kvstore bench --quick` fits in
        # 3 minutes on a 2-core machine (4K/32K took ~217 s on its own)
        contexts = [1024, 2048, 4096] if args.quick else [4096, 16384, 32768]
        print("note: CPU run; contexts scaled down from 4K/32K/128K to "
              f"{'/'.join(str(c) for c in contexts)} (the CPU target is 32K)")
    batches = [int(x) for x in args.batches.split(",")] if args.batches else (
        [1] if args.quick or not on_gpu else [1, 8])
    args.formats = args.formats.split(",")
    args.repeats = args.repeats or (3 if args.quick else 11 if on_gpu else 5)
    args.inner = args.inner or (10 if on_gpu else 1)
    if args.sample_ms is None:
        args.sample_ms = 10.0 if on_gpu else 0.0

    copy_bps = copy_bandwidth((1 << 30) if on_gpu else (1 << 28), args.repeats, args.sample_ms / 1e3)
    quantized_sdpa = load_mlx_lm_quantized_sdpa()
    print(f"device {mx.default_device()}, direct impl {direct_impl}, block size {args.block_size}, "
          f"{N_Q_HEADS} q heads / {N_KV_HEADS} kv heads / head dim {HEAD_DIM}, decode (L=1)")
    rows: list[dict] = []
    for batch in batches:
        for tokens in contexts:
            bench_case(batch, tokens, args, direct_impl, quantized_sdpa, rows, copy_bps)
    print_table(rows, copy_bps)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_bps=copy_bps, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
