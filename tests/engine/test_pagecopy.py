"""engine/pagecopy.py and the restore path it serves: pages land in memory the caller
owns (the pool's own buffers), byte for byte, threaded or not. (That the copy costs one
pass is a speed claim: tools/bench/store.py measures it, no test times it.)"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import PagedKVCache
from engine.formats import FORMATS, PageSpec, pages_from_blocks
from engine.pagecopy import HostBuffers, PageCopies, direct_writes, host_readable, host_view, page_regions
from engine.pool import BlockPool


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
