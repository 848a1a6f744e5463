#!/usr/bin/env bash
# Issue 19 on the H200 (run from the repository root on the device machine; results
# and logs under $OUT): TTFT for the 8B-shaped and 1B models at 8K (native, k4v4), then
# tools/bench/profile/restore_h200.py (hashing, host -> device transfers, a restore's
# profile). Installs MLX into /root/site first if it is missing (.whl/b carried, part
# one already in /root/p: /work/shared/gpu/README.md), and python-xxhash 4.1.0 (.whl/c)
# into /root/xx: 4.x releases the GIL while hashing, 3.x does not.
set -u
export PYTHONUNBUFFERED=1
if [ ! -d /root/site/mlx ]; then bash .whl/b/install-on-device.sh || exit 3; fi
if [ -d .whl/c ] && [ ! -d /root/xx/xxhash ]; then
  python3 -m pip install -q --no-index --no-deps --target /root/xx .whl/c/*.whl
fi
BASE=/root/site:$PWD
PYTHONPATH=$BASE python3 -c "import xxhash, numpy, os; print('image xxhash', xxhash.VERSION, 'numpy', numpy.__version__, os.cpu_count(), 'CPUs')"
export PYTHONPATH=/root/xx:$BASE
python3 -c "import xxhash; print('xxhash used', xxhash.VERSION)"
timeout ${T8:-150} python3 -m tools.bench.ttft --size 8b --prompts 8192 --formats native k4v4 --repeats 3 \
  --json "$OUT/ttft_8b.json" > "$OUT/ttft_8b.log" 2>&1; echo "ttft 8b rc=$?"
tail -n 4 "$OUT/ttft_8b.log"
timeout ${T1:-90} python3 -m tools.bench.ttft --size 1b --prompts 8192 --formats native k4v4 --repeats 3 \
  --json "$OUT/ttft_1b.json" > "$OUT/ttft_1b.log" 2>&1; echo "ttft 1b rc=$?"
tail -n 4 "$OUT/ttft_1b.log"
timeout ${TP:-90} python3 tools/bench/profile/restore_h200.py --json "$OUT/probe.json" > "$OUT/probe.log" 2>&1
echo "probe rc=$?"; grep -v "^ " "$OUT/probe.log" | head -12
PYTHONPATH=$BASE timeout 30 python3 tools/bench/profile/restore_h200.py --sections hashing 2>&1 | tail -1
