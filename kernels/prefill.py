"""Prefill attention over paged history: the history dequantized once per chunk.

A prefill chunk of L queries (more than the direct kernels' 8) attends to T = history + L
keys. The partitioned path dequantizes the history partition by partition and merges in
MLX ops, which made prefill into packed pages grow with the square of the context on the
H200 (issue 22). This path instead:

  1. gathers the history's blocks once and dequantizes them into the model dtype
     (packed pages; native pages are gathered as stored): the workspace, priced by
     attention.workspace_nbytes("dequantized", ...) before admission allocates it;
  2. takes the chunk's own K/V in full precision when the caller hands them in (`fresh`,
     as written this step), else from the pages like the history;
  3. runs one mx.fast.scaled_dot_product_attention in the model dtype, causal from the
     end (query l sits at T - L + l), with sinks.

Numerics against the decode path (docs/kernels.md, "Prefill"): both read the same codes
and scales; prefill computes in the model dtype (bf16: 8-bit significand) where the decode
kernels use fp16 operands and fp32 accumulation, and rotated keys are met by queries
rotated in float32 then cast. With `fresh`, the chunk's own tokens are exact rather than
quantized, as mlx-lm's KVCache would see them.
"""

from __future__ import annotations

import math

import mlx.core as mx

from kernels.call import PagedAttentionCall
from kernels.hadamard import rotate
from kernels.paging import check_shape, clean_block_ids, gather_pages


def serves(call_mask, window: int | None, batch: int) -> bool:
    """The calls this path takes: one sequence, mask None or "causal", no window."""
    return batch == 1 and window is None and (call_mask is None or isinstance(call_mask, str))


def dequantized_attention(call: PagedAttentionCall, fresh: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """queries [1, Hq, L, Dk] -> [1, Hq, L, Dv] in queries.dtype.
    fresh: (keys [1, Hkv, L, Dk], values [1, Hkv, L, Dv]) of the chunk itself, unrotated,
    or None (read from the pages)."""
    shape = check_shape(call)
    assert serves(call.mask, call.window, shape.batch), "dequantized_attention: batch 1, no window"
    layout, dtype = call.layout, call.queries.dtype
    total = shape.max_context
    history = total - shape.num_queries if fresh is not None else total
    keys = values = None
    if history > 0:
        num_blocks = math.ceil(history / shape.block_size)
        block_ids = clean_block_ids(call.block_tables, list(call.context_lens), shape.block_size, 0, num_blocks)
        keys, values = gather_pages(call.planes, layout, block_ids, dtype)
        keys, values = keys[:, :, :history], values[:, :, :history]
    if fresh is not None:
        fresh_keys, fresh_values = fresh
        if layout.rotated_keys:
            fresh_keys = rotate(fresh_keys, layout.rotation_seed).astype(dtype)
        keys = fresh_keys if keys is None else mx.concatenate([keys, fresh_keys.astype(dtype)], axis=2)
        values = fresh_values if values is None else mx.concatenate([values, fresh_values.astype(dtype)], axis=2)
    queries = call.queries
    if layout.rotated_keys:
        queries = rotate(queries, layout.rotation_seed).astype(dtype)
    mask = "causal" if call.mask == "causal" and shape.num_queries > 1 else None
    sinks = None if call.sinks is None else call.sinks.astype(dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=call.scale, mask=mask, sinks=sinks)


def workspace_nbytes(n_q_heads: int, n_kv_heads: int, num_queries: int, k_head_dim: int,
                     v_head_dim: int, context_len: int, block_size: int, layout,
                     model_dtype_nbytes: int) -> int:
    """Peak temporaries of one call: the gathered pages (stored bytes), for packed pages
    the unpacked codes and the float32 dequantization, the history in the model dtype
    (twice: gathered, then concatenated with the chunk), rotated queries, and the scores
    [Hq, L, T] float32 the SDPA may materialise."""
    padded = math.ceil(context_len / block_size) * block_size
    dims = k_head_dim + v_head_dim
    if layout.packed:
        code_bytes = (k_head_dim * layout.k_bits + v_head_dim * layout.v_bits) // 8
        stored = code_bytes + dims // layout.group_size * 8
        per_token = stored + dims + dims * 4 + 2 * dims * model_dtype_nbytes
    else:
        per_token = dims * model_dtype_nbytes * 3
    queries = n_q_heads * num_queries * k_head_dim * 4
    scores = n_q_heads * num_queries * padded * 4
    return padded * n_kv_heads * per_token + queries + scores
