"""Issue 17 defect 1: a cache's layers must sit at one offset when published or restored."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from engine.attention import installed
from engine.engine_model import EngineModel
from engine.errors import OffsetMismatch
from engine.models import make_cache
from engine.policy import KVPolicy
from engine.publish import publish
from engine.restore import RestoreRequest, restore
from kvstore.store import Store
from tests.engine.factories import prompt_tokens, tiny_model

MODEL_ID = "test/tiny"


def _generated(model, policy, prompt, max_tokens):
    cache = make_cache(model, policy)
    with installed(model):
        out = [int(t) for t, _ in generate_step(mx.array(prompt), model, prompt_cache=cache,
                                                 max_tokens=max_tokens)]
    return cache, out


def test_checkpoint_after_generation_is_refused_and_the_held_tokens_restore_at_one_offset(
        tmp_path):
    model = tiny_model("gemma3_text", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    engine_model = EngineModel(model, MODEL_ID, policy=policy)
    prompt = prompt_tokens(40, seed=60).tolist()
    cache, out = _generated(model, policy, prompt, max_tokens=10)
    # mlx-lm fed every generated token back: the layers sit at 50, not at the prompt's 40
    assert {c.offset for c in cache} == {50}
    with Store(tmp_path / "s") as store:
        with pytest.raises(OffsetMismatch) as info:
            publish(engine_model, store, prompt, cache, checkpoint="x")
        assert info.value.offsets == [50] * 4 and info.value.tokens == 40
        assert store.list_checkpoints("default") == []
        # what the cache really holds publishes, and restores with every layer at 50
        held = prompt + out
        publish(engine_model, store, held, cache, checkpoint="x")
        restored = restore(engine_model, store, RestoreRequest(held + [1]))
        assert (restored.tokens_restored, restored.checkpoint) == (50, "x")
        assert [c.offset for c in restored.cache] == [50] * 4


def test_a_prefix_of_full_attention_layers_still_publishes_after_generation(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    prompt = prompt_tokens(40, seed=61).tolist()
    cache, _ = _generated(model, policy, prompt, max_tokens=4)
    with Store(tmp_path / "s") as store:
        engine_model = EngineModel(model, MODEL_ID, policy=policy)
        result = publish(engine_model, store, prompt, cache)
        assert (result.tokens, result.blocks) == (40, 3)
        restored = restore(engine_model, store, RestoreRequest(prompt + [1]))
        assert [c.offset for c in restored.cache] == [40, 40]


def test_a_stored_checkpoint_with_layers_past_its_tokens_is_refused_on_restore(tmp_path):
    # What capture wrote before it checked offsets: the rings at 50, the tokens 40.
    from dataclasses import replace

    from engine.publish import capture, upload

    model = tiny_model("gemma3_text", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    identity = EngineModel(model, MODEL_ID, policy=policy).identity
    prompt = prompt_tokens(40, seed=62).tolist()
    cache, out = _generated(model, policy, prompt, max_tokens=10)
    rings = capture(identity, prompt + out, cache, attachments=True).attachments
    old = replace(capture(identity, prompt, cache), attachments=rings)
    with Store(tmp_path / "s") as store:
        upload(store, old, checkpoint="old")
        with pytest.raises(OffsetMismatch, match="captured after generation"):
            restore(EngineModel(model, MODEL_ID, policy=policy), store, RestoreRequest(prompt + [1]))
