"""RemoteStore against the in-process app: the same protocol, bytes and errors as the
embedded Store it wraps."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from api.errors import STATUS_OF, status_of
from kvstore import errors
from kvstore.client import RemoteStore
from kvstore.format import FormatIdentity
from kvstore.records import BlockRecord, Checkpoint
from kvstore.store import Store
from kvstore.wire import error_from_body, error_to_body
from tests.api.conftest import remote_for
from tests.kvstore.factories import (
    expected_pages,
    flip_bit,
    make_identity,
    plan_prefix,
    restore_prefix,
    save_prefix,
    stored_value,
)

TOKENS = list(range(1000, 1030))  # 7 full blocks and a 2-token tail


def public_methods(cls) -> set[str]:
    return {n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v)}


def test_remote_store_has_the_store_method_set():
    missing = public_methods(Store) - public_methods(RemoteStore) - {"open"}
    assert not missing, f"RemoteStore lacks {sorted(missing)}"
    for name in public_methods(Store) - {"open"}:
        ours = inspect.signature(getattr(Store, name)).parameters
        theirs = inspect.signature(getattr(RemoteStore, name)).parameters
        assert list(ours) == list(theirs), f"{name}: {list(ours)} != {list(theirs)}"


def test_save_restore_and_checkpoints_match_the_embedded_store(open_client, store):
    remote = remote_for(open_client)
    identity = make_identity()
    saved = save_prefix(remote, identity, "default", TOKENS, checkpoint="c1")
    matched, blocks = restore_prefix(remote, identity, "default", TOKENS + [7, 7])
    assert matched == len(TOKENS) and [b.key for b in blocks] == list(saved.chain_keys)
    assert restore_prefix(store, identity, "default", TOKENS)[0] == len(TOKENS)
    digests = [d for b in blocks for d in b.pages]
    want = expected_pages(identity, blocks)
    assert remote.read_pages(digests) == want
    buffers = [np.zeros(len(w), np.uint8) for w in want]
    assert remote.read_pages_into(digests, buffers) == sum(map(len, want))
    assert [b.tobytes() for b in buffers] == want
    assert remote.page_nbytes(digests) == [len(w) for w in want]
    assert remote.get_blocks(saved.chain_keys) == store.get_blocks(saved.chain_keys)
    assert remote.has_blocks([saved.chain_keys[0], b"\1" * 32]) == [True, False]
    assert remote.get_format(identity.format_id) == identity
    assert remote.list_formats() == store.list_formats()
    assert remote.get_checkpoint("default", "c1") == store.get_checkpoint("default", "c1")
    assert [c.name for c in remote.list_checkpoints("default")] == ["c1"]
    stats = remote.stats()
    assert stats.checkpoint_count == 1 and stats.page_count == store.stats().page_count
    assert remote.check(read_data=True).ok
    assert remote.plan_gc(0.0).summary()["unreferenced_pages"] == 0
    remote.delete_checkpoint("default", "c1")
    assert remote.list_checkpoints() == []
    report = remote.evict(0)
    assert report.blocks == len(saved.records) and store.stats().block_count == 0
    assert remote.plan_gc(0.0).execute()["pages"] == 0
    assert remote.missing(digests) == digests


def test_store_errors_come_back_as_the_same_types(open_client, store):
    remote = remote_for(open_client)
    identity = make_identity()
    records, payload = plan_prefix(identity, "default", TOKENS[:8])
    with pytest.raises(errors.MissingReferences) as info:  # format not stored
        remote.commit_blocks(records)
    remote.put_format(identity)
    with pytest.raises(errors.MissingReferences) as info:  # pages not stored
        remote.commit_blocks(records[:1])
    assert info.value.missing == [f"page {d.hex()}" for d in records[0].pages]
    assert store.stats().block_count == 0
    with pytest.raises(errors.NotFound):
        remote.get_checkpoint("default", "nope")
    with pytest.raises(errors.NotFound):
        remote.read_pages([next(iter(payload))])
    with pytest.raises(errors.DigestMismatch):
        remote.put_pages({next(iter(payload)): b"not these bytes"})
    remote.put_pages(payload)
    remote.commit_blocks(records)
    ckpt = Checkpoint("twice", "default", identity.format_id, TOKENS[:8],
                      tuple(r.key for r in records))
    remote.create_checkpoint(ckpt)
    with pytest.raises(errors.AlreadyExists) as info:
        remote.create_checkpoint(ckpt)
    assert str(info.value) == "checkpoint default/twice exists; delete it or pass replace=True"
    assert remote.create_checkpoint(ckpt, replace=True).name == "twice"
    bad = Checkpoint("bad", "default", identity.format_id, TOKENS[:7],
                     tuple(r.key for r in records))
    with pytest.raises(errors.InvalidInput):
        remote.create_checkpoint(bad)


def test_upload_digest_mismatch_is_422_and_names_both(open_client, store):
    r = open_client.put("/v1/pages/" + "ab" * 32, content=b"x" * 100)
    assert r.status_code == 422 and r.json()["code"] == "digest_mismatch"
    assert r.json()["claimed"] == "ab" * 32 and len(r.json()["actual"]) == 64
    assert store.stats().page_count == 0


def test_unsupported_format_version_is_409_with_code(open_client):
    body = make_identity().to_dict() | {"schema_version": 99}
    r = open_client.put("/v1/formats/" + "00" * 32, json=body)
    assert r.status_code == 409 and r.json()["code"] == "unsupported_version"


def test_corrupt_page_is_500_naming_the_digest_and_quarantined(open_client, store):
    from kvstore.ids import page_digest
    remote = remote_for(open_client)
    data = np.random.default_rng(5).bytes(20000)  # random: stored raw, once, in overflow pages
    victim = page_digest(data)
    remote.put_pages({victim: data})
    flip_bit(store.path, stored_value(store, victim), 48 * 8 + 77)
    r = open_client.post("/v1/pages/get", json={"digests": [victim.hex()]})
    assert r.status_code == 500 and r.json()["code"] == "integrity_error"
    assert r.json()["digest"] == victim.hex() and victim.hex() in r.json()["message"]
    with pytest.raises(errors.IntegrityError) as info:  # quarantined: refused again
        remote.read_pages([victim])
    assert info.value.digest == victim.hex()
    assert store.stats().quarantined_count == 1


def test_store_full_is_507(tmp_path):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings
    from tests.kvstore.factories import make_store
    small = make_store(tmp_path / "small", max_map_nbytes=1 << 20)
    try:
        with TestClient(create_app(store=small, settings=Settings(data_dir=small.path))) as client:
            data = np.random.default_rng(0).bytes(2 << 20)
            from kvstore.ids import page_digest
            r = client.put(f"/v1/pages/{page_digest(data).hex()}", content=data)
            assert r.status_code == 507 and r.json()["code"] == "store_full"
            assert small.stats().page_count == 0
    finally:
        small.close()


def test_zstd_uploads_decode_to_the_same_page(open_client, store):
    remote = RemoteStore("http://testserver", client=open_client, compress_uploads=True)
    page = bytes(1 << 16) + b"tail"
    from kvstore.ids import page_digest
    result = remote.put_pages({page_digest(page): page})
    assert result.new == 1
    assert remote.read_pages([page_digest(page)]) == [page]


@pytest.mark.parametrize("cls", [c for c in vars(errors).values()
                                 if isinstance(c, type) and issubclass(c, errors.KVStoreError)])
def test_every_store_error_has_a_status_and_round_trips(cls):
    samples = {
        errors.DigestMismatch: lambda: errors.DigestMismatch("a" * 64, "b" * 64),
        errors.MissingReferences: lambda: errors.MissingReferences("x", ["page 1", "page 2"]),
        errors.IntegrityError: lambda: errors.IntegrityError("c" * 64, "xxh3 differs"),
        errors.IncompatibleFormat: lambda: errors.IncompatibleFormat("differs", [("layers[0].kv_heads", 8, 4)]),
        errors.UnsupportedVersion: lambda: errors.UnsupportedVersion("too new"),
    }
    exc = samples.get(cls, lambda: cls("something went wrong"))()
    status = status_of(exc)
    assert 400 <= status < 600
    back = error_from_body(error_to_body(exc), status)
    assert type(back) is cls and str(back) == str(exc)
    for attr in ("diff", "digest", "missing", "claimed", "actual"):
        assert getattr(back, attr, None) == getattr(exc, attr, None)
    assert [c for c, _ in STATUS_OF][-1] is errors.KVStoreError


def test_identity_round_trips_through_put_and_get(open_client):
    remote = remote_for(open_client)
    identity = make_identity(model_id="other/model")
    assert remote.put_format(identity) == identity.format_id
    fresh = remote_for(open_client)
    assert fresh.get_format(identity.format_id_hex) == identity
    assert isinstance(fresh.list_formats()[0], FormatIdentity)
    assert isinstance(BlockRecord, type)
