"""BlockPool: LIFO allocation, growth, reference counts, and exhaustion that changes
nothing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine import BlockPool, PagedKVCache, PageSpec, PoolExhausted
from engine.formats import FORMATS


def make_pool(name="native-f32", blocks=4, max_blocks=None, block=4):
    spec = PageSpec(FORMATS[name], 2, 64, 64, block, 64, None)
    return BlockPool(spec, blocks, max_blocks=max_blocks)


def test_lifo_free_list_is_deterministic():
    pool = make_pool(blocks=4)
    assert pool.allocate(3) == [0, 1, 2]
    pool.decref([0, 1])
    assert pool.allocate(1) == [0]  # the first of the last freed run comes back first
    assert pool.allocate(2) == [1, 3]
    assert pool.num_free_blocks == 0


def test_growth_appends_blocks_and_keeps_contents():
    pool = make_pool(blocks=2)
    (first,) = pool.allocate(1)
    pool.write(first, 0, {"k": mx.ones((2, 4, 64)), "v": mx.full((2, 4, 64), 2.0)})
    ids = pool.allocate(4)
    assert ids == [1, 2, 3, 4]
    assert pool.num_blocks == 5  # max(2 * 2, 1 + 4)
    assert pool.nbytes == 5 * pool.block_nbytes
    assert pool.used_nbytes == 5 * pool.block_nbytes
    assert mx.array_equal(pool.planes["v"][first], mx.full((2, 4, 64), 2.0)).item()


def test_reference_counts_free_on_zero():
    pool = make_pool(blocks=2)
    (block,) = pool.allocate(1)
    pool.incref([block])
    pool.decref([block])
    assert pool.refcount(block) == 1 and pool.num_free_blocks == 1
    pool.decref([block])
    assert pool.refcount(block) == 0 and pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.decref([block])


def _host(pool):
    return {name: np.array(plane) for name, plane in pool.planes.items()}


@pytest.mark.parametrize("name", ["native-f32", "k4v4"])
def test_exhaustion_raises_typed_error_and_touches_nothing(name):
    pool = make_pool(name, blocks=2, max_blocks=3)
    dtype = mx.float32
    a = PagedKVCache(pool)
    a.update_and_fetch(mx.random.normal((1, 2, 6, 64)).astype(dtype),
                       mx.random.normal((1, 2, 6, 64)).astype(dtype))  # blocks 0, 1
    b = a.clone()  # shares both blocks; block 1 is partial
    before = _host(pool)
    state = (list(a.block_ids), list(b.block_ids), a.offset, b.offset, pool.num_free_blocks,
             pool.num_blocks, [pool.refcount(i) for i in range(pool.num_blocks)])
    # b needs a copy of shared block 1 plus 2 new blocks: 3 > the 1 growth leaves.
    with pytest.raises(PoolExhausted) as info:
        b.update_and_fetch(mx.ones((1, 2, 8, 64), dtype), mx.ones((1, 2, 8, 64), dtype))
    assert info.value.requested == 3 and info.value.available == 1
    after = (list(a.block_ids), list(b.block_ids), a.offset, b.offset, pool.num_free_blocks,
             pool.num_blocks, [pool.refcount(i) for i in range(pool.num_blocks)])
    assert after == state
    for plane_name, host in _host(pool).items():
        np.testing.assert_array_equal(host, before[plane_name])
    # A write that fits still works afterwards.
    b.update_and_fetch(mx.ones((1, 2, 1, 64), dtype), mx.ones((1, 2, 1, 64), dtype))
    assert b.offset == 7 and pool.num_blocks == 3


def test_dropping_a_cache_returns_its_blocks():
    pool = make_pool(blocks=4)
    cache = PagedKVCache(pool)
    cache.update_and_fetch(mx.zeros((1, 2, 9, 64)), mx.zeros((1, 2, 9, 64)))
    assert pool.num_free_blocks == 1
    del cache
    assert pool.num_free_blocks == 4


@pytest.mark.parametrize("name", ["native-f32", "k4v4"])
@pytest.mark.parametrize("order", ["consecutive", "two runs", "scattered", "whole pool"])
def test_write_blocks_writes_what_one_block_at_a_time_writes(name, order, monkeypatch):
    """write_blocks by slice updates per run of consecutive ids (a prefill chunk's fresh
    blocks), or one scatter when the ids make more than MAX_SLICE_RUNS runs, or a copy
    when one run covers the pool: each plane equal, bit for bit, to writing the blocks
    one by one with write(); the other blocks untouched."""
    blocks = {"consecutive": [2, 3, 4], "two runs": [5, 6, 1, 2], "scattered": [7, 0, 5, 2, 4, 1],
              "whole pool": list(range(8))}[order]
    pools = [make_pool(name, blocks=8), make_pool(name, blocks=8)]
    for pool in pools:  # both pools start from the same nonzero contents
        pool.allocate(8)
        for n, p in pool.planes.items():
            pool.planes[n] = mx.array(np.arange(p.size).reshape(p.shape) % 97).astype(p.dtype)
    rng = np.random.default_rng(7)
    values = {n: mx.array(rng.integers(0, 97, (len(blocks), *p.shape[1:]))).astype(p.dtype)
              for n, p in pools[0].planes.items()}
    scattered = []
    real = BlockPool._write_runs
    monkeypatch.setattr(BlockPool, "_write_runs",
                        lambda self, n, v, runs, ids: scattered.append(ids is not None) or real(self, n, v, runs, ids))
    pools[0].write_blocks(blocks, values)
    monkeypatch.undo()
    for i, block in enumerate(blocks):
        pools[1].write(block, 0, {n: v[i : i + 1] for n, v in values.items()})
    assert set(scattered) == {order == "scattered"}
    for n in pools[0].spec.plane_names:
        assert mx.array_equal(pools[0].planes[n], pools[1].planes[n]).item(), n  # tolerance 0
