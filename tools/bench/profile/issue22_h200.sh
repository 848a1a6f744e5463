#!/usr/bin/env bash
# Issue 22's H200 run in one device call (after the two-call install of shared/gpu/README.md):
# the kernel tests on CUDA (the shared split_queries.h / split_softmax.h text and the
# dequantized prefill path), then tools/bench/engine for the 1B- and 8B-shaped models at
# 2K/8K/32K. Results go to $OUT (JSON after each context, so a timeout keeps what ran).
set -u
OUT=${OUT:-/tmp/issue22}
mkdir -p "$OUT"
nvidia-smi -L > "$OUT/device.txt" 2>&1
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device())" >> "$OUT/device.txt" 2>&1
KVSTORE_TEST_IMPLS=cuda timeout 170 python3 -m pytest -q -p no:cacheprovider -rs \
  tests/kernels tests/engine/test_packed.py > "$OUT/tests.txt" 2>&1
echo "tests rc=$?" >> "$OUT/tests.txt"
bench() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m tools.bench.engine --prefill-step 2048 --decode 16 \
    --out "$OUT/$name.json" "$@" > "$OUT/$name.md" 2> "$OUT/$name.err"
  echo "rc=$?" >> "$OUT/$name.err"
}
bench bench_1b 110 --size llama-1b --contexts 2048,8192,32768
bench bench_8b_short 90 --size llama-8b --contexts 2048,8192
bench bench_8b_32k 170 --size llama-8b --contexts 32768
