"""A page damaged on disk, through the public entry points (issue 17, defects 2 and 3):
the read that finds the damage raises IntegrityError once; later restores stop before
the damaged block (a shorter prefix, never an error); publishing the same prefix again
re-sends the quarantined page, and the restore then equals the original, byte for byte
(tolerance 0: native pages are copied, not recomputed)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.attention import installed
from engine.engine_model import EngineModel
from engine.models import make_cache
from engine.policy import KVPolicy
from engine.publish import capture, publish
from engine.restore import RestoreRequest, restore
from kvstore.errors import IntegrityError
from kvstore.pages import HEADER_NBYTES
from kvstore.store import Store
from tests.engine.factories import prompt_tokens, tiny_model
from tests.kvstore.factories import assert_check_clean, flip_bit, stored_value

MODEL_ID = "test/tiny"
BLOCK = 16
TOKENS = 64  # four full blocks
DAMAGED_BLOCK = 2  # blocks 0 and 1 stay whole


def _prefilled(model, policy, tokens):
    cache = make_cache(model, policy)
    with installed(model):
        mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


@pytest.fixture
def damaged(tmp_path):
    """A store holding a published 64-token prompt whose block 2 has one page with a
    flipped bit on disk; returns (model, policy, identity, tokens, the original capture,
    the cache published, the store path)."""
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=BLOCK)
    identity = EngineModel(model, MODEL_ID, policy=policy).identity
    tokens = prompt_tokens(TOKENS, seed=11).tolist()
    cache = _prefilled(model, policy, tokens)
    original = capture(identity, tokens, cache)
    path = tmp_path / "store"
    with Store(path) as store:
        result = publish(EngineModel(model, MODEL_ID, policy=policy), store, tokens, cache)
        assert result.blocks == 4 and result.blocks_skipped == 0
        match = store.lookup_prefix(identity.format_id, "default", tokens)
        victim = match.blocks[DAMAGED_BLOCK].pages[0]
        value = stored_value(store, victim)
    flip_bit(path, value, HEADER_NBYTES * 8 + 77)  # a bit of the page's bytes, not its header
    return model, policy, identity, tokens, original, cache, path


def _restore(model, policy, tokens, store):
    return restore(EngineModel(model, MODEL_ID, policy=policy), store, RestoreRequest(tokens + [0]))


def test_damage_raises_once_then_restores_stop_before_the_damaged_block(damaged):
    model, policy, identity, tokens, original, _, path = damaged
    with Store(path) as store:
        with pytest.raises(IntegrityError):
            _restore(model, policy, tokens, store)  # the read that finds the damage
        for _ in range(2):  # never again: the prefix is cut before the damaged block
            again = _restore(model, policy, tokens, store)
            assert again.tokens_restored == DAMAGED_BLOCK * BLOCK
            assert again.blocks == DAMAGED_BLOCK
            got = capture(identity, tokens[: again.tokens_restored], again.cache)
            for a, b in zip(original.layers, got.layers, strict=True):
                for i in range(DAMAGED_BLOCK):
                    assert a.page(i) == b.page(i)
        stats = store.stats()
        assert stats.quarantined_count == 1
        assert stats.lookups_stopped_at_damage == 2


def test_publishing_again_heals_a_quarantined_page(damaged):
    model, policy, identity, tokens, original, cache, path = damaged
    with Store(path) as store:
        with pytest.raises(IntegrityError):
            _restore(model, policy, tokens, store)
        result = publish(EngineModel(model, MODEL_ID, policy=policy), store, tokens, cache)
        assert result.blocks_skipped == DAMAGED_BLOCK, "blocks before the damage stay skipped"
        assert result.pages_sent == 1, "exactly the quarantined page is sent again"
        healed = _restore(model, policy, tokens, store)
        assert healed.tokens_restored == TOKENS and healed.blocks == 4
        got = capture(identity, tokens, healed.cache)
        for a, b in zip(original.layers, got.layers, strict=True):
            for i in range(TOKENS // BLOCK):
                assert a.page(i) == b.page(i), f"block {i} restored other bytes"
        assert store.stats().quarantined_count == 0, "the healed page left quarantine"
        assert_check_clean(store, read_data=True)
