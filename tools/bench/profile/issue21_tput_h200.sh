#!/usr/bin/env bash
# Issue 21's H200 throughput rerun alone (no TTFT part): tools.bench.server's 4-client
# uncached throughput (96 tokens a request), 3 untimed warm-up rounds then 10 ABBA rounds, once with `--publish-segments ""` (publish nothing)
# and once with the defaults; each run's server logs come back as $OUT/logs-<tag>.tgz.
# Needs the first two of the three calls in docs/server.md, "H200", "Third try" (the tree
# in /root/clean, .whl/kt and .whl/kv in /root/kt; MLX from .whl/b is installed here when
# /root/site lacks it), then: carry [".whl/b"] and run
#   bash tools/bench/profile/issue21_tput_h200.sh
# About 100 s with the 8B model build (2026-12-02: 0.91x with nothing published, 0.51x
# with the defaults; docs/server.md "H200").
set -u
export PYTHONUNBUFFERED=1
test -d /root/site/mlx || bash .whl/b/install-on-device.sh > $OUT/install.log 2>&1 || { tail -5 $OUT/install.log; exit 3; }
export PYTHONPATH=/root/site:/root/kt:/root/clean
cd /root/clean
ulimit -c 0
timeout -k 30 300 python3 - <<'PY' > $OUT/tput.md 2> $OUT/tput.err
import json, os, sys, tempfile
from pathlib import Path
from tools.bench import server as b
work = Path(tempfile.mkdtemp(prefix="tput-"))
print(work, file=sys.stderr, flush=True)
base = b.SERVE_ARGS["8b"]
for tag, extra in (("nopublish", ("--publish-segments", "")), ("default", ())):
    b.SERVE_ARGS["8b"] = base + extra
    w = work / tag
    w.mkdir()
    try:
        r = b.run("8b", [], 1, 4, 96, w, 10, model_dir=Path("/dev/shm/m8b"), warmup_rounds=3)
        print(tag, json.dumps(r.get("throughput"), indent=1), flush=True)
    finally:
        os.system(f"cd {w} && tar czf {os.environ['OUT']}/logs-{tag}.tgz logs")
PY
echo rc=$?
tail -25 $OUT/tput.err | cut -c1-300
cat $OUT/tput.md
