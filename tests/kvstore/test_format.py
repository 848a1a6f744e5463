"""Format identity: diff names every differing field, newer schemas are refused, and a
prefix saved under one identity never matches a lookup under another."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kvstore.errors import IncompatibleFormat, InvalidInput, UnsupportedVersion
from kvstore.format import SCHEMA_VERSION, FormatIdentity, diff
from kvstore.records import Checkpoint
from kvstore.store import STORE_SCHEMA_VERSION, U64, Store
from tests.kvstore.factories import (
    make_identity,
    make_layer,
    make_store,
    restore_prefix,
    save_prefix,
)

BASE = make_identity()

# name -> (the other identity, the diff paths that must be named)
MISMATCHES = {
    "model_fingerprint": (replace(BASE, model_fingerprint="e" * 64), ["model_fingerprint"]),
    "layer_count": (replace(BASE, layers=BASE.layers + (make_layer(),)), ["len(layers)"]),
    "page_format": (replace(BASE, layers=(make_layer(page_format="native-f16"),) + BASE.layers[1:]),
                    ["layers[0].page_format"]),
    "block_size": (replace(BASE, block_size_tokens=8), ["block_size_tokens"]),
    "rotation": (replace(BASE, layers=BASE.layers[:1] + (replace(BASE.layers[1], rotation="none"),)
                         + BASE.layers[2:]), ["layers[1].rotation"]),
}


def test_diff_names_every_differing_field():
    assert diff(BASE, BASE) == []
    other = replace(BASE, model_id="other", block_size_tokens=16, tokenizer_fingerprint="",
                    layers=(make_layer(kv_heads=4, k_head_dim=32),) + BASE.layers[1:])
    assert diff(BASE, other) == [
        ("block_size_tokens", 4, 16),
        ("model_id", "test/tiny", "other"),
        ("tokenizer_fingerprint", "t" * 64, ""),
        ("layers[0].k_head_dim", 16, 32),
        ("layers[0].kv_heads", 2, 4),
    ]


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_require_same_raises_with_the_diff(name):
    other, paths = MISMATCHES[name]
    with pytest.raises(IncompatibleFormat) as err:
        BASE.require_same(other)
    assert [path for path, _, _ in err.value.diff] == paths
    for path in paths:
        assert path in str(err.value)
    BASE.require_same(make_identity())  # an equal identity passes


@pytest.mark.parametrize("name", sorted(MISMATCHES))
def test_another_identity_never_matches_in_lookup(tmp_path, name):
    other, _ = MISMATCHES[name]
    tokens = list(range(40, 53))
    with make_store(tmp_path) as store:
        save_prefix(store, BASE, "ns", tokens)
        store.put_format(other)
        assert restore_prefix(store, BASE, "ns", tokens)[0] == len(tokens)
        assert store.lookup_prefix(other.format_id, "ns", tokens).tokens_matched == 0
        assert store.lookup_prefix(BASE.format_id, "other-ns", tokens).tokens_matched == 0
        # saving under the other identity makes a separate chain, not a shared one
        save_prefix(store, other, "ns", tokens)
        assert store.lookup_prefix(other.format_id, "ns", tokens).tokens_matched == len(tokens)


def test_unknown_format_never_matches(tmp_path):
    with make_store(tmp_path) as store:
        save_prefix(store, BASE, "ns", list(range(8)))
        unknown = replace(BASE, model_id="never-stored")
        assert store.lookup_prefix(unknown.format_id, "ns", list(range(8))).tokens_matched == 0


def test_a_checkpoint_refuses_blocks_of_another_format(tmp_path):
    other, _ = MISMATCHES["model_fingerprint"]
    tokens = list(range(8))
    with make_store(tmp_path) as store:
        saved = save_prefix(store, BASE, "ns", tokens)
        store.put_format(other)
        with pytest.raises(InvalidInput):
            store.create_checkpoint(Checkpoint("c", "ns", other.format_id, tuple(tokens), saved.chain_keys))


def test_newer_schema_version_is_refused():
    data = json.loads(BASE.canonical())
    data["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(UnsupportedVersion) as err:
        FormatIdentity.from_json(json.dumps(data))
    assert "newer" in str(err.value)
    with pytest.raises(UnsupportedVersion):
        replace(BASE, schema_version=SCHEMA_VERSION + 1)
    assert isinstance(err.value, IncompatibleFormat)


@pytest.mark.parametrize("mutate", [
    lambda d: d.update(extra_field=1),
    lambda d: d["layers"][0].update(extra=1),
    lambda d: d.update(layers=[]),
    lambda d: d.update(block_size_tokens=0),
    lambda d: d.update(block_size_tokens=True),
    lambda d: d["layers"][1].update(group_size=0),
    lambda d: d["layers"][0].update(page_format="fp8"),
    lambda d: d["layers"][0].update(kv_heads=-1),
    lambda d: d.update(schema_version=0),
    lambda d: d.update(model_id="x" * 257),
])
def test_malformed_identities_are_refused(mutate):
    data = json.loads(BASE.canonical())
    mutate(data)
    with pytest.raises(InvalidInput):
        FormatIdentity.from_json(json.dumps(data))


def test_store_with_a_newer_schema_is_refused(tmp_path):
    with make_store(tmp_path) as store:
        store.lmdb.write(lambda txn, dbs: txn.put(b"schema_version", U64.pack(STORE_SCHEMA_VERSION + 1),
                                                  db=dbs["meta"]))
    with pytest.raises(UnsupportedVersion):
        Store(tmp_path)


def test_mlx_affine_layers_diff_on_bits_group_size_and_scale_dtype():
    """Each of what an mlx-qB page's bytes depend on is part of the identity."""
    q4 = make_layer(page_format="mlx-q4", k_head_dim=64, v_head_dim=64, group_size=32,
                    scale_dtype="bfloat16")
    base = replace(BASE, layers=(q4,) + BASE.layers[1:])
    others = {
        "layers[0].page_format": replace(q4, page_format="mlx-q8"),
        "layers[0].group_size": replace(q4, group_size=64),
        "layers[0].scale_dtype": replace(q4, scale_dtype="float16"),
    }
    ids = {base.format_id}
    for path, layer in others.items():
        other = replace(base, layers=(layer,) + base.layers[1:])
        assert [p for p, _, _ in diff(base, other)] == [path]
        ids.add(other.format_id)
    assert len(ids) == 1 + len(others)
    assert base.layers[0].page_nbytes(4) == 2 * 4 * (128 * 4 // 8 + 2 * 2 * 128 // 32)
