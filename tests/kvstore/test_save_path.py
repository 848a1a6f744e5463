"""The save path (issue 19 item 2) on the schema-1 store: a PageBatch's digests are
computed once, by kvstore, on every core, and Store.put_pages does not hash them again
(client pairs still are); zstd is decided once per page format and never tried for
packed ones; a save commits once however many pages (one fdatasync); the map grows
before a large put instead of after a failed attempt per doubling."""

from __future__ import annotations

import os

import blake3
import pytest

import kvstore.pages as pages_module
import kvstore.store as store_module
from kvstore import fileio
from kvstore.errors import DigestMismatch, InvalidInput
from kvstore.index import StoreIndex
from kvstore.pages import CODEC_RAW, CODEC_ZSTD, PageBatch, PageHeader, hash_page, hash_pages
from tests.kvstore.factories import make_store


def rand(n: int, seed: int) -> bytes:
    return blake3.blake3(seed.to_bytes(4, "little")).digest(length=n)


def codec_of(store, digest) -> int:
    with store.index.read() as index:
        return PageHeader.unpack(index.page(digest)).codec


@pytest.mark.parametrize("workers", [None, 1, 3])
def test_hash_pages_names_every_page_as_hash_page_does(workers):
    pages = [b"", b"x", rand(5000, 1), rand(2 << 20, 2), bytes(300)] * 3
    assert hash_pages(pages, workers) == [hash_page(p) for p in pages]


def test_a_page_batch_is_stored_without_hashing_again(tmp_path, monkeypatch):
    pages = [rand(4096, i) for i in range(20)]
    batch = PageBatch.hash(pages)
    assert list(batch.digests) == [blake3.blake3(p).digest() for p in pages]

    def no_rehash(_pages):
        raise AssertionError("put_pages hashed a PageBatch again")

    monkeypatch.setattr(store_module, "verified_pages", no_rehash)
    with make_store(tmp_path / "s") as store:
        result = store.put_pages(batch)
        assert (result.new, result.existing) == (20, 0)
        assert store.read_pages(batch.digests) == pages
        again = store.put_pages(batch.only(reversed(batch.digests[:5])))
        assert (again.new, again.existing) == (0, 5)


def test_client_pairs_are_still_verified(tmp_path):
    page = rand(1000, 1)
    with make_store(tmp_path / "s") as store:
        with pytest.raises(DigestMismatch):
            store.put_pages([(bytes(32), page)])
        assert store.stats().page_count == 0
        batch = PageBatch.hash([page])
        forged = [(d, rand(1000, 2)) for d, _ in batch]  # a batch's pairs, bytes swapped
        with pytest.raises(DigestMismatch):
            store.put_pages(forged)


def test_a_page_batch_is_made_only_by_hashing_immutable_pages():
    with pytest.raises(AssertionError, match="PageBatch.hash"):
        PageBatch((hash_page(b"a"),), (b"b",), (None,))
    with pytest.raises(InvalidInput, match="writable"):
        PageBatch.hash([bytearray(b"abc")])
    with pytest.raises(InvalidInput, match="page formats"):
        PageBatch.hash([b"a", b"b"], ["native-bf16"])
    batch = PageBatch.hash([b"a", b"b"])
    with pytest.raises(InvalidInput, match="not in this batch"):
        batch.only([hash_page(b"c")])
    assert PageBatch.hash([memoryview(b"abc")]).digests == (hash_page(b"abc"),)


def test_zstd_is_decided_once_per_page_format_and_never_for_packed_pages(tmp_path, monkeypatch):
    zeros, noise = bytes(200_000), rand(200_000, 7)
    zeros2 = bytes(199_000)
    batch = PageBatch.hash(
        [zeros, noise, noise[:150_000] + bytes(50_000), zeros2, bytes(1000), rand(3000, 8) + bytes(9000)],
        ["k8v4", "native-bf16", "native-bf16", "mlx-q4", None, None])
    samples = []
    real = pages_module._worth_compressing

    def counting(raw, policy):
        samples.append(len(raw))
        return real(raw, policy)

    monkeypatch.setattr(pages_module, "_worth_compressing", counting)
    with make_store(tmp_path / "s") as store:
        store.put_pages(batch)
        codecs = [codec_of(store, d) for d in batch.digests]
    # packed: raw though all zeros; native-bf16: its first page (noise) decided for both
    # (one sample); quantised: raw; no format: each page sampled itself
    assert codecs == [CODEC_RAW, CODEC_RAW, CODEC_RAW, CODEC_RAW, CODEC_ZSTD, CODEC_ZSTD]
    # one decision for native-bf16 (its second page is not sampled), none for packed or
    # quantised pages; the format-less pages are asked each (<= 128 KiB: no sample)
    assert samples == [200_000, 1000, 12000]
    with make_store(tmp_path / "pairs") as store:  # pairs: every page sampled, as before
        store.put_pages(list(batch))
        assert [codec_of(store, d) for d in batch.digests][:4] == [CODEC_ZSTD, CODEC_RAW,
                                                                    CODEC_RAW, CODEC_ZSTD]


def test_a_save_of_many_pages_commits_once(tmp_path):
    pages = [os.urandom(1 << 20) for _ in range(72)]  # 72 MiB: past the old 64 MiB batches
    batch = PageBatch.hash(pages)
    with make_store(tmp_path / "s") as store:
        before = fileio.calls["write"]
        store.put_pages(batch)
        assert fileio.calls["write"] - before == 1
        assert store.stats().page_count == 72


def test_the_page_count_cap_still_splits_a_put(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "PUT_BATCH_PAGES", 4)
    pages = [rand(100, i) for i in range(10)]
    with make_store(tmp_path / "s", map_nbytes=1 << 20) as store:  # no growth: no retried commit
        before = fileio.calls["write"]
        store.put_pages(PageBatch.hash(pages))
        assert fileio.calls["write"] - before == 3
        assert store.read_pages([hash_page(p) for p in pages]) == pages


def test_a_large_put_grows_the_map_first_and_runs_once(tmp_path, monkeypatch):
    runs = []
    real = StoreIndex.write_pages

    def counted(self, encoded):
        runs.append(len(encoded))
        return real(self, encoded)

    monkeypatch.setattr(StoreIndex, "write_pages", counted)
    pages = [rand(256 << 10, i) for i in range(32)]  # 8 MiB into a 64 KiB map
    with make_store(tmp_path / "s") as store:
        store.put_pages(PageBatch.hash(pages))
        assert runs == [32]
        assert store.read_pages([hash_page(p) for p in pages]) == pages


def test_a_save_checksums_each_raw_page_once_on_the_thread_that_writes_it(tmp_path, monkeypatch):
    """The xxh3-128 of a page stored raw is computed once, by the segment writer's
    threads just before their pwritev (kvstore/segments.py PendingRecord), not in a
    pass of its own before the writes; the index records the same header."""
    import threading
    import types

    import xxhash
    calls = []

    def digest(data):
        calls.append((threading.current_thread().name, memoryview(data).nbytes))
        return xxhash.xxh3_128_digest(data)
    monkeypatch.setattr(pages_module, "xxhash", types.SimpleNamespace(xxh3_128_digest=digest))
    pages = [os.urandom(1 << 20) for _ in range(12)]  # 12 MiB: past PARALLEL_WRITE_NBYTES
    batch = PageBatch.hash(pages, ["native-bf16"] * len(pages))
    with make_store(tmp_path / "s") as store:
        store.put_pages(batch)
        page_calls = [name for name, n in calls if n == 1 << 20]
        assert len(page_calls) == len(pages)
        assert all(name.startswith("kvstore-write") for name in page_calls), page_calls
        assert store.read_pages(batch.digests) == pages
        with store.index.read() as index:
            header = PageHeader.unpack(index.page(batch.digests[0]))
        assert header.codec == CODEC_RAW and header.xxh3 == xxhash.xxh3_128_digest(pages[0])
