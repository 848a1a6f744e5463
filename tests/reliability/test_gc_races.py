"""5. GC races, each a deterministic scenario (interleavings forced through GC's
progress callback, which runs between delete batches, and upload times set in the
past by patching kvstore.store.now_ns). Every scenario: 0 lost pages — check(read_data)
is clean and every committed save restores byte-identically."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import kvstore.store as store_module
from kvstore.errors import GCAborted, MissingReferences
from kvstore.gc import BATCH, plan_gc
from kvstore.ids import page_digest
from kvstore.records import Checkpoint
from tests.kvstore.factories import (
    assert_no_garbage,
    gc_now,
    make_identity,
    make_store,
    plan_prefix,
    save_prefix,
)
from tests.reliability.common import REPO, metric, restore_exact

IDENTITY = make_identity()
GRACE_S = 5.0
OLD_S = 60.0


def _aged(monkeypatch, age_s: float):
    """A context in which uploads are stamped `age_s` seconds ago."""
    ctx = monkeypatch.context()
    m = ctx.__enter__()
    m.setattr(store_module, "now_ns", lambda: time.time_ns() - int(age_s * 1e9))
    return ctx


def _loose(store, monkeypatch, n: int, seed: int) -> list:
    pages = {page_digest(p): p for p in (os.urandom(64) + seed.to_bytes(4, "big") + i.to_bytes(4, "big")
                                         for i in range(n))}
    ctx = _aged(monkeypatch, OLD_S)
    store.put_pages(pages)
    ctx.__exit__(None, None, None)
    return list(pages)


def _lost(store, saves) -> int:
    report = store.check(read_data=True)
    assert report.ok, report.problems[:5]
    lost = 0
    for ns, tokens in saves:
        matched, exact = restore_exact(store, ns, tokens)
        lost += matched != len(tokens) or not exact
    return lost


def test_writer_paused_past_grace_between_upload_and_commit(tmp_path, monkeypatch):
    with make_store(tmp_path) as store:
        store.put_format(IDENTITY)
        tokens = list(range(40))
        records, payload = plan_prefix(IDENTITY, "ns", tokens)
        ctx = _aged(monkeypatch, OLD_S)          # uploaded, then the writer stalls...
        store.put_pages({d: payload[d] for d in store.missing(list(payload))})
        ctx.__exit__(None, None, None)
        deleted = plan_gc(store, GRACE_S).execute()  # ...past the grace period
        assert deleted["pages"] == len(payload)
        with pytest.raises(MissingReferences):   # never commits a record over absent pages
            store.commit_blocks(records)
        assert store.has_blocks([r.key for r in records]) == [False] * len(records)
        reuploaded = store.missing(list(payload))
        store.put_pages({d: payload[d] for d in reuploaded})
        store.commit_blocks(records)
        lost = _lost(store, [("ns", tokens)])
        # and a writer within its grace period is not touched at all
        tokens2 = list(range(1000, 1040))
        records2, payload2 = plan_prefix(IDENTITY, "ns", tokens2)
        store.put_pages(payload2)
        spared = plan_gc(store, GRACE_S).execute()
        store.commit_blocks(records2)
        lost += _lost(store, [("ns", tokens), ("ns", tokens2)])
    metric("gc_race_paused_writer", swept_uploads=deleted["pages"], commit_refused=1,
           reuploaded=len(reuploaded), young_uploads_swept=spared["pages"], lost_pages=lost)
    assert lost == 0 and spared["pages"] == 0


@pytest.mark.parametrize("when", ["before_execute", "between_batches"])
def test_writer_dedups_against_a_page_being_swept(tmp_path, monkeypatch, when):
    with make_store(tmp_path) as store:
        store.put_format(IDENTITY)
        tokens = list(range(500, 540))
        records, payload = plan_prefix(IDENTITY, "ns", tokens)
        ctx = _aged(monkeypatch, OLD_S)       # an earlier, abandoned upload of the same pages
        store.put_pages(payload)
        ctx.__exit__(None, None, None)
        _loose(store, monkeypatch, 2 * BATCH, 1)  # so the sweep has several batches
        plan = plan_gc(store, GRACE_S)
        assert {c.digest for c in plan.pages} >= set(payload)
        state = {"absent": None}

        def writer_dedups():
            state["absent"] = store.missing(list(payload))  # present: refreshes grace times
            store.put_pages({d: payload[d] for d in state["absent"]})
            for _ in range(3):
                try:
                    store.commit_blocks(records)
                    return
                except MissingReferences:  # a batch took them first: upload again
                    store.put_pages({d: payload[d] for d in store.missing(list(payload))})
            raise AssertionError("commit never succeeded")

        if when == "before_execute":
            writer_dedups()
            done = plan.execute()
        else:
            fired = []

            def progress(n, nbytes):
                if not fired:
                    fired.append(1)
                    writer_dedups()
            done = plan.execute(progress=progress)
        lost = _lost(store, [("ns", tokens)])
        assert store.missing(list(payload)) == []
    metric("gc_race_dedup_during_sweep", when=when, planned=len(plan.pages), deleted=done["pages"],
           skipped=done["skipped"], writer_reuploaded=len(state["absent"]), lost_pages=lost)
    assert lost == 0


def test_checkpoint_deleted_and_resaved_during_a_sweep(tmp_path, monkeypatch):
    with make_store(tmp_path) as store:
        tokens = list(range(2000, 2040))
        ctx = _aged(monkeypatch, OLD_S)
        saved = save_prefix(store, IDENTITY, "ns", tokens)
        attachment = os.urandom(300)
        att = page_digest(attachment)
        store.put_pages({att: attachment})
        ctx.__exit__(None, None, None)
        ckpt = Checkpoint("c", "ns", IDENTITY.format_id, tuple(tokens), saved.chain_keys,
                          {"state": att})
        store.create_checkpoint(ckpt)
        _loose(store, monkeypatch, 2 * BATCH, 2)
        store.delete_checkpoint("ns", "c")          # the attachment is now unreferenced, old
        plan = plan_gc(store, GRACE_S)
        assert att in {c.digest for c in plan.pages}
        resaved = {"reuploads": 0}

        def progress(n, nbytes):
            if "done" in resaved:
                return
            resaved["done"] = True
            for _ in range(3):
                try:
                    store.create_checkpoint(ckpt)
                    return
                except MissingReferences:           # this sweep took it already: upload again
                    resaved["reuploads"] += 1
                    store.put_pages({att: attachment})
            raise AssertionError("re-save never succeeded")
        done = plan.execute(progress=progress)
        assert store.get_checkpoint("ns", "c").attachments == {"state": att}
        assert store.read_pages([att]) == [attachment]
        lost = _lost(store, [("ns", tokens)])
        gc_now(store)
        assert store.read_pages([att]) == [attachment]
        assert_no_garbage(store)
    metric("gc_race_checkpoint_resaved", planned=len(plan.pages), deleted=done["pages"],
           skipped=done["skipped"], attachment_reuploads=resaved["reuploads"], lost_pages=lost)
    assert lost == 0


@pytest.mark.parametrize("pause", ["before_execute", "between_batches"])
def test_gc_paused_past_its_grace_aborts(tmp_path, monkeypatch, pause):
    grace_s = 0.3
    with make_store(tmp_path) as store:
        loose = _loose(store, monkeypatch, 3 * BATCH, 3)
        plan = plan_gc(store, grace_s)
        assert len(plan.pages) == len(loose)
        tokens = list(range(3000, 3040))

        def stall():
            time.sleep(grace_s + 0.2)
            save_prefix(store, IDENTITY, "ns", tokens)  # a writer works during the pause
        if pause == "before_execute":
            stall()
            with pytest.raises(GCAborted):
                plan.execute()
        else:
            calls = []

            def progress(n, nbytes):
                calls.append(n)
                if len(calls) == 1:
                    stall()
            with pytest.raises(GCAborted):
                plan.execute(progress=progress)
        deleted = len(store.missing(loose))
        lost = _lost(store, [("ns", tokens)])
    expected_deleted = 0 if pause == "before_execute" else BATCH
    metric("gc_race_paused_gc", pause=pause, planned=len(plan.pages), deleted_before_abort=deleted,
           aborted=1, lost_pages=lost)
    assert deleted == expected_deleted and lost == 0


OTHER_GC = """
import sys
from kvstore.errors import GCAborted
from kvstore.gc import plan_gc
from kvstore.store import Store
try:
    plan_gc(Store(sys.argv[1]), 5.0).execute()
except GCAborted:
    sys.exit(3)
"""


def test_two_gcs_at_once(tmp_path, monkeypatch):
    with make_store(tmp_path) as store:
        tokens = list(range(4000, 4040))
        save_prefix(store, IDENTITY, "ns", tokens)
        loose = _loose(store, monkeypatch, 2 * BATCH, 4)
        first, second = plan_gc(store, GRACE_S), plan_gc(store, GRACE_S)
        outcome = {}

        def progress(n, nbytes):
            if outcome:
                return
            try:                                     # same process, another descriptor
                second.execute()
                outcome["in_process"] = "ran"
            except GCAborted:
                outcome["in_process"] = "aborted"
            other = subprocess.run(                  # and another process
                [sys.executable, "-c", OTHER_GC, str(tmp_path)], cwd=REPO, capture_output=True,
                env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
            outcome["other_process"] = {3: "aborted", 0: "ran"}.get(other.returncode, "crashed")
            assert other.returncode in (0, 3), other.stderr.decode()[-2000:]
        done = first.execute(progress=progress)
        lost = _lost(store, [("ns", tokens)])
        assert store.missing(loose) == loose
    metric("gc_race_two_gcs", first_deleted=done["pages"], second_in_process=outcome["in_process"],
           second_other_process=outcome["other_process"], lost_pages=lost)
    assert outcome == {"in_process": "aborted", "other_process": "aborted"} and lost == 0
