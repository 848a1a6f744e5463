"""Store: the embedded, durable, content-addressed page store over one LMDB directory.

Its public method set is the store protocol; kvstore.client.RemoteStore implements
the same one over HTTP, so callers (the engine, the CLI) take either.

A save goes pages first, then records:
  missing(digests)        which pages the store lacks (and marks present ones as in use)
  put_pages(pages)        hash, compress where it pays, write; durable on return
  commit_blocks(records)  atomic; refuses records whose pages, parent or format are absent
  create_checkpoint(c)    atomic; pins its blocks and attachment pages
A restore goes lookup_prefix -> get_pages / read_pages_into. Every page read is checked
against the xxh3-128 in its header; a damaged page is quarantined and IntegrityError
names it. check(read_data=True) re-hashes every page with blake3.

Reference counts (refs: page -> number of block records and checkpoint attachments
naming it; pins: block -> number of checkpoints naming it; children: parent -> child)
are updated in the same write transaction as the records that change them.
"""

from __future__ import annotations

import heapq
import os
import struct
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import blake3

from kvstore import faults
from kvstore.errors import (
    AlreadyExists,
    DigestMismatch,
    IntegrityError,
    InvalidInput,
    MissingReferences,
    NotFound,
    StoreFull,
    StoreIOError,
    UnsupportedVersion,
)
from kvstore.format import FormatIdentity
from kvstore.ids import ROOT_KEY, ChainKey, PageDigest, chain_key, check_namespace
from kvstore.lmdbenv import (
    DEFAULT_MAP_NBYTES,
    DEFAULT_MAX_MAP_NBYTES,
    DEFAULT_RESERVE_NBYTES,
    META_RECORD,
    LmdbEnv,
)
from kvstore.pages import (
    HEADER_NBYTES,
    Compression,
    PageHeader,
    accounted_nbytes,
    decode_stored,
    encode_page,
    verify_stored,
)
from kvstore.records import BlockRecord, Checkpoint, checkpoint_key

STORE_SCHEMA_VERSION = 1
U64 = struct.Struct(">Q")
SIZES = struct.Struct(">QQ")
PUT_BATCH_NBYTES = 64 << 20  # LMDB caps dirty pages per transaction; batch page writes
TOUCH_FLUSH_S = 10.0
EVICT_BATCH_BLOCKS = 1024  # blocks per eviction transaction at most (see Store.evict)
_BLAKE3_THREADS_FROM = 1 << 20
COUNTERS = ("raw_nbytes", "stored_nbytes", "referenced_raw_nbytes",
            "evicted_blocks", "evicted_nbytes")


def now_ns() -> int:
    return time.time_ns()


def hash_page(data) -> PageDigest:
    """blake3 of a page; multithreaded for large pages."""
    threads = blake3.blake3.AUTO if len(data) >= _BLAKE3_THREADS_FROM else 1
    return PageDigest(blake3.blake3(data, max_threads=threads).digest())


def verified_pages(pages: Mapping | Iterable[tuple]) -> list[tuple[PageDigest, object]]:
    """(digest, bytes) pairs from {digest: bytes} or pairs, every digest recomputed.
    One mismatch raises DigestMismatch before the caller writes or sends anything."""
    items = list(pages.items()) if isinstance(pages, Mapping) else list(pages)
    checked = []
    for claimed, data in items:
        digest = PageDigest.coerce(claimed)
        actual = hash_page(data)
        if actual != digest:
            raise DigestMismatch(digest.hex(), actual.hex())
        checked.append((digest, data))
    return checked


@dataclass(frozen=True)
class StoreConfig:
    map_nbytes: int = DEFAULT_MAP_NBYTES
    max_map_nbytes: int = DEFAULT_MAX_MAP_NBYTES
    budget_nbytes: int | None = None  # evict LRU unpinned blocks past this many stored bytes
    reserve_nbytes: int = DEFAULT_RESERVE_NBYTES  # disk kept free for deletes and GC
    compression: Compression = field(default_factory=Compression)


@dataclass(frozen=True)
class PutResult:
    new: int
    existing: int
    stored_nbytes: int


@dataclass(frozen=True)
class CommitResult:
    new: int
    existing: int
    evicted_blocks: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """The longest stored prefix: how many tokens, and the block records in chain order."""

    tokens_matched: int
    blocks: tuple[BlockRecord, ...]

    @property
    def chain_keys(self) -> list[ChainKey]:
        return [b.key for b in self.blocks]


@dataclass(frozen=True)
class EvictionReport:
    blocks: int
    pages: int
    freed_nbytes: int


@dataclass(frozen=True)
class StoreStats:
    page_count: int
    block_count: int
    checkpoint_count: int
    format_count: int
    quarantined_count: int
    pinned_block_count: int
    raw_nbytes: int
    stored_nbytes: int
    referenced_raw_nbytes: int
    evicted_blocks: int
    evicted_nbytes: int
    budget_nbytes: int | None
    map_nbytes: int
    file_nbytes: int
    lookups: int
    lookup_hits: int
    tokens_looked_up: int
    tokens_matched: int
    # lookups whose match stopped before a block naming a missing or quarantined page
    # (this process, since open; the caller recomputed from there)
    lookups_stopped_at_damage: int = 0

    @property
    def dedup_ratio(self) -> float:
        return self.referenced_raw_nbytes / self.raw_nbytes if self.raw_nbytes else 1.0

    @property
    def compression_ratio(self) -> float:
        return self.raw_nbytes / self.stored_nbytes if self.stored_nbytes else 1.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["dedup_ratio"] = self.dedup_ratio
        out["compression_ratio"] = self.compression_ratio
        return out


# -- small transaction helpers (txn, dbs) ----------------------------------------------
def _get_u64(txn, db, key: bytes) -> int:
    raw = txn.get(key, db=db)
    return U64.unpack(raw)[0] if raw is not None else 0


def _add_u64(txn, db, key: bytes, delta: int) -> int:
    value = _get_u64(txn, db, key) + delta
    assert value >= 0, f"counter {key!r} would go negative ({value}); the index is inconsistent"
    if value == 0:
        txn.delete(key, db=db)
    else:
        txn.put(key, U64.pack(value), db=db)
    return value


def _counter(txn, dbs, name: str, delta: int) -> None:
    _add_u64(txn, dbs["meta"], name.encode(), delta)


def _has_children(txn, dbs, key: bytes) -> bool:
    with txn.cursor(db=dbs["children"]) as cur:
        return cur.set_range(key) and bytes(cur.key()[:32]) == key


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
        self._formats: dict[bytes, FormatIdentity] = {}
        self._touch_lock = threading.Lock()
        self._pending_touches: dict[bytes, int] = {}
        self._touches_since = 0.0
        # lookups, hits, tokens asked, tokens matched, lookups stopped at a damaged block
        self._lookups = [0, 0, 0, 0, 0]
        self._check_schema()

    @property
    def maps_pages(self) -> bool:
        """get_pages yields zero-copy views of the LMDB map (kvstore/protocol.py)."""
        return True

    @classmethod
    def open(cls, path, **config) -> "Store":
        return cls(path, StoreConfig(**config) if config else None)

    def close(self) -> None:
        if not self._lmdb.readonly:
            self._flush_touches()
        self._lmdb.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_schema(self):
        with self._lmdb.read() as txn:
            version = _get_u64(txn, self._lmdb.dbs["meta"], META_RECORD)
        if version > STORE_SCHEMA_VERSION:
            raise UnsupportedVersion(
                f"store at {self.path} has schema version {version}; this code reads up to "
                f"{STORE_SCHEMA_VERSION}. Upgrade mlx-kvstore"
            )

    # -- formats -------------------------------------------------------------------
    def put_format(self, identity: FormatIdentity) -> bytes:
        """Idempotent. Returns the 32-byte format id."""
        fid, raw = identity.format_id, identity.canonical()

        def put(txn, dbs):
            if txn.get(fid, db=dbs["formats"]) is None:
                txn.put(fid, raw, db=dbs["formats"])
        if self._cached_format(fid) is None:
            self._lmdb.write(put, what="storing a format identity")
        self._formats[fid] = identity
        return fid

    def get_format(self, format_id) -> FormatIdentity:
        fid = _format_id_bytes(format_id)
        identity = self._cached_format(fid)
        if identity is None:
            raise NotFound(f"format {fid.hex()} is not stored; put_format() it first")
        return identity

    def _cached_format(self, fid: bytes) -> FormatIdentity | None:
        identity = self._formats.get(fid)
        if identity is None:
            with self._lmdb.read() as txn:
                raw = txn.get(fid, db=self._lmdb.dbs["formats"])
            if raw is None:
                return None
            identity = FormatIdentity.from_json(raw)
            assert identity.format_id == fid, f"format record {fid.hex()} hashes to another id"
            self._formats[fid] = identity
        return identity

    def list_formats(self) -> list[FormatIdentity]:
        with self._lmdb.read() as txn:
            raws = list(txn.cursor(db=self._lmdb.dbs["formats"]).iternext(values=True))
        return [FormatIdentity.from_json(v) for _, v in raws]

    # -- pages -----------------------------------------------------------------------
    def missing(self, digests: Iterable) -> list[PageDigest]:
        """The digests the store does not hold, in input order. Present pages that no
        record references yet get their grace time refreshed, so GC spares them until
        the caller commits."""
        wanted = [PageDigest.coerce(d) for d in digests]
        absent, unreferenced = [], []
        dbs = self._lmdb.dbs
        with self._lmdb.read(buffers=True) as txn:  # presence only: never copy a page
            for d in wanted:
                if txn.get(d, db=dbs["pages"]) is None:
                    absent.append(d)
                elif txn.get(d, db=dbs["refs"]) is None:
                    unreferenced.append(d)
        if unreferenced:
            stamp = U64.pack(now_ns())

            def refresh(txn, dbs):
                for d in unreferenced:
                    if txn.get(d, db=dbs["pages"]) is not None:
                        txn.put(d, stamp, db=dbs["page_times"])
            self._lmdb.write(refresh, what="refreshing page grace times", buffers=True)
        return absent

    def put_pages(self, pages: Mapping | Iterable[tuple]) -> PutResult:
        """Store pages given as {digest: bytes} or (digest, bytes) pairs. Every digest is
        recomputed first; one mismatch refuses the whole call with DigestMismatch and
        nothing is written. Idempotent. Durable when it returns."""
        checked = verified_pages(pages)
        new = existing = stored_total = 0
        for batch in _batches(checked, PUT_BATCH_NBYTES):
            encoded = [(d, *encode_page(data, self.config.compression, d)) for d, data in batch]
            need = sum(HEADER_NBYTES + len(stored) for _, _, stored in encoded)
            n, e, s = self._lmdb.write(lambda txn, dbs: _write_pages(txn, dbs, encoded),
                                       what="storing pages", buffers=True, need_nbytes=need)
            faults.crash_point("pages_synced")
            new, existing, stored_total = new + n, existing + e, stored_total + s
        return PutResult(new, existing, stored_total)

    @contextmanager
    def get_pages(self, digests: Sequence) -> Iterator[list]:
        """Zero-copy: yields one read-only buffer per digest, valid only inside the
        with-block (they point into the LMDB map; zstd pages are decompressed copies).
        Every page is verified before anything is yielded."""
        wanted = [PageDigest.coerce(d) for d in digests]
        damaged: list[tuple[PageDigest, str]] = []
        with self._lmdb.read(buffers=True) as txn:
            views = []
            for d in wanted:
                value = txn.get(d, db=self._lmdb.dbs["pages"])
                if value is None:
                    self._raise_absent(txn, d)
                try:
                    header, body = verify_stored(value, d)
                    views.append(decode_stored(header, body))
                except ValueError as exc:
                    damaged.append((d, str(exc)))
            if not damaged:
                yield views
                return
        self._quarantine(damaged)
        raise IntegrityError(damaged[0][0].hex(), damaged[0][1])

    def read_pages(self, digests: Sequence) -> list[bytes]:
        """Copying variant of get_pages."""
        with self.get_pages(digests) as views:
            return [bytes(v) for v in views]

    def read_pages_into(self, digests: Sequence, buffers: Sequence) -> int:
        """Copy each verified page into the matching writable buffer (exact length).
        Returns bytes copied."""
        if len(buffers) != len(digests):
            raise InvalidInput(f"{len(digests)} digests but {len(buffers)} buffers")
        total = 0
        with self.get_pages(digests) as views:
            for d, view, buf in zip(digests, views, buffers):
                dest = memoryview(buf).cast("B")
                if dest.nbytes != len(view):
                    raise InvalidInput(f"buffer for page {PageDigest.coerce(d).short} holds "
                                       f"{dest.nbytes} bytes, the page has {len(view)}")
                dest[:] = view
                total += dest.nbytes
        return total

    def page_nbytes(self, digests: Sequence) -> list[int]:
        """Raw (uncompressed) length of each page; NotFound when absent."""
        out = []
        with self._lmdb.read(buffers=True) as txn:
            for d in (PageDigest.coerce(x) for x in digests):
                value = txn.get(d, db=self._lmdb.dbs["pages"])
                if value is None:
                    self._raise_absent(txn, d)
                out.append(accounted_nbytes(value)[0])
        return out

    def _raise_absent(self, txn, d: PageDigest):
        if txn.get(d, db=self._lmdb.dbs["quarantine"]) is not None:
            raise IntegrityError(d.hex(), "quarantined earlier")
        raise NotFound(f"page {d.hex()} is not stored")

    def _quarantine(self, damaged: list[tuple[PageDigest, str]]) -> None:
        def move(txn, dbs):
            for d, _ in damaged:
                value = txn.get(d, db=dbs["pages"])
                if value is None:
                    continue
                txn.put(d, value, db=dbs["quarantine"])
                refs = _get_u64(txn, dbs["refs"], d)
                _counter(txn, dbs, "referenced_raw_nbytes", -refs * page_sizes(txn, dbs, d, value)[0])
                _delete_page(txn, dbs, d)
        if not self._lmdb.readonly:
            self._lmdb.write(move, what="quarantining damaged pages", freeing=True)

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
            fmt = formats[b.format_id]
            if len(b.pages) != len(fmt.paged_layers):
                raise InvalidInput(f"block {b.key.short} has {len(b.pages)} pages; its format has "
                                   f"{len(fmt.paged_layers)} paged layers")
            if len(b.tokens) > fmt.block_size_tokens:
                raise InvalidInput(f"block {b.key.short} holds {len(b.tokens)} tokens, more than "
                                   f"the format's block size {fmt.block_size_tokens}")
        stamp = now_ns()

        def commit(txn, dbs):
            self._apply_touches(txn, dbs)
            batch_keys = {}
            missing_pages, new, existing = [], 0, 0
            for b in blocks:
                fmt = formats[b.format_id]
                if b.key in batch_keys or txn.get(b.key, db=dbs["blocks"]) is not None:
                    existing += 1
                    if b.key not in batch_keys:
                        _touch_block(txn, dbs, b.key, stamp)
                    continue
                if not b.is_root:
                    parent = batch_keys.get(b.parent)
                    if parent is None:
                        raw = txn.get(b.parent, db=dbs["blocks"])
                        parent = BlockRecord.decode(raw) if raw is not None else None
                    if parent is None or parent.namespace != b.namespace:
                        # another namespace's block reads exactly as an absent one: the
                        # answer must not tell a tenant what another tenant stored
                        raise MissingReferences(f"block {b.key.short}", [f"parent block {b.parent.hex()}"])
                    if len(parent.tokens) != fmt.block_size_tokens or parent.format_id != b.format_id:
                        raise InvalidInput(f"block {b.key.short}'s parent is a partial block or of "
                                           "another format")
                for layer_index, d in zip(fmt.paged_layers, b.pages):
                    value = txn.get(d, db=dbs["pages"])
                    if value is None:
                        missing_pages.append(f"page {d.hex()}")
                        continue
                    want = fmt.layers[layer_index].page_nbytes(len(b.tokens))
                    got = accounted_nbytes(value)[0]
                    if got != want:
                        raise InvalidInput(
                            f"block {b.key.short} layer {layer_index}: page {d.short} holds {got} "
                            f"bytes, the format needs {want} for {len(b.tokens)} tokens")
                if missing_pages:
                    # nothing will be committed; keep validating the children so the
                    # error names every absent page, not the parent of the next block
                    batch_keys[b.key] = b
                    continue
                record = b.with_times(stamp, stamp)
                _insert_block(txn, dbs, record)
                batch_keys[b.key] = record
                new += 1
            if missing_pages:
                raise MissingReferences("commit_blocks", missing_pages)
            evicted = 0
            if self.config.budget_nbytes is not None:
                evicted = _evict_to(txn, dbs, self.config.budget_nbytes).blocks
            return CommitResult(new, existing, evicted)

        result = self._lmdb.write(commit, what="committing blocks", buffers=True)
        faults.crash_point("acknowledged")
        return result

    def get_blocks(self, keys: Sequence) -> list[BlockRecord]:
        out = []
        with self._lmdb.read() as txn:
            for k in (ChainKey.coerce(x) for x in keys):
                raw = txn.get(k, db=self._lmdb.dbs["blocks"])
                if raw is None:
                    raise NotFound(f"block {k.hex()} is not stored")
                out.append(BlockRecord.decode(raw))
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
        with self._lmdb.read() as txn:
            with txn.cursor(db=self._lmdb.dbs["blocks"]) as cur:
                if not cur.set_range(start):
                    return out
                for key, value in cur:
                    if bytes(key) == start:
                        continue
                    record = BlockRecord.decode(value)
                    if namespace is None or record.namespace == namespace:
                        out.append(record)
                        if len(out) >= limit:
                            break
        return out

    def find_blocks(self, keys: Sequence) -> list[BlockRecord | None]:
        """The stored record of each key, or None: record presence only (a record whose
        pages are damaged is still returned; has_blocks says whether it is complete)."""
        with self._lmdb.read() as txn:
            raws = [txn.get(ChainKey.coerce(k), db=self._lmdb.dbs["blocks"]) for k in keys]
        return [BlockRecord.decode(raw) if raw is not None else None for raw in raws]

    def has_blocks(self, keys: Sequence) -> list[bool]:
        """One bool per key: True only when the block's record is stored and every page
        it names is present (not missing, not quarantined). A block that answers False
        is published again, pages and all; that is how a quarantined page heals. A
        presence check: page values are never copied (buffers=True) or hashed."""
        dbs = self._lmdb.dbs
        with self._lmdb.read(buffers=True) as txn:
            return [_complete_record(txn, dbs, ChainKey.coerce(k)) is not None for k in keys]

    def lookup_prefix(self, format_id, namespace: str, tokens: Sequence[int], *,
                      max_tokens: int | None = None) -> PrefixMatch:
        """The longest run of stored blocks that prefixes `tokens` (at most max_tokens
        of them), under this format and namespace only. A trailing partial block
        matches when its tokens prefix the rest. The match stops before the first
        block that names a missing or quarantined page (a presence check, no hashing):
        the caller recomputes from there, and stats count the lookup in
        lookups_stopped_at_damage."""
        fid = _format_id_bytes(format_id)
        check_namespace(namespace)
        tokens = list(tokens)[: max_tokens if max_tokens is not None else None]
        identity = self._cached_format(fid)
        matched: list[BlockRecord] = []
        damaged = False
        if identity is not None and tokens:
            bs = identity.block_size_tokens
            parent, pos = ROOT_KEY, 0
            dbs = self._lmdb.dbs
            with self._lmdb.read(buffers=True) as txn:  # presence of pages: never copied
                while pos + bs <= len(tokens):
                    key = chain_key(fid, namespace, parent, tokens[pos : pos + bs])
                    record = _complete_record(txn, dbs, key)
                    if record is None:
                        damaged = txn.get(key, db=dbs["blocks"]) is not None
                        break
                    matched.append(record)
                    parent, pos = key, pos + bs
                if not damaged:  # a trailing partial block, after the full ones
                    for n in range(min(len(tokens) - pos, bs - 1), 0, -1):
                        key = chain_key(fid, namespace, parent, tokens[pos : pos + n])
                        if txn.get(key, db=dbs["blocks"]) is None:
                            continue
                        record = _complete_record(txn, dbs, key)
                        if record is None:
                            damaged = True
                        else:
                            matched.append(record)
                        break
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
        record = Checkpoint(**{**_ckpt_fields(checkpoint), "created_ns": stamp})

        def create(txn, dbs):
            self._apply_touches(txn, dbs)
            key = record.db_key
            old = txn.get(key, db=dbs["checkpoints"])
            if old is not None and not replace:
                raise AlreadyExists(f"checkpoint {record.namespace}/{record.name} exists; "
                                    "delete it or pass replace=True")
            _validate_checkpoint(txn, dbs, record, identity)
            if old is not None:
                _unpin_checkpoint(txn, dbs, Checkpoint.decode(old))
            txn.put(key, record.encode(), db=dbs["checkpoints"])
            for k in record.chain_keys:
                _add_u64(txn, dbs["pins"], k, 1)
                _touch_block(txn, dbs, k, stamp)
            for d in record.attachments.values():
                _add_ref(txn, dbs, d, 1)
            return record

        result = self._lmdb.write(create, what="creating a checkpoint", buffers=True)
        faults.crash_point("acknowledged")
        return result

    def get_checkpoint(self, namespace: str, name: str) -> Checkpoint:
        with self._lmdb.read() as txn:
            raw = txn.get(checkpoint_key(namespace, name), db=self._lmdb.dbs["checkpoints"])
        if raw is None:
            raise NotFound(f"checkpoint {namespace}/{name} does not exist")
        return Checkpoint.decode(raw)

    def list_checkpoints(self, namespace: str | None = None) -> list[Checkpoint]:
        prefix = check_namespace(namespace).encode() + b"\x00" if namespace is not None else b""
        out = []
        with self._lmdb.read() as txn:
            with txn.cursor(db=self._lmdb.dbs["checkpoints"]) as cur:
                if not cur.set_range(prefix):
                    return out
                for key, value in cur:
                    if not key.startswith(prefix):
                        break
                    out.append(Checkpoint.decode(value))
        return out

    def delete_checkpoint(self, namespace: str, name: str) -> None:
        key = checkpoint_key(namespace, name)

        def delete(txn, dbs):
            raw = txn.get(key, db=dbs["checkpoints"])
            if raw is None:
                raise NotFound(f"checkpoint {namespace}/{name} does not exist")
            _unpin_checkpoint(txn, dbs, Checkpoint.decode(raw))
            txn.delete(key, db=dbs["checkpoints"])
        self._lmdb.write(delete, what="deleting a checkpoint", buffers=True, freeing=True)

    # -- capacity, stats, maintenance ----------------------------------------------------
    def evict(self, to_nbytes: int) -> EvictionReport:
        """Evict least-recently-used unpinned blocks, children before parents, until
        stored bytes are at most to_nbytes or nothing evictable is left."""
        if to_nbytes < 0:
            raise InvalidInput("eviction target must be >= 0 bytes")

        def run(txn, dbs, max_blocks):
            self._apply_touches(txn, dbs)
            return _evict_to(txn, dbs, to_nbytes, max_blocks=max_blocks)

        # In bounded transactions, as GC deletes. On a full disk (or a map at its limit)
        # a transaction's copied pages must fit in the pages earlier ones freed, so a
        # batch refused as StoreFull is retried at half the size, down to one block.
        blocks = pages = freed = 0
        batch = EVICT_BATCH_BLOCKS
        while True:
            try:
                report = self._lmdb.write(lambda txn, dbs: run(txn, dbs, batch),
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
        dbs = self._lmdb.dbs
        with self._lmdb.read() as txn:
            counts = {name: txn.stat(dbs[name])["entries"] for name in
                      ("pages", "blocks", "checkpoints", "formats", "quarantine", "pins")}
            counters = {name: _get_u64(txn, dbs["meta"], name.encode()) for name in COUNTERS}
        lookups, hits, asked, matched, stopped = self._lookups
        return StoreStats(
            page_count=counts["pages"], block_count=counts["blocks"],
            checkpoint_count=counts["checkpoints"], format_count=counts["formats"],
            quarantined_count=counts["quarantine"], pinned_block_count=counts["pins"],
            budget_nbytes=self.config.budget_nbytes, map_nbytes=self._lmdb.map_nbytes(),
            file_nbytes=self._lmdb.used_nbytes(), lookups=lookups, lookup_hits=hits,
            tokens_looked_up=asked, tokens_matched=matched,
            lookups_stopped_at_damage=stopped, **counters,
        )

    def check(self, read_data: bool = False, subset: tuple[int, int] | None = None, progress=None):
        """Verify the whole index (and, with read_data, every page's blake3). Returns a
        CheckReport of typed problems; see kvstore/check.py."""
        from kvstore.check import check_store
        return check_store(self, read_data=read_data, subset=subset, progress=progress)

    def plan_gc(self, grace_s: float = 3600.0):
        """A GCPlan of unreferenced pages older than grace_s and orphans; see kvstore/gc.py."""
        from kvstore.gc import plan_gc
        return plan_gc(self, grace_s)

    # -- internals -------------------------------------------------------------------------
    def _require_format(self, format_id) -> FormatIdentity:
        identity = self._cached_format(_format_id_bytes(format_id))
        if identity is None:
            raise MissingReferences("the record", [f"format {bytes(format_id).hex()}"])
        return identity

    def _note_lookup(self, asked: int, matched: int, keys: list[bytes], damaged: bool) -> None:
        with self._touch_lock:
            self._lookups[0] += 1
            self._lookups[1] += 1 if matched else 0
            self._lookups[2] += asked
            self._lookups[3] += matched
            self._lookups[4] += 1 if damaged else 0
            if not keys:
                return
            stamp = now_ns()
            if not self._pending_touches:
                self._touches_since = time.monotonic()
            for k in keys:
                self._pending_touches[bytes(k)] = stamp
            due = time.monotonic() - self._touches_since > TOUCH_FLUSH_S
        if due and not self._lmdb.readonly:
            try:
                self._flush_touches()
            except (StoreIOError, StoreFull):
                pass  # only LRU order is lost (see _apply_touches); the lookup itself succeeded

    def _flush_touches(self) -> None:
        with self._touch_lock:
            if not self._pending_touches:
                return
        # rewrites existing records only; allowed into the headroom so close() never fails
        self._lmdb.write(self._apply_touches, what="recording block use", freeing=True)

    def _apply_touches(self, txn, dbs) -> None:
        """LRU touches from lookups are kept in memory and written with the next write:
        losing them in a crash only ages the LRU order, never the data."""
        with self._touch_lock:
            touches, self._pending_touches = self._pending_touches, {}
        for key, stamp in touches.items():
            _touch_block(txn, dbs, key, stamp)

    @property
    def lmdb(self) -> LmdbEnv:
        """The environment, for kvstore.gc and kvstore.check."""
        return self._lmdb


# -- record maintenance inside one write transaction -----------------------------------
def _init_meta(txn, dbs) -> None:
    """The meta record of a new store, written with its databases (kvstore/lmdbenv.py:
    an environment without it is refused as damaged, never initialised again)."""
    txn.put(META_RECORD, U64.pack(STORE_SCHEMA_VERSION), db=dbs["meta"])


def _format_id_bytes(format_id) -> bytes:
    if isinstance(format_id, FormatIdentity):
        return format_id.format_id
    if isinstance(format_id, str):
        return bytes(ChainKey.parse(format_id))
    if isinstance(format_id, (bytes, bytearray, memoryview)) and len(format_id) == 32:
        return bytes(format_id)
    raise InvalidInput(f"not a format id: {format_id!r:.80}")


def _batches(items: list, max_nbytes: int):
    batch, size = [], 0
    for item in items:
        if batch and size + len(item[1]) > max_nbytes:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += len(item[1])
    if batch:
        yield batch


def _write_pages(txn, dbs, encoded) -> tuple[int, int, int]:
    new = existing = stored_total = 0
    stamp = U64.pack(now_ns())
    for digest, header, stored in encoded:
        if txn.get(digest, db=dbs["pages"]) is not None:
            existing += 1
        else:
            raw_nbytes = PageHeader.unpack(header).raw_nbytes
            txn.put(digest, b"".join((header, stored)), db=dbs["pages"])
            _counter(txn, dbs, "raw_nbytes", raw_nbytes)
            _counter(txn, dbs, "stored_nbytes", HEADER_NBYTES + len(stored))
            txn.put(digest, SIZES.pack(raw_nbytes, HEADER_NBYTES + len(stored)), db=dbs["page_sizes"])
            # a page re-uploaded after quarantine: its surviving references count again,
            # and the damaged copy goes (the page is whole again; nothing to keep it for)
            refs = _get_u64(txn, dbs["refs"], digest)
            if refs:
                _counter(txn, dbs, "referenced_raw_nbytes", refs * raw_nbytes)
            txn.delete(digest, db=dbs["quarantine"])
            stored_total += HEADER_NBYTES + len(stored)
            new += 1
        txn.put(digest, stamp, db=dbs["page_times"])
    faults.crash_point("page_written")
    return new, existing, stored_total


def _complete_record(txn, dbs, key: bytes) -> BlockRecord | None:
    """The block record under `key` when it is stored and every page it names is in
    `pages` (quarantine moves a page out of it); else None. txn may use buffers."""
    raw = txn.get(bytes(key), db=dbs["blocks"])
    if raw is None:
        return None
    record = BlockRecord.decode(raw)  # copies the record before any other get
    pages = dbs["pages"]
    return record if all(txn.get(d, db=pages) is not None for d in record.pages) else None


def page_sizes(txn, dbs, digest: bytes, value) -> tuple[int, int]:
    """(raw, stored) bytes a page was counted with when written: from `page_sizes`, or
    recovered from the record itself for pages written before that database existed."""
    raw = txn.get(digest, db=dbs["page_sizes"])
    return SIZES.unpack(raw) if raw is not None else accounted_nbytes(value)


def _forget_page_bytes(txn, dbs, digest: bytes, value) -> None:
    raw_nbytes, stored_nbytes = page_sizes(txn, dbs, digest, value)
    _counter(txn, dbs, "raw_nbytes", -raw_nbytes)
    _counter(txn, dbs, "stored_nbytes", -stored_nbytes)


def _delete_page(txn, dbs, digest: bytes) -> int:
    """Remove one page and its grace time; returns stored bytes freed."""
    value = txn.get(digest, db=dbs["pages"])
    if value is None:
        return 0
    freed = len(value)
    _forget_page_bytes(txn, dbs, digest, value)  # reads value before it modifies anything
    txn.delete(digest, db=dbs["pages"])
    txn.delete(digest, db=dbs["page_sizes"])
    txn.delete(digest, db=dbs["page_times"])
    return freed


def _raw_nbytes_of(txn, dbs, digest: bytes) -> int:
    value = txn.get(digest, db=dbs["pages"])
    return page_sizes(txn, dbs, digest, value)[0] if value is not None else 0


def _add_ref(txn, dbs, digest: bytes, delta: int) -> int:
    _counter(txn, dbs, "referenced_raw_nbytes", delta * _raw_nbytes_of(txn, dbs, digest))
    return _add_u64(txn, dbs["refs"], digest, delta)


def _insert_block(txn, dbs, record: BlockRecord) -> None:
    txn.put(record.key, record.encode(), db=dbs["blocks"])
    txn.put(U64.pack(record.last_used_ns) + record.key, b"", db=dbs["lru"])
    if not record.is_root:
        txn.put(record.parent + record.key, b"", db=dbs["children"])
    for d in record.pages:
        _add_ref(txn, dbs, d, 1)


def _touch_block(txn, dbs, key: bytes, stamp: int) -> None:
    raw = txn.get(key, db=dbs["blocks"])
    if raw is None:
        return
    record = BlockRecord.decode(raw)
    if record.last_used_ns >= stamp:
        return
    txn.delete(U64.pack(record.last_used_ns) + key, db=dbs["lru"])
    txn.put(U64.pack(stamp) + key, b"", db=dbs["lru"])
    txn.put(key, record.with_times(record.created_ns, stamp).encode(), db=dbs["blocks"])


def _remove_block(txn, dbs, record: BlockRecord) -> tuple[int, int]:
    """Delete an unpinned leaf block; pages left with no reference go too.
    Returns (pages deleted, stored bytes freed)."""
    key = record.key
    assert txn.get(key, db=dbs["pins"]) is None, f"evicting pinned block {key.hex()}"
    txn.delete(key, db=dbs["blocks"])
    txn.delete(U64.pack(record.last_used_ns) + key, db=dbs["lru"])
    if not record.is_root:
        txn.delete(record.parent + key, db=dbs["children"])
    pages = freed = 0
    for d in record.pages:
        if _add_ref(txn, dbs, d, -1) == 0:
            freed += _delete_page(txn, dbs, d)
            pages += 1
    return pages, freed


def _evict_to(txn, dbs, target_nbytes: int, max_blocks: int | None = None) -> EvictionReport:
    stored = _get_u64(txn, dbs["meta"], b"stored_nbytes")
    if stored <= target_nbytes:
        return EvictionReport(0, 0, 0)
    heap = []
    with txn.cursor(db=dbs["lru"]) as cur:
        for key, _ in cur:
            stamp, chain = U64.unpack(key[:8])[0], bytes(key[8:])
            if txn.get(chain, db=dbs["pins"]) is None and not _has_children(txn, dbs, chain):
                heap.append((stamp, chain))
    heapq.heapify(heap)
    blocks = pages = freed = 0
    while heap and stored > target_nbytes and (max_blocks is None or blocks < max_blocks):
        _, chain = heapq.heappop(heap)
        record = BlockRecord.decode(txn.get(chain, db=dbs["blocks"]))
        p, f = _remove_block(txn, dbs, record)
        blocks, pages, freed, stored = blocks + 1, pages + p, freed + f, stored - f
        parent = record.parent
        if (not record.is_root and txn.get(parent, db=dbs["pins"]) is None
                and not _has_children(txn, dbs, parent)):
            parent_record = BlockRecord.decode(txn.get(parent, db=dbs["blocks"]))
            heapq.heappush(heap, (parent_record.last_used_ns, parent))
    if blocks:
        _counter(txn, dbs, "evicted_blocks", blocks)
        _counter(txn, dbs, "evicted_nbytes", freed)
    return EvictionReport(blocks, pages, freed)


def _ckpt_fields(c: Checkpoint) -> dict:
    return {"name": c.name, "namespace": c.namespace, "format_id": c.format_id,
            "tokens": c.tokens, "chain_keys": c.chain_keys, "attachments": c.attachments,
            "metadata": c.metadata}


def _validate_checkpoint(txn, dbs, c: Checkpoint, identity: FormatIdentity) -> None:
    missing, parent, tokens = [], ROOT_KEY, []
    for k in c.chain_keys:
        raw = txn.get(k, db=dbs["blocks"])
        if raw is None:
            missing.append(f"block {k.hex()}")
            continue
        record = BlockRecord.decode(raw)
        if record.namespace != c.namespace:  # reads as absent: no cross-tenant oracle
            missing.append(f"block {k.hex()}")
            continue
        if record.format_id != c.format_id:
            raise InvalidInput(f"block {k.short} belongs to another format")
        if record.parent != parent:
            raise InvalidInput(f"block {k.short} does not follow the previous block in the chain")
        parent = k
        tokens.extend(record.tokens)
    for name, d in c.attachments.items():
        if txn.get(d, db=dbs["pages"]) is None:
            missing.append(f"attachment {name} page {d.hex()}")
    if missing:
        raise MissingReferences(f"checkpoint {c.namespace}/{c.name}", missing)
    if tuple(tokens) != tuple(c.tokens):
        raise InvalidInput(f"checkpoint {c.namespace}/{c.name}: its blocks hold {len(tokens)} tokens "
                           f"that are not the {len(c.tokens)} tokens it names")


def _unpin_checkpoint(txn, dbs, c: Checkpoint) -> None:
    for k in c.chain_keys:
        _add_u64(txn, dbs["pins"], k, -1)
    for d in c.attachments.values():
        _add_ref(txn, dbs, d, -1)
