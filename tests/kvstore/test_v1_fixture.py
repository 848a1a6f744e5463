"""tests/kvstore/testdata/v1-store: a golden store of schema version 1 (page bodies as
LMDB values), made with the code of c9676d5 before segment files (issue 19 item 1).
It is unpacked into a temporary directory and opened there: read-only it serves every
page under its own name and checks clean; when the store moves to schema 2, these
tests grow the migration (`kvstore migrate`, pages byte-identical afterwards)."""

from __future__ import annotations

import shutil
from pathlib import Path

import blake3
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
