"""A damaged LMDB environment is refused with StoreCorrupt, never re-initialised
(issue 17, defect 4). Two ways one flipped bit used to empty a store silently:

  name     a bit of a sub-database's name in the main database's root page: LMDB no
           longer finds "pages", and a read-write open created a new empty one;
  root     a bit of the main database's root page number in the current meta page:
           LMDB reads an older main database whose sub-databases are empty, and a
           read-write open wrote the meta record again over it.

Either way, read-only and read-write opens now raise StoreCorrupt naming the store and
what is missing, and the data file is byte-for-byte what it was. `kvstore check`
prints one line and exits 4. tests/kvstore/testdata/ holds a tiny store broken the
first way (see its README), opened here as an operator would meet it.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest
import zstandard

from kvstore.errors import InvalidInput, StoreCorrupt
from kvstore.lmdbenv import LmdbEnv
from kvstore.records import Checkpoint
from kvstore.store import Store
from tests.kvstore.factories import make_identity, make_store, restore_prefix, save_prefix
from tests.tools.helpers import run
from tools.commands.common import EXIT_INCOMPATIBLE, EXIT_OK

TESTDATA = Path(__file__).parent / "testdata"
IDENTITY = make_identity()
TOKENS = list(range(40))
PSIZE = 4096  # LMDB's page size on the machines we run on (checked in _meta)
META = struct.Struct("<IHHQQQQQ")  # MDB_db: pad, flags, depth, branch, leaf, overflow, entries, root


def _meta(blob: bytes) -> tuple[int, int]:
    """(file offset of the current meta page's main-database MDB_db, its root page)."""
    best = None
    for page in (0, 1):
        base = page * PSIZE + 16  # page header
        magic, version = struct.unpack_from("<II", blob, base)
        assert magic == 0xBEEFC0DE, "not an LMDB data file, or another page size"
        dbs = base + 24  # magic, version, address, mapsize
        txnid = struct.unpack_from("<Q", blob, dbs + 2 * META.size + 8)[0]
        main = dbs + META.size  # [FREE_DBI, MAIN_DBI]
        if best is None or txnid > best[0]:
            best = (txnid, main, META.unpack_from(blob, main)[-1])
    return best[1], best[2]


def flip_sub_database_name(path: Path, name: bytes) -> None:
    data = path / "data.mdb"
    blob = bytearray(data.read_bytes())
    _, root = _meta(blob)
    at = blob.find(name, root * PSIZE, (root + 1) * PSIZE)
    assert at >= 0, f"{name!r} is not in the main database's root page"
    blob[at] ^= 0x01
    data.write_bytes(bytes(blob))


def flip_main_root(path: Path) -> None:
    data = path / "data.mdb"
    blob = bytearray(data.read_bytes())
    main, _ = _meta(blob)
    blob[main + META.size - 8] ^= 0x01  # the lowest bit of md_root
    data.write_bytes(bytes(blob))


def _saved_store(path: Path) -> None:
    with make_store(path) as store:
        save_prefix(store, IDENTITY, "default", TOKENS, checkpoint="c")


def _saved_store_without(path: Path, database: bytes) -> None:
    """A saved store, then `database` dropped in LMDB itself (no bit flips)."""
    import lmdb

    _saved_store(path)
    env = lmdb.open(str(path), max_dbs=16)
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(database, txn=txn), delete=True)
    env.close()


def _files(path: Path) -> bytes:
    return (path / "data.mdb").read_bytes()


@pytest.mark.parametrize("damage", ["name", "root"])
def test_a_flipped_bit_in_the_main_database_is_refused_and_nothing_is_written(tmp_path, damage):
    path = tmp_path / "store"
    _saved_store(path)
    if damage == "name":
        flip_sub_database_name(path, b"pages")
    else:
        flip_main_root(path)
    before = _files(path)
    for readonly in (True, False):
        with pytest.raises(StoreCorrupt) as info:
            Store(path, readonly=readonly)
        message = str(info.value)
        assert str(path) in message and "\n" not in message
        # root: the page it now names lists none of the sub-databases, or an old main
        # database whose meta record was not yet written; the message says which
        assert ("pages" in message) if damage == "name" else ("meta" in message)
        assert _files(path) == before, f"a {'read-only' if readonly else 'read-write'} open wrote"
    code = run("check", "--data-dir", path)
    assert code.code == EXIT_INCOMPATIBLE
    lines = [line for line in code.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "store_corrupt" in lines[0], code.stderr
    assert "Traceback" not in code.stderr + code.stdout
    assert _files(path) == before


def test_an_existing_environment_lacking_a_sub_database_is_never_given_one(tmp_path):
    """The mechanism, without bit flips: drop a declared sub-database in LMDB itself."""
    path = tmp_path / "store"
    _saved_store_without(path, b"refs")
    before = _files(path)
    with pytest.raises(StoreCorrupt, match="refs"):
        Store(path)
    assert _files(path) == before


def _databases_without_meta(path: Path, *, data: bool = False, later_txn: bool = False) -> None:
    """Every declared sub-database in LMDB's first transaction, no meta record: what the
    code before 2b4d4ad left when it died between creating the databases and writing
    meta. data=True puts one page entry in that same transaction; later_txn=True
    commits a second, empty-handed transaction (an environment past its first one)."""
    import lmdb

    from kvstore.lmdbenv import DATABASES

    env = lmdb.open(str(path), max_dbs=16)
    with env.begin(write=True) as txn:
        dbs = {name: env.open_db(name.encode(), txn=txn, create=True) for name in DATABASES}
        if data:
            txn.put(bytes(32), b"a page value", db=dbs["pages"])
    if later_txn:
        with env.begin(write=True) as txn:
            txn.put(b"k", b"v", db=dbs["lru"])
        with env.begin(write=True) as txn:
            txn.delete(b"k", db=dbs["lru"])
    env.close()


def test_empty_sub_databases_without_the_meta_record_are_initialised(tmp_path):
    """The old crash window (databases committed, meta not yet): it holds nothing, so a
    read-write open initialises it; a read-only open says there is no store yet."""
    from kvstore.errors import NotFound

    path = tmp_path / "store"
    _databases_without_meta(path)
    before = _files(path)
    with pytest.raises(NotFound, match="nothing was written"):
        Store(path, readonly=True)
    assert _files(path) == before
    with make_store(path) as store:
        save_prefix(store, IDENTITY, "default", TOKENS)
    with Store(path, readonly=True) as store:
        assert restore_prefix(store, IDENTITY, "default", TOKENS)[0] == len(TOKENS)


@pytest.mark.parametrize("how", ["data", "later_txn"])
def test_sub_databases_without_the_meta_record_holding_anything_are_refused(tmp_path, how):
    """Data and no meta record, or empty databases in an environment past its first
    transaction (an old main-database root reached through a damaged meta page): damage."""
    path = tmp_path / "store"
    _databases_without_meta(path, **{how: True})
    before = _files(path)
    for readonly in (True, False):
        with pytest.raises(StoreCorrupt, match="meta record"):
            Store(path, readonly=readonly)
    assert _files(path) == before


def test_a_read_only_open_of_no_store_is_not_found(tmp_path):
    from kvstore.errors import NotFound

    with pytest.raises(NotFound, match="no store"):
        Store(tmp_path / "nothing", readonly=True)
    import lmdb

    lmdb.open(str(tmp_path / "empty")).close()  # an environment nothing was committed to
    with pytest.raises(NotFound, match="no store"):
        Store(tmp_path / "empty", readonly=True)
    with Store(tmp_path / "empty") as store:  # read-write: created whole
        assert store.stats().block_count == 0


def test_a_new_store_is_created_whole_and_reopens(tmp_path):
    path = tmp_path / "store"
    with make_store(path) as store:
        save_prefix(store, IDENTITY, "default", TOKENS)
    for readonly in (True, False):
        with Store(path, readonly=readonly) as store:
            assert restore_prefix(store, IDENTITY, "default", TOKENS)[0] == len(TOKENS)
    assert run("check", "--data-dir", path).code == EXIT_OK


def test_an_older_store_without_page_sizes_gains_it_read_write_only(tmp_path):
    """page_sizes was declared after stores existed: such a store is not damaged."""
    path = tmp_path / "store"
    _saved_store_without(path, b"page_sizes")
    with pytest.raises(StoreCorrupt, match="open it read-write once"):
        Store(path, readonly=True)
    with Store(path) as store:
        assert restore_prefix(store, IDENTITY, "default", TOKENS)[0] == len(TOKENS)
        assert store.check().problems == []
    with Store(path, readonly=True) as store:
        assert store.stats().block_count == 10


def test_the_broken_fixture_store_is_refused(tmp_path):
    """tests/kvstore/testdata/broken-pages-name: "pages" renamed by one bit."""
    path = tmp_path / "broken"
    path.mkdir()
    packed = (TESTDATA / "broken-pages-name.data.mdb.zst").read_bytes()
    (path / "data.mdb").write_bytes(zstandard.ZstdDecompressor().decompress(packed))
    before = _files(path)
    with pytest.raises(StoreCorrupt, match="pages"):
        Store(path)
    with pytest.raises(StoreCorrupt, match="pages"):
        LmdbEnv(path, readonly=True)
    ran = run("stats", "--data-dir", path)
    assert ran.code == EXIT_INCOMPATIBLE and len(ran.stderr.strip().splitlines()) == 1
    assert _files(path) == before


def test_kvstore_serve_refuses_a_damaged_store_in_one_line(tmp_path):
    import os
    import subprocess
    import sys

    path = tmp_path / "store"
    _saved_store(path)
    flip_sub_database_name(path, b"blocks")
    before = _files(path)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "KVSTORE_PORT": "1"}  # never bound
    proc = subprocess.run([sys.executable, "-m", "tools.cli", "serve", "--data-dir", str(path)],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == EXIT_INCOMPATIBLE, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "blocks" in proc.stderr, proc.stderr
    assert _files(path) == before


def make_fixture(out_dir: Path = TESTDATA) -> Path:
    """Regenerate the fixture: python -c 'from tests.kvstore.test_store_corrupt import
    make_fixture; make_fixture()'."""
    work = out_dir / "_work"
    shutil.rmtree(work, ignore_errors=True)
    with Store(work) as store:  # default map: the file holds only used pages
        save_prefix(store, IDENTITY, "default", TOKENS[:8], checkpoint="c")
    flip_sub_database_name(work, b"pages")
    target = out_dir / "broken-pages-name.data.mdb.zst"
    target.write_bytes(zstandard.ZstdCompressor(level=19).compress(_files(work)))
    shutil.rmtree(work)
    return target


def test_a_block_record_stored_under_another_blocks_key_is_never_matched(tmp_path):
    """A block record's key is derived from its content (BlockRecord.key) and looked up
    by the key the prompt's tokens give. A record found under a key it does not hash to
    (another prompt's block, written there by damage or a bug) names another prompt's
    pages: the lookup stops before it, as before a damaged block, and never serves it."""
    identity = make_identity()
    a, b = list(range(100, 113)), list(range(500, 513))
    with make_store(tmp_path / "s") as store:
        saved_a = save_prefix(store, identity, "ns", a)
        saved_b = save_prefix(store, identity, "ns", b)
        key_a1, key_b1 = saved_a.records[1].key, saved_b.records[1].key

        def swap(txn, dbs):
            txn.put(bytes(key_a1), txn.get(bytes(key_b1), db=dbs["blocks"]), db=dbs["blocks"])

        store.lmdb.write(swap)
        stopped = store.stats().lookups_stopped_at_damage
        match = store.lookup_prefix(identity.format_id, "ns", a)
        assert [r.key for r in match.blocks] == [saved_a.records[0].key]
        assert match.tokens_matched == identity.block_size_tokens
        assert store.stats().lookups_stopped_at_damage == stopped + 1
        assert store.has_blocks([key_a1]) == [False]
        assert [r and r.key for r in store.find_blocks([key_a1, key_b1])] == [None, key_b1]
        with pytest.raises(InvalidInput, match=key_a1.short):  # nor checkpointed
            store.create_checkpoint(Checkpoint("a", "ns", identity.format_id, tuple(a),
                                               tuple(r.key for r in saved_a.records)))
        assert restore_prefix(store, identity, "ns", b)[0] == len(b)  # b is untouched
