"""2. GC kill loop: SIGKILL a GC process at random points while two writers save
through the embedded Store and abandon loose uploads for GC to find. After every kill:
check finds no missing page (0 referenced pages deleted) and every acknowledged save
restores byte-identically (0 failed restores; each cycle verifies the saves
acknowledged since the last one plus 200 older ones at random, the end all of them). At the end a rerun converges: a second
GC deletes nothing and no garbage is left.

CI: 50 cycles; KVSTORE_SOAK=1: 500."""

from __future__ import annotations

import random
import time

import pytest

from kvstore.gc import gc_history
from kvstore.store import Store
from tests.kvstore.factories import assert_no_garbage, gc_now
from tests.kvstore.workers import read_log
from tests.reliability.common import SOAK, kill, metric, spawn, verify_entries

GRACE_S = 1.0  # longer than any upload-to-commit window of these writers


def test_gc_kill_loop(tmp_path):
    run_loop(tmp_path, 50)


@pytest.mark.timeout(1800)
@pytest.mark.skipif(not SOAK, reason="soak tier: KVSTORE_SOAK=1 runs this loop for 500 cycles "
                    "(about 15 min on 2 cores); CI runs 50")
def test_gc_kill_loop_soak(tmp_path):
    run_loop(tmp_path, 500, soak=True)


def run_loop(tmp_path, cycles: int, soak: bool = False):
    store_dir = tmp_path / "store"
    logs = [tmp_path / "w1.jsonl", tmp_path / "w2.jsonl"]
    Store(store_dir).close()
    writers = [spawn("local-writer", str(store_dir), str(log), str(i + 1), "4", "0.02",
                     log=tmp_path / f"w{i}.out") for i, log in enumerate(logs)]
    rng = random.Random(8)
    started = time.monotonic()
    failed_restores = missing = runs = verified_upto = 0
    try:
        for cycle in range(cycles):
            gc_out = tmp_path / f"gc-{cycle}.out"
            gc = spawn("gc-loop", str(store_dir), str(GRACE_S), log=gc_out)
            time.sleep(rng.uniform(0.3, 1.2))
            kill(gc)
            runs += gc_out.read_text().count('"gc_done"')
            for w in writers:
                assert w.poll() is None, f"a writer died: {(tmp_path / 'w0.out').read_text()[-2000:]}"
            entries = [e for log in logs for e in read_log(str(log))]
            # the saves acknowledged since the last cycle, and 200 older ones at random
            sample = entries[verified_upto:] + rng.sample(entries[:verified_upto],
                                                          min(200, verified_upto))
            verified_upto = len(entries)
            with Store(store_dir) as store:
                report = store.check()
                missing += sum(p.kind == "page_missing" for p in report.problems)
                assert report.ok, f"cycle {cycle}: {report.problems[:5]}"
                counts = verify_entries(store, sample)
                failed_restores += counts["lost"] + counts["wrong"]
                assert counts == {"lost": 0, "wrong": 0, "checkpoints_lost": 0}, (cycle, counts)
            if soak and (cycle + 1) % 100 == 0:  # partial figures, should a soak be cut short
                metric("gc_kill_loop_progress", cycles_done=cycle + 1, acknowledged_saves=len(entries),
                       completed_gc_runs=runs, referenced_pages_deleted=missing,
                       failed_restores=failed_restores, seconds=round(time.monotonic() - started, 1))
    finally:
        for w in writers:
            kill(w)
    entries = [e for log in logs for e in read_log(str(log))]
    with Store(store_dir) as store:
        collected = sum(h["pages"] for h in gc_history(store))  # the last 50 runs
        first = gc_now(store)
        second = gc_now(store)
        assert second["pages"] == 0 and second["quarantined"] == 0 and second["stale_times"] == 0
        assert_no_garbage(store)
        assert store.check(read_data=True).ok
        assert verify_entries(store, entries) == {"lost": 0, "wrong": 0, "checkpoints_lost": 0}
    metric("gc_kill_loop", cycles=cycles, acknowledged_saves=len(entries),
           completed_gc_runs=runs, pages_collected_last_50_runs=collected,
           referenced_pages_deleted=missing, failed_restores=failed_restores,
           rerun_deleted=first["pages"], second_rerun_deleted=second["pages"],
           seconds=round(time.monotonic() - started, 1))
    assert runs > 0 and collected > 0, "the GC never completed a run: the loop tested nothing"
