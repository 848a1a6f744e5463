"""Publish and restore across processes, checkpoints with attachments, refusals, write-behind."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from engine.attention import installed
from engine.engine_model import EngineModel
from engine.errors import FormatMismatch
from engine.models import make_cache, make_pools
from engine.policy import KVPolicy
from engine.publish import capture, publish
from engine.restore import RestoreRequest, restore
from engine.writebehind import WriteBehindPublisher
from kvstore.errors import IncompatibleFormat
from kvstore.store import Store
from tests.engine.factories import prompt_tokens, run_worker, tiny_model

MODEL_ID = "test/tiny"


def _run_worker(spec: dict) -> dict:
    return run_worker("tests.engine.xproc_worker", spec)


# (model type, page format): native must equal recompute exactly; each packed format must
# equal the same format computed from scratch. gemma3_text has sliding layers, restored
# from checkpoint attachments.
CROSS_PROCESS_CASES = [
    ("llama", "native"), ("llama", "k8v8"), ("llama", "k8v4"), ("llama", "k4v4"),
    ("gemma3_text", "native"), ("gemma3_text", "k4v4"),
]


@pytest.mark.parametrize("model_type,page_format", CROSS_PROCESS_CASES)
def test_cross_process_restore_equals_recompute(tmp_path, model_type, page_format):
    model = tiny_model(model_type, mx.bfloat16)
    weights = tmp_path / "weights.safetensors"
    model.save_weights(str(weights))
    shared = prompt_tokens(1500, seed=3).tolist()
    common = {"model_type": model_type, "dtype": "bfloat16", "weights": str(weights),
              "format": page_format, "block_size": 64, "store": str(tmp_path / "store")}
    published = _run_worker({**common, "role": "publish", "prompt": shared})
    assert published["blocks"] == -(-1500 // 64)
    suffix = prompt_tokens(40, seed=4).tolist()
    result = _run_worker({**common, "role": "restore", "prompt": shared + suffix, "generate": 32})
    if model_type == "llama":
        assert result["source"] == "prefix"
        assert result["tokens_restored"] == 1500  # 23 full blocks + the 28-token partial block
    else:
        assert result["source"] == "checkpoint"
        assert result["tokens_restored"] == 1500  # exactly the checkpoint, never partway
    assert len(result["got"]) == 32
    assert result["got"] == result["want"]


def _prefilled(model, policy, tokens):
    cache = make_cache(model, policy)
    with installed(model):
        mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


def test_partial_match_restores_only_shared_blocks(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    first = prompt_tokens(100, seed=5).tolist()
    with Store(tmp_path / "s") as store:
        publish(EngineModel(model, MODEL_ID, policy=policy), store, first,
                _prefilled(model, policy, first))
        other = first[:50] + prompt_tokens(60, seed=6).tolist()  # shares 3 full blocks (48 tokens)
        restored = restore(EngineModel(model, MODEL_ID, policy=policy), store,
                           RestoreRequest(other))
        assert restored.tokens_restored == 48 and restored.blocks == 3
        assert restored.cache[0].size() == 48


def test_incompatible_checkpoint_is_refused_before_allocation(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    native, packed = KVPolicy(block_size_tokens=16), KVPolicy(default_format="k4v4", block_size_tokens=16)
    tokens = prompt_tokens(64, seed=7).tolist()
    with Store(tmp_path / "s") as store:
        publish(EngineModel(model, MODEL_ID, policy=native), store, tokens,
                _prefilled(model, native, tokens), checkpoint="c")
        pools = make_pools(model, packed)
        blocks_before = [p.num_blocks for p in pools if p]
        used_before = [p.num_used_blocks for p in pools if p]
        mx.eval(mx.zeros(1))
        active_before = mx.get_active_memory()
        with pytest.raises(IncompatibleFormat) as info:
            restore(EngineModel(model, MODEL_ID, policy=packed, pools=pools), store,
                    RestoreRequest(tokens + [1], checkpoint="c"))
        fields = {path for path, _, _ in info.value.diff}
        assert "layers[0].page_format" in fields and "layers[0].rotation" in fields
        assert [p.num_blocks for p in pools if p] == blocks_before
        assert [p.num_used_blocks for p in pools if p] == used_before
        assert mx.get_active_memory() <= active_before


def test_pools_of_another_format_are_refused_with_diff(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    native, packed = KVPolicy(block_size_tokens=16), KVPolicy(default_format="k8v8", block_size_tokens=16)
    with Store(tmp_path / "s") as store:
        pools = make_pools(model, packed)
        with pytest.raises(IncompatibleFormat) as info:
            restore(EngineModel(model, MODEL_ID, policy=native, pools=pools), store,
                    RestoreRequest([1, 2, 3]))
        assert any(path.endswith("page_format") for path, _, _ in info.value.diff)
        assert all(p.num_used_blocks == 0 for p in pools if p)


def test_packed_restore_is_byte_identical_to_published_pages(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(default_format="k4v4", block_size_tokens=16)
    tokens = prompt_tokens(70, seed=8).tolist()
    identity = EngineModel(model, MODEL_ID, policy=policy).identity
    cache = _prefilled(model, policy, tokens)
    before = capture(identity, tokens, cache)
    with Store(tmp_path / "s") as store:
        engine_model = EngineModel(model, MODEL_ID, policy=policy)
        publish(engine_model, store, tokens, cache)
        restored = restore(engine_model, store, RestoreRequest(tokens + [0]))
        assert restored.tokens_restored == 70
        after = capture(identity, tokens, restored.cache)
    for a, b in zip(before.layers, after.layers):
        for i in range(-(-70 // 16)):
            assert a.page(i) == b.page(i)


@pytest.mark.parametrize("kind", ["kvcache", "quantized"])
def test_restore_into_stock_caches_matches_stock_recompute(tmp_path, kind):
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    tokens = prompt_tokens(90, seed=9).tolist()
    prompt = tokens + prompt_tokens(5, seed=10).tolist()
    # publish from a stock KVCache: users without the paged engine benefit too
    stock = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([tokens]), cache=stock))
    with Store(tmp_path / "s") as store:
        engine_model = EngineModel(model, MODEL_ID, policy=policy)
        publish(engine_model, store, tokens, stock)
        restored = restore(engine_model, store, RestoreRequest(prompt, cache_kind=kind))
    assert restored.tokens_restored == 90
    expected_type = KVCache if kind == "kvcache" else QuantizedKVCache
    assert all(isinstance(c, expected_type) for c in restored.cache)
    if kind == "quantized":  # quantized on restore: a conversion at the restored offset
        assert {c.converted_at_token for c in restored.cache} == {90}
    # Recompute the way mlx-lm does with kv_bits (generate_step's maybe_quantize_kv_cache):
    # prefill natively, then KVCache.to_quantized. A QuantizedKVCache from the first token
    # is a different computation (later layers see quantized attention), not a reference.
    # Same chunking (90 tokens, then 5), so the only possible difference is the restored
    # state: tolerance 0.
    fresh = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([prompt[:90]]), cache=fresh))
    if kind == "quantized":
        fresh = [c.to_quantized(group_size=64, bits=8) for c in fresh]
    for ours, theirs in zip(restored.cache, fresh):
        assert ours.offset == theirs.offset == 90
        for a, b in zip(_leaves(ours.state), _leaves(theirs.state)):
            assert mx.array_equal(a[..., :90, :], b[..., :90, :]).item()
    got = model(mx.array([prompt[90:]]), cache=restored.cache)[:, -1]
    want = model(mx.array([prompt[90:]]), cache=fresh)[:, -1]
    assert mx.array_equal(got, want).item()


def _leaves(state):
    from mlx.utils import tree_flatten
    return [v for _, v in tree_flatten(state) if isinstance(v, mx.array)]


def test_quantized_kvcache_is_not_published_as_native(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    caches = [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
    tokens = prompt_tokens(20, seed=11).tolist()
    mx.eval(model(mx.array([tokens]), cache=caches))
    with pytest.raises(FormatMismatch):
        capture(EngineModel(model, MODEL_ID, policy=policy).identity, tokens, caches)


def test_write_behind_drops_under_a_tiny_cap_and_never_serves_wrong_pages(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    identity = EngineModel(model, MODEL_ID, policy=policy).identity
    prompts = [prompt_tokens(64, seed=20 + i).tolist() for i in range(6)]
    captures = [capture(identity, p, _prefilled(model, policy, p)) for p in prompts]
    with Store(tmp_path / "s") as store:
        publisher = WriteBehindPublisher(store, capacity_nbytes=int(captures[0].nbytes * 1.5))
        accepted = [publisher.submit(c) for c in captures]
        assert publisher.drain(timeout=60)
        stats = publisher.stats()
        publisher.close()
        assert stats["dropped"] >= 1 and stats["failed"] == 0
        assert stats["published"] + stats["dropped"] == len(captures)
        assert stats["pinned_nbytes"] == 0
        assert accepted[-1]  # the newest capture is never the oldest in the queue
        for prompt, cap in zip(prompts, captures):
            restored = restore(EngineModel(model, MODEL_ID, policy=policy), store,
                               RestoreRequest(prompt + [1]))
            if restored.tokens_restored:
                again = capture(identity, prompt, restored.cache)
                assert all(a.page(i) == b.page(i) for a, b in zip(cap.layers, again.layers)
                           for i in range(4))


def test_sliding_state_is_never_restored_partway(tmp_path):
    model = tiny_model("gemma3_text", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    tokens = prompt_tokens(40, seed=30).tolist()
    with Store(tmp_path / "s") as store:
        engine_model = EngineModel(model, MODEL_ID, policy=policy)
        publish(engine_model, store, tokens, _prefilled(model, policy, tokens), checkpoint="ring")
        # shares 32 tokens (2 full blocks) but not the checkpoint's 40: the sliding
        # layers' rings are only valid at 40, so nothing is restored
        diverged = tokens[:32] + prompt_tokens(20, seed=31).tolist()
        assert restore(engine_model, store, RestoreRequest(diverged)).tokens_restored == 0
        extended = tokens + prompt_tokens(5, seed=32).tolist()
        restored = restore(engine_model, store, RestoreRequest(extended))
        assert (restored.tokens_restored, restored.source, restored.checkpoint) == (40, "checkpoint", "ring")
        assert all(c.offset == 40 for c in restored.cache)


def test_publish_and_restore_through_the_http_service(tmp_path):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from api.settings import Settings
    from kvstore.client import RemoteStore

    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(block_size_tokens=16)
    tokens = prompt_tokens(90, seed=50).tolist()
    with Store(tmp_path / "s") as store:
        app = create_app(store=store, settings=Settings(data_dir=store.path))
        with TestClient(app) as client:
            remote = RemoteStore("http://testserver", None, client=client)
            engine_model = EngineModel(model, MODEL_ID, policy=policy)
            publish(engine_model, remote, tokens, _prefilled(model, policy, tokens))
            restored = restore(engine_model, remote, RestoreRequest(tokens + [3]))
    assert restored.tokens_restored == 90
    fresh = _prefilled(model, policy, tokens)
    with installed(model):
        want = model(mx.array([[3]]), cache=fresh)[:, -1]
        got = model(mx.array([[3]]), cache=restored.cache)[:, -1]
    assert mx.array_equal(got, want).item()


# -- mlx-lm's QuantizedKVCache: mlx-qB pages ------------------------------------------------
def _quantized_policy(bits=4, group_size=64, block=16):
    return KVPolicy(default_format=f"mlx-q{bits}", group_size=group_size, block_size_tokens=block)


def _quantized_prefilled(model, tokens, bits=4, group_size=64):
    caches = [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]
    mx.eval(model(mx.array([tokens]), cache=caches))
    return caches


def _quantized_arrays(cache, tokens):
    """codes, scales, biases of K then V for the first `tokens` tokens."""
    return [a[..., :tokens, :] for a in (*cache.keys, *cache.values)]


# (model type, bits, group size). gemma3_text's sliding layers travel as attachments of
# the checkpoint the publisher makes; its full layers are QuantizedKVCaches.
QUANTIZED_CROSS_PROCESS_CASES = [("llama", 4, 64), ("llama", 8, 32), ("gemma3_text", 8, 64)]


@pytest.mark.parametrize("model_type,bits,group_size", QUANTIZED_CROSS_PROCESS_CASES)
def test_cross_process_quantized_kvcache_restore_equals_quantized_recompute(
        tmp_path, model_type, bits, group_size):
    model = tiny_model(model_type, mx.bfloat16)
    weights = tmp_path / "weights.safetensors"
    model.save_weights(str(weights))
    shared = prompt_tokens(300, seed=12).tolist()
    common = {"model_type": model_type, "dtype": "bfloat16", "weights": str(weights),
              "cache": "quantized", "bits": bits, "group_size": group_size, "block_size": 64,
              "store": str(tmp_path / "store")}
    published = _run_worker({**common, "role": "publish", "prompt": shared})
    assert published["blocks"] == -(-300 // 64)
    suffix = prompt_tokens(40, seed=13).tolist()
    result = _run_worker({**common, "role": "restore", "prompt": shared + suffix, "generate": 16})
    assert result["types"] == (["QuantizedKVCache"] if model_type == "llama"
                               else ["QuantizedKVCache", "RotatingKVCache"])
    assert result["source"] == ("prefix" if model_type == "llama" else "checkpoint")
    assert result["tokens_restored"] == 300  # 4 full blocks and the 44-token partial one
    # Codes, scales and biases of every layer, byte for byte as the publisher held them.
    assert len(result["state"]) == 2 * 6  # two full-attention layers, six arrays each
    assert len(set(result["state"])) == 12
    assert result["state"] == published["state"]
    # The same QuantizedKVCache computed from scratch over the whole prompt: tokens and
    # every step's logprobs, tolerance 0.
    assert len(result["got"]) == 16
    assert result["got"] == result["want"]
    assert result["got_logprobs"] == result["want_logprobs"]
    # The comparison can tell caches apart: native K/V give other logprobs.
    assert result["got_logprobs"] != result["native_logprobs"]


def test_quantized_pages_restore_byte_identical_and_partial_prefix(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    policy = _quantized_policy(bits=4, group_size=32, block=16)
    identity = EngineModel(model, MODEL_ID, policy=policy).identity
    assert [identity.layers[i].page_format for i in identity.paged_layers] == ["mlx-q4"] * 2
    assert {(x.group_size, x.scale_dtype, x.rotation) for x in identity.layers} == {
        (32, "bfloat16", "none")}
    first = prompt_tokens(100, seed=40).tolist()
    published = _quantized_prefilled(model, first, bits=4, group_size=32)
    before = capture(identity, first, published)
    with Store(tmp_path / "s") as store:
        engine_model = EngineModel(model, MODEL_ID, policy=policy)
        publish(engine_model, store, first, published)
        whole = restore(engine_model, store, RestoreRequest(first + [1], cache_kind="quantized"))
        assert whole.tokens_restored == 100 and whole.blocks == 7
        after = capture(identity, first, whole.cache)
        other = first[:50] + prompt_tokens(60, seed=41).tolist()  # shares 3 full blocks
        partial = restore(engine_model, store, RestoreRequest(other, cache_kind="quantized"))
    for a, b in zip(before.layers, after.layers, strict=True):
        assert all(a.page(i) == b.page(i) for i in range(7))
    assert partial.tokens_restored == 48 and partial.blocks == 3
    for theirs, ours, part in zip(published, whole.cache, partial.cache, strict=True):
        assert type(ours) is QuantizedKVCache and (ours.bits, ours.group_size) == (4, 32)
        assert ours.offset == 100 and part.offset == 48
        for a, b in zip(_quantized_arrays(theirs, 100), _quantized_arrays(ours, 100), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
        for a, b in zip(_quantized_arrays(theirs, 48), _quantized_arrays(part, 48), strict=True):
            assert mx.array_equal(a, b).item()
    # and it keeps working as a QuantizedKVCache: the next tokens match the published cache
    rest = prompt_tokens(5, seed=42).tolist()
    got = model(mx.array([rest]), cache=whole.cache)[:, -1]
    want = model(mx.array([rest]), cache=published)[:, -1]
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("target,kwargs,field", [
    ("bits", {"policy": _quantized_policy(bits=8)}, "layers[0].page_format"),
    ("group size", {"policy": _quantized_policy(group_size=32)}, "layers[0].group_size"),
    ("scale dtype", {"dtype": mx.float32}, "layers[0].scale_dtype"),
    ("explicit bits", {"quantized_bits": 8}, "layers[0].page_format"),
    ("explicit group size", {"quantized_group_size": 128}, "layers[0].group_size"),
    ("paged target", {"cache_kind": "paged"}, "layers[0].page_format"),
    ("kvcache target", {"cache_kind": "kvcache"}, "layers[0].page_format"),
])
def test_quantized_identity_mismatch_is_refused_before_allocation(tmp_path, target, kwargs, field):
    model = tiny_model("llama", mx.bfloat16)
    policy = _quantized_policy(bits=4, group_size=64)
    tokens = prompt_tokens(64, seed=43).tolist()
    with Store(tmp_path / "s") as store:
        publish(EngineModel(model, MODEL_ID, policy=policy), store, tokens,
                _quantized_prefilled(model, tokens), checkpoint="c")
        kwargs = dict(kwargs)
        reader = tiny_model("llama", kwargs.pop("dtype")) if "dtype" in kwargs else model
        reader_model = EngineModel(reader, MODEL_ID, policy=kwargs.pop("policy", policy))
        args = {"cache_kind": "quantized", **kwargs}
        mx.eval(mx.zeros(1))
        active_before = mx.get_active_memory()
        with pytest.raises(IncompatibleFormat) as info:
            restore(reader_model, store, RestoreRequest(tokens + [1], checkpoint="c", **args))
        assert mx.get_active_memory() <= active_before
        assert field in {path for path, _, _ in info.value.diff}, info.value.diff
        # the same restore with the publisher's identity goes through
        ok = restore(EngineModel(model, MODEL_ID, policy=policy), store,
                     RestoreRequest(tokens + [1], cache_kind="quantized", checkpoint="c"))
        assert ok.tokens_restored == 64


def test_quantized_kvcache_is_published_only_under_its_own_identity(tmp_path):
    model = tiny_model("llama", mx.bfloat16)
    tokens = prompt_tokens(20, seed=44).tolist()
    caches = _quantized_prefilled(model, tokens, bits=4, group_size=64)
    for policy in (_quantized_policy(bits=8), _quantized_policy(group_size=32),
                   KVPolicy(default_format="k4v4", block_size_tokens=16)):
        with pytest.raises(FormatMismatch):
            capture(EngineModel(model, MODEL_ID, policy=policy).identity, tokens, caches)
    # and a KVCache is not published as mlx-qB pages
    stock = [KVCache() for _ in model.layers]
    mx.eval(model(mx.array([tokens]), cache=stock))
    with pytest.raises(FormatMismatch):
        capture(EngineModel(model, MODEL_ID, policy=_quantized_policy()).identity, tokens, stock)
    cap = capture(EngineModel(model, MODEL_ID, policy=_quantized_policy()).identity, tokens, caches)
    assert [len(cap.layers[0].page(i)) for i in range(2)] == [
        cap.layers[0].spec.page_nbytes(16), cap.layers[0].spec.page_nbytes(4)]


def test_paged_engine_refuses_mlx_q_pages_with_a_typed_error():
    from engine.errors import UnpagedFormat

    model = tiny_model("llama", mx.bfloat16)
    with pytest.raises(UnpagedFormat, match="QuantizedKVCache"):
        make_pools(model, _quantized_policy())
    with pytest.raises(UnpagedFormat):
        make_cache(model, _quantized_policy())


@pytest.mark.parametrize("page_format", ["native", "mlx-q8"])
def test_generate_with_store_restores_what_it_published(tmp_path, page_format):
    from engine.generate import generate_with_store
    from engine.rates import RateBook

    model = tiny_model("llama", mx.bfloat16)
    policy = KVPolicy(default_format=page_format, block_size_tokens=16)
    prompt = prompt_tokens(70, seed=45).tolist()
    with Store(tmp_path / "s") as store:
        engine_model = EngineModel(model, MODEL_ID, policy=policy)
        first = generate_with_store(engine_model, None, prompt, store, max_new_tokens=8,
                                    rates=RateBook())
        assert first.tokens_restored == 0 and first.published["blocks"] == 5
        # a fresh rate book has no prefill samples and restores: the 4 full blocks (at most
        # 69 tokens may be restored, and the stored partial block holds all 6 of the rest)
        again = generate_with_store(engine_model, None, prompt, store, max_new_tokens=8,
                                    rates=RateBook(), publish_prompt=False)
    assert again.tokens_restored == 64 and again.tokens_computed == 6
    assert again.tokens == first.tokens
