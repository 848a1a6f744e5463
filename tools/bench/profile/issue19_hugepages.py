"""Issue 19, CPU: what the first touch of a KVCache-layout restore's fresh arrays costs,
with 4 KiB pages against transparent huge pages asked for by madvise.

A restore into mlx-lm's KVCache layout allocates its per-layer arrays fresh
(engine/pagecopy.py uninitialised) and writes every byte once; the arrays are new
memory, so that write takes one page fault per 4 KiB (131k per 512 MiB). Where the
kernel's transparent huge pages are in "madvise" mode (/sys/kernel/mm/transparent_hugepage/
enabled), MADV_HUGEPAGE on the fresh range lets each fault map 2 MiB instead.

Arms, interleaved (the order alternates every round), each allocating --arrays arrays of
[1, 8, --tokens, 128] bf16 through uninitialised() and filling them by numpy copies on
the restore's worker threads, then freeing them:
  4k      as the engine did before (no madvise)
  huge    madvise(MADV_HUGEPAGE) on each array before its first write
Per arm: median ms, and minor faults per sample (getrusage). From the repository root:

  PYTHONPATH=$PWD python tools/bench/profile/issue19_hugepages.py [--rounds 9] [--json F]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

import engine.pagecopy as pagecopy


def sample(arrays: int, tokens: int, source: np.ndarray, huge: bool) -> tuple[float, int]:
    saved = pagecopy.HUGE_PAGES
    pagecopy.HUGE_PAGES = huge
    try:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        out = pagecopy.uninitialised({f"a{i}": (1, 8, tokens, 128) for i in range(arrays)},
                                     {f"a{i}": mx.bfloat16 for i in range(arrays)})
        copies = pagecopy.PageCopies()
        for a in out.values():
            copies.add_pairs([(pagecopy.host_view(a).reshape(-1), source)])  # (target, source)
        copies.run()
        seconds = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    finally:
        pagecopy.HUGE_PAGES = saved
    del out
    return seconds, faults


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arrays", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        mode = f.read().strip()
    source = np.random.default_rng(0).integers(0, 255, 8 * args.tokens * 128 * 2, dtype=np.uint8)
    samples: dict[str, list[tuple[float, int]]] = {"4k": [], "huge": []}
    for r in range(args.rounds + 1):
        order = ["4k", "huge"] if r % 2 else ["huge", "4k"]
        for arm in order:
            s = sample(args.arrays, args.tokens, source, arm == "huge")
            if r:  # round 0 warms both
                samples[arm].append(s)
    mib = args.arrays * 8 * args.tokens * 128 * 2 / 2**20
    out = {"transparent_hugepage": mode, "mib": mib, "rounds": args.rounds}
    print(f"transparent_hugepage: {mode}; {args.arrays} arrays, {mib:.0f} MiB per sample")
    for arm, values in samples.items():
        ms = statistics.median(1e3 * s for s, _ in values)
        faults = statistics.median(f for _, f in values)
        out[arm] = {"median_ms": ms, "ms": [1e3 * s for s, _ in values], "median_faults": faults}
        print(f"{arm:5s} {ms:8.1f} ms  {faults:8.0f} faults  "
              f"(min {1e3 * min(s for s, _ in values):.1f}, max {1e3 * max(s for s, _ in values):.1f})")
    print(f"4k / huge: {out['4k']['median_ms'] / out['huge']['median_ms']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
