"""ResidentIndex: blocks already in this process are shared, not fetched again."""

from __future__ import annotations

import mlx.core as mx

from engine.attention import installed
from engine.engine_model import EngineModel
from engine.models import make_cache, make_pools
from engine.policy import KVPolicy
from engine.resident import ResidentIndex
from kvstore.ids import chain_keys
from tests.engine.factories import prompt_tokens, tiny_model

MODEL_ID = "test/tiny"


def test_adopted_blocks_are_shared_and_copy_on_write():
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    identity = EngineModel(model, MODEL_ID, policy=policy).identity
    pools = make_pools(model, policy)
    tokens = prompt_tokens(50, seed=40).tolist()
    with installed(model):
        cache = make_cache(model, policy, pools=pools)
        mx.eval(model(mx.array([tokens]), cache=cache))
        index = ResidentIndex(pools, capacity_blocks=8)
        assert index.register(identity, "default", tokens, cache) == 3  # full blocks only
        keys = chain_keys(identity.format_id, "default", tokens, 16)
        assert index.longest(keys) == 3
        assert index.longest(chain_keys(identity.format_id, "other", tokens, 16)) == 0
        used = [p.num_used_blocks for p in pools if p]
        adopted = index.adopt(keys[:3], 16, attention_impl=cache[0].attention_impl)
        assert [p.num_used_blocks for p in pools if p] == used  # nothing allocated, nothing copied
        restored = [adopted.get(i, c) for i, c in enumerate(cache)]
        for layer, c in adopted.items():
            assert c.block_ids == cache[layer].block_ids[:3]
            assert pools[layer].refcount(c.block_ids[0]) == 3  # live cache, index, adopted
        # the adopted caches continue the prompt exactly like the live cache
        suffix = tokens[48:]
        got = model(mx.array([suffix]), cache=restored)[:, -1]
        for c in cache:
            c.trim(c.size() - 48)
        want = model(mx.array([suffix]), cache=cache)[:, -1]
        assert mx.array_equal(got, want).item()
        index.clear()
        assert len(index) == 0


def test_restore_shares_resident_blocks_and_reads_only_the_rest(tmp_path):
    from engine import EngineModel, RestoreRequest, publish, restore
    from kvstore.store import Store

    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    identity = EngineModel(model, MODEL_ID, policy=policy).identity
    pools = make_pools(model, policy)
    index = ResidentIndex(pools)
    tokens = prompt_tokens(80, seed=41).tolist()
    with Store(tmp_path / "s") as store, installed(model):
        cache = make_cache(model, policy, pools=pools)
        mx.eval(model(mx.array([tokens]), cache=cache))
        engine_model = EngineModel(model, MODEL_ID, policy=policy, resident=index)
        publish(engine_model, store, tokens, cache)
        index.register(identity, "default", tokens[:32], cache)  # 2 of the 5 blocks resident
        first = restore(engine_model, store, RestoreRequest(tokens + [1]))
        assert (first.tokens_restored, first.resident_blocks, first.blocks) == (80, 2, 5)
        assert first.bytes_read == 3 * identity.block_nbytes(16)  # only the 3 blocks not resident
        for layer, c in enumerate(first.cache):
            assert c.block_ids[:2] == cache[layer].block_ids[:2]
        # the restore listed every full block it built: a second restore reads nothing
        second = restore(engine_model, store, RestoreRequest(tokens + [1]))
        assert (second.resident_blocks, second.bytes_read) == (5, 0)
        want = model(mx.array([[1]]), cache=cache)[:, -1]
        for restored in (first, second):
            got = model(mx.array([[1]]), cache=restored.cache)[:, -1]
            assert mx.array_equal(got, want).item()
        index.clear()


def test_a_salted_namespace_shares_resident_blocks_too(tmp_path):
    """The index keys blocks as the store does: with the namespace's chain salt, so a
    restore in a salted namespace finds what the previous restore listed."""
    from engine import EngineModel, RestoreRequest, publish, restore
    from kvstore.store import Store, StoreConfig

    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    pools = make_pools(model, policy)
    index = ResidentIndex(pools)
    tokens = prompt_tokens(48, seed=42).tolist()
    config = StoreConfig(chain_salts={"team-b": "ab" * 32})
    with Store(tmp_path / "s", config) as store, installed(model):
        cache = make_cache(model, policy, pools=pools)
        mx.eval(model(mx.array([tokens]), cache=cache))
        engine_model = EngineModel(model, MODEL_ID, policy=policy, resident=index)
        publish(engine_model, store, tokens, cache, namespace="team-b")
        first = restore(engine_model, store, RestoreRequest(tokens + [1], namespace="team-b"))
        assert (first.tokens_restored, first.resident_blocks) == (48, 0)
        second = restore(engine_model, store, RestoreRequest(tokens + [1], namespace="team-b"))
        assert (second.resident_blocks, second.bytes_read) == (3, 0)
        want = model(mx.array([[1]]), cache=cache)[:, -1]
        got = model(mx.array([[1]]), cache=second.cache)[:, -1]
        assert mx.array_equal(got, want).item()
        index.clear()
