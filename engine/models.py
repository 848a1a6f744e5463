"""engine.make_cache: the right cache for every layer of an mlx-lm model.

It mirrors what mlx-lm builds (model.make_cache() when the model has one, else one
KVCache per layer) and swaps each full-attention KVCache for a PagedKVCache in that
layer's BlockPool. Sliding-window layers keep mlx-lm's RotatingKVCache, recurrent state
keeps its own cache, and anything else mlx-lm chose is left alone. The layer kinds the
config rules give (engine/geometry.py) must agree with the caches mlx-lm builds; a
disagreement is a bug in the rules and fails loudly.

One BlockPool per paged layer, shared by every sequence of that layer: pass the list
from make_pools() to make_cache() to serve several requests from one set of arenas.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache

from engine.attention import model_modules
from engine.cache import PagedKVCache
from engine.errors import UnsupportedModel
from engine.formats import format_identity, page_spec_for, require_paged, resolve_format
from engine.geometry import layer_geometry
from engine.policy import KVPolicy
from engine.pool import BlockPool
from kvstore.format import FormatIdentity

DEFAULT_NUM_BLOCKS = 16


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype the model computes K/V in: its most common floating parameter dtype.

    Quantized weights are uint32 and do not count; their scales carry the compute
    dtype. This is what "native" resolves to; it never depends on weight bits.
    """
    counts = Counter(v.dtype for _, v in tree_flatten(model.parameters())
                     if v.dtype in (mx.bfloat16, mx.float16, mx.float32))
    if not counts:
        raise UnsupportedModel("the model has no floating-point parameters")
    return counts.most_common(1)[0][0]


def model_identity(model: nn.Module, policy: KVPolicy, *, model_id: str,
                   tokenizer_fingerprint: str = "", converted_at_token: int = 0) -> FormatIdentity:
    """kvstore's format identity of this model's pages under the policy; for mlx-qB
    pages of a converted cache, converted_at_token names the conversion offset
    (engine.stock.conversion_offset(caches))."""
    return format_identity(model.args, policy, model_id=model_id,
                           model_dtype=model_dtype(model),
                           tokenizer_fingerprint=tokenizer_fingerprint,
                           converted_at_token=converted_at_token)


def _stock_caches(model: nn.Module) -> list:
    if hasattr(model, "make_cache"):
        return model.make_cache()
    return [KVCache() for _ in model.layers]


def make_pools(model: nn.Module, policy: KVPolicy | None = None, *, model_id: str | None = None,
               num_blocks: int = DEFAULT_NUM_BLOCKS, max_blocks: int | None = None,
               growth: float = 2.0) -> list[BlockPool | None]:
    """One BlockPool per full-attention layer (None for the other layers).

    UnpagedFormat when the policy gives mlx-qB pages, which only mlx-lm's
    QuantizedKVCache holds."""
    policy = policy or KVPolicy()
    fmt = resolve_format(policy.format_for(model_id), model_dtype(model))
    require_paged(fmt)
    pools: list[BlockPool | None] = []
    for geometry in layer_geometry(model.args):
        if geometry.kind != "full":
            pools.append(None)
            continue
        spec = page_spec_for(geometry, fmt, policy)
        pools.append(BlockPool(spec, num_blocks, max_blocks=max_blocks, growth=growth))
    return pools


def default_attention_impl(pool: BlockPool) -> str | None:
    """"reference" for native pages (bit-exact with mlx-lm), the kernels' dispatch else."""
    return None if pool.spec.format.packed else "reference"


def make_cache(model: nn.Module, policy: KVPolicy | None = None, *, model_id: str | None = None,
               pools: list[BlockPool | None] | None = None,
               attention_impl: str | None = "auto", grant=None) -> list:
    """The model's cache list with paged full-attention layers (see the module docstring).

    attention_impl: "auto" (default_attention_impl), None (kernels dispatch) or a name.
    grant: an engine.admission Grant priced over `pools`; its caches check every
    allocation against it and close() frees them (see engine/admission.py).
    """
    policy = policy or KVPolicy()
    geometry = layer_geometry(model.args)
    stock = _stock_caches(model)
    if len(stock) != len(geometry):
        raise UnsupportedModel(f"config describes {len(geometry)} layers, model builds "
                               f"{len(stock)} caches")
    if pools is None:
        pools = make_pools(model, policy, model_id=model_id)
    routed_by = tuple(model_modules(model))
    caches = []
    for index, (layer, cache, pool) in enumerate(zip(geometry, stock, pools, strict=True)):
        if type(cache) is KVCache:
            assert layer.kind == "full" and pool is not None, (
                f"layer {index}: mlx-lm builds a KVCache but the rules say {layer.kind}")
            impl = default_attention_impl(pool) if attention_impl == "auto" else attention_impl
            cache = (PagedKVCache(pool, attention_impl=impl) if grant is None
                     else grant.new_cache(pool, attention_impl=impl))
            cache.routed_by = routed_by
            caches.append(cache)
        else:
            assert layer.kind != "full" or not isinstance(cache, RotatingKVCache), (
                f"layer {index}: the rules say full attention, mlx-lm builds {type(cache).__name__}")
            caches.append(cache)
    if grant is not None:
        grant.bind(caches)
    return caches
