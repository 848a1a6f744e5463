"""Crashes: SIGKILL a writer at random moments, and exit at every named crash point.

Kill loop (20 cycles; 300 with KVSTORE_SOAK=1): a writer subprocess saves random
prefixes into one store and logs each save after it returns. After each SIGKILL:
every logged save restores byte-identically, check reports 0 problems. At the end,
GC leaves no orphans.

Crash points: every step registered in kvstore/faults.py has a case here (the test
fails when one has none), run with two seeds each; after the crash the store is
consistent and holds exactly what the step implies.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore import faults
from kvstore.gc import BATCH
from kvstore.records import BlockRecord
from tests.kvstore import workers
from tests.kvstore.factories import (
    assert_check_clean,
    assert_no_garbage,
    gc_now,
    make_store,
    plan_prefix,
    restore_prefix,
    wait_for,
)

REPO = Path(__file__).resolve().parents[2]
SOAK = os.environ.get("KVSTORE_SOAK") == "1"
KILL_CYCLES = 300 if SOAK else 20


def _spawn(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.kvstore.workers", *args], cwd=REPO,
                            env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def test_sigkill_writer_loop(tmp_path):
    store_dir, log = str(tmp_path / "store"), str(tmp_path / "acked.jsonl")
    rng = random.Random(20261129)
    acked_total = 0
    for cycle in range(KILL_CYCLES):
        writer = _spawn("writer", store_dir, log, str(cycle))
        if cycle % 4 == 0:  # mid-save for sure: after its first acknowledged save
            before = len(workers.read_log(log))
            wait_for(lambda b=before, w=writer: len(workers.read_log(log)) > b or w.poll() is not None)
            time.sleep(rng.uniform(0.0, 0.05))
        else:  # at a random moment: during start-up or mid-save
            time.sleep(rng.uniform(0.05, 0.8))
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
        assert writer.returncode == -signal.SIGKILL, writer.stdout.read().decode()[-2000:]
        entries = workers.read_log(log)
        # every save acknowledged since the last cycle, plus a sample of older ones
        # (all of them at the end), so a soak run stays linear in its length
        fresh, older = entries[acked_total:], entries[:acked_total]
        with make_store(store_dir) as store:
            workers.verify_acknowledged(store, fresh + rng.sample(older, min(len(older), 200)))
            assert_check_clean(store)
        acked_total = len(entries)
    assert acked_total >= KILL_CYCLES // 4, f"only {acked_total} saves acknowledged in {KILL_CYCLES} cycles"
    with make_store(store_dir) as store:
        gc_now(store)
        assert_no_garbage(store)
        workers.verify_acknowledged(store, workers.read_log(log))
        assert_check_clean(store, read_data=True)
    print(f"METRIC kill_cycles={KILL_CYCLES} acknowledged_saves={acked_total} lost=0")


# -- named crash points ------------------------------------------------------------------
def _b_state(store, seed):
    records, payload = plan_prefix(workers.IDENTITY, "ns", workers.prefix_b(seed))
    blocks = store.has_blocks([r.key for r in records])
    absent = set(store.missing(list(payload)))
    shared = {d for r in plan_prefix(workers.IDENTITY, "ns", workers.PREFIX_A)[0] for d in r.pages}
    own = set(payload) - shared  # pages only B names (zero pages may be shared with A)
    names = {c.name for c in store.list_checkpoints("ns")}
    return {"blocks": all(blocks), "no_blocks": not any(blocks), "pages": not (own & absent),
            "no_pages": own <= absent, "checkpoint": "b" in names}


def _loose_left(store, seed):
    return len(workers.loose_pages(seed)) - len(store.missing(list(workers.loose_pages(seed))))


# step -> [(KVSTORE_CRASH_AT value, what must hold after the crash)]
CASES = {
    "page_written": [("page_written", lambda s, seed: _b_state(s, seed)["no_pages"]
                      and _b_state(s, seed)["no_blocks"])],
    # schema 2: records written, or synced, but the index commit that names them never
    # ran: nothing of B is reachable, A is intact, check is clean (the bytes past the
    # committed tail are unreachable and the next save overwrites them)
    "segments_written": [("segments_written", lambda s, seed: _b_state(s, seed)["no_pages"]
                          and _b_state(s, seed)["no_blocks"])],
    "segments_synced": [("segments_synced", lambda s, seed: _b_state(s, seed)["no_pages"]
                         and _b_state(s, seed)["no_blocks"])],
    "pages_synced": [("pages_synced", lambda s, seed: _b_state(s, seed)["pages"]
                      and _b_state(s, seed)["no_blocks"])],
    "index_before_commit": [
        ("index_before_commit:1", lambda s, seed: _b_state(s, seed)["no_pages"]),       # put_pages
        ("index_before_commit:2", lambda s, seed: _b_state(s, seed)["pages"]
         and _b_state(s, seed)["no_blocks"]),                                          # commit_blocks
    ],
    "index_committed": [
        ("index_committed:1", lambda s, seed: _b_state(s, seed)["pages"] and _b_state(s, seed)["no_blocks"]),
        ("index_committed:2", lambda s, seed: _b_state(s, seed)["blocks"]
         and not _b_state(s, seed)["checkpoint"]),
    ],
    "acknowledged": [
        ("acknowledged:1", lambda s, seed: _b_state(s, seed)["blocks"] and not _b_state(s, seed)["checkpoint"]),
        ("acknowledged:2", lambda s, seed: _b_state(s, seed)["checkpoint"]),
    ],
    "gc_listed": [("gc_listed", lambda s, seed: _loose_left(s, seed) == workers.LOOSE_PAGES)],
    "gc_deleted": [("gc_deleted", lambda s, seed: _loose_left(s, seed) == workers.LOOSE_PAGES - BATCH)],
    # schema 2: the pages are gone from the index; some dead records are punched, their
    # entries not yet forgotten (the next GC punches them again, harmlessly)
    "gc_punched": [("gc_punched", lambda s, seed: _loose_left(s, seed) == 0)],
    # schema 2, compaction of segment 0 (mostly dead once the loose pages go): copies
    # past the tail, or rebound, or the file removed; A restores exactly in each
    # (tests/kvstore/test_compaction.py has the detailed cases)
    "gc_compact_written": [("gc_compact_written", lambda s, seed: _loose_left(s, seed) == 0)],
    "gc_compact_synced": [("gc_compact_synced", lambda s, seed: _loose_left(s, seed) == 0)],
    "gc_compacted": [("gc_compacted", lambda s, seed: _loose_left(s, seed) == 0)],
    "gc_segment_removed": [("gc_segment_removed", lambda s, seed: _loose_left(s, seed) == 0)],
}


def test_every_registered_crash_point_has_a_case():
    assert set(CASES) == set(faults.STEPS), (
        f"crash points without a case: {sorted(set(faults.STEPS) - set(CASES))}; "
        f"cases for unknown steps: {sorted(set(CASES) - set(faults.STEPS))}")


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("target,holds", [case for cases in CASES.values() for case in cases],
                         ids=[c[0] for cases in CASES.values() for c in cases])
def test_crash_point(tmp_path, target, holds, seed):
    proc = _spawn("crash-scenario", str(tmp_path), target, str(seed))
    output = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == faults.CRASH_EXIT_CODE, f"crash point {target} never fired:\n{output[-2000:]}"
    with make_store(tmp_path) as store:
        assert_check_clean(store)
        assert restore_prefix(store, workers.IDENTITY, "ns", workers.PREFIX_A)[0] == len(workers.PREFIX_A)
        assert store.get_checkpoint("ns", "a").tokens == tuple(workers.PREFIX_A)
        assert holds(store, seed), f"after a crash at {target} the store is not in the implied state"
        # whatever the crash left, GC converges and a restore of B is exact or a clean miss
        gc_now(store)
        assert_no_garbage(store)
        matched, records = restore_prefix(store, workers.IDENTITY, "ns", workers.prefix_b(seed))
        assert all(isinstance(r, BlockRecord) for r in records)
        assert_check_clean(store, read_data=True)
