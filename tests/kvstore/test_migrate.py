"""kvstore/migrate.py: the golden schema-1 fixture (tests/kvstore/testdata) migrated to
schema 2, byte-identical afterwards; refusals; crashes at named points and kills, each
leaving a store that opens and checks clean, and a run that resumes.

What "byte-identical" means here: every page value read back at schema 2 (bytes 80.. of
its segment record) is the v1 LMDB value, byte for byte; every page the store serves
equals what the v1 store served; every database other than `pages`, `quarantine` and
`meta` is unchanged entry for entry, and `meta` differs only by schema_version and the
segment_tail keys. Schema-1 stores other than the fixture are made from it by writing
v1 values with raw LMDB (today's Store writes schema 2 only)."""

from __future__ import annotations

import os
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import blake3
import lmdb
import pytest

from kvstore import faults
from kvstore.errors import IntegrityError, NeedsMigration, StoreCorrupt
from kvstore.migrate import STATE_KEY, MigrationRefused, MigrationState, plan_migration
from kvstore.pages import Compression, encode_page
from kvstore.segments import Location, SegmentFiles
from kvstore.store import Store
from tests.kvstore.factories import restore_prefix, save_prefix
from tests.kvstore.test_v1_fixture import IDENTITY, ORPHAN, SAVES, unpack

ROOT = Path(__file__).resolve().parents[2]
U64 = struct.Struct(">Q")
SMALL_SEGMENT = 64 << 10  # the fixture's 20 pages then fill more than one segment


# -- helpers ---------------------------------------------------------------------------------
def raw_env(path: Path) -> lmdb.Environment:
    return lmdb.open(str(path), max_dbs=32, map_size=1 << 30)


def dump(path: Path) -> dict[str, dict[bytes, bytes]]:
    """Every named database of the environment, entry by entry (no Store involved)."""
    env = raw_env(path)
    try:
        with env.begin() as txn:
            names = [bytes(k) for k in txn.cursor().iternext(values=False)]
        out = {}
        for name in names:
            db = env.open_db(name)
            with env.begin() as txn:
                out[name.decode()] = {bytes(k): bytes(v) for k, v in txn.cursor(db=db)}
        return out
    finally:
        env.close()


def served(path: Path) -> dict[bytes, bytes]:
    """Every page the store serves (read-only open), by digest."""
    with Store(path, readonly=True) as store:
        with store.index.read(buffers=True) as index:
            digests = [bytes(d) for d, _ in index.pages()]
        return dict(zip(digests, store.read_pages(digests), strict=True))


def schema_version(path: Path) -> int:
    return U64.unpack(dump(path)["meta"][b"schema_version"])[0]


def assert_migrated_byte_identical(path: Path, before: dict, pages_before: dict) -> None:
    """before: dump() of the v1 store; pages_before: served() of it."""
    after = dump(path)
    assert schema_version(path) == 2
    for name, entries in before.items():
        if name not in ("pages", "quarantine", "meta"):
            assert after[name] == entries, f"database {name} changed"
    meta = {k: v for k, v in after["meta"].items() if not k.startswith(b"segment_tail/")}
    before_meta = {k: v for k, v in before["meta"].items() if k != STATE_KEY}  # a resumed run's
    assert meta == {**before_meta, b"schema_version": U64.pack(2)}
    assert STATE_KEY not in after["meta"]
    files = SegmentFiles(path / "segments", readonly=True)
    try:
        assert set(after["pages"]) == set(before["pages"])
        for digest, value in before["pages"].items():
            loc = Location.unpack(after["pages"][digest])
            assert bytes(files.page_value(loc)) == value, f"page {digest.hex()} differs"
        for digest, value in before.get("quarantine", {}).items():
            loc = Location.unpack(after["quarantine"][digest])
            assert bytes(files.page_value(loc)) == value
    finally:
        files.close()
    assert served(path) == pages_before
    with Store(path) as store:
        assert store.check(read_data=True).problems == []
        for namespace, tokens, _ in SAVES:
            assert restore_prefix(store, IDENTITY, namespace, tokens)[0] == len(tokens)
        assert store.get_checkpoint("default", "c").tokens == SAVES[0][1]


def add_v1_pages(path: Path, payloads: list[bytes]) -> list[bytes]:
    """Write unreferenced pages into a schema-1 store as its own code did: the v1 value,
    its sizes, its grace time and the byte counters (so check stays clean)."""
    env = raw_env(path)
    dbs = {n: env.open_db(n.encode()) for n in ("meta", "pages", "page_sizes", "page_times")}
    digests = []
    with env.begin(write=True) as txn:
        for payload in payloads:
            digest = blake3.blake3(payload).digest()
            header, stored = encode_page(payload, Compression(), digest)
            txn.put(digest, header + bytes(stored), db=dbs["pages"])
            txn.put(digest, struct.pack(">QQ", len(payload), 48 + len(stored)), db=dbs["page_sizes"])
            txn.put(digest, U64.pack(time.time_ns()), db=dbs["page_times"])
            for name, delta in ((b"raw_nbytes", len(payload)), (b"stored_nbytes", 48 + len(stored))):
                old = txn.get(name, db=dbs["meta"])
                txn.put(name, U64.pack((U64.unpack(old)[0] if old else 0) + delta), db=dbs["meta"])
            digests.append(digest)
    env.close()
    return digests


def migrate_in_subprocess(path: Path, env_extra: dict, *, batch_pages: int = 4,
                          wait: bool = True) -> subprocess.Popen:
    """plan + execute in a child; it prints one line per batch copied."""
    code = ("import sys; from kvstore.migrate import plan_migration; "
            f"plan_migration(sys.argv[1]).execute(lambda n, b: print(n, flush=True), "
            f"batch_pages={batch_pages}, segment_nbytes={SMALL_SEGMENT})")
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env_extra},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if wait:
        proc.wait(60)
    return proc


@pytest.fixture
def v1(tmp_path):
    path = unpack(tmp_path / "v1")
    return path, dump(path), served(path)


# -- the fixture, byte-identical ---------------------------------------------------------
def test_the_v1_fixture_migrates_byte_identical(v1):
    path, before, pages_before = v1
    with pytest.raises(NeedsMigration):
        with Store(path) as store:  # read-write at version 1: reads work, writes refuse
            save_prefix(store, IDENTITY, "default", [7, 7, 7, 7])
    plan = plan_migration(path, segment_nbytes=SMALL_SEGMENT)
    assert plan.ok and not plan.nothing_to_do and plan.resume is None
    assert (plan.pages, plan.pages_left, plan.quarantined) == (20, 20, 0)
    assert plan.stored_nbytes == sum(len(v) for v in before["pages"].values())
    seen = []
    result = plan.execute(lambda n, nbytes: seen.append((n, nbytes)), batch_pages=3,
                          segment_nbytes=SMALL_SEGMENT)
    assert result["pages"] == result["copied_pages"] == 20 and not result["damaged_pages"]
    assert result["segments"] >= 2 and result["dead_records"] == 0
    assert [n for n, _ in seen] == [3] * 6 + [2]
    assert sum(b for _, b in seen) == plan.stored_nbytes
    assert_migrated_byte_identical(path, before, pages_before)
    assert plan_migration(path).nothing_to_do
    with Store(path) as store:  # a migrated store takes writes, and stays clean
        save_prefix(store, IDENTITY, "default", list(range(200, 230)))
        assert restore_prefix(store, IDENTITY, "default", list(range(200, 230)))[0] == 30
        assert store.check(read_data=True).problems == []


def test_compaction_shrinks_data_mdb_and_no_compact_keeps_it(tmp_path):
    sizes = {}
    for compact in (True, False):
        path = unpack(tmp_path / f"v1-{compact}")
        add_v1_pages(path, [os.urandom(64 << 10) for _ in range(48)])  # 3 MiB of bodies
        pages_before = served(path)
        size_before = (path / "data.mdb").stat().st_size
        result = plan_migration(path).execute(compact=compact)
        assert result["compacted"] is compact
        sizes[compact] = (path / "data.mdb").stat().st_size
        assert result["data_file_nbytes_after"] == sizes[compact]
        assert served(path) == pages_before
        with Store(path, readonly=True) as store:
            assert store.check(read_data=True).problems == []
        assert not (path / "migrate-compact.tmp").exists()
    assert sizes[False] >= size_before  # LMDB freed the bodies but keeps the file
    assert sizes[True] < size_before // 4


# -- what the plan refuses ---------------------------------------------------------------------
def test_the_plan_writes_nothing(v1):
    path, before, _ = v1
    raw = (path / "data.mdb").read_bytes()
    plan_migration(path)
    assert (path / "data.mdb").read_bytes() == raw
    assert not (path / "segments").exists()


def test_refusals(v1, monkeypatch):
    path, _, _ = v1
    (path / "segments").mkdir()
    (path / "segments" / "00000000.seg").write_bytes(bytes(4096))
    plan = plan_migration(path)
    assert [r.kind for r in plan.refusals] == ["foreign_segments"]
    with pytest.raises(MigrationRefused) as info:
        plan.execute()
    assert info.value.kind == "foreign_segments"
    (path / "segments" / "00000000.seg").unlink()

    monkeypatch.setattr("kvstore.migrate._fs_free", lambda p: 1 << 20)
    plan = plan_migration(path)
    assert [r.kind for r in plan.refusals] == ["no_space"] and "needs" in plan.refusals[0].message
    monkeypatch.undo()

    env = raw_env(path)
    pages = env.open_db(b"pages")
    with env.begin(write=True) as txn:
        digest, value = next(iter(txn.cursor(db=pages)))
        digest, value = bytes(digest), bytearray(value)
        value[0] ^= 0x01  # the page header's magic: its length cannot be read
        txn.put(digest, bytes(value), db=pages)
    env.close()
    plan = plan_migration(path)
    assert [r.kind for r in plan.refusals] == ["damaged_header"]
    assert digest.hex() in plan.refusals[0].message
    assert schema_version(path) == 1 and not (path / "segments" / "00000001.seg").exists()


def test_a_store_open_in_another_process_is_refused(v1):
    path, _, _ = v1
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from kvstore.store import Store; "
         "s = Store(sys.argv[1], readonly=True); s.stats(); print('open', flush=True); "
         "time.sleep(60)", str(path)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"open"
        plan = plan_migration(path)
        assert [r.kind for r in plan.refusals] == ["in_use"]
        assert str(holder.pid) in plan.refusals[0].message
    finally:
        holder.kill()
        holder.wait()
    assert plan_migration(path).ok  # its reader slot is cleared once it is gone


def test_the_lock_probe_sees_other_processes_and_holds_new_ones_off(v1):
    """What the compaction's rename relies on: EnvLockProbe names another process that
    has the environment open (not this one), and while exclude() holds, a process that
    opens the store waits in LMDB's open until this one closes its environment."""
    from kvstore.lmdbenv import LmdbEnv
    from kvstore.migrate import EnvLockProbe

    path, _, _ = v1
    probe = EnvLockProbe(path)
    env = LmdbEnv(path)
    try:
        assert probe.holder() is None  # our own environment does not count
        assert probe.exclude()
        opener = subprocess.Popen(
            [sys.executable, "-c", "import sys; from kvstore.store import Store; "
             "Store(sys.argv[1], readonly=True).close(); print('opened', flush=True)", str(path)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE)
        time.sleep(1.5)
        assert opener.poll() is None, "a process opened the store while it was excluded"
    finally:
        env.close()  # releases the exclusion (POSIX locks go with any close)
        probe.close()
    assert opener.wait(30) == 0 and opener.stdout.read().strip() == b"opened"


def test_a_held_writer_lock_refuses_execute(v1):
    path, _, _ = v1
    import fcntl

    fd = os.open(path / "segments.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a schema-2 save, or another migration
        with pytest.raises(MigrationRefused) as info:
            plan_migration(path).execute()
        assert info.value.kind == "busy" and "segments.lock" in str(info.value)
    finally:
        os.close(fd)
    assert schema_version(path) == 1 and not (path / "segments").exists()


def test_a_schema_newer_than_two_is_refused_and_zero_is_damage(v1):
    path, _, _ = v1
    for version in (3, 0):
        env = raw_env(path)
        with env.begin(write=True) as txn:
            txn.put(b"schema_version", U64.pack(version), db=env.open_db(b"meta", txn=txn))
        env.close()
        raw = (path / "data.mdb").read_bytes()
        if version == 3:
            plan = plan_migration(path)
            assert [r.kind for r in plan.refusals] == ["newer_version"]
            with pytest.raises(MigrationRefused):
                plan.execute()
        else:
            with pytest.raises(StoreCorrupt, match="schema_version is 0"):
                plan_migration(path)
        assert (path / "data.mdb").read_bytes() == raw and not (path / "segments").exists()


def test_pages_older_than_page_sizes_get_the_sizes_schema_one_counted(v1):
    """Stores from before the page_sizes database hold pages without an entry (schema 1
    recovers the sizes from the record); schema 2 needs one for every page."""
    path, before, pages_before = v1
    env = raw_env(path)
    sizes_db = env.open_db(b"page_sizes")
    with env.begin(write=True) as txn:
        dropped = sorted(before["page_sizes"])[::3]
        for digest in dropped:
            txn.delete(digest, db=sizes_db)
    env.close()
    result = plan_migration(path).execute()
    assert result["sizes_added"] == len(dropped) > 0
    assert dump(path)["page_sizes"] == before["page_sizes"]
    assert_migrated_byte_identical(path, before, pages_before)


# -- carried as they are ---------------------------------------------------------------------
def test_damaged_and_quarantined_pages_are_carried_unchanged(v1):
    path, _, _ = v1
    orphan = blake3.blake3(ORPHAN).digest()
    env = raw_env(path)
    dbs = {n: env.open_db(n.encode()) for n in ("meta", "pages", "page_sizes", "page_times",
                                                "quarantine")}
    with env.begin(write=True) as txn:  # quarantine the unreferenced page, as a v1 read would
        value = bytes(txn.get(orphan, db=dbs["pages"]))
        raw_n, stored_n = struct.unpack(">QQ", txn.get(orphan, db=dbs["page_sizes"]))
        txn.put(orphan, value, db=dbs["quarantine"])
        for name in ("pages", "page_sizes", "page_times"):
            txn.delete(orphan, db=dbs[name])
        for name, n in ((b"raw_nbytes", raw_n), (b"stored_nbytes", stored_n)):
            txn.put(name, U64.pack(U64.unpack(txn.get(name, db=dbs["meta"]))[0] - n), db=dbs["meta"])
        damaged, body = next((bytes(k), bytearray(v)) for k, v in txn.cursor(db=dbs["pages"])
                             if len(v) > 100)
        body[60] ^= 0x10  # a stored byte: the header is intact, the xxh3 fails
        txn.put(damaged, bytes(body), db=dbs["pages"])
    env.close()
    before = dump(path)
    result = plan_migration(path).execute()
    assert [d["digest"] for d in result["damaged_pages"]] == [damaged.hex()]
    assert result["quarantined"] == 1
    after = dump(path)
    files = SegmentFiles(path / "segments", readonly=True)
    assert bytes(files.page_value(Location.unpack(after["pages"][damaged]))) == bytes(body)
    assert bytes(files.page_value(Location.unpack(after["quarantine"][orphan]))) == value
    files.close()
    assert {k: v for k, v in after["refs"].items()} == before["refs"]
    with Store(path, readonly=True) as store:
        problems = store.check(read_data=True).problems
        assert [(p.kind, p.object) for p in problems] == [("page_damaged", damaged.hex())]
        with pytest.raises(IntegrityError):
            store.read_pages([damaged])


# -- crashes, kills, resumption ------------------------------------------------------------------
# The fixture's 20 pages in batches of 4: commits 1..5 record progress, commit 6 switches.
CRASHES = {
    "index_committed:2": (1, 8),       # after the second batch's progress commit
    "index_before_commit:3": (1, 8),   # third batch appended and synced, progress not committed
    "index_before_commit:6": (1, 20),  # the switch transaction, not committed
    "index_committed:6": (2, None),    # switched, before compaction
}


@pytest.mark.parametrize("crash_at", sorted(CRASHES))
def test_a_crash_leaves_a_store_that_opens_checks_clean_and_resumes(v1, crash_at):
    path, before, pages_before = v1
    proc = migrate_in_subprocess(path, {"KVSTORE_CRASH_AT": crash_at})
    output = proc.stdout.read().decode()
    assert proc.returncode == faults.CRASH_EXIT_CODE, output[-2000:]
    version, copied = CRASHES[crash_at]
    assert schema_version(path) == version
    assert served(path) == pages_before  # opens (read-only at version 1), serves every page
    with Store(path, readonly=True) as store:
        assert store.check(read_data=True).problems == []
    plan = plan_migration(path)
    if version == 1:
        assert plan.resume is not None and plan.resume.pages_copied == copied
        assert plan.pages_left == 20 - copied
        state = MigrationState.decode(dump(path)["meta"][STATE_KEY])
        assert state.cursor == sorted(before["pages"])[copied - 1]
        result = plan.execute(batch_pages=4, segment_nbytes=SMALL_SEGMENT)
        assert result["resumed"] and result["copied_pages"] == 20 - copied
    else:
        assert plan.nothing_to_do
    assert_migrated_byte_identical(path, before, pages_before)


def test_a_full_disk_stops_the_copy_and_a_second_run_resumes(v1, monkeypatch):
    """No room for the second segment file: StoreFull, the store stays schema 1 and
    checks clean, the copy so far is kept; with room again the next run finishes."""
    import errno

    from kvstore.errors import StoreFull

    path, before, pages_before = v1
    real, made = os.posix_fallocate, []

    def fallocate(fd, offset, nbytes):
        made.append(nbytes)
        if len(made) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, nbytes)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(StoreFull, match="disk is full"):
        plan_migration(path).execute(batch_pages=3, segment_nbytes=SMALL_SEGMENT)
    monkeypatch.undo()
    assert schema_version(path) == 1 and served(path) == pages_before
    state = MigrationState.decode(dump(path)["meta"][STATE_KEY])
    assert 0 < state.pages_copied < 20 and state.pages_copied % 3 == 0
    assert sorted(os.listdir(path / "segments")) == ["00000000.seg"]  # nothing half-made
    with Store(path, readonly=True) as store:
        assert store.check(read_data=True).problems == []
    result = plan_migration(path).execute(batch_pages=3, segment_nbytes=SMALL_SEGMENT)
    assert result["copied_pages"] == 20 - state.pages_copied
    assert_migrated_byte_identical(path, before, pages_before)


def test_kill_loop_then_resume(tmp_path):
    """SIGKILL a migration of 80 pages (2 a batch) three times, each a few batches in and
    a moment into the next; each time the store is still schema 1, opens, serves every
    page and checks clean, and the copy has moved on. The last run finishes,
    byte-identical."""
    path = unpack(tmp_path / "v1")
    rng = random.Random(19)
    add_v1_pages(path, [rng.randbytes(32 << 10) for _ in range(60)])
    before, pages_before = dump(path), served(path)
    copied = 0
    for _ in range(3):
        proc = migrate_in_subprocess(path, {}, batch_pages=2, wait=False)
        for _ in range(rng.randint(1, 5)):
            assert proc.stdout.readline().strip() == b"2"
        time.sleep(rng.uniform(0, 0.02))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert schema_version(path) == 1
        state = MigrationState.decode(dump(path)["meta"][STATE_KEY])
        assert state.pages_copied > copied
        copied = state.pages_copied
        with Store(path, readonly=True) as store:
            assert store.check(read_data=True).problems == []
        assert served(path) == pages_before
    result = plan_migration(path).execute(batch_pages=2, segment_nbytes=SMALL_SEGMENT)
    assert result["resumed"] and result["copied_pages"] == 80 - copied
    assert_migrated_byte_identical(path, before, pages_before)


def test_pages_changed_between_runs_are_caught_up_and_dead_records_named(v1):
    """A v1 writer between two runs (older code): one page written before the cursor,
    one copied page deleted. The switch copies the first and hands the second's record
    to dead_records, so check finds no orphan."""
    path, _, _ = v1
    loose = add_v1_pages(path, [bytes([i]) * 3000 for i in range(1, 7)])  # unreferenced
    proc = migrate_in_subprocess(path, {"KVSTORE_CRASH_AT": "index_committed:3"})
    assert proc.returncode == faults.CRASH_EXIT_CODE
    cursor = MigrationState.decode(dump(path)["meta"][STATE_KEY]).cursor
    payload = next(p for p in (os.urandom(3000) for _ in range(1000))
                   if blake3.blake3(p).digest() < cursor)
    (new,) = add_v1_pages(path, [payload])
    gone = min(loose)  # copied: below the cursor
    assert gone <= cursor
    env = raw_env(path)
    dbs = {n: env.open_db(n.encode()) for n in ("meta", "pages", "page_sizes", "page_times")}
    with env.begin(write=True) as txn:  # delete it, as a v1 GC would
        raw_n, stored_n = struct.unpack(">QQ", txn.get(gone, db=dbs["page_sizes"]))
        for name in ("pages", "page_sizes", "page_times"):
            txn.delete(gone, db=dbs[name])
        for name, n in ((b"raw_nbytes", raw_n), (b"stored_nbytes", stored_n)):
            txn.put(name, U64.pack(U64.unpack(txn.get(name, db=dbs["meta"]))[0] - n), db=dbs["meta"])
    env.close()
    before, pages_before = dump(path), served(path)
    assert new in pages_before and gone not in pages_before
    result = plan_migration(path).execute(batch_pages=4, segment_nbytes=SMALL_SEGMENT)
    assert result["dead_records"] == 1
    (dead_key,) = dump(path)["dead_records"]
    segment, offset = struct.unpack(">IQ", dead_key)
    files = SegmentFiles(path / "segments", readonly=True)
    assert bytes(files.view(Location(segment, offset, 128))[8:40]) == gone  # its record
    files.close()
    assert_migrated_byte_identical(path, before, pages_before)
def _referenced(env, txn, digest) -> bool:
    return txn.get(bytes(digest), db=env.open_db(b"refs", txn=txn)) is not None
