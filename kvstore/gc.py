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
    span never held anyone else's record.
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

BATCH = 256
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
        return deleted

    def _punch_dead(self) -> dict:
        """Punch every record dead for longer than the grace period (listed now: those
        this run's deletes made count when the grace is 0), then forget their entries,
        in batches. Punch first: a crash in between leaves an entry whose span is
        already a hole, and punching it again is harmless."""
        cutoff_ns = time.time_ns() - int(self.grace_s * 1e9)
        segments = self.store.index.segments
        with self.store.index.read() as index:
            due = [loc for loc, died in index.dead_records() if died <= cutoff_ns]
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


def plan_gc(store, grace_s: float = 3600.0) -> GCPlan:
    if grace_s < 0:
        raise InvalidInput("grace period must be >= 0 seconds")
    planned_ns = time.time_ns()
    plan = GCPlan(store, float(grace_s), time.monotonic(), planned_ns)
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
            plan.dead_records = [(loc, died) for loc, died in index.dead_records()
                                 if died <= cutoff_ns]
    faults.crash_point("gc_listed")
    return plan


def gc_history(store) -> list[dict]:
    with store.index.read() as index:
        raw = index.meta(HISTORY_KEY)
    return json.loads(raw) if raw else []


def _append_history(index: StoreIndex, entry: dict) -> None:
    raw = index.meta(HISTORY_KEY)
    history = json.loads(raw) if raw else []
    history = (history + [entry])[-HISTORY_LENGTH:]
    index.put_meta(HISTORY_KEY, json.dumps(history).encode())


__all__ = ["GCPlan", "GCCandidate", "plan_gc", "gc_history"]
