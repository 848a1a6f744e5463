"""kvstore migrate: a schema-1 store (page bodies as LMDB values) to schema 2 (segment
files, docs/format.md section 10). plan_migration(path) -> MigrationPlan reads only and
says what will move and why it cannot; plan.execute() migrates, and resumes a migration
that was interrupted.

Phases of execute (every one survives a crash, see below):
  copy     in digest order, in batches of at most BATCH_PAGES pages / BATCH_NBYTES
           bytes: each v1 page value (its 48-byte header || stored bytes) is appended
           unchanged to a segment record (os.pwritev from the LMDB map: bytes 80.. of a
           record are a v1 page record, so every page stays byte-identical); the
           segments are fdatasync'ed; THEN one write transaction records the progress
           in meta `migration` (STATE_KEY, JSON: the last digest copied and the tail of
           every segment written). The store stays schema 1 through the whole copy:
           every `pages` value is still the v1 record, every reader of either version
           reads it as before, and the records are bytes only the migration state names.
  switch   one write transaction makes the records reachable: every `pages` value
           becomes its record's 24-byte location, quarantined copies become locations,
           a `segment_tail/XXXXXXXX` key is set for every segment, a page older than the
           `page_sizes` database gets the entry schema 1 counted it by, records no entry names
           (pages deleted between two runs) go to `dead_records` for GC, schema_version
           becomes 2 and the migration state goes. The v1 bodies are freed in the same
           commit (LMDB's free list: data.mdb keeps its size). Before it, every page
           entry is matched against the records found by scanning the segments up to
           the committed tails (the record's page header must be the v1 header, byte for
           byte); pages without one (written, or changed, since they were copied) are
           copied and synced first. The switch re-checks this inside its transaction.
  compact  optional, default on: the environment is copied with compaction
           (env.copy(compact=True)) inside a write transaction, so no writer commits
           meanwhile, into <store>/migrate-compact.tmp/, fsync'ed and renamed over
           data.mdb (then the directory is fsync'ed). Skipped, and said, when another
           process has the store open or the disk cannot hold the copy: the store is
           complete at schema 2 without it, and LMDB reuses the freed pages for the index.

Why one switch rather than rebinding in batches: a store rebound in batches is a mix of
v1 records and locations that every reader (Store, check, GC, the tools) would have to
tell apart by the migration's cursor, and a crash would leave a store that no schema
describes. The bytes and the syncs are the copy's, and the copy is batched; the switch
writes 24-byte values (about 64 bytes of B-tree leaf per page) and frees the bodies.

A crash leaves: during copy, a schema-1 store (migration state in meta, segment bytes it
names, maybe bytes past its tails that the next run overwrites: SegmentFiles.prepare);
during the switch, that or a complete schema-2 store; during compaction, a complete
schema-2 store (old or compacted data.mdb) and maybe a stale temporary directory that
the next run removes. Each opens and checks clean. Running migrate again resumes.

Exclusion: execute holds <store>/segments.lock (the schema-2 writer lock) and gc.lock,
and refuses while another process has the LMDB environment open (EnvLockProbe: LMDB's
own lock on lock.mdb): such a process would go on reading the store as the version it
opened. The compaction's rename happens while new openers wait in LMDB's open.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore import fileio
from kvstore.errors import KVStoreError, NotFound, StoreCorrupt, StoreIOError, UnsupportedVersion
from kvstore.index import DEAD_KEY, DEAD_VALUE, SIZES, TAIL_PREFIX, U64
from kvstore.lmdbenv import DEFAULT_RESERVE_NBYTES, META_RECORD, LmdbEnv
from kvstore.pages import HEADER_NBYTES, accounted_nbytes, trusted_header, verify_stored
from kvstore.segments import (
    MIN_SEGMENT_NBYTES,
    PAGE_VALUE_AT,
    RECORD_HEADER_NBYTES,
    Location,
    PendingRecord,
    SegmentFiles,
    align_up,
    parse_record_header,
)

FROM_VERSION = 1
TO_VERSION = 2
STATE_KEY = b"migration"
SEGMENTS_DIR = "segments"
COMPACT_DIR = "migrate-compact.tmp"
BATCH_PAGES = 4096
BATCH_NBYTES = 256 << 20
SEGMENT_NBYTES = 256 << 20          # the store's default (docs/format.md section 10)
SWITCH_ATTEMPTS = 3

REFUSAL_KINDS = {
    "newer_version": "the store's schema is newer than this code knows",
    "damaged_header": "page records whose header is damaged: their length cannot be read",
    "foreign_segments": "segment files that no migration state names",
    "in_use": "another process has the store open",
    "busy": "another migration, save or GC holds the store's lock",
    "changed": "the store changed under the migration (its schema, or its pages kept changing)",
    "no_space": "the disk cannot hold the segment files",
}


class MigrationRefused(KVStoreError):
    """The migration cannot run now (Refusal.kind says why: REFUSAL_KINDS); nothing was
    changed by the step refused. Never crosses HTTP (the CLI's edge maps `kind` to an
    exit code); it belongs in kvstore/errors.py once that file's owner takes it."""

    code = "migration_refused"

    def __init__(self, message: str, kind: str = "busy"):
        assert kind in REFUSAL_KINDS, f"unregistered refusal kind {kind}"
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Refusal:
    kind: str
    message: str

    def __post_init__(self):
        assert self.kind in REFUSAL_KINDS, f"unregistered refusal kind {self.kind}"


@dataclass
class MigrationState:
    """The progress of an interrupted migration (meta STATE_KEY), explicit so that a
    resumed run never infers it from what the values look like."""

    cursor: bytes | None = None                        # the last digest copied
    tails: dict[int, int] = field(default_factory=dict)  # segment -> bytes the copy wrote
    pages_copied: int = 0
    nbytes_copied: int = 0
    started_ns: int = 0

    def encode(self) -> bytes:
        return json.dumps({
            "to_version": TO_VERSION, "cursor": self.cursor.hex() if self.cursor else None,
            "tails": {str(s): t for s, t in sorted(self.tails.items())},
            "pages_copied": self.pages_copied, "nbytes_copied": self.nbytes_copied,
            "started_ns": self.started_ns}, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw) -> "MigrationState":
        doc = json.loads(bytes(raw))
        if doc.get("to_version") != TO_VERSION:
            raise UnsupportedVersion(f"the store holds the state of a migration to schema "
                                     f"{doc.get('to_version')!r}; this code migrates to "
                                     f"{TO_VERSION}. Use the code that started it")
        cursor = doc["cursor"]
        return cls(bytes.fromhex(cursor) if cursor else None,
                   {int(s): int(t) for s, t in doc["tails"].items()},
                   int(doc["pages_copied"]), int(doc["nbytes_copied"]), int(doc["started_ns"]))


@dataclass
class MigrationPlan:
    """What a migration of the store at `path` does; see the module docstring. A plan
    with refusals is not executed; one with nothing_to_do (already schema 2) only
    removes a stale compaction directory."""

    path: Path
    schema_version: int
    pages: int = 0                 # page entries in the store
    pages_left: int = 0            # not yet copied (all of them on a first run)
    stored_nbytes: int = 0         # 48 + stored bytes of every page (the counters' rule)
    left_nbytes: int = 0           # 48 + stored bytes of the pages not yet copied
    copy_nbytes: int = 0           # segment bytes still to write (records' spans)
    quarantined: int = 0
    free_nbytes: int = 0
    need_nbytes: int = 0
    data_file_nbytes: int = 0
    resume: MigrationState | None = None
    refusals: list[Refusal] = field(default_factory=list)

    @property
    def nothing_to_do(self) -> bool:
        return self.schema_version == TO_VERSION

    @property
    def ok(self) -> bool:
        return not self.refusals

    def summary(self) -> dict:
        return {
            "store": str(self.path), "schema_version": self.schema_version,
            "to_version": TO_VERSION, "nothing_to_do": self.nothing_to_do,
            "pages": self.pages, "pages_left": self.pages_left,
            "stored_nbytes": self.stored_nbytes, "left_nbytes": self.left_nbytes,
            "copy_nbytes": self.copy_nbytes,
            "quarantined": self.quarantined, "free_nbytes": self.free_nbytes,
            "need_nbytes": self.need_nbytes, "data_file_nbytes": self.data_file_nbytes,
            "resumes": self.resume is not None,
            "pages_copied": self.resume.pages_copied if self.resume else 0,
            "refusals": [{"kind": r.kind, "message": r.message} for r in self.refusals],
        }

    def execute(self, progress=None, *, compact: bool = True, batch_pages: int = BATCH_PAGES,
                batch_nbytes: int = BATCH_NBYTES, segment_nbytes: int = SEGMENT_NBYTES) -> dict:
        """Migrate (see the module docstring); progress(pages, nbytes) after each batch.
        Raises MigrationRefused when the plan has refusals or a check made again under
        the locks fails. Returns what was done."""
        if self.refusals:
            raise MigrationRefused(self.refusals[0].message, self.refusals[0].kind)
        if self.nothing_to_do:
            shutil.rmtree(self.path / COMPACT_DIR, ignore_errors=True)
            return {"migrated": False, "pages": 0}
        with _locked(self.path):
            return _Migration(self, progress, batch_pages, batch_nbytes, segment_nbytes).run(compact)


def plan_migration(path, *, segment_nbytes: int = SEGMENT_NBYTES) -> MigrationPlan:
    """Read the store at `path` (never writing) and say what a migration would do."""
    path = Path(path)
    if not (path / "data.mdb").is_file():
        raise NotFound(f"no store at {path} (no data.mdb)")
    probe = EnvLockProbe(path)
    env = None
    try:
        env = LmdbEnv(path, readonly=True)
        with env.read() as txn:
            raw = txn.get(META_RECORD, db=env.dbs["meta"])
        version = U64.unpack(raw)[0] if raw is not None else 0
        plan = MigrationPlan(path, version, data_file_nbytes=(path / "data.mdb").stat().st_size)
        if version > TO_VERSION:
            plan.refusals.append(Refusal("newer_version", (
                f"store at {path} has schema version {version}; this code knows up to "
                f"{TO_VERSION} and migrates only from {FROM_VERSION}. Upgrade mlx-kvstore")))
            return plan
        if version == TO_VERSION:
            return plan
        if version != FROM_VERSION:  # 0, or absent: damage, never guessed to be a version
            raise StoreCorrupt(f"store at {path} is damaged: its schema_version is {version}, "
                               "which no code wrote; nothing was written. See "
                               "docs/reliability.md ('A store refused as damaged')")
        _plan_pages(env, plan, segment_nbytes)
        holder = probe.holder()
        if holder is not None:
            plan.refusals.append(_in_use(path, holder))
    finally:
        if env is not None:
            env.close()
        probe.close()
    segments = SegmentFiles(path / SEGMENTS_DIR, readonly=True).segments()
    if segments and plan.resume is None:
        plan.refusals.append(Refusal("foreign_segments", (
            f"{path / SEGMENTS_DIR} holds {len(segments)} segment file(s) but the store "
            "records no migration in progress: they are not this migration's. Move them "
            "out of the store directory, then run `kvstore migrate` again")))
    plan.free_nbytes = _fs_free(path)
    if plan.need_nbytes > plan.free_nbytes:
        plan.refusals.append(Refusal("no_space", (
            f"the migration needs {plan.need_nbytes} bytes free on the store's filesystem "
            f"(segment files for {plan.pages_left} pages, their preallocation and the "
            f"store's reserve) and {plan.free_nbytes} are free; nothing was written. Free "
            "space, then run `kvstore migrate` again")))
    return plan


def _plan_pages(env: LmdbEnv, plan: MigrationPlan, segment_nbytes: int) -> None:
    damaged = []
    with env.read(buffers=True) as txn:
        raw_state = txn.get(STATE_KEY, db=env.dbs["meta"])
        plan.resume = MigrationState.decode(raw_state) if raw_state is not None else None
        cursor = plan.resume.cursor if plan.resume else None
        for key, value in txn.cursor(db=env.dbs["pages"]):
            plan.pages += 1
            plan.stored_nbytes += len(value)
            if trusted_header(value) is None:
                damaged.append(bytes(key).hex())
            elif cursor is None or bytes(key) > cursor:
                plan.pages_left += 1
                plan.left_nbytes += len(value)
                plan.copy_nbytes += align_up(RECORD_HEADER_NBYTES + len(value) - HEADER_NBYTES)
        plan.quarantined = txn.stat(env.dbs["quarantine"])["entries"]
    if damaged:
        plan.refusals.append(Refusal("damaged_header", (
            f"{len(damaged)} page record(s) have a damaged header (first: {damaged[0]}), so "
            "their length cannot be read and migrate will not guess it; nothing was written. "
            "`kvstore check` lists them. Delete or evict what names them with the previous "
            "mlx-kvstore and `kvstore gc --grace 0`, or restore the store from a backup")))
    slack = min(segment_nbytes, plan.copy_nbytes)  # the last segment's preallocation
    plan.need_nbytes = plan.copy_nbytes + slack + DEFAULT_RESERVE_NBYTES if plan.pages_left else 0


class _Migration:
    """One execute(): the copy, the switch, the compaction (module docstring)."""

    def __init__(self, plan: MigrationPlan, progress, batch_pages: int, batch_nbytes: int,
                 segment_nbytes: int):
        self.plan, self.progress = plan, progress
        self.batch_pages, self.batch_nbytes = batch_pages, batch_nbytes
        self.segment_nbytes = segment_nbytes
        self.result = {"migrated": True, "pages": 0, "copied_pages": 0, "copied_nbytes": 0,
                       "resumed": False, "damaged_pages": [], "dead_records": 0,
                       "quarantined": 0, "dropped_quarantined": 0, "compacted": False,
                       "compact_note": None,
                       "data_file_nbytes_before": plan.data_file_nbytes}

    def run(self, compact: bool) -> dict:
        path = self.plan.path
        self.probe = EnvLockProbe(path)
        env = None
        try:
            holder = self.probe.holder()
            if holder is not None:
                raise MigrationRefused(_in_use(path, holder).message, "in_use")
            env = LmdbEnv(path)
            state = self._state(env)
            files = SegmentFiles(path / SEGMENTS_DIR, self.segment_nbytes,
                                 first_segment_nbytes=min(MIN_SEGMENT_NBYTES, self.segment_nbytes))
            try:
                files.prepare(state.tails)  # bytes past the tails: a crashed run's, overwritten
                self._copy(env, files, state)
                self._switch(env, files, state)
            finally:
                files.close()
            if compact:
                self._compact(env)
        finally:
            if env is not None:
                env.close()  # releases the probe's exclusion too (POSIX locks)
            self.probe.close()
        self.result["data_file_nbytes_after"] = (path / "data.mdb").stat().st_size
        return self.result

    # -- state -------------------------------------------------------------------------
    def _state(self, env: LmdbEnv) -> MigrationState:
        with env.read() as txn:
            raw_version = txn.get(META_RECORD, db=env.dbs["meta"])
            raw = txn.get(STATE_KEY, db=env.dbs["meta"])
        version = U64.unpack(raw_version)[0]
        if version != FROM_VERSION:
            raise MigrationRefused(f"store at {self.plan.path} is at schema version {version} "
                                   "now, not the 1 it was planned at; plan again", "changed")
        if raw is not None:
            self.result["resumed"] = True
            return MigrationState.decode(raw)
        if SegmentFiles(self.plan.path / SEGMENTS_DIR, readonly=True).segments():
            raise MigrationRefused(f"{self.plan.path / SEGMENTS_DIR} holds segment files no "
                                   "migration state names; move them out and plan again",
                                   "foreign_segments")
        return MigrationState(started_ns=time.time_ns())

    def _commit_state(self, env: LmdbEnv, state: MigrationState) -> None:
        raw = state.encode()
        env.write(lambda txn, dbs: txn.put(STATE_KEY, raw, db=dbs["meta"]),
                  what="recording migration progress")

    # -- copy --------------------------------------------------------------------------
    def _copy(self, env: LmdbEnv, files: SegmentFiles, state: MigrationState) -> None:
        while True:
            with env.read(buffers=True) as txn:
                batch = self._next_batch(txn, env.dbs, state.cursor)
                if not batch:
                    return
                locations = files.append([p for p, _ in batch])  # from the map: no copy
            files.sync()  # durable BEFORE the commit that names them
            nbytes = sum(n for _, n in batch)
            for loc in locations:
                state.tails[loc.segment] = max(state.tails.get(loc.segment, 0), loc.end)
            state.cursor = batch[-1][0].digest
            state.pages_copied += len(batch)
            state.nbytes_copied += nbytes
            self._commit_state(env, state)
            self.result["copied_pages"] += len(batch)
            self.result["copied_nbytes"] += nbytes
            if self.progress:
                self.progress(len(batch), nbytes)

    def _next_batch(self, txn, dbs, cursor: bytes | None) -> list[tuple[PendingRecord, int]]:
        batch, nbytes = [], 0
        with txn.cursor(db=dbs["pages"]) as cur:
            if not cur.set_range(cursor or b""):
                return batch
            for key, value in cur.iternext():
                key = bytes(key)
                if cursor is not None and key <= cursor:
                    continue
                if batch and (len(batch) >= self.batch_pages or nbytes + len(value) > self.batch_nbytes):
                    break
                batch.append((self._pending(key, value), len(value)))
                nbytes += len(value)
        return batch

    def _pending(self, digest: bytes, value) -> PendingRecord:
        """A v1 page value as a segment record, unchanged. A page that fails its check
        is carried as it is (a read at schema 2 quarantines it, as at schema 1), and
        named in the result (pages copied by this run); a header that cannot be read is
        refused (the plan said so first)."""
        if trusted_header(value) is None:
            raise MigrationRefused(f"page {digest.hex()}'s record header is damaged; its "
                                   "length cannot be read. Plan again to see what to do",
                                   "damaged_header")
        try:
            verify_stored(value, digest)
        except ValueError as exc:
            self.result["damaged_pages"].append({"digest": digest.hex(), "problem": str(exc)})
        view = memoryview(value)
        return PendingRecord(digest, bytes(view[:HEADER_NBYTES]), view[HEADER_NBYTES:])

    # -- switch ------------------------------------------------------------------------
    def _switch(self, env: LmdbEnv, files: SegmentFiles, state: MigrationState) -> None:
        env.create_schema2_databases()
        for _ in range(SWITCH_ATTEMPTS):
            records = self._scan(files, state.tails)
            pages, quarantined = self._v1_entries(env)
            extra = self._catch_up(env, files, state, records, pages, quarantined)
            try:
                done = env.write(lambda txn, dbs, records=records, extra=extra:
                                 self._rebind(txn, dbs, state, records, extra),
                                 what="switching the store to schema version 2", freeing=True,
                                 buffers=True)  # headers only: never copy a page body
            except _Changed:
                continue  # a page changed between the scan and the transaction: again
            self.result.update(done)
            return
        raise MigrationRefused(f"the pages of {self.plan.path} kept changing during the switch "
                               "to schema 2: stop every process that writes to it, then run "
                               "`kvstore migrate` again (the copy is kept)", "changed")

    def _scan(self, files: SegmentFiles, tails: dict[int, int]) -> dict[bytes, tuple]:
        """digest -> (location, page header bytes) of every intact record below the
        committed tails; a digest met twice keeps its first record (the rest die)."""
        records: dict[bytes, tuple] = {}
        self._unnamed: list[Location] = []
        for segment, tail in sorted(tails.items()):
            for rec in files.scan(segment, tail, verify=False):
                probe = Location(segment, rec.offset, rec.length)
                digest, header = parse_record_header(files.view(probe))
                loc = Location(segment, rec.offset, rec.length, header.codec)
                if digest in records:
                    self._unnamed.append(loc)
                else:
                    records[digest] = (loc, header.pack())
        return records

    @staticmethod
    def _v1_entries(env: LmdbEnv) -> tuple[dict[bytes, bytes], dict[bytes, bytes | None]]:
        """digest -> v1 page header of every page; digest -> header of every quarantined
        copy (None when its header cannot be read)."""
        with env.read(buffers=True) as txn:
            pages = {bytes(k): bytes(v[:HEADER_NBYTES])
                     for k, v in txn.cursor(db=env.dbs["pages"])}
            quarantined = {bytes(k): (bytes(v[:HEADER_NBYTES]) if trusted_header(v) else None)
                           for k, v in txn.cursor(db=env.dbs["quarantine"])}
        return pages, quarantined

    def _catch_up(self, env, files, state, records, pages, quarantined) -> dict[bytes, Location]:
        """Copy, and sync, the pages with no matching record (written or changed since
        they were copied) and the quarantined copies; digest -> location of the
        quarantined ones (pages' go into `records`)."""
        todo = [d for d, header in pages.items() if records.get(d, (None, None))[1] != header]
        todo_q = [d for d, header in quarantined.items() if header is not None]
        extra: dict[bytes, Location] = {}
        if not todo and not todo_q:
            return extra
        with env.read(buffers=True) as txn:
            wanted = ([(d, txn.get(d, db=env.dbs["pages"]), False) for d in todo]
                      + [(d, txn.get(d, db=env.dbs["quarantine"]), True) for d in todo_q])
            # a deleted page is skipped; a damaged header refuses in _pending (never guessed)
            wanted = [w for w in wanted if w[1] is not None and (not w[2] or trusted_header(w[1]))]
            pending = [PendingRecord(d, bytes(v[:HEADER_NBYTES]), memoryview(v)[HEADER_NBYTES:])
                       if is_copy else self._pending(d, v) for d, v, is_copy in wanted]
            locations = files.append(pending)
        files.sync()  # durable before the switch names them
        for (d, _, is_copy), rec, loc in zip(wanted, pending, locations, strict=True):
            state.tails[loc.segment] = max(state.tails.get(loc.segment, 0), loc.end)
            if is_copy:
                extra[d] = loc
                continue
            if d in records:
                self._unnamed.append(records[d][0])
            records[d] = (loc, rec.page_header)
        return extra

    def _rebind(self, txn, dbs, state: MigrationState, records: dict, quarantine_locs: dict) -> dict:
        """The switch transaction (fn of LmdbEnv.write: may run again from scratch). Its
        values are views valid until the first put: every one is read first."""
        pages, sizes = {}, {}
        for key, value in txn.cursor(db=dbs["pages"]):
            digest = bytes(key)
            pages[digest] = bytes(value[:HEADER_NBYTES])
            if txn.get(digest, db=dbs["page_sizes"]) is None:
                # a page older than page_sizes: schema 2 needs its entry, and this is
                # what schema 1 counted it as (StoreIndex.page_sizes' fallback)
                sizes[digest] = SIZES.pack(*accounted_nbytes(value))
        quarantined = [bytes(k) for k in txn.cursor(db=dbs["quarantine"]).iternext(values=False)]
        for digest, header in pages.items():
            rec = records.get(digest)
            if rec is None or rec[1] != header:
                raise _Changed()
        for digest, raw in sizes.items():
            txn.put(digest, raw, db=dbs["page_sizes"])
        named = set()
        for digest in pages:
            loc = records[digest][0]
            txn.put(digest, loc.pack(), db=dbs["pages"])
            named.add((loc.segment, loc.offset))
        dropped = 0
        for digest in quarantined:
            loc = quarantine_locs.get(digest)
            if loc is None:
                txn.delete(digest, db=dbs["quarantine"])  # its header cannot be read
                dropped += 1
            else:
                txn.put(digest, loc.pack(), db=dbs["quarantine"])
                named.add((loc.segment, loc.offset))
        dead = [loc for digest, (loc, _) in records.items() if digest not in pages]
        dead += self._unnamed
        now = time.time_ns()
        dead_count = 0
        for loc in dead:
            if (loc.segment, loc.offset) not in named:
                txn.put(DEAD_KEY.pack(loc.segment, loc.offset), DEAD_VALUE.pack(loc.length, now),
                        db=dbs["dead_records"])
                dead_count += 1
        for segment, tail in state.tails.items():
            txn.put(TAIL_PREFIX + f"{segment:08x}".encode(), U64.pack(tail), db=dbs["meta"])
        txn.put(META_RECORD, U64.pack(TO_VERSION), db=dbs["meta"])
        txn.delete(STATE_KEY, db=dbs["meta"])
        return {"pages": len(pages), "sizes_added": len(sizes), "quarantined": len(quarantine_locs),
                "dropped_quarantined": dropped, "dead_records": dead_count,
                "segments": len(state.tails)}

    # -- compaction --------------------------------------------------------------------
    def _compact(self, env: LmdbEnv) -> None:
        path = self.plan.path
        tmp = path / COMPACT_DIR
        shutil.rmtree(tmp, ignore_errors=True)
        need = env.used_nbytes() - env.free_in_file_nbytes()
        if _fs_free(path) < need + DEFAULT_RESERVE_NBYTES:
            self.result["compact_note"] = (f"skipped: the disk cannot hold a {need}-byte "
                                           "compacted copy; LMDB reuses the freed pages")
            return
        raw = env.env
        txn = raw.begin(write=True)  # no other writer commits while the copy is made
        try:
            holder = self.probe.holder()
            if holder is not None or not self.probe.exclude():
                self.result["compact_note"] = (f"skipped: process {holder} has the store open; "
                                               "LMDB reuses the freed pages")
                return
            tmp.mkdir()
            raw.copy(str(tmp), compact=True, txn=txn)
            fd = os.open(tmp / "data.mdb", os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp / "data.mdb", path / "data.mdb")
            _fsync_dir(path)
            self.result["compacted"] = True
        except OSError as exc:
            raise StoreIOError(f"compacting {path}/data.mdb failed ({exc}); the store is "
                               "complete at schema 2 without it") from None
        finally:
            txn.abort()
            shutil.rmtree(tmp, ignore_errors=True)


class _Changed(Exception):
    """Raised inside the switch transaction (aborting it) when a page is not as scanned."""


class EnvLockProbe:
    """Who else has the store's LMDB environment open. LMDB holds a POSIX read lock on
    byte 0 of lock.mdb in every process, for as long as the environment is open
    (mdb_env_setup_locks); F_GETLK names another process's lock, never this one's.
    exclude() upgrades this process's lock to a write lock: a process that opens the
    environment then waits in LMDB's own open until ours closes (LMDB takes that lock
    before it opens data.mdb), which is what the compaction's rename needs.

    POSIX locks go when ANY descriptor of the file is closed in the process, so the
    probe is opened before this process's LmdbEnv and closed after it is closed, and a
    process that holds the store open itself (a Store object) must not migrate it."""

    _FLOCK = "hh4xqqi4x"  # struct flock on Linux (x86_64, aarch64): type, whence, start, len, pid

    def __init__(self, path: Path):
        self.fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                          0o644)

    def holder(self) -> int | None:
        """The pid of a process other than this one with the environment open, or None."""
        query = struct.pack(self._FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
        kind, _, _, _, pid = struct.unpack(self._FLOCK, fcntl.fcntl(self.fd, fcntl.F_GETLK, query))
        return None if kind == fcntl.F_UNLCK else pid

    def exclude(self) -> bool:
        """Hold byte 0 exclusively until the environment closes; False when another
        process has it open."""
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETLK,
                        struct.pack(self._FLOCK, fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0))
        except (BlockingIOError, PermissionError):
            return False
        return True

    def close(self) -> None:
        os.close(self.fd)


def _in_use(path: Path, pid: int) -> Refusal:
    return Refusal("in_use", (
        f"store at {path} is open in process {pid} (and maybe others: a server, an "
        "engine or another command); stop them, then run `kvstore migrate` again. A process "
        "that opened it at schema 1 would read the migrated store as damaged"))


class _locked:
    """Exclusive, non-blocking flocks on <store>/segments.lock (the schema-2 writer
    lock) and gc.lock for the whole of execute."""

    def __init__(self, path: Path):
        self.path, self.fds = path, []

    def __enter__(self):
        for name in ("segments.lock", "gc.lock"):
            fd = fileio.open_lock(self.path / name)
            self.fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.__exit__()
                raise MigrationRefused(f"{self.path / name} is held by another process (a "
                                       "migration, save or GC); wait for it, then run "
                                       "`kvstore migrate` again") from None
        return self

    def __exit__(self, *exc):
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _fs_free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


assert PAGE_VALUE_AT + HEADER_NBYTES == RECORD_HEADER_NBYTES  # bytes 80.. are the v1 value

__all__ = ["plan_migration", "MigrationRefused", "MigrationPlan", "MigrationState", "Refusal", "REFUSAL_KINDS",
           "STATE_KEY", "EnvLockProbe"]
