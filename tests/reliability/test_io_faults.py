"""4. I/O faults at the boundary the store owns (kvstore/fileio.py): fail the k-th
write, fsync, rename or unlink during save, restore, GC and export, for every k the
operation reaches. Each time: a typed error (StoreIOError; StoreFull for ENOSPC), 0
partial records (a block commit and a checkpoint are all or nothing, an export file is
absent or complete), a clean check once the fault is lifted, and the operation then
succeeds. A failed fsync is never retried into a success: the failing commit is the
operation's last.

LMDB's own page writes and syncs happen inside mdb_txn_commit; fileio.commit_txn
injects at that boundary by aborting the transaction, as LMDB does when its pwrite or
fdatasync fails (docs/reliability.md)."""

from __future__ import annotations

import errno

import lmdb
import pytest

import kvstore.store as store_module
from kvstore import fileio
from kvstore.errors import GCAborted, IntegrityError, StoreFull, StoreIOError
from kvstore.ids import page_digest
from tests.kvstore.factories import (
    assert_no_garbage,
    gc_now,
    make_identity,
    make_store,
    plan_prefix,
    save_prefix,
)
from tests.reliability.common import metric, restore_exact
from tools.portable import export_checkpoint, read_export

IDENTITY = make_identity()


@pytest.fixture(autouse=True)
def _no_leftover_faults():
    fileio.clear()
    yield
    fileio.clear()


def _count(fn) -> dict:
    before = dict(fileio.calls)
    fn()
    return {op: fileio.calls[op] - before[op] for op in fileio.OPS}


def _all_or_nothing(store, namespace, tokens, checkpoint) -> None:
    records, _ = plan_prefix(IDENTITY, namespace, tokens)
    present = store.has_blocks([r.key for r in records])
    assert all(present) or not any(present), f"a partial block commit: {present}"
    names = {c.name for c in store.list_checkpoints(namespace)}
    if checkpoint in names:
        assert all(present)
        assert restore_exact(store, namespace, tokens) == (len(tokens), True)


@pytest.mark.parametrize("op", ["write", "fsync"])
def test_save_fault_at_every_commit(tmp_path, op):
    faults_hit = typed = 0
    with make_store(tmp_path) as store:
        save_prefix(store, IDENTITY, "ns", list(range(30)), checkpoint="warm")  # formats etc.
        n = _count(lambda: save_prefix(store, IDENTITY, "ns", list(range(1000, 1030)),
                                       checkpoint="probe"))[op]
        assert n >= 3, f"a save reaches {n} {op} calls"
        for k in range(1, n + 1):
            tokens = list(range(10_000 * k, 10_000 * k + 30))
            fileio.inject(op, k)
            before = dict(fileio.calls)
            with pytest.raises((StoreIOError, StoreFull)) as err:
                save_prefix(store, IDENTITY, "ns", tokens, checkpoint=f"c{k}")
            faults_hit += 1
            typed += isinstance(err.value, StoreIOError)
            # never retried into a success: the failed commit was the save's last
            assert fileio.calls[op] - before[op] == k
            fileio.clear()
            _all_or_nothing(store, "ns", tokens, f"c{k}")
            assert store.check().ok
            save_prefix(store, IDENTITY, "ns", tokens, checkpoint=f"c{k}")  # lifted: it works
            assert restore_exact(store, "ns", tokens) == (len(tokens), True)
        gc_now(store)
        assert_no_garbage(store)
        assert store.check(read_data=True).ok
    metric("io_fault_save", op=op, commits_per_save=n, faults_injected=faults_hit,
           typed_errors=typed, partial_records=0, retried_into_success=0)


def test_enospc_at_commit_is_store_full(tmp_path):
    with make_store(tmp_path) as store:
        fileio.inject("write", 1, errno.ENOSPC)
        with pytest.raises(StoreFull):
            save_prefix(store, IDENTITY, "ns", list(range(30)))
        fileio.clear()
        assert store.check().ok
        save_prefix(store, IDENTITY, "ns", list(range(30)))


@pytest.mark.parametrize("op", ["write", "fsync"])
def test_restore_under_faults(tmp_path, monkeypatch, op):
    """A restore writes only bookkeeping (LRU touches, quarantine). With a fault armed:
    intact pages still restore exactly; a damaged page is refused with a typed error
    and never returned; after the fault is lifted it is quarantined as usual."""
    monkeypatch.setattr(store_module, "TOUCH_FLUSH_S", 0.0)  # every lookup flushes touches
    tokens = list(range(30))
    with make_store(tmp_path) as store:
        saved = save_prefix(store, IDENTITY, "ns", tokens)
        victim = saved.records[-1].pages[0]  # restores of the first block never read it
        restore_exact(store, "ns", tokens)
    env = lmdb.open(str(tmp_path), max_dbs=16)
    db = env.open_db(b"pages", create=False)
    with env.begin(write=True, db=db) as txn:
        damaged = bytearray(txn.get(bytes(victim)))
        damaged[-1] ^= 0x40
        txn.put(bytes(victim), bytes(damaged))
    env.close()
    outcomes = {}
    with make_store(tmp_path) as store:
        fileio.inject(op, 1)
        try:
            outcomes["intact"] = restore_exact(store, "ns", tokens[:4]) == (4, True)
        except (StoreIOError, StoreFull):
            outcomes["intact"] = "typed_error"
        fileio.inject(op, 1)
        with pytest.raises((IntegrityError, StoreIOError)) as err:
            store.read_pages([victim])
        outcomes["damaged"] = type(err.value).__name__
        fileio.clear()
        with pytest.raises(IntegrityError):
            store.read_pages([victim])
        assert store.stats().quarantined_count == 1
        report = store.check(read_data=True)
        assert [p.kind for p in report.problems] == ["page_quarantined"]
    metric("io_fault_restore", op=op, intact_restore=outcomes["intact"],
           damaged_read=outcomes["damaged"], damaged_bytes_returned=0)
    assert outcomes["intact"] is True, "a failed LRU bookkeeping write failed a healthy restore"


@pytest.mark.parametrize("op", ["open", "write", "fsync"])
def test_gc_fault(tmp_path, monkeypatch, op):
    with make_store(tmp_path) as store:
        tokens = list(range(30))
        save_prefix(store, IDENTITY, "ns", tokens, checkpoint="keep")
        loose = {page_digest(bytes([i % 256, i // 256]) * 100): bytes([i % 256, i // 256]) * 100
                 for i in range(600)}
        store.put_pages(loose)
        n = 1 if op == "open" else 3  # three delete batches, then the orphan commit
        outcomes = []
        for k in range(1, n + 2):
            fileio.inject(op, k)
            try:
                gc_now(store)
                outcomes.append("ok")
            except (StoreIOError, StoreFull) as exc:
                outcomes.append(type(exc).__name__)
            except GCAborted:
                outcomes.append("aborted")
            fileio.clear()
            assert store.check().ok
            assert restore_exact(store, "ns", tokens) == (len(tokens), True)
            store.put_pages(loose)
        gc_now(store)
        assert_no_garbage(store)
        assert store.check(read_data=True).ok
    metric("io_fault_gc", op=op, outcomes="/".join(outcomes), partial_records=0,
           referenced_pages_lost=0)
    assert outcomes[0] == "StoreIOError"


@pytest.mark.parametrize("op", ["open", "write", "fsync", "rename", "unlink"])
def test_export_fault(tmp_path, op):
    with make_store(tmp_path / "store") as store:
        save_prefix(store, IDENTITY, "ns", list(range(30)), checkpoint="c")
        ckpt = store.get_checkpoint("ns", "c")
        target = tmp_path / "c.safetensors"
        n = _count(lambda: export_checkpoint(store, ckpt, tmp_path / "probe.safetensors"))[op]
        target.write_bytes(b"the previous export")
        results = []
        for k in range(1, n + 1):
            fileio.inject(op, k)
            try:
                export_checkpoint(store, ckpt, target)
                results.append("ok")
            except (StoreIOError, StoreFull) as exc:
                results.append(type(exc).__name__)
                if "syncing its directory" in str(exc):  # renamed: complete, maybe not durable
                    read_export(target)
                else:
                    assert target.read_bytes() == b"the previous export"
                    continue
            target.write_bytes(b"the previous export")
            fileio.clear()
            leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".partial")]
            if op != "unlink":
                assert leftovers == [], leftovers
        export_checkpoint(store, ckpt, target)
        read_export(target)  # verifies every byte
    metric("io_fault_export", op=op, calls_per_export=n, outcomes="/".join(results) or "none",
           partial_files_published=0)
    if op != "unlink" and n:
        assert all(r == "StoreIOError" for r in results)
