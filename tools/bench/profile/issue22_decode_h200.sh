#!/usr/bin/env bash
# Issue 22 item 3 (decode end to end) on the H200 in one device call, after the two-call
# install of shared/gpu/README.md. The benchmark first (the figure that counts), then the
# tests on CUDA in what is left of the call:
#   1. tools/bench/engine's measure() for the 8B-shaped model at 8K and 32K, one model build
#      for every arm (KVCache, QuantizedKVCache 4-bit, paged native with the default kernel
#      and with the lane-group kernel (KVSTORE_DIRECT_NATIVE_MMA=0), paged k4v4 with the
#      default quantize-on-write and with cuda-rotate), each arm with its decode-step build
#      profile, $REPEATS rounds with the arms taking turns; ratios against KVCache of the same
#      round; the "inline sources" arms hand the kernel texts to MLX whole
#      (KVSTORE_KERNEL_DIR=inline, kernel objects made afresh when that changes between arms).
#      JSON to $OUT/engine_h200_llama8b_decode.json.
#   2. KVSTORE_TEST_IMPLS=cuda pytest of $TEST_PATHS (default: the decode kernels' tests and
#      tests/engine/test_cache.py; $TEST_K: pytest -k), cut at $TEST_LIMIT seconds.
# $CONTEXTS, $REPEATS, $VARIANTS (arm names joined by ";"), $SIZE and the *_LIMITs narrow a run.
set -u
OUT=${OUT:-/tmp/issue22}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/device.txt" 2>&1
timeout "${BENCH_LIMIT:-300}" python3 - "$OUT" "${CONTEXTS:-8192,32768}" "${REPEATS:-2}" "${VARIANTS:-all}" "${SIZE:-llama-8b}" \
  > "$OUT/bench.md" 2> "$OUT/bench.err" <<'EOF'
import json, os, statistics, sys, time
import mlx.core as mx
from engine import KVPolicy, installed, make_cache
from kernels.attention import forget_compiled_kernels
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from tools.bench import engine as bench

out, contexts, repeats, variants, size = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4], sys.argv[5]
began = time.time()
model, params = bench.build_model(size, mx.bfloat16)
print(f"model built in {time.time() - began:.1f} s ({params / 1e9:.2f}B)", file=sys.stderr)
layers = len(model.layers)
policy = lambda name: KVPolicy(default_format=name, block_size_tokens=128)
# (arm, factory, environment while it runs)
arms = [
    ("mlx-lm KVCache", lambda: [KVCache() for _ in range(layers)], {}),
    ("mlx-lm QuantizedKVCache 4-bit", lambda: [QuantizedKVCache(64, 4) for _ in range(layers)], {}),
    ("paged native", lambda: make_cache(model, policy("native")), {}),
    ("paged native, lane kernel", lambda: make_cache(model, policy("native")), {"KVSTORE_DIRECT_NATIVE_MMA": "0"}),
    ("paged k4v4", lambda: make_cache(model, policy("k4v4")), {}),
    ("paged k4v4, cuda-rotate", lambda: make_cache(model, policy("k4v4")), {"KVSTORE_QUANTIZE_IMPL": "cuda-rotate"}),
    # the kernel texts handed to MLX whole on every call, as before kernels/sources.nvrtc_text
    ("paged native, inline sources", lambda: make_cache(model, policy("native")), {"KVSTORE_KERNEL_DIR": "inline"}),
    ("paged k4v4, inline sources", lambda: make_cache(model, policy("k4v4")), {"KVSTORE_KERNEL_DIR": "inline"}),
]


kernel_dir = None  # the arms' $KVSTORE_KERNEL_DIR, read when a kernel object is made
if variants != "all":
    arms = [a for a in arms if a[0] in variants.split(";") or a[0] == "mlx-lm KVCache"]
report = {"size": size, "params": params, "decode": 16, "prefill_step": 2048, "block_size": 128,
          "device": str(mx.default_device()), "repeats": repeats, "contexts": {}}
with installed(model):
    for context in contexts:
        prompt = mx.random.randint(0, bench.SIZES[size]["vocab_size"], (context,), dtype=mx.int32)
        rounds = {name: [] for name, _, _ in arms}
        for repeat in range(repeats):
            # KVCache first; the other arms in reverse order every other round
            for name, factory, env in (arms if repeat % 2 == 0 else arms[:1] + arms[:0:-1]):
                if env.get("KVSTORE_KERNEL_DIR") != kernel_dir:
                    forget_compiled_kernels()  # the next arm makes its own under its environment
                    kernel_dir = env.get("KVSTORE_KERNEL_DIR")
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    rounds[name].append(bench.safe_measure(model, factory, prompt, 16, 2048, repeat == 0))
                finally:
                    for k, v in saved.items():
                        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
                mx.clear_cache()
                print(f"{context} repeat {repeat}: {name} {time.time() - began:.0f} s", file=sys.stderr)
        results = {}
        for name, runs in rounds.items():
            r = bench.median_result(runs)
            if "error" not in r:
                base = rounds["mlx-lm KVCache"]
                r["x_kvcache_decode_by_round"] = [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(runs, base)]
                r["x_kvcache_overlap_by_round"] = [a["decode_overlap_tok_s"] / b["decode_overlap_tok_s"] for a, b in zip(runs, base)]
                r["decode_tok_s_by_round"] = [a["decode_tok_s"] for a in runs]
            results[name] = r
        report["contexts"][context] = results
        with open(f"{out}/engine_h200_llama8b_decode.json", "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"### context {context}\n\n" + bench.table(results, "mlx-lm KVCache") + "\n")
        for name, r in results.items():
            if "error" not in r:
                print(f"- {name}: decode x by round {[round(x, 3) for x in r['x_kvcache_decode_by_round']]}, "
                      f"overlapped x {[round(x, 3) for x in r['x_kvcache_overlap_by_round']]}, "
                      f"build {r['decode_build_ms']:.2f} ms, eval {r['decode_eval_ms']:.2f} ms")
        print()
EOF
echo "rc=$?" >> "$OUT/bench.err"
cat "$OUT/bench.md"
tail -3 "$OUT/bench.err"
# -v: a run cut by $TEST_LIMIT still says which tests passed; $TEST_K narrows it (pytest -k)
KVSTORE_TEST_IMPLS=cuda timeout "${TEST_LIMIT:-150}" python3 -m pytest -v -p no:cacheprovider -rs \
  ${TEST_PATHS:-tests/kernels/test_native_mma.py tests/kernels/test_call.py tests/engine/test_cache.py tests/kernels/test_quantize.py tests/kernels/test_attention.py} \
  ${TEST_K:+-k "$TEST_K"} > "$OUT/tests.txt" 2>&1
echo "rc=$?" >> "$OUT/tests.txt"
grep -c PASSED "$OUT/tests.txt"; grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.txt" | tail -12
