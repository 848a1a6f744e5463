"""The one LMDB environment of a store directory, and the one write helper.

Named sub-databases are declared here and nowhere else (DATABASES). Keys are fixed
width where they can be (32-byte digests, big-endian integers) and always < 511 bytes.

Opening never re-initialises. Only an environment in which nothing was ever committed
gets its databases, created in one transaction with the store's meta record (and one
whose first transaction created every database, all still empty, and nothing more:
older code's crash before its meta record). An existing environment that lacks a
declared database (other than ADDED_LATER ones), or has them all but no meta record
and holds anything, is refused with StoreCorrupt before anything is written (see
LmdbEnv._open_or_create and docs/reliability.md).

Every write goes through LmdbEnv.write(fn): fn(txn, dbs) runs in one write
transaction; MapFullError aborts it, the map grows (doubling, up to max_map_nbytes)
and fn runs again from scratch, so fn must not keep state between attempts.
A full disk (ENOSPC) or a map at its limit raises StoreFull with nothing committed.
A commit is durable when write() returns: the environment is opened with sync and
metasync, so LMDB fdatasyncs the data and the meta page before commit returns, and a
failed sync surfaces as StoreIOError (never retried into a success).

Concurrency. Several processes may open one directory: LMDB serializes writers with
its own lock file and lets readers run beside them. Within a process, set_mapsize()
invalidates open transactions, so transactions hold a shared lock and a resize takes
it exclusively. An environment belongs to the process that opened it: after fork()
the child opens its own (the parent's handle is parked, never used or closed there).
Stale reader slots left by killed processes are cleared at open, when slots run out,
and by writers every READER_CHECK_S seconds.

Headroom. LMDB is copy-on-write: deleting a checkpoint or collecting garbage needs new
pages too, so on a full disk nothing could be freed. The store therefore keeps
reserve_nbytes of the filesystem, and of the map limit, free for writes that free space (freeing=True:
checkpoint deletes, eviction, GC, quarantine): any other write is refused with
StoreFull, before it starts, when it would leave less than that, counting the pages
already free inside data.mdb (LMDB reuses them before it grows the file). A commit that
fails while the filesystem is below the reserve is StoreFull as well: LMDB reports a
short write on a full disk as EIO, not ENOSPC.
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, TypeVar

import lmdb

from kvstore import faults, fileio
from kvstore.errors import NotFound, StoreCorrupt, StoreFull, StoreIOError

T = TypeVar("T")

# name -> what it maps (key -> value). The only place sub-databases are named.
DATABASES = {
    "meta": "ascii name -> value (schema version, byte counters, GC history)",
    "formats": "format id (32) -> canonical JSON of the FormatIdentity",
    "pages": "page digest (32) -> schema 1: 48-byte header || stored bytes (kvstore/pages.py); "
             "schema 2: 24-byte location of its segment record (kvstore/segments.py)",
    "page_times": "page digest (32) -> u64be ns of the last upload or dedup hit (GC grace)",
    "page_sizes": "page digest (32) -> u64be raw nbytes || u64be stored nbytes, as counted "
                  "when written (so damage to a record cannot skew the byte counters)",
    "refs": "page digest (32) -> u64be count of block records and checkpoints naming it",
    "quarantine": "page digest (32) -> the stored value that failed verification (schema 1), "
                  "or its 24-byte location (schema 2)",
    "dead_records": "schema 2: u32be segment || u64be offset -> u64be length || u64be ns it died "
                    "(a segment record no page names any more; GC punches it after the grace)",
    "blocks": "chain key (32) -> block record (kvstore/records.py)",
    "children": "parent key (32) || child key (32) -> empty",
    "lru": "u64be last-used ns || chain key (32) -> empty",
    "pins": "chain key (32) -> u64be count of checkpoints naming the block",
    "checkpoints": "namespace || 0x00 || name -> checkpoint manifest JSON",
}

# Databases declared after stores existed without them: an existing store that has its
# meta record may gain them (read-write). Every other missing database is damage.
ADDED_LATER = frozenset({"page_sizes"})
# Databases of schema 2 (docs/format.md section 10): a schema-1 store has none of them and
# is opened without them (never created at open: a v1 store is read-only until `kvstore
# migrate`, which calls create_schema2_databases). The Store refuses a schema-2 store
# lacking one as damaged: which databases must exist is decided by the schema number.
SCHEMA2_DATABASES = frozenset({"dead_records"})
META_RECORD = b"schema_version"  # written with the databases; its absence is damage

DEFAULT_MAP_NBYTES = 1 << 30
DEFAULT_MAX_MAP_NBYTES = 1 << 40
DEFAULT_RESERVE_NBYTES = 64 << 20
READER_CHECK_S = 10.0  # a writer clears stale reader slots at most this often
MAX_READERS = 1024

_parked_envs: list = []  # handles inherited across fork(): never used, never closed


class RWLock:
    """Many holders of the shared side, or one of the exclusive side."""

    def __init__(self):
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self):
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if self._shared == 0:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        with self._cond:
            while self._exclusive or self._shared:
                self._cond.wait()
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class LmdbEnv:
    """Owns one lmdb.Environment for this process; see the module docstring."""

    def __init__(self, path: Path, map_nbytes: int = DEFAULT_MAP_NBYTES,
                 max_map_nbytes: int = DEFAULT_MAX_MAP_NBYTES, readonly: bool = False,
                 reserve_nbytes: int = DEFAULT_RESERVE_NBYTES,
                 init: Callable[[object, dict], None] | None = None):
        """init(txn, dbs) writes the meta record of a new store, in the transaction that
        creates its databases (it must write META_RECORD)."""
        self.path = Path(path)
        self._init = init
        self.reserve_nbytes = reserve_nbytes
        self._reader_checked = time.monotonic()
        self.initial_map_nbytes = map_nbytes
        self.max_map_nbytes = max(max_map_nbytes, map_nbytes)
        self.readonly = readonly
        self._lock = RWLock()
        self._pid = -1
        self._env = None
        self._dbs: dict[str, object] = {}
        self._open_lock = threading.Lock()
        self._ensure_open()

    # -- lifetime -------------------------------------------------------------------
    def _ensure_open(self):
        if self._pid == os.getpid() and self._env is not None:
            return
        with self._open_lock:
            if self._pid == os.getpid() and self._env is not None:
                return
            if self._env is not None:  # inherited across fork(): park it, open our own
                _parked_envs.append(self._env)
            self.path.mkdir(parents=True, exist_ok=True)
            for name in ("data.mdb", "lock.mdb"):  # LMDB would follow them out of the store
                if (self.path / name).is_symlink():
                    raise StoreIOError(f"{self.path / name} is a symlink; refusing to open the "
                                       "store through it. Replace it with the real file")
            env = self._open_env()
            try:
                env.reader_check()
                dbs = self._open_databases(env)
            except BaseException:
                env.close()  # refused (StoreCorrupt, StoreFull): nothing stays open
                raise
            self._env, self._dbs, self._pid = env, dbs, os.getpid()

    def _open_env(self):
        """lmdb.open, retried when another process grows the map between LMDB's reading of
        the file's size and py-lmdb's first transaction inside open (MDB_MAP_RESIZED): a
        fresh open adopts the new size. Seen in CI with four processes on a 64 KiB map."""
        for _ in range(16):
            try:
                return lmdb.open(
                    str(self.path), map_size=self.initial_map_nbytes, subdir=True,
                    max_dbs=len(DATABASES) + 2, max_readers=MAX_READERS, sync=True,
                    metasync=True, lock=True, readonly=self.readonly, create=not self.readonly,
                    readahead=False, writemap=False,
                )
            except lmdb.MapResizedError:
                continue
            except lmdb.Error as exc:
                if self.readonly and not (self.path / "data.mdb").exists():
                    raise NotFound(f"no store at {self.path} (no data.mdb; a read-only open "
                                   "never creates one)") from None
                if not isinstance(exc, (lmdb.InvalidError, lmdb.CorruptedError,
                                        lmdb.PageNotFoundError, lmdb.VersionMismatchError)):
                    raise
                raise StoreCorrupt(f"store at {self.path} is damaged: LMDB refuses its data file "
                                   f"({exc}); nothing was written. See docs/reliability.md "
                                   "('A store refused as damaged')") from None
        raise StoreIOError(f"could not open {self.path}: other processes kept growing the map "
                           "while it opened; retry")

    def _open_databases(self, env) -> dict:
        """Open every named database; create them only in a new environment (see
        classify below). Another process may have grown the map since lmdb.open
        (MapResizedError: adopt its size), and creating the databases in a tiny map may
        need it grown (MapFullError): both retry, as write() does."""
        for _ in range(16):
            try:
                return self._open_or_create(env)
            except lmdb.MapResizedError:
                env.set_mapsize(0)
            except lmdb.MapFullError:
                current = env.info()["map_size"]
                if current >= self.max_map_nbytes:
                    raise StoreFull(f"creating the databases needs more than the map limit of "
                                    f"{self.max_map_nbytes} bytes") from None
                env.set_mapsize(min(max(current * 2, 1 << 20), self.max_map_nbytes))
        raise StoreIOError(f"could not open the databases of {self.path}: the map kept changing")

    def _open_or_create(self, env) -> dict:
        """An environment is one of three things, decided before anything is written:
          new       nothing was ever committed (LMDB's last txn id is 0) and its main
                    database is empty: the databases and the meta record are created
                    in one transaction (read-write only);
          a store   every declared database is listed in the main database and `meta`
                    holds the schema_version record;
          unborn    every declared database is listed and empty, no meta record, and
                    LMDB's last transaction is the first (an older code's crash between
                    creating the databases and writing meta): it holds nothing and is
                    initialised (read-write; read-only: NotFound), see _unborn;
          damaged   anything else: StoreCorrupt names what is missing, and nothing is
                    written. Databases are never created in an existing environment
                    (a flipped bit in the main database's root would otherwise make a
                    full store look like a new one and be re-initialised over it),
                    except the ones ADDED_LATER, in a store that has its meta record."""
        with env.begin() as snapshot:  # the names and the txn id of one snapshot: a
            # process that creates the store between two reads must not look like damage
            names, last_txnid = self._listed_databases(env, snapshot), snapshot.id()
        declared = set(DATABASES)
        if not names and last_txnid == 0:
            if self.readonly:
                raise NotFound(f"no store at {self.path}: its LMDB environment is empty (a "
                               "read-write open creates the store)")
            with env.begin(write=True) as txn:
                if txn.id() == 1 and not self._listed_databases(env, txn):
                    dbs = {name: env.open_db(name.encode(), txn=txn, create=True)
                           for name in DATABASES}
                    if self._init is not None:
                        self._init(txn, dbs)
                    return dbs
            return self._open_or_create(env)  # another process created it first
        absent_schema2 = (declared - names) & SCHEMA2_DATABASES
        missing = sorted(declared - names - SCHEMA2_DATABASES)
        if missing and (self.readonly or not set(missing) <= ADDED_LATER or "meta" in missing):
            raise StoreCorrupt(
                f"store at {self.path} is damaged: LMDB's main database does not list the "
                f"sub-database(s) {', '.join(missing)}; nothing was written. See "
                "docs/reliability.md ('A store refused as damaged')"
                + (" (a store older than the page_sizes database: open it read-write once "
                   "to add it)" if set(missing) <= ADDED_LATER else ""))
        if self.readonly:
            # No txn argument: py-lmdb then opens each handle in a read txn it really
            # commits. A handle opened in a caller's read-only txn is dropped when
            # py-lmdb recycles that txn on exit (it resets, not commits, read txns), and
            # every later get() fails with EINVAL.
            dbs = {name: env.open_db(name.encode(), create=False) for name in DATABASES
                   if name not in absent_schema2}
        else:
            with env.begin(write=True) as txn:  # commits nothing unless ADDED_LATER are made
                dbs = {name: env.open_db(name.encode(), txn=txn, create=name in missing)
                       for name in DATABASES if name not in absent_schema2}
        with env.begin() as txn:
            no_meta = txn.get(META_RECORD, db=dbs["meta"]) is None
            unborn = no_meta and not missing and self._unborn(txn, dbs)
        if unborn:
            return self._initialise_unborn(env, dbs)
        with env.begin() as txn:
            if txn.get(META_RECORD, db=dbs["meta"]) is None:
                raise StoreCorrupt(
                    f"store at {self.path} is damaged: its sub-databases are listed but the "
                    f"meta record ({META_RECORD.decode()}) is missing, so LMDB's main database "
                    "points at an old or foreign root; nothing was written. See "
                    "docs/reliability.md ('A store refused as damaged')")
        return dbs

    @staticmethod
    def _unborn(txn, dbs, *, write: bool = False) -> bool:
        """The crash window of stores made before the databases and the meta record were
        created in one transaction: the databases were committed (LMDB's transaction 1)
        and the process died before the meta record (transaction 2). Such an environment
        holds nothing. Every declared database must be listed and empty AND the
        environment's last transaction must be that first one: an environment whose
        main-database root was damaged (a flipped bit in the meta page) can point at an
        old root with empty databases too, but its last transaction id is the live one
        (> 1), and it is refused as damaged."""
        last_txnid = txn.id() - 1 if write else txn.id()  # a write txn's id is the next one
        return last_txnid == 1 and all(txn.stat(db)["entries"] == 0 for db in dbs.values())

    def _initialise_unborn(self, env, dbs) -> dict:
        if self.readonly:
            raise NotFound(f"no store at {self.path}: its databases were created but nothing "
                           "was written to them (a crash while the store was being made); a "
                           "read-write open initialises it")
        with env.begin(write=True) as txn:
            if txn.get(META_RECORD, db=dbs["meta"]) is None:  # else another process did
                if not self._unborn(txn, dbs, write=True):
                    return self._open_or_create(env)  # changed under us: classify again
                if self._init is not None:
                    self._init(txn, dbs)
        return dbs

    def _listed_databases(self, env, txn=None) -> set[str]:
        """The names LMDB's main database lists (named databases are its keys). A main
        database that cannot be read is damage, not an empty store."""
        try:
            if txn is not None:
                return {bytes(k).decode("utf-8", "replace") for k in txn.cursor().iternext(values=False)}
            with env.begin() as own:
                return {bytes(k).decode("utf-8", "replace") for k in own.cursor().iternext(values=False)}
        except (lmdb.MapResizedError, lmdb.MapFullError, lmdb.ReadersFullError):
            raise
        except lmdb.Error as exc:
            raise StoreCorrupt(f"store at {self.path} is damaged: LMDB's main database cannot be "
                               f"read ({exc}); nothing was written. See docs/reliability.md "
                               "('A store refused as damaged')") from None

    def create_schema2_databases(self) -> None:
        """Create the SCHEMA2_DATABASES a schema-1 store lacks, empty, in one committed
        transaction (`kvstore migrate`, before the transaction that sets schema_version
        2). Idempotent."""
        assert not self.readonly, "create_schema2_databases on a read-only environment"
        env = self.env
        with self._lock.shared():
            with env.begin(write=True) as txn:
                made = {name: env.open_db(name.encode(), txn=txn, create=True)
                        for name in sorted(SCHEMA2_DATABASES - set(self._dbs))}
        self._dbs.update(made)

    def close(self):
        with self._open_lock:
            if self._env is not None and self._pid == os.getpid():
                with self._lock.exclusive():
                    self._env.close()
            self._env = None

    @property
    def env(self):
        self._ensure_open()
        return self._env

    @property
    def dbs(self) -> dict:
        self._ensure_open()
        return self._dbs

    def map_nbytes(self) -> int:
        return self.env.info()["map_size"]

    def used_nbytes(self) -> int:
        """Bytes of the data file LMDB has used (last page number times page size)."""
        info, stat = self.env.info(), self.env.stat()
        return (info["last_pgno"] + 1) * stat["psize"]

    # -- transactions -----------------------------------------------------------------
    @contextmanager
    def read(self, buffers: bool = False):
        """A short read transaction. With buffers=True values are zero-copy memoryviews
        valid only inside the block."""
        env = self.env
        for attempt in range(3):
            with self._lock.shared():
                try:
                    txn = env.begin(buffers=buffers)
                except lmdb.MapResizedError:
                    pass
                except lmdb.ReadersFullError:
                    env.reader_check()
                    continue
                else:
                    try:
                        yield txn
                    finally:
                        txn.abort()
                    return
            self._adopt_grown_map()
        raise StoreIOError("could not start a read transaction after adopting a grown map")

    def write(self, fn: Callable[[object, dict], T], *, what: str = "write",
              buffers: bool = False, freeing: bool = False, need_nbytes: int = 0) -> T:
        """Run fn(txn, dbs) in one durable write transaction (see the module docstring).
        With buffers=True, txn.get returns zero-copy views instead of copies: a view is
        valid only until the next put or delete in the transaction, so fn must finish
        with each value before it modifies anything. Page values are up to 256 MiB, so
        paths that only test presence or read a page's header use it. freeing=True marks
        a write that frees space (it may use the headroom); need_nbytes is what the
        write is expected to add."""
        env = self.env
        if time.monotonic() - self._reader_checked > READER_CHECK_S:
            # a process killed inside a read transaction leaves its slot behind, and the
            # snapshot it pins stops LMDB reusing pages: the file would grow without end
            self._reader_checked = time.monotonic()
            env.reader_check()
        if not freeing:
            self._check_headroom(what, need_nbytes)
        if need_nbytes:
            self._grow_for(need_nbytes)
        while True:
            with self._lock.shared():
                try:
                    txn = env.begin(write=True, buffers=buffers)
                    try:
                        result = fn(txn, self._dbs)
                        faults.crash_point("index_before_commit")
                    except BaseException:
                        txn.abort()
                        raise
                    fileio.commit_txn(txn, what)  # aborts, and raises typed, on a fault
                    faults.crash_point("index_committed")
                    return result
                except lmdb.MapResizedError:
                    grow = None
                except lmdb.MapFullError:
                    grow = True
                except lmdb.DiskError as exc:
                    raise StoreFull(
                        f"{what} failed: the store's disk is full ({exc}); nothing was "
                        "committed. Free space, or run `kvstore gc` / `kvstore evict`"
                    ) from None
                except lmdb.ReadersFullError:
                    env.reader_check()
                    continue
                except lmdb.Error as exc:
                    low = max(self.reserve_nbytes, need_nbytes, 1 << 20)
                    if "No space" in str(exc) or self._fs_available() < low:
                        raise StoreFull(f"{what} failed: disk full ({exc}); nothing was committed. "
                                        "Run `kvstore gc` / `kvstore evict`, or free space") from None
                    if isinstance(exc, (lmdb.PanicError, lmdb.CorruptedError, lmdb.InvalidError)):
                        raise
                    raise StoreIOError(f"{what} failed and was not committed: {exc}") from None
            if grow:
                self._grow_map(what)
            else:
                self._adopt_grown_map()

    # -- headroom (see the module docstring) ----------------------------------------------
    def _fs_available(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def free_in_file_nbytes(self) -> int:
        """Bytes of data.mdb not used by any database: pages LMDB reuses before it grows
        the file. An estimate (it counts pages an old reader may still pin as free)."""
        env = self.env
        psize = env.stat()["psize"]
        used = 2 + sum(env.stat()[k] for k in ("branch_pages", "leaf_pages", "overflow_pages"))
        with self.read() as txn:
            for db in self._dbs.values():
                st = txn.stat(db)
                used += st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        try:
            file_nbytes = os.stat(self.path / "data.mdb").st_size
        except FileNotFoundError:
            return 0
        return max(0, file_nbytes - used * psize)

    def check_disk_headroom(self, what: str, need_nbytes: int) -> None:
        """StoreFull, before anything is written, unless the filesystem keeps
        reserve_nbytes free after need_nbytes more (segment bytes, written beside the
        map: the map's own headroom is not theirs)."""
        if self.reserve_nbytes <= 0:
            return
        available = self._fs_available()
        if available - need_nbytes >= self.reserve_nbytes:
            return
        raise StoreFull(
            f"{what} refused: the store's filesystem has {available} bytes free, the write "
            f"needs {need_nbytes} and the store keeps {self.reserve_nbytes} for deletes and "
            "GC; nothing was written. Run `kvstore gc` / `kvstore evict` or delete "
            "checkpoints, or free space")

    def _check_headroom(self, what: str, need_nbytes: int) -> None:
        # Messages name no path: they reach HTTP clients (a 507), and the server's
        # directory layout is none of theirs.
        if self.reserve_nbytes <= 0:
            return
        self._check_map_headroom(what, need_nbytes)
        available = self._fs_available()
        if available - need_nbytes >= self.reserve_nbytes:
            return  # the fast path: one statvfs
        if available + self.free_in_file_nbytes() - need_nbytes >= self.reserve_nbytes:
            return
        raise StoreFull(
            f"{what} refused: the store's filesystem has {available} bytes free and the "
            f"store keeps {self.reserve_nbytes} for deletes and GC; nothing was written. Run "
            "`kvstore gc` / `kvstore evict` or delete checkpoints, or free space")

    def _check_map_headroom(self, what: str, need_nbytes: int) -> None:
        """The same reserve inside the map limit: at max_map_nbytes a write that frees
        space still needs fresh pages (LMDB copies on write), so other writes stop
        while reserve_nbytes of the limit is unused."""
        room = self.max_map_nbytes - self.used_nbytes() - need_nbytes
        if room >= self.reserve_nbytes:
            return  # the fast path: the file's high-water mark is far from the limit
        if room + self.free_in_file_nbytes() >= self.reserve_nbytes:
            return
        raise StoreFull(
            f"{what} refused: the store is within {self.reserve_nbytes} bytes (kept for deletes, "
            f"eviction and GC) of its map limit of {self.max_map_nbytes} bytes; nothing was "
            "written. Delete checkpoints, run `kvstore evict` and `kvstore gc`, or raise "
            "max_map_nbytes")

    def _grow_for(self, need_nbytes: int) -> None:
        """Grow the map before a write expected to add need_nbytes, so a large save does
        not fill it, abort and run again once per doubling (each attempt copies every
        page). LMDB's B-tree pages come on top of the values: a quarter is allowed."""
        want = self.used_nbytes() + need_nbytes + need_nbytes // 4
        if want <= self.map_nbytes():
            return
        with self._lock.exclusive():
            current = self._env.info()["map_size"]
            target = current
            while target < want and target < self.max_map_nbytes:
                target = min(max(target * 2, 1 << 20), self.max_map_nbytes)
            if target > current:
                self._env.set_mapsize(target)

    def _adopt_grown_map(self):
        with self._lock.exclusive():
            self._env.set_mapsize(0)

    def _grow_map(self, what: str):
        with self._lock.exclusive():
            current = self._env.info()["map_size"]
            if current >= self.max_map_nbytes:
                raise StoreFull(
                    f"{what} needs more than the store's map limit of {self.max_map_nbytes} bytes; "
                    "nothing was committed. Raise max_map_nbytes, or run `kvstore gc` / `kvstore evict`"
                )
            self._env.set_mapsize(min(max(current * 2, 1 << 20), self.max_map_nbytes))
