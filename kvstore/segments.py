"""Segment files: page bodies in preallocated, append-only files beside the LMDB index
(issue 19 item 1; key-value separation as in WiscKey, Badger's value log, restic's
pack files). Not yet used by Store: the store still keeps page bodies as LMDB values
(schema version 1). This module is the layer Store switches to at schema version 2.

Nouns:
  segment     <dir>/<id as 8 hex digits>.seg, preallocated (posix_fallocate) when it is
              made, so a full disk is met when a segment is made, never in the middle of
              a record. Its size: segment_nbytes, or, with first_segment_nbytes set (the
              store's case), the larger of what the append still has to write and twice
              the previous segment, within [first_segment_nbytes, segment_nbytes]; a
              record larger than that gets a segment of its own span.
  record      one page at a RECORD_ALIGN (4 KiB) aligned offset:
                offset size field
                0      4    magic b"KVS1"
                4      4    reserved, zero
                8      32   digest: blake3 of the raw page (the page's name)
                40     32   reserved, zero
                72     8    xxh3-64 of bytes [0, 72) then [80, 128): a header that is
                            not a record's (zeros, a punched hole, stale bytes) or that
                            was damaged is told apart from one that is
                80     48   the page header of kvstore/pages.py (codec, raw_nbytes,
                            stored_nbytes, xxh3-128 of the stored bytes, digest prefix)
                128    ...  stored bytes (64-byte aligned: viewable as any dtype)
              then zero padding to the next 4 KiB boundary (the record's span). Bytes
              [80, length) are exactly a schema-1 page record (header || stored bytes):
              page_value() views them, and kvstore/pages.py verifies them as at schema 1.
  location    where the index finds a record: (segment, offset, length, flags), packed
              as LOCATION (24 bytes, big-endian); length = RECORD_HEADER_NBYTES +
              stored_nbytes; flags holds the codec.
  tail        the end of the bytes of a segment that the index may name. The writer
              keeps it (the index commits it with the locations it makes reachable):
              bytes past it are leftovers of a crash, unreachable, and overwritten.

Write order (the caller's part is the index transaction):
  append()    os.pwritev from the caller's buffers (header, stored bytes, padding): no
              join copy; records are not yet durable;
  sync()      fdatasync of every segment written since the last sync; a failure is
              fatal for that save (StoreIOError), never retried into a success;
  then the caller commits the index transaction that makes the locations reachable.
A crash before that commit leaves only unreachable bytes past the committed tail.

Reads: view() is a zero-copy memoryview of a read-only mmap of the segment;
verify_record() checks the header checksum, the digest, the lengths and the xxh3-128
of the stored bytes (not blake3: check --read-data does that).

Space: punch() frees one dead record's span (fallocate PUNCH_HOLE | KEEP_SIZE); the
caller does so only after a grace period, since another process may still read it
(GC's plan -> execute). A mostly-dead segment is compacted by relocate() (live records
appended elsewhere; the caller rebinds their locations, then removes the segment after
the grace period). scan() walks a segment's records for check: records no index entry
names are orphans, and entries past a segment's end are reported by the caller.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import xxhash

from kvstore import fileio
from kvstore.errors import StoreFull, StoreIOError
from kvstore.pages import CODEC_RAW, PageHeader, raw_page_header
from kvstore.pages import HEADER_NBYTES as PAGE_HEADER_NBYTES

RECORD_MAGIC = b"KVS1"
RECORD_ALIGN = 4096
RECORD_HEADER_NBYTES = 128
_PREFIX = struct.Struct(">4s4s32s")  # magic, reserved, digest
PAGE_VALUE_AT = 80  # where the page header starts: [80, length) is a v1 page record
_CHECKSUM_AT = 72
MIN_SEGMENT_NBYTES = 1 << 20
PARALLEL_WRITE_NBYTES = 8 << 20  # below this an append writes on the caller's thread
LOCATION = struct.Struct(">IIQQ")  # segment, flags, offset, length
DEFAULT_SEGMENT_NBYTES = 1 << 30
SEGMENT_NAME = re.compile(r"^([0-9a-f]{8})\.seg$")
WRITER_LOCK_NAME = "segments.lock"  # in the store directory: writer_lock()
_ZEROS = bytes(RECORD_ALIGN)
WRITEBACK_NBYTES = 8 << 20  # an append starts writeback of every 8 MiB it has written
SYNC_FILE_RANGE_WRITE = 0x02
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
assert PAGE_VALUE_AT + PAGE_HEADER_NBYTES == RECORD_HEADER_NBYTES


@dataclass(frozen=True)
class Location:
    """Where one record lies; `length` is header plus stored bytes (no padding)."""

    segment: int
    offset: int
    length: int
    flags: int = 0

    def pack(self) -> bytes:
        return LOCATION.pack(self.segment, self.flags, self.offset, self.length)

    @classmethod
    def unpack(cls, value) -> "Location":
        if len(value) != LOCATION.size:
            raise ValueError(f"a location is {LOCATION.size} bytes, not {len(value)}")
        segment, flags, offset, length = LOCATION.unpack_from(value)
        return cls(segment, offset, length, flags)

    @property
    def span_nbytes(self) -> int:
        """Bytes the record occupies in its segment, padding included."""
        return align_up(self.length)

    @property
    def end(self) -> int:
        return self.offset + self.span_nbytes


@contextmanager
def writer_lock(store_path: Path):
    """The segment writer lock of the store at store_path (docs/format.md section 10):
    an exclusive flock on <store>/segments.lock, held by whoever appends records, from
    reading the committed tails to the index commit that moves them (Store.put_pages,
    GC's compaction). The file is opened per use, so a forked child never shares its
    parent's lock; flock locks belong to open files, so another thread of this process
    waits for it too."""
    fd = fileio.open_lock(Path(store_path) / WRITER_LOCK_NAME)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def align_up(nbytes: int) -> int:
    return (nbytes + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


def record_header(digest: bytes, page_header: bytes) -> bytes:
    """The 128-byte record header for a page (page_header: pages.encode_page's)."""
    assert len(digest) == 32 and len(page_header) == PAGE_HEADER_NBYTES
    head = _PREFIX.pack(RECORD_MAGIC, bytes(4), bytes(digest)) + bytes(32)
    return head + _header_checksum(head, page_header) + bytes(page_header)


def _header_checksum(first: bytes, page_header: bytes) -> bytes:
    h = xxhash.xxh3_64(first)
    h.update(page_header)
    return h.digest()


def parse_record_header(view) -> tuple[bytes, PageHeader]:
    """(digest, page header) of the record whose header starts `view`; ValueError
    when these bytes are not an intact record header."""
    if len(view) < RECORD_HEADER_NBYTES:
        raise ValueError(f"{len(view)} bytes cannot hold a record header")
    head = bytes(view[:RECORD_HEADER_NBYTES])
    if head[:4] != RECORD_MAGIC:
        raise ValueError(f"bad record magic {head[:4]!r}")
    if (_header_checksum(head[:_CHECKSUM_AT], head[PAGE_VALUE_AT:])
            != head[_CHECKSUM_AT:PAGE_VALUE_AT]):
        raise ValueError("the record header's checksum does not match (damaged header)")
    if any(head[4:8]) or any(head[40:_CHECKSUM_AT]):
        raise ValueError("reserved record header bytes are not zero")
    page = PageHeader.unpack(head[PAGE_VALUE_AT:])
    return head[8:40], page


def verify_record(view, digest: bytes, location: Location | None = None, *,
                  hash_body: bool = True) -> tuple[PageHeader, memoryview]:
    """view: the record's bytes (view()). Returns (page header, stored bytes view) or
    raises ValueError naming the damage: header checksum, digest, lengths, xxh3-128.
    Every check that kvstore.pages.verify_stored makes of the page value is made here
    too (the page header's fields, its digest prefix, the stored length, the xxh3-128),
    with the record header's own, in one parse: the read path's one verification.
    hash_body=False leaves out the xxh3-128 alone, for a caller that compares it later
    (kvstore/deferred.py: header.xxh3 is what the bytes must hash to)."""
    named, header = parse_record_header(view)
    digest = bytes(digest)
    if named != digest:
        raise ValueError(f"the record was written for page {named.hex()[:16]}..., not for "
                         "this one (misplaced or swapped)")
    if any(header.digest_prefix) and header.digest_prefix != digest[:8]:
        raise ValueError(f"the page header was written for page {header.digest_prefix.hex()}"
                         "..., not for this one (misplaced or swapped)")
    length = RECORD_HEADER_NBYTES + header.stored_nbytes
    if location is not None and location.length != length:
        raise ValueError(f"the index says {location.length} bytes, the record header "
                         f"{length}")
    body = memoryview(view)[RECORD_HEADER_NBYTES:length]
    if len(body) != header.stored_nbytes:
        raise ValueError(f"stored length {len(body)} != header's {header.stored_nbytes} "
                         "(the record runs past the segment's end)")
    if hash_body and xxhash.xxh3_128_digest(body) != header.xxh3:
        raise ValueError("xxh3-128 of the stored bytes does not match the header")
    return header, body


@dataclass
class PendingRecord:
    """One page to append: its name, its encoded page header and the stored bytes (any
    buffer; written from where it lies).

    page_header None: a page stored raw whose header append() makes, and sets here, on
    the thread that writes the record: its xxh3-128 is computed just before the pwritev
    that reads the same bytes (cache-warm for the kernel's copy), so a save makes no
    separate checksum pass over its pages (512 MiB on the 2-core VM: xxh3 in the write
    threads 181 ms against 163 ms + a 50 ms pass)."""

    digest: bytes
    page_header: bytes | None
    stored: object


@dataclass(frozen=True)
class ScannedRecord:
    offset: int
    length: int          # header + stored bytes, from the header (0 when unreadable)
    digest: bytes | None
    problem: str | None  # None: the record verifies


class SegmentFiles:
    """The segment files of one store directory, for this process. append/sync are for
    one writer at a time (the caller serialises saves); views are thread-safe."""

    def __init__(self, directory: Path, segment_nbytes: int = DEFAULT_SEGMENT_NBYTES, *,
                 readonly: bool = False, first_segment_nbytes: int | None = None):
        for nbytes in (segment_nbytes, first_segment_nbytes or RECORD_ALIGN):
            if nbytes < RECORD_ALIGN or nbytes % RECORD_ALIGN:
                raise ValueError(f"segment sizes must be positive multiples of {RECORD_ALIGN}")
        self.directory = Path(directory)
        self.segment_nbytes = segment_nbytes
        # None: every segment is segment_nbytes; else segments grow (module docstring)
        self.first_segment_nbytes = first_segment_nbytes
        self.readonly = readonly
        self._lock = threading.Lock()
        self._maps: dict[int, mmap.mmap] = {}
        self._write_fds: dict[int, int] = {}
        self._unsynced: set[int] = set()
        self._current: int | None = None  # segment appended to, and its tail
        self._tail = 0
        if not readonly:
            self.directory.mkdir(parents=True, exist_ok=True)

    # -- naming ----------------------------------------------------------------------
    def path(self, segment: int) -> Path:
        return self.directory / f"{segment:08x}.seg"

    def segments(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        out = []
        for entry in os.listdir(self.directory):
            m = SEGMENT_NAME.match(entry)
            if m:
                out.append(int(m.group(1), 16))
        return sorted(out)

    def file_nbytes(self, segment: int) -> int:
        try:
            return os.stat(self.path(segment)).st_size
        except FileNotFoundError:
            return 0

    def allocated_nbytes(self) -> int:
        """Disk the segment files hold: st_blocks * 512 summed over every segment file,
        so preallocated space counts (a new segment is posix_fallocate'd whole) and
        punched holes do not. A file removed meanwhile counts 0."""
        total = 0
        for segment in self.segments():
            try:
                total += os.stat(self.path(segment)).st_blocks * 512
            except FileNotFoundError:
                pass
        return total

    # -- writing ---------------------------------------------------------------------
    def resume(self, segment: int, tail: int) -> None:
        """Append to `segment` from `tail` (the committed tail the index holds): bytes
        past it are unreachable leftovers and are overwritten."""
        if tail % RECORD_ALIGN:
            raise ValueError(f"tail {tail} is not {RECORD_ALIGN}-aligned")
        self._current, self._tail = segment, tail

    def prepare(self, tails: dict[int, int]) -> None:
        """Before an append, under the caller's writer lock: resume at the committed tail
        of the highest segment the index names (tails: segment -> committed tail), and
        delete every segment file above it. Those have no committed tail: a crashed or
        failed save made them, no index entry names them, and no reader maps them."""
        self._unsynced.clear()
        current = max(tails, default=None)
        # Another process may have deleted a leftover of ours and made a new segment of
        # that id since: file descriptors and maps cached for uncommitted segments may
        # name unlinked files. Write descriptors are reopened per save; maps of
        # committed segments stay (those files are never replaced).
        with self._lock:
            fds, self._write_fds = list(self._write_fds.values()), {}
            stale = [seg for seg in self._maps if current is None or seg > current]
            maps = [self._maps.pop(seg) for seg in stale]
        for fd in fds:
            os.close(fd)
        for m in maps:
            try:
                m.close()
            except BufferError:
                pass  # a view is still exported; the mapping goes with it
        for segment in self.segments():
            if current is None or segment > current:
                self.remove(segment)
        if current is None:
            self._current, self._tail = None, 0
        else:
            self.resume(current, tails[current])

    @property
    def tail(self) -> tuple[int, int] | None:
        """(segment, tail) that the next index commit records, or None before any write."""
        return None if self._current is None else (self._current, self._tail)

    def append(self, records: Sequence[PendingRecord], *, workers: int = 1) -> list[Location]:
        """Write records (not yet durable: sync() next); a record without a page header
        gets one (PendingRecord). Opens a new preallocated segment when the current one
        cannot hold the next record; StoreFull when the disk cannot hold a new segment
        (nothing of that segment stays behind). Places are reserved first, in order;
        with workers > 1 and at least PARALLEL_WRITE_NBYTES to write, the pwritev calls
        (and the xxh3 before each) then run on that many threads (pwritev and xxh3 drop
        the GIL, so one thread's copy into the page cache overlaps another's)."""
        assert not self.readonly, "append on a read-only SegmentFiles"
        lengths = [RECORD_HEADER_NBYTES + memoryview(rec.stored).nbytes for rec in records]
        left = sum(align_up(n) for n in lengths)  # what this append still has to write
        total = left
        out, places = [], []
        for rec, length in zip(records, lengths, strict=True):
            span = align_up(length)
            segment, offset = self._reserve(span, left)
            self._ensure_fd(segment)
            left -= span
            places.append((segment, offset, span))
            codec = CODEC_RAW if rec.page_header is None else PageHeader.unpack(rec.page_header).codec
            out.append(Location(segment, offset, length, codec))

        def write(i: int) -> None:
            rec, length, (segment, offset, span) = records[i], lengths[i], places[i]
            if rec.page_header is None:  # xxh3-128 here, on this write thread (PendingRecord)
                rec.page_header = raw_page_header(rec.stored, rec.digest)
            parts = [record_header(rec.digest, rec.page_header), rec.stored]
            if span > length:
                parts.append(_ZEROS[: span - length])
            self._pwritev_all(segment, parts, offset, span)

        def write_run(run: range) -> None:
            # Records of a run lie back to back; every WRITEBACK_NBYTES of them, the
            # kernel is told to start writing them out, so sync()'s fdatasync finds
            # most of the save already on its way to the disk (one 512 MiB save on
            # this 2-core VM: fdatasync 0.13-0.16 s -> 0.01-0.07 s, the whole write +
            # sync 0.20-0.25 s -> 0.14-0.18 s). Durability is still sync()'s alone.
            pending: list = []  # (segment, start, end) not yet handed to writeback
            for i in run:
                write(i)
                segment, offset, span = places[i]
                if pending and pending[0] == segment and pending[2] == offset:
                    pending[2] = offset + span
                else:
                    if pending:
                        start_writeback(self._write_fds[pending[0]], pending[1], pending[2] - pending[1])
                    pending = [segment, offset, offset + span]
                if pending[2] - pending[1] >= WRITEBACK_NBYTES:
                    start_writeback(self._write_fds[segment], pending[1], pending[2] - pending[1])
                    pending = []
            if pending:
                start_writeback(self._write_fds[pending[0]], pending[1], pending[2] - pending[1])

        workers = min(workers, len(records))
        if workers <= 1 or total < PARALLEL_WRITE_NBYTES:
            write_run(range(len(records)))
        else:
            step = -(-len(records) // workers)
            runs = [range(a, min(a + step, len(records))) for a in range(0, len(records), step)]
            with ThreadPoolExecutor(len(runs), thread_name_prefix="kvstore-write") as pool:
                for future in [pool.submit(write_run, r) for r in runs]:
                    future.result()  # the first failure (StoreFull, StoreIOError) raises
        return out

    def sync(self) -> None:
        """fdatasync every segment written since the last sync. A failure is fatal for
        the save that wrote them: StoreIOError, and the caller commits nothing."""
        segments = sorted(self._unsynced)

        def sync_one(segment: int) -> None:
            try:
                os.fdatasync(self._write_fds[segment])
            except OSError as exc:
                raise StoreIOError(f"fdatasync of segment {segment:08x} failed ({exc}); the "
                                   "pages were not stored") from None
        if len(segments) <= 1:
            for segment in segments:
                sync_one(segment)
        else:  # the segments' writeback overlaps (fdatasync drops the GIL)
            with ThreadPoolExecutor(len(segments), thread_name_prefix="kvstore-sync") as pool:
                for future in [pool.submit(sync_one, segment) for segment in segments]:
                    future.result()  # every sync ran; the first failure raises
        self._unsynced.clear()

    def _reserve(self, span: int, left_nbytes: int = 0) -> tuple[int, int]:
        if self._current is not None:
            size = self.file_nbytes(self._current)
            if self._tail + span <= size:
                offset = self._tail
                self._tail += span
                self._ensure_fd(self._current)
                return self._current, offset
        last = max(self.segments(), default=-1)
        segment = last + 1
        preferred = max(self._new_segment_nbytes(last, left_nbytes), span)
        needed = max(span, min(align_up(left_nbytes), preferred))  # this append's rest
        try:
            self._create(segment, preferred)
        except StoreFull:
            if needed >= preferred:
                raise
            # a nearly full disk (space freed by punched holes is scattered): a segment
            # just large enough for what this append still has to write
            self._create(segment, needed)
        self._current, self._tail = segment, span
        return segment, 0

    def _new_segment_nbytes(self, last: int, left_nbytes: int) -> int:
        if self.first_segment_nbytes is None:
            return self.segment_nbytes
        previous = self.file_nbytes(last) if last >= 0 else 0
        want = max(self.first_segment_nbytes, align_up(left_nbytes), 2 * previous)
        return min(self.segment_nbytes, want)

    def _create(self, segment: int, nbytes: int) -> None:
        path = self.path(segment)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            os.fsync(fd)
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"no room for a new {nbytes}-byte segment: the disk is full "
                                f"({exc}); nothing was stored. Run `kvstore gc` / `kvstore "
                                "evict`, or free space") from None
            raise StoreIOError(f"could not create segment {segment:08x}: {exc}") from None
        self._write_fds[segment] = fd

    def _ensure_fd(self, segment: int) -> int:
        fd = self._write_fds.get(segment)
        if fd is None:
            fd = os.open(self.path(segment), os.O_RDWR | os.O_CLOEXEC)
            self._write_fds[segment] = fd
        return fd

    def _pwritev_all(self, segment: int, parts: list, offset: int, total: int) -> None:
        fd = self._ensure_fd(segment)
        views = [memoryview(p).cast("B") for p in parts]
        done = 0
        while done < total:
            try:
                n = os.pwritev(fd, views, offset + done)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise StoreFull(f"writing segment {segment:08x} failed: the disk is "
                                    f"full ({exc}); nothing was committed") from None
                raise StoreIOError(f"writing segment {segment:08x} failed ({exc}); nothing "
                                   "was committed") from None
            done += n
            while views and n >= views[0].nbytes:  # drop what was written, keep the rest
                n -= views[0].nbytes
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
        self._unsynced.add(segment)

    # -- reading -----------------------------------------------------------------------
    def view(self, location: Location) -> memoryview:
        """Zero-copy view of a record's bytes (header and stored bytes). A location past
        the segment's end gives a shorter view (verify_record refuses it)."""
        m = self._map(location.segment)
        if m is None:
            return memoryview(b"")
        end = min(location.offset + location.length, len(m))
        return memoryview(m)[min(location.offset, end):end]

    def page_value(self, location: Location) -> memoryview:
        """Zero-copy view of the record's page value, bytes [80, length): a schema-1
        page record (48-byte header || stored bytes), to verify with
        kvstore.pages.verify_stored. Shorter (down to empty) past the file's end."""
        return self.view(location)[PAGE_VALUE_AT:]

    def read_verified(self, location: Location, digest: bytes) -> tuple[PageHeader, memoryview]:
        return verify_record(self.view(location), digest, location)

    def _map(self, segment: int) -> mmap.mmap | None:
        m = self._maps.get(segment)  # the read path: no lock once mapped (a dict get is atomic)
        if m is not None:
            return m
        with self._lock:
            m = self._maps.get(segment)
            if m is None:
                try:
                    with open(self.path(segment), "rb") as f:
                        if os.fstat(f.fileno()).st_size == 0:
                            return None
                        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                except FileNotFoundError:
                    return None
                self._maps[segment] = m
            return m

    def scan(self, segment: int, tail: int | None = None, *, verify: bool = True
             ) -> Iterator[ScannedRecord]:
        """Every record of a segment up to tail (the file's end by default), in offset
        order: at each 4 KiB boundary an intact header starts a record (its span is
        skipped); anything else (zeros, a punched hole, a damaged header) is skipped
        one block at a time. A record whose header is intact but whose body fails is
        reported with its problem (verify=False: headers only, problem None)."""
        m = self._map(segment)
        if m is None:
            return
        end = len(m) if tail is None else min(tail, len(m))
        offset = 0
        while offset + RECORD_HEADER_NBYTES <= end:
            head = memoryview(m)[offset:offset + RECORD_HEADER_NBYTES]
            try:
                digest, page = parse_record_header(head)
            except ValueError:
                offset += RECORD_ALIGN
                continue
            length = RECORD_HEADER_NBYTES + page.stored_nbytes
            problem = None
            if verify:
                try:
                    verify_record(memoryview(m)[offset:min(offset + length, len(m))], digest)
                except ValueError as exc:
                    problem = str(exc)
            yield ScannedRecord(offset, length, digest, problem)
            offset += align_up(length)

    # -- space -------------------------------------------------------------------------
    def punch(self, location: Location) -> bool:
        """Free a dead record's span (the file keeps its size; reads of it give zeros).
        False where the filesystem cannot punch holes (the bytes then stay until the
        segment is compacted away)."""
        fd = self._ensure_fd(location.segment)
        return punch_hole(fd, location.offset, location.span_nbytes)

    def relocate(self, moves: Sequence[tuple[bytes, Location]]) -> list[Location]:
        """Copy verified live records to the append position (compaction). The caller
        syncs, commits the new locations, and removes the old segment after the grace
        period. A record that does not verify raises ValueError (quarantine it instead)."""
        pending = []
        for digest, loc in moves:
            header, body = self.read_verified(loc, digest)
            pending.append(PendingRecord(bytes(digest), header.pack(), bytes(body)))
        return self.append(pending)

    def remove(self, segment: int) -> None:
        """Delete a segment file no index entry names any more (after compaction)."""
        with self._lock:
            m = self._maps.pop(segment, None)
            fd = self._write_fds.pop(segment, None)
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass  # a view is still exported; the mapping goes with it
        if fd is not None:
            os.close(fd)
        self.path(segment).unlink(missing_ok=True)
        if self._current == segment:
            self._current, self._tail = None, 0

    def close(self) -> None:
        with self._lock:
            maps, fds = list(self._maps.values()), list(self._write_fds.values())
            self._maps.clear()
            self._write_fds.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping lives until it is dropped
        for fd in fds:
            os.close(fd)


@dataclass(frozen=True)
class SegmentAudit:
    """What audit() found; check --read-data reports each as a problem (schema 2).
      damaged   (digest, location, reason): an index entry whose record fails
      past_end  (digest, location): an index entry beyond its segment's file or tail
      orphans   (segment, offset, digest): an intact record no index entry names
                (crash leftovers and dead records GC has not punched yet)"""

    damaged: tuple = ()
    past_end: tuple = ()
    orphans: tuple = ()

    @property
    def clean(self) -> bool:
        return not (self.damaged or self.past_end or self.orphans)


def audit(files: SegmentFiles, locations: dict[bytes, Location],
          tails: dict[int, int] | None = None) -> SegmentAudit:
    """Verify every indexed record and scan every segment for records the index does
    not name. locations: digest -> Location (the pages index); tails: segment -> the
    committed tail (records past it are unreachable; None: the file's end)."""
    tails = tails or {}
    damaged, past_end = [], []
    named: set[tuple[int, int]] = set()
    for digest, loc in locations.items():
        limit = min(files.file_nbytes(loc.segment), tails.get(loc.segment, 1 << 63))
        if loc.offset + loc.length > limit:
            past_end.append((digest, loc))
            continue
        named.add((loc.segment, loc.offset))
        try:
            files.read_verified(loc, digest)
        except ValueError as exc:
            damaged.append((digest, loc, str(exc)))
    orphans = [(segment, r.offset, r.digest) for segment in files.segments()
               for r in files.scan(segment) if (segment, r.offset) not in named]
    return SegmentAudit(tuple(damaged), tuple(past_end), tuple(orphans))


_libc = None
_sync_file_range = None  # libc's, or False where there is none (not Linux)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing [offset, offset + nbytes) of fd out now
    (sync_file_range(SYNC_FILE_RANGE_WRITE): it waits for nothing to reach the disk, and
    it is no durability barrier; fdatasync is). Advisory: where the call is missing or
    fails nothing happens here, since a writeback error it would meet is reported by the
    fdatasync that follows (the file's error state), and that fails the save."""
    global _sync_file_range
    if _sync_file_range is None:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
        _sync_file_range = fn or False
    if _sync_file_range and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)  # drops the GIL (ctypes)


def punch_hole(fd: int, offset: int, nbytes: int) -> bool:
    """fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE); False when unsupported."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong,
                                    ctypes.c_longlong]
    rc = _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, nbytes)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS):
        return False
    raise StoreIOError(f"punching a hole at {offset} (+{nbytes}) failed: {os.strerror(err)}")
