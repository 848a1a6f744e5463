#!/usr/bin/env bash
# Issue 19 on the H200, old tree against the working tree (run from the repository root
# on the device machine, after the MLX install of /work/shared/gpu/README.md; results
# and logs under $OUT):
#   1. tools/bench/profile/issue19_groups.py: the device restore's read variants,
#      interleaved (8B- and 1B-shaped prefixes at 8K);
#   2. the ttft bench, native 8K, alternating processes of this tree (B) and of the
#      tree in build/old-tree.tar.gz (A: `git archive <commit> | gzip`, carried):
#      8B: (B A) x N8 (3), 1B: (B A) x N1 (2). Each process: --repeats $REPEATS (5), arms
#      interleaved inside it; B's processes also write a cProfile of one restore arm.
#      The logs and JSON go to $OUT/ab.tgz.
# Time limits (seconds): TG (probe; 0 skips it), T8, T1 per process.
set -u
export PYTHONUNBUFFERED=1
SITE=/root/site
if [ -f build/old-tree.tar.gz ] && [ ! -d /root/old ]; then
  mkdir -p /root/old && tar xzf build/old-tree.tar.gz -C /root/old
fi
PYTHONPATH=$SITE python3 -c "import mlx.core as mx, os; print('mlx', mx.__version__, mx.default_device(), os.cpu_count(), 'CPUs')"
if [ "${TG:-120}" != 0 ]; then
  PYTHONPATH=$SITE:$PWD timeout ${TG:-120} python3 tools/bench/profile/issue19_groups.py --rounds ${ROUNDS:-7} \
    --json "$OUT/groups.json" > "$OUT/groups.log" 2>&1; echo "groups rc=$?"; cat "$OUT/groups.log"
fi
ttft() {  # ttft <label> <tree> <size> <time limit> [more ttft arguments]
  local label=$1 tree=$2 size=$3 limit=$4; shift 4
  (cd "$tree" && PYTHONPATH=$SITE:$tree timeout "$limit" python3 -m tools.bench.ttft --size "$size" --prompts 8192 \
    --formats native --repeats ${REPEATS:-5} --json "$OUT/ttft_$label.json" "$@" > "$OUT/ttft_$label.log" 2>&1)
  echo "ttft $label rc=$?"; grep -E "tokens:" "$OUT/ttft_$label.log"
}
for i in $(seq ${N8:-3}); do
  ttft 8b_B$i "$PWD" 8b ${T8:-110} --profile-restore "$OUT/ttft_profile_8b_B$i"
  ttft 8b_A$i /root/old 8b ${T8:-110}
done
for i in $(seq ${N1:-2}); do
  ttft 1b_B$i "$PWD" 1b ${T1:-60} --profile-restore "$OUT/ttft_profile_1b_B$i"
  ttft 1b_A$i /root/old 1b ${T1:-60}
done
(cd "$OUT" && tar czf ab.tgz ttft_* $(ls groups.json 2>/dev/null) && rm -f ttft_*)
