#!/usr/bin/env bash
# Issue 19 on the H200 (run from the repository root on the device machine; results
# and logs under $OUT): TTFT for the 8B-shaped and 1B models at 8K (native, k4v4), then
# tools/bench/profile/restore_h200.py (hashing; the restore's stages at 1 GiB: verified
# reads, host copies, the device's part, and those pieces alone). Installs MLX into
# /root/site first if it is missing (.whl/b carried, part one already in /root/p:
# /work/shared/gpu/README.md). python-xxhash: the image's (4.0.1, releases the GIL while
# hashing); where .whl/c is carried, the wheel in it goes to /root/xx and is used instead.
# Time limits per step (seconds): T8, T1, TP; FORMATS: the ttft formats; SECTIONS: the
# probe's sections.
set -u
export PYTHONUNBUFFERED=1
if [ ! -d /root/site/mlx ]; then bash .whl/b/install-on-device.sh || exit 3; fi
if [ -d .whl/c ] && [ ! -d /root/xx/xxhash ]; then
  python3 -m pip install -q --no-index --no-deps --target /root/xx .whl/c/*.whl
fi
export PYTHONPATH=/root/xx:/root/site:$PWD
python3 -c "import xxhash, numpy, os, mlx.core as mx; print('xxhash', xxhash.VERSION, 'numpy', numpy.__version__, os.cpu_count(), 'CPUs', 'mlx', mx.__version__)"
timeout ${T8:-150} python3 -m tools.bench.ttft --size 8b --prompts 8192 --formats ${FORMATS:-native k4v4} --repeats 3 \
  --json "$OUT/ttft_8b.json" > "$OUT/ttft_8b.log" 2>&1; echo "ttft 8b rc=$?"
tail -n 4 "$OUT/ttft_8b.log"
timeout ${T1:-80} python3 -m tools.bench.ttft --size 1b --prompts 8192 --formats ${FORMATS:-native k4v4} --repeats 3 \
  --json "$OUT/ttft_1b.json" > "$OUT/ttft_1b.log" 2>&1; echo "ttft 1b rc=$?"
tail -n 4 "$OUT/ttft_1b.log"
timeout ${TP:-60} python3 tools/bench/profile/restore_h200.py --sections ${SECTIONS:-stages hashing} \
  --json "$OUT/probe.json" > "$OUT/probe.log" 2>&1
echo "probe rc=$?"; grep -v "^ " "$OUT/probe.log" | head -8
