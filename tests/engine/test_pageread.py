"""The fused read (engine/pageread.py read_into, engine/pagecopy.py DeferredCopies): every
page handed to its sink is the verified stored page, byte for byte (tolerance 0); a
damaged page is never handed over, raises IntegrityError and is quarantined; a restore
that meets one gives back the blocks it had laid out; a page whose length is not its
block's is refused before anything is copied from it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.attention import installed
from engine.engine_model import EngineModel
from engine.errors import FormatMismatch
from engine.models import make_cache
from engine.pagecopy import DeferredCopies, page_regions
from engine.pageread import read_into
from engine.policy import KVPolicy
from engine.publish import publish
from engine.restore import RestoreRequest, restore
from kvstore.errors import IntegrityError
from kvstore.ids import page_digest
from kvstore.pages import HEADER_NBYTES
from kvstore.store import Store
from tests.engine.factories import prompt_tokens, tiny_model
from tests.kvstore.factories import flip_bit, stored_value

PAGE_NBYTES = 4096 + 512  # not a multiple of the chunk: runs end mid-chunk


def _pages(count: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PAGE_NBYTES, dtype=np.uint8).tobytes() for _ in range(count)]


@pytest.mark.parametrize("workers", [1, 3, 4])
@pytest.mark.parametrize("page_nbytes", [PAGE_NBYTES, 1])  # one page per get_pages; many
def test_read_into_hands_each_page_its_stored_bytes_once(tmp_path, workers, page_nbytes):
    pages = _pages(48)
    digests = [page_digest(p) for p in pages]
    got: dict[int, bytes] = {}
    with Store(tmp_path / "s") as store:
        store.put_pages(dict(zip(digests, pages, strict=True)))
        read_into(store, digests, lambda i, view: got.setdefault(i, bytes(view)) and None,
                  page_nbytes, workers=workers)
    assert sorted(got) == list(range(len(pages)))
    assert all(got[i] == pages[i] for i in range(len(pages)))


def test_read_into_never_hands_over_a_damaged_page(tmp_path):
    pages = _pages(48, seed=1)
    digests = [page_digest(p) for p in pages]
    victim = 29
    path = tmp_path / "s"
    with Store(path) as store:
        store.put_pages(dict(zip(digests, pages, strict=True)))
        value = stored_value(store, digests[victim])
    flip_bit(path, value, HEADER_NBYTES * 8 + 9)  # a bit of the page's bytes
    handed: list[int] = []
    with Store(path) as store:
        with pytest.raises(IntegrityError) as raised:
            read_into(store, digests, lambda i, view: handed.append(i), PAGE_NBYTES, workers=4)
        assert digests[victim].hex() in str(raised.value)
        assert victim not in handed
        assert store.stats().quarantined_count == 1


def test_a_page_of_the_wrong_length_is_refused_before_it_is_copied():
    copies = DeferredCopies()
    target = np.zeros((1, 4, 8), dtype=np.uint8)
    (stand_in,) = copies.stand_ins([32])

    class Spec:  # page_regions needs the plane layout only
        plane_names, kv_heads = ("k",), 1
        plane_widths, plane_dtypes = {"k": 8}, {"k": mx.uint8}

        def page_nbytes(self, tokens):
            return tokens * 8

    copies.add(stand_in, page_regions(Spec(), 4), {"k": target})
    with pytest.raises(FormatMismatch):
        copies.copy(0, bytes(range(40)))
    assert not target.any()
    copies.copy(0, bytes(range(32)))
    assert target.tobytes() == bytes(range(32))


@pytest.mark.parametrize("path", ["fused", "views"])
def test_a_restore_that_meets_a_damaged_page_gives_its_blocks_back(tmp_path, monkeypatch, path):
    """Fused (the CPU's path) and through one read of views (the device path's, run on
    the CPU)."""
    import sys

    if path == "views":
        restore_module = sys.modules["engine.restore"]  # engine.restore names the function
        monkeypatch.setattr(restore_module, "_fused", lambda engine_model, store, plan: False)
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    tokens = prompt_tokens(64, seed=5).tolist()
    engine_model = EngineModel(model, "test/tiny", policy=policy)
    cache = make_cache(model, policy)
    with installed(model):
        mx.eval(model(mx.array([tokens]), cache=cache))
    path = tmp_path / "store"
    with Store(path) as store:
        publish(engine_model, store, tokens, cache)
        match = store.lookup_prefix(engine_model.identity.format_id, "default", tokens)
        value = stored_value(store, match.blocks[3].pages[-1])  # the last page read
    for c in cache:
        c.free()
    flip_bit(path, value, HEADER_NBYTES * 8 + 77)
    with Store(path) as store:
        free = [pool.num_free_blocks for pool in engine_model.pools if pool is not None]
        with pytest.raises(IntegrityError) as raised:  # holds the failed restore's frames
            restore(engine_model, store, RestoreRequest(tokens + [0]))
        assert raised.value is not None
        assert [pool.num_free_blocks for pool in engine_model.pools if pool is not None] == free


def test_view_and_fused_restores_give_the_same_bytes(tmp_path, monkeypatch):
    """The device path's read (one read of views, then the copies), run on the CPU,
    against the fused read: the same pages, byte for byte (tolerance 0)."""
    import sys

    from engine.publish import capture

    restore_module = sys.modules["engine.restore"]  # engine.restore names the function
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    tokens = prompt_tokens(56, seed=6).tolist()  # the last block holds 8 tokens
    engine_model = EngineModel(model, "test/tiny", policy=policy)
    cache = make_cache(model, policy)
    with installed(model):
        mx.eval(model(mx.array([tokens]), cache=cache))
    with Store(tmp_path / "store") as store:
        publish(engine_model, store, tokens, cache)
        fused = restore(engine_model, store, RestoreRequest(tokens + [0]))
        monkeypatch.setattr(restore_module, "_fused", lambda engine_model, store, plan: False)
        views = restore(engine_model, store, RestoreRequest(tokens + [0]))
    assert fused.tokens_restored == views.tokens_restored == len(tokens)
    a = capture(engine_model.identity, tokens, fused.cache)
    b = capture(engine_model.identity, tokens, views.cache)
    want = capture(engine_model.identity, tokens, cache)
    for x, y, z in zip(a.layers, b.layers, want.layers, strict=True):
        assert [bytes(x.page(i)) for i in range(4)] == [bytes(y.page(i)) for i in range(4)] \
            == [bytes(z.page(i)) for i in range(4)]


def test_a_pending_read_verifies_on_its_readers_and_raises_at_views(tmp_path):
    from engine.pageread import PendingRead

    pages = _pages(48, seed=2)
    digests = [page_digest(p) for p in pages]
    path = tmp_path / "s"
    with Store(path) as store:
        store.put_pages(dict(zip(digests, pages, strict=True)))
        read = PendingRead(store, digests, workers=4)
        try:
            assert [bytes(v) for v in read.views()] == pages
        finally:
            read.close()
        read.close()  # idempotent
        value = stored_value(store, digests[40])
    flip_bit(path, value, HEADER_NBYTES * 8 + 3)
    with Store(path) as store:
        read = PendingRead(store, digests, workers=4)
        try:
            with pytest.raises(IntegrityError):
                read.views()
        finally:
            read.close()


def _published_kv(tmp_path, seed: int, n_tokens: int):
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    tokens = prompt_tokens(n_tokens, seed=seed).tolist()
    engine_model = EngineModel(model, "test/tiny", policy=policy)
    cache = make_cache(model, policy)
    with installed(model):
        mx.eval(model(mx.array([tokens]), cache=cache))
    with Store(tmp_path / "store") as store:
        publish(engine_model, store, tokens, cache)
    return engine_model, tokens, cache


def test_a_kvcache_restores_fused_read_gives_the_bytes_of_the_view_read(tmp_path, monkeypatch):
    """The KVCache layout's fused read (engine/restore.py _read_fused: every layer laid
    out, then one read) against the device path's one read of views, run on the CPU,
    and the published caches: the same K and V, bit for bit (tolerance 0)."""
    import sys

    restore_module = sys.modules["engine.restore"]  # engine.restore names the function
    engine_model, tokens, cache = _published_kv(tmp_path, seed=7, n_tokens=72)  # last block 8
    request = RestoreRequest(tokens + [0], cache_kind="kvcache")
    with Store(tmp_path / "store") as store:
        fused = restore(engine_model, store, request)
        monkeypatch.setattr(restore_module, "_fused", lambda engine_model, store, plan: False)
        views = restore(engine_model, store, request)
    assert fused.tokens_restored == views.tokens_restored == len(tokens)
    for a, b, want in zip(fused.cache, views.cache, cache, strict=True):
        keys, values = want.state
        for x, y, z in ((a.keys, b.keys, keys), (a.values, b.values, values)):
            x, y = x[..., : len(tokens), :], y[..., : len(tokens), :]
            assert np.array(x.view(mx.uint16)).tobytes() == np.array(y.view(mx.uint16)).tobytes() \
                == np.array(z.view(mx.uint16)).tobytes()


@pytest.mark.parametrize("fused", [True, False])
def test_a_kvcache_restore_writes_every_byte_of_its_uninitialised_arrays(tmp_path, monkeypatch, fused):
    """The KVCache layout's arrays are allocated uninitialised (engine/pagecopy.py
    uninitialised): here they start as 0xAB in every byte, and the restore must still
    give the published K and V bit for bit (tolerance 0), the last block short."""
    import sys

    restore_module = sys.modules["engine.restore"]  # engine.restore names the functions

    def filled(shapes, dtypes):
        out = {n: mx.full(shape[:-1] + (shape[-1] * dtypes[n].size,), 0xAB, mx.uint8).view(dtypes[n])
               for n, shape in shapes.items()}
        mx.eval(list(out.values()))
        return out

    monkeypatch.setattr(restore_module, "uninitialised", filled)
    if not fused:
        monkeypatch.setattr(restore_module, "_fused", lambda engine_model, store, plan: False)
    engine_model, tokens, cache = _published_kv(tmp_path, seed=9, n_tokens=72)
    with Store(tmp_path / "store") as store:
        restored = restore(engine_model, store, RestoreRequest(tokens + [0], cache_kind="kvcache"))
    assert restored.tokens_restored == len(tokens)
    for got, want in zip(restored.cache, cache, strict=True):
        keys, values = want.state
        assert got.keys.shape == keys.shape and got.values.shape == values.shape
        for x, z in ((got.keys, keys), (got.values, values)):
            assert np.array(x.view(mx.uint16)).tobytes() == np.array(z.view(mx.uint16)).tobytes()


def test_a_kvcache_restore_that_meets_a_damaged_page_raises_integrity_error(tmp_path):
    """A damaged page in a middle layer of block 1: IntegrityError on the caller's
    thread; the page is quarantined, so the next restore serves block 0 alone, bit for
    bit (tolerance 0)."""
    engine_model, tokens, cache = _published_kv(tmp_path, seed=8, n_tokens=64)
    with Store(tmp_path / "store") as store:
        match = store.lookup_prefix(engine_model.identity.format_id, "default", tokens)
        value = stored_value(store, match.blocks[1].pages[len(match.blocks[1].pages) // 2])
    block0 = [[np.array(x[..., :16, :].view(mx.uint16)).tobytes() for x in c.state] for c in cache]
    for c in cache:
        c.free()
    flip_bit(tmp_path / "store", value, HEADER_NBYTES * 8 + 77)
    with Store(tmp_path / "store") as store:
        with pytest.raises(IntegrityError):
            restore(engine_model, store, RestoreRequest(tokens + [0], cache_kind="kvcache"))
        again = restore(engine_model, store, RestoreRequest(tokens + [0], cache_kind="kvcache"))
    assert again.tokens_restored == 16  # block 0: the quarantined page's block is not served
    assert [[np.array(x.view(mx.uint16)).tobytes() for x in (c.keys, c.values)] for c in again.cache] == block0
