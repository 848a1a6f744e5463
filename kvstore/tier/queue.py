"""UploadQueue: the persistent write-behind backlog of one store directory.

A job names an object to upload, never its bytes: the bytes are in the local store,
which committed them first. Jobs live in <store>/upload-queue.sqlite (SQLite, WAL,
synchronous=FULL: a job acknowledged is on disk), so a restart resumes the backlog.
SQLite rather than a sub-database of the store's LMDB environment: the queue is the
tier's, the store directory's format stays the store's own, and several processes on
one directory may share the file (SQLite locks it).

    jobs(id, lane, kind, key, nbytes, attempts, next_try_ns, enqueued_ns, last_error)

Lanes give the upload order: 0 formats and pages, 1 block records, 2 checkpoints
(puts and deletes). The uploader always drains the lowest lane that has a job due, and
a record is uploaded only once everything it names is confirmed in the bucket, so a
remote reader never sees a record whose pages are missing.

Idempotent: one row per (lane, key). Adding an immutable object already queued is a
no-op; a checkpoint put or delete replaces the queued one (and moves to the back), so
the last intent wins. Capped in bytes: add() refuses jobs past max_nbytes and says
how many it took (a returned decision, not an exception); refused work stays local.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

QUEUE_FILE = "upload-queue.sqlite"
LANE = {"format": 0, "page": 0, "block": 1, "checkpoint": 2, "checkpoint_delete": 2}
REPLACEABLE = frozenset({"checkpoint", "checkpoint_delete"})

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    lane INTEGER NOT NULL,
    kind TEXT NOT NULL,
    key TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_try_ns INTEGER NOT NULL DEFAULT 0,
    enqueued_ns INTEGER NOT NULL,
    last_error TEXT,
    UNIQUE (lane, key)
);
CREATE INDEX IF NOT EXISTS jobs_due ON jobs (lane, next_try_ns, id);
"""


@dataclass(frozen=True)
class Job:
    id: int
    lane: int
    kind: str
    key: str          # page digest / chain key / format id hex, or "namespace/name"
    nbytes: int
    attempts: int
    enqueued_ns: int


@dataclass(frozen=True)
class Backlog:
    jobs: int
    nbytes: int
    by_lane: tuple[int, int, int]
    oldest_age_s: float
    failing: int          # jobs that failed at least once and wait for a retry
    last_error: str | None

    def to_dict(self) -> dict:
        return {"backlog_jobs": self.jobs, "backlog_nbytes": self.nbytes,
                "backlog_pages": self.by_lane[0], "backlog_blocks": self.by_lane[1],
                "backlog_checkpoints": self.by_lane[2], "backlog_oldest_age_s": self.oldest_age_s,
                "backlog_failing": self.failing, "backlog_last_error": self.last_error}


class UploadQueue:
    def __init__(self, store_dir, max_nbytes: int):
        self.path = Path(store_dir) / QUEUE_FILE
        self.max_nbytes = int(max_nbytes)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=30, isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self.added = threading.Event()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def add(self, jobs: list[tuple[str, str, int]], *, force: bool = False,
            hold_s: float = 0.0) -> int:
        """Queue (kind, key, nbytes) jobs in one transaction; returns how many were taken
        (already-queued immutable jobs count as taken). Past the byte cap none are taken
        unless force (dependencies of work already queued). hold_s: the jobs are not due
        before then unless release()d: a writer queues its intent, commits locally, then
        releases; a writer that crashed in between leaves jobs that come due after hold_s
        and upload what the local store has (or are dropped)."""
        if not jobs:
            return 0
        now = time.time_ns()
        due_ns = now + int(hold_s * 1e9)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if not force:
                    queued = self._db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM jobs").fetchone()[0]
                    if queued + sum(n for _, _, n in jobs) > self.max_nbytes:
                        self._db.execute("ROLLBACK")
                        return 0
                for kind, key, nbytes in jobs:
                    verb = "REPLACE" if kind in REPLACEABLE else "IGNORE"
                    self._db.execute(
                        f"INSERT OR {verb} INTO jobs (lane, kind, key, nbytes, next_try_ns, "
                        "enqueued_ns) VALUES (?, ?, ?, ?, ?, ?)",
                        (LANE[kind], kind, key, int(nbytes), due_ns, now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        self.added.set()
        return len(jobs)

    def release(self, keys: list[tuple[str, str]]) -> None:
        """Make held jobs due now (their writer's local commit has returned)."""
        with self._lock:
            self._db.executemany(
                "UPDATE jobs SET next_try_ns = 0 WHERE lane = ? AND key = ? AND kind = ? "
                "AND attempts = 0", [(LANE[kind], key, kind) for kind, key in keys])
        self.added.set()

    def due(self, limit: int = 64) -> list[Job]:
        """Due jobs of the lowest lane that has any job at all (due or waiting)."""
        now = time.time_ns()
        with self._lock:
            row = self._db.execute("SELECT MIN(lane) FROM jobs").fetchone()
            if row[0] is None:
                return []
            rows = self._db.execute(
                "SELECT id, lane, kind, key, nbytes, attempts, enqueued_ns FROM jobs "
                "WHERE lane = ? AND next_try_ns <= ? ORDER BY id LIMIT ?",
                (row[0], now, limit)).fetchall()
        return [Job(*r) for r in rows]

    def pending(self, kind: str, key: str) -> bool:
        with self._lock:
            return self._db.execute("SELECT 1 FROM jobs WHERE lane = ? AND key = ? AND kind = ?",
                                    (LANE[kind], key, kind)).fetchone() is not None

    def jobs_for(self, keys: list[tuple[str, str]]) -> list[Job]:
        out = []
        with self._lock:
            for kind, key in keys:
                r = self._db.execute(
                    "SELECT id, lane, kind, key, nbytes, attempts, enqueued_ns FROM jobs "
                    "WHERE lane = ? AND key = ? AND kind = ?", (LANE[kind], key, kind)).fetchone()
                if r is not None:
                    out.append(Job(*r))
        return out

    def done(self, jobs: list[Job]) -> None:
        """Remove finished (or dropped) jobs; a job replaced meanwhile (a newer intent
        for the same checkpoint) has another id and stays."""
        if not jobs:
            return
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.executemany("DELETE FROM jobs WHERE id = ?", [(j.id,) for j in jobs])
            self._db.execute("COMMIT")

    def retry(self, job: Job, delay_s: float, error: str | None) -> None:
        """Try again after delay_s; error None means 'waiting on a dependency', which
        does not count as a failed attempt."""
        when = time.time_ns() + int(delay_s * 1e9)
        with self._lock:
            if error is None:
                self._db.execute("UPDATE jobs SET next_try_ns = ? WHERE id = ?", (when, job.id))
            else:
                self._db.execute("UPDATE jobs SET next_try_ns = ?, attempts = attempts + 1, "
                                 "last_error = ? WHERE id = ?", (when, error[:500], job.id))

    def next_due_s(self) -> float | None:
        with self._lock:
            row = self._db.execute("SELECT MIN(next_try_ns) FROM jobs").fetchone()
        return None if row[0] is None else max(0.0, (row[0] - time.time_ns()) / 1e9)

    def backlog(self) -> Backlog:
        with self._lock:
            total = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(nbytes), 0), MIN(enqueued_ns), "
                "COALESCE(SUM(attempts > 0), 0) FROM jobs").fetchone()
            lanes = dict(self._db.execute("SELECT lane, COUNT(*) FROM jobs GROUP BY lane").fetchall())
            err = self._db.execute("SELECT last_error FROM jobs WHERE last_error IS NOT NULL "
                                   "ORDER BY id DESC LIMIT 1").fetchone()
        oldest = (time.time_ns() - total[2]) / 1e9 if total[2] else 0.0
        return Backlog(total[0], total[1], (lanes.get(0, 0), lanes.get(1, 0), lanes.get(2, 0)),
                       oldest, total[3], err[0] if err else None)


def read_backlog(store_dir) -> Backlog | None:
    """The backlog of a store directory without opening the tier (for `kvstore stats`);
    None when the directory has never had a tier."""
    path = Path(store_dir) / QUEUE_FILE
    if not path.exists():
        return None
    queue = UploadQueue(store_dir, max_nbytes=0)
    try:
        return queue.backlog()
    finally:
        queue.close()
