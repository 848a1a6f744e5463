"""engine.make_cache per model class: paged full layers, mlx-lm's RotatingKVCache for
sliding layers, and generation that matches mlx-lm's own caches."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

import engine
from engine import KVPolicy, PagedKVCache, make_cache, make_pools, model_identity
from engine.errors import UnsupportedModel
from engine.geometry import layer_geometry
from tests.engine.factories import model_config, prompt_tokens, tiny_model

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
    layers = zip(caches, stock, layer_geometry(model.args), model.layers, strict=True)
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
    ident = model_identity(model, POLICY, model_id="tiny-gemma3")
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


def test_unknown_model_types_are_refused():
    with pytest.raises(UnsupportedModel):
        layer_geometry({**model_config("llama"), "model_type": "mamba"})
    with pytest.raises(UnsupportedModel):
        layer_geometry({"hidden_size": 8})
