"""1. Server kill loop: SIGKILL the service at random while two writers save through
RemoteStore (~30% of saves extend a stored prefix) and a reader restores acknowledged
saves. After every kill, with the service down: check passes, every acknowledged save
restores byte-identically from the store directory, no checkpoint is partial. At the
end GC leaves no orphans and no missing pages.

CI: 50 cycles. KVSTORE_SOAK=1: 1000 cycles (each cycle then verifies the saves
acknowledged since the last cycle plus 300 sampled older ones; all at the end)."""

from __future__ import annotations

import json
import random
import time

import pytest

from kvstore.store import Store
from tests.kvstore.factories import assert_no_garbage, gc_now
from tests.kvstore.workers import read_log
from tests.reliability.common import (
    SOAK,
    KillableServer,
    kill,
    metric,
    partial_checkpoints,
    spawn,
    verify_entries,
)


def test_server_kill_loop(tmp_path):
    run_loop(tmp_path, 50)


@pytest.mark.timeout(9000)  # 2026-11-30: 900 cycles took 4711 s; each cycle's check grows with the store
@pytest.mark.skipif(not SOAK, reason="soak tier: KVSTORE_SOAK=1 runs this loop for 1000 cycles "
                    "(about 105 min on 2 cores); CI runs 50")
def test_server_kill_loop_soak(tmp_path):
    run_loop(tmp_path, 1000, soak=True)


def run_loop(tmp_path, cycles: int, soak: bool = False):
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    server = KillableServer(store_dir, tmp_path / "server.log",
                            {"KVSTORE_MAP_NBYTES": str(1 << 20)})
    logs = [tmp_path / "writer-1.jsonl", tmp_path / "writer-2.jsonl"]
    reader_out = tmp_path / "reader.json"
    rng = random.Random(20261129)
    server.start()
    procs = [spawn("remote-writer", server.url, str(log), str(i + 1), log=tmp_path / f"w{i}.out")
             for i, log in enumerate(logs)]
    procs.append(spawn("remote-reader", server.url, str(reader_out), *map(str, logs),
                       log=tmp_path / "reader.out"))
    started = time.monotonic()
    problems = lost = wrong = ckpt_lost = partial = 0
    verified_upto = 0
    try:
        for cycle in range(cycles):
            if cycle:
                server.start()
            time.sleep(rng.uniform(0.1, 0.7))
            server.sigkill()
            entries = [e for log in logs for e in read_log(str(log))]
            if soak and cycle < cycles - 1:
                sample = entries[verified_upto:] + random.sample(entries[:verified_upto],
                                                                 min(300, verified_upto))
            else:
                sample = entries
            verified_upto = len(entries)
            with Store(store_dir) as store:
                report = store.check()
                problems += len(report.problems)
                assert report.ok, f"cycle {cycle}: check found {report.problems[:5]}"
                counts = verify_entries(store, sample)
                lost, wrong, ckpt_lost = (lost + counts["lost"], wrong + counts["wrong"],
                                          ckpt_lost + counts["checkpoints_lost"])
                assert counts == {"lost": 0, "wrong": 0, "checkpoints_lost": 0}, (cycle, counts)
                partial += partial_checkpoints(store)
                assert partial == 0, f"cycle {cycle}: a partial checkpoint is visible"
            if soak and (cycle + 1) % 100 == 0:  # partial figures, should a soak be cut short
                metric("server_kill_loop_progress", cycles_done=cycle + 1,
                       acknowledged_saves=len(entries), lost=lost, wrong_bytes=wrong,
                       checkpoints_lost=ckpt_lost, partial_checkpoints=partial,
                       check_problems=problems, seconds=round(time.monotonic() - started, 1))
    finally:
        for p in procs:
            kill(p)
        if server.proc is not None:
            server.sigkill()
    entries = [e for log in logs for e in read_log(str(log))]
    reader = json.loads(reader_out.read_text())
    with Store(store_dir) as store:
        assert verify_entries(store, entries) == {"lost": 0, "wrong": 0, "checkpoints_lost": 0}
        deleted = gc_now(store)
        assert_no_garbage(store)
        final = store.check(read_data=True)
        assert final.ok, final.problems[:5]
        assert verify_entries(store, entries) == {"lost": 0, "wrong": 0, "checkpoints_lost": 0}
        stats = store.stats()
    reused = sum(1 for e in entries if e.get("reused"))
    metric("server_kill_loop", cycles=cycles, server_starts=server.starts,
           acknowledged_saves=len(entries), reused_pct=round(100 * reused / max(1, len(entries)), 1),
           checkpoints=stats.checkpoint_count, reader_restores_ok=reader["ok"],
           reader_restores_bad=reader["bad"], reader_unavailable=reader["unavailable"],
           lost=lost, wrong_bytes=wrong, checkpoints_lost=ckpt_lost, partial_checkpoints=partial,
           check_problems=problems, gc_deleted_pages=deleted["pages"], orphans_after_gc=0,
           missing_pages_after_gc=0, seconds=round(time.monotonic() - started, 1))
    assert reader["bad"] == 0, reader["bad_examples"]
    assert reader["ok"] > 0, "the reader never restored anything"
    assert len(entries) >= cycles, f"only {len(entries)} saves acknowledged in {cycles} cycles"
