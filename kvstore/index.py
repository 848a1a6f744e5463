"""StoreIndex: the bookkeeping a store keeps beside its pages, as one type.

restic keeps its MasterIndex as its own type rather than as helpers other modules
reach into; this is that type here. A StoreIndex is bound to one LMDB transaction
(read or write) of one store and owns every rule about the sub-databases
(kvstore/lmdbenv.py DATABASES) other than the page bytes' own layout:

  counters     byte counters in `meta` (COUNTERS): raw, stored and referenced bytes,
               evicted blocks and bytes; changed with the records that change them
  references   refs: page -> block records and checkpoint attachments naming it
  pins         pins: block -> checkpoints naming it
  children     children: parent || child, so eviction finds leaves
  LRU          lru: last-used ns || chain key; touch_block moves a block in it,
               evict_to removes unpinned leaves oldest first, parents after children
  pages        presence, sizes as written (page_sizes), grace times (page_times),
               quarantine; write_pages and delete_page keep the counters exact. At
               schema 2 (docs/format.md section 10) a `pages` entry is a Location in a
               segment file: page() resolves it to a zero-copy view of the record's page
               value, which reads exactly as a schema-1 value; deleted and forgotten
               records go to dead_records for GC to punch; segment tails live in meta,
               with the retired marks of segments compaction emptied (rebind_page)
  checkpoints  validated, pinned and unpinned with their blocks and attachments

A store hands them out through its `index` (an IndexAccess): `with store.index.read()
as index` and `store.index.write(fn)`. Store, kvstore.gc, kvstore.check and
tools/inventory.py read and change the index only through it, and name no database
themselves.
"""

from __future__ import annotations

import heapq
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, TypeVar

from kvstore import faults
from kvstore.errors import InvalidInput, MissingReferences
from kvstore.format import FormatIdentity
from kvstore.ids import ROOT_KEY, ChainSalts, chain_key, compare_salts
from kvstore.pages import HEADER_NBYTES, PageHeader, accounted_nbytes
from kvstore.records import BlockRecord, Checkpoint
from kvstore.segments import LOCATION, Location, parse_record_header

U64 = struct.Struct(">Q")
SIZES = struct.Struct(">QQ")
DEAD_KEY = struct.Struct(">IQ")   # dead_records key: segment, offset
DEAD_VALUE = struct.Struct(">QQ")  # dead_records value: length, ns it died
TAIL_PREFIX = b"segment_tail/"    # meta: segment_tail/<8 hex> -> u64be committed tail
RETIRED_PREFIX = b"segment_retired/"  # meta: segment_retired/<8 hex> -> u64be ns compacted
SCHEMA_V1, SCHEMA_V2 = 1, 2
T = TypeVar("T")
COUNTERS = ("raw_nbytes", "stored_nbytes", "referenced_raw_nbytes",
            "evicted_blocks", "evicted_nbytes")


def now_ns() -> int:
    return time.time_ns()


@dataclass(frozen=True)
class EvictionReport:
    blocks: int
    pages: int
    freed_nbytes: int


def check_block_shape(record: BlockRecord, fmt: FormatIdentity) -> None:
    """InvalidInput unless the record has one page per paged layer of its format and
    at most a block of tokens (checked before any transaction starts)."""
    if len(record.pages) != len(fmt.paged_layers):
        raise InvalidInput(f"block {record.key.short} has {len(record.pages)} pages; its format "
                           f"has {len(fmt.paged_layers)} paged layers")
    if len(record.tokens) > fmt.block_size_tokens:
        raise InvalidInput(f"block {record.key.short} holds {len(record.tokens)} tokens, more "
                           f"than the format's block size {fmt.block_size_tokens}")


class PendingTouches:
    """LRU touches from lookups, kept in memory and written with the next write
    transaction (apply): losing them in a crash only ages the LRU order, never data."""

    def __init__(self):
        self._lock = threading.Lock()
        self._touches: dict[bytes, int] = {}
        self._since = 0.0

    def add(self, keys, stamp_ns: int) -> float:
        """Note a use of every key; returns how long (s) the oldest pending one waited."""
        with self._lock:
            if not self._touches:
                self._since = time.monotonic()
            for k in keys:
                self._touches[bytes(k)] = stamp_ns
            return time.monotonic() - self._since

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._touches)

    def apply(self, index: "StoreIndex") -> None:
        with self._lock:
            touches, self._touches = self._touches, {}
        for key, stamp in touches.items():
            index.touch_block(key, stamp)


class IndexAccess:
    """How a store hands out its index: read() yields a StoreIndex over one short
    read transaction, write(fn) runs fn(index) in one durable write transaction of the
    store's environment (kvstore/lmdbenv.py LmdbEnv.write: fn may run again from
    scratch when the map grows). Store.index and TieredStore.index are one."""

    def __init__(self, env, clock=now_ns, chain_salts: ChainSalts | None = None, *,
                 schema: int = SCHEMA_V2, segments=None, refuse_writes=None):
        """schema: the store's schema_version (1 or 2); segments: its
        kvstore.segments.SegmentFiles (schema 2); refuse_writes: an exception to raise
        on every write (a schema-1 store: NeedsMigration), or None."""
        self._env = env  # a kvstore.lmdbenv.LmdbEnv
        self._clock = clock
        self._salts = chain_salts if chain_salts is not None else ChainSalts()
        self.schema = schema
        self.segments = segments
        self.refuse_writes = refuse_writes

    def _index(self, txn, dbs) -> "StoreIndex":
        return StoreIndex(txn, dbs, self._clock, self._salts, schema=self.schema,
                          segments=self.segments)

    @contextmanager
    def read(self, *, buffers: bool = False) -> Iterator["StoreIndex"]:
        """With buffers=True page values are zero-copy views, valid inside the block."""
        with self._env.read(buffers=buffers) as txn:
            yield self._index(txn, self._env.dbs)

    def write(self, fn: Callable[["StoreIndex"], T], *, what: str, buffers: bool = False,
              freeing: bool = False, need_nbytes: int = 0) -> T:
        if self.refuse_writes is not None:
            raise self.refuse_writes(what)
        return self._env.write(lambda txn, dbs: fn(self._index(txn, dbs)),
                               what=what, buffers=buffers, freeing=freeing,
                               need_nbytes=need_nbytes)


class StoreIndex:
    """The index of one store inside one transaction (see the module docstring). With
    a buffers=True transaction, values are views valid until the next write: every
    method finishes reading a value before it modifies anything."""

    def __init__(self, txn, dbs: dict, clock=now_ns, chain_salts: ChainSalts | None = None, *,
                 schema: int = SCHEMA_V2, segments=None):
        self.txn = txn
        self.dbs = dbs
        assert schema in (SCHEMA_V1, SCHEMA_V2), f"no StoreIndex for schema {schema}"
        assert schema == SCHEMA_V1 or segments is not None, "a schema-2 index needs its segments"
        self.schema = schema
        self.segments = segments  # kvstore.segments.SegmentFiles (schema 2)
        self.clock = clock  # ns; the grace time of pages written (tests move it)
        # the store's per-namespace chain salts (StoreConfig.chain_salts): they key
        # lookups and decode salted records (kvstore/records.py)
        self.chain_salts = chain_salts if chain_salts is not None else ChainSalts()

    # -- integers: counters, references, pins ----------------------------------------------
    def _get_u64(self, db: str, key: bytes) -> int:
        raw = self.txn.get(key, db=self.dbs[db])
        return U64.unpack(raw)[0] if raw is not None else 0

    def _add_u64(self, db: str, key: bytes, delta: int) -> int:
        value = self._get_u64(db, key) + delta
        assert value >= 0, f"{db} {bytes(key)!r} would go negative ({value}); the index is inconsistent"
        if value == 0:
            self.txn.delete(key, db=self.dbs[db])
        else:
            self.txn.put(key, U64.pack(value), db=self.dbs[db])
        return value

    def counter(self, name: str) -> int:
        return self._get_u64("meta", name.encode())

    def counters(self) -> dict[str, int]:
        return {name: self.counter(name) for name in COUNTERS}

    def add_counter(self, name: str, delta: int) -> None:
        assert name in COUNTERS, f"unregistered counter {name}"
        self._add_u64("meta", name.encode(), delta)

    def refs(self, digest: bytes) -> int:
        return self._get_u64("refs", bytes(digest))

    def add_ref(self, digest: bytes, delta: int) -> int:
        """Change a page's reference count, and referenced_raw_nbytes with it (by the
        page's raw size when it is stored; a quarantined page counts 0 until healed)."""
        self.add_counter("referenced_raw_nbytes", delta * self.raw_nbytes(digest))
        return self._add_u64("refs", bytes(digest), delta)

    def pins(self, key: bytes) -> int:
        return self._get_u64("pins", bytes(key))

    def entries(self, db: str) -> int:
        return self.txn.stat(self.dbs[db])["entries"]

    # -- meta values (schema version, GC history) -----------------------------------------
    def meta(self, key: bytes):
        return self.txn.get(key, db=self.dbs["meta"])

    def put_meta(self, key: bytes, value: bytes) -> None:
        self.txn.put(key, value, db=self.dbs["meta"])

    # -- pages ----------------------------------------------------------------------------
    def page(self, digest: bytes):
        """The stored record (48-byte header || stored bytes), or None. At schema 2 a
        zero-copy view of the segment record's page value (kvstore/segments.py), which
        verifies as a schema-1 value does; empty when the location does not parse."""
        raw = self.txn.get(bytes(digest), db=self.dbs["pages"])
        if raw is None or self.schema == SCHEMA_V1:
            return raw
        location = self._parse_location(raw)
        return self.segments.page_value(location) if location is not None else memoryview(b"")

    def location(self, digest: bytes) -> Location | None:
        """Schema 2: where the page's record lies (None: absent or unparseable)."""
        assert self.schema == SCHEMA_V2
        raw = self.txn.get(bytes(digest), db=self.dbs["pages"])
        return self._parse_location(raw) if raw is not None else None

    def record_problem(self, digest: bytes) -> str | None:
        """Schema 2: what is wrong with the record header of a stored page (magic,
        reserved bytes, checksum, the full digest), or None; the page value itself is
        verified by the caller (kvstore.pages.verify_stored). None at schema 1."""
        if self.schema == SCHEMA_V1:
            return None
        location = self.location(digest)
        if location is None:
            return "its location does not parse"
        try:
            named, _ = parse_record_header(self.segments.view(location))
        except ValueError as exc:
            return f"record header: {exc}"
        if named != bytes(digest):
            return (f"the record was written for page {named.hex()[:16]}..., not for this one "
                    "(misplaced or swapped)")
        return None

    @staticmethod
    def _parse_location(raw) -> Location | None:
        return Location.unpack(raw) if len(raw) == LOCATION.size else None

    def has_page(self, digest: bytes) -> bool:
        return self.txn.get(bytes(digest), db=self.dbs["pages"]) is not None

    def is_quarantined(self, digest: bytes) -> bool:
        return self.txn.get(bytes(digest), db=self.dbs["quarantine"]) is not None

    def page_sizes(self, digest: bytes, value) -> tuple[int, int]:
        """(raw, stored) bytes a page was counted with when written: from `page_sizes`,
        or recovered from the record itself for pages written before that database."""
        raw = self.txn.get(bytes(digest), db=self.dbs["page_sizes"])
        return SIZES.unpack(raw) if raw is not None else accounted_nbytes(value)

    def raw_nbytes(self, digest: bytes) -> int:
        sizes = self.txn.get(bytes(digest), db=self.dbs["page_sizes"])  # only with a page
        if sizes is not None:
            return SIZES.unpack(sizes)[0]
        value = self.page(digest)
        return self.page_sizes(digest, value)[0] if value is not None else 0

    def page_time(self, digest: bytes) -> int:
        """ns of the page's last upload or dedup hit (its GC grace time), 0 if none."""
        return self._get_u64("page_times", bytes(digest))

    def refresh_page_time(self, digest: bytes, stamp_ns: int) -> None:
        if self.has_page(digest):
            self.txn.put(bytes(digest), U64.pack(stamp_ns), db=self.dbs["page_times"])

    def write_pages(self, encoded) -> tuple[int, int, int]:
        """encoded: (digest, header, stored bytes) triples at schema 1; (digest, header,
        Location) at schema 2, the record already appended and synced. Returns (new,
        existing, stored bytes written). A page stored again after quarantine heals:
        its surviving references count again and its quarantine entry goes (at schema
        2 the damaged record it named becomes a dead record). At schema 2 a page
        already present keeps its record, and the new one is dead at once."""
        txn, dbs = self.txn, self.dbs
        new = existing = stored_total = 0
        now = self.clock()
        stamp = U64.pack(now)
        for digest, header, stored in encoded:
            if txn.get(digest, db=dbs["pages"]) is not None:
                existing += 1
                if self.schema == SCHEMA_V2:
                    self.add_dead(stored, now)
            else:
                raw_nbytes = PageHeader.unpack(header).raw_nbytes
                if self.schema == SCHEMA_V2:
                    stored_nbytes = HEADER_NBYTES + PageHeader.unpack(header).stored_nbytes
                    txn.put(digest, stored.pack(), db=dbs["pages"])
                    self._forget_quarantined_location(digest, now)
                else:
                    stored_nbytes = HEADER_NBYTES + len(stored)
                    txn.put(digest, b"".join((header, stored)), db=dbs["pages"])
                self.add_counter("raw_nbytes", raw_nbytes)
                self.add_counter("stored_nbytes", stored_nbytes)
                txn.put(digest, SIZES.pack(raw_nbytes, stored_nbytes), db=dbs["page_sizes"])
                refs = self.refs(digest)
                if refs:
                    self.add_counter("referenced_raw_nbytes", refs * raw_nbytes)
                txn.delete(digest, db=dbs["quarantine"])
                stored_total += stored_nbytes
                new += 1
            txn.put(digest, stamp, db=dbs["page_times"])
        faults.crash_point("page_written")
        return new, existing, stored_total

    def delete_page(self, digest: bytes, *, record_dies: bool = True) -> int:
        """Remove one page, its sizes and grace time; returns stored bytes freed. At
        schema 2 its record becomes a dead record (record_dies=False: quarantine keeps
        naming it)."""
        digest = bytes(digest)
        value = self.page(digest)
        if value is None:
            return 0
        if self.schema == SCHEMA_V2:
            location = self.location(digest)
            if record_dies and location is not None:
                self.add_dead(location, self.clock())
        raw_nbytes, stored_nbytes = self.page_sizes(digest, value)  # before any change
        freed = stored_nbytes if self.schema == SCHEMA_V2 else len(value)
        self.add_counter("raw_nbytes", -raw_nbytes)
        self.add_counter("stored_nbytes", -stored_nbytes)
        for db in ("pages", "page_sizes", "page_times"):
            self.txn.delete(digest, db=self.dbs[db])
        return freed

    def quarantine_page(self, digest: bytes) -> bool:
        """Move a damaged page to `quarantine`: its references stay (the records still
        name it) but count no bytes until it is stored again. False when absent. At
        schema 2 quarantine holds the record's location (its bytes stay put)."""
        digest = bytes(digest)
        value = self.page(digest)
        if value is None:
            return False
        if self.schema == SCHEMA_V2:
            raw_nbytes = self.page_sizes(digest, value)[0]
            kept = bytes(self.txn.get(digest, db=self.dbs["pages"]))
        else:
            value = bytes(value)
            raw_nbytes, kept = self.page_sizes(digest, value)[0], value
        self.txn.put(digest, kept, db=self.dbs["quarantine"])
        self.add_counter("referenced_raw_nbytes", -self.refs(digest) * raw_nbytes)
        self.delete_page(digest, record_dies=False)
        return True

    def forget_quarantined(self, digest: bytes) -> bool:
        if self.schema == SCHEMA_V2:
            return self._forget_quarantined_location(bytes(digest), self.clock())
        return bool(self.txn.delete(bytes(digest), db=self.dbs["quarantine"]))

    def _forget_quarantined_location(self, digest: bytes, stamp_ns: int) -> bool:
        raw = self.txn.get(digest, db=self.dbs["quarantine"])
        if raw is None:
            return False
        location = self._parse_location(bytes(raw))
        if location is not None:
            self.add_dead(location, stamp_ns)
        return bool(self.txn.delete(digest, db=self.dbs["quarantine"]))

    # -- segments (schema 2): committed tails and dead records ---------------------------
    def segment_tails(self) -> dict[int, int]:
        """segment -> committed tail: the index may name bytes [0, tail) of it."""
        out = {}
        for key, value in self._items("meta", TAIL_PREFIX):
            key = bytes(key)
            if not key.startswith(TAIL_PREFIX):
                break
            out[int(key[len(TAIL_PREFIX):], 16)] = U64.unpack(value)[0]
        return out

    def put_segment_tail(self, segment: int, tail: int) -> None:
        self.txn.put(TAIL_PREFIX + b"%08x" % segment, U64.pack(tail), db=self.dbs["meta"])

    def add_dead(self, location: Location, stamp_ns: int) -> None:
        self.txn.put(DEAD_KEY.pack(location.segment, location.offset),
                     DEAD_VALUE.pack(location.length, stamp_ns), db=self.dbs["dead_records"])

    def dead_records(self) -> Iterator[tuple[Location, int]]:
        """(location, ns it died) of every dead record, in segment and offset order."""
        for key, value in self._items("dead_records"):
            segment, offset = DEAD_KEY.unpack(bytes(key))
            length, died = DEAD_VALUE.unpack(bytes(value))
            yield Location(segment, offset, length), died

    def is_dead(self, location: Location) -> bool:
        return self.txn.get(DEAD_KEY.pack(location.segment, location.offset),
                            db=self.dbs["dead_records"]) is not None

    def forget_dead(self, location: Location) -> bool:
        return bool(self.txn.delete(DEAD_KEY.pack(location.segment, location.offset),
                                    db=self.dbs["dead_records"]))

    # -- compaction (schema 2, kvstore/gc.py): rebinding and retired segments -----------
    def rebind_page(self, digest: bytes, old: Location, new: Location) -> bool:
        """Point a page at its relocated copy, if it still lies at `old` (it may have
        been deleted or quarantined since the copy was made); False otherwise. Sizes,
        counters and grace time are unchanged: the record's bytes are the same."""
        current = self.location(digest)
        if current is None or (current.segment, current.offset) != (old.segment, old.offset):
            return False
        self.txn.put(bytes(digest), new.pack(), db=self.dbs["pages"])
        return True

    def retire_segment(self, segment: int, stamp_ns: int) -> None:
        """Mark a compacted segment: no page names it any more; GC removes its file
        once it has been retired for the grace period (readers may still map it)."""
        self.txn.put(RETIRED_PREFIX + b"%08x" % segment, U64.pack(stamp_ns), db=self.dbs["meta"])

    def retired_segments(self) -> dict[int, int]:
        """segment -> ns it was retired (compacted), awaiting the removal of its file."""
        out = {}
        for key, value in self._items("meta", RETIRED_PREFIX):
            key = bytes(key)
            if not key.startswith(RETIRED_PREFIX):
                break
            out[int(key[len(RETIRED_PREFIX):], 16)] = U64.unpack(value)[0]
        return out

    def forget_segment(self, segment: int) -> int:
        """After a retired segment's file is removed: drop its committed tail, its
        retired mark and every dead record in it. Returns the dead records dropped."""
        meta = self.dbs["meta"]
        self.txn.delete(TAIL_PREFIX + b"%08x" % segment, db=meta)
        self.txn.delete(RETIRED_PREFIX + b"%08x" % segment, db=meta)
        prefix = struct.pack(">I", segment)
        keys = []
        for key in self._items("dead_records", prefix, values=False):
            if bytes(key[:4]) != prefix:
                break
            keys.append(bytes(key))
        for key in keys:
            self.txn.delete(key, db=self.dbs["dead_records"])
        return len(keys)

    def locations(self) -> Iterator[tuple[bytes, Location | None]]:
        """(digest, location) of every page (schema 2); None for an unparseable one."""
        for key, value in self._items("pages"):
            yield bytes(key), self._parse_location(value)

    def quarantined_locations(self) -> Iterator[tuple[bytes, Location | None]]:
        for key, value in self._items("quarantine"):
            yield bytes(key), self._parse_location(value)

    def forget_page_time(self, digest: bytes) -> bool:
        """Drop a grace time whose page is gone (a GC orphan); False otherwise."""
        if self.has_page(digest):
            return False
        return bool(self.txn.delete(bytes(digest), db=self.dbs["page_times"]))

    # -- blocks ---------------------------------------------------------------------------
    def block(self, key: bytes) -> BlockRecord | None:
        raw = self.txn.get(bytes(key), db=self.dbs["blocks"])
        return BlockRecord.decode(raw, self.chain_salts) if raw is not None else None

    def has_block(self, key: bytes) -> bool:
        return self.txn.get(bytes(key), db=self.dbs["blocks"]) is not None

    def complete_block(self, key: bytes) -> BlockRecord | None:
        """The block's record when it is stored, was stored under its own key, and
        every page it names is present (quarantine moves a page out of `pages`); else
        None. Presence only: no page value is copied or hashed."""
        record = self.verified_block(key)  # decoded (copied) before any other get
        if record is None or not all(self.has_page(d) for d in record.pages):
            return None
        return record

    def verified_block(self, key: bytes) -> BlockRecord | None:
        """block(key), or None when the record found there hashes to another chain key
        (BlockRecord.key derives it from the record's own fields): a record written
        under the wrong key names another prompt's pages, and is never served. check
        reports it as block_bad."""
        record = self.block(key)
        if record is None or record.key != bytes(key):
            return None
        return record

    def has_children(self, key: bytes) -> bool:
        key = bytes(key)
        with self.txn.cursor(db=self.dbs["children"]) as cur:
            return cur.set_range(key) and bytes(cur.key()[:32]) == key

    def insert_block(self, record: BlockRecord) -> None:
        txn, dbs = self.txn, self.dbs
        txn.put(record.key, record.encode(), db=dbs["blocks"])
        txn.put(U64.pack(record.last_used_ns) + record.key, b"", db=dbs["lru"])
        if not record.is_root:
            txn.put(record.parent + record.key, b"", db=dbs["children"])
        for d in record.pages:
            self.add_ref(d, 1)

    def touch_block(self, key: bytes, stamp_ns: int) -> None:
        """Move a block to stamp_ns in the LRU order (never backwards)."""
        record = self.block(key)
        if record is None or record.last_used_ns >= stamp_ns:
            return
        key = bytes(key)
        self.txn.delete(U64.pack(record.last_used_ns) + key, db=self.dbs["lru"])
        self.txn.put(U64.pack(stamp_ns) + key, b"", db=self.dbs["lru"])
        self.txn.put(key, record.with_times(record.created_ns, stamp_ns).encode(), db=self.dbs["blocks"])

    def remove_block(self, record: BlockRecord) -> tuple[int, int]:
        """Delete an unpinned leaf block; pages left with no reference go too.
        Returns (pages deleted, stored bytes freed)."""
        txn, dbs, key = self.txn, self.dbs, record.key
        assert self.pins(key) == 0, f"evicting pinned block {key.hex()}"
        txn.delete(key, db=dbs["blocks"])
        txn.delete(U64.pack(record.last_used_ns) + key, db=dbs["lru"])
        if not record.is_root:
            txn.delete(record.parent + key, db=dbs["children"])
        pages = freed = 0
        for d in record.pages:
            if self.add_ref(d, -1) == 0:
                freed += self.delete_page(d)
                pages += 1
        return pages, freed

    def _evictable(self, key: bytes) -> bool:
        return self.pins(key) == 0 and not self.has_children(key)

    def evict_to(self, target_nbytes: int, max_blocks: int | None = None) -> EvictionReport:
        """Remove least-recently-used unpinned leaves (a parent becomes a candidate once
        its last child goes) until stored bytes are at most target_nbytes, at most
        max_blocks of them."""
        stored = self.counter("stored_nbytes")
        if stored <= target_nbytes:
            return EvictionReport(0, 0, 0)
        heap = []
        with self.txn.cursor(db=self.dbs["lru"]) as cur:
            for key, _ in cur:
                stamp, chain = U64.unpack(key[:8])[0], bytes(key[8:])
                if self._evictable(chain):
                    heap.append((stamp, chain))
        heapq.heapify(heap)
        blocks = pages = freed = 0
        while heap and stored > target_nbytes and (max_blocks is None or blocks < max_blocks):
            _, chain = heapq.heappop(heap)
            record = self.block(chain)
            p, f = self.remove_block(record)
            blocks, pages, freed, stored = blocks + 1, pages + p, freed + f, stored - f
            if not record.is_root and self._evictable(record.parent):
                heapq.heappush(heap, (self.block(record.parent).last_used_ns, record.parent))
        if blocks:
            self.add_counter("evicted_blocks", blocks)
            self.add_counter("evicted_nbytes", freed)
        return EvictionReport(blocks, pages, freed)

    def commit_blocks(self, blocks: list[BlockRecord], formats: dict[bytes, FormatIdentity],
                      stamp_ns: int) -> tuple[int, int]:
        """Insert new records (parents before children), touch existing ones. Raises,
        for the caller to abort the transaction, MissingReferences naming every absent
        page or parent, or InvalidInput. Returns (new, existing)."""
        batch: dict[bytes, BlockRecord] = {}
        missing_pages, new, existing = [], 0, 0
        for b in blocks:
            fmt = formats[b.format_id]
            if not compare_salts(b.salt, self.chain_salts.salt_for(b.namespace)):
                how = ("with a chain salt that is not this store's salt of that namespace"
                       if b.salted else "without a chain salt, and this store salts that namespace")
                raise InvalidInput(f"block {b.key.short} of namespace {b.namespace!r} is keyed "
                                   f"{how}: take the salt from store.chain_salt(namespace)")
            if b.key in batch or self.has_block(b.key):
                existing += 1
                if b.key not in batch:
                    self.touch_block(b.key, stamp_ns)
                continue
            if not b.is_root:
                parent = batch.get(b.parent) or self.block(b.parent)
                if parent is None or parent.namespace != b.namespace:
                    # another namespace's block reads exactly as an absent one: the
                    # answer must not tell a tenant what another tenant stored
                    raise MissingReferences(f"block {b.key.short}", [f"parent block {b.parent.hex()}"])
                if len(parent.tokens) != fmt.block_size_tokens or parent.format_id != b.format_id:
                    raise InvalidInput(f"block {b.key.short}'s parent is a partial block or of "
                                       "another format")
            for layer_index, d in zip(fmt.paged_layers, b.pages):
                if not self.has_page(d):
                    missing_pages.append(f"page {d.hex()}")
                    continue
                want = fmt.layers[layer_index].page_nbytes(len(b.tokens))
                got = self.raw_nbytes(d)  # as counted when written (page_sizes)
                if got != want:
                    raise InvalidInput(
                        f"block {b.key.short} layer {layer_index}: page {d.short} holds {got} "
                        f"bytes, the format needs {want} for {len(b.tokens)} tokens")
            if missing_pages:
                # nothing will be committed; keep validating the children so the
                # error names every absent page, not the parent of the next block
                batch[b.key] = b
                continue
            record = b.with_times(stamp_ns, stamp_ns)
            self.insert_block(record)
            batch[b.key] = record
            new += 1
        if missing_pages:
            raise MissingReferences("commit_blocks", missing_pages)
        return new, existing

    def match_prefix(self, fid: bytes, namespace: str, tokens: list[int],
                     block_size_tokens: int) -> tuple[list[BlockRecord], bool]:
        """The longest run of complete blocks that prefixes `tokens`, and whether it
        stopped before a stored block with a missing or quarantined page (then no
        trailing partial block is matched either)."""
        bs, matched, damaged = block_size_tokens, [], False
        salt = self.chain_salts.salt_for(namespace)
        parent, pos = ROOT_KEY, 0
        while pos + bs <= len(tokens):
            key = chain_key(fid, namespace, parent, tokens[pos : pos + bs], salt=salt)
            record = self.complete_block(key)
            if record is None:
                damaged = self.has_block(key)
                break
            matched.append(record)
            parent, pos = key, pos + bs
        if not damaged:  # a trailing partial block, after the full ones
            for n in range(min(len(tokens) - pos, bs - 1), 0, -1):
                key = chain_key(fid, namespace, parent, tokens[pos : pos + n], salt=salt)
                if not self.has_block(key):
                    continue
                record = self.complete_block(key)
                damaged = record is None
                if record is not None:
                    matched.append(record)
                break
        return matched, damaged

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, key: bytes) -> Checkpoint | None:
        raw = self.txn.get(key, db=self.dbs["checkpoints"])
        return Checkpoint.decode(raw) if raw is not None else None

    def put_checkpoint(self, c: Checkpoint, identity: FormatIdentity, stamp_ns: int, *,
                       replace: bool) -> bool:
        """Validate, then store and pin `c` (unpinning the checkpoint it replaces).
        Returns False, writing nothing, when one exists and replace is False."""
        old = self.checkpoint(c.db_key)
        if old is not None and not replace:
            return False
        self.validate_checkpoint(c, identity)
        if old is not None:
            self.unpin_checkpoint(old)
        self.txn.put(c.db_key, c.encode(), db=self.dbs["checkpoints"])
        for k in c.chain_keys:
            self._add_u64("pins", bytes(k), 1)
            self.touch_block(k, stamp_ns)
        for d in c.attachments.values():
            self.add_ref(d, 1)
        return True

    def delete_checkpoint(self, key: bytes) -> bool:
        old = self.checkpoint(key)
        if old is None:
            return False
        self.unpin_checkpoint(old)
        self.txn.delete(key, db=self.dbs["checkpoints"])
        return True

    def validate_checkpoint(self, c: Checkpoint, identity: FormatIdentity) -> None:
        missing, parent, tokens = [], ROOT_KEY, []
        for k in c.chain_keys:
            record = self.block(k)
            if record is None or record.namespace != c.namespace:
                missing.append(f"block {k.hex()}")  # another namespace's reads as absent
                continue
            if record.format_id != c.format_id:
                raise InvalidInput(f"block {k.short} belongs to another format")
            if record.parent != parent:
                raise InvalidInput(f"block {k.short} does not follow the previous block in the chain")
            parent = k
            tokens.extend(record.tokens)
        for name, d in c.attachments.items():
            if not self.has_page(d):
                missing.append(f"attachment {name} page {d.hex()}")
        if missing:
            raise MissingReferences(f"checkpoint {c.namespace}/{c.name}", missing)
        if tuple(tokens) != tuple(c.tokens):
            raise InvalidInput(f"checkpoint {c.namespace}/{c.name}: its blocks hold {len(tokens)} "
                               f"tokens that are not the {len(c.tokens)} tokens it names")

    def unpin_checkpoint(self, c: Checkpoint) -> None:
        for k in c.chain_keys:
            self._add_u64("pins", bytes(k), -1)
        for d in c.attachments.values():
            self.add_ref(d, -1)

    # -- whole tables, in key order (check, GC, inventory) --------------------------------
    def _items(self, db: str, start: bytes = b"", values: bool = True) -> Iterator:
        with self.txn.cursor(db=self.dbs[db]) as cur:
            if not cur.set_range(start):
                return
            yield from (cur.iternext(values=values) if values else cur.iternext(values=False))

    def pages(self) -> Iterator[tuple[bytes, object]]:
        """(digest, stored record) of every page (at schema 2 the view page() gives)."""
        for key, value in self._items("pages"):
            if self.schema == SCHEMA_V2:
                location = self._parse_location(value)
                value = self.segments.page_value(location) if location else memoryview(b"")
            yield bytes(key), value

    def block_records(self, after: bytes = b"") -> Iterator[tuple[bytes, object]]:
        """(chain key, encoded record) from `after` on, in key order (not decoded, so a
        record that does not decode can be reported)."""
        for key, value in self._items("blocks", after):
            yield bytes(key), value

    def checkpoint_records(self, prefix: bytes = b"") -> Iterator[tuple[bytes, object]]:
        """(namespace || 0x00 || name, encoded manifest) whose key starts with prefix."""
        for key, value in self._items("checkpoints", prefix):
            if not bytes(key).startswith(prefix):
                return
            yield bytes(key), value

    def format_records(self) -> Iterator[tuple[bytes, object]]:
        for key, value in self._items("formats"):
            yield bytes(key), value

    def format_record(self, fid: bytes):
        return self.txn.get(bytes(fid), db=self.dbs["formats"])

    def put_format_record(self, fid: bytes, canonical: bytes) -> None:
        if self.format_record(fid) is None:
            self.txn.put(bytes(fid), canonical, db=self.dbs["formats"])

    def quarantined(self) -> set[bytes]:
        return {bytes(k) for k in self._items("quarantine", values=False)}

    def reference_counts(self) -> dict[bytes, int]:
        return {bytes(k): U64.unpack(v)[0] for k, v in self._items("refs")}

    def pin_counts(self) -> dict[bytes, int]:
        return {bytes(k): U64.unpack(v)[0] for k, v in self._items("pins")}

    def children_entries(self) -> set[bytes]:
        """parent (32) || child (32) of every child."""
        return {bytes(k) for k in self._items("children", values=False)}

    def lru_entries(self) -> set[bytes]:
        """u64be last-used ns || chain key of every block."""
        return {bytes(k) for k in self._items("lru", values=False)}

    def page_time_digests(self) -> list[bytes]:
        return [bytes(k) for k in self._items("page_times", values=False)]


__all__ = ["StoreIndex", "IndexAccess", "PendingTouches", "EvictionReport", "check_block_shape", "COUNTERS", "U64", "SIZES", "now_ns", "SCHEMA_V1", "SCHEMA_V2"]
