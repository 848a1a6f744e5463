#!/usr/bin/env bash
# Issue 22 item 3 (decode end to end) on the H200 in one device call, after the two-call
# install of shared/gpu/README.md: the fused quantize kernel's tests first (one short run,
# so a compile error shows before anything long), then the kernel and packed-engine tests
# on CUDA, then tools/bench/engine for the 8B-shaped model at 8K and 32K (KVCache,
# QuantizedKVCache 4-bit, paged native, paged k4v4, with each arm's decode-step build
# profile), and k4v4 at 32K once more with the quantize kernel replaced by its mx.compile
# path (KVSTORE_QUANTIZE_IMPL=compiled, or $SECOND_QUANTIZE_IMPL, e.g. cuda-rotate), to see
# what the kernel buys. $TEST_PATHS, $ARMS and the *_LIMIT variables narrow a second run.
# Results go to $OUT.
set -u
OUT=${OUT:-/tmp/issue22}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/device.txt" 2>&1
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())" >> "$OUT/device.txt" 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider -rs tests/kernels/test_quantize.py > "$OUT/tests_quantize.txt" 2>&1
echo "rc=$?" >> "$OUT/tests_quantize.txt"
tail -3 "$OUT/tests_quantize.txt"
KVSTORE_TEST_IMPLS=cuda timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider -rs \
  ${TEST_PATHS:-tests/kernels tests/engine/test_packed.py} > "$OUT/tests.txt" 2>&1
echo "rc=$?" >> "$OUT/tests.txt"
tail -3 "$OUT/tests.txt"
ARMS=${ARMS:-"mlx-lm QuantizedKVCache 4-bit,paged native,paged k4v4"}
timeout "${BENCH_LIMIT:-200}" python3 -m tools.bench.engine --size llama-8b --contexts 8192,32768 \
  --prefill-step 2048 --decode 16 --profile --arms "$ARMS" --out "$OUT/engine_h200_llama8b.json" \
  > "$OUT/bench_8b.md" 2> "$OUT/bench_8b.err"
echo "rc=$?" >> "$OUT/bench_8b.err"
tail -12 "$OUT/bench_8b.md"
KVSTORE_QUANTIZE_IMPL=${SECOND_QUANTIZE_IMPL:-compiled} timeout "${COMPILED_LIMIT:-90}" python3 -m tools.bench.engine --size llama-8b \
  --contexts 32768 --prefill-step 2048 --decode 16 --arms "paged k4v4" \
  --out "$OUT/engine_h200_llama8b_32k_${SECOND_QUANTIZE_IMPL:-compiled}_quantize.json" > "$OUT/bench_compiled.md" 2> "$OUT/bench_compiled.err"
echo "rc=$?" >> "$OUT/bench_compiled.err"
tail -5 "$OUT/bench_compiled.md"
