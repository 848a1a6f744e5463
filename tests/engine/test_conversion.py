"""Issue 17 defect 5: a QuantizedKVCache converted partway is another computation than one
quantized from its first token, so it gets another format id, chain and minimum offset."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

from engine.engine_model import EngineModel
from engine.errors import FormatMismatch
from engine.formats import format_identity
from engine.models import kv_dtype
from engine.policy import KVPolicy
from engine.publish import capture, publish
from engine.restore import RestoreRequest, restore
from kvstore.store import Store
from tests.engine.factories import prompt_tokens, tiny_model

MODEL_ID = "test/tiny"
POLICY = KVPolicy(default_format="mlx-q4", group_size=64, block_size_tokens=16)


def _converted(model, store, prompt, start):
    """What a user gets from generate_step(kv_bits=4, quantized_kv_start=start) on the
    engine's stock caches: the first `start` tokens native, then mx.quantize'd."""
    fresh = restore(EngineModel(model, MODEL_ID, policy=KVPolicy(block_size_tokens=16)), store,
                    RestoreRequest(prompt, cache_kind="kvcache"))
    assert fresh.tokens_restored == 0
    cache = fresh.cache
    for _ in generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=1, kv_bits=4,
                           kv_group_size=64, quantized_kv_start=start, prefill_step_size=start):
        pass
    assert all(isinstance(c, QuantizedKVCache) for c in cache)
    return cache


def _from_token_zero(model, prompt):
    caches = [QuantizedKVCache(group_size=64, bits=4) for _ in model.layers]
    mx.eval(model(mx.array([prompt]), cache=caches))
    return caches


def test_a_converted_cache_is_never_served_as_one_quantized_from_token_zero(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    prompt = prompt_tokens(70, seed=70).tolist()
    engine_model = EngineModel(model, MODEL_ID, policy=POLICY)
    zero_identity = engine_model.identity
    with Store(tmp_path / "s") as store:
        converted = _converted(model, store, prompt, start=32)
        # capturing it as "quantized from token 0" is refused: its pages differ
        with pytest.raises(FormatMismatch, match="converted_at_token=32"):
            capture(zero_identity, prompt, converted)
        ours = _from_token_zero(model, prompt)
        assert publish(engine_model, store, prompt, ours).blocks_skipped == 0
        # under its own identity it is another format and another chain: nothing skipped
        # publish names the pages by the caches' own conversion: another format and chain
        converted_identity = engine_model.identity_for(32)
        assert converted_identity == format_identity(model, POLICY, model_id=MODEL_ID,
                                                     model_dtype=kv_dtype(model),
                                                     converted_at_token=32)
        assert converted_identity.format_id != zero_identity.format_id
        result = publish(engine_model, store, prompt, converted)
        assert (result.blocks, result.blocks_skipped) == (5, 0)
        want_zero = capture(zero_identity, prompt, ours)
        want_converted = capture(converted_identity, prompt, converted)
        # layer 0 sees only embeddings; layer 1 saw native attention in one, quantized in the other
        assert want_zero.layers[1].page(0) != want_converted.layers[1].page(0)

        # each request gets the pages of its own history, byte for byte
        request = prompt + [1]
        zero = restore(engine_model, store, RestoreRequest(request, cache_kind="quantized"))
        conv = restore(engine_model, store, RestoreRequest(request, cache_kind="quantized",
                                                           converted_at_token=32))
        assert zero.tokens_restored == conv.tokens_restored == 70
        got_zero = capture(zero_identity, prompt, zero.cache)
        got_converted = capture(converted_identity, prompt, conv.cache)
        for want, got in ((want_zero, got_zero), (want_converted, got_converted)):
            assert all(a.page(i) == b.page(i) for a, b in zip(want.layers, got.layers)
                       for i in range(5))
        # the converted pages are never matched or trimmed below their conversion
        short = restore(engine_model, store, RestoreRequest(
            request, cache_kind="quantized", converted_at_token=32, max_restore_tokens=20))
        assert short.tokens_restored == 0
        assert conv.cache[0].trim(60) == 38 and conv.cache[0].offset == 32
        # a history nobody published is a miss, not another history's pages
        other = restore(engine_model, store, RestoreRequest(request, cache_kind="quantized",
                                                            converted_at_token=48))
        assert other.tokens_restored == 0


def test_a_converted_cache_is_not_published_below_its_conversion(tmp_path):
    from engine.errors import InvalidRequest

    model = tiny_model("llama", mx.bfloat16)
    prompt = prompt_tokens(70, seed=71).tolist()
    with Store(tmp_path / "s") as store:
        converted = _converted(model, store, prompt, start=32)
        with pytest.raises(InvalidRequest, match="below"):
            publish(EngineModel(model, MODEL_ID, policy=POLICY), store, prompt[:20], converted)


def test_pages_stored_under_schema_1_are_still_served_unless_their_history_is_unknown(tmp_path):
    # A store written before schema 2: the same identities at schema_version=1.
    from dataclasses import replace

    from engine.publish import upload
    from tests.engine.test_publish_restore import _prefilled

    model = tiny_model("llama", mx.bfloat16)
    prompt = prompt_tokens(40, seed=72).tolist()
    native = EngineModel(model, MODEL_ID, policy=KVPolicy(block_size_tokens=16))
    quantized = EngineModel(model, MODEL_ID, policy=POLICY)
    old_native = replace(native.identity, schema_version=1, converted_at_token=0)
    old_quantized = replace(quantized.identity, schema_version=1, converted_at_token=0)
    assert old_native.format_id == native.identity.equivalent_older().format_id
    assert quantized.identity.equivalent_older() is None
    with Store(tmp_path / "s") as store:
        upload(store, capture(old_native, prompt, _prefilled(model, native.policy, prompt)),
               checkpoint="n")
        upload(store, capture(old_quantized, prompt, _from_token_zero(model, prompt)),
               checkpoint="q")
        request = RestoreRequest(prompt + [1])
        assert restore(native, store, request).tokens_restored == 40
        assert restore(native, store, RestoreRequest(prompt + [1], checkpoint="n")).tokens_restored == 40
        # schema-1 mlx-qB pages may come from a converted cache: never served
        assert restore(quantized, store, RestoreRequest(prompt + [1], cache_kind="quantized")
                       ).tokens_restored == 0
        from kvstore.errors import IncompatibleFormat
        with pytest.raises(IncompatibleFormat):
            restore(quantized, store, RestoreRequest(prompt + [1], cache_kind="quantized",
                                                     checkpoint="q"))


def test_tracked_caches_save_and_load_with_mlx_lm_as_its_own_classes(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from engine.stock import to_mlx_lm

    model = tiny_model("llama", mx.bfloat16)
    prompt = prompt_tokens(70, seed=73).tolist()
    with Store(tmp_path / "s") as store:
        converted = _converted(model, store, prompt, start=32)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, to_mlx_lm(converted))
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [QuantizedKVCache] * 2
    for ours, theirs in zip(converted, loaded, strict=True):
        assert theirs.offset == ours.offset
        for a, b in zip(ours.keys, theirs.keys, strict=True):
            assert mx.array_equal(a[..., : ours.offset, :], b[..., : ours.offset, :]).item()
