"""Store over segment files (schema 2, docs/format.md section 10): where a save's bytes
go and in what order, what a failure between the segment write and the index commit
leaves, GC's hole punching, disk full at preallocation, and what check reports about
segments (page_past_end, record_orphan)."""

from __future__ import annotations

import errno
import os

import pytest

from kvstore import segments as seg
from kvstore.errors import StoreFull, StoreIOError
from kvstore.index import StoreIndex
from kvstore.lmdbenv import LmdbEnv
from kvstore.pages import PageBatch, hash_page
from kvstore.segments import PAGE_VALUE_AT, Location
from tests.kvstore.factories import (
    assert_check_clean,
    gc_now,
    make_store,
    stored_value,
)


def rand(n: int, seed: int) -> bytes:
    import blake3
    return blake3.blake3(seed.to_bytes(4, "little")).digest(length=n)


def locations(store, digests) -> list[Location]:
    with store.index.read() as index:
        return [index.location(d) for d in digests]


def test_a_save_appends_records_syncs_them_then_commits_once(tmp_path, monkeypatch):
    """Write order: every record's bytes are in a segment and fdatasync'ed before the one
    index commit that names them; the page value is bytes 80.. of its record."""
    pages = [rand(20_000 + i, i) for i in range(12)]
    events = []
    real_sync, real_write = seg.SegmentFiles.sync, LmdbEnv.write

    def sync(self):
        events.append("sync")
        return real_sync(self)

    def write(self, fn, **kw):
        events.append(f"commit:{kw.get('what')}")
        return real_write(self, fn, **kw)
    with make_store(tmp_path / "s") as store:
        store.put_format  # noqa: B018 (the store is open before the patches)
        monkeypatch.setattr(seg.SegmentFiles, "sync", sync)
        monkeypatch.setattr(LmdbEnv, "write", write)
        result = store.put_pages(PageBatch.hash(pages))
        monkeypatch.undo()
        assert result.new == 12
        assert events == ["sync", "commit:storing pages"]
        locs = locations(store, [hash_page(p) for p in pages])
        assert all(loc.offset % seg.RECORD_ALIGN == 0 for loc in locs)
        with store.index.read() as index:
            tails = index.segment_tails()
        assert tails == {0: max(loc.end for loc in locs)}
        for page, loc in zip(pages, locs, strict=True):
            blob = (tmp_path / "s" / "segments" / f"{loc.segment:08x}.seg").read_bytes()
            value = blob[loc.offset + PAGE_VALUE_AT : loc.offset + loc.length]
            assert value == stored_value(store, hash_page(page))
            assert value[48:] == page
        assert store.read_pages([hash_page(p) for p in pages]) == pages
        assert_check_clean(store, read_data=True)


def test_a_failed_index_commit_leaves_only_unreachable_bytes_that_the_next_save_reuses(tmp_path, monkeypatch):
    pages = [rand(9000, i) for i in range(6)]
    with make_store(tmp_path / "s") as store:
        store.put_pages(PageBatch.hash(pages[:2]))
        tail_before = locations(store, [hash_page(pages[1])])[0].end

        def fail(self, encoded):
            raise StoreIOError("injected: the index commit failed")
        monkeypatch.setattr(StoreIndex, "write_pages", fail)
        with pytest.raises(StoreIOError):
            store.put_pages(PageBatch.hash(pages[2:4]))
        monkeypatch.undo()
        assert store.missing([hash_page(p) for p in pages[2:4]]) == [hash_page(p) for p in pages[2:4]]
        assert_check_clean(store, read_data=True)  # the leftovers past the tail: not reported
        store.put_pages(PageBatch.hash(pages[4:]))
        # the next save starts at the committed tail, over the leftovers
        assert locations(store, [hash_page(pages[4])])[0].offset == tail_before
        assert store.read_pages([hash_page(p) for p in pages[:2] + pages[4:]]) == pages[:2] + pages[4:]
        assert_check_clean(store, read_data=True)


def test_a_failed_fdatasync_commits_nothing(tmp_path, monkeypatch):
    page = rand(5000, 1)
    with make_store(tmp_path / "s") as store:
        def fail(fd):
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(seg.os, "fdatasync", fail)
        with pytest.raises(StoreIOError, match="fdatasync"):
            store.put_pages({hash_page(page): page})
        monkeypatch.undo()
        assert store.missing([hash_page(page)]) == [hash_page(page)]
        assert store.stats().page_count == 0
        assert_check_clean(store, read_data=True)


def test_a_full_disk_at_segment_preallocation_is_store_full_with_nothing_reachable(tmp_path, monkeypatch):
    first, second = rand(3000, 1), rand(3 << 20, 2)  # the second needs a new segment
    with make_store(tmp_path / "s") as store:
        store.put_pages({hash_page(first): first})

        def full(fd, offset, nbytes):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(seg.os, "posix_fallocate", full)
        with pytest.raises(StoreFull, match="disk is full"):
            store.put_pages({hash_page(second): second})
        monkeypatch.undo()
        assert sorted(os.listdir(tmp_path / "s" / "segments")) == ["00000000.seg"]
        assert store.missing([hash_page(second)]) == [hash_page(second)]
        assert_check_clean(store, read_data=True)
        store.put_pages({hash_page(second): second})  # room again
        assert store.read_pages([hash_page(first), hash_page(second)]) == [first, second]
        assert_check_clean(store, read_data=True)


def test_gc_punches_dead_records_after_the_grace_and_frees_their_blocks(tmp_path):
    pages = [rand(256 << 10, i) for i in range(8)]
    with make_store(tmp_path / "s") as store:
        store.put_pages(PageBatch.hash(pages))
        path = tmp_path / "s" / "segments" / "00000000.seg"
        allocated = os.stat(path).st_blocks
        plan = store.plan_gc(3600.0)  # young pages: nothing to do
        assert plan.pages == [] and plan.dead_records == []
        done = gc_now(store)  # unreferenced, grace 0: deleted, then punched
        assert done["pages"] == 8 and done["punched_records"] == 8
        freed = (allocated - os.stat(path).st_blocks) * 512
        assert freed >= 8 * (256 << 10), f"punching freed only {freed} bytes"
        with open(path, "rb") as f:
            assert f.read(4096) == bytes(4096)  # a punched record reads as zeros
        with store.index.read() as index:
            assert list(index.dead_records()) == []
        assert store.stats().page_count == 0
        assert_check_clean(store, read_data=True)


def test_a_dead_record_waits_out_the_grace_period(tmp_path):
    page = rand(5000, 3)
    with make_store(tmp_path / "s") as store:
        store.put_pages({hash_page(page): page})
        store.plan_gc(0.0).execute()
        # the page was deleted, punched at once (grace 0); a record that dies under a
        # grace waits for a later GC
        store.put_pages({hash_page(page): page})
        store.index.write(lambda index: index.delete_page(hash_page(page)), what="test delete")
        plan = store.plan_gc(60.0)
        assert plan.dead_records == [] and plan.execute().get("punched_records") == 0
        with store.index.read() as index:
            assert len(list(index.dead_records())) == 1
        assert_check_clean(store, read_data=True)  # a dead record is not an orphan


def test_check_names_orphan_records_and_locations_past_the_end(tmp_path):
    a, b = rand(7000, 1), rand(7000, 2)
    da, db = hash_page(a), hash_page(b)
    with make_store(tmp_path / "s") as store:
        store.put_pages({da: a, db: b})
        la = locations(store, [da])[0]
        # a page dropped from the index without its record becoming dead: leaked space
        store.index.write(lambda index: index.delete_page(da, record_dies=False),
                          what="test: leak a record")
        # a location moved past the segment's committed tail
        loc = locations(store, [db])[0]
        moved = Location(loc.segment, loc.offset + (1 << 20), loc.length, loc.flags)
        store.lmdb.write(lambda txn, dbs: txn.put(db, moved.pack(), db=dbs["pages"]),
                         what="test: move a location")
        report = store.check(read_data=True)
        kinds = {(p.kind, p.object) for p in report.problems}
        assert ("page_past_end", db.hex()) in kinds, report.problems
        # both records are now named by nothing: a's (leaked) and b's (its entry moved)
        orphans = {p.object: p.detail for p in report.problems if p.kind == "record_orphan"}
        assert set(orphans) == {f"{la.segment:08x}+{la.offset}", f"{loc.segment:08x}+{loc.offset}"}
        assert da.hex() in orphans[f"{la.segment:08x}+{la.offset}"]
        assert db.hex() in orphans[f"{loc.segment:08x}+{loc.offset}"]
        structure = {p.kind for p in store.check().problems}
        assert "page_past_end" in structure and "record_orphan" not in structure


# offsets into a record: record magic, reserved, digest, reserved, checksum, page magic,
# codec, page reserved, raw length, stored length, xxh3, digest prefix, first and last
# stored byte
DAMAGE_AT = (0, 5, 8, 50, 72, 80, 84, 86, 90, 100, 110, 124, 128, -1)


@pytest.mark.parametrize("at", DAMAGE_AT)
def test_get_pages_refuses_and_quarantines_damage_anywhere_in_a_record(tmp_path, at):
    """get_pages' one-parse verification (segments.verify_record) still refuses a byte
    flipped anywhere in a segment record, header or body, and serves nothing of it."""
    from kvstore.errors import IntegrityError
    good, bad = rand(30_000, 1), rand(30_000, 2)
    with make_store(tmp_path / "s") as store:
        batch = PageBatch.hash([good, bad])
        store.put_pages(batch)
        loc = locations(store, [batch.digests[1]])[0]
        offset = loc.offset + (at if at >= 0 else loc.length + at)
        fd = os.open(store.path / "segments" / f"{loc.segment:08x}.seg", os.O_RDWR)
        try:
            byte = os.pread(fd, 1, offset)
            os.pwrite(fd, bytes([byte[0] ^ 0x10]), offset)
        finally:
            os.close(fd)
        with store.get_pages([batch.digests[0]]) as views:
            assert bytes(views[0]) == good
        with pytest.raises(IntegrityError):
            with store.get_pages(list(batch.digests)):
                pytest.fail("a damaged page was served")
        assert store.stats().quarantined_count == 1
