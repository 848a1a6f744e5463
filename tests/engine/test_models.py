"""engine.make_cache per model: paged full layers, mlx-lm's caches for the rest, the
probed geometry (no per-type rules), the load-time router check, and generation that
matches mlx-lm's own caches."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

import engine
from engine import EngineModel, KVPolicy, PagedKVCache, make_cache, make_pools
from engine.errors import UnsupportedModel
from engine.attention import GATHERED
from engine.geometry import layer_geometry, model_fingerprint, probe_geometry
from engine.formats import format_identity
from engine.models import check_paged_attention, kv_dtype
from tests.engine.factories import model_config, prompt_tokens, tiny_model
from tests.engine.test_model_sweep import build

POLICY = KVPolicy(block_size_tokens=16)


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("llama", {"num_hidden_layers": 3, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    ("qwen2", {}),
    ("qwen3", {}),
    ("gemma3_text", {}),
])
def test_make_cache_mirrors_mlx_lm(model_type, overrides):
    model = tiny_model(model_type, **overrides)
    stock = make_prompt_cache(model)
    caches = make_cache(model, POLICY)
    assert len(caches) == len(stock)
    layers = zip(caches, stock, layer_geometry(model), model.layers, strict=True)
    for ours, theirs, geometry, layer in layers:
        if geometry.kind == "full":
            assert isinstance(ours, PagedKVCache)
            attention = layer.self_attn
            assert ours.spec.kv_heads == attention.n_kv_heads
            assert ours.spec.k_head_dim * attention.n_kv_heads == attention.k_proj.weight.shape[0]
        else:
            assert type(ours) is type(theirs) is RotatingKVCache
            assert ours.max_size == theirs.max_size == geometry.window


def test_gemma3_with_sliding_layers_generates_like_mlx_lm(paged_calls):
    model = tiny_model("gemma3_text", mx.bfloat16)
    prompt = prompt_tokens(37, seed=11)  # longer than the window of 8 and 2 blocks of 16
    expected = list(generate_step(prompt, model, prompt_cache=make_prompt_cache(model),
                                  max_tokens=24, prefill_step_size=16))
    caches = make_cache(model, POLICY)
    with engine.installed(model):
        got = list(generate_step(prompt, model, prompt_cache=caches, max_tokens=24,
                                 prefill_step_size=16))
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected, strict=True):
        assert mx.array_equal(a, b).item()
    paged_layers = sum(isinstance(c, PagedKVCache) for c in caches)
    assert paged_layers == 2 and len(paged_calls) == paged_layers * (3 + 1 + 24)  # chunks 16+16+4
    ident = EngineModel(model, "tiny-gemma3", policy=POLICY).identity
    assert ident.paged_layers == (1, 3)


def test_gemma3_packed_runs():
    model = tiny_model("gemma3_text", mx.bfloat16)
    caches = make_cache(model, KVPolicy(default_format="k4v4", block_size_tokens=16))
    with engine.installed(model):
        tokens = list(generate_step(prompt_tokens(30), model, prompt_cache=caches, max_tokens=8))
    assert len(tokens) == 8
    assert caches[1].spec.format.name == "k4v4" and caches[1].offset == 30 + 8


def test_pools_are_shared_between_requests():
    model = tiny_model("llama", mx.bfloat16)
    pools = make_pools(model, POLICY, num_blocks=4)
    first, second = make_cache(model, POLICY, pools=pools), make_cache(model, POLICY, pools=pools)
    with engine.installed(model):
        model(prompt_tokens(20)[None], cache=first)
        model(prompt_tokens(20, seed=3)[None], cache=second)
    assert first[0].pool is second[0].pool is pools[0]
    assert first[0].block_ids == (0, 1) and second[0].block_ids == (2, 3)
    assert pools[0].num_free_blocks == 0


def test_configs_that_build_no_model_are_refused():
    with pytest.raises(UnsupportedModel, match="not a mamba config"):
        layer_geometry({**model_config("llama"), "model_type": "mamba"})  # no state_size, ...
    with pytest.raises(UnsupportedModel, match="no model_type"):
        layer_geometry({"hidden_size": 8})
    with pytest.raises(UnsupportedModel, match="not supported"):
        layer_geometry({**model_config("llama"), "model_type": "no_such_model"})


def test_unknown_cache_classes_are_refused_by_name():
    model = build("deepseek_v41")  # its make_cache builds deepseek_v41.LayerCache
    with pytest.raises(UnsupportedModel, match=r"deepseek_v41\.LayerCache"):
        probe_geometry(model)


def test_geometry_is_probed_without_model_args():
    model = build("baichuan_m1")  # carries .config, no .args (the old rules crashed)
    assert not hasattr(model, "args")
    geometry = probe_geometry(model)
    # two CacheLists, flattened into their sub-caches (a sliding and a full layer)
    assert [(g.kind, g.cache_class) for g in geometry.layers] == [
        ("state", "CacheList[0].ArraysCache"), ("sliding", "CacheList[1].RotatingKVCache"),
        ("state", "CacheList[0].ArraysCache"), ("full", "CacheList[1].KVCache")]
    assert geometry.config["model_type"] == "baichuan_m1"
    assert probe_geometry(model) is geometry  # once per model object
    assert len(model_fingerprint(model)) == 64


def test_probe_reads_heads_dims_and_kinds_from_the_forward():
    geometry = probe_geometry(build("phi3"))  # hidden 64 / 4 heads: head dim 16, 2 KV heads
    assert [(g.kind, g.kv_heads, g.k_head_dim, g.v_head_dim) for g in geometry.layers] == [
        ("full", 2, 16, 16)] * 2
    # MLA caches the latent: 1 head, Dk = kv_lora_rank (16), Dv = the rope dim (8)
    mla = probe_geometry(build("deepseek_v3")).layers[0]
    assert (mla.kind, mla.kv_heads, mla.k_head_dim, mla.v_head_dim) == ("full", 1, 16, 8)
    kinds = [(g.kind, g.cache_class) for g in probe_geometry(build("qwen3_next")).layers]
    assert kinds == [("state", "ArraysCache"), ("full", "KVCache")]
    assert probe_geometry(build("gemma3n")).layers.__len__() == 2  # 4 layers share 2 caches


def test_fingerprint_covers_the_probed_geometry():
    base = model_config("llama", num_hidden_layers=2, sliding_window=8)
    full = {**base, "layer_types": ["full_attention", "full_attention"]}
    mixed = {**base, "layer_types": ["sliding_attention", "full_attention"]}
    assert model_fingerprint(full) != model_fingerprint(mixed)
    assert model_fingerprint(tiny_model("llama")) == model_fingerprint(model_config("llama"))


def test_native_pages_follow_the_probed_kv_dtype():
    ident = EngineModel(tiny_model("qwen3", mx.bfloat16), "m", policy=POLICY).identity
    assert {layer.page_format for layer in ident.layers} == {"native-bf16"}
    ident = EngineModel(tiny_model("qwen3", mx.float32), "m", policy=POLICY).identity
    assert {layer.page_format for layer in ident.layers} == {"native-f32"}


def test_models_failing_the_router_check_attend_over_gathered_history(paged_calls):
    model = build("deepseek_v3")  # MLA computes on the fetched latent: the router is unsafe
    check = check_paged_attention(model)
    assert not check.routed and "NotFetched" in check.reason
    caches = make_cache(model, POLICY)
    assert {c.attention_impl for c in caches} == {GATHERED}
    prompt = prompt_tokens(20)
    with engine.installed(model):
        got = list(generate_step(prompt, model, prompt_cache=caches, max_tokens=6))
    want = list(generate_step(prompt, model, prompt_cache=make_prompt_cache(model), max_tokens=6))
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert mx.array_equal(a, b).item()
    assert paged_calls == []  # the check's own calls bypass the spy; serving made none


def test_router_check_needs_the_router_to_be_called():
    plamo2 = check_paged_attention(build("plamo2"))  # calls mx.fast directly
    assert not plamo2.routed and "never calls" in plamo2.reason
    assert check_paged_attention(tiny_model("llama")).routed


def test_engine_model_binds_its_format_once():
    """The model id picks the format once, in EngineModel; pools and caches get a policy
    bound to it (model_id reaches only format_identity, issue 18)."""
    from engine.engine_model import EngineModel

    policy = KVPolicy(block_size_tokens=16, overrides=(("org/packed", "k8v4"),))
    model = tiny_model("llama")
    packed, plain = EngineModel(model, "org/packed", policy=policy), EngineModel(model, "org/x",
                                                                                policy=policy)
    assert packed.model_policy.overrides == () and packed.model_policy.default_format == "k8v4"
    assert {p.spec.format.name for p in packed.pools} == {"k8v4"}
    assert {c.spec.format.name for c in packed.make_cache()} == {"k8v4"}
    assert {layer.page_format for layer in plain.identity.layers} == {"native-f32"}
    assert packed.identity == format_identity(model, policy, model_id="org/packed",
                                              model_dtype=kv_dtype(model))
