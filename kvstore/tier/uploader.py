"""Uploader: drains the UploadQueue into the bucket, in order, with retries.

One background thread takes due jobs of the lowest lane (formats and pages, then
block records, then checkpoints) and runs them on the bucket's bounded pool. Each job
reads its object from the local store at upload time, so a job whose object is gone
locally (evicted, deleted, never committed because the local write failed) is dropped.

The ordering invariant: a record is uploaded only once everything it names is
confirmed in the bucket (`_confirmed`: uploaded or seen by HEAD, no older than
refresh_after_s, else HEAD again, which re-PUTs an old one). A record whose
dependency is still queued waits; one whose dependency is absent from the bucket
and the queue queues it (forced past the cap: it is small next to what is already
queued) when the local store has it, and is dropped when nobody has it.

Failures back off exponentially (retry_base_s doubling to retry_max_s, with jitter)
and are retried forever: the data is committed locally, and the backlog is visible
in stats. run_now(jobs) runs given jobs in the caller's thread (synchronous mode).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import wait

from kvstore.errors import KVStoreError, NotFound
from kvstore.ids import ChainKey, PageDigest
from kvstore.tier import layout as L
from kvstore.tier.bucket import Bucket
from kvstore.tier.queue import Job, UploadQueue

log = logging.getLogger(__name__)
RETRY_BASE_S = 0.5
RETRY_MAX_S = 60.0
WAIT_DEPENDENCY_S = 0.2
BATCH_JOBS = 64
CONFIRMED_MAX = 200_000  # remembered confirmations (about 150 bytes each)


class _Wait(Exception):
    """A dependency is still queued: try the job again shortly."""


class _Drop(Exception):
    """The job's object (or one it names) exists nowhere: forget the job."""


class Uploader:
    def __init__(self, local, bucket: Bucket, layout: L.Layout, queue: UploadQueue,
                 refresh_after_s: float):
        self.local, self.bucket, self.layout, self.queue = local, bucket, layout, queue
        self.refresh_after_s = float(refresh_after_s)
        self._confirmed: dict[str, float] = {}   # object key -> monotonic time confirmed
        self._confirm_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters = {"uploaded": 0, "uploaded_nbytes": 0, "skipped_existing": 0,
                         "refreshed": 0, "dropped": 0, "failures": 0}
        self._counter_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kvstore-uploader", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self.queue.added.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                jobs = self.queue.due(BATCH_JOBS)
                if jobs:
                    self.run_now(jobs)
                    continue
                delay = self.queue.next_due_s()
                self.queue.added.clear()
                self.queue.added.wait(1.0 if delay is None else min(max(delay, 0.01), 1.0))
            except Exception:  # the loop must survive anything; the job stays queued
                log.exception("upload loop error; retrying in 1 s")
                self._stop.wait(1.0)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until the backlog is empty (tests, shutdown); True when it is."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.queue.backlog().jobs == 0:
                return True
            self.queue.added.set()
            time.sleep(0.05)
        return False

    # -- running jobs ------------------------------------------------------------------------
    def run_now(self, jobs: list[Job]) -> list[Job]:
        """Run jobs (pages in parallel on the pool, records in order); returns those that
        did not finish (waiting or failed, left queued for a retry). Finished jobs leave
        the queue in one transaction per lane (one fsync, not one per object); a crash
        before that only repeats idempotent uploads."""
        unfinished = []
        for lane in sorted({j.lane for j in jobs}):
            batch = [j for j in jobs if j.lane == lane]
            if lane == 0:
                futures = [self.bucket.pool.submit(self._run_one, j) for j in batch]
                wait(futures)
                finished = [f.result() for f in futures]
            else:
                finished = [self._run_one(j) for j in batch]
            self.queue.done([j for j, ok in zip(batch, finished, strict=True) if ok])
            unfinished += [j for j, ok in zip(batch, finished, strict=True) if not ok]
        return unfinished

    def _run_one(self, job: Job) -> bool:
        """True when the job is finished (uploaded, or dropped); the caller dequeues it."""
        try:
            outcome = getattr(self, f"_upload_{job.kind}")(job.key)
        except _Wait:
            self.queue.retry(job, WAIT_DEPENDENCY_S, None)
            return False
        except _Drop as why:
            log.info("upload of %s %s dropped: %s", job.kind, job.key, why)
            self._count("dropped")
            return True
        except (KVStoreError, OSError, Exception) as exc:  # noqa: BLE001 - retried, never lost
            delay = min(RETRY_MAX_S, RETRY_BASE_S * 2 ** min(job.attempts, 16))
            self.queue.retry(job, delay * (0.5 + random.random()), f"{type(exc).__name__}: {exc}")
            self._count("failures")
            return False
        self._count({"new": "uploaded", "exists": "skipped_existing",
                     "refreshed": "refreshed"}.get(outcome, "uploaded"))
        return True

    def _count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            self.counters[name] += n

    def _put_immutable(self, key: str, pieces) -> str:
        outcome = self.bucket.put_immutable(key, pieces, self.refresh_after_s)
        if outcome != "exists":
            self._count("uploaded_nbytes", sum(len(p) for p in pieces))
        self._confirm(key)
        return outcome

    def _confirm(self, key: str) -> None:
        now = time.monotonic()
        with self._confirm_lock:
            self._confirmed[key] = now
            if len(self._confirmed) > CONFIRMED_MAX:  # bounded: drop what has expired anyway
                horizon = now - self.refresh_after_s / 2
                self._confirmed = {k: t for k, t in self._confirmed.items() if t >= horizon}

    # -- one upload per kind -----------------------------------------------------------------
    def _upload_page(self, key: str) -> str:
        digest = PageDigest.parse(key)
        try:
            data = self.local.read_pages([digest])[0]
        except NotFound:
            raise _Drop("the page is no longer in the local store") from None
        return self._put_immutable(self.layout.page_key(digest), L.envelope("pages", data))

    def _upload_format(self, key: str) -> str:
        try:
            identity = self.local.get_format(key)
        except NotFound:
            raise _Drop("the format is not in the local store") from None
        return self._put_immutable(self.layout.format_key(identity.format_id),
                                   L.envelope("formats", identity.canonical()))

    def _upload_block(self, key: str) -> str:
        chain = ChainKey.parse(key)
        try:
            record = self.local.get_blocks([chain])[0]
        except NotFound:
            raise _Drop("the block is no longer in the local store") from None
        self._require("format", record.format_id.hex())
        for d in record.pages:
            self._require("page", d.hex())
        if not record.is_root:
            self._require("block", record.parent.hex())
        return self._put_immutable(self.layout.block_key(chain),
                                   L.envelope("blocks", L.block_payload(record)))

    def _upload_checkpoint(self, key: str) -> str:
        namespace, name = key.split("/", 1)
        try:
            ckpt = self.local.get_checkpoint(namespace, name)
        except NotFound:
            raise _Drop("the checkpoint is no longer in the local store") from None
        self._require("format", ckpt.format_id.hex())
        for k in ckpt.chain_keys:
            self._require("block", k.hex())
        for d in ckpt.attachments.values():
            self._require("page", d.hex())
        self.bucket.put(self.layout.checkpoint_key(namespace, name),
                        L.envelope("checkpoints", ckpt.encode()))
        return "new"

    def _upload_checkpoint_delete(self, key: str) -> str:
        namespace, name = key.split("/", 1)
        self.bucket.delete(self.layout.checkpoint_key(namespace, name))
        return "new"

    # -- dependencies ------------------------------------------------------------------------
    def _object_key(self, kind: str, key: str) -> str:
        return {"page": self.layout.page_key, "block": self.layout.block_key,
                "format": lambda k: self.layout.format_key(bytes.fromhex(k))}[kind](key)

    def _require(self, kind: str, key: str) -> None:
        """Return when the object is in the bucket and young enough to be depended on;
        raise _Wait while it is queued, _Drop when nobody has it."""
        object_key = self._object_key(kind, key)
        with self._confirm_lock:
            seen = self._confirmed.get(object_key)
        if seen is not None and time.monotonic() - seen < self.refresh_after_s / 2:
            return
        if self.queue.pending(kind, key):
            raise _Wait()
        info = self.bucket.head(object_key)
        if info is not None and info.age_s < self.refresh_after_s:
            self._confirm(object_key)
            return
        # absent, or old enough that a remote GC might be about to sweep it: upload it
        # again from the local copy (which refreshes its age), or give up on the record
        if not self._has_local(kind, key):
            if info is not None:
                self._confirm(object_key)  # old but present, and we cannot refresh it
                return
            raise _Drop(f"{kind} {key[:12]} is neither in the bucket nor in the local store")
        self.queue.add([(kind, key, 0)], force=True)
        raise _Wait()

    def _has_local(self, kind: str, key: str) -> bool:
        try:
            if kind == "page":
                return not self.local.missing([key])
            if kind == "block":  # the record: its pages are separate jobs
                return self.local.find_blocks([key])[0] is not None
            self.local.get_format(key)
            return True
        except NotFound:
            return False
