"""Time to first token: restore from the store against full recompute, per page format.

Usage:
  python -m tools.bench.ttft                    # CPU-scaled model, 512/2K/8K prompts, native + k4v4
  python -m tools.bench.ttft --quick            # toy model, 256/512 prompts, all four formats (seconds)
  python -m tools.bench.ttft --size 1b          # Llama-3.2-1B geometry (for a GPU)
  python -m tools.bench.ttft --size 8b          # Llama-3.1-8B geometry (for a GPU)
  python -m tools.bench.ttft --json out.json

For each prompt length and page format, in one run, interleaved:
  recompute  a fresh paged cache prefills the whole prompt (chunks of 2048, as
             mlx-lm's generate_step does), then the first token is sampled;
  restore    restore() the prompt's stored prefix (all but the last token) from an
             embedded Store, prefill the last token, sample the first token. The
             prefix is published (untimed) from the first recompute's cache, after its
             clock stops, so no prefill runs only to fill the store;
  mlx-lm file  the peer: load_prompt_cache of a .safetensors file holding mlx-lm
             KVCache objects for the same prefix (saved beforehand, untimed; bf16, so
             the same file serves every page format), prefill the last token, sample.
All end with mx.eval of the first token. Medians over --repeats.

Full defaults, and why: "1b" is Llama-3.2-1B's geometry (16 layers, hidden 2048, 32
query / 8 KV heads of 64, MLP 8192, vocab 128256). On this project's 2-core CPU machines
MLX's CPU matmul runs at 4-6 GFLOP/s, so one 8K prefill of that model takes hours, and
even a 4-layer 12.6M-parameter model took 100 s (idle) to 200 s (loaded) per 8K prefill:
at four formats and 3 repeats the suite alone ran past an hour. The default CPU size,
"cpu", keeps the 1B's KV geometry per layer (8 KV heads of 64) with 2 layers, hidden
512, MLP 1024, vocab 4096 (7.3M parameters), and the default formats are the two ends,
native and k4v4 (the engine and attention suites cover k8v8 and k8v4). Recompute work
and restored bytes both scale linearly with the layer count, so the speedups are those
of a deeper model of the same width. That keeps `kvstore bench` near 40 minutes on 2
cores. On a bigger machine, run the full set:
  python -m tools.bench.ttft --size 1b --formats native k8v8 k8v4 k4v4
  (or: kvstore bench --suite-args "ttft=--size 1b --formats native k8v8 k8v4 k4v4")
The printed table says which size ran.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, load_prompt_cache, save_prompt_cache

from engine import EngineModel, KVPolicy, RestoreRequest, publish, restore
from engine.attention import installed
from kvstore.store import Store
from tools.bench.common import machine_line

SIZES = {
    "1b": dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256),
    # Llama-3.1-8B's geometry (for a GPU): 512 MiB of bf16 KV per 4096 tokens
    "8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256),
    # "cpu": the 1B's KV geometry per layer, 2 layers (see the module docstring)
    "cpu": dict(num_hidden_layers=2, hidden_size=512, num_attention_heads=8,
                num_key_value_heads=8, head_dim=64, intermediate_size=1024, vocab_size=4096),
    "quick": dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=64, intermediate_size=512, vocab_size=1024),
}
PREFILL_STEP = 2048
ALL_FORMATS = ("native", "k8v8", "k8v4", "k4v4")
FULL_FORMATS = ("native", "k4v4")  # the two ends; the CPU budget (module docstring)
MODEL_ID = "bench/ttft"


def build_model(size: str):
    config = dict(model_type="llama", rms_norm_eps=1e-5, rope_theta=500000.0,
                  tie_word_embeddings=True, max_position_embeddings=131072, **SIZES[size])
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model, sum(v.size for _, v in tree_flatten(model.parameters()))


def first_token(model, tokens: list[int], cache) -> int:
    for start in range(0, len(tokens) - 1, PREFILL_STEP):
        chunk = tokens[start : min(start + PREFILL_STEP, len(tokens) - 1)]
        model(mx.array([chunk]), cache=cache)
        mx.eval([c.state for c in cache])
    logits = model(mx.array([tokens[-1:]]), cache=cache)
    token = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(token)
    return token.item()


def run(size: str, prompts: list[int], formats: list[str], repeats: int, block_size: int,
        profile: str | None = None) -> list[dict]:
    model, params = build_model(size)
    vocab = SIZES[size]["vocab_size"]
    rows = []
    prompt_files: dict[int, str] = {}  # prompt length -> mlx-lm prompt-cache file of its prefix
    with tempfile.TemporaryDirectory() as tmp, Store(f"{tmp}/store") as store, installed(model):
        for fmt in formats:
            policy = KVPolicy(default_format=fmt, block_size_tokens=block_size)
            for length in prompts:
                tokens = mx.random.randint(0, vocab, (length,), key=mx.random.key(length)).tolist()
                engine_model = EngineModel(model, MODEL_ID, policy=policy)
                if length not in prompt_files:  # the peer's file, once per length (untimed)
                    kv_caches = [KVCache() for _ in model.layers]
                    first_token(model, tokens, kv_caches)  # fills all but the last token
                    prompt_files[length] = f"{tmp}/prompt-{length}.safetensors"
                    save_prompt_cache(prompt_files[length], kv_caches)
                    del kv_caches
                recompute, restored, loaded, calls = [], [], [], []
                want = None
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    cache = engine_model.make_cache()
                    got = first_token(model, tokens, cache)
                    recompute.append(time.perf_counter() - t0)
                    if want is None:
                        # the first recompute fills the store (after its clock stopped):
                        # a separate prefill for it would cost one more 8K prefill per case
                        want = got
                        publish(engine_model, store, tokens[:-1], cache)
                    assert got == want
                    for c in cache:
                        c.free()
                    t0 = time.perf_counter()
                    result = restore(engine_model, store, RestoreRequest(tokens))
                    calls.append(time.perf_counter() - t0)  # restore() returned; device work may go on
                    logits = model(mx.array([tokens[result.tokens_restored:]]), cache=result.cache)
                    token = mx.argmax(logits[:, -1], axis=-1)
                    mx.eval(token)
                    restored.append(time.perf_counter() - t0)
                    assert result.tokens_restored == length - 1, result.tokens_restored
                    assert token.item() == want, "restored first token differs from recompute"
                    for c in result.cache:
                        c.free()
                    t0 = time.perf_counter()
                    kv_caches = load_prompt_cache(prompt_files[length])
                    logits = model(mx.array([tokens[-1:]]), cache=kv_caches)
                    mx.eval(mx.argmax(logits[:, -1], axis=-1))
                    loaded.append(time.perf_counter() - t0)
                    del kv_caches
                if profile:  # one more restore arm, untimed, under cProfile
                    _profile_restore(f"{profile}.{fmt}.{length}.txt", model, engine_model, store, tokens)
                rec, res = statistics.median(recompute), statistics.median(restored)
                load = statistics.median(loaded)
                rows.append({"size": size, "params": params, "format": fmt, "prompt_tokens": length,
                             "recompute_s": rec, "restore_s": res, "speedup": rec / res,
                             "recompute_min_max": [min(recompute), max(recompute)],
                             "restore_min_max": [min(restored), max(restored)],
                             "mlx_lm_load_s": load, "mlx_lm_load_min_max": [min(loaded), max(loaded)],
                             "restore_call_s": statistics.median(calls),
                             "restored_bytes": result.bytes_read, "device": str(mx.default_device())})
                print(f"  {fmt:>6} {length:>6} tokens: recompute {rec * 1e3:9.1f} ms, "
                      f"restore {res * 1e3:8.1f} ms (restore() {statistics.median(calls) * 1e3:.1f}), {rec / res:7.1f}x, mlx-lm file {load * 1e3:8.1f} ms",
                      file=sys.stderr)
    return rows


def _profile_restore(path: str, model, engine_model, store, tokens: list[int]) -> None:
    """The restore arm once under cProfile (the first token evaluated inside it); the
    stats by internal and by cumulative time go to `path`."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    result = restore(engine_model, store, RestoreRequest(tokens))
    logits = model(mx.array([tokens[result.tokens_restored:]]), cache=result.cache)
    mx.eval(mx.argmax(logits[:, -1], axis=-1))
    profiler.disable()
    for c in result.cache:
        c.free()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(30)
    with open(path, "w") as f:
        f.write(text.getvalue())


def table(rows: list[dict]) -> str:
    head = ("| format | prompt tokens | recompute TTFT (median, min-max) | restore TTFT (median, "
            "min-max) | restored MiB | speedup | mlx-lm file TTFT (median, min-max) | restore vs "
            "mlx-lm file |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['prompt_tokens']} | {r['recompute_s'] * 1e3:.1f} ms "
            f"({r['recompute_min_max'][0] * 1e3:.1f}-{r['recompute_min_max'][1] * 1e3:.1f}) | "
            f"{r['restore_s'] * 1e3:.2f} ms ({r['restore_min_max'][0] * 1e3:.2f}-"
            f"{r['restore_min_max'][1] * 1e3:.2f}) | {r['restored_bytes'] / 2**20:.1f} | "
            f"{r['speedup']:.1f}x | {r['mlx_lm_load_s'] * 1e3:.2f} ms ({r['mlx_lm_load_min_max'][0] * 1e3:.2f}-"
            f"{r['mlx_lm_load_min_max'][1] * 1e3:.2f}) | {r['mlx_lm_load_s'] / r['restore_s']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Full defaults are scaled for a 2-core CPU, so that `kvstore bench` finishes in "
               "about 40 minutes: a 2-layer model and the two end formats (native, k4v4). With "
               "4 layers and all four formats this suite alone ran past an hour there (8K "
               "prefills at 4-6 GFLOP/s). On a bigger machine: python -m tools.bench.ttft "
               "--size 1b --formats native k8v8 k8v4 k4v4")
    parser.add_argument("--quick", action="store_true",
                        help="toy model, 256/512-token prompts, all four formats, 2 repeats")
    parser.add_argument("--size", choices=sorted(SIZES),
                        help="model: cpu (default: 2 layers, 7.3M parameters), quick (--quick), "
                             "1b (Llama-3.2-1B geometry, for a GPU), 8b (Llama-3.1-8B geometry: 32 "
                             "layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336; "
                             "for a GPU)")
    parser.add_argument("--prompts", type=int, nargs="+",
                        help="prompt lengths in tokens (default 512 2048 8192; --quick 256 512)")
    parser.add_argument("--formats", nargs="+", choices=ALL_FORMATS,
                        help=f"page formats (default {' '.join(FULL_FORMATS)}; --quick "
                             f"{' '.join(ALL_FORMATS)})")
    parser.add_argument("--repeats", type=int, help="interleaved repeats, medians (default 3; --quick 2)")
    parser.add_argument("--block-size", type=int, default=256, help="tokens per block (default 256)")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--profile-restore", metavar="PREFIX",
                        help="after each case's repeats, run its restore arm once more under "
                             "cProfile and write the stats to PREFIX.<format>.<tokens>.txt")
    args = parser.parse_args(argv)
    size = args.size or ("quick" if args.quick else "cpu")
    prompts = args.prompts or ([256, 512] if args.quick else [512, 2048, 8192])
    repeats = args.repeats or (2 if args.quick else 3)
    formats = args.formats or list(ALL_FORMATS if args.quick else FULL_FORMATS)
    rows = run(size, prompts, formats, repeats, args.block_size, args.profile_restore)
    params = rows[0]["params"] if rows else 0
    print(f"## Time to first token: store hit vs recompute\n\nmodel: llama-shaped `{size}` "
          f"({params / 1e6:.1f}M parameters, bf16), device {mx.default_device()}, block "
          f"{args.block_size} tokens, median of {repeats}, arms interleaved\n\n{machine_line()}\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
