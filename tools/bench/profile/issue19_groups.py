"""Run on the H200: the device restore's read, variant by variant, interleaved (issue 19).

The engine restore into pools of an 8B-shaped prefix at 8192 tokens (1 GiB: 32 layers
of 8 KV heads of 128, block 256) and a 1B-shaped one (256 MiB: 16 layers of 8 heads of
64), from an embedded Store, timed as the ttft bench's restore arm sees it: restore()
returning (host) and then mx.synchronize (the device's tail). Variants, in rotation
within each round so that a slow moment of the machine falls on all of them:

  G MiB groups      each group of layers of at least G MiB read into the pools' staging
                    rows by engine/pageread.py read_into (64 MiB of pages per get_pages
                    on 8 threads), its device copies started before the next group is
                    read (engine/restore.py DEVICE_READ_GROUP_NBYTES, with
                    DEVICE_READ_LAST_NBYTES None; 256 MiB is the committed path);
                    the device hashes the pages it copied
                    (restore.HASH_ON_DEVICE, the default on CUDA: kernels/page_hash.py)
  tapered to T MiB  the same, the groups laid out from the end: a last group of at
                    least T MiB, each one before it twice the one after it, up to 256 MiB
                    (DEVICE_READ_LAST_NBYTES)
  ..., host hashes  the host verifies every page before it copies it (HASH_ON_DEVICE off)

Medians over --rounds. From the repository root:
  PYTHONPATH=$PWD python3 tools/bench/profile/issue19_groups.py [--rounds 7] [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import mlx.core as mx

from engine import RestoreRequest, restore
from kvstore.store import Store
from tools.bench.store import Prefix, Shape, engine_model, save_prefix

SHAPES = {
    "8b": Shape(layers=32, kv_heads=8, head_dim=128, tokens=8192, block_size_tokens=256),
    "1b": Shape(layers=16, kv_heads=8, head_dim=64, tokens=8192, block_size_tokens=256),
}
QUICK = Shape(layers=4, kv_heads=8, head_dim=64, tokens=1024, block_size_tokens=256)
MiB = 2**20
# (name, DEVICE_READ_GROUP_NBYTES, DEVICE_READ_LAST_NBYTES, HASH_ON_DEVICE)
VARIANTS = (("256 MiB groups", 256 * MiB, None, True), ("tapered to 32 MiB", 256 * MiB, 32 * MiB, True),
            ("tapered to 16 MiB", 256 * MiB, 16 * MiB, True), ("tapered to 64 MiB", 256 * MiB, 64 * MiB, True),
            ("128 MiB groups", 128 * MiB, None, True),
            ("tapered to 32 MiB, host hashes", 256 * MiB, 32 * MiB, False))
SETTINGS = ("DEVICE_READ_GROUP_NBYTES", "DEVICE_READ_LAST_NBYTES", "HASH_ON_DEVICE")


def run_shape(shape: Shape, rounds: int) -> dict:
    restore_mod = sys.modules["engine.restore"]  # the package's `restore` names the function
    model = engine_model(shape)
    prefix = Prefix(shape, model.identity)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in VARIANTS}
    defaults = [getattr(restore_mod, name) for name in SETTINGS]
    with tempfile.TemporaryDirectory() as tmp, Store(f"{tmp}/store") as store:
        save_prefix(store, prefix)
        request = RestoreRequest(prefix.tokens + [0], namespace="bench")

        def once() -> tuple[float, float]:
            t0 = time.perf_counter()
            result = restore(model, store, request)
            t1 = time.perf_counter()
            mx.synchronize()
            t2 = time.perf_counter()
            assert result.tokens_restored == shape.tokens, result.tokens_restored
            for c in result.cache:
                c.free()
            return t1 - t0, t2 - t1

        try:
            for r in range(rounds + 1):  # round 0 warms every variant up, untimed
                for name, *settings in VARIANTS:
                    for setting, value in zip(SETTINGS, settings, strict=True):
                        setattr(restore_mod, setting, value)
                    sample = once()
                    if r:
                        samples[name].append(sample)
        finally:
            for setting, value in zip(SETTINGS, defaults, strict=True):
                setattr(restore_mod, setting, value)
    out = {"nbytes": shape.nbytes, "rounds": rounds}
    for name, rows in samples.items():
        host = statistics.median(h for h, _ in rows)
        tail = statistics.median(t for _, t in rows)
        total = statistics.median(h + t for h, t in rows)
        out[name] = {"host_ms": round(host * 1e3, 2), "tail_ms": round(tail * 1e3, 2),
                     "total_ms": round(total * 1e3, 2),
                     "total_min_max_ms": [round(min(h + t for h, t in rows) * 1e3, 2),
                                          round(max(h + t for h, t in rows) * 1e3, 2)]}
    return out


def probe_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments the issue 19 restore probes share: --rounds, --sizes, --quick, --json."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--sizes", nargs="+", default=["8b", "1b"], choices=sorted(SHAPES))
    parser.add_argument("--quick", action="store_true", help="a 4-layer 16 MiB prefix (a smoke run)")
    parser.add_argument("--json", help="write the figures here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = probe_parser(__doc__, rounds=7).parse_args(argv)
    print(f"device {mx.default_device()}, mlx {mx.__version__}", file=sys.stderr)
    out = {}
    for size in (["quick"] if args.quick else args.sizes):
        shape = QUICK if size == "quick" else SHAPES[size]
        out[size] = run_shape(shape, args.rounds)
        for name, row in out[size].items():
            if isinstance(row, dict):
                print(f"{size:>5} {name:<27} total {row['total_ms']:8.2f} ms (host {row['host_ms']:.2f}, "
                      f"tail {row['tail_ms']:.2f}; min-max {row['total_min_max_ms']})", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
