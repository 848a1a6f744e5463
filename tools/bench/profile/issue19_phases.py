"""Run on the H200 (or H100): where a device restore's time goes, phase by phase (issue 19).

The engine restore into pools of the 8B-shaped prefix at 8192 tokens (1 GiB: 32 layers
of 8 KV heads of 128, block 256) and the 1B-shaped one (256 MiB: 16 layers of 8 heads
of 64), from an embedded Store, with timestamps taken around the restore's own steps
(no profiler: cProfile's per-call cost inflated the per-page Python threefold):

  lookup        restore() start to the first layer's layout (chain keys, the index's
                block records, admission, fresh caches)
  layout        each group's BlockPool.write_pages (stand-ins, staging, MLX's lazy ops)
  read          each group's read_into, summed (the store's per-page checks and the
                copies into the staging rows, on the reader threads); read_start and
                read_end: the first group's start, the last group's end
  settle        waiting for the device's hashes and comparing them (_settle)
  tail          restore() returned to mx.synchronize() returning (the device's copies)

and, on the same bytes, the limits the phases are measured against:

  host copy     1 GiB (or 256 MiB) memcpy between two host buffers on 8 threads
  read floor    read_into of the same pages into one host buffer (per-page checks and
                copies, nothing laid out, no device work)
  bus copy      device_copy of the staging buffer (managed memory on the host) into
                device memory

With --lag, a second pass waits for the device (mx.synchronize) after each group's read,
before that group's copies start, and reports those waits per group (lag_ms): how much of
the earlier groups' device copies and hashes was still running when the host had read the
next group. All zeros: the device keeps up, and only the last group's copies are waited
for. The pass serialises the groups, so its other phases are not the restore's.

Medians over --rounds. From the repository root:
  PYTHONPATH=$PWD python3 tools/bench/profile/issue19_phases.py [--rounds 5] [--quick] [--json F]
--device-path runs the staging path on a CPU too (direct_writes patched to False, as
tests/engine/test_device_restore.py does): a smoke run; its figures mean nothing.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from engine import RestoreRequest, restore
from engine.pagecopy import DeviceStaging, device_copy
from engine.pageread import STAGING_READ_CHUNK_NBYTES, STAGING_READ_WORKERS, read_into
from engine.pool import BlockPool
from kvstore.ids import page_digest
from kvstore.store import Store
from tools.bench.profile.issue19_groups import QUICK, SHAPES, probe_parser
from tools.bench.store import Prefix, Shape, engine_model, save_prefix

RESTORE = sys.modules["engine.restore"]  # the package's `restore` names the function


class Timeline:
    """(phase, start, end) on any thread, relative to the restore's start."""

    def __init__(self):
        self.events: list[tuple[str, float, float]] = []
        self.t0 = 0.0
        self._lock = threading.Lock()

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.events.append((name, start - self.t0, time.perf_counter() - self.t0))
        return timed

    def summary(self, host_end: float, sync_end: float) -> dict:
        ev = sorted(self.events, key=lambda e: e[1])
        lags = [round((b - a) * 1e3, 2) for name, a, b in ev if name == "lag"]
        layouts = [(a, b) for name, a, b in ev if name == "layout"]
        settles = [(a, b) for name, a, b in ev if name == "settle"]
        reads = [(a, b) for name, a, b in ev if name == "read"]
        read_start, read_end = reads[0][0], max(b for _, b in reads)
        return {
            "lookup_ms": (layouts[0][0] if layouts else 0.0) * 1e3,
            "layout_ms": sum(b - a for a, b in layouts) * 1e3,
            "read_start_ms": read_start * 1e3,
            "read_ms": sum(b - a for a, b in reads) * 1e3,
            "groups": len(reads),
            "read_end_ms": read_end * 1e3,
            "settle_ms": sum(b - a for a, b in settles) * 1e3,
            "host_ms": host_end * 1e3,
            "tail_ms": (sync_end - host_end) * 1e3,
            "total_ms": sync_end * 1e3,
            **({"lag_ms": lags} if lags else {}),
        }


def _median_rows(rows: list[dict]) -> dict:
    """Medians of every figure; of a list (lag_ms), element by element."""
    return {k: ([round(statistics.median(col), 2) for col in zip(*(r[k] for r in rows), strict=True)]
                if isinstance(rows[0][k], list) else round(statistics.median(r[k] for r in rows), 2))
            for k in rows[0]}


def _threaded_copy(dst: np.ndarray, src: np.ndarray, workers: int = 8) -> None:
    step = -(-src.size // workers)
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda i: np.copyto(dst[i : i + step], src[i : i + step]),
                      range(0, src.size, step)))


def limits(store: Store, prefix: Prefix, rounds: int) -> dict:
    """The host copy, read floor and bus copy of the prefix's bytes, medians."""
    pages = [p for row in prefix.pages for p in row]
    names = [page_digest(page) for page in pages]
    page_nbytes = max(len(p) for p in pages)
    nbytes = sum(len(p) for p in pages)
    src = np.empty(nbytes, dtype=np.uint8)
    src[:] = 1
    staging = DeviceStaging()
    staged, host = staging.take(nbytes)
    rows = host[: len(names) * page_nbytes].reshape(len(names), page_nbytes)
    out: dict[str, list[float]] = {"host_copy_ms": [], "read_floor_ms": [], "bus_copy_ms": []}
    for r in range(rounds + 1):
        t = time.perf_counter()
        _threaded_copy(host[:nbytes], src)
        a = time.perf_counter()
        read_into(store, names, lambda i, page: np.copyto(rows[i, : len(page)], np.frombuffer(page, np.uint8)),
                  page_nbytes, STAGING_READ_WORKERS, STAGING_READ_CHUNK_NBYTES, [])
        b = time.perf_counter()
        mx.eval(device_copy(staged[:nbytes]))
        mx.synchronize()
        c = time.perf_counter()
        if r:
            out["host_copy_ms"].append((a - t) * 1e3)
            out["read_floor_ms"].append((b - a) * 1e3)
            out["bus_copy_ms"].append((c - b) * 1e3)
    return {k: round(statistics.median(v), 2) for k, v in out.items()}


def run_shape(shape: Shape, rounds: int, lag: bool = False) -> dict:
    model = engine_model(shape)
    prefix = Prefix(shape, model.identity)
    timeline = Timeline()

    settle, read, write_pages = RESTORE._settle, RESTORE.read_into, BlockPool.write_pages
    RESTORE._settle = timeline.wrap("settle", settle)
    RESTORE.read_into = timeline.wrap("read", read)
    BlockPool.write_pages = timeline.wrap("layout", write_pages)
    timed_read, waited = RESTORE.read_into, timeline.wrap("lag", mx.synchronize)

    def read_then_wait(*args, **kwargs):
        timed_read(*args, **kwargs)
        waited()

    try:
        with tempfile.TemporaryDirectory() as tmp, Store(f"{tmp}/store") as store:
            save_prefix(store, prefix)
            request = RestoreRequest(prefix.tokens + [0], namespace="bench")

            def timed(rows: list) -> None:
                for r in range(rounds + 1):  # round 0 warms up, untimed
                    timeline.events.clear()
                    timeline.t0 = time.perf_counter()
                    result = restore(model, store, request)
                    host_end = time.perf_counter() - timeline.t0
                    mx.synchronize()
                    sync_end = time.perf_counter() - timeline.t0
                    assert result.tokens_restored == shape.tokens, result.tokens_restored
                    for c in result.cache:
                        c.free()
                    if r:
                        rows.append(timeline.summary(host_end, sync_end))

            samples: list[dict] = []
            timed(samples)
            out = {"nbytes": shape.nbytes, "rounds": rounds, "restore": _median_rows(samples),
                   "limits": limits(store, prefix, rounds)}
            if lag:
                RESTORE.read_into, lagged = read_then_wait, []
                timed(lagged)
                out["lag"] = _median_rows(lagged)
    finally:
        RESTORE._settle, RESTORE.read_into = settle, read
        BlockPool.write_pages = write_pages
    return out


def main(argv: list[str] | None = None) -> int:
    parser = probe_parser(__doc__, rounds=5)
    parser.add_argument("--device-path", action="store_true",
                        help="the staging path on a CPU too (a smoke run)")
    parser.add_argument("--lag", action="store_true",
                        help="a second pass waiting for the device after each group's read")
    args = parser.parse_args(argv)
    if args.device_path:
        import engine.cache  # noqa: PLC0415
        RESTORE.direct_writes = engine.cache.direct_writes = lambda: False
    print(f"device {mx.default_device()}, mlx {mx.__version__}", file=sys.stderr)
    out = {}
    for size in (["quick"] if args.quick else args.sizes):
        out[size] = run_shape(QUICK if size == "quick" else SHAPES[size], args.rounds, args.lag)
        print(f"{size:>5} restore " + " ".join(f"{k} {v}" for k, v in out[size]["restore"].items()),
              file=sys.stderr)
        print(f"{size:>5} limits  " + " ".join(f"{k} {v}" for k, v in out[size]["limits"].items()),
              file=sys.stderr)
        if "lag" in out[size]:
            print(f"{size:>5} lag     " + " ".join(f"{k} {v}" for k, v in out[size]["lag"].items()),
                  file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
