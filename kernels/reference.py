"""The numerical control: gather every used block, dequantize, then one
mx.fast.scaled_dot_product_attention over the contiguous history.

Compute dtype:
  native, unrotated   the model dtype, on keys/values exactly as stored. For B = 1 (or
                      equal context lengths), mask None or "causal" and no window the call
                      is mx.fast.scaled_dot_product_attention(queries, keys, values,
                      scale=scale, mask=mask, sinks=sinks) on [B, Hkv, T, D] arrays of the
                      model dtype: bit-identical to mlx-lm's KVCache path.
  packed or rotated   float32: dequantized keys/values (float32 math, quant.dequantize),
                      queries rotated in float32; the output is cast to queries.dtype.

Cost: the whole history is expanded (see attention.workspace_nbytes("reference", ...)).
"""

from __future__ import annotations

import math

import mlx.core as mx

from kernels.call import PagedAttentionCall
from kernels.paging import (
    check_shape,
    clean_block_ids,
    exact_native,
    gather_pages,
    prepare_queries,
    visibility_mask,
)


def reference_attention(call: PagedAttentionCall) -> mx.array:
    """queries [B, Hq, L, Dk] -> [B, Hq, L, Dv] in queries.dtype."""
    shape = check_shape(call)
    queries, planes, block_tables, layout = call.queries, call.planes, call.block_tables, call.layout
    context_lens, scale, mask, window, sinks = (call.context_lens, call.scale, call.mask, call.window,
                                                call.sinks)
    total = shape.max_context
    num_blocks = math.ceil(total / shape.block_size)
    block_ids = clean_block_ids(block_tables, context_lens, shape.block_size, 0, num_blocks)
    exact = exact_native(layout)
    keys, values = gather_pages(planes, layout, block_ids, None if exact else mx.float32)
    if keys.shape[2] != total:
        keys, values = keys[:, :, :total], values[:, :, :total]
    if exact:
        prepared = queries
    else:
        prepared = prepare_queries(queries, layout)
        sinks = None if sinks is None else sinks.astype(mx.float32)

    same_lengths = len(set(context_lens)) == 1
    if same_lengths and window is None and (mask is None or isinstance(mask, str)):
        if mask not in (None, "causal"):
            raise ValueError(f"unknown mask {mask!r} (expected None, 'causal' or an array)")
        sdpa_mask = mask
    else:
        causal = isinstance(mask, str) and mask == "causal"
        if isinstance(mask, str) and not causal:
            raise ValueError(f"unknown mask {mask!r} (expected None, 'causal' or an array)")
        visible = visibility_mask(
            context_lens, shape.num_queries, 0, total, causal=causal, window=window
        )
        sdpa_mask = combine_masks(visible, None if isinstance(mask, str) else mask, prepared.dtype)

    out = mx.fast.scaled_dot_product_attention(
        prepared, keys, values, scale=scale, mask=sdpa_mask, sinks=sinks
    )
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)


def combine_masks(visible: mx.array | None, user_mask: mx.array | None, dtype):
    """The positional visibility (boolean) and a caller's array mask (boolean or additive,
    broadcastable to [B, Hq, L, T]) as one mask SDPA accepts."""
    if user_mask is None:
        return visible
    if visible is None:
        return user_mask if user_mask.dtype == mx.bool_ else user_mask.astype(dtype)
    if user_mask.dtype == mx.bool_:
        return visible & user_mask
    return mx.where(visible, user_mask.astype(dtype), mx.array(-mx.inf, dtype=dtype))
