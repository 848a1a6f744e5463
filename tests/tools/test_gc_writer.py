"""`kvstore gc` while another process keeps saving: nothing referenced is deleted.

The writer is tests/kvstore/workers.py's: random prompts, ~30% sharing blocks with
earlier ones, some checkpoints, each save logged (fsync) only once acknowledged. GC
runs through the CLI with a short grace period over and over while it writes, and
also has real garbage to collect (loose pages uploaded before and never committed).
Afterwards every acknowledged save restores byte-identically and check --read-data is
clean."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from kvstore.ids import page_digest
from kvstore.store import Store
from tests.kvstore.factories import wait_for
from tests.kvstore.workers import read_log, verify_acknowledged
from tests.tools.helpers import run
from tools.commands.common import EXIT_CONFLICT, EXIT_OK

ROOT = Path(__file__).resolve().parents[2]
GC_RUNS_S = 4.0


def test_gc_while_a_writer_saves_deletes_nothing_referenced(tmp_path):
    path, log = tmp_path / "store", tmp_path / "writer.log"
    loose = [os.urandom(700) for _ in range(40)]
    with Store(path) as store:
        store.put_pages({page_digest(p): p for p in loose})
    time.sleep(1.1)  # the loose pages are now older than the 1 s grace period
    writer = subprocess.Popen([sys.executable, "-m", "tests.kvstore.workers", "writer", str(path),
                               str(log), "7"], cwd=ROOT)
    deleted, runs, conflicts = 0, 0, 0
    try:
        wait_for(lambda: len(read_log(str(log))) >= 5, timeout_s=60)
        deadline = time.monotonic() + GC_RUNS_S
        while time.monotonic() < deadline:
            ran = run("gc", "--grace", "1s", "--json", "-d", path)
            assert ran.code in (EXIT_OK, EXIT_CONFLICT), ran.stderr
            if ran.code == EXIT_OK:
                deleted += ran.json()["deleted"]["pages"]
                runs += 1
            else:
                conflicts += 1
        assert writer.poll() is None, "the writer died while GC ran"
    finally:
        writer.terminate()
        writer.wait(30)
    entries = read_log(str(log))
    assert runs >= 2 and len(entries) >= 10, (runs, len(entries))
    assert deleted >= len(loose), f"GC deleted {deleted} pages; the {len(loose)} loose ones were garbage"
    with Store(path) as store:
        verify_acknowledged(store, entries)
        report = store.check(read_data=True)
        assert report.problems == [], report.problems[:5]
