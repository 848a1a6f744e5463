"""Verified page reads for a restore, split over threads: read_pages(store, digests), and
the fused read_into(store, digests, sink, page_nbytes).

read_into is what a restore that writes through host views uses (engine/restore.py):
its targets are laid out first, then each worker thread of a shared pool asks the store
for a short run of pages at a time (READ_CHUNK_NBYTES: the store verifies them, which
brings them into the CPU's caches) and hands each to the sink at once, which copies it
where it goes. One pass over the bytes, on several cores, with no thread that waits on
another. read_pages below hands out views that stay valid until the caller's block
ends (the device path copies them into staging while they are).

A store's get_pages verifies every page (its hash) before it yields the views, and does
that on the calling thread. For a restore of 1 GiB that one pass was the largest cost
on a 16-core host (H200: 184 ms per GiB, docs/benchmarks.md). Here, for a store that
maps its pages (store.maps_pages: views into its own map, nothing fetched), the
digests are split into contiguous runs, one get_pages per run on its own thread; each
reader holds its with-block open, so its views stay valid, until the caller's block
ends. The hashing runs in parallel where the hash releases the GIL (python-xxhash >= 4;
3.x holds it, and the runs then verify one after another, no slower than one call).
Every page is still verified by the store before any view of it is yielded; a damaged
or missing page raises the store's own error (IntegrityError, after it quarantined the
page; NotFound), the first in digest order, after every reader has closed.

A RemoteStore (maps_pages False) fetches: one get_pages call, one request, as before.

Cost model: one thread start per reader (about 0.1 ms) and one read transaction each.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from kvstore.protocol import PageReader

READ_WORKERS = min(16, os.cpu_count() or 1)
MIN_PAGES_PER_READER = 8  # below this a thread costs more than it saves


@contextmanager
def read_pages(store: PageReader, digests: Sequence, workers: int | None = None) -> Iterator[list]:
    """Verified page buffers in digest order, valid inside the with-block (see the
    module docstring); on up to `workers` threads (default READ_WORKERS)."""
    pending = PendingRead(store, digests, workers)
    try:
        yield pending.views()
    finally:
        pending.close()


class PendingRead:
    """A read_pages started without waiting for it: for a store that maps its pages the
    readers verify their runs while the caller does other work (a restore copies the
    previous group of layers meanwhile). views() waits for them and returns the verified
    views in digest order (or raises the first reader's error); the views stay valid
    until close(), which the caller must call (it is idempotent). A store that fetches,
    or a read too small for threads, is read by views() on the caller's thread."""

    def __init__(self, store: PageReader, digests: Sequence, workers: int | None = None):
        self.store, self.digests = store, list(digests)
        workers = READ_WORKERS if workers is None else workers
        workers = min(workers, len(self.digests) // MIN_PAGES_PER_READER)
        self._inline = None  # the caller-thread get_pages, once views() entered it
        self._readers: list[_Reader] = []
        if workers > 1 and store.maps_pages:
            step = -(-len(self.digests) // workers)
            self._readers = [_Reader(store, self.digests[i : i + step])
                             for i in range(0, len(self.digests), step)]
            try:
                for reader in self._readers:
                    reader.start()
            except BaseException:
                self.close()
                raise

    def views(self) -> list:
        if not self.digests:
            return []
        if not self._readers:
            if self._inline is None:
                self._inline = self.store.get_pages(self.digests)
                self._inline_views = self._inline.__enter__()
            return self._inline_views
        for reader in self._readers:
            reader.ready.wait()
        failed = next((r.error for r in self._readers if r.error is not None), None)
        if failed is not None:
            raise failed
        return [view for reader in self._readers for view in reader.views]

    def close(self) -> None:
        inline, self._inline = self._inline, None
        if inline is not None:
            inline.__exit__(None, None, None)
        readers, self._readers = self._readers, []
        for reader in readers:
            reader.done.set()
        for reader in readers:
            if reader.ident is not None:  # started
                reader.join()


# read_into verifies this many bytes of pages per get_pages before they are copied: about
# one core's L2, so the copy reads what the hash has just brought into cache.
READ_CHUNK_NBYTES = 2 * 2**20


# read_into's runs and threads when the sink copies into a device backend's staging (CUDA
# managed memory, engine/pool.py write_pages) instead of into arrays the CPU reads next:
# there cache residency does not matter, while every get_pages and every writing thread
# costs. H200, 512 MiB restore into pools (tools/bench/profile/restore_h200.py, restore):
# 2 MiB runs on 16 threads 109.9 ms, 16 MiB on 16 95.9, 2 MiB on 8 90.0, 16 MiB on 8
# 78.6, 64 MiB on 8 63.4, against 77.9 for the unfused read of the views.
STAGING_READ_CHUNK_NBYTES = 64 * 2**20
STAGING_READ_WORKERS = 8


def read_into(store: PageReader, digests: Sequence, sink: Callable[[int, object], None],
              page_nbytes: int, workers: int | None = None,
              chunk_nbytes: int = READ_CHUNK_NBYTES, checks: list | None = None) -> None:
    """The fused read: sink(i, page) for every digest, each page handed over right after
    the store verified it (valid during the call), in no particular order, from up to
    `workers` threads (default READ_WORKERS) of a shared pool. page_nbytes (the largest
    page's length, about) sizes the runs: chunk_nbytes of pages per get_pages.

    With `checks` (a list), the pages are read with get_pages_deferred instead: the
    store makes every check but the xxh3-128 of the pages it leaves to the caller
    (kvstore/deferred.py), and (first index, DeferredPages) of every run is appended
    to `checks`; the caller settles each before it uses what the sink copied.

    A damaged or missing page raises the store's error (IntegrityError after it
    quarantined the page; NotFound), a failing sink its own: that of the earliest run
    that failed, after every worker stopped (the others stop at their next chunk). Other pages' sinks may have run by then: the caller
    discards what they wrote. A store that fetches (maps_pages False) is asked once,
    and the sink runs on the calling thread."""
    digests = list(digests)
    workers = READ_WORKERS if workers is None else workers
    workers = min(workers, len(digests) // MIN_PAGES_PER_READER)
    if not digests:
        return
    read = store.get_pages if checks is None else store.get_pages_deferred

    def views_of(opened, at: int) -> list:
        if checks is None:
            return opened
        checks.append((at, opened))  # list.append is atomic: readers share the list
        return opened.views

    if workers <= 1 or not store.maps_pages:
        with read(digests) as opened:
            for i, view in enumerate(views_of(opened, 0)):
                sink(i, view)
        return
    chunk = max(1, chunk_nbytes // max(1, page_nbytes))
    step = -(-len(digests) // workers)
    stop = threading.Event()

    def run(first: int) -> None:
        try:
            for at in range(first, min(first + step, len(digests)), chunk):
                if stop.is_set():
                    return
                with read(digests[at : min(at + chunk, first + step)]) as opened:
                    for k, view in enumerate(views_of(opened, at)):
                        sink(at + k, view)
        except BaseException:
            stop.set()  # the others stop at their next chunk
            raise

    futures = [_read_pool().submit(run, first) for first in range(0, len(digests), step)]
    errors = [f.exception() for f in futures]  # waits for every worker
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        raise failed


@functools.lru_cache(maxsize=1)
def _read_pool() -> ThreadPoolExecutor:
    """read_into's threads, one pool per process (made on first use). Its tasks never
    wait on one another, so restores on several threads can share it."""
    return ThreadPoolExecutor(READ_WORKERS, thread_name_prefix="kv-read-into")


class _Reader(threading.Thread):
    """One get_pages over one run of digests, held open until `done` is set."""

    def __init__(self, store: PageReader, digests: list):
        super().__init__(name="kv-read", daemon=True)
        self.store, self.digests = store, digests
        self.views: list = []
        self.error: BaseException | None = None
        self.ready, self.done = threading.Event(), threading.Event()

    def run(self) -> None:
        try:
            with self.store.get_pages(self.digests) as views:
                self.views = views
                self.ready.set()
                self.done.wait()
        except BaseException as exc:  # handed to the caller's thread, raised there
            self.error = exc
        finally:
            self.ready.set()


__all__ = ["PendingRead", "read_into", "read_pages", "READ_WORKERS", "STAGING_READ_CHUNK_NBYTES",
           "STAGING_READ_WORKERS"]
