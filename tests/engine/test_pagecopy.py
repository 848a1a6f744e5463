"""engine/pagecopy.py and the restore path it serves: pages land in memory the caller
owns (the pool's own buffers), byte for byte, threaded or not. (That the copy costs one
pass is a speed claim: tools/bench/store.py measures it, no test times it.)"""

from __future__ import annotations

import gc
import os
import sys
import threading
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import engine.pagecopy as pagecopy
from engine.cache import PagedKVCache
from engine.formats import FORMATS, PageSpec, pages_from_blocks, resolve_format
from engine.pagecopy import (
    DeviceStaging,
    HostBuffers,
    PageCopies,
    device_copy,
    direct_writes,
    host_readable,
    host_view,
    page_regions,
    uninitialised,
)
from engine.pageread import read_pages
from engine.pool import BlockPool
from engine.restore import kvcache_from_pages, quantized_kvcache_from_pages
from kvstore.errors import IntegrityError
from kvstore.pages import PageBatch
from kvstore.store import Store


def spec_of(name: str, block: int = 4) -> PageSpec:
    fmt = FORMATS[name]
    return PageSpec(fmt, kv_heads=2, k_head_dim=64, v_head_dim=64, block_size_tokens=block,
                    group_size=32 if fmt.packed else 64)


def random_pages(spec: PageSpec, tokens: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    size = spec.block_size_tokens
    counts = [min(size, tokens - i) for i in range(0, tokens, size)]
    return [rng.integers(0, 256, spec.page_nbytes(c), dtype=np.uint8).tobytes() for c in counts]


def test_host_view_writes_the_arrays_own_memory_and_refuses_a_strided_view():
    a = mx.zeros((3, 4, 5), mx.bfloat16)
    host = host_view(a)
    assert host.shape == (3, 4, 10) and host.flags.writeable
    host[1, 2, :2] = [0x80, 0x3F]  # bf16 1.0, little-endian
    assert a[1, 2, 0].item() == 1.0 and a.sum().item() == 1.0
    with pytest.raises(AssertionError):
        host_view(a[:, 1:3])
    assert host_readable(a[:, 1:3]).shape == (3, 2, 10)  # copied instead


def test_uninitialised_arrays_have_their_shapes_and_are_the_memory_their_host_views_write():
    shapes = {"k": (2, 33, 7), "v": (1, 5, 4), "codes": (3, 4, 2)}
    dtypes = {"k": mx.bfloat16, "v": mx.float32, "codes": mx.uint32}
    out = uninitialised(shapes, dtypes)
    assert {n: (a.shape, a.dtype) for n, a in out.items()} == {n: (shapes[n], dtypes[n]) for n in shapes}
    rng = np.random.default_rng(5)
    for a in out.values():
        want = rng.integers(0, 256, size=host_view(a).shape, dtype=np.uint8)
        host_view(a)[...] = want
        assert np.array(a.view(mx.uint8)).tobytes() == want.tobytes()
    assert uninitialised({}, {}) == {}


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds address (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="transparent huge pages are a Linux kernel feature; this kernel has none")
def test_uninitialised_arrays_ask_for_huge_pages(monkeypatch):
    """A KVCache-layout restore's fresh arrays are advised MADV_HUGEPAGE before their
    first write (engine/pagecopy.py HUGE_PAGES), so that the write maps 2 MiB per fault.
    The kernel records the advice on the array's mapping: VmFlags "hg". (Not the other
    way round: freed memory that MLX's allocator hands out again keeps its advice.)"""
    monkeypatch.setattr(pagecopy, "HUGE_PAGES", True)
    out = uninitialised({"k": (1, 8, 4096, 128)}, {"k": mx.bfloat16})  # 8 MiB
    host = host_view(out["k"])
    middle = host.ctypes.data + host.nbytes // 2 // 2**21 * 2**21  # inside an advised 2 MiB page
    assert "hg" in _vma_flags(middle)
    host[...] = 7
    assert np.array(out["k"].view(mx.uint8)).min() == 7


def test_advise_huge_pages_leaves_a_buffer_smaller_than_a_huge_page_alone():
    assert not pagecopy.advise_huge_pages(memoryview(bytearray(2**20)))


@pytest.mark.skipif(not direct_writes(), reason="device backend: pages go through staging")
@pytest.mark.parametrize("name", ["native-bf16", "native-f32", "k8v4", "k4v4"])
def test_pages_land_in_the_pool_memory_that_earlier_host_views_see(name):
    """Pages are written into the pool's own buffers: host views of the planes taken
    before from_pages hold them afterwards, and the MLX arrays read the same bytes."""
    spec = spec_of(name)
    pool = BlockPool(spec, 8)
    before = pool.host_planes()
    pages = random_pages(spec, 4 * 3 + 2)
    cache = PagedKVCache.from_pages(pool, pages)
    size = spec.block_size_tokens
    for index, (block, page) in enumerate(zip(cache.block_ids, pages, strict=True)):
        count = min(size, cache.offset - index * size)
        held = b"".join(before[r.name][block, :, :count].tobytes() for r in page_regions(spec, count))
        assert held == page, f"block {block} of the pool's own memory does not hold page {index}"
    got = pages_from_blocks(spec, pool.planes, list(cache.block_ids), cache.offset)
    assert [bytes(p) for p in got] == pages


@pytest.mark.skipif(not direct_writes(), reason="device backend: pages go through staging")
@pytest.mark.parametrize("workers", [1, 2])
def test_threaded_copies_equal_inline_ones(workers, monkeypatch):
    monkeypatch.setattr("engine.pagecopy.MIN_THREADED_NBYTES", 0)
    spec = spec_of("native-f16", block=16)
    pages = random_pages(spec, 16 * 5 + 3, seed=workers)
    pool = BlockPool(spec, 1)
    copies = PageCopies()
    cache = PagedKVCache.from_pages(pool, pages, copies=copies)
    assert len(copies) == len(pages) * len(spec.plane_names)
    copies.run(workers)
    got = pages_from_blocks(spec, pool.planes, list(cache.block_ids), cache.offset)
    assert [bytes(p) for p in got] == pages


def test_page_regions_tile_the_page():
    spec = spec_of("k8v4")
    for tokens in (1, 3, 4):
        regions = page_regions(spec, tokens)
        assert [r.name for r in regions] == list(spec.plane_names)
        assert regions[0].start == 0
        assert all(a.start + a.nbytes == b.start for a, b in zip(regions, regions[1:], strict=False))
        assert regions[-1].start + regions[-1].nbytes == spec.page_nbytes(tokens)


@pytest.mark.parametrize("fragmented", [False, True])
def test_the_staging_path_writes_the_same_blocks(fragmented, monkeypatch):
    """BlockPool.write_pages (a backend whose arrays the host cannot see): consecutive
    block ids go by slice updates, scattered ones (more than 4 runs) by one scatter."""
    monkeypatch.setattr("engine.cache.direct_writes", lambda: False)
    spec = spec_of("k8v4")
    pool = BlockPool(spec, 16)
    if fragmented:  # free every other block, so the restore gets 1, 3, 5, ...
        taken = pool.allocate(16)
        pool.decref(taken[1::2])
    pages = random_pages(spec, 4 * 5 + 1, seed=3)
    cache = PagedKVCache.from_pages(pool, pages)
    ids = list(cache.block_ids)
    assert ids == ([1, 3, 5, 7, 9, 11] if fragmented else list(range(6)))
    got = pages_from_blocks(spec, pool.planes, ids, cache.offset)
    assert [bytes(p) for p in got] == pages


def test_the_staging_path_never_leaves_a_whole_pool_a_view_of_its_staging(monkeypatch):
    """A restore that fills every block of a pool: a slice update covering a whole
    array is the update itself in MLX, so without device_copy the planes would alias
    the staging buffer and the next restore into that pool would overwrite them."""
    monkeypatch.setattr("engine.cache.direct_writes", lambda: False)
    spec = spec_of("native-bf16")
    pool = BlockPool(spec, 3, max_blocks=3)
    pages = random_pages(spec, 4 * 3, seed=5)
    cache = PagedKVCache.from_pages(pool, pages)
    assert list(cache.block_ids) == [0, 1, 2]
    mx.eval(pool.planes)
    _, host = pool._staging.take(3 * spec.block_nbytes)  # what the next restore writes
    host[:] = 0xA5
    got = pages_from_blocks(spec, pool.planes, list(cache.block_ids), cache.offset)
    assert [bytes(p) for p in got] == pages


def test_a_capture_buffer_is_reused_only_after_every_view_of_it_is_gone():
    buffers = HostBuffers(max_nbytes=1 << 20)
    first = buffers.take(4096)
    first[:] = 7
    view = memoryview(first[100:200]).toreadonly()  # what a capture hands out
    del first
    gc.collect()
    assert buffers.idle_nbytes == 0, "recycled while a page view still points into it"
    second = buffers.take(4096)
    second[:] = 1
    assert bytes(view) == bytes([7]) * 100
    del view, second
    gc.collect()
    assert buffers.idle_nbytes == 4096 * 2  # both back; the next take reuses one
    third = buffers.take(4096)
    assert buffers.idle_nbytes == 4096
    del third
    gc.collect()
    big = buffers.take(1 << 20)
    del big
    gc.collect()
    assert buffers.idle_nbytes <= 1 << 20  # the oldest dropped past max_nbytes


def test_parallel_reads_yield_every_verified_page_in_digest_order(tmp_path, monkeypatch):
    """read_pages splits a mapped store's get_pages over threads: the same views, in
    the order asked (repeats included), as one call gives."""
    monkeypatch.setattr("engine.pageread.MIN_PAGES_PER_READER", 2)
    pages = [bytes([i]) * (1000 + i) for i in range(23)]
    with Store(tmp_path / "s") as store:
        batch = PageBatch.hash([memoryview(p).toreadonly() for p in pages])
        store.put_pages(batch)
        digests = list(batch.digests) + [batch.digests[3]]
        calls = []
        real = store.get_pages
        monkeypatch.setattr(store, "get_pages",
                            lambda ds: calls.append((len(ds), threading.current_thread().name)) or real(ds))
        with read_pages(store, digests, workers=4) as views:
            assert [bytes(v) for v in views] == pages + [pages[3]]
    assert len(calls) == 4 and all(name == "kv-read" for _, name in calls), calls
    assert sum(n for n, _ in calls) == len(digests)


class _DamagedReader:
    """A mapped store whose get_pages raises IntegrityError for a run holding b"bad"
    (as Store does after quarantining); records which runs are open."""

    maps_pages = True

    def __init__(self):
        self.open = 0
        self.lock = threading.Lock()

    @contextmanager
    def get_pages(self, digests):
        if b"bad" in digests:
            raise IntegrityError(b"bad".hex(), "xxh3-128 of the stored bytes does not match")
        with self.lock:
            self.open += 1
        try:
            yield [bytes(d) for d in digests]
        finally:
            with self.lock:
                self.open -= 1


def test_a_damaged_page_in_any_run_refuses_the_whole_read_and_closes_every_run(monkeypatch):
    monkeypatch.setattr("engine.pageread.MIN_PAGES_PER_READER", 1)
    store = _DamagedReader()
    digests = [b"p%02d" % i for i in range(12)]
    digests[9] = b"bad"
    reached = False
    with pytest.raises(IntegrityError):
        with read_pages(store, digests, workers=4):
            reached = True
    assert not reached, "views were yielded although a page failed verification"
    assert store.open == 0, "a reader's get_pages was left open"
    assert not [t for t in threading.enumerate() if t.name == "kv-read"]
    with read_pages(store, digests[:8], workers=4) as views:  # the intact part still reads
        assert views == digests[:8] and store.open == 4
    assert store.open == 0


@pytest.mark.parametrize("name", ["native-bf16", "mlx-q4"])
def test_the_device_path_builds_the_same_stock_cache(name, monkeypatch):
    """_history through DeviceStaging (direct_writes False: CUDA) equals the host-view
    path, byte for byte, also when the staging buffer is reused by a second layer."""
    fmt = resolve_format(name, mx.bfloat16)
    spec = PageSpec(fmt, kv_heads=2, k_head_dim=64, v_head_dim=64, block_size_tokens=4, group_size=64)
    build = kvcache_from_pages if name.startswith("native") else quantized_kvcache_from_pages
    pages = [random_pages(spec, 4 * 3 + 1, seed=s) for s in (1, 2)]
    want = [build(spec, p).state for p in pages]
    # engine.restore names the function in the package: patch the module itself
    monkeypatch.setattr(sys.modules["engine.restore"], "direct_writes", lambda: False)
    got = [build(spec, p).state for p in pages]  # the second reuses the first's staging
    arrays = lambda states: [a for _, a in tree_flatten(states) if isinstance(a, mx.array)]  # noqa: E731
    assert len(arrays(want)) == len(arrays(got)) > 0
    for w, g in zip(arrays(want), arrays(got), strict=True):
        w, g = (None, w), (None, g)
        assert w[1].shape == g[1].shape and w[1].dtype == g[1].dtype
        raw = lambda a: np.array(a.view(mx.uint8) if a.dtype.size != 1 else a)  # noqa: E731
        assert np.array_equal(raw(w[1]), raw(g[1]))


def test_device_staging_is_rewritten_only_after_its_readers_ran():
    staging = DeviceStaging()
    array, host = staging.take(64)
    host[:] = 5
    copied = device_copy(array[:64])  # lazy: reads the staging when evaluated
    staging.hold([copied])
    again, host2 = staging.take(32)  # waits for `copied` before handing the memory out
    assert again is array
    host2[:] = 9
    assert np.array(copied).tolist() == [5] * 64


def test_started_copies_are_done_when_run_returns_and_their_errors_raise_there(monkeypatch):
    monkeypatch.setattr("engine.pagecopy.MIN_THREADED_NBYTES", 0)
    rng = np.random.default_rng(7)
    sources = [rng.integers(0, 256, 4096, dtype=np.uint8) for _ in range(6)]
    targets = [np.zeros(4096, dtype=np.uint8) for _ in sources]
    copies = PageCopies()
    copies.add_pairs(zip(targets[:4], sources[:4], strict=True))
    copies.start(workers=2)  # handed to the copy threads; the caller goes on
    copies.add_pairs(zip(targets[4:], sources[4:], strict=True))
    assert len(copies) == 6
    copies.run(workers=2)
    assert len(copies) == 0
    assert all(np.array_equal(t, s) for t, s in zip(targets, sources, strict=True))
    read_only = np.zeros(4096, dtype=np.uint8)
    read_only.flags.writeable = False
    copies.add_pairs([(read_only, sources[0]), (targets[0], sources[1])])
    copies.start(workers=2)
    with pytest.raises(ValueError):
        copies.run(workers=2)


@pytest.mark.parametrize("fmt", ["native-bf16", "k4v4"])
@pytest.mark.parametrize("free", [(1, 2, 3, 7, 8, 12), (4, 5, 6, 7, 8, 9), (0, 2, 3, 5, 6, 9)])
def test_capture_copies_runs_of_consecutive_blocks_as_one_copy_per_plane(free, fmt):
    """pages_from_blocks on the host-view path: blocks in runs (copied as one strided copy
    per plane and run) and apart, the short last block consecutive or not: every page
    byte for byte (tolerance 0)."""
    spec = spec_of(fmt)
    pool = BlockPool(spec, 16)
    taken = pool.allocate(16)
    pool.decref([taken[i] for i in free])
    pages = random_pages(spec, 5 * spec.block_size_tokens + 3, seed=4)
    cache = PagedKVCache.from_pages(pool, pages)
    assert list(cache.block_ids) == list(free)
    got = pages_from_blocks(spec, pool.planes, list(cache.block_ids), cache.offset)
    assert [bytes(p) for p in got] == pages
