"""Garbage collection: plan_gc(store, grace) -> GCPlan; plan.execute() deletes.

What is garbage:
  unreferenced pages   no block record or checkpoint names them (no `refs` entry) and
                       their grace time (last upload or dedup hit, `page_times`) is
                       older than the grace period;
  orphans              quarantined page copies, and `page_times` entries whose page
                       is gone;
  dead records         (schema 2) segment records no page names any more: their page
                       was deleted (by this GC, eviction, or an earlier GC), or their
                       quarantine entry forgotten. Once a record has been dead for the
                       grace period, execute() frees its span by hole punching
                       (kvstore/segments.py punch) and then drops its dead_records entry.
                       A record that died in this very run waits for the next one unless
                       the grace is 0.
  mostly-dead segments (schema 2) a segment whose live records (those a page names) span
                       less than compact_below (default 0.25) of its committed tail,
                       other than the highest one (where saves append) and one already
                       retired. execute() compacts it (compact_segment): under the
                       writer lock (kvstore/segments.py writer_lock: the flock on
                       <store>/segments.lock that put_pages takes), each live record is verified as a read verifies it,
                       copied to the append position, fdatasync'ed, and then one index
                       transaction rebinds the pages still there to their copies, makes
                       the old records dead and marks the segment retired (with the
                       time). A record that fails verification is quarantined, as a
                       read would, never copied. A segment retired for longer than the
                       grace period has its file removed (then its tail, retired mark
                       and dead records are forgotten); one this run retired waits for
                       the next run unless the grace is 0.

Why it is safe while writers run:
  - a page uploaded but not yet committed is younger than the grace period;
  - a writer that dedups against a stored page calls missing(), which refreshes the
    page's grace time, so a sweep that planned to delete it skips it;
  - execute() re-checks every candidate inside each delete transaction (still no
    reference, still older than the grace period) before deleting it;
  - a GC that has run (or been paused) for longer than its grace period aborts with
    GCAborted instead of deleting, because its view may be older than a writer's
    upload-to-commit window;
  - one GC at a time per store: an exclusive flock on <store>/gc.lock;
  - a dead record is punched only after it has been dead for the grace period, so a
    reader that resolved its location before the page was deleted (a restore that
    looked the prefix up just before an eviction) has long finished with the bytes;
    segment offsets below a committed tail are never written again, so a punched
    span never held anyone else's record;
  - a compacted segment's file stays for the grace period after no page names it: a
    reader that resolved a location in it just before the rebind (or that maps it
    since) reads the old, intact copy; a view already taken stays valid even after
    the file is removed (an unlinked file lives while it is mapped). Segment ids are
    never reused (a new segment takes the highest file's id + 1, and the highest
    segment is never compacted);
  - crashes: copies made before the rebind commit lie past the committed tail
    (unreachable, overwritten by the next append, as a crashed save's); after it, the
    retired segment is removed by a later GC; a crash between the file's removal and
    the index's forgetting it is finished by the next GC (removal is idempotent).
A writer whose pages were nonetheless collected (it paused between upload and commit
for longer than the grace period) gets MissingReferences from commit and re-uploads;
it never commits a record whose pages are absent.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field

from kvstore import faults, fileio
from kvstore.errors import GCAborted, InvalidInput
from kvstore.index import SCHEMA_V2, StoreIndex
from kvstore.segments import Location, PendingRecord, writer_lock

BATCH = 256
DEFAULT_COMPACT_BELOW = 0.25  # compact a segment whose live records span less than this
COMPACT_BATCH_NBYTES = 64 << 20  # live bytes copied per sync + rebind commit at most
HISTORY_KEY = b"gc_history"
HISTORY_LENGTH = 50


@dataclass(frozen=True)
class GCCandidate:
    digest: bytes
    stored_nbytes: int
    age_s: float


@dataclass
class GCPlan:
    store: object  # a kvstore.store.Store: its path and index
    grace_s: float
    planned_at: float
    planned_at_ns: int
    pages: list[GCCandidate] = field(default_factory=list)
    quarantined: list[bytes] = field(default_factory=list)
    stale_times: list[bytes] = field(default_factory=list)
    dead_records: list = field(default_factory=list)  # (Location, ns it died), schema 2
    compact_below: float = DEFAULT_COMPACT_BELOW
    compactions: list["CompactionCandidate"] = field(default_factory=list)  # schema 2
    retired: list[tuple[int, int]] = field(default_factory=list)  # (segment, ns retired)

    @property
    def freed_nbytes(self) -> int:
        return sum(c.stored_nbytes for c in self.pages)

    def summary(self) -> dict:
        return {
            "grace_s": self.grace_s,
            "unreferenced_pages": len(self.pages),
            "unreferenced_nbytes": self.freed_nbytes,
            "quarantined_pages": len(self.quarantined),
            "stale_time_entries": len(self.stale_times),
            "dead_records": len(self.dead_records),
            "dead_nbytes": sum(loc.span_nbytes for loc, _ in self.dead_records),
            "compact_segments": len(self.compactions),
            "compact_live_nbytes": sum(c.live_nbytes for c in self.compactions),
            "compact_tail_nbytes": sum(c.tail_nbytes for c in self.compactions),
            "retired_segments": len(self.retired),
        }

    def execute(self, progress=None) -> dict:
        """Delete the plan's garbage in batches, re-checking each candidate. Raises
        GCAborted when another GC holds the lock or when the plan is older than its
        grace period. Returns what was deleted."""
        lock_path = self.store.path / "gc.lock"
        fd = fileio.open_lock(lock_path)  # never follows a planted symlink
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise GCAborted(f"another GC is running on {self.store.path}; try again later") from None
            return self._execute_locked(progress)
        finally:
            os.close(fd)

    def _check_fresh(self):
        # grace 0 means "collect everything unreferenced now": no window to protect.
        elapsed = time.monotonic() - self.planned_at
        if self.grace_s > 0 and elapsed > self.grace_s:
            raise GCAborted(
                f"the GC plan is {elapsed:.1f}s old, longer than its grace period of "
                f"{self.grace_s:.1f}s; nothing more was deleted. Plan again"
            )

    def _execute_locked(self, progress) -> dict:
        cutoff_ns = self.planned_at_ns - int(self.grace_s * 1e9)
        deleted = {"pages": 0, "freed_nbytes": 0, "skipped": 0, "quarantined": 0, "stale_times": 0}
        for start in range(0, len(self.pages), BATCH):
            self._check_fresh()
            batch = self.pages[start : start + BATCH]

            def sweep(index: StoreIndex, batch=batch):
                pages = freed = skipped = 0
                for c in batch:
                    if index.refs(c.digest) or index.page_time(c.digest) > cutoff_ns:
                        skipped += 1
                        continue
                    n = index.delete_page(c.digest)
                    pages, freed = pages + (1 if n else 0), freed + n
                return pages, freed, skipped
            pages, freed, skipped = self.store.index.write(sweep, what="GC delete", buffers=True,
                                                           freeing=True)
            faults.crash_point("gc_deleted")
            deleted["pages"] += pages
            deleted["freed_nbytes"] += freed
            deleted["skipped"] += skipped
            if progress:
                progress(len(batch), sum(c.stored_nbytes for c in batch))
        self._check_fresh()

        def orphans(index: StoreIndex):
            q = sum(1 for d in self.quarantined if index.forget_quarantined(d))
            s = sum(1 for d in self.stale_times if index.forget_page_time(d))
            _append_history(index, {**deleted, "quarantined": q, "stale_times": s,
                                    "at_ns": time.time_ns(), "grace_s": self.grace_s})
            return q, s
        deleted["quarantined"], deleted["stale_times"] = self.store.index.write(
            orphans, what="GC orphans", freeing=True)
        if self.store.index.schema == SCHEMA_V2:
            self._check_fresh()
            deleted.update(self._punch_dead())
            deleted.update(self._compact())
        return deleted

    def _compact(self) -> dict:
        """Compact the planned segments (each re-examined under the writer lock), then
        remove the files of segments retired for longer than the grace period (listed
        after the compactions: with grace 0 this run's go at once)."""
        done = {"compacted_segments": 0, "relocated_records": 0, "relocated_nbytes": 0,
                "compaction_quarantined": 0, "removed_segments": 0, "removed_nbytes": 0}
        # listed again now: this run's deletes made segments mostly dead (the plan's
        # list counted them as deleted already; segments re-examined under the lock)
        with self.store.index.read() as index:
            candidates = compaction_candidates(index, self.compact_below)
        for candidate in candidates:
            self._check_fresh()
            result = compact_segment(self.store, candidate.segment, self.compact_below)
            if result is not None:
                done["compacted_segments"] += 1
                done["relocated_records"] += result.relocated
                done["relocated_nbytes"] += result.relocated_nbytes
                done["compaction_quarantined"] += result.quarantined
        cutoff_ns = time.time_ns() - int(self.grace_s * 1e9)
        with self.store.index.read() as index:
            due = sorted(seg for seg, ns in index.retired_segments().items() if ns <= cutoff_ns)
        for segment in due:
            done["removed_nbytes"] += remove_retired_segment(self.store, segment)
            done["removed_segments"] += 1
        return done

    def _punch_dead(self) -> dict:
        """Punch every record dead for longer than the grace period (listed now: those
        this run's deletes made count when the grace is 0), then forget their entries,
        in batches. Punch first: a crash in between leaves an entry whose span is
        already a hole, and punching it again is harmless."""
        cutoff_ns = time.time_ns() - int(self.grace_s * 1e9)
        segments = self.store.index.segments
        with self.store.index.read() as index:
            retired = index.retired_segments()  # their records go with the file
            due = [loc for loc, died in index.dead_records()
                   if died <= cutoff_ns and loc.segment not in retired]
        punched = nbytes = unpunched = 0
        for start in range(0, len(due), BATCH):
            batch = due[start : start + BATCH]
            done = []
            for loc in batch:
                if segments.file_nbytes(loc.segment) == 0 or segments.punch(loc):
                    done.append(loc)
                else:
                    unpunched += 1  # no hole punching here: the bytes stay, and the entry
            faults.crash_point("gc_punched")

            def forget(index: StoreIndex, done=done):
                return sum(1 for loc in done if index.forget_dead(loc))
            self.store.index.write(forget, what="GC dead records", freeing=True)
            punched += len(done)
            nbytes += sum(loc.span_nbytes for loc in done)
        return {"punched_records": punched, "punched_nbytes": nbytes,
                "unpunched_records": unpunched}


def plan_gc(store, grace_s: float = 3600.0, *,
            compact_below: float = DEFAULT_COMPACT_BELOW) -> GCPlan:
    """compact_below: compact a segment whose live records span less than this fraction
    of its committed tail (0 turns compaction off; 1 compacts every segment but the
    highest, which saves append to)."""
    if grace_s < 0:
        raise InvalidInput("grace period must be >= 0 seconds")
    if not 0.0 <= compact_below <= 1.0:
        raise InvalidInput(f"compact_below is a fraction in [0, 1], not {compact_below}")
    planned_ns = time.time_ns()
    plan = GCPlan(store, float(grace_s), time.monotonic(), planned_ns,
                  compact_below=float(compact_below))
    cutoff_ns = planned_ns - int(grace_s * 1e9)
    with store.index.read(buffers=True) as index:
        for digest, value in index.pages():
            if index.refs(digest):
                continue
            stamp = index.page_time(digest)
            if stamp > cutoff_ns:
                continue
            stored = index.page_sizes(digest, value)[1]
            plan.pages.append(GCCandidate(digest, stored, (planned_ns - stamp) / 1e9))
        plan.quarantined = sorted(index.quarantined())
        plan.stale_times = [d for d in index.page_time_digests() if not index.has_page(d)]
        if index.schema == SCHEMA_V2:
            retired = index.retired_segments()
            plan.dead_records = [(loc, died) for loc, died in index.dead_records()
                                 if died <= cutoff_ns and loc.segment not in retired]
            plan.retired = sorted(retired.items())
            plan.compactions = compaction_candidates(
                index, compact_below, deleting={c.digest for c in plan.pages})
    faults.crash_point("gc_listed")
    return plan


# -- compaction (schema 2) -------------------------------------------------------------
@dataclass(frozen=True)
class CompactionCandidate:
    segment: int
    live_records: int
    live_nbytes: int  # spans (padding included) of the records pages name
    tail_nbytes: int  # the segment's committed tail


@dataclass(frozen=True)
class CompactionResult:
    segment: int
    relocated: int  # records copied and rebound
    relocated_nbytes: int
    quarantined: int  # records that failed verification (quarantined, not copied)
    vanished: int  # pages deleted or quarantined meanwhile (their copies are dead)


def live_records_by_segment(index: StoreIndex, deleting: frozenset | set = frozenset()
                            ) -> dict[int, list[tuple[bytes, Location]]]:
    """segment -> (digest, location) of every page whose record lies in it (but the
    pages in `deleting`)."""
    out: dict[int, list[tuple[bytes, Location]]] = {}
    for digest, loc in index.locations():
        if loc is not None and digest not in deleting:
            out.setdefault(loc.segment, []).append((digest, loc))
    return out


def compaction_candidates(index: StoreIndex, compact_below: float, *,
                          deleting: frozenset | set = frozenset()) -> list[CompactionCandidate]:
    """Segments whose live spans are below compact_below of their committed tail; never
    the highest segment with a tail (saves append to it) nor a retired one. deleting:
    pages to count as gone (the plan's own deletes)."""
    tails = index.segment_tails()
    if not tails or compact_below <= 0:
        return []
    retired, current = index.retired_segments(), max(tails)
    live = live_records_by_segment(index, deleting)
    out = []
    for segment, tail in sorted(tails.items()):
        if segment == current or segment in retired or tail == 0:
            continue
        records = live.get(segment, [])
        nbytes = sum(loc.span_nbytes for _, loc in records)
        if nbytes < compact_below * tail:
            out.append(CompactionCandidate(segment, len(records), nbytes, tail))
    return out


def compact_segment(store, segment: int, compact_below: float = 1.0) -> CompactionResult | None:
    """Copy the live records of `segment` to the append position and retire it (the
    module docstring). Re-examined under the writer lock: None, changing nothing, when
    it is the highest segment, already retired, has no tail, or is no longer below
    compact_below. Raises what the appends and syncs raise (StoreFull, StoreIOError):
    nothing is then rebound, and the copies are unreachable bytes past the tail."""
    files = store.index.segments
    with writer_lock(store.path):  # the lock put_pages appends under
        with store.index.read() as index:
            tails = index.segment_tails()
            if (segment not in tails or segment == max(tails)
                    or segment in index.retired_segments()):
                return None
            moves = live_records_by_segment(index).get(segment, [])
        if sum(loc.span_nbytes for _, loc in moves) >= compact_below * tails[segment]:
            return None
        files.prepare(tails)  # resume at the committed tail, as a save does
        relocated = nbytes = quarantined = vanished = 0
        batches = _compaction_batches(moves) or [[]]
        for i, batch in enumerate(batches):
            pending, damaged = [], []
            for digest, loc in batch:
                try:
                    header, body = files.read_verified(loc, digest)
                except ValueError as exc:
                    damaged.append((digest, loc, str(exc)))
                    continue
                pending.append(((digest, loc), PendingRecord(digest, header.pack(), bytes(body))))
            new_locs = files.append([rec for _, rec in pending]) if pending else []
            faults.crash_point("gc_compact_written")
            files.sync()  # StoreIOError: nothing rebound
            faults.crash_point("gc_compact_synced")
            last = i == len(batches) - 1
            moved = [(d, old, new) for ((d, old), _), new in zip(pending, new_locs, strict=True)]

            def rebind(index: StoreIndex, moved=moved, damaged=damaged, last=last):
                now = index.clock()
                bound = gone = bad = 0
                new_tails: dict[int, int] = {}
                for digest, old, new in moved:
                    new_tails[new.segment] = max(new_tails.get(new.segment, 0), new.end)
                    if index.rebind_page(digest, old, new):
                        bound += 1
                        index.add_dead(old, now)  # named, so check sees no orphan
                    else:
                        gone += 1
                        index.add_dead(new, now)  # deleted meanwhile: the copy is dead too
                for digest, old, _ in damaged:
                    if index.location(digest) == old:
                        index.quarantine_page(digest)  # quarantine names the old record
                        bad += 1
                for seg, tail in new_tails.items():
                    index.put_segment_tail(seg, max(tail, index.segment_tails().get(seg, 0)))
                if last:
                    index.retire_segment(segment, now)
                return bound, gone, bad
            bound, gone, bad = store.index.write(rebind, what="GC compaction", freeing=True)
            faults.crash_point("gc_compacted")
            relocated += bound
            nbytes += sum(new.span_nbytes for _, _, new in moved)
            quarantined += bad
            vanished += gone
    return CompactionResult(segment, relocated, nbytes, quarantined, vanished)


def _compaction_batches(moves: list) -> list[list]:
    out, batch, size = [], [], 0
    for move in moves:
        if batch and size + move[1].span_nbytes > COMPACT_BATCH_NBYTES:
            out.append(batch)
            batch, size = [], 0
        batch.append(move)
        size += move[1].span_nbytes
    if batch:
        out.append(batch)
    return out


def remove_retired_segment(store, segment: int) -> int:
    """Remove a retired segment's file (its directory fsync'ed), then forget its tail,
    retired mark and dead records in one index transaction. Returns the disk bytes the
    file held (0 when a crashed GC had already removed it). Idempotent."""
    files = store.index.segments
    with store.index.read() as index:
        assert segment in index.retired_segments(), f"segment {segment:08x} is not retired"
        assert not any(loc is not None and loc.segment == segment
                       for _, loc in index.locations()), (
            f"segment {segment:08x} is retired but a page still names it")
    try:
        nbytes = os.stat(files.path(segment)).st_blocks * 512
    except FileNotFoundError:
        nbytes = 0
    files.remove(segment)  # this process's map closes; views already taken stay valid
    _fsync_dir(files.directory)  # the unlink is durable before the index forgets it
    faults.crash_point("gc_segment_removed")
    store.index.write(lambda index: index.forget_segment(segment),
                      what="GC segment removal", freeing=True)
    return nbytes


def _fsync_dir(directory) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def gc_history(store) -> list[dict]:
    with store.index.read() as index:
        raw = index.meta(HISTORY_KEY)
    return json.loads(raw) if raw else []


def _append_history(index: StoreIndex, entry: dict) -> None:
    raw = index.meta(HISTORY_KEY)
    history = json.loads(raw) if raw else []
    history = (history + [entry])[-HISTORY_LENGTH:]
    index.put_meta(HISTORY_KEY, json.dumps(history).encode())


__all__ = ["GCPlan", "GCCandidate", "plan_gc", "gc_history", "CompactionCandidate",
           "CompactionResult", "compact_segment", "remove_retired_segment",
           "DEFAULT_COMPACT_BELOW"]
