"""Run on the H200: where a restore's time goes (issue 19 item 4), section by section.

  hashing     xxh3-128 and blake3 over 512 MiB of 1 MiB pages on 1, 8 and 16 threads
              (whether the installed bindings release the GIL decides whether the
              store's verification can use the host's cores)
  transfer    512 MiB of pages into device-memory pool planes (32 planes of 32 blocks,
              16 blocks written), median of 5, host copy and device part apart:
                host views     the planes viewed by the host (moved to managed memory),
                               written there, then read by a GPU op (the path before)
                mx.array       a numpy staging buffer, one mx.array per plane, slice
                               updates (the staging path before)
                staging        DeviceStaging, advised to stay on the host (engine default)
                staging, default policy   the same without the advice
                staging + prefetch        the same, migrated to the GPU before the copies
  restore     engine.restore of the 512 MiB 8B-shaped prefix (tools/bench/store.py)
              into pools, with 1 and READ_WORKERS page readers, and a cProfile of one
  stages      the same restore at 8192 tokens (1 GiB, the ttft bench's 8B case) split by
              stage (verified reads, host copies, write_pages, device tail), with 16 copy
              threads and one reader, and the pieces alone: reads, copies on 8 / 16
              threads, the fused read_pages_into, the device copies (stages() says which)

From the repository root: PYTHONPATH=$PWD python3 tools/bench/profile/restore_h200.py [--json F]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

import engine.pageread as pageread
from engine import RestoreRequest, restore
from engine.pagecopy import DeviceStaging, host_view, run_copies
from kvstore.store import Store

PAGE = 1 << 20
PAGES = 512  # --quick: 64 (a smoke run on a CPU)


def median_s(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def hashing(pages: list[bytes]) -> dict:
    import blake3
    import xxhash

    out = {"xxhash_version": xxhash.VERSION, "blake3_version": blake3.__version__}
    for name, fn in (("xxh3", xxhash.xxh3_128_digest), ("blake3", lambda p: blake3.blake3(p).digest())):
        for threads in (1, 8, 16):
            with ThreadPoolExecutor(threads) as pool:
                out[f"{name}_{threads}t_ms"] = median_s(
                    lambda fn=fn, pool=pool: list(pool.map(fn, pages, chunksize=8))) * 1e3
    return out


def transfer(pages: list[bytes]) -> dict:
    from engine import managed

    half = PAGE // 2  # one block of one plane: [8 heads, 256 tokens, 128] bf16
    sources = [np.frombuffer(p, dtype=np.uint8)[h * half : (h + 1) * half] for p in pages for h in (0, 1)]
    n = len(sources) // 32  # blocks written per plane (32 at 512 pages: 512 MiB in all)
    shape = (2 * n, 8, 256, 128)  # blocks, heads, block tokens, dim; half of it written
    planes = [mx.zeros(shape, mx.bfloat16) for _ in range(32)]
    mx.eval(planes)
    total = len(sources) * half
    out = {"nbytes": total}

    def staged(staging: DeviceStaging, prefetch: bool):
        host_s, dev_s = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            array, host = staging.take(total)
            pairs = [(host[i * half : (i + 1) * half], src) for i, src in enumerate(sources)]
            run_copies(pairs, total)
            if prefetch:
                managed.prefetch(host.ctypes.data, total, 0)
                managed.synchronize()
            t1 = time.perf_counter()
            for j, plane in enumerate(planes):
                part = array[j * n * half : (j + 1) * n * half].view(mx.bfloat16).reshape(n, *shape[1:])
                plane[0:n] = part
            staging.hold(planes)
            mx.eval(planes)
            t2 = time.perf_counter()
            host_s.append(t1 - t0)
            dev_s.append(t2 - t1)
        return statistics.median(host_s) * 1e3, statistics.median(dev_s) * 1e3

    advised = DeviceStaging()
    out["staging_host_ms"], out["staging_device_ms"] = staged(advised, False)
    out["staging_advised"] = advised.advised
    real = managed.keep_on_host
    managed.keep_on_host = lambda *a, **k: False
    try:
        out["default_policy_host_ms"], out["default_policy_device_ms"] = staged(DeviceStaging(), False)
        out["prefetch_host_ms"], out["prefetch_device_ms"] = staged(DeviceStaging(), True)
    finally:
        managed.keep_on_host = real

    numpy_staging = np.empty(total, dtype=np.uint8)

    def by_mx_array():
        pairs = [(numpy_staging[i * half : (i + 1) * half], src) for i, src in enumerate(sources)]
        run_copies(pairs, total)
        for j, plane in enumerate(planes):
            seg = numpy_staging[j * n * half : (j + 1) * n * half]
            plane[0:n] = mx.array(seg).view(mx.bfloat16).reshape(n, *shape[1:])
        mx.eval(planes)

    out["mx_array_ms"] = median_s(by_mx_array) * 1e3

    hosts = [host_view(p) for p in planes]  # moves them into managed memory

    def by_host_views():
        pairs = []
        for j, h in enumerate(hosts):
            flat = h.reshape(-1)
            pairs += [(flat[b * half : (b + 1) * half], sources[j * n + b]) for b in range(n)]
        run_copies(pairs, total)
        mx.eval([p[0:n].view(mx.uint16).max() for p in planes])

    out["host_views_ms"] = median_s(by_host_views) * 1e3
    return out


def restore_profile(quick: bool = False) -> dict:
    from tools.bench.store import FULL, QUICK, Prefix, engine_model, save_prefix

    shape = QUICK if quick else FULL
    model = engine_model(shape)
    prefix = Prefix(shape, model.identity)
    out = {}
    with tempfile.TemporaryDirectory() as tmp, Store(f"{tmp}/store") as store:
        save_prefix(store, prefix)
        request = RestoreRequest(prefix.tokens + [0], namespace="bench")

        def once():
            result = restore(model, store, request)
            assert result.tokens_restored == shape.tokens, result.tokens_restored
            mx.eval([pool.planes for pool in model.pools if pool is not None])  # device work done
            for c in result.cache:
                c.free()

        once()
        for workers in (1, pageread.READ_WORKERS):
            pageread.READ_WORKERS = workers
            out[f"restore_pools_{workers}_readers_ms"] = median_s(once) * 1e3
        profiler = cProfile.Profile()
        profiler.enable()
        once()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(25)
        out["profile"] = text.getvalue()
    return out


class _Clock:
    """Seconds spent inside wrapped functions, summed per name (the restore's stages)."""

    def __init__(self):
        self.s: dict[str, float] = {}

    def wrap(self, owner, attr: str, name: str, context: bool = False):
        real = getattr(owner, attr)
        clock = self

        if context:  # a context manager: time its entry (the verified read)
            from contextlib import contextmanager

            @contextmanager
            def timed_cm(*a, **k):
                t0 = time.perf_counter()
                with real(*a, **k) as value:
                    clock.s[name] = clock.s.get(name, 0.0) + time.perf_counter() - t0
                    yield value
            setattr(owner, attr, timed_cm)
        else:
            def timed_fn(*a, **k):
                t0 = time.perf_counter()
                try:
                    return real(*a, **k)
                finally:
                    clock.s[name] = clock.s.get(name, 0.0) + time.perf_counter() - t0
            setattr(owner, attr, timed_fn)
        return lambda: setattr(owner, attr, real)


def stages(quick: bool = False) -> dict:
    """The engine restore into pools of the 8B-shaped prefix at 8192 tokens (1 GiB, as
    in the ttft bench), its time split by stage (medians of 5): read = the store's
    verified reads (get_pages on the reader threads, engine/pageread.py), host copies =
    pages into the pools' staging (PageCopies.run), write_pages = those copies plus the
    slice-update graph and its launch, device tail = mx.synchronize after restore
    returns; as committed, with 16 copy threads (8 by default), and with one reader.
    (On 2026-12-02 it also ran reads in groups of layers, the next group verified while
    one was copied: 64 / 128 / 256 MiB groups 172 / 176 / 159 ms against 138 ms for one
    read; that code is gone, its figures are in docs/benchmarks.md.) Then the pieces alone: get_pages on one thread, read_pages on 16, copies of
    verified views into one DeviceStaging on 8 / 16 threads, the fused read_pages_into
    into it (verify + copy per page), and the device copies from it into the planes."""
    import engine.pool as pool_mod
    from engine import pagecopy

    restore_mod = sys.modules["engine.restore"]  # the package's `restore` names the function
    from tools.bench.store import Prefix, Shape, engine_model, save_prefix

    shape = Shape(layers=4 if quick else 32, kv_heads=8, head_dim=128, tokens=1024 if quick else 8192,
                  block_size_tokens=256)
    model = engine_model(shape)
    prefix = Prefix(shape, model.identity)
    out = {"nbytes": shape.nbytes, "pages": shape.layers * shape.blocks}
    with tempfile.TemporaryDirectory() as tmp, Store(f"{tmp}/store") as store:
        save_prefix(store, prefix)
        request = RestoreRequest(prefix.tokens + [0], namespace="bench")
        match = store.lookup_prefix(model.identity.format_id, "bench", prefix.tokens)
        digests = [d for b in match.blocks for d in b.pages]

        def once(clock: _Clock | None = None):
            t0 = time.perf_counter()
            result = restore(model, store, request)
            t1 = time.perf_counter()
            mx.synchronize()
            t2 = time.perf_counter()
            assert result.tokens_restored == shape.tokens, result.tokens_restored
            for c in result.cache:
                c.free()
            return t1 - t0, t2 - t1

        def run_variant(label: str, repeats: int = 5):
            once()
            rows = []
            for _ in range(repeats):
                clock = _Clock()
                undo = [clock.wrap(restore_mod, "_pages", "read", context=True),
                        clock.wrap(pool_mod.BlockPool, "write_pages", "write_pages"),
                        clock.wrap(pagecopy.PageCopies, "run", "host copies")]
                try:
                    host, tail = once()
                finally:
                    for u in reversed(undo):
                        u()
                rows.append({"restore": host, "device tail": tail, **clock.s})
            keys = rows[0].keys()
            out[label] = {k + "_ms": round(statistics.median(r.get(k, 0.0) for r in rows) * 1e3, 2) for k in keys}

        run_variant("default")
        copy_workers = pagecopy.DEFAULT_WORKERS
        pagecopy.DEFAULT_WORKERS = min(16, os.cpu_count() or 1)
        pagecopy._copy_pool.cache_clear()  # a pool of that many copy threads from here on
        run_variant("16 copy threads")
        pagecopy.DEFAULT_WORKERS = copy_workers
        pagecopy._copy_pool.cache_clear()
        workers = pageread.READ_WORKERS
        pageread.READ_WORKERS = 1
        run_variant("one reader")
        pageread.READ_WORKERS = workers

        def get_pages_one_thread():
            with store.get_pages(digests):
                pass

        def read_pages_threads():
            with pageread.read_pages(store, digests):
                pass

        out["get_pages_1_thread_ms"] = median_s(get_pages_one_thread) * 1e3
        out["read_pages_16_readers_ms"] = median_s(read_pages_threads) * 1e3
        staging = DeviceStaging()
        array, host = staging.take(shape.nbytes)
        page = shape.page_nbytes
        rows = [host[i * page : (i + 1) * page] for i in range(len(digests))]
        with store.get_pages(digests) as views:
            pairs = [(rows[i], np.frombuffer(v, dtype=np.uint8)) for i, v in enumerate(views)]
            for threads in (8, 16):
                def copy_all(threads=threads):
                    step = -(-len(pairs) // threads)
                    with ThreadPoolExecutor(threads) as pool:
                        list(pool.map(lambda i: [np.copyto(t, s) for t, s in pairs[i : i + step]],
                                      range(0, len(pairs), step)))
                out[f"copy_verified_views_{threads}_threads_ms"] = median_s(copy_all) * 1e3
        out["read_pages_into_staging_ms"] = median_s(lambda: store.read_pages_into(digests, rows)) * 1e3
        # twice the blocks written: a slice update covering a whole array would return the
        # update itself (a view of the staging buffer) and copy nothing
        planes = [mx.zeros((2 * shape.blocks, 2, 8, 256, 128), mx.bfloat16) for _ in range(shape.layers)]
        mx.eval(planes)

        def device_part():
            # staging holds block-major pages (block i, layer j at i * L + j): one strided
            # read per layer, as a per-layer staging layout would give in one slice
            staged = array[: shape.nbytes].view(mx.bfloat16).reshape(shape.blocks, shape.layers, 2, 8, 256, 128)
            for j in range(shape.layers):
                planes[j][0 : shape.blocks] = staged[:, j]
            mx.eval(planes)

        out["device_copies_from_staging_ms"] = median_s(device_part) * 1e3
        profiler = cProfile.Profile()
        profiler.enable()
        once()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
        out["profile"] = text.getvalue()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--sections", nargs="+", default=["hashing", "transfer", "restore", "stages"])
    parser.add_argument("--quick", action="store_true", help="64 pages, a 16 MiB restore (a smoke run)")
    args = parser.parse_args(argv)
    global PAGES
    if args.quick:
        PAGES = 64
    print(f"device {mx.default_device()}, {os.cpu_count()} CPUs, mlx {mx.__version__}", flush=True)
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 256, PAGE, dtype=np.uint8).tobytes() for _ in range(PAGES)]
    report = {}
    for section in args.sections:
        t0 = time.perf_counter()
        report[section] = {"hashing": hashing, "transfer": transfer,
                           "restore": lambda _: restore_profile(args.quick),
                           "stages": lambda _: stages(args.quick)}[section](pages)
        figures = {k: (round(v, 1) if isinstance(v, float) else v)
                   for k, v in report[section].items() if k != "profile"}
        print(f"{section} ({time.perf_counter() - t0:.1f} s): {figures}", flush=True)
        if "profile" in report[section]:
            print(report[section]["profile"], flush=True)
        if args.json:  # after every section: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
