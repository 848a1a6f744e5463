#!/usr/bin/env bash
# Issue 19 on the H200: the restore that leaves the pages' xxh3-128 to the GPU
# (kernels/page_hash.py, kvstore/deferred.py). Run from the repository root on the device
# machine, after the MLX install of /work/shared/gpu/README.md (done here if /root/site is
# missing and .whl/b is carried); results and logs under $OUT:
#   1. the CUDA tests of the kernel and of the restore that uses it (KVSTORE_TEST_IMPLS=cuda);
#   2. the kernel alone: 1 GiB of 1 MiB rows hashed per layer (32 calls of 32 rows) and in
#      one call, median of 5, against one device copy of the same bytes;
#   3. tools/bench/profile/issue19_groups.py: the restore with device hashes against host
#      hashes, and the group sizes, interleaved.
# Time limits (seconds): TT (tests), TK (kernel), TG (probe).
set -u
export PYTHONUNBUFFERED=1
if [ ! -d /root/site/mlx ]; then bash .whl/b/install-on-device.sh || exit 3; fi
export PYTHONPATH=/root/site:$PWD
OUT=${OUT:-/tmp/issue19}
mkdir -p "$OUT"
KVSTORE_TEST_IMPLS=cuda timeout ${TT:-150} python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_page_hash.py tests/kvstore/test_deferred.py tests/engine/test_device_restore.py \
  tests/engine/test_pagecopy.py > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -n 15 "$OUT/tests.log"
timeout ${TK:-60} python3 - > "$OUT/kernel.log" 2>&1 <<'PY'
import statistics, time
import mlx.core as mx
from engine.pagecopy import device_copy
from kernels.page_hash import page_hashes
rows = mx.random.randint(0, 256, (1024 * 2**20,), dtype=mx.uint8)
mx.eval(rows)
def timed(fn):
    samples = []
    for _ in range(6):
        mx.synchronize(); t = time.perf_counter(); mx.eval(fn()); mx.synchronize()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples[1:]) * 1e3
layer = 32 * 2**20
per_layer = lambda: [page_hashes(rows[i * layer:(i + 1) * layer], 2**20, [2**20] * 32) for i in range(32)]
print(f"page_hashes 1 GiB, 32 calls of 32 x 1 MiB: {timed(per_layer):.2f} ms")
print(f"page_hashes 1 GiB, one call of 1024 x 1 MiB: {timed(lambda: page_hashes(rows, 2**20, [2**20] * 1024)):.2f} ms")
print(f"device_copy 1 GiB (device to device): {timed(lambda: device_copy(rows)):.2f} ms")
PY
echo "kernel rc=$?"; cat "$OUT/kernel.log"
timeout ${TG:-150} python3 tools/bench/profile/issue19_groups.py --rounds ${ROUNDS:-5} \
  --json "$OUT/groups.json" > "$OUT/groups.log" 2>&1; echo "groups rc=$?"; cat "$OUT/groups.log"
