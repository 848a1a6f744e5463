#!/usr/bin/env bash
# Issue 22 on a GPU (H200 or H100), one device call after the MLX install of
# /work/shared/gpu/README.md (done here if /root/site is missing and .whl/b is carried):
#   1. the CUDA tests of the pool's writes, the paged cache and packed prefill (TT s;
#      $TEST_FILES picks the files);
#   2. tools/bench/profile/issue22_chunk_writes.py: --writes (write_blocks alone, one
#      8B-shaped layer's 2048-token chunk, both ways), then prefill TTFT with a chunk's blocks
#      written by slice updates against scatters, arms interleaved, 8B-shaped at
#      $CONTEXTS_8B (8192) and 1B-shaped at 8192, $ROUNDS (7) rounds (T8 / T1 s);
#   3. with GROUP_PROBE=1, tools/bench/profile/issue19_groups.py --sizes 1b (TG s).
# Everything goes to $OUT/chunk_writes.tgz; the summaries to stdout.
set -u
export PYTHONUNBUFFERED=1
if [ ! -d /root/site/mlx ]; then bash .whl/b/install-on-device.sh || exit 3; fi
export PYTHONPATH=/root/site:$PWD
. tools/bench/profile/transformers_stub.sh
OUT=${OUT:-/tmp/issue22c}
mkdir -p "$OUT/r"
KVSTORE_TEST_IMPLS=cuda timeout ${TT:-120} python3 -m pytest -q -p no:cacheprovider -rfE --tb=line \
  ${TEST_FILES:-tests/engine/test_pool.py tests/engine/test_cache.py tests/engine/test_packed.py} \
  > "$OUT/r/tests.log" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/r/tests.log" | cut -c1-300 | head -20
probe() {  # name, limit, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 tools/bench/profile/issue22_chunk_writes.py --rounds ${ROUNDS:-7} \
    --json "$OUT/r/$name.json" "$@" > "$OUT/r/$name.log" 2>&1
  echo "$name rc=$?"; cat "$OUT/r/$name.log"
}
probe chunk_writes_ops 60 --writes --rounds 15
probe chunk_writes_8b ${T8:-200} --size llama-8b --contexts ${CONTEXTS_8B:-8192}
probe chunk_writes_1b ${T1:-100} --size llama-1b --contexts 8192
if [ "${GROUP_PROBE:-0}" = 1 ]; then
  timeout ${TG:-100} python3 tools/bench/profile/issue19_groups.py --sizes 1b --rounds ${GROUP_ROUNDS:-25} \
    --json "$OUT/r/groups_1b.json" > "$OUT/r/groups_1b.log" 2>&1; echo "groups rc=$?"; cat "$OUT/r/groups_1b.log"
fi
(cd "$OUT/r" && tar czf "$OUT/chunk_writes.tgz" .)
