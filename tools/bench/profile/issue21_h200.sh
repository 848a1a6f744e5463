#!/usr/bin/env bash
# Issue 21's H200 figure: tools/bench/server.py (stock mlx_lm.server against
# `kvstore serve-model` with the store: TTFT after a restart, throughput of 4 concurrent
# clients uncached) with the 8B-shaped model, in one device call. Run from the repository
# root; results and logs go to $OUT.
#
# Three calls, back to back (the machine forgets everything about 30 s after a call; 64 MiB
# carried per call, tree included, so the wheels travel in three parts; docs/server.md,
# "H200", "Third try"):
#   1. carry [".whl/a", ".whl/kt", "build/issue21-tree.tar.gz"]:
#        mkdir -p /root/p /root/clean && cp .whl/a/part00 /root/p/ && python3 -m pip install \
#          -q --no-index --no-deps --no-compile --target /root/kt .whl/kt/*.whl \
#          && tar xzf build/issue21-tree.tar.gz -C /root/clean
#   2. carry [".whl/kv"]:
#        python3 -m pip install -q --no-index --no-deps --no-compile --target /root/kt .whl/kv/*.whl
#   3. carry [".whl/b"]:
#        bash .whl/b/install-on-device.sh && export PYTHONPATH=/root/site:/root/kt:/root/clean \
#          && cd /root/clean && ISSUE21_NO_INSTALL=1 bash tools/bench/profile/issue21_h200.sh
# build/issue21-tree.tar.gz is the code to measure (git archive --format=tar HEAD kvstore
# engine kernels api tools pyproject.toml | gzip -9). .whl/kt: pydantic, openai, httpx and
# their small dependencies, truststore included (httpcore imports it); .whl/kv: transformers,
# tokenizers, huggingface_hub, typer, xxhash 4.x and the rest (numpy is the image's); MLX
# from .whl/b (../shared/gpu/README.md). Without ISSUE21_NO_INSTALL the script installs
# MLX and .whl/kv itself (the old two-call layout, which no longer fits 64 MiB).
# Locally (a CPU rehearsal of the same steps on a small model, PYTHONPATH already set):
#   ISSUE21_NO_INSTALL=1 SIZE=8b-rehearsal OUT=/tmp/i21 bash tools/bench/profile/issue21_h200.sh
#
# Settings (environment): SIZE (8b), REPEATS (3), ROUNDS (4), WARM_CONTEXTS (2048,8192),
# T2K and TW (timeouts in s of the 2K run, which also measures throughput, and of the
# warm-start run; 0 skips one). On the H200 each restart of an 8B-shaped server costs about
# 20 s (7 s to /health, 12-15 s of model load in the first request, the stop), so the 2K
# run is about 21 s x (1 + 2 REPEATS + 2) + 30 s of throughput rounds, the warm run about
# 23 s x (1 + 2 REPEATS) per context: REPEATS=1 ROUNDS=2 T2K=150 TW=160 fits one call
# with the 17 s model build and the install.
set -u
export PYTHONUNBUFFERED=1
SIZE=${SIZE:-8b}
REPEATS=${REPEATS:-3}
WARM_CONTEXTS=${WARM_CONTEXTS:-2048,8192}
ROUNDS=${ROUNDS:-4}
T2K=${T2K:-200}
TW=${TW:-200}
OUT=${OUT:-/tmp/issue21}
mkdir -p "$OUT"
began=$(date +%s)
say() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - began ))s] $*" | tee -a "$OUT/driver.log"; }

if [ -z "${ISSUE21_NO_INSTALL:-}" ]; then
  test -f /root/p/part00 || { say "COLD: /root/p/part00 missing (run call 1 first)"; exit 3; }
  test -d /root/kt/transformers || { say "COLD: /root/kt missing (run call 1 first)"; exit 3; }
  WHL=${WHL:-$PWD/.whl}
  (cd "$WHL/.." && bash .whl/b/install-on-device.sh) >> "$OUT/install.log" 2>&1 \
    || { say "MLX install failed"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/kt "$WHL"/kv/*.whl \
    >> "$OUT/install.log" 2>&1 || { say "pip install of .whl/kv failed"; exit 3; }
  export PYTHONPATH=/root/site:/root/kt:$PWD
fi
say "installed"
{
  nvidia-smi -L 2>&1
  python3 -c "import sys, mlx.core as mx, transformers, tokenizers, openai, xxhash, mlx_lm; \
print(sys.version.split()[0], 'mlx', mx.__version__, mx.default_device(), 'mlx_lm', mlx_lm.__version__, \
'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, \
'openai', openai.__version__, 'xxhash', xxhash.VERSION)" 2>&1 | grep -v PyTorch
  nproc; free -g; df -h /dev/shm /tmp
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

# the model directory in RAM when there is room for it (14 GB for 8b), else under /tmp
need_gb=$([ "$SIZE" = 8b ] && echo 20 || echo 1)
shm_gb=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [ -n "$shm_gb" ] && [ "$shm_gb" -ge "$need_gb" ]; then MODEL=/dev/shm/issue21-$SIZE
elif [ -z "${ISSUE21_NO_INSTALL:-}" ] && mkdir -p /root/ram \
    && mount -t tmpfs -o size=$((need_gb + 2))G tmpfs /root/ram 2>> "$OUT/device.txt"; then
  MODEL=/root/ram/issue21-$SIZE
else MODEL=/tmp/issue21-$SIZE; fi
say "model directory $MODEL"

bench() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  [ "$limit" -gt 0 ] || { say "$name skipped"; return; }
  say "$name: start (limit ${limit}s)"
  timeout -k 100 "$limit" python3 -m tools.bench.server --size "$SIZE" --model-dir "$MODEL" \
    --repeats "$REPEATS" --json "$OUT/$name.json" --logs "$OUT/logs_$name" "$@" \
    > "$OUT/$name.md" 2> "$OUT/$name.err"
  local rc=$?
  say "$name: rc=$rc"
  grep -v PyTorch "$OUT/$name.err" | tail -n 30
  cat "$OUT/$name.md"
}
# 2K: TTFT after a restart as the CPU bench measures it (the first request after /health,
# which waits for the model load), and throughput; then 2K and 8K with one warm-up
# request before the timed one (the prompt's own TTFT)
bench server_${SIZE}_2k "$T2K" --contexts 2048 --rounds "$ROUNDS"
bench server_${SIZE}_warm "$TW" --contexts "$WARM_CONTEXTS" --rounds 0 --warm-start
# what serve-model logged about the store (publications, drops, lookups), kept short
grep -h -i -E "write-behind|dropped|publish|restor|tier|error|Traceback" "$OUT"/logs_*/*.log \
  2>/dev/null | grep -v "GET /health" | sort | uniq -c | sort -rn | head -n 20
ls -la "$MODEL" > "$OUT/model_dir.txt" 2>&1
# one file: the device returns only a few files from $OUT, and the logs are what explains a crash
(cd "$OUT" && tar czf logs.tgz logs_* 2>/dev/null && rm -rf logs_*)
rm -rf "$MODEL"
say "done"
