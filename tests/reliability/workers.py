"""Subprocesses of the reliability suite: `python -m tests.reliability.workers CMD ...`.

    serve                                   the service, configured from KVSTORE_* env
    remote-writer URL LOG SEED              save random prefixes through RemoteStore until
                                            killed; log each acknowledged save (fsynced)
    remote-reader URL OUT LOG...            restore random acknowledged saves until killed;
                                            write {"ok", "bad", "unavailable"} to OUT
    local-writer STORE LOG SEED GARBAGE [PAUSE_S]
                                            save through the embedded Store; also upload
                                            GARBAGE loose pages per save that are never
                                            committed (abandoned uploads, for GC to find);
                                            sleep PAUSE_S between saves
    gc-loop STORE GRACE                     plan + execute GC over and over until killed
    hold-reader STORE                       open a read transaction, print "ready", sleep
    crash-op STORE TARGET OP SEED           set up a store, then run OP (save, delete, gc,
                                            evict) with KVSTORE_CRASH_AT=TARGET; exits with
                                            faults.CRASH_EXIT_CODE when it fires, 0 if not

Writers follow the documented protocol: a commit refused with MissingReferences (GC
took pages the writer uploaded but had not committed) uploads them again and retries.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from kvstore.errors import GCAborted, KVStoreError, MissingReferences
from tests.kvstore.factories import plan_prefix
from tests.kvstore.workers import IDENTITY, random_prompt
from tests.reliability.common import restore_exact

RETRY_SLEEP_S = 0.05


def save_with_retry(store, namespace, tokens, checkpoint=None):
    """save_prefix with the writer's side of the GC protocol (see the module docstring)."""
    from kvstore.records import Checkpoint
    store.put_format(IDENTITY)
    records, payload = plan_prefix(IDENTITY, namespace, tokens)
    for _ in range(20):
        known = store.has_blocks([r.key for r in records])
        needed = list(dict.fromkeys(d for r, k in zip(records, known, strict=True) if not k for d in r.pages))
        absent = store.missing(needed)
        if absent:
            store.put_pages({d: payload[d] for d in absent})
        try:
            store.commit_blocks(records)
            break
        except MissingReferences:
            continue
    else:
        raise AssertionError("commit kept missing pages after 20 re-uploads")
    if checkpoint:
        store.create_checkpoint(Checkpoint(checkpoint, namespace, IDENTITY.format_id,
                                           tuple(tokens), tuple(r.key for r in records)),
                                replace=True)


def _log_line(log, entry: dict) -> None:
    log.write(json.dumps(entry) + "\n")
    log.flush()
    os.fsync(log.fileno())


def remote_writer(url: str, log_path: str, seed: str) -> None:
    from kvstore.client import RemoteStore
    rng = random.Random(int(seed))
    history: list = []
    first_blocks: set = set()
    store = RemoteStore(url, timeout_s=10.0, retries=1)
    with open(log_path, "a") as log:
        for i in range(10**9):
            longer = [h for h in history if len(h[1]) >= 4]
            if longer and rng.random() < 0.3:  # re-use at least one stored block
                ns, base = rng.choice(longer)
                tokens = base[: rng.randrange(4, len(base) + 1)] + \
                    [rng.randrange(50_000) for _ in range(rng.randrange(1, 10))]
            else:
                ns, tokens = random_prompt(rng, [])
            first = (ns, tuple(tokens[:4]))
            reused = len(tokens) >= 4 and first in first_blocks  # its first block is stored
            name = f"w{seed}-{i}" if rng.random() < 0.3 else None
            try:
                save_with_retry(store, ns, tokens, name)
            except (KVStoreError, OSError, Exception):  # server down or killed mid-request
                time.sleep(RETRY_SLEEP_S)
                continue
            _log_line(log, {"ns": ns, "tokens": tokens, "checkpoint": name, "reused": reused})
            history.append((ns, tokens))
            if len(tokens) >= 4:
                first_blocks.add(first)


def _read_entries(paths: list[str]) -> list[dict]:
    from tests.kvstore.workers import read_log
    return [e for p in paths for e in read_log(p)]


def remote_reader(url: str, out_path: str, *logs: str) -> None:
    from kvstore.client import RemoteStore
    rng = random.Random(7)
    counts = {"ok": 0, "bad": 0, "unavailable": 0, "bad_examples": []}
    store = RemoteStore(url, timeout_s=10.0, retries=1)
    last_write = 0.0
    while True:
        entries = _read_entries(list(logs))
        if entries:
            e = rng.choice(entries)
            try:
                matched, exact = restore_exact(store, e["ns"], e["tokens"])
            except (KVStoreError, OSError, Exception):
                counts["unavailable"] += 1
                time.sleep(RETRY_SLEEP_S)
            else:
                if matched == len(e["tokens"]) and exact:
                    counts["ok"] += 1
                else:
                    counts["bad"] += 1
                    counts["bad_examples"] = (counts["bad_examples"] + [e])[-5:]
        else:
            time.sleep(RETRY_SLEEP_S)
        if time.monotonic() - last_write > 0.2:
            tmp = out_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(counts, f)
            os.replace(tmp, out_path)
            last_write = time.monotonic()


def local_writer(store_dir: str, log_path: str, seed: str, garbage: str, pause_s: str = "0") -> None:
    from tests.kvstore.factories import make_store
    rng = random.Random(int(seed))
    history: list = []
    store = make_store(store_dir)
    with open(log_path, "a") as log:
        for i in range(10**9):
            ns, tokens = random_prompt(rng, history)
            name = f"l{seed}-{i}" if rng.random() < 0.3 else None
            save_with_retry(store, ns, tokens, name)
            _log_line(log, {"ns": ns, "tokens": tokens, "checkpoint": name})
            history.append((ns, tokens))
            if int(garbage):
                loose = [rng.randbytes(200) for _ in range(int(garbage))]
                from kvstore.ids import page_digest
                store.put_pages({page_digest(p): p for p in loose})
            time.sleep(float(pause_s))


def gc_loop(store_dir: str, grace: str) -> None:
    from tests.kvstore.factories import make_store
    store = make_store(store_dir)
    while True:
        try:
            done = store.plan_gc(float(grace)).execute()
        except GCAborted:
            continue
        print(json.dumps({"gc_done": done["pages"]}), flush=True)
        time.sleep(0.01)


def hold_reader(store_dir: str) -> None:
    from tests.kvstore.factories import make_store
    store = make_store(store_dir)
    with store.lmdb.read():
        print("ready", flush=True)
        time.sleep(3600)


CRASH_A = list(range(1, 14))


def crash_b(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [100_000 + rng.randrange(100_000) for _ in range(13 + seed % 7)]


def crash_setup(store, seed: int) -> None:
    """A (checkpoint a), A2 (checkpoint a2, deleted by op delete), C (unpinned: evict
    removes it), and 300 loose pages (more than one GC batch)."""
    from kvstore.ids import page_digest
    from tests.kvstore.factories import save_prefix
    save_prefix(store, IDENTITY, "ns", CRASH_A, checkpoint="a")
    save_prefix(store, IDENTITY, "ns", [7] * 9 + [seed], checkpoint="a2")
    save_prefix(store, IDENTITY, "ns", [8] * 11 + [seed])
    rng = random.Random(seed)
    loose = [rng.randbytes(300) for _ in range(300)]
    store.put_pages({page_digest(p): p for p in loose})


def crash_op(store_dir: str, target: str, op: str, seed: str) -> None:
    from tests.kvstore.factories import gc_now, make_store, save_prefix
    store = make_store(store_dir)
    crash_setup(store, int(seed))
    os.environ["KVSTORE_CRASH_AT"] = target
    if op == "save":
        save_prefix(store, IDENTITY, "ns", crash_b(int(seed)), checkpoint="b")
    elif op == "delete":
        store.delete_checkpoint("ns", "a2")
    elif op == "gc":
        gc_now(store)
    elif op == "evict":
        store.evict(0)
    else:
        raise SystemExit(f"unknown op {op}")
    os._exit(0)  # the crash point never fired


def serve() -> None:
    from api.server import serve as run_server
    from api.settings import Settings
    run_server(Settings.load())


COMMANDS = {"serve": serve, "remote-writer": remote_writer, "remote-reader": remote_reader,
            "local-writer": local_writer, "gc-loop": gc_loop, "hold-reader": hold_reader,
            "crash-op": crash_op}

if __name__ == "__main__":
    command, *args = sys.argv[1:]
    COMMANDS[command](*args)
