"""StoreStats.file_nbytes at schema 2 counts the segment files' allocated bytes (st_blocks
* 512) as well as LMDB's used data file: the page bodies live in the segments, so a
figure of data.mdb alone misses nearly all of the disk a store holds."""

from __future__ import annotations

import os

from kvstore.pages import PageBatch
from tests.kvstore.factories import gc_now, make_store

PAGE_NBYTES = 256 * 1024


def pages(n: int, seed: int = 0) -> list[bytes]:
    import blake3
    return [blake3.blake3(bytes([seed, i])).digest(length=PAGE_NBYTES) for i in range(n)]


def segment_allocated_nbytes(store) -> int:
    """Independently of the store's code: st_blocks * 512 of every <store>/segments/*.seg."""
    directory = store.path / "segments"
    return sum(os.stat(directory / name).st_blocks * 512
               for name in os.listdir(directory) if name.endswith(".seg"))


def test_file_nbytes_counts_the_segment_files_allocated_bytes(tmp_path):
    with make_store(tmp_path / "s") as store:
        store.put_pages(PageBatch.hash(pages(12)))
        segments = segment_allocated_nbytes(store)
        stats = store.stats()
        # the 12 bodies (3 MiB) are in the segments, preallocation included
        assert segments >= 12 * PAGE_NBYTES
        assert stats.file_nbytes == store._lmdb.used_nbytes() + segments
        assert stats.file_nbytes > stats.stored_nbytes


def test_file_nbytes_drops_when_gc_punches_dead_records(tmp_path):
    """Punched holes free blocks (the files keep their size): file_nbytes follows the
    blocks, not st_size. Where the filesystem cannot punch, GC reports the records as
    unpunched and the figure must not drop."""
    with make_store(tmp_path / "s") as store:
        store.put_pages(PageBatch.hash(pages(12)))  # no block names them: garbage
        before = store.stats().file_nbytes
        report = gc_now(store)  # deletes the pages; grace 0: punches their records
        after = store.stats()
        assert after.page_count == 0
        assert after.file_nbytes == store._lmdb.used_nbytes() + segment_allocated_nbytes(store)
        if report["punched_records"] == 12:
            assert after.file_nbytes <= before - 12 * PAGE_NBYTES + (1 << 20), (before, after.file_nbytes)
