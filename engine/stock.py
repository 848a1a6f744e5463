"""mlx-lm's own caches, with the one fact they do not keep: when they were quantized.

mlx-lm's generate_step(kv_bits=B, quantized_kv_start=S) computes the first tokens with
native K/V and then, at the first step where a cache's offset reaches S, replaces it by
cache.to_quantized(...) (mlx_lm.generate.maybe_quantize_kv_cache). The QuantizedKVCache
it gets back holds mlx-qB codes like one quantized from its first token, but its
pages differ: the early tokens' later layers attended over native K/V. A plain
QuantizedKVCache does not say which of the two it is.

  TrackedKVCache            a KVCache whose to_quantized (the hook mlx-lm calls) returns
                            a ConvertedQuantizedKVCache recording the offset it was
                            converted at. Everything else is mlx-lm's KVCache.
  ConvertedQuantizedKVCache a QuantizedKVCache with converted_at_token: its minimum
                            reusable offset. trim() never goes below it: a prefix
                            shorter than the conversion is a state no computation had.

make_stock_cache(model) builds mlx-lm's caches with TrackedKVCache for every KVCache
(to_mlx_lm(caches) gives them back as mlx-lm's own classes, for save_prompt_cache);
restore's stock targets use it. conversion_offset(caches) is what a publication's
format identity must name (FormatIdentity.converted_at_token): 0 for caches never
converted (a QuantizedKVCache built empty, a KVCache, a PagedKVCache). A
QuantizedKVCache that mlx-lm converted from a KVCache the engine did not build carries
no record and reads as 0, which is what it would be had it been built empty: build
caches with make_stock_cache (or restore(cache_kind="kvcache")) before generating with
kv_bits, or name the offset in the identity yourself.
"""

from __future__ import annotations

from typing import Sequence

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from engine.errors import FormatMismatch


class ConvertedQuantizedKVCache(QuantizedKVCache):
    """A QuantizedKVCache converted from native K/V at converted_at_token tokens."""

    def __init__(self, group_size: int = 64, bits: int = 8, converted_at_token: int = 0):
        super().__init__(group_size=group_size, bits=bits)
        self.converted_at_token = int(converted_at_token)

    def trim(self, n: int) -> int:
        """mlx-lm's trim, floored at the conversion offset; returns the tokens trimmed."""
        return super().trim(max(0, min(n, self.offset - self.converted_at_token)))


class TrackedKVCache(KVCache):
    """mlx-lm's KVCache; its conversion to a QuantizedKVCache records the offset."""

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> ConvertedQuantizedKVCache:
        plain = super().to_quantized(group_size=group_size, bits=bits)
        converted = ConvertedQuantizedKVCache(group_size, bits, converted_at_token=self.offset)
        converted.keys, converted.values, converted.offset = plain.keys, plain.values, plain.offset
        return converted


def make_stock_cache(model: nn.Module) -> list:
    """mlx-lm's caches for the model (model.make_cache() when it has one, else one
    KVCache per layer), each plain KVCache replaced by an empty TrackedKVCache."""
    stock = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in model.layers]
    return [TrackedKVCache() if type(c) is KVCache else c for c in stock]


def to_mlx_lm(caches: Sequence) -> list:
    """The same caches as mlx-lm's own classes (the conversion record dropped, the arrays
    shared, not copied): mlx-lm's save_prompt_cache writes class names that its
    load_prompt_cache looks up in mlx_lm.models.cache, where these subclasses are not."""
    out = []
    for cache in caches:
        if isinstance(cache, ConvertedQuantizedKVCache):
            plain = QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)
            plain.keys, plain.values, plain.offset = cache.keys, cache.values, cache.offset
        elif isinstance(cache, TrackedKVCache):
            plain = KVCache()
            plain.keys, plain.values, plain.offset = cache.keys, cache.values, cache.offset
        else:
            plain = cache
        out.append(plain)
    return out


def conversion_offset(caches: Sequence) -> int:
    """The offset the caches' QuantizedKVCaches were converted at (0: never converted,
    or quantized from the first token). FormatMismatch when layers disagree: mlx-lm
    converts every layer at one step, so a disagreement is a cache put together from
    two computations."""
    found = {c.converted_at_token if isinstance(c, ConvertedQuantizedKVCache) else 0
             for c in caches if isinstance(c, QuantizedKVCache)}
    if len(found) > 1:
        raise FormatMismatch(f"the cache's QuantizedKVCaches were converted at different "
                             f"offsets {sorted(found)}")
    return found.pop() if found else 0
