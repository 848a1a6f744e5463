"""GC compaction of mostly-dead segments (issue 19 item 1, kvstore/gc.py): the plan's
threshold, the copy -> fdatasync -> rebind order under the writer lock, damaged records
quarantined and never copied, removal of the file only after the grace period, readers
in another process that hold views across a compaction and a removal, and a crash at
every compaction step (check clean, nothing lost, the next GC converges).

The scenario (build): 64 KiB segments of sixteen 4 KiB records. Prefix A (one block,
two pages) is saved first, then 30 loose pages, then prefix B: segment 0 holds A and
14 loose pages, segment 1 sixteen loose pages, segment 2 (where saves append) B. Once
GC deletes the loose pages, segment 0 is 2/16 live and segment 1 wholly dead: both are
compacted; segment 2 never is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kvstore.gc as gc_module
import kvstore.store as store_module
from kvstore import faults
from kvstore.gc import compaction_candidates, plan_gc
from kvstore.ids import page_digest
from tests.kvstore.factories import (
    assert_check_clean,
    assert_no_garbage,
    gc_now,
    make_identity,
    make_store,
    restore_prefix,
    save_prefix,
)

IDENTITY = make_identity()
SEGMENT_NBYTES = 64 << 10
A = [1, 2, 3, 4]
B = [9, 8, 7, 6, 5, 4, 3, 2]
REPO = Path(__file__).resolve().parents[2]
# the compaction steps of kvstore/faults.py and the occurrences that reach them here
# (tests/reliability/test_crash_points.py runs each once more on its own store)
CRASH_STEPS = {
    "gc_compact_written": [1, 2],
    "gc_compact_synced": [1, 2],
    "gc_compacted": [1, 2],
    "gc_segment_removed": [1, 2],
}


def open_store(path):
    return make_store(path, segment_nbytes=SEGMENT_NBYTES)


def loose_pages(n: int, seed: int = 0) -> dict:
    pages = [bytes([seed, i]) * 1500 for i in range(n)]  # 3000 bytes: one 4 KiB span each
    return {page_digest(p): p for p in pages}


def build(store, *, loose_age_s: float = 0.0, monkeypatch=None) -> dict:
    """The module docstring's scenario; loose pages stamped loose_age_s in the past."""
    save_prefix(store, IDENTITY, "ns", A, checkpoint="a")
    loose = loose_pages(30)
    if loose_age_s:
        with monkeypatch.context() as m:
            m.setattr(store_module, "now_ns", lambda: time.time_ns() - int(loose_age_s * 1e9))
            store.put_pages(loose)
    else:
        store.put_pages(loose)
    save_prefix(store, IDENTITY, "ns", B)
    with store.index.read() as index:
        by_segment = {}
        for digest, loc in index.locations():
            by_segment.setdefault(loc.segment, set()).add(digest)
    assert sorted(by_segment) == [0, 1, 2], by_segment
    assert len(by_segment[0] & set(loose)) == 14 and by_segment[1] <= set(loose)
    return loose


def segment_files(store) -> list[int]:
    return store.index.segments.segments()


def assert_prefixes_intact(store) -> None:
    assert restore_prefix(store, IDENTITY, "ns", A)[0] == len(A)
    assert restore_prefix(store, IDENTITY, "ns", B)[0] == len(B)


# -- the plan ---------------------------------------------------------------------------
def test_the_plan_picks_mostly_dead_segments_never_the_one_saves_append_to(tmp_path):
    with open_store(tmp_path) as store:
        build(store)
        with store.index.read() as index:
            assert compaction_candidates(index, 0.25) == []  # every page is still live
        plan = store.plan_gc(0.0)  # the loose pages are unreferenced: counted as gone
        assert [(c.segment, c.live_records) for c in plan.compactions] == [(0, 2), (1, 0)]
        assert plan.summary()["compact_segments"] == 2
        assert store.plan_gc(60.0).compactions == []  # young loose pages stay: all live
        gc_now(store)
        # wholly dead, the highest segment is still never a candidate
        store.put_pages(loose_pages(3, seed=1))
        with store.index.read() as index:
            current = max(index.segment_tails())
        with store.index.read() as index:
            planned = {c.segment for c in compaction_candidates(index, 1.0)}
        assert current not in planned


def test_the_threshold_is_a_fraction_of_the_committed_tail(tmp_path, monkeypatch):
    with open_store(tmp_path) as store:
        loose = build(store)
        with store.index.read() as index:
            seg0 = {d for d, loc in index.locations() if loc.segment == 0}
        # leave 4 of segment 0's 16 records live: exactly 25%, not below it
        keep = set(list(sorted(seg0 & set(loose)))[:2])
        drop = (seg0 & set(loose)) - keep
        store.index.write(lambda index: [index.delete_page(d) for d in drop], what="test")
        with store.index.read() as index:
            assert [c.segment for c in compaction_candidates(index, 0.25)] == []
            assert [c.segment for c in compaction_candidates(index, 0.26)] == [0]
            assert compaction_candidates(index, 0.0) == []  # 0 turns compaction off
        with pytest.raises(Exception, match="fraction"):
            plan_gc(store, 60.0, compact_below=1.5)


# -- compaction itself ------------------------------------------------------------------
def test_gc_compacts_mostly_dead_segments_and_frees_their_files(tmp_path):
    with open_store(tmp_path) as store:
        build(store)
        before = store.stats().file_nbytes
        done = gc_now(store)  # grace 0: the loose pages go, then compaction and removal
        assert done["pages"] == 30
        assert done["compacted_segments"] == 2 and done["removed_segments"] == 2
        assert done["relocated_records"] == 2  # A's two pages; segment 1 had none live
        # the dead records were punched first (grace 0); what the files still held on
        # disk was A's two old records
        assert done["punched_records"] == 30 and done["removed_nbytes"] >= 2 * 4096
        assert segment_files(store) == [2, 3] or segment_files(store) == [2]
        with store.index.read() as index:
            assert {loc.segment for _, loc in index.locations()} <= {2, 3}
            assert sorted(index.segment_tails()) == segment_files(store)
            assert index.retired_segments() == {}
            assert all(loc.segment not in (0, 1) for loc, _ in index.dead_records())
        assert store.stats().file_nbytes < before
        assert_prefixes_intact(store)
        assert_check_clean(store, read_data=True)
        assert_no_garbage(store)
        again = gc_now(store)
        assert again["compacted_segments"] == 0 and again["removed_segments"] == 0


def test_with_a_grace_period_the_file_is_removed_by_a_later_run(tmp_path, monkeypatch):
    with open_store(tmp_path) as store:
        build(store, loose_age_s=3600, monkeypatch=monkeypatch)
        done = store.plan_gc(60.0).execute()
        assert done["pages"] == 30 and done["compacted_segments"] == 2
        assert done["removed_segments"] == 0 and done["punched_records"] == 0
        assert segment_files(store)[:2] == [0, 1]  # retired, still there for readers
        with store.index.read() as index:
            assert sorted(index.retired_segments()) == [0, 1]
        plan = store.plan_gc(60.0)
        assert plan.summary()["retired_segments"] == 2 and plan.compactions == []
        assert_check_clean(store, read_data=True)  # old copies are dead, not orphans
        assert_prefixes_intact(store)
        assert plan.execute()["removed_segments"] == 0  # not yet past the grace
        time.sleep(0.3)
        done = store.plan_gc(0.2).execute()
        assert done["removed_segments"] == 2 and done["compacted_segments"] == 0
        assert 0 not in segment_files(store) and 1 not in segment_files(store)
        assert_check_clean(store, read_data=True)
        assert_prefixes_intact(store)


def test_a_damaged_record_is_quarantined_never_copied(tmp_path):
    with open_store(tmp_path) as store:
        build(store)
        record = store.lookup_prefix(IDENTITY.format_id, "ns", A).blocks[0]
        with store.index.read() as index:
            victim = next(d for d in record.pages if index.location(d).segment == 0)
            loc = index.location(victim)
        with open(store.index.segments.path(0), "r+b") as f:  # one stored byte flipped
            f.seek(loc.offset + loc.length - 1)
            byte = f.read(1)
            f.seek(loc.offset + loc.length - 1)
            f.write(bytes([byte[0] ^ 1]))
        done = gc_now(store)
        assert done["compaction_quarantined"] == 1 and done["compacted_segments"] == 2
        with store.index.read() as index:
            assert index.is_quarantined(victim) and not index.has_page(victim)
        for segment in segment_files(store):  # no copy of the damaged bytes anywhere
            assert victim not in {r.digest for r in store.index.segments.scan(segment)}
        assert store.has_blocks([record.key]) == [False]  # republishing heals it
        save_prefix(store, IDENTITY, "ns", A)
        assert store.has_blocks([record.key]) == [True]
        gc_now(store)
        assert_prefixes_intact(store)
        assert_check_clean(store, read_data=True)


def test_a_page_evicted_during_compaction_is_not_brought_back(tmp_path, monkeypatch):
    with open_store(tmp_path) as store:
        build(store)
        store.delete_checkpoint("ns", "a")  # A unpinned, referenced: GC keeps its pages
        records = store.lookup_prefix(IDENTITY.format_id, "ns", A).blocks
        a_pages = {d for r in records for d in r.pages}
        loose = loose_pages(30)
        store.index.write(lambda index: [index.delete_page(d) for d in loose], what="test")
        real = faults.crash_point

        def evict_meanwhile(step):  # copies synced, rebind not yet committed
            if step == "gc_compact_synced":
                store.evict(0)
            real(step)
        monkeypatch.setattr(gc_module.faults, "crash_point", evict_meanwhile)
        done = store.plan_gc(60.0).execute()
        assert done["compacted_segments"] == 2 and done["relocated_records"] == 0
        assert set(store.missing(list(a_pages))) == a_pages
        with store.index.read() as index:  # the copies are dead records, not orphans
            dead = {(loc.segment, loc.offset) for loc, _ in index.dead_records()}
            current = max(index.segment_tails())
        copies = {(current, r.offset) for r in store.index.segments.scan(current)
                  if r.digest in a_pages}
        assert len(copies) == len(a_pages) and copies <= dead
        assert_check_clean(store, read_data=True)


def test_a_save_during_compaction_waits_for_the_writer_lock(tmp_path, monkeypatch):
    """Without the lock, the save would append from the same committed tail and
    overwrite the copies that the rebind then points at."""
    with open_store(tmp_path) as store:
        build(store)
        loose = loose_pages(30)
        store.index.write(lambda index: [index.delete_page(d) for d in loose], what="test")
        real = faults.crash_point
        saver: list[threading.Thread] = []

        def save_meanwhile(step):
            if step == "gc_compact_synced" and not saver:
                t = threading.Thread(target=save_prefix, args=(store, IDENTITY, "other",
                                                              list(range(40, 60))))
                t.start()
                saver.append(t)
                t.join(0.5)  # long enough to overwrite the copies if it could
            real(step)
        monkeypatch.setattr(gc_module.faults, "crash_point", save_meanwhile)
        done = store.plan_gc(60.0).execute()
        saver[0].join(30)
        assert done["compacted_segments"] == 2
        assert_prefixes_intact(store)
        assert restore_prefix(store, IDENTITY, "other", list(range(40, 60)))[0] == 20
        assert_check_clean(store, read_data=True)


def test_the_gc_command_shows_compacted_segments_and_bytes_freed(tmp_path):
    from tests.tools.helpers import run
    with open_store(tmp_path) as store:
        build(store)
    planned = run("gc", "--dry-run", "--grace", "0", "--json", "-d", tmp_path).json()
    assert planned["plan"]["compact_segments"] == 2 and planned["deleted"] is None
    off = run("gc", "--dry-run", "--grace", "0", "--compact-below", "0", "--json", "-d", tmp_path)
    assert off.json()["plan"]["compact_segments"] == 0
    text = run("gc", "--grace", "0", "-d", tmp_path)
    assert text.code == 0, text.stderr
    assert "2 mostly-dead segment(s) to compact" in text.stdout
    assert "compacted 2 segment(s): relocated 2 live records" in text.stdout
    assert "removed 2 retired segment file(s), freeing" in text.stdout
    assert run("gc", "--compact-below", "2", "-d", tmp_path).code != 0  # not a fraction
    with open_store(tmp_path) as store:
        assert not {0, 1} & set(segment_files(store))
        assert_prefixes_intact(store)


def test_check_reports_a_page_in_a_retired_segment_and_removal_refuses_it(tmp_path):
    with open_store(tmp_path) as store:
        build(store)
        store.index.write(lambda index: index.retire_segment(0, time.time_ns()), what="test")
        report = store.check()
        assert {p.kind for p in report.problems} == {"page_retired"}
        assert len(report.problems) == 16  # every page of segment 0
        with pytest.raises(AssertionError, match="still names it"):
            gc_module.remove_retired_segment(store, 0)
        assert 0 in segment_files(store)
        assert_prefixes_intact(store)


# -- readers in another process ---------------------------------------------------------
def test_a_reader_holding_views_across_compaction_and_removal(tmp_path, monkeypatch):
    """Another process resolves A's locations (old segment 0) and then compaction runs
    (grace 60: the file stays): its reads of the old locations verify. It takes views;
    the file is removed (a later GC, past the grace); the views still hold A's bytes;
    and its fresh reads resolve to the copies. Nothing is quarantined."""
    with open_store(tmp_path) as store:
        build(store, loose_age_s=3600, monkeypatch=monkeypatch)
    reader = subprocess.Popen([sys.executable, "-m", "tests.kvstore.test_compaction", "reader",
                               str(tmp_path)], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert reader.stdout.readline().strip() == "resolved", reader.stderr.read()
        with open_store(tmp_path) as store:
            assert store.plan_gc(60.0).execute()["compacted_segments"] == 2
            assert 0 in segment_files(store)
            reader.stdin.write("go\n")
            reader.stdin.flush()
            assert reader.stdout.readline().strip() == "viewing", reader.stderr.read()
            time.sleep(0.3)
            assert store.plan_gc(0.2).execute()["removed_segments"] == 2
            assert 0 not in segment_files(store)
            reader.stdin.write("go\n")
            reader.stdin.flush()
            out, err = reader.communicate(timeout=60)
            assert reader.returncode == 0 and out.strip() == "intact", err[-2000:]
            with store.index.read() as index:
                assert index.quarantined() == set()
            assert_prefixes_intact(store)
            assert_check_clean(store, read_data=True)
    finally:
        if reader.poll() is None:
            reader.kill()


def _reader(store_dir: str) -> None:
    from tests.kvstore.factories import expected_pages
    store = open_store(store_dir)
    match = store.lookup_prefix(IDENTITY.format_id, "ns", A)
    digests = [d for b in match.blocks for d in b.pages]
    want = expected_pages(IDENTITY, match.blocks)
    segments = store.index.segments
    with store.index.read() as index:  # resolved before the compaction
        old = [index.location(d) for d in digests]
    assert {loc.segment for loc in old} == {0}, old
    print("resolved", flush=True)
    sys.stdin.readline()  # compacted, retired, file still there
    views = []
    for d, loc in zip(digests, old, strict=True):
        segments.read_verified(loc, d)  # the old copy verifies
        views.append(segments.page_value(loc))
    print("viewing", flush=True)
    sys.stdin.readline()  # the file is removed now
    from kvstore.pages import decode_stored, verify_stored
    for view, data, d in zip(views, want, digests, strict=True):
        header, body = verify_stored(view, d)
        assert bytes(decode_stored(header, body)) == data
    with store.get_pages(digests) as fresh:  # resolves to the copies
        assert [bytes(v) for v in fresh] == want
    with store.index.read() as index:
        assert all(index.location(d).segment not in (0, 1) for d in digests)
    print("intact", flush=True)


# -- crashes ----------------------------------------------------------------------------
# GC's index transactions here: 1 deletes, 2 orphans, 3 punched records forgotten,
# 4 and 5 the two rebinds, 6 and 7 the two removals forgotten
CRASH_CASES = [(step, k) for step, ks in CRASH_STEPS.items() for k in ks] + [
    ("index_before_commit", 4), ("index_committed", 4), ("index_before_commit", 5),
    ("index_before_commit", 6), ("index_committed", 7)]


@pytest.mark.parametrize("step,k", CRASH_CASES, ids=[f"{s}:{k}" for s, k in CRASH_CASES])
def test_a_crash_during_compaction_loses_nothing(tmp_path, step, k):
    proc = subprocess.run([sys.executable, "-m", "tests.kvstore.test_compaction", "crash",
                           str(tmp_path), f"{step}:{k}"], cwd=REPO, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == faults.CRASH_EXIT_CODE, (
        f"{step}:{k} never fired (exit {proc.returncode}): {proc.stderr.decode()[-2000:]}")
    with open_store(tmp_path) as store:
        assert_check_clean(store, read_data=True)  # leftovers are not damage
        assert_prefixes_intact(store)
        gc_now(store)  # converges: compaction finished or redone, files removed
        with store.index.read() as index:
            assert index.retired_segments() == {}
            assert {loc.segment for _, loc in index.locations()}.isdisjoint({0, 1})
        assert not {0, 1} & set(segment_files(store))
        assert_no_garbage(store)
        assert_check_clean(store, read_data=True)
        assert_prefixes_intact(store)


def _crash(store_dir: str, target: str) -> None:
    store = open_store(store_dir)
    build(store)
    os.environ["KVSTORE_CRASH_AT"] = target
    gc_now(store)
    os._exit(0)  # the crash point never fired


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"reader": _reader, "crash": _crash}[command](*args)
