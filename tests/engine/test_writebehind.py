"""WriteBehindPublisher's byte cap: it bounds the backlog, and never a single prompt."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.engine_model import EngineModel
from engine.policy import KVPolicy
from engine.publish import capture
from engine.restore import RestoreRequest, restore
from engine.writebehind import WriteBehindPublisher
from kvstore.store import Store
from tests.engine.factories import prompt_tokens, tiny_model

MODEL_ID = "test/tiny"


def _captured(model, identity, tokens):
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=caches))
    return capture(identity, tokens, caches)


def test_a_capture_larger_than_the_cap_is_still_published(tmp_path):
    # serve-model's default 256 MiB cap is smaller than one 2K-token capture of an
    # 8B model (128 KiB per token): such prompts were dropped whole, every time
    model = tiny_model("llama", mx.bfloat16)
    engine_model = EngineModel(model, MODEL_ID, policy=KVPolicy(block_size_tokens=16))
    tokens = prompt_tokens(64, seed=40).tolist()
    big = _captured(model, engine_model.identity, tokens)
    with Store(tmp_path / "s") as store:
        with WriteBehindPublisher(store, capacity_nbytes=big.nbytes // 4) as publisher:
            assert publisher.submit(big)
            assert publisher.drain(timeout=60)
            stats = publisher.stats()
        assert (stats["published"], stats["dropped"], stats["failed"]) == (1, 0, 0)
        restored = restore(engine_model, store, RestoreRequest(tokens + [1]))
        assert restored.tokens_restored == 64


def test_over_the_cap_older_captures_go_first_and_the_newest_stays(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    engine_model = EngineModel(model, MODEL_ID, policy=KVPolicy(block_size_tokens=16))
    prompts = [prompt_tokens(64, seed=41 + i).tolist() for i in range(5)]
    captures = [_captured(model, engine_model.identity, p) for p in prompts]
    with Store(tmp_path / "s") as store:
        publisher = WriteBehindPublisher(store, capacity_nbytes=captures[0].nbytes // 2)
        with publisher._cond:  # hold the worker so the whole burst meets a full queue
            accepted = [publisher.submit(c) for c in captures]
            queued = [j.capture for j in publisher._queue]
        assert all(accepted)
        assert queued[-1] is captures[-1] and len(queued) == 1
        assert publisher.drain(timeout=60)
        stats = publisher.stats()
        publisher.close()
        assert stats["published"] + stats["dropped"] == len(captures)
        assert stats["published"] >= 1 and stats["dropped"] >= len(captures) - 2
        last = restore(engine_model, store, RestoreRequest(prompts[-1] + [1]))
        assert last.tokens_restored == 64
