"""kvstore/segments.py on its own: records round-trip from the caller's buffers, sit
4 KiB aligned with their stored bytes 64-byte aligned, every kind of damage is named,
scan finds records and orphans, holes free space, a full disk at preallocation leaves
nothing behind, a failed fdatasync is fatal, compaction moves verified records."""

from __future__ import annotations

import errno
import os
import threading

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import segments as seg
from kvstore.errors import StoreFull, StoreIOError
from kvstore.pages import Compression, decode_stored, encode_page
from kvstore.segments import (
    RECORD_ALIGN,
    RECORD_HEADER_NBYTES,
    Location,
    PendingRecord,
    SegmentFiles,
    verify_record,
)

SMALL = 64 * 1024  # segment size in these tests: rollover runs


def page(n: int, seed: int = 0) -> bytes:
    return blake3.blake3(seed.to_bytes(4, "little")).digest(length=n)


RAW = Compression(enabled=False)


def pending(data, policy=RAW) -> PendingRecord:
    digest = blake3.blake3(data).digest()
    header, stored = encode_page(data, policy, digest)
    return PendingRecord(digest, header, stored)


def _appended(path, recs, segment_nbytes: int = SMALL) -> tuple[SegmentFiles, list]:
    """SegmentFiles at `path` with `recs` appended and synced: (files, their locations)."""
    files = SegmentFiles(path, segment_nbytes)
    locs = files.append(recs)
    files.sync()
    return files, locs


def test_records_round_trip_aligned_and_zero_copy(tmp_path):
    files = SegmentFiles(tmp_path, SMALL)
    datas = [page(n, i) for i, n in enumerate((1, 512, 4096 - RECORD_HEADER_NBYTES, 5000))]
    source = bytearray(b"".join(datas))
    views, at = [], 0
    for d in datas:  # slices of one caller buffer: written from where they lie
        views.append(memoryview(source)[at:at + len(d)])
        at += len(d)
    recs = [PendingRecord(blake3.blake3(d).digest(), encode_page(d, Compression(enabled=False))[0], v)
            for d, v in zip(datas, views, strict=True)]
    locs = files.append(recs)
    files.sync()
    assert [loc.offset % RECORD_ALIGN for loc in locs] == [0] * len(locs)
    assert locs[2].span_nbytes == RECORD_ALIGN  # header + body exactly one block
    for loc, d, rec in zip(locs, datas, recs, strict=True):
        header, body = files.read_verified(loc, rec.digest)
        assert bytes(body) == d
        assert isinstance(body, memoryview) and body.readonly
        assert (loc.offset + RECORD_HEADER_NBYTES) % 64 == 0
    assert Location.unpack(locs[3].pack()) == locs[3]
    files.close()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=20000), min_size=1, max_size=8))
def test_any_pages_round_trip_through_segments(tmp_path_factory, datas):
    recs = [pending(d, Compression()) for d in datas]
    files, locs = _appended(tmp_path_factory.mktemp("seg"), recs)
    for loc, d, rec in zip(locs, datas, recs, strict=True):
        header, body = files.read_verified(loc, rec.digest)
        assert bytes(decode_stored(header, body)) == d
    files.close()


def test_segments_roll_over_and_a_large_record_gets_its_own(tmp_path):
    files = SegmentFiles(tmp_path, SMALL)
    locs = files.append([pending(page(20000, i)) for i in range(6)])  # 6 x 20 KiB spans
    big = files.append([pending(page(3 * SMALL, 99))])[0]
    files.sync()
    assert sorted({loc.segment for loc in locs}) == [0, 1]  # three 20 KiB spans per segment
    assert big.segment == 2 and files.file_nbytes(2) == big.span_nbytes
    assert files.file_nbytes(0) == SMALL  # preallocated whole
    files.close()


@pytest.mark.parametrize("where", ["body", "digest", "header_length", "checksum"])
def test_damage_inside_a_record_is_named(tmp_path, where):
    files = SegmentFiles(tmp_path, SMALL)
    rec = pending(page(3000, 1))
    loc = files.append([rec])[0]
    files.sync()
    files.close()
    at = {"body": RECORD_HEADER_NBYTES + 1000, "digest": 9, "header_length": 80 + 23,
          "checksum": 73}[where]
    with open(files.path(loc.segment), "r+b") as f:
        f.seek(loc.offset + at)
        b = f.read(1)[0]
        f.seek(loc.offset + at)
        f.write(bytes([b ^ 0x10]))
    files = SegmentFiles(tmp_path, SMALL)
    with pytest.raises(ValueError, match="xxh3-128" if where == "body" else "checksum"):
        files.read_verified(loc, rec.digest)
    files.close()


def test_a_record_read_under_another_name_or_length_or_past_the_end_is_refused(tmp_path):
    files = SegmentFiles(tmp_path, SMALL)
    a, b = pending(page(100, 1)), pending(page(100, 2))
    la, lb = files.append([a, b])
    files.sync()
    with pytest.raises(ValueError, match="misplaced or swapped"):
        files.read_verified(la, b.digest)
    with pytest.raises(ValueError, match="index says"):
        files.read_verified(Location(la.segment, la.offset, la.length + 1), a.digest)
    past = Location(la.segment, SMALL - RECORD_ALIGN, la.length)  # zeros: no record there
    with pytest.raises(ValueError, match="magic"):
        files.read_verified(past, a.digest)
    beyond = Location(la.segment, SMALL + RECORD_ALIGN, la.length)
    with pytest.raises(ValueError, match="cannot hold"):
        files.read_verified(beyond, a.digest)
    with pytest.raises(ValueError, match="cannot hold"):
        files.read_verified(Location(7, 0, la.length), a.digest)  # no such segment
    files.close()


def test_scan_finds_every_record_skips_holes_and_names_damage(tmp_path):
    recs = [pending(page(n, i)) for i, n in enumerate((100, 9000, 50, 7000))]
    files, locs = _appended(tmp_path, recs, 1 << 20)
    found = list(files.scan(0))
    assert [(r.offset, r.digest, r.problem) for r in found] == [
        (loc.offset, rec.digest, None) for loc, rec in zip(locs, recs, strict=True)]
    with open(files.path(0), "r+b") as f:  # a hole where the second record was (zeros,
        f.seek(locs[1].offset)              # as a punched hole reads), damage in the last
        f.write(bytes(locs[1].span_nbytes))
        f.seek(locs[3].offset + RECORD_HEADER_NBYTES + 5)
        f.write(b"\xff")
    files.close()
    files = SegmentFiles(tmp_path, 1 << 20)
    found = list(files.scan(0))
    assert [r.offset for r in found] == [locs[0].offset, locs[2].offset, locs[3].offset]
    assert found[0].problem is None and found[1].problem is None
    assert "xxh3" in found[2].problem
    # orphans: records no index entry names (here the index names the first only)
    assert [r.offset for r in found if r.offset != locs[0].offset] == [locs[2].offset, locs[3].offset]
    assert [r.offset for r in files.scan(0, tail=locs[2].offset)] == [locs[0].offset]
    files.close()


def test_punch_frees_a_dead_records_blocks_and_reads_zeros(tmp_path):
    files = SegmentFiles(tmp_path, 1 << 20)
    locs = files.append([pending(page(200_000, i)) for i in range(2)])
    files.sync()
    before = os.stat(files.path(0)).st_blocks
    if not files.punch(locs[0]):
        pytest.skip(f"the filesystem of {tmp_path} cannot punch holes")
    after = os.stat(files.path(0)).st_blocks
    assert (before - after) * 512 >= locs[0].span_nbytes - RECORD_ALIGN
    assert os.stat(files.path(0)).st_size == 1 << 20  # KEEP_SIZE
    assert not any(files.view(locs[0]))
    assert [r.offset for r in files.scan(0)] == [locs[1].offset]
    files.close()


def test_a_full_disk_at_preallocation_is_store_full_and_leaves_no_segment(tmp_path, monkeypatch):
    files = SegmentFiles(tmp_path, SMALL)

    def full(fd, offset, nbytes):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(seg.os, "posix_fallocate", full)
    with pytest.raises(StoreFull, match="disk is full"):
        files.append([pending(page(10, 1))])
    assert files.segments() == [] and list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    loc = files.append([pending(page(10, 1))])[0]  # room again: the first segment is 0
    assert loc.segment == 0
    files.close()


def test_a_failed_fdatasync_is_fatal_and_not_retried(tmp_path, monkeypatch):
    files = SegmentFiles(tmp_path, SMALL)
    files.append([pending(page(10, 1))])
    calls = []

    def failing(fd):
        calls.append(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(seg.os, "fdatasync", failing)
    with pytest.raises(StoreIOError, match="fdatasync"):
        files.sync()
    assert len(calls) == 1
    files.close()


def test_resume_appends_at_the_committed_tail_over_leftovers(tmp_path):
    files = SegmentFiles(tmp_path, SMALL)
    kept = files.append([pending(page(100, 1))])[0]
    files.sync()
    tail = files.tail
    files.append([pending(page(100, 2))])  # a crash before the index commit: a leftover
    files.close()
    files = SegmentFiles(tmp_path, SMALL)
    files.resume(*tail)
    rec = pending(page(300, 3))
    loc = files.append([rec])[0]
    files.sync()
    assert (loc.segment, loc.offset) == tail
    assert [r.digest for r in files.scan(0)] == [pending(page(100, 1)).digest, rec.digest]
    assert files.read_verified(kept, pending(page(100, 1)).digest)[1].nbytes == 100
    files.close()


def test_relocate_moves_verified_records_and_the_old_segment_goes(tmp_path):
    recs = [pending(page(20000, i)) for i in range(3)]
    files, locs = _appended(tmp_path, recs)
    moved = files.relocate([(recs[1].digest, locs[1])])
    files.sync()
    assert moved[0].segment == 1
    files.remove(0)
    assert files.segments() == [1]
    assert bytes(files.read_verified(moved[0], recs[1].digest)[1]) == page(20000, 1)
    files.close()


def test_a_damaged_record_is_not_relocated(tmp_path):
    files = SegmentFiles(tmp_path, SMALL)
    rec = pending(page(1000, 1))
    loc = files.append([rec])[0]
    files.sync()
    with open(files.path(0), "r+b") as f:
        f.seek(loc.offset + RECORD_HEADER_NBYTES)
        f.write(b"\x00\x01")
    with pytest.raises(ValueError, match="xxh3"):
        files.relocate([(rec.digest, loc)])
    files.close()


def test_verify_record_checks_a_compressed_record(tmp_path):
    files = SegmentFiles(tmp_path, SMALL)
    data = bytes(50_000)
    rec = pending(data, Compression())
    loc = files.append([rec])[0]
    assert loc.flags == 1 and loc.length < 1000  # zstd, tiny
    header, body = verify_record(files.view(loc), rec.digest, loc)
    assert decode_stored(header, body) == data
    files.close()


def test_audit_names_damaged_records_entries_past_the_end_and_orphans(tmp_path):
    from kvstore.segments import audit

    recs = [pending(page(3000, i)) for i in range(4)]
    files, locs = _appended(tmp_path, recs)
    index = {r.digest: loc for r, loc in zip(recs[:3], locs[:3], strict=True)}  # 4th: orphan
    assert audit(files, index).orphans == ((0, locs[3].offset, recs[3].digest),)
    with open(files.path(0), "r+b") as f:  # damage inside the second record's body
        f.seek(locs[1].offset + RECORD_HEADER_NBYTES + 100)
        f.write(b"\x00\xff")
    files.close()
    files = SegmentFiles(tmp_path, SMALL)
    ghost = pending(page(10, 9))
    index[ghost.digest] = Location(0, SMALL, 200)  # past the segment's end
    index[b"\x01" * 32] = Location(3, 0, 200)     # a segment that does not exist
    report = audit(files, index, tails={0: locs[3].end})
    assert [d for d, _, _ in report.damaged] == [recs[1].digest]
    assert "xxh3" in report.damaged[0][2]
    assert {d for d, _ in report.past_end} == {ghost.digest, b"\x01" * 32}
    # the damaged record is still named (not an orphan); the 4th still is one
    assert [o[2] for o in report.orphans] == [recs[3].digest]
    short_tail = audit(files, {recs[0].digest: locs[0], recs[2].digest: locs[2]},
                       tails={0: locs[1].end})
    assert [d for d, _ in short_tail.past_end] == [recs[2].digest]
    clean = audit(files, {recs[0].digest: locs[0], recs[3].digest: locs[3]})
    assert not clean.damaged and not clean.past_end
    assert [o[2] for o in clean.orphans] == [recs[1].digest, recs[2].digest]  # damaged or not
    files.close()


def test_prepare_never_writes_through_a_descriptor_of_a_replaced_segment(tmp_path):
    """Two writers (two processes' SegmentFiles) on one directory, serialised as the
    store's writer lock does. A's failed save left segment 1 uncommitted; B's next save
    deletes it and makes a new segment 1, committed. A's following save must append to
    that new file, not through its cached descriptor of the unlinked one (whose bytes
    nobody could ever read)."""
    a, b = SegmentFiles(tmp_path, SMALL), SegmentFiles(tmp_path, SMALL)
    base = a.append([pending(page(20000, i)) for i in range(3)])  # fills segment 0
    a.sync()
    tails = {0: max(loc.end for loc in base)}
    a.prepare(tails)
    a.append([pending(page(20000, 10))])  # segment 1, never committed: a leftover
    b.prepare(tails)  # deletes A's segment 1
    made = b.append([pending(page(20000, 20))])
    b.sync()
    assert made[0].segment == 1
    tails[1] = made[0].end
    a.prepare(tails)
    rec = pending(page(20000, 30))
    (loc,) = a.append([rec])
    a.sync()
    reader = SegmentFiles(tmp_path, SMALL)
    header, body = reader.read_verified(loc, rec.digest)
    assert bytes(body) == page(20000, 30)
    for files in (a, b, reader):
        files.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_append_starts_writeback_of_every_written_span_once(tmp_path, monkeypatch, workers):
    """append hands every byte it wrote to start_writeback (sync_file_range), in runs of
    at most about WRITEBACK_NBYTES, each run inside one segment, none twice; sync() is
    still what makes them durable. Small segments: the runs break at rollover."""
    monkeypatch.setattr(seg, "WRITEBACK_NBYTES", 3 * RECORD_ALIGN)
    monkeypatch.setattr(seg, "PARALLEL_WRITE_NBYTES", 0)
    calls = []
    real = seg.start_writeback
    monkeypatch.setattr(seg, "start_writeback",
                        lambda fd, offset, nbytes: (calls.append((fd, offset, nbytes)),
                                                    real(fd, offset, nbytes)))
    files = SegmentFiles(tmp_path, 8 * RECORD_ALIGN)
    recs = [pending(page(3000 + 37 * i, i)) for i in range(21)]
    locs = files.append(recs, workers=workers)
    files.sync()
    fd_segment = {fd: s for s, fd in files._write_fds.items()}
    covered = sorted((fd_segment[fd], offset, offset + nbytes) for fd, offset, nbytes in calls)
    spans = sorted((loc.segment, loc.offset, loc.end) for loc in locs)
    merged = []
    for s, a, b in covered:  # every call is a run of whole, adjacent record spans
        assert b - a <= 4 * RECORD_ALIGN
        merged += [x for x in spans if x[0] == s and a <= x[1] and x[2] <= b]
    assert merged == spans  # each span in exactly one call
    assert sum(b - a for _, a, b in covered) == sum(loc.span_nbytes for loc in locs)
    for data, loc in zip(recs, locs, strict=True):
        assert bytes(files.read_verified(loc, data.digest)[1]) == bytes(data.stored)
    files.close()


def test_verify_record_refuses_a_page_header_written_for_another_page(tmp_path):
    """The page header's digest prefix is checked on the read path as at schema 1, even
    where the record header (full digest, checksum) is intact: a page value moved under
    another page's record header is refused."""
    data, other = page(5000, 1), page(5000, 2)
    digest = blake3.blake3(data).digest()
    header, stored = encode_page(data, RAW, blake3.blake3(other).digest())  # other's prefix
    files, (loc,) = _appended(tmp_path, [PendingRecord(digest, header, stored)])
    with pytest.raises(ValueError, match="page header was written for page"):
        files.read_verified(loc, digest)
    files.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_raw_record_gets_its_header_and_xxh3_on_the_thread_that_writes_it(tmp_path, monkeypatch,
                                                                             workers):
    """PendingRecord(page_header=None): append makes the raw page header (the xxh3-128
    of the stored bytes) on the write thread, right before that record's pwritev, and
    sets it on the record: the header encode_page makes, and the record verifies."""
    monkeypatch.setattr(seg, "PARALLEL_WRITE_NBYTES", 0)
    events = []  # (thread name, what, digest), as the writers did them
    real_header, real_write = seg.raw_page_header, SegmentFiles._pwritev_all

    def header(raw, digest):
        events.append((threading.current_thread().name, "xxh3", bytes(digest)))
        return real_header(raw, digest)

    def write(self, segment, parts, offset, total):
        events.append((threading.current_thread().name, "write", bytes(parts[0][8:40])))
        return real_write(self, segment, parts, offset, total)
    monkeypatch.setattr(seg, "raw_page_header", header)
    monkeypatch.setattr(SegmentFiles, "_pwritev_all", write)
    datas = [page(5000 + 111 * i, i) for i in range(8)]
    recs = [PendingRecord(blake3.blake3(d).digest(), None, d) for d in datas]
    files = SegmentFiles(tmp_path, SMALL)
    locs = files.append(recs, workers=workers)
    files.sync()
    for rec, loc, d in zip(recs, locs, datas, strict=True):
        assert rec.page_header == encode_page(d, RAW, rec.digest)[0]
        assert loc.flags == 0  # codec raw
        assert bytes(files.read_verified(loc, rec.digest)[1]) == d
    threads = {name for name, _, _ in events}
    for name in threads:  # per thread: each page's xxh3, then at once its own write
        mine = [(what, digest) for n, what, digest in events if n == name]
        assert mine == [step for what, digest in mine[::2] for step in (("xxh3", digest), ("write", digest))]
    assert sorted(digest for _, what, digest in events if what == "xxh3") == sorted(r.digest for r in recs)
    if workers > 1:
        assert all(name.startswith("kvstore-write") for name in threads)
    files.close()
