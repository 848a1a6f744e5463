"""WriteBehindPublisher's byte cap: it bounds the backlog, and never a single prompt;
and deferred captures (capture_later), whose host copy the worker makes."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from engine.engine_model import EngineModel
from engine.errors import FormatMismatch, OffsetMismatch
from engine.policy import KVPolicy
from engine.publish import DeferredCapture, capture, capture_later
from engine.restore import RestoreRequest, restore
from engine.writebehind import WriteBehindPublisher
from kvstore.store import Store
from tests.engine.factories import prompt_tokens, tiny_model

MODEL_ID = "test/tiny"


def _captured(model, identity, tokens):
    return capture(identity, tokens, _prefilled(model, tokens))


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


# -- capture_later: the device copies on the generation thread, the host copy on the worker


def _pages(cap) -> list[bytes]:
    return [bytes(p) for layer in cap.layers for p in layer.pages]


def _prefilled(model, tokens, caches=None):
    caches = caches if caches is not None else make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=caches))
    return caches


def test_a_deferred_capture_is_the_capture_of_the_cache_as_it_was_when_taken():
    # serve-model's generation thread goes on decoding into the same caches (and mlx-lm
    # trims and overwrites them) while the worker makes the host copy: the deferred
    # capture must hold the bytes of the moment it was taken, bit for bit
    model = tiny_model("llama", mx.bfloat16)
    identity = EngineModel(model, MODEL_ID, policy=KVPolicy(block_size_tokens=16)).identity
    tokens = prompt_tokens(40, seed=50).tolist()
    caches = _prefilled(model, tokens)
    expected = _pages(capture(identity, tokens, caches))
    later = capture_later(identity, tokens[:37], caches, defer=True)
    assert isinstance(later, DeferredCapture)
    for c in caches:  # what decoding after a trim does to the first tokens' rows
        c.keys[..., :8, :] = mx.zeros_like(c.keys[..., :8, :])
        c.values[..., 30:, :] = mx.ones_like(c.values[..., 30:, :])
    mx.eval([c.state for c in caches])
    cap = later.result()
    assert cap.tokens == tuple(tokens[:37])
    short = _pages(capture(identity, tokens[:37], _prefilled(model, tokens[:37])))
    assert _pages(cap) == short  # tolerance 0
    assert _pages(cap)[:2] == expected[:2]  # the full blocks are the 40-token capture's
    assert later.nbytes == cap.nbytes


def test_deferred_quantized_captures_are_the_codes_bit_for_bit():
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16, default_format="mlx-q8", group_size=64)
    identity = EngineModel(model, MODEL_ID, policy=policy).identity
    tokens = prompt_tokens(20, seed=51).tolist()
    caches = _prefilled(model, tokens, [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers])
    assert _pages(capture_later(identity, tokens, caches, defer=True).result()) == \
        _pages(capture(identity, tokens, caches))


def test_capture_later_checks_what_capture_checks_before_it_returns():
    model = tiny_model("llama", mx.bfloat16)
    identity = EngineModel(model, MODEL_ID, policy=KVPolicy(block_size_tokens=16)).identity
    tokens = prompt_tokens(20, seed=52).tolist()
    caches = _prefilled(model, tokens)
    with pytest.raises(OffsetMismatch):  # more tokens than the caches hold
        capture_later(identity, tokens + [1, 2], caches, defer=True)
    quantized = _prefilled(model, tokens, [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers])
    with pytest.raises(FormatMismatch):
        capture_later(identity, tokens, quantized, defer=True)


def test_the_publisher_publishes_deferred_captures_and_counts_their_failures(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    engine_model = EngineModel(model, MODEL_ID, policy=KVPolicy(block_size_tokens=16))
    tokens = prompt_tokens(48, seed=53).tolist()
    later = capture_later(engine_model.identity, tokens, _prefilled(model, tokens), defer=True)

    class Broken(DeferredCapture):
        def result(self):
            raise RuntimeError("device copy failed")

    broken = Broken(engine_model.identity, tuple(tokens[:16]), [])
    with Store(tmp_path / "s") as store:
        with WriteBehindPublisher(store, capacity_nbytes=1 << 30) as publisher:
            assert publisher.submit(broken) and publisher.submit(later)
            assert publisher.drain(timeout=60)
            stats = publisher.stats()
        assert (stats["published"], stats["failed"], stats["pinned_nbytes"]) == (1, 1, 0)
        assert "device copy failed" in stats["last_error"]
        restored = restore(engine_model, store, RestoreRequest(tokens + [1]))
        assert restored.tokens_restored == 48
