"""The fused read on a device backend (direct_writes() False: CUDA), run on the CPU.

There each pool's pages go through its DeviceStaging buffer: the fused restore lays
every layer out on stand-ins, the store's readers copy each verified page into the
staging (BlockPool.write_pages with a DeferredCopies), and only then does the device
copy the staging into the pool planes. These tests patch direct_writes to False where
the restore and the caches ask it, so that path runs against the host-view one."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from engine.engine_model import EngineModel
from engine.formats import PageSpec, pages_from_blocks
from engine.policy import KVPolicy
from engine.publish import publish
from engine.restore import RestoreRequest, restore
from kernels.page_hash import MIN_NBYTES
from kernels.quantize import cuda_available
from kvstore.errors import CopyDamaged, IntegrityError
from kvstore.store import Store
from tests.engine.factories import prompt_tokens, tiny_model
from tests.engine.test_publish_restore import _prefilled
from tests.kvstore.factories import flip_bit, stored_value

MODEL_ID = "test/tiny"


def _device_backend(monkeypatch) -> list:
    """direct_writes() False for the restore and the caches; returns a list that
    records each _read_views call (the unfused path)."""
    monkeypatch.setattr(sys.modules["engine.restore"], "direct_writes", lambda: False)
    monkeypatch.setattr("engine.cache.direct_writes", lambda: False)
    restore_module = sys.modules["engine.restore"]
    unfused, read_views = [], restore_module._read_views

    def spy(*args, **kwargs):
        unfused.append(1)
        return read_views(*args, **kwargs)

    monkeypatch.setattr(restore_module, "_read_views", spy)
    return unfused


def _pool_pages(engine_model, restored) -> list[list[bytes]]:
    out = []
    for layer in engine_model.identity.paged_layers:
        cache, pool = restored.cache[layer], engine_model.pools[layer]
        spec = PageSpec.from_layer_spec(engine_model.identity.layers[layer],
                                        engine_model.identity.block_size_tokens)
        mx.eval(pool.planes)
        got = pages_from_blocks(spec, pool.planes, list(cache.block_ids), cache.offset)
        out.append([bytes(p) for p in got])
    return out


@contextmanager
def _published(tmp_path, fmt: str, n_tokens: int, seed: int):
    """(store, a factory of fresh engine models, tokens, want): a store holding a tiny
    llama's prefill of n_tokens in `fmt` pages (block 16), and the pools' pages that the
    host-view restore of it gives, which the device path must match."""
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16, default_format=fmt)
    tokens = prompt_tokens(n_tokens, seed=seed).tolist()
    with Store(tmp_path / "s") as store:
        publish(EngineModel(model, MODEL_ID, policy=policy), store, tokens,
                _prefilled(model, policy, tokens))
        host = EngineModel(model, MODEL_ID, policy=policy)
        want = _pool_pages(host, restore(host, store, RestoreRequest(tokens + [1])))
        yield store, lambda: EngineModel(model, MODEL_ID, policy=policy), tokens, want


@pytest.mark.parametrize("fmt", ["native", "k4v4"])
def test_the_fused_device_read_fills_the_pools_as_the_host_view_read_does(tmp_path, monkeypatch, fmt):
    with _published(tmp_path, fmt, 90, seed=60) as (store, engine_model, tokens, want):
        unfused = _device_backend(monkeypatch)
        device = engine_model()
        for _ in range(2):  # the second reuses each pool's staging buffer
            restored = restore(device, store, RestoreRequest(tokens + [1]))
            assert restored.tokens_restored == 90
            assert _pool_pages(device, restored) == want  # tolerance 0
            for cache in restored.cache:
                cache.free()
        assert unfused == []  # the fused read ran, not the view read


def test_a_damaged_page_fails_the_fused_device_read_and_frees_what_it_laid_out(tmp_path, monkeypatch):
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    tokens = prompt_tokens(64, seed=61).tolist()
    path = tmp_path / "s"
    with Store(path) as store:
        saved = publish(EngineModel(model, MODEL_ID, policy=policy), store, tokens,
                        _prefilled(model, policy, tokens))
        assert saved.blocks == 4
        victim = store.lookup_prefix(EngineModel(model, MODEL_ID, policy=policy).identity.format_id,
                                     "default", tokens).blocks[2].pages[1]
        value = stored_value(store, victim)
    flip_bit(path, value, 8 * len(value) - 3)
    _device_backend(monkeypatch)
    with Store(path) as store:
        device = EngineModel(model, MODEL_ID, policy=policy)
        used_before = [pool.num_used_blocks for pool in device.pools]
        with pytest.raises(IntegrityError):
            restore(device, store, RestoreRequest(tokens + [1]))
        assert [pool.num_used_blocks for pool in device.pools] == used_before
        # the page is quarantined: the next restore stops before its block, correctly
        restored = restore(device, store, RestoreRequest(tokens + [1]))
        assert restored.tokens_restored == 32


def test_the_device_read_goes_by_layer_groups_each_groups_copies_started_before_the_next_read(
        tmp_path, monkeypatch):
    """Each staging row takes one whole page (one copy per page); the layers are read
    in groups of DEVICE_READ_GROUP_NBYTES, each group's device copies started before
    the next group is read; bit-exact however the layers are grouped."""
    restore_module = sys.modules["engine.restore"]
    with _published(tmp_path, "native", 70, seed=62) as (store, engine_model, tokens, want):
        _device_backend(monkeypatch)
        reads, evals = [], []
        real_read, real_eval = restore_module.read_into, restore_module.mx.async_eval
        monkeypatch.setattr(restore_module, "read_into",
                            lambda store, digests, *a: reads.append(len(digests)) or real_read(store, digests, *a))
        monkeypatch.setattr(restore_module.mx, "async_eval",
                            lambda arrays: evals.append(len(reads)) or real_eval(arrays))
        device = engine_model()
        layers = len(device.identity.paged_layers)
        assert layers >= 2, "the tiny model needs two layers to make two groups"
        layer = sum(len(p) for p in want[0])  # the bytes of one layer's pages
        # one group; one per layer; tapered: a last group of one layer, the rest before it
        for group_nbytes, last, sizes in ((1 << 30, None, [layers]), (1, None, [1] * layers),
                                          (1 << 30, layer, [layers - 1, 1])):
            reads.clear()
            evals.clear()
            monkeypatch.setattr(restore_module, "DEVICE_READ_GROUP_NBYTES", group_nbytes)
            monkeypatch.setattr(restore_module, "DEVICE_READ_LAST_NBYTES", last)
            restored = restore(device, store, RestoreRequest(tokens + [1]))
            assert _pool_pages(device, restored) == want  # tolerance 0
            for cache in restored.cache:
                cache.free()
            assert reads == [5 * n for n in sizes]  # 5 blocks of each layer
            assert evals == list(range(1, len(sizes) + 1))  # each group's copies after its read


@pytest.mark.parametrize("layers, layer_mib, largest, last, want", [
    (16, 16, 256, 32, [2, 8, 4, 2]),  # the 1B-shaped prefix at 8K: 32, 128, 64, 32 MiB
    (32, 32, 256, 32, [1, 8, 8, 8, 4, 2, 1]),  # 8B-shaped: 256 MiB at most
    (16, 16, 256, None, [16]),  # equal groups
    (32, 32, 256, None, [8, 8, 8, 8]),
    (5, 16, 32, None, [1, 2, 2]),  # equal groups leave the remainder to the first
    (3, 16, 256, 512, [3]),  # a last group larger than the largest: the largest
    (1, 16, 256, 32, [1]),
    (0, 16, 256, 32, []),
])
def test_read_groups_taper_towards_the_end(layers, layer_mib, largest, last, want):
    """read_groups: consecutive layer ranges covering every layer once, in order, sized
    from the end (DEVICE_READ_LAST_NBYTES doubling up to DEVICE_READ_GROUP_NBYTES)."""
    mib = 2**20
    bounds = sys.modules["engine.restore"].read_groups(
        [layer_mib * mib] * layers, largest * mib, None if last is None else last * mib)
    assert [stop - first for first, stop in bounds] == want
    assert [first for first, _ in bounds] == [sum(want[:i]) for i in range(len(want))]


def _device_hashes(monkeypatch, damage_row: int | None = None, kernel: bool = False) -> list:
    """The device hashes what it copied (restore.HASH_ON_DEVICE on "CUDA"): the work of
    kernels/page_hash.py done here by python-xxhash over the device copy's rows, which is
    what the kernel must equal (tests/kernels/test_page_hash.py); kernel=True (a CUDA GPU
    only): the kernel itself, counted. damage_row: that row's bytes are changed before
    they are hashed (a copy damaged on its way). Returns the page count of every
    hash_rows entry hashed."""
    monkeypatch.setattr(sys.modules["engine.restore"], "cuda_available", lambda: True)
    counts = []
    if kernel:
        real = sys.modules["engine.pagecopy"].page_hashes
        monkeypatch.setattr("engine.pagecopy.page_hashes",
                            lambda rows, row, lengths: counts.append(len(lengths)) or real(rows, row, lengths))
        return counts

    def host_page_hashes(rows, row_nbytes, lengths):
        data = np.array(rows)
        out = np.zeros((len(lengths), 2), dtype=np.uint64)
        for i, n in enumerate(lengths):
            page = bytearray(data[i * row_nbytes : i * row_nbytes + n].tobytes())
            if damage_row is not None and sum(counts) + i == damage_row:
                page[n // 2] ^= 0x04
            if n >= MIN_NBYTES:
                digest = xxhash.xxh3_128_intdigest(bytes(page))
                out[i] = (digest >> 64, digest & (2**64 - 1))
        counts.append(len(lengths))
        return mx.array(out)

    monkeypatch.setattr("engine.pagecopy.page_hashes", host_page_hashes)
    return counts


@pytest.mark.parametrize("fmt", ["native", "k4v4"])
def test_the_device_hashes_every_page_it_copies_and_the_store_settles_them(tmp_path, monkeypatch, fmt):
    with _published(tmp_path, fmt, 90, seed=63) as (store, engine_model, tokens, want):
        unfused = _device_backend(monkeypatch)
        counts = _device_hashes(monkeypatch)
        deferred = []
        real = store.get_pages_deferred
        monkeypatch.setattr(store, "get_pages_deferred", lambda d: deferred.append(len(d)) or real(d))
        device = engine_model()
        restored = restore(device, store, RestoreRequest(tokens + [1]))
        assert _pool_pages(device, restored) == want  # tolerance 0
        pages = 6 * len(device.identity.paged_layers)  # 90 tokens: 6 blocks of 16 per layer
        assert sum(counts) == pages and sum(deferred) == pages and unfused == []


@pytest.mark.parametrize("kernel", [
    False, pytest.param(True, marks=pytest.mark.skipif(not cuda_available(), reason="the page hash "
                                                       "kernel needs a CUDA GPU; python-xxhash stands in"))])
def test_a_page_damaged_in_the_store_fails_the_device_check_and_is_quarantined(tmp_path, monkeypatch, kernel):
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    tokens = prompt_tokens(64, seed=64).tolist()
    path = tmp_path / "s"
    with Store(path) as store:
        publish(EngineModel(model, MODEL_ID, policy=policy), store, tokens,
                _prefilled(model, policy, tokens))
        victim = store.lookup_prefix(EngineModel(model, MODEL_ID, policy=policy).identity.format_id,
                                     "default", tokens).blocks[2].pages[0]
        value = stored_value(store, victim)
    flip_bit(path, value, 8 * len(value) - 11)  # a stored byte: only its xxh3-128 can tell
    _device_backend(monkeypatch)
    counts = _device_hashes(monkeypatch, kernel=kernel)
    with Store(path) as store:
        device = EngineModel(model, MODEL_ID, policy=policy)
        used_before = [pool.num_used_blocks for pool in device.pools]
        with pytest.raises(IntegrityError) as raised:
            restore(device, store, RestoreRequest(tokens + [1]))
        assert not isinstance(raised.value, CopyDamaged) and raised.value.digest == victim.hex()
        assert counts, "the damage was found by the device's hashes, not on the host"
        assert [pool.num_used_blocks for pool in device.pools] == used_before
        restored = restore(device, store, RestoreRequest(tokens + [1]))  # quarantined: stops before it
        assert restored.tokens_restored == 32


def test_a_copy_damaged_on_its_way_fails_the_restore_and_quarantines_nothing(tmp_path, monkeypatch):
    with _published(tmp_path, "native", 64, seed=65) as (store, engine_model, tokens, want):
        _device_backend(monkeypatch)
        _device_hashes(monkeypatch, damage_row=5)
        device = engine_model()
        used_before = [pool.num_used_blocks for pool in device.pools]
        with pytest.raises(CopyDamaged):
            restore(device, store, RestoreRequest(tokens + [1]))
        assert [pool.num_used_blocks for pool in device.pools] == used_before
        _device_hashes(monkeypatch)  # the next copy arrives whole: every page is served
        restored = restore(device, store, RestoreRequest(tokens + [1]))
        assert restored.tokens_restored == 64 and _pool_pages(device, restored) == want
