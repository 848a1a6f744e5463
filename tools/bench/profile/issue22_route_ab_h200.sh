#!/usr/bin/env bash
# Issue 22, decode end to end: this tree against an older one on the H200, alternating
# processes, after the two-call install of shared/gpu/README.md. Each round runs
# tools/bench/profile/issue22_decode_h200.sh (benchmark only) from this tree, then from the
# tree in $OLD_TAR (a `git archive` of the older commit, extracted to /tmp/oldtree), so a
# change of the machine's speed between processes falls on both trees alike. Ratios are
# against KVCache within each process. JSON: $OUT/{new,old}<round>/engine_h200_llama8b_decode.json.
# $ORDER ("new old" by default) is the order within a round.
#   OLD_TAR=old.tar ROUNDS=2 VARIANTS="paged native;paged k4v4" CONTEXTS=32768,8192 bash tools/bench/profile/issue22_route_ab_h200.sh
set -u
OUT=${OUT:-/tmp/issue22_ab}
NEW=$PWD
mkdir -p "$OUT" /tmp/oldtree && tar -xf "${OLD_TAR:-old.tar}" -C /tmp/oldtree
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in ${ORDER:-new old}; do
    dir=$NEW; [ "$tree" = old ] && dir=/tmp/oldtree
    (cd "$dir" && PYTHONPATH=/root/site:$dir OUT=$OUT/$tree$round REPEATS=${REPEATS:-2} \
       TEST_LIMIT=1 TEST_PATHS=tests/kernels/test_call.py bash tools/bench/profile/issue22_decode_h200.sh \
       > "$OUT/$tree$round.log" 2>&1)
    grep -E "^- paged|^### " "$OUT/$tree$round/bench.md" | sed "s/^/$tree$round /"
  done
done
