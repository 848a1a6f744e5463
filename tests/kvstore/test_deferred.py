"""kvstore/deferred.py and Store.get_pages_deferred: the read whose checksums the caller
computes (a GPU, kernels/page_hash.py). Here the caller's hash is python-xxhash over the
views, as the device's must equal it: a page stays unserved until settle() matched it, a
page damaged in the store is quarantined by settle(), a copy damaged on its way is refused
without quarantining anything."""

from __future__ import annotations

import os

import pytest
import xxhash

from kvstore.deferred import MIN_DEFERRED_NBYTES, verified_now
from kvstore.errors import CopyDamaged, IntegrityError, NotFound
from kvstore.ids import page_digest
from kvstore.pages import HEADER_NBYTES, encode_page
from kvstore.store import Store
from tests.kvstore.factories import flip_bit


def put(store: Store, payloads: list[bytes]) -> list:
    digests = [page_digest(p) for p in payloads]
    store.put_pages(dict(zip(digests, payloads, strict=True)))
    return digests


def stored_value(store: Store, payload: bytes) -> bytes:
    """The page value (header + stored bytes) as it lies in the segment."""
    header, stored = encode_page(payload, store.config.compression, bytes(page_digest(payload)))
    return header + bytes(stored)


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "store") as s:
        yield s


def test_deferred_views_are_the_pages_and_owe_exactly_their_raw_long_records(store):
    raw = [os.urandom(4096), os.urandom(MIN_DEFERRED_NBYTES), os.urandom(MIN_DEFERRED_NBYTES - 1)]
    zeros = bytes(64 * 1024)  # compresses: stored as a zstd frame, decoded and verified here
    digests = put(store, raw + [zeros])
    with store.get_pages_deferred(digests) as pages:
        assert [bytes(v) for v in pages.views] == raw + [zeros]
        owed = [e is not None for e in pages.expected]
        assert owed == [True, True, False, False]
        assert pages.owed == 2
        assert pages.expected[0] == xxhash.xxh3_128_digest(raw[0])
        computed = [xxhash.xxh3_128_digest(bytes(v)) for v in pages.views]
    pages.settle(computed)  # after the with-block, as the restore settles after the device


def test_a_page_damaged_in_the_store_is_served_to_no_one_and_quarantined(store, tmp_path):
    payloads = [os.urandom(8192), os.urandom(8192)]
    digests = put(store, payloads)
    store.close()
    flip_bit(tmp_path / "store", stored_value(store, payloads[1]), HEADER_NBYTES * 8 + 777)
    with Store(tmp_path / "store") as reopened:
        with reopened.get_pages_deferred(digests) as pages:  # no hash here: nothing noticed
            computed = [xxhash.xxh3_128_digest(bytes(v)) for v in pages.views]
        with pytest.raises(IntegrityError) as raised:
            pages.settle(computed)
        assert not isinstance(raised.value, CopyDamaged)
        assert raised.value.digest == digests[1].hex()
        with pytest.raises((IntegrityError, NotFound)):  # quarantined: never served again
            with reopened.get_pages([digests[1]]):
                pass
        with reopened.get_pages([digests[0]]) as views:
            assert bytes(views[0]) == payloads[0]


def test_a_copy_damaged_on_its_way_is_refused_and_nothing_is_quarantined(store):
    payloads = [os.urandom(8192), os.urandom(8192)]
    digests = put(store, payloads)
    with store.get_pages_deferred(digests) as pages:
        copies = [bytearray(v) for v in pages.views]
    copies[0][100] ^= 0x10  # what the device hashed is not what the store holds
    with pytest.raises(CopyDamaged) as raised:
        pages.settle([xxhash.xxh3_128_digest(bytes(c)) for c in copies])
    assert raised.value.digest == digests[0].hex()
    with store.get_pages(digests) as views:  # both pages still served, verified
        assert [bytes(v) for v in views] == payloads


def test_settle_refuses_a_count_that_does_not_match(store):
    digests = put(store, [os.urandom(1024)])
    with store.get_pages_deferred(digests) as pages:
        pass
    with pytest.raises(ValueError, match="1 pages"):
        pages.settle([])


def test_a_store_that_defers_nothing_owes_nothing(store):
    payloads = [os.urandom(4096), os.urandom(4096)]
    digests = put(store, payloads)
    with verified_now(store.get_pages, digests) as pages:
        assert [bytes(v) for v in pages.views] == payloads
        assert pages.expected == [None, None] and pages.owed == 0
    pages.settle([b"anything", None])
