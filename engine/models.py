"""engine.make_cache: the right cache for every layer of an mlx-lm model.

It mirrors what mlx-lm builds (make_prompt_cache(model): model.make_cache() when the
model has one, else one KVCache per layer) and swaps each full-attention KVCache (the
probe of engine/geometry.py says which) for a PagedKVCache in that layer's BlockPool,
inside a CacheList too (its sub-caches are layers of their own). Sliding-window, chunked
and recurrent layers keep mlx-lm's caches.

Paged attention is turned on per model only after a load-time check
(check_paged_attention: a short forward through paged caches with the router, compared
with mlx-lm's caches, exactly). A model that fails it gets paged caches with
attention_impl "gathered": pages are stored the same way, and update_and_fetch hands the
model its decoded history, which is exact.

One BlockPool per paged layer, shared by every sequence of that layer: pass the list
from make_pools() to make_cache() to serve several requests from one set of arenas.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from engine.attention import GATHERED, checking, installed, model_modules
from engine.cache import PagedKVCache
from engine.errors import UnsupportedModel
from engine.formats import (
    native_format_name,
    page_spec_for,
    require_paged,
    resolve_format,
)
from engine.geometry import layer_geometry, leaf_caches, probe_geometry, with_leaves
from engine.policy import KVPolicy
from engine.pool import BlockPool

DEFAULT_NUM_BLOCKS = 16
# The load-time check: a prefill of CHECK_PROMPT_TOKENS in blocks of CHECK_BLOCK_TOKENS
# (so it crosses blocks), then CHECK_DECODE_STEPS one-token steps.
CHECK_PROMPT_TOKENS = 7
CHECK_BLOCK_TOKENS = 4
CHECK_DECODE_STEPS = 2


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The model's most common floating parameter dtype (quantized weights are uint32
    and do not count; their scales carry the compute dtype)."""
    counts = Counter(v.dtype for _, v in tree_flatten(model.parameters())
                     if v.dtype in (mx.bfloat16, mx.float16, mx.float32))
    if not counts:
        raise UnsupportedModel("the model has no floating-point parameters")
    return counts.most_common(1)[0][0]


def kv_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model's K/V arrive in (probed, engine/geometry.py): what "native"
    resolves to. It never depends on weight bits."""
    return probe_geometry(model).kv_dtype


def make_pools(model: nn.Module, policy: KVPolicy | None = None, *,
               num_blocks: int = DEFAULT_NUM_BLOCKS, max_blocks: int | None = None,
               growth: float = 2.0) -> list[BlockPool | None]:
    """One BlockPool per full-attention layer (None for the other layers), in the policy's
    default format: bind a per-model override first (EngineModel does, or
    policy.with_format(policy.format_for(model id))).

    UnpagedFormat when the policy gives mlx-qB pages, which only mlx-lm's
    QuantizedKVCache holds."""
    policy = policy or KVPolicy()
    fmt = resolve_format(policy.default_format, kv_dtype(model))
    require_paged(fmt)
    pools: list[BlockPool | None] = []
    for geometry in layer_geometry(model):
        if geometry.kind != "full":
            pools.append(None)
            continue
        spec = page_spec_for(geometry, fmt, policy)
        pools.append(BlockPool(spec, num_blocks, max_blocks=max_blocks, growth=growth))
    return pools


def default_attention_impl(pool: BlockPool) -> str | None:
    """The kernels' dispatch (None: the direct kernel on a GPU), except for native pages on
    the CPU: "reference" there, the numerical control, bit-exact with mlx-lm's KVCache. On a
    GPU the reference would gather the whole history every step (issue 22: 0.24x KVCache)."""
    if pool.spec.format.packed or mx.default_device() == mx.gpu:
        return None
    return "reference"


@dataclass(frozen=True)
class PagedAttentionCheck:
    """Whether the router may attend for this model's paged layers, and why not."""

    routed: bool
    reason: str = ""


_CHECKS: dict[int, tuple[weakref.ref, PagedAttentionCheck]] = {}


def check_paged_attention(model: nn.Module) -> PagedAttentionCheck:
    """The load-time check of the module docstring, once per model object.

    Native pages through the "reference" arm are bit-exact with mlx-lm's KVCache
    wherever the model hands its fetched K/V to scaled_dot_product_attention and nothing
    else; any exception or any differing logit means it does something else with them."""
    hit = _CHECKS.get(id(model))
    if hit is not None and hit[0]() is model:
        return hit[1]
    result = _check(model)
    key = id(model)
    _CHECKS[key] = (weakref.ref(model, lambda _: _CHECKS.pop(key, None)), result)
    return result


def _check(model: nn.Module) -> PagedAttentionCheck:
    geometry = probe_geometry(model)
    if not any(layer.kind == "full" for layer in geometry.layers):
        return PagedAttentionCheck(False, "no full-attention layer")
    fmt = resolve_format(native_format_name(geometry.kv_dtype), geometry.kv_dtype)
    policy = KVPolicy(block_size_tokens=CHECK_BLOCK_TOKENS)
    routed_by = tuple(model_modules(model))
    blocks = -(-(CHECK_PROMPT_TOKENS + CHECK_DECODE_STEPS) // CHECK_BLOCK_TOKENS)
    stock, paged_top = make_prompt_cache(model), make_prompt_cache(model)
    paged = leaf_caches(paged_top)  # one per geometry layer (CacheLists flattened)
    for index, layer in enumerate(geometry.layers):
        if layer.kind == "full":
            pool = BlockPool(page_spec_for(layer, fmt, policy), blocks)
            paged[index] = PagedKVCache(pool, attention_impl="reference")
            paged[index].routed_by = routed_by
    paged = with_leaves(paged_top, paged)
    tokens = [(7 * i + 3) % geometry.vocab_size for i in range(CHECK_PROMPT_TOKENS)]
    steps = [tokens] + [[(11 * i + 5) % geometry.vocab_size] for i in range(CHECK_DECODE_STEPS)]
    try:
        with installed(model), checking() as router_calls:
            for step in steps:
                inputs = mx.array([step], dtype=mx.int32)
                want, got = model(inputs, cache=stock), model(inputs, cache=paged)
                mx.eval(want, got)
                if not mx.array_equal(want, got).item():
                    return PagedAttentionCheck(False, "paged attention through the router "
                                                      "differs from mlx-lm's caches")
            if router_calls() == 0:  # its attention does not go through the global
                return PagedAttentionCheck(False, "the model never calls "
                                                  "scaled_dot_product_attention with its cache")
    except Exception as exc:  # whatever the model did with NOT_FETCHED
        return PagedAttentionCheck(False, f"the router fails: {type(exc).__name__}: {exc}"[:200])
    return PagedAttentionCheck(True)


_ROUTED_BY: dict[int, tuple[weakref.ref, tuple[str, ...]]] = {}


def _routed_by(model: nn.Module) -> tuple[str, ...]:
    """model_modules(model), once per model object: the walk over its modules cost
    about 3.5 ms a call on the 2-core CPU (32 layers), and make_cache runs on every
    restore."""
    hit = _ROUTED_BY.get(id(model))
    if hit is not None and hit[0]() is model:
        return hit[1]
    names, key = tuple(model_modules(model)), id(model)
    _ROUTED_BY[key] = (weakref.ref(model, lambda _: _ROUTED_BY.pop(key, None)), names)
    return names


def make_cache(model: nn.Module, policy: KVPolicy | None = None, *,
               pools: list[BlockPool | None] | None = None,
               attention_impl: str | None = "auto", grant=None) -> list:
    """The model's cache list with paged full-attention layers (see the module docstring),
    in the policy's default format (pools from make_pools(model, policy) when not given).

    attention_impl: "auto" (default_attention_impl), None (kernels dispatch), a name,
    or "gathered"; a model that fails check_paged_attention gets "gathered" whatever
    is asked (its caches' attention_impl says so).
    grant: an engine.admission Grant priced over `pools`; its caches check every
    allocation against it and close() frees them (see engine/admission.py).
    """
    policy = policy or KVPolicy()
    geometry = layer_geometry(model)
    top = make_prompt_cache(model)
    stock = leaf_caches(top)  # CacheLists flattened: one per geometry layer
    if len(stock) != len(geometry):  # the probe saw the same make_cache
        raise UnsupportedModel(f"the model built {len(stock)} caches, its probe "
                               f"{len(geometry)}")
    if pools is None:
        pools = make_pools(model, policy)
    routed = attention_impl != GATHERED and check_paged_attention(model).routed
    routed_by = _routed_by(model) if routed else ()
    caches = []
    for index, (layer, cache, pool) in enumerate(zip(geometry, stock, pools, strict=True)):
        if layer.kind != "full":
            caches.append(cache)
            continue
        assert pool is not None, f"layer {index} is full attention but has no pool"
        impl = (GATHERED if not routed else
                default_attention_impl(pool) if attention_impl == "auto" else attention_impl)
        cache = (PagedKVCache(pool, attention_impl=impl) if grant is None
                 else grant.new_cache(pool, attention_impl=impl))
        cache.routed_by = routed_by
        caches.append(cache)
    if grant is not None:
        grant.bind(caches)
    return with_leaves(top, caches)
