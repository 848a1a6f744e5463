"""tests/kvstore/testdata/v1-store: a golden store of schema version 1 (page bodies as
LMDB values), made with the code of c9676d5 before segment files (issue 19 item 1).
It is unpacked into a temporary directory and opened there: read-only it serves every
page under its own name and checks clean; when the store moves to schema 2, these
tests grow the migration (`kvstore migrate`, pages byte-identical afterwards)."""

from __future__ import annotations

import shutil
from pathlib import Path

import blake3
import pytest
import zstandard

from kvstore.store import Store
from tests.kvstore.factories import make_identity, restore_prefix, save_prefix

TESTDATA = Path(__file__).parent / "testdata"
FIXTURE = TESTDATA / "v1-store.data.mdb.zst"
IDENTITY = make_identity()
# what make_fixture saved: (namespace, tokens, checkpoint)
SAVES = (("default", tuple(range(1, 27)), "c"), ("other", tuple(range(1, 11)), None),
         ("default", tuple(range(1, 9)) + (99, 98, 97, 96, 95), None))
ORPHAN = b"orphan" * 100  # one page no record references


def unpack(path: Path) -> Path:
    path.mkdir()
    (path / "data.mdb").write_bytes(zstandard.ZstdDecompressor().decompress(FIXTURE.read_bytes()))
    return path


def all_pages(store: Store) -> dict[bytes, bytes]:
    with store.index.read(buffers=True) as index:
        digests = [d for d, _ in index.pages()]
    return dict(zip(digests, store.read_pages(digests), strict=True))


def test_the_v1_fixture_opens_read_only_and_serves_every_page(tmp_path):
    path = unpack(tmp_path / "v1")
    before = (path / "data.mdb").read_bytes()
    with Store(path, readonly=True) as store:
        stats = store.stats()
        assert (stats.page_count, stats.block_count, stats.checkpoint_count) == (20, 12, 1)
        pages = all_pages(store)
        assert all(blake3.blake3(data).digest() == d for d, data in pages.items())
        assert blake3.blake3(ORPHAN).digest() in pages
        for namespace, tokens, _ in SAVES:
            assert restore_prefix(store, IDENTITY, namespace, tokens)[0] == len(tokens)
        assert store.get_checkpoint("default", "c").tokens == SAVES[0][1]
        assert store.check(read_data=True).problems == []
    assert (path / "data.mdb").read_bytes() == before


def make_fixture(out: Path = FIXTURE) -> Path:
    """How the fixture was made (with schema-1 code; running it on later code makes a
    store of that code's schema, not this fixture)."""
    work = out.parent / "_v1_work"
    shutil.rmtree(work, ignore_errors=True)
    with Store(work) as store:
        for namespace, tokens, checkpoint in SAVES:
            save_prefix(store, IDENTITY, namespace, list(tokens), checkpoint=checkpoint)
        store.put_pages({blake3.blake3(ORPHAN).digest(): ORPHAN})
    out.write_bytes(zstandard.ZstdCompressor(level=19).compress((work / "data.mdb").read_bytes()))
    shutil.rmtree(work)
    return out


def test_a_v1_store_opened_read_write_refuses_every_write_naming_migrate(tmp_path):
    """Schema 1 is read, never written (docs/format.md section 10): a read-write open
    serves the pages, and every write raises NeedsMigration naming `kvstore migrate`,
    with nothing written (data.mdb byte-identical, no segment files made)."""
    from kvstore.errors import NeedsMigration
    from kvstore.pages import hash_page

    path = unpack(tmp_path / "v1")
    before = (path / "data.mdb").read_bytes()
    with Store(path) as store:
        assert store.schema_version == 1
        assert len(all_pages(store)) == 20
        page = b"a new page" * 50
        attempts = {
            "put_pages": lambda: store.put_pages({hash_page(page): page}),
            "save": lambda: save_prefix(store, IDENTITY, "default", list(range(50, 70))),
            "delete_checkpoint": lambda: store.delete_checkpoint("default", "c"),
            "evict": lambda: store.evict(0),
            "gc": lambda: store.plan_gc(0.0).execute(),
            "put_format": lambda: store.put_format(make_identity(model_id="another")),
        }
        for name, attempt in attempts.items():
            with pytest.raises(NeedsMigration, match="kvstore migrate") as info:
                attempt()
            assert "schema version 1" in str(info.value), name
        restore_prefix(store, IDENTITY, *SAVES[0][:2])  # lookups still work (no LRU write)
    assert (path / "data.mdb").read_bytes() == before
    assert not (path / "segments").exists()


def test_a_store_of_an_unknown_or_zero_schema_version_is_refused_not_guessed(tmp_path):
    """Every branch keys on the schema_version number: 0 (or any value that is not 1 or
    2) is damage (StoreCorrupt), a larger one UnsupportedVersion; neither is opened as a
    v1 or a v2 store, and nothing is written."""
    import lmdb

    from kvstore.errors import StoreCorrupt, UnsupportedVersion

    for value, error in ((0, StoreCorrupt), (3, UnsupportedVersion)):
        path = unpack(tmp_path / f"v{value}")
        env = lmdb.open(str(path), max_dbs=16)
        meta = env.open_db(b"meta", create=False)
        with env.begin(write=True) as txn:
            txn.put(b"schema_version", value.to_bytes(8, "big"), db=meta)
        env.close()
        before = (path / "data.mdb").read_bytes()
        for readonly in (True, False):
            with pytest.raises(error):
                Store(path, readonly=readonly)
        assert (path / "data.mdb").read_bytes() == before
        assert not (path / "segments").exists()


def test_a_v2_store_without_its_dead_records_database_is_refused_as_damaged(tmp_path):
    """A schema-2 store must have every schema-2 database: the v1 fixture relabelled 2
    (so it lacks dead_records) is StoreCorrupt, never given the database."""
    import lmdb

    from kvstore.errors import StoreCorrupt

    path = unpack(tmp_path / "v2")
    env = lmdb.open(str(path), max_dbs=16)
    meta = env.open_db(b"meta", create=False)
    with env.begin(write=True) as txn:
        txn.put(b"schema_version", (2).to_bytes(8, "big"), db=meta)
    env.close()
    before = (path / "data.mdb").read_bytes()
    for readonly in (True, False):
        with pytest.raises(StoreCorrupt, match="dead_records"):
            Store(path, readonly=readonly)
    assert (path / "data.mdb").read_bytes() == before
