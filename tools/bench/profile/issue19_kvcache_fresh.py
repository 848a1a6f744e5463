"""The restore into KVCache layout against load_prompt_cache on this CPU, alternating,
with the first-touch faults of each counted (issue 19).

tools/bench/store.py interleaves 13 cases, so each restore's 512 MiB of fresh arrays
comes from memory that other cases freed seconds earlier; on this VM such memory goes
back to the host and the next first touch faults it in at a cost that varies from run to
run by 3x (docs/benchmarks.md, "2026-12-03"). This probe runs only the two arms, one
after the other, with a fixed idle gap before each (--sleep), and prints each arm's
median and every sample with its minor faults (getrusage), so that the cost of the
faults and the cost of the work can be told apart:

  default   MLX's CPU buffer cache as it is (32 MiB): each arm's arrays are fresh memory
  --warm    mx.set_cache_limit(2 GiB) for both arms: the arrays come from MLX's cache,
            no faults, and what is left is the work (our verified strided copy; the
            peer's file read)

Run it in each tree to compare them (the trees import from PYTHONPATH):
  PYTHONPATH=$PWD python3 tools/bench/profile/issue19_kvcache_fresh.py [--sleep 1] [--warm]
      [--rounds 6] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from engine import RestoreRequest, restore
from kvstore.store import Store
from tools.bench.store import FULL, NAMESPACE, Prefix, engine_model, save_prefix


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleep", type=float, default=1.0, help="idle seconds before each arm")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warm", action="store_true", help="MLX's CPU cache at 2 GiB: no faults")
    parser.add_argument("--profile", action="store_true", help="one more restore under cProfile")
    args = parser.parse_args(argv)
    if args.warm:
        mx.set_cache_limit(2**31)
    model = engine_model(FULL)
    prefix = Prefix(FULL, model.identity)
    root = Path(tempfile.mkdtemp(prefix="kvstore-probe-"))
    try:
        cache_file = str(root / "prompt.safetensors")
        save_prompt_cache(cache_file, prefix.kv_caches())
        request = RestoreRequest(prefix.tokens + [0], cache_kind="kvcache", namespace=NAMESPACE)
        samples: dict[str, list[tuple[float, int]]] = {"restore -> KVCache layout": [],
                                                        "load_prompt_cache + eval": []}
        with Store(root / "store") as store:
            save_prefix(store, prefix)
            for _ in range(args.rounds):
                for name in samples:
                    time.sleep(args.sleep)
                    faults, t0 = _minor_faults(), time.perf_counter()
                    if name.startswith("restore"):
                        out = restore(model, store, request).cache
                    else:
                        out = load_prompt_cache(cache_file)
                    mx.eval([c.state for c in out])
                    samples[name].append((time.perf_counter() - t0, _minor_faults() - faults))
                    del out
            for name, values in samples.items():
                median = statistics.median(s for s, _ in values)
                print(f"{name}: median {1e3 * median:.1f} ms; samples (ms, minor faults) "
                      f"{[(round(1e3 * s), f) for s, f in values]}")
            if args.profile:
                time.sleep(args.sleep)
                profile = cProfile.Profile()
                profile.enable()
                out = restore(model, store, request).cache
                profile.disable()
                del out
                pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
