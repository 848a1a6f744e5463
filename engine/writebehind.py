"""WriteBehindPublisher: publishing that never blocks decode.

The caller captures (engine.publish.capture: a host copy of the pages, so the live
cache may change at once; or capture_later: device copies only, whose host copies the
worker makes) and submits; one worker thread uploads captures in order.
The queue is capped in bytes of pinned captures. Over the cap, the oldest capture
not in flight is dropped, down to the newest one: that one is always kept, so a single
capture larger than the cap (a long prompt of a large model) is still published, and
the pinned bytes stay within the cap or within the capture in flight plus the newest.
A drop means a future cache miss, never a wrong result, because nothing of a dropped
capture reaches the store. Upload failures are counted and logged, never raised into
generation. drain() waits for the queue to empty (shutdown).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from engine.publish import DEFAULT_NAMESPACE, Capture, DeferredCapture, PublishResult, upload

log = logging.getLogger(__name__)
DEFAULT_CAPACITY_NBYTES = 256 << 20


@dataclass
class _Job:
    capture: Capture | DeferredCapture
    namespace: str
    checkpoint: str | None
    metadata: dict | None

    @property
    def nbytes(self) -> int:
        return self.capture.nbytes


class WriteBehindPublisher:
    def __init__(self, store, *, capacity_nbytes: int = DEFAULT_CAPACITY_NBYTES,
                 namespace: str = DEFAULT_NAMESPACE):
        if capacity_nbytes <= 0:
            raise ValueError("capacity_nbytes must be positive")
        self.store = store
        self.capacity_nbytes = capacity_nbytes
        self.namespace = namespace
        self._queue: deque[_Job] = deque()
        self._in_flight: _Job | None = None
        self._cond = threading.Condition()
        self._closed = False
        self.published = self.dropped = self.failed = 0
        self.dropped_nbytes = 0
        self.last_error: str | None = None
        self.last_result: PublishResult | None = None
        self._worker = threading.Thread(target=self._run, name="kvstore-write-behind", daemon=True)
        self._worker.start()

    # -- producer side -------------------------------------------------------------
    def submit(self, capture: Capture | DeferredCapture, *, checkpoint: str | None = None,
               metadata: dict | None = None, namespace: str | None = None) -> bool:
        """Queue a capture; returns False only when the publisher is closed (an older
        capture may be dropped to make room under the cap). A DeferredCapture counts
        its nbytes against the cap from here (device memory until the worker copies it
        to the host)."""
        job = _Job(capture, namespace or self.namespace, checkpoint, metadata)
        with self._cond:
            if self._closed:
                self._drop(job, "publisher is closed")
                return False
            self._queue.append(job)
            # the newest capture stays even alone over the cap: dropping it would leave
            # every prompt whose KV exceeds the cap unpublishable, forever
            while self._pinned_nbytes() > self.capacity_nbytes and len(self._queue) > 1:
                self._drop(self._queue.popleft(), "queue over its byte cap")
            if job.nbytes > self.capacity_nbytes:
                log.info("write-behind holds a capture of %d bytes, over its %d-byte cap, "
                         "alone", job.nbytes, self.capacity_nbytes)
            self._cond.notify_all()
            return True

    def _drop(self, job: _Job, why: str) -> None:
        self.dropped += 1
        self.dropped_nbytes += job.nbytes
        log.info("write-behind dropped a capture of %d tokens (%d bytes): %s",
                 len(job.capture.tokens), job.nbytes, why)

    def _pinned_nbytes(self) -> int:
        queued = sum(j.nbytes for j in self._queue)
        return queued + (self._in_flight.nbytes if self._in_flight is not None else 0)

    # -- worker --------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._in_flight = self._queue.popleft()
            try:
                capture = job.capture
                if isinstance(capture, DeferredCapture):
                    capture = capture.result()
                result = upload(self.store, capture, namespace=job.namespace,
                                checkpoint=job.checkpoint, metadata=job.metadata)
            except Exception as exc:  # noqa: BLE001 - never raised into generation
                with self._cond:
                    self.failed += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("write-behind publish failed: %s", self.last_error)
            else:
                with self._cond:
                    self.published += 1
                    self.last_result = result
            finally:
                with self._cond:
                    self._in_flight = None
                    self._cond.notify_all()

    # -- lifecycle -----------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued capture is published or failed. True if empty."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._in_flight is None, timeout)

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        if drain:
            self.drain(timeout)
        with self._cond:
            self._closed = True
            for job in self._queue:
                self._drop(job, "publisher closed before it was sent")
            self._queue.clear()
            self._cond.notify_all()
        self._worker.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stats(self) -> dict:
        with self._cond:
            return {
                "queued_items": len(self._queue),
                "in_flight": self._in_flight is not None,
                "pinned_nbytes": self._pinned_nbytes(),
                "capacity_nbytes": self.capacity_nbytes,
                "published": self.published,
                "dropped": self.dropped,
                "dropped_nbytes": self.dropped_nbytes,
                "failed": self.failed,
                "last_error": self.last_error,
            }
