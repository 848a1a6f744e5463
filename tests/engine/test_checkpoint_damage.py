"""Issue 17 defect 3, restore's checkpoint path: a page damaged on disk raises
IntegrityError once, at the read that finds it; afterwards a named checkpoint gives the
blocks before the damage (full-attention models) or nothing (state valid only at its own
length), and a hybrid model's lookup passes over to a shorter usable checkpoint."""

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
from tests.kvstore.factories import flip_bit, stored_value

MODEL_ID = "test/tiny"
POLICY = KVPolicy(block_size_tokens=16)


def _prefilled(model, tokens):
    cache = make_cache(model, POLICY)
    with installed(model):
        mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


def _hybrid(n_tokens: int, seed: int):
    """A tiny gemma3_text (sliding layers: checkpoints carry attachments), its engine
    model and a prompt of n_tokens."""
    model = tiny_model("gemma3_text", mx.bfloat16)
    return model, EngineModel(model, MODEL_ID, policy=POLICY), prompt_tokens(n_tokens, seed=seed).tolist()


def _damage(path, checkpoint: str, block: int) -> None:
    """Flip a bit of the first page of the checkpoint's block `block`, no Store open."""
    with Store(path) as store:
        ckpt = store.get_checkpoint("default", checkpoint)
        value = stored_value(store, store.get_blocks(ckpt.chain_keys)[block].pages[0])
    flip_bit(path, value, HEADER_NBYTES * 8 + 77)


def test_a_named_checkpoint_gives_the_blocks_before_a_damaged_page(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    identity = EngineModel(model, MODEL_ID, policy=POLICY).identity
    tokens = prompt_tokens(64, seed=80).tolist()
    cache = _prefilled(model, tokens)
    original = capture(identity, tokens, cache)
    path = tmp_path / "s"
    with Store(path) as store:
        publish(EngineModel(model, MODEL_ID, policy=POLICY), store, tokens, cache, checkpoint="c")
    _damage(path, "c", block=2)
    with Store(path) as store:
        def again():
            return restore(EngineModel(model, MODEL_ID, policy=POLICY), store,
                           RestoreRequest(tokens + [0], checkpoint="c"))
        with pytest.raises(IntegrityError):
            again()  # the read that finds the damage says so, once
        for _ in range(2):  # and never again: the blocks before it, the rest recomputed
            restored = again()
            assert (restored.tokens_restored, restored.blocks) == (32, 2)
            assert (restored.source, restored.checkpoint) == ("checkpoint", "c")
            got = capture(identity, tokens[:32], restored.cache)
            assert all(a.page(i) == b.page(i) for a, b in zip(original.layers, got.layers)
                       for i in range(2))


def test_a_hybrid_model_passes_over_a_damaged_checkpoint_to_a_shorter_one(tmp_path):
    model, engine_model, tokens = _hybrid(48, seed=81)
    path = tmp_path / "s"
    with Store(path) as store:
        publish(engine_model, store, tokens[:32], _prefilled(model, tokens[:32]), checkpoint="short")
        publish(engine_model, store, tokens, _prefilled(model, tokens), checkpoint="long")
        assert restore(engine_model, store, RestoreRequest(tokens + [0])).checkpoint == "long"
    _damage(path, "long", block=2)  # a block only "long" has
    with Store(path) as store:
        def again(**kwargs):
            return restore(engine_model, store, RestoreRequest(tokens + [0], **kwargs))
        with pytest.raises(IntegrityError):
            again()
        for _ in range(2):
            restored = again()
            assert (restored.tokens_restored, restored.checkpoint) == (32, "short")
            assert [c.offset for c in restored.cache] == [32] * 4
        # named, a checkpoint with attachments is all or nothing: its rings sit at 48
        named = again(checkpoint="long")
        assert (named.tokens_restored, named.source) == (0, "none")
        assert [c.offset for c in named.cache] == [0] * 4


def test_a_missing_attachment_page_makes_a_checkpoint_unusable(tmp_path):
    model, engine_model, tokens = _hybrid(40, seed=82)
    path = tmp_path / "s"
    with Store(path) as store:
        publish(engine_model, store, tokens, _prefilled(model, tokens), checkpoint="ring")
        ring = next(iter(store.get_checkpoint("default", "ring").attachments.values()))
        value = stored_value(store, ring)
    flip_bit(path, value, HEADER_NBYTES * 8 + 77)
    with Store(path) as store:
        with pytest.raises(IntegrityError):
            restore(engine_model, store, RestoreRequest(tokens + [0]))
        restored = restore(engine_model, store, RestoreRequest(tokens + [0]))
        assert restored.tokens_restored == 0
