#!/usr/bin/env bash
# Issue 22, packed prefill on the H200 in one device call, after the install of
# shared/gpu/README.md (carry .whl/b, .whl/pt with pytest and its deps, .whl/p22 with
# pytest-timeout, xxhash and the HTTP test's fastapi/httpx stack): the prefill, packed
# and publish/restore tests on CUDA (the cross-process restore = recompute cases
# included; failures printed, one line each), with ARMS_DIAGNOSTIC=1 the
# gathered/partitioned diagnostic with and without TF32, the one-layer prefill profile
# (tools/bench/profile/issue22_prefill.py), then tools/bench/engine's TTFT for the
# 8B-shaped model at 8K and 32K and the 1B-shaped one at 8K ($ARMS_8B, $ARMS_1B).
# The device returns at most 8 files from $OUT: the summaries go to stdout. mlx-lm imports
# transformers at load; where it is absent a stand-in with the names it imports is put
# first on PYTHONPATH (no tokenizer is used). Results go to $OUT.
set -u
OUT=${OUT:-/tmp/issue22p}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ ! -f /root/site/.issue22p ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site .whl/pt/*.whl .whl/p22/*.whl \
    > "$OUT/pip.txt" 2>&1 && touch /root/site/.issue22p
fi
. tools/bench/profile/transformers_stub.sh
nvidia-smi -L 2>&1
python3 -c "import mlx.core as mx, mlx_lm, numpy; print(mx.__version__, mx.default_device())" 2>&1
KVSTORE_TEST_IMPLS=cuda timeout "${TEST_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider -rfEs \
  --tb=line tests/kernels/test_prefill.py tests/engine/test_packed.py tests/engine/test_publish_restore.py \
  > "$OUT/tests.txt" 2>&1
echo "rc=$?" >> "$OUT/tests.txt"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|^E  |Error" "$OUT/tests.txt" | cut -c1-300 | head -60
if [ -n "${ARMS_DIAGNOSTIC:-}" ]; then
  timeout 30 python3 -m tools.bench.profile.issue22_prefill arms --out "$OUT/arms.json"
  MLX_ENABLE_TF32=0 timeout 30 python3 -m tools.bench.profile.issue22_prefill arms --out "$OUT/arms_tf32_off.json"
fi
timeout 40 python3 -m tools.bench.profile.issue22_prefill prefill --out "$OUT/prefill_profile.json" 2>&1 | tail -4
bench() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m tools.bench.engine --prefill-step 2048 --decode 4 \
    --out "$OUT/$name.json" "$@" > "$OUT/$name.md" 2> "$OUT/$name.err"
  echo "rc=$?" >> "$OUT/$name.err"
  grep -E "^(###|\| )" "$OUT/$name.md"; tail -3 "$OUT/$name.err"
}
bench engine_h200_llama8b_prefill "${BENCH_8B_LIMIT:-120}" --size llama-8b --contexts 8192,32768 \
  --arms "${ARMS_8B:-paged k4v4}"
bench engine_h200_llama1b_prefill "${BENCH_1B_LIMIT:-45}" --size llama-1b --contexts 8192 --repeats 2 \
  --arms "${ARMS_1B:-paged k4v4}"
