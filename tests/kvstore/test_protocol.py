"""Store, RemoteStore and TieredStore conform to kvstore/protocol.py: every method of
every view exists with the protocol's parameters, and the declared capability
maps_pages says what get_pages really hands out."""

from __future__ import annotations

import inspect

import httpx
import pytest

from kvstore.client import RemoteStore
from kvstore.protocol import VIEWS, PageReader, PageWriter, StoreAdmin, StoreProtocol
from kvstore.store import Store
from kvstore.tier.bucket import TierConfig
from kvstore.tier.store import TieredStore
from tests.kvstore.factories import make_store

IMPLEMENTATIONS = (Store, RemoteStore, TieredStore)


def _members(view) -> dict[str, object]:
    out = {}
    for cls in reversed(view.__mro__):
        if cls in (object,) or cls.__name__ == "Protocol" or cls.__module__ == "typing":
            continue
        for name, value in vars(cls).items():
            if not name.startswith("_"):
                out[name] = value
    return out


def _parameters(fn) -> list[tuple[str, object, object]]:
    """(name, kind, default) of every parameter but self."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("view", VIEWS + (StoreProtocol,), ids=lambda v: v.__name__)
def test_every_method_of_the_view_exists_with_the_protocols_parameters(impl, view):
    members = _members(view)
    assert members, f"{view.__name__} declares nothing"
    for name, declared in members.items():
        assert hasattr(impl, name), f"{impl.__name__} lacks {view.__name__}.{name}"
        actual = inspect.getattr_static(impl, name)
        if isinstance(declared, property):
            assert isinstance(actual, property), f"{impl.__name__}.{name} is not a property"
            continue
        want, got = _parameters(declared), _parameters(getattr(impl, name))
        assert got == want, f"{impl.__name__}.{name}{got} != protocol {want}"


class _NoBucket:
    """Stands in for an S3 bucket: the conformance test never reaches it."""

    name = "none"

    def close(self):
        pass


def _unreachable(request):
    raise AssertionError(f"the conformance test sent {request.method} {request.url}")


def test_instances_conform_and_declare_whether_pages_are_mapped(tmp_path):
    make_store(tmp_path / "served").close()  # the server's directory, opened read-only
    store = make_store(tmp_path / "store")
    remote = RemoteStore("http://kv", client=httpx.Client(base_url="http://kv",
                                                          transport=httpx.MockTransport(_unreachable)))
    remote_local = RemoteStore("http://kv", local_dir=tmp_path / "served",
                               client=httpx.Client(base_url="http://kv",
                                                   transport=httpx.MockTransport(_unreachable)))
    tiered = TieredStore(make_store(tmp_path / "tier-local"), TierConfig(bucket="b"),
                         bucket=_NoBucket(), start_uploader=False)
    try:
        for s in (store, remote, remote_local, tiered):
            for view in (PageReader, PageWriter, StoreAdmin, StoreProtocol):
                assert isinstance(s, view), f"{type(s).__name__} is not a {view.__name__}"
        assert store.maps_pages is True
        assert remote.maps_pages is False, "over HTTP every page is fetched into a new buffer"
        assert remote_local.maps_pages is True, "with local_dir pages come from the server's map"
        assert tiered.maps_pages is True
    finally:
        remote.close()
        remote_local.close()
        tiered.close()
        store.close()


def test_a_class_missing_a_method_does_not_conform():
    """The isinstance checks above can fail: a reader without get_pages is no PageReader."""

    class Partial:
        maps_pages = True

        def has_blocks(self, keys):
            return []

    assert not isinstance(Partial(), PageReader)
    assert not isinstance(Partial(), StoreProtocol)


class _EmptyBucket(_NoBucket):
    """A reachable bucket that holds nothing: every lookup's remote part is a miss."""

    def __init__(self):
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(2)

    def get(self, key):
        return None

    def head(self, key):
        return None

    def list(self, prefix):
        return []

    def close(self):
        self.pool.shutdown()


def test_store_and_tiered_store_agree_on_a_damaged_block(tmp_path):
    """has_blocks and lookup_prefix of a TieredStore answer as its local Store does when
    a page is quarantined (RemoteStore: tests/tools/test_remote_damage.py)."""
    from kvstore.errors import IntegrityError
    from kvstore.pages import HEADER_NBYTES
    from tests.kvstore.factories import (
        flip_bit,
        make_identity,
        restore_prefix,
        save_prefix,
        stored_value,
    )

    identity, tokens, path = make_identity(), list(range(300, 316)), tmp_path / "local"
    with make_store(path) as store:
        saved = save_prefix(store, identity, "default", tokens)
        value = stored_value(store, saved.records[2].pages[0])
    flip_bit(path, value, HEADER_NBYTES * 8 + 17)
    keys = list(saved.chain_keys)
    tiered = TieredStore(make_store(path), TierConfig(bucket="b"), bucket=_EmptyBucket(),
                         start_uploader=False)
    try:
        assert tiered.has_blocks(keys) == tiered.local.has_blocks(keys) == [True] * 4
        with pytest.raises(IntegrityError):
            restore_prefix(tiered, identity, "default", tokens)
        assert tiered.has_blocks(keys) == tiered.local.has_blocks(keys) == [True, True, False, True]
        assert restore_prefix(tiered, identity, "default", tokens)[0] == 8
        assert tiered.local.lookup_prefix(identity.format_id, "default", tokens).tokens_matched == 8
    finally:
        tiered.close()
