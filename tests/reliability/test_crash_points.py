"""3. Named crash points. Every step registered in kvstore/faults.py STEPS has cases
here (the first test fails when one has none), each run with several seeds; a seed
picks the operation that reaches the step (save, checkpoint delete, GC, eviction), the
occurrence k, and the data. The process exits at the step as a SIGKILL would. Then:
check is clean; what was durable before is intact; the interrupted operation is all
or nothing (blocks, checkpoint, delete, eviction); an acknowledged step is durable; GC
converges; a full read check is clean."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvstore import faults
from tests.kvstore.factories import assert_no_garbage, gc_now, make_store, plan_prefix
from tests.reliability.common import IDENTITY, REPO, SOAK, metric, restore_exact
from tests.reliability.workers import CRASH_A, crash_b

SEEDS = range(12) if SOAK else range(4)
# step -> the (operation, occurrence) pairs that reach it; seed i runs pair i % len, and
# each step runs max(len(SEEDS), len(pairs)) seeds, so every pair runs at least once
OPTIONS = {
    "page_written": [("save", 1)],
    "segments_written": [("save", 1)],
    "segments_synced": [("save", 1)],
    "pages_synced": [("save", 1)],
    "index_before_commit": [("save", 1), ("save", 2), ("save", 3), ("delete", 1), ("gc", 2),
                            ("gc", 1), ("gc", 3), ("evict", 1)],
    "index_committed": [("save", 1), ("save", 2), ("save", 3), ("delete", 1), ("gc", 1),
                        ("gc", 2), ("gc", 3), ("evict", 1)],
    "acknowledged": [("save", 1), ("save", 2)],
    "gc_listed": [("gc", 1)],
    "gc_deleted": [("gc", 1), ("gc", 2)],
    "gc_punched": [("gc", 1), ("gc", 2)],
    "gc_compact_written": [("gc", 1)],  # the loose pages' GC leaves segment 0 mostly dead
    "gc_compact_synced": [("gc", 1)],
    "gc_compacted": [("gc", 1)],
    "gc_segment_removed": [("gc", 1)],
}
CASES = [(step, *options[seed % len(options)], seed) for step, options in OPTIONS.items()
         for seed in range(max(len(SEEDS), len(options)))]  # every option, >= SEEDS seeds
_results: list[dict] = []


def test_every_registered_crash_point_has_cases():
    assert set(OPTIONS) == set(faults.STEPS), (
        f"crash points without a case: {sorted(set(faults.STEPS) - set(OPTIONS))}; "
        f"cases for unknown steps: {sorted(set(OPTIONS) - set(faults.STEPS))}")
    for step in OPTIONS:
        assert sum(1 for c in CASES if c[0] == step) >= 3, f"{step} has fewer than 3 seeds"


def _state(store, seed: int) -> dict:
    records, payload = plan_prefix(IDENTITY, "ns", crash_b(seed))
    blocks = store.has_blocks([r.key for r in records])
    shared = {d for tokens in (CRASH_A, [7] * 9 + [seed], [8] * 11 + [seed])
              for r in plan_prefix(IDENTITY, "ns", tokens)[0] for d in r.pages}
    own = set(payload) - shared
    absent = set(store.missing(list(own)))
    c_records, _ = plan_prefix(IDENTITY, "ns", [8] * 11 + [seed])
    c_blocks = store.has_blocks([r.key for r in c_records])
    names = {c.name for c in store.list_checkpoints("ns")}
    return {"b_blocks": blocks, "b_pages_all": not absent, "b_pages_none": absent == own,
            "b_ckpt": "b" in names, "a2": "a2" in names, "c_blocks": c_blocks}


@pytest.mark.parametrize("step,op,k,seed", CASES, ids=[f"{s}:{k}-{o}-seed{d}" for s, o, k, d in CASES])
def test_crash_point(tmp_path, step, op, k, seed):
    target = f"{step}:{k}"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "tests.reliability.workers", "crash-op",
                           str(tmp_path), target, op, str(seed)], cwd=REPO, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == faults.CRASH_EXIT_CODE, (
        f"{target} during {op} never fired (exit {proc.returncode}):\n{proc.stdout.decode()[-1500:]}"
        f"{proc.stderr.decode()[-1500:]}")
    with make_store(tmp_path) as store:
        report = store.check()
        assert report.ok, report.problems[:5]
        assert restore_exact(store, "ns", CRASH_A) == (len(CRASH_A), True)
        assert store.get_checkpoint("ns", "a").tokens == tuple(CRASH_A)
        st = _state(store, seed)
        assert all(st["b_blocks"]) or not any(st["b_blocks"]), "a partial block commit"
        assert all(st["c_blocks"]) or not any(st["c_blocks"]), "a partial eviction"
        if st["b_ckpt"]:
            assert all(st["b_blocks"])
            assert restore_exact(store, "ns", crash_b(seed)) == (len(crash_b(seed)), True)
        if op == "save" and step == "page_written":
            assert st["b_pages_none"] and not any(st["b_blocks"])
        if op == "save" and step in ("segments_written", "segments_synced"):
            assert st["b_pages_none"] and not any(st["b_blocks"])  # nothing acknowledged
        if op == "save" and step == "pages_synced":
            assert st["b_pages_all"] and not any(st["b_blocks"])
        if op == "save" and step == "acknowledged":
            assert all(st["b_blocks"]) and (k == 1 or st["b_ckpt"])
        if op != "delete":
            assert st["a2"]
        if op != "evict":
            assert all(st["c_blocks"])
        gc_now(store)
        assert_no_garbage(store)
        assert store.check(read_data=True).ok
        assert restore_exact(store, "ns", CRASH_A) == (len(CRASH_A), True)
    _results.append({"step": step, "op": op})
    if len(_results) == len(CASES):
        metric("crash_points", steps=len(OPTIONS), cases=len(CASES),
               min_seeds_per_step=len(SEEDS), operations="save/delete/gc/evict", fired=len(_results), check_problems=0,
               partial_records=0, lost_acknowledged=0)
    assert time.monotonic() - started < 60
