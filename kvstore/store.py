"""Store: the embedded, durable, content-addressed page store over one directory: page
bodies in segment files (kvstore/segments.py), LMDB as the index (schema version 2,
docs/format.md section 10). A schema-1 store (page bodies as LMDB values) is opened
read-only: reads work, every write raises NeedsMigration naming `kvstore migrate`.

It implements the store protocol (kvstore/protocol.py), as kvstore.client.RemoteStore
(HTTP) and kvstore.tier.TieredStore (S3) do, so callers (the engine, the CLI) take any.

A save goes pages first, then records:
  missing(digests)        which pages the store lacks (and marks present ones as in use)
  put_pages(pages)        hash, compress where it pays, append to a segment,
                          fdatasync it, then one index commit; durable on return
  commit_blocks(records)  atomic; refuses records whose pages, parent or format are absent
  create_checkpoint(c)    atomic; pins its blocks and attachment pages
A restore goes lookup_prefix -> get_pages / read_pages_into. Every page read is checked
against the xxh3-128 in its header; a damaged page is quarantined and IntegrityError
names it. check(read_data=True) re-hashes every page with blake3.

The bookkeeping (counters, references, pins, children, LRU order, eviction) is the
StoreIndex of kvstore/index.py, changed in the same write transaction as the records
that change it; `Store.index` hands it out one transaction at a time.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np

from kvstore import faults
from kvstore.check import CheckReport, check_store
from kvstore.deferred import MIN_DEFERRED_NBYTES, DeferredPages, verified_now
from kvstore.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidInput,
    MissingReferences,
    NeedsMigration,
    NotFound,
    StoreCorrupt,
    StoreFull,
    StoreIOError,
    UnsupportedVersion,
)
from kvstore.format import FormatIdentity
from kvstore.gc import GCPlan, plan_gc
from kvstore.ids import ChainKey, ChainSalts, PageDigest, check_namespace
from kvstore.index import (
    COUNTERS,
    SCHEMA_V1,
    SCHEMA_V2,
    U64,
    EvictionReport,
    IndexAccess,
    PendingTouches,
    StoreIndex,
    check_block_shape,
    now_ns,
)
from kvstore.lmdbenv import (
    DEFAULT_MAP_NBYTES,
    DEFAULT_MAX_MAP_NBYTES,
    DEFAULT_RESERVE_NBYTES,
    META_RECORD,
    LmdbEnv,
)
from kvstore.pages import (
    CODEC_RAW,
    HEADER_NBYTES,
    Compression,
    PageBatch,
    accounted_nbytes,
    decode_stored,
    hash_page,
    verified_pages,
    verify_stored,
    zstd_frame,
    zstd_page_header,
)
from kvstore.readinto import read_verified
from kvstore.segments import (
    RECORD_HEADER_NBYTES,
    PendingRecord,
    SegmentFiles,
    align_up,
    verify_record,
    writer_lock,
)
from kvstore.records import BlockRecord, Checkpoint, checkpoint_key
from kvstore.results import CommitResult, PrefixMatch, PutResult, StoreStats

STORE_SCHEMA_VERSION = SCHEMA_V2  # what a new store is made with; 1 is still read
# One segment sync and one index commit per save up to these (issue 19). What the caps
# buy: zstd frames of a batch are held in memory (up to PUT_BATCH_NBYTES), and LMDB's
# dirty list holds 2^17 pages (a batch's index entries stay well under it).
PUT_BATCH_NBYTES = 1 << 30
PUT_BATCH_PAGES = 32768
INDEX_NBYTES_PER_PAGE = 512  # what one page adds to the index (location, sizes, time)
DEFAULT_SEGMENT_NBYTES = 256 << 20  # segments grow from FIRST_SEGMENT_NBYTES up to this
FIRST_SEGMENT_NBYTES = 1 << 20
SAVE_WORKERS = os.cpu_count() or 1  # threads that encode and write a save's records
PARALLEL_ENCODE_NBYTES = 8 << 20
TOUCH_FLUSH_S = 10.0
EVICT_BATCH_BLOCKS = 1024  # blocks per eviction transaction at most (see Store.evict)
__all__ = ["Store", "StoreConfig", "StoreStats", "PutResult", "CommitResult", "PrefixMatch",
           "EvictionReport", "hash_page", "verified_pages", "PageBatch", "format_id_bytes", "now_ns",
           "COUNTERS", "STORE_SCHEMA_VERSION"]  # some defined in kvstore/pages.py, index.py


@dataclass(frozen=True)
class StoreConfig:
    map_nbytes: int = DEFAULT_MAP_NBYTES
    max_map_nbytes: int = DEFAULT_MAX_MAP_NBYTES
    budget_nbytes: int | None = None  # evict LRU unpinned blocks past this many stored bytes
    reserve_nbytes: int = DEFAULT_RESERVE_NBYTES  # disk kept free for deletes and GC
    compression: Compression = field(default_factory=Compression)
    segment_nbytes: int = DEFAULT_SEGMENT_NBYTES  # largest segment file (kvstore/segments.py)
    # namespace -> 32-byte secret salt of its chain keys (docs/format.md section 3);
    # namespaces not named are unsalted. Give every process that opens the store the
    # same salts: a reader without a salted namespace's salt refuses its records.
    chain_salts: ChainSalts = field(default_factory=ChainSalts)

    def __post_init__(self):
        if not isinstance(self.chain_salts, ChainSalts):
            object.__setattr__(self, "chain_salts", ChainSalts(self.chain_salts))


class Store:
    """The embedded store (see the module docstring). Thread-safe; one per process
    per directory is enough. Open with Store(path) or Store.open(path)."""

    def __init__(self, path: str | os.PathLike, config: StoreConfig | None = None, *,
                 readonly: bool = False):
        self.path = Path(path)
        self.config = config or StoreConfig()
        self._lmdb = LmdbEnv(self.path, self.config.map_nbytes, self.config.max_map_nbytes,
                             readonly=readonly, reserve_nbytes=self.config.reserve_nbytes,
                             init=_init_meta)
        try:
            self.schema_version = self._read_schema()
        except BaseException:
            self._lmdb.close()
            raise
        self._segments = None
        if self.schema_version == SCHEMA_V2:
            self._segments = SegmentFiles(self.path / "segments", self.config.segment_nbytes,
                                          readonly=readonly,
                                          first_segment_nbytes=min(FIRST_SEGMENT_NBYTES,
                                                                   self.config.segment_nbytes))
        self._writable = not readonly and self.schema_version == SCHEMA_V2
        self._writer_lock = threading.Lock()
        self._formats: dict[bytes, FormatIdentity] = {}
        self._touches = PendingTouches()
        self._lookup_lock = threading.Lock()
        # lookups, hits, tokens asked, tokens matched, lookups stopped at a damaged block
        self._lookups = [0, 0, 0, 0, 0]
        # the index, one transaction at a time (kvstore/index.py)
        self.index = IndexAccess(self._lmdb, _clock, self.config.chain_salts,
                                 schema=self.schema_version, segments=self._segments,
                                 refuse_writes=self._refusal())

    @property
    def maps_pages(self) -> bool:
        """get_pages yields zero-copy views (kvstore/protocol.py): of the segment files'
        maps at schema 2, of the LMDB map at schema 1."""
        return True

    def chain_salt(self, namespace: str) -> bytes | None:
        """The namespace's chain salt (StoreConfig.chain_salts), None when unsalted:
        what a publisher passes to chain_key and BlockRecord (kvstore/protocol.py)."""
        return self.config.chain_salts.salt_for(check_namespace(namespace))

    @classmethod
    def open(cls, path, **config) -> "Store":
        return cls(path, StoreConfig(**config) if config else None)

    def close(self) -> None:
        if self._writable:
            self._flush_touches()
        self._lmdb.close()
        if self._segments is not None:
            self._segments.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _read_schema(self) -> int:
        """The store's schema_version; every branch keys on this number (docs/format.md
        section 10), never on a missing key or database. LmdbEnv has already refused an
        environment without the meta record."""
        with self._lmdb.read() as txn:
            raw = txn.get(META_RECORD, db=self._lmdb.dbs["meta"])
        version = U64.unpack(raw)[0] if raw is not None and len(raw) == U64.size else None
        if version is not None and version > STORE_SCHEMA_VERSION:
            raise UnsupportedVersion(
                f"store at {self.path} has schema version {version}; this code reads up to "
                f"{STORE_SCHEMA_VERSION}. Upgrade mlx-kvstore"
            )
        if version not in (SCHEMA_V1, SCHEMA_V2):
            raise StoreCorrupt(f"store at {self.path} is damaged: its schema_version record is "
                               f"{bytes(raw or b'').hex() or 'empty'}, not a version this code "
                               "knows; nothing was written. See docs/reliability.md ('A store "
                               "refused as damaged')")
        if version == SCHEMA_V2 and "dead_records" not in self._lmdb.dbs:
            raise StoreCorrupt(f"store at {self.path} is damaged: it is schema version 2 but "
                               "LMDB's main database does not list the sub-database "
                               "dead_records; nothing was written. See docs/reliability.md "
                               "('A store refused as damaged')")
        return version

    def _refusal(self):
        if self.schema_version != SCHEMA_V1:
            return None
        path = self.path

        def refuse(what: str) -> NeedsMigration:
            return NeedsMigration(
                f"{what} refused: the store at {path} is schema version 1 (page bodies in "
                f"LMDB), which this code reads but does not write; nothing was written. Run "
                f"`kvstore migrate {path}` to move it to schema version "
                f"{STORE_SCHEMA_VERSION}")
        return refuse

    # -- formats -------------------------------------------------------------------
    def put_format(self, identity: FormatIdentity) -> bytes:
        """Idempotent. Returns the 32-byte format id."""
        fid, raw = identity.format_id, identity.canonical()
        if self._cached_format(fid) is None:
            self.index.write(lambda index: index.put_format_record(fid, raw),
                             what="storing a format identity")
        self._formats[fid] = identity
        return fid

    def get_format(self, format_id) -> FormatIdentity:
        fid = format_id_bytes(format_id)
        identity = self._cached_format(fid)
        if identity is None:
            raise NotFound(f"format {fid.hex()} is not stored; put_format() it first")
        return identity

    def _cached_format(self, fid: bytes) -> FormatIdentity | None:
        identity = self._formats.get(fid)
        if identity is None:
            with self.index.read() as index:
                raw = index.format_record(fid)
            if raw is None:
                return None
            identity = FormatIdentity.from_json(raw)
            assert identity.format_id == fid, f"format record {fid.hex()} hashes to another id"
            self._formats[fid] = identity
        return identity

    def list_formats(self) -> list[FormatIdentity]:
        with self.index.read() as index:
            raws = [value for _, value in index.format_records()]
        return [FormatIdentity.from_json(v) for v in raws]

    # -- pages -----------------------------------------------------------------------
    def missing(self, digests: Iterable) -> list[PageDigest]:
        """The digests the store does not hold, in input order. Present pages that no
        record references yet get their grace time refreshed, so GC spares them until
        the caller commits."""
        wanted = [PageDigest.coerce(d) for d in digests]
        absent, unreferenced = [], []
        with self.index.read(buffers=True) as index:  # presence only: never copy a page
            for d in wanted:
                if not index.has_page(d):
                    absent.append(d)
                elif index.refs(d) == 0:
                    unreferenced.append(d)
        if unreferenced:
            stamp = now_ns()

            def refresh(index: StoreIndex):
                for d in unreferenced:
                    index.refresh_page_time(d, stamp)
            self.index.write(refresh, what="refreshing page grace times", buffers=True)
        return absent

    def put_pages(self, pages: PageBatch | Mapping | Iterable[tuple]) -> PutResult:
        """Store pages given as {digest: bytes} or (digest, bytes) pairs. Every digest is
        recomputed first; one mismatch refuses the whole call with DigestMismatch and
        nothing is written. A PageBatch (kvstore/pages.py: digests this process's
        kvstore computed, PageBatch.hash) is not hashed again, and zstd is decided once
        per page format in it. Idempotent. Durable when it returns: the records are
        appended to segment files and fdatasync'ed, then one index commit makes them
        reachable (docs/format.md section 10), for up to PUT_BATCH_NBYTES /
        PUT_BATCH_PAGES of pages."""
        if not self._writable:
            raise (self.index.refuse_writes or _read_only)("storing pages")
        policy = self.config.compression
        if isinstance(pages, PageBatch):
            checked = list(pages)
            decisions = pages.zstd_decisions(policy)
        else:
            checked = verified_pages(pages)
            decisions = [None] * len(checked)
        new = existing = stored_total = 0
        for batch in _batches(list(zip(checked, decisions, strict=True)), PUT_BATCH_NBYTES,
                              PUT_BATCH_PAGES):
            n, e, s = self._put_batch(batch, policy)
            faults.crash_point("pages_synced")
            new, existing, stored_total = new + n, existing + e, stored_total + s
        return PutResult(new, existing, stored_total)

    def _put_batch(self, batch: list, policy: Compression) -> tuple[int, int, int]:
        """One batch: under the writer lock, append the absent pages' records, sync them,
        then one index commit of their locations and the segments' new tails."""
        with self._segment_writer():
            with self.index.read() as index:
                present = {d for (d, _), _ in batch if index.has_page(d)}
                tails = index.segment_tails()
            todo, seen = [], set(present)
            for (d, data), z in batch:
                if d not in seen:
                    seen.add(d)
                    todo.append((d, data, z))
            records = _encode_pages(todo, policy)
            locations = []
            if records:
                need = sum(align_up(RECORD_HEADER_NBYTES + memoryview(r.stored).nbytes)
                           for r in records)
                self._lmdb.check_disk_headroom("storing pages", need)
                self._segments.prepare(tails)
                # raw pages' headers (their xxh3-128) are made on the write threads
                locations = self._segments.append(records, workers=SAVE_WORKERS)
                faults.crash_point("segments_written")
                self._segments.sync()  # StoreIOError on failure: nothing is committed
                faults.crash_point("segments_synced")
            new_tails: dict[int, int] = {}
            for loc in locations:
                new_tails[loc.segment] = max(new_tails.get(loc.segment, 0), loc.end)
            items = [(r.digest, r.page_header, loc) for r, loc in zip(records, locations, strict=True)]
            dups = len(batch) - len(todo) - len(present)  # pages named twice in this batch
            stamp = now_ns()

            def commit(index: StoreIndex) -> tuple[int, int, int]:
                n, e, s = index.write_pages(items)
                for d in present:  # a dedup hit refreshes the page's grace time
                    index.refresh_page_time(d, stamp)
                for segment, tail in new_tails.items():
                    index.put_segment_tail(segment, tail)
                return n, e, s
            n, e, s = self.index.write(commit, what="storing pages", buffers=True,
                                       need_nbytes=INDEX_NBYTES_PER_PAGE * len(batch))
            return n, e + len(present) + dups, s

    @contextmanager
    def _segment_writer(self):
        """One appender at a time: this process's threads (a lock), and other processes
        (an exclusive flock on <store>/segments.lock, opened per save, so a forked child
        never shares the parent's lock)."""
        with self._writer_lock, writer_lock(self.path):
            yield

    @contextmanager
    def get_pages(self, digests: Sequence) -> Iterator[list]:
        """Zero-copy: yields one read-only buffer per digest, valid only inside the
        with-block (they point into a segment's map, or the LMDB map at schema 1; zstd
        pages are decompressed copies). Every page (and at schema 2 its record header)
        is verified before anything is yielded."""
        wanted = [PageDigest.coerce(d) for d in digests]
        damaged: list[tuple[PageDigest, str]] = []
        with self.index.read(buffers=True) as index:
            if self.schema_version == SCHEMA_V2:
                views, _ = _segment_views(index, wanted, damaged)
            else:
                views = []
                for d in wanted:
                    value = index.page(d)
                    if value is None:
                        _raise_absent(index, d)
                    try:
                        header, body = verify_stored(value, d)
                        views.append(decode_stored(header, body))
                    except ValueError as exc:
                        damaged.append((d, str(exc)))
            if not damaged:
                yield views
                return
        self._quarantine(damaged)

    @contextmanager
    def get_pages_deferred(self, digests: Sequence) -> Iterator[DeferredPages]:
        """get_pages for a caller that hashes the bytes where it copies them (a GPU,
        kvstore/deferred.py): every check of each record but its xxh3-128, which the
        DeferredPages' `expected` names for the caller's settle(). zstd pages, pages
        shorter than MIN_DEFERRED_NBYTES and a schema-1 store's pages are verified here
        and owe nothing. A record that fails a check made here is quarantined and
        raises IntegrityError, as in get_pages."""
        if self.schema_version != SCHEMA_V2:
            with verified_now(self.get_pages, digests) as pages:
                yield pages
            return
        wanted = [PageDigest.coerce(d) for d in digests]
        damaged: list[tuple[PageDigest, str]] = []
        with self.index.read(buffers=True) as index:
            views, expected = _segment_views(index, wanted, damaged, defer=True)
            if not damaged:
                yield DeferredPages(wanted, views, expected, self._recheck)
                return
        self._quarantine(damaged)

    def _recheck(self, digests: list[PageDigest]) -> None:
        """settle()'s second look at pages whose copies failed: get_pages on the host
        (quarantines and raises for a page damaged here)."""
        with self.get_pages(digests):
            pass

    def read_pages(self, digests: Sequence) -> list[bytes]:
        """Copying variant of get_pages."""
        with self.get_pages(digests) as views:
            return [bytes(v) for v in views]

    def read_pages_into(self, digests: Sequence, buffers: Sequence) -> int:
        """Copy each verified page into the matching writable buffer (exact length).
        Returns bytes copied. Each page is verified and copied in one pass, on worker
        threads (kvstore/readinto.py), straight from the segment map; a damaged page is
        quarantined and IntegrityError names it, as get_pages does."""
        if len(buffers) != len(digests):
            raise InvalidInput(f"{len(digests)} digests but {len(buffers)} buffers")
        wanted = [PageDigest.coerce(d) for d in digests]
        dests = [memoryview(buf).cast("B") for buf in buffers]
        with self.index.read(buffers=True) as index:
            records = []
            for d, dest in zip(wanted, dests, strict=True):
                value = index.page(d)
                if value is None:
                    _raise_absent(index, d)
                records.append((d, value))
            header_damage = [(i, problem) for i, (d, _) in enumerate(records)
                             if (problem := index.record_problem(d)) is not None]
            if header_damage:  # schema 2: a damaged record header; nothing is copied
                records = []
            for (d, value), dest in zip(records, dests):
                nbytes = index.page_sizes(d, value)[0]  # as counted when written
                if dest.nbytes != nbytes:
                    raise InvalidInput(f"buffer for page {d.short} holds {dest.nbytes} "
                                       f"bytes, the page has {nbytes}")

            def sink(i: int, raw) -> None:
                if len(raw) != dests[i].nbytes:
                    raise InvalidInput(f"buffer for page {wanted[i].short} holds "
                                       f"{dests[i].nbytes} bytes, the page has {len(raw)}")
                # numpy's copy releases the GIL (a memoryview assignment holds it): the
                # readers' copies run on several cores, as their hashing does
                np.copyto(np.frombuffer(dests[i], dtype=np.uint8), np.frombuffer(raw, dtype=np.uint8))
            damaged = header_damage or read_verified(records, sink)
        if damaged:
            self._quarantine([(wanted[i], reason) for i, reason in damaged])
        return sum(dest.nbytes for dest in dests)

    def _quarantine(self, damaged: list[tuple[PageDigest, str]]):
        """Quarantine damaged pages (where this store may write) and raise IntegrityError
        naming the first."""
        if self._writable:
            self.index.write(lambda index: [index.quarantine_page(d) for d, _ in damaged],
                             what="quarantining damaged pages", freeing=True)
        raise IntegrityError(damaged[0][0].hex(), damaged[0][1])

    def page_nbytes(self, digests: Sequence) -> list[int]:
        """Raw (uncompressed) length of each page; NotFound when absent."""
        out = []
        with self.index.read(buffers=True) as index:
            for d in (PageDigest.coerce(x) for x in digests):
                value = index.page(d)
                if value is None:
                    _raise_absent(index, d)
                out.append(accounted_nbytes(value)[0])
        return out

    # -- blocks ------------------------------------------------------------------------
    def commit_blocks(self, blocks: Sequence[BlockRecord]) -> CommitResult:
        """Atomically add block records (parents before children). Refuses, with
        nothing committed, a record whose format, pages or parent are not stored, or
        whose page lengths do not fit its format. Existing records are only touched."""
        blocks = list(blocks)
        for b in blocks:
            if not isinstance(b, BlockRecord):
                raise InvalidInput("commit_blocks takes BlockRecord objects")
        formats = {b.format_id: self._require_format(b.format_id) for b in blocks}
        for b in blocks:
            check_block_shape(b, formats[b.format_id])
        stamp = now_ns()

        def commit(index: StoreIndex) -> CommitResult:
            self._touches.apply(index)
            new, existing = index.commit_blocks(blocks, formats, stamp)
            evicted = 0
            if self.config.budget_nbytes is not None:
                evicted = index.evict_to(self.config.budget_nbytes).blocks
            return CommitResult(new, existing, evicted)

        result = self.index.write(commit, what="committing blocks", buffers=True)
        faults.crash_point("acknowledged")
        return result

    def get_blocks(self, keys: Sequence) -> list[BlockRecord]:
        out = []
        for k, record in zip(keys, self.find_blocks(keys), strict=True):
            if record is None:
                raise NotFound(f"block {ChainKey.coerce(k).hex()} is not stored")
            out.append(record)
        return out

    def list_blocks(self, namespace: str | None = None, *, after=None,
                    limit: int = 1000) -> list[BlockRecord]:
        """Block records in chain-key order, after the key `after` (exclusive), at most
        `limit`, of one namespace or of all. Page through a store with
        after=<last key of the previous page>."""
        if not 1 <= limit <= 100_000:
            raise InvalidInput("limit must be in [1, 100000]")
        if namespace is not None:
            check_namespace(namespace)
        start = bytes(ChainKey.coerce(after)) if after is not None else b""
        out: list[BlockRecord] = []
        with self.index.read() as index:
            for key, value in index.block_records(start):
                if key == start:
                    continue
                record = BlockRecord.decode(value, index.chain_salts)
                if namespace is None or record.namespace == namespace:
                    out.append(record)
                    if len(out) >= limit:
                        break
        return out

    def find_blocks(self, keys: Sequence) -> list[BlockRecord | None]:
        """The stored record of each key, or None: record presence only (a record whose
        pages are damaged is still returned; has_blocks says whether it is complete). A
        record stored under a key it does not hash to reads as None (verified_block)."""
        with self.index.read() as index:
            return [index.verified_block(ChainKey.coerce(k)) for k in keys]

    def has_blocks(self, keys: Sequence) -> list[bool]:
        """One bool per key: True only when the block's record is stored and every page
        it names is present (not missing, not quarantined). A block that answers False
        is published again, pages and all; that is how a quarantined page heals. A
        presence check: page values are never copied (buffers=True) or hashed."""
        with self.index.read(buffers=True) as index:
            return [index.complete_block(ChainKey.coerce(k)) is not None for k in keys]

    def lookup_prefix(self, format_id, namespace: str, tokens: Sequence[int], *,
                      max_tokens: int | None = None) -> PrefixMatch:
        """The longest run of stored blocks that prefixes `tokens` (at most max_tokens
        of them), under this format and namespace only. A trailing partial block
        matches when its tokens prefix the rest. The match stops before the first
        block that names a missing or quarantined page (a presence check, no hashing):
        the caller recomputes from there, and stats count the lookup in
        lookups_stopped_at_damage."""
        fid = format_id_bytes(format_id)
        check_namespace(namespace)
        tokens = list(tokens)[: max_tokens if max_tokens is not None else None]
        identity = self._cached_format(fid)
        matched, damaged = [], False
        if identity is not None and tokens:
            with self.index.read(buffers=True) as index:  # presence of pages: never copied
                matched, damaged = index.match_prefix(fid, namespace, tokens,
                                                      identity.block_size_tokens)
        count = sum(len(b.tokens) for b in matched)
        self._note_lookup(len(tokens), count, [b.key for b in matched], damaged)
        return PrefixMatch(count, tuple(matched))

    # -- checkpoints ---------------------------------------------------------------------
    def create_checkpoint(self, checkpoint: Checkpoint, *, replace: bool = False) -> Checkpoint:
        """Atomically store a named checkpoint. Its blocks must form one chain from the
        root whose tokens are exactly checkpoint.tokens, and every block and attachment
        page must be stored. Raises AlreadyExists unless replace=True."""
        identity = self._require_format(checkpoint.format_id)
        stamp = now_ns()
        record = dataclasses.replace(checkpoint, created_ns=stamp)  # re-validated

        def create(index: StoreIndex) -> Checkpoint:
            self._touches.apply(index)
            if not index.put_checkpoint(record, identity, stamp, replace=replace):
                raise AlreadyExists(f"checkpoint {record.namespace}/{record.name} exists; "
                                    "delete it or pass replace=True")
            return record

        result = self.index.write(create, what="creating a checkpoint", buffers=True)
        faults.crash_point("acknowledged")
        return result

    def get_checkpoint(self, namespace: str, name: str) -> Checkpoint:
        with self.index.read() as index:
            ckpt = index.checkpoint(checkpoint_key(namespace, name))
        if ckpt is None:
            raise NotFound(f"checkpoint {namespace}/{name} does not exist")
        return ckpt

    def list_checkpoints(self, namespace: str | None = None) -> list[Checkpoint]:
        prefix = check_namespace(namespace).encode() + b"\x00" if namespace is not None else b""
        with self.index.read() as index:
            return [Checkpoint.decode(value) for _, value in index.checkpoint_records(prefix)]

    def delete_checkpoint(self, namespace: str, name: str) -> None:
        key = checkpoint_key(namespace, name)

        def delete(index: StoreIndex) -> None:
            if not index.delete_checkpoint(key):
                raise NotFound(f"checkpoint {namespace}/{name} does not exist")
        self.index.write(delete, what="deleting a checkpoint", buffers=True, freeing=True)

    # -- capacity, stats, maintenance ----------------------------------------------------
    def evict(self, to_nbytes: int) -> EvictionReport:
        """Evict least-recently-used unpinned blocks, children before parents, until
        stored bytes are at most to_nbytes or nothing evictable is left."""
        if to_nbytes < 0:
            raise InvalidInput("eviction target must be >= 0 bytes")

        def run(index: StoreIndex, max_blocks: int) -> EvictionReport:
            self._touches.apply(index)
            return index.evict_to(to_nbytes, max_blocks=max_blocks)

        # In bounded transactions, as GC deletes. On a full disk (or a map at its limit)
        # a transaction's copied pages must fit in the pages earlier ones freed, so a
        # batch refused as StoreFull is retried at half the size, down to one block.
        blocks = pages = freed = 0
        batch = EVICT_BATCH_BLOCKS
        while True:
            try:
                report = self.index.write(lambda index: run(index, batch),
                                          what="evicting blocks", buffers=True, freeing=True)
            except StoreFull:
                if batch == 1:
                    raise
                batch //= 2
                continue
            blocks, pages, freed = blocks + report.blocks, pages + report.pages, freed + report.freed_nbytes
            if report.blocks < batch:
                return EvictionReport(blocks, pages, freed)

    def stats(self) -> StoreStats:
        """Counts and bytes. file_nbytes is the disk the store holds: the LMDB data
        file's used pages (last page number times page size) plus, at schema 2, the
        segment files' allocated bytes (st_blocks * 512: preallocated space counts,
        punched holes do not; SegmentFiles.allocated_nbytes)."""
        with self.index.read() as index:
            counts = {name: index.entries(name) for name in
                      ("pages", "blocks", "checkpoints", "formats", "quarantine", "pins")}
            counters = index.counters()
        lookups, hits, asked, matched, stopped = self._lookups
        return StoreStats(
            page_count=counts["pages"], block_count=counts["blocks"],
            checkpoint_count=counts["checkpoints"], format_count=counts["formats"],
            quarantined_count=counts["quarantine"], pinned_block_count=counts["pins"],
            budget_nbytes=self.config.budget_nbytes, map_nbytes=self._lmdb.map_nbytes(),
            file_nbytes=self._lmdb.used_nbytes() + self._segment_allocated_nbytes(), lookups=lookups, lookup_hits=hits,
            tokens_looked_up=asked, tokens_matched=matched,
            lookups_stopped_at_damage=stopped, **counters,
        )

    def check(self, read_data: bool = False, subset: tuple[int, int] | None = None,
              progress=None) -> CheckReport:
        """Verify the whole index (and, with read_data, every page's blake3). Returns a
        CheckReport of typed problems; see kvstore/check.py."""
        return check_store(self, read_data=read_data, subset=subset, progress=progress)

    def plan_gc(self, grace_s: float = 3600.0) -> GCPlan:
        """A GCPlan of unreferenced pages older than grace_s and orphans; see kvstore/gc.py."""
        return plan_gc(self, grace_s)

    # -- internals -------------------------------------------------------------------------
    def _segment_allocated_nbytes(self) -> int:
        """Schema 2: the segment files' allocated bytes; 0 at schema 1 (no segments)."""
        return 0 if self._segments is None else self._segments.allocated_nbytes()

    def _require_format(self, format_id) -> FormatIdentity:
        identity = self._cached_format(format_id_bytes(format_id))
        if identity is None:
            raise MissingReferences("the record", [f"format {bytes(format_id).hex()}"])
        return identity

    def _note_lookup(self, asked: int, matched: int, keys: list[bytes], damaged: bool) -> None:
        with self._lookup_lock:
            for i, n in enumerate((1, 1 if matched else 0, asked, matched, 1 if damaged else 0)):
                self._lookups[i] += n
        if keys and self._touches.add(keys, now_ns()) > TOUCH_FLUSH_S and self._writable:
            try:
                self._flush_touches()
            except (StoreIOError, StoreFull):
                pass  # only LRU order is lost (see PendingTouches); the lookup succeeded

    def _flush_touches(self) -> None:
        if self._touches:
            # rewrites existing records only; allowed into the headroom so close() never fails
            self.index.write(self._touches.apply, what="recording block use", freeing=True)

    @property
    def lmdb(self) -> LmdbEnv:
        """The environment itself, for tests that damage it on purpose; kvstore.gc,
        kvstore.check and the tools go through Store.index (kvstore/index.py)."""
        return self._lmdb


def _clock() -> int:
    return now_ns()  # looked up at each call, so a test that moves kvstore.store.now_ns moves it


def _init_meta(txn, dbs) -> None:
    """The meta record of a new store, written with its databases (kvstore/lmdbenv.py:
    an environment without it is refused as damaged, never initialised again)."""
    txn.put(META_RECORD, U64.pack(STORE_SCHEMA_VERSION), db=dbs["meta"])


def _read_only(what: str) -> StoreIOError:
    return StoreIOError(f"{what} refused: the store was opened read-only; nothing was written")


def _raise_absent(index: StoreIndex, d: PageDigest):
    if index.is_quarantined(d):
        raise IntegrityError(d.hex(), "quarantined earlier")
    raise NotFound(f"page {d.hex()} is not stored")


def _segment_views(index: StoreIndex, wanted: list, damaged: list, *, defer: bool = False
                   ) -> tuple[list, list[bytes | None]]:
    """Schema 2, the loop of get_pages (and get_pages_deferred): per page one index get,
    one view of its segment record and one parse of its header (kvstore/segments.py
    verify_record: the record header's magic, reserved bytes, checksum and full digest,
    and every check verify_stored makes of the page value: its header, digest prefix,
    lengths, xxh3-128). Pages that fail go to `damaged` (digest, reason); the rest are
    returned in order, as (views, expected). With `defer`, a raw record of at least
    MIN_DEFERRED_NBYTES is checked in everything but its xxh3-128, which expected[i]
    names for the caller (kvstore/deferred.py); every other page is verified here and
    owes nothing (None). Per page this is the least Python that verifies it: callers
    read from many threads, and this loop holds the GIL."""
    segments = index.segments
    views, expected = [], []
    for d in wanted:
        location = index.location(d)
        if location is None:
            if not index.has_page(d):
                _raise_absent(index, d)
            damaged.append((d, "its location does not parse"))
            continue
        try:
            view = segments.view(location)
            header, body = verify_record(view, d, location, hash_body=not defer)
            if defer:
                if header.codec == CODEC_RAW and header.stored_nbytes >= MIN_DEFERRED_NBYTES:
                    views.append(body)
                    expected.append(header.xxh3)
                    continue
                header, body = verify_record(view, d, location)  # a zstd or short page
            views.append(decode_stored(header, body))
            expected.append(None)
        except ValueError as exc:
            damaged.append((d, str(exc)))
    return views, expected


def format_id_bytes(format_id) -> bytes:
    """A format id given as a FormatIdentity, 64 hex characters or 32 bytes, as bytes."""
    if isinstance(format_id, FormatIdentity):
        return format_id.format_id
    if isinstance(format_id, str):
        return bytes(ChainKey.parse(format_id))
    if isinstance(format_id, (bytes, bytearray, memoryview)) and len(format_id) == 32:
        return bytes(format_id)
    raise InvalidInput(f"not a format id: {format_id!r:.80}")


def _encode_pages(todo: list, policy: Compression) -> list[PendingRecord]:
    """(digest, data, zstd decision) -> the records to append, in order. A page stored
    raw leaves its header to the segment writer, which computes its xxh3-128 on the
    write thread just before writing it (PendingRecord): no checksum pass here. zstd is
    tried here, on SAVE_WORKERS threads once the pages it is tried on are enough bytes
    to pay for them (none in a PageBatch of packed or incompressible formats)."""
    def encode(item) -> PendingRecord:
        d, data, z = item
        frame = zstd_frame(data, policy, try_zstd=z)  # also refuses an oversized page
        if frame is None:
            return PendingRecord(d, None, data)
        return PendingRecord(d, zstd_page_header(len(data), frame, d), frame)
    tried = sum(len(data) for _, data, z in todo if z is not False)
    workers = min(SAVE_WORKERS, len(todo))
    if workers <= 1 or tried < PARALLEL_ENCODE_NBYTES:
        return [encode(item) for item in todo]
    with ThreadPoolExecutor(workers, thread_name_prefix="kvstore-encode") as pool:
        return list(pool.map(encode, todo, chunksize=max(1, len(todo) // (4 * workers))))


def _batches(items: list, max_nbytes: int, max_pages: int):
    """items: ((digest, data), zstd decision); runs of at most max_nbytes / max_pages."""
    batch, size = [], 0
    for item in items:
        nbytes = len(item[0][1])
        if batch and (size + nbytes > max_nbytes or len(batch) >= max_pages):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes
    if batch:
        yield batch

