"""Named crash points and I/O fault injection for the reliability suite.

Every durable step calls crash_point(name). When the environment variable
KVSTORE_CRASH_AT names that step (optionally "name:k" for the k-th time it is
reached, counting from 1), the process exits at once with os._exit(CRASH_EXIT_CODE),
as a SIGKILL would: no finally blocks, no atexit, no flush. With the variable unset
the check is one dict lookup.

STEPS lists every registered step, so a test can prove each has a case.
"""

from __future__ import annotations

import os

CRASH_EXIT_CODE = 86
STEPS = {
    "page_written": "pages are in the write transaction, before the index is touched",
    "segments_written": "put_pages wrote a batch's segment records (not synced, not indexed)",
    "segments_synced": "put_pages fdatasync'ed a batch's segment records; the index "
                       "transaction that makes them reachable has not committed",
    "pages_synced": "put_pages committed a batch of pages (durable, no record names them yet)",
    "index_before_commit": "a write transaction is complete but not yet committed",
    "index_committed": "a write transaction committed (data and index synced)",
    "acknowledged": "a save returned to its caller",
    "gc_listed": "GC listed its candidates",
    "gc_deleted": "GC committed one batch of deletions",
    "gc_punched": "GC punched one batch of dead segment records, before it forgets them",
    "gc_compact_written": "compaction appended a batch of live records' copies (not synced, "
                          "not indexed)",
    "gc_compact_synced": "compaction fdatasync'ed the copies; the rebind transaction has not "
                         "committed",
    "gc_compacted": "compaction committed a batch's rebind (the last one retires the segment)",
    "gc_segment_removed": "GC removed a retired segment's file; the index has not forgotten "
                          "its tail and dead records",
}
_counts: dict[str, int] = {}


def crash_point(step: str) -> None:
    target = os.environ.get("KVSTORE_CRASH_AT")
    if not target:
        return
    assert step in STEPS, f"unregistered crash point {step!r}"
    name, _, nth = target.partition(":")
    if name != step:
        return
    _counts[step] = _counts.get(step, 0) + 1
    if _counts[step] >= int(nth or 1):
        os._exit(CRASH_EXIT_CODE)
