#!/usr/bin/env bash
# Issue 19 on the H200 (or H100): where the device restore's time goes, the read's group
# sizes, and TTFT against an older tree. Run from the repository root on the
# device machine, after the MLX install of /work/shared/gpu/README.md (done here if
# /root/site is missing and .whl/b is carried); results and logs under $OUT. Each step
# runs when its switch is 1 (GROUP_PROBE, not GROUPS: bash's own GROUPS ignores assignment):
#   TESTS  the CUDA tests of the page hash kernel, the deferred store read and the
#          device restore (TT seconds);
#   PHASES tools/bench/profile/issue19_phases.py: the restore's phases and the copy
#          limits, 8B- and 1B-shaped at 8K (TP seconds); LAG=1 adds its --lag pass;
#   GROUP_PROBE tools/bench/profile/issue19_groups.py: group sizes, host hashes, readers (TG);
#   K4     the ttft bench of this tree, k4v4 pages, 1B and 8B at 8K (TK per process);
#   AB     tools/bench/profile/issue19_ab_h200.sh without its groups probe: native TTFT
#          of this tree against build/old-tree.tar.gz, N8 / N1 process pairs.
set -u
export PYTHONUNBUFFERED=1
if [ ! -d /root/site/mlx ]; then bash .whl/b/install-on-device.sh || exit 3; fi
export PYTHONPATH=/root/site:$PWD
OUT=${OUT:-/tmp/issue19}
export OUT
mkdir -p "$OUT"
if [ "${TESTS:-1}" = 1 ]; then
  KVSTORE_TEST_IMPLS=cuda timeout ${TT:-150} python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_page_hash.py tests/kvstore/test_deferred.py tests/engine/test_device_restore.py \
    tests/engine/test_pageread.py > "$OUT/tests.log" 2>&1; echo "tests rc=$?"; tail -n 4 "$OUT/tests.log"
fi
if [ "${PHASES:-1}" = 1 ]; then
  timeout ${TP:-150} python3 tools/bench/profile/issue19_phases.py --rounds ${ROUNDS:-7} \
    $([ "${LAG:-0}" = 1 ] && echo --lag) --json "$OUT/phases.json" > "$OUT/phases.log" 2>&1; echo "phases rc=$?"; cat "$OUT/phases.log"
fi
if [ "${GROUP_PROBE:-1}" = 1 ]; then
  timeout ${TG:-150} python3 tools/bench/profile/issue19_groups.py --rounds ${ROUNDS:-7} \
    --json "$OUT/groups.json" > "$OUT/groups.log" 2>&1; echo "groups rc=$?"; cat "$OUT/groups.log"
fi
if [ "${K4:-0}" = 1 ]; then
  for size in 1b 8b; do
    timeout ${TK:-150} python3 -m tools.bench.ttft --size $size --prompts 8192 --formats k4v4 \
      --repeats ${REPEATS:-5} --json "$OUT/ttft_k4v4_$size.json" > "$OUT/ttft_k4v4_$size.log" 2>&1
    echo "ttft k4v4 $size rc=$?"; grep -E "tokens:" "$OUT/ttft_k4v4_$size.log"
  done
fi
if [ "${AB:-0}" = 1 ]; then TG=0 bash tools/bench/profile/issue19_ab_h200.sh; fi
