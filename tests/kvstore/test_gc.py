"""GC safety: the grace period protects young uploads, missing() refreshes it, two GCs
never sweep at once, and a GC paused past its grace aborts without deleting."""

from __future__ import annotations

import time

import pytest

import kvstore.gc as gc_module
import kvstore.store as store_module
from kvstore.errors import GCAborted, MissingReferences
from kvstore.gc import gc_history
from tests.kvstore.factories import (
    assert_check_clean,
    assert_no_garbage,
    make_identity,
    make_store,
    plan_prefix,
    save_prefix,
)

IDENTITY = make_identity()
GRACE_S = 60.0


def _upload(store, tokens, age_s: float, monkeypatch) -> tuple[list, dict]:
    """Upload the pages of `tokens` without committing, stamped `age_s` seconds ago."""
    records, payload = plan_prefix(IDENTITY, "ns", tokens)
    store.put_format(IDENTITY)
    with monkeypatch.context() as m:
        m.setattr(store_module, "now_ns", lambda: time.time_ns() - int(age_s * 1e9))
        store.put_pages(payload)
    return records, payload


def test_grace_protects_young_pages(tmp_path, monkeypatch):
    with make_store(tmp_path) as store:
        _, old = _upload(store, list(range(100, 108)), 2 * GRACE_S, monkeypatch)
        _, young = _upload(store, list(range(8)), 1.0, monkeypatch)
        old = set(old) - set(young)  # a page in both (all zeros) was re-uploaded: young
        plan = store.plan_gc(GRACE_S)
        assert {c.digest for c in plan.pages} == old and old
        done = plan.execute()
        assert done["pages"] == len(old) and done["skipped"] == 0
        assert store.missing(list(young)) == [] and set(store.missing(list(old))) == old
        assert_check_clean(store)


def test_missing_refreshes_grace_even_after_planning(tmp_path, monkeypatch):
    with make_store(tmp_path) as store:
        records, payload = _upload(store, list(range(8)), 2 * GRACE_S, monkeypatch)
        plan = store.plan_gc(GRACE_S)
        assert {c.digest for c in plan.pages} == set(payload)
        # a writer dedups against the stored pages: missing() says none are missing...
        assert store.missing(list(payload)) == []
        # ...and the sweep planned before that spares them
        done = plan.execute()
        assert done["pages"] == 0 and done["skipped"] == len(payload)
        store.commit_blocks(records)  # so the writer's commit succeeds
        assert store.plan_gc(0.0).pages == []
        assert_check_clean(store)


def test_a_writer_paused_past_the_grace_is_refused_not_corrupted(tmp_path, monkeypatch):
    with make_store(tmp_path) as store:
        records, payload = _upload(store, list(range(8)), 2 * GRACE_S, monkeypatch)
        store.plan_gc(GRACE_S).execute()
        with pytest.raises(MissingReferences):
            store.commit_blocks(records)
        assert store.stats().block_count == 0
        assert_check_clean(store)


def test_two_gcs_at_once_one_aborts(tmp_path, monkeypatch):
    with make_store(tmp_path) as store:
        _upload(store, list(range(8)), 2 * GRACE_S, monkeypatch)
        first = store.plan_gc(GRACE_S)
        second = store.plan_gc(GRACE_S)
        assert first.pages and len(second.pages) == len(first.pages)
        seen = []

        def during_first_sweep(*_):
            with pytest.raises(GCAborted, match="another GC"):
                second.execute()
            seen.append(True)
        first.execute(progress=during_first_sweep)
        assert seen == [True]
        assert second.execute()["pages"] == 0  # after the first: nothing left, lock free
        assert_no_garbage(store)
        assert len(gc_history(store)) == 2


def test_two_gcs_in_two_processes_one_aborts(tmp_path, monkeypatch):
    """The lock is an flock on <store>/gc.lock: held by another process, GC aborts."""
    import subprocess
    import sys

    with make_store(tmp_path) as store:
        _upload(store, list(range(8)), 2 * GRACE_S, monkeypatch)
        holder = subprocess.Popen(
            [sys.executable, "-c", "import fcntl,os,sys,time;"
             f"fd=os.open({str(tmp_path / 'gc.lock')!r},os.O_RDWR|os.O_CREAT);"
             "fcntl.flock(fd,fcntl.LOCK_EX);print('locked',flush=True);sys.stdin.read()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().strip() == "locked"
            with pytest.raises(GCAborted):
                store.plan_gc(GRACE_S).execute()
            assert store.plan_gc(GRACE_S).pages  # nothing was deleted
        finally:
            holder.stdin.close()
            holder.wait(timeout=10)
        assert store.plan_gc(GRACE_S).execute()["pages"] > 0


def test_a_gc_paused_past_its_grace_aborts(tmp_path, monkeypatch):
    with make_store(tmp_path) as store:
        _upload(store, list(range(8)), 2 * GRACE_S, monkeypatch)
        before = store.stats().page_count
        plan = store.plan_gc(GRACE_S)
        assert plan.pages
        real = time.monotonic
        monkeypatch.setattr(gc_module.time, "monotonic", lambda: real() + GRACE_S + 1)
        with pytest.raises(GCAborted, match="longer than its grace"):
            plan.execute()
        assert store.stats().page_count == before
        monkeypatch.setattr(gc_module.time, "monotonic", real)
        assert store.plan_gc(GRACE_S).execute()["pages"] == before
        assert_check_clean(store)


def test_gc_never_touches_referenced_pages(tmp_path):
    with make_store(tmp_path) as store:
        saved = save_prefix(store, IDENTITY, "ns", list(range(13)), checkpoint="c")
        other = save_prefix(store, IDENTITY, "ns", list(range(50, 58)))
        store.evict(0)  # the unpinned chain goes with its pages
        assert store.has_blocks(other.chain_keys) == [False, False]
        done = store.plan_gc(0.0).execute()
        assert done["pages"] == 0
        pages = [d for r in saved.records for d in r.pages]
        assert len(store.read_pages(pages)) == len(pages)
        assert_no_garbage(store)
        assert_check_clean(store, read_data=True)
