"""Attention over packed pages through mx.quantized_matmul: the CPU's packed path.

The kernels' packed planes are mlx's own affine quantization in all but the container:
4-bit codes with element 2j in the low nibble of byte j, read as little-endian uint32
words, are mlx's 4-bit packing (element e at bits 4e of its word); 8-bit codes likewise;
x = code * scale + offset per group is mlx's w = q * scale + bias. So with the codes
viewed as uint32, `mx.quantized_matmul` scores queries against packed keys and weights
packed values without any dequantized copy:

  scores  = quantized_matmul(q, k_codes, k_scales, k_offsets, transpose=True)   # [B, Hkv, R, P]
  partial = quantized_matmul(p, v_codes, v_scales, v_offsets, transpose=False)  # [B, Hkv, R, Dv]

over partitions of partition_tokens with the same log-sum-exp merge, masks, windows and
sinks as kernels/partitioned.py (R = rep * L grouped query rows, float32 throughout:
queries rotated and scaled in float32, as there). Measured on this 2-core CPU, one decode
call at 1024 tokens, 8 KV heads, D 128: 3.8 ms for k4v4 against 7.3 ms partitioned (and
4.8 ms for bf16 SDPA over a KVCache). Served: packed layouts whose group size mlx
quantizes in (32, 64, 128); select_impl sends the rest to "partitioned". Workspace: one
partition's gathered pages plus scores, under the partitioned path's price.

Prefill chunks (more than 8 queries; kernels/attention.py passes fresh and
dequantize_partitions): the history's partitions are dequantized into float32 and met by
plain float32 matmuls, and the chunk's own K/V (as the model computed them, unquantized)
are the last partition of the merge, causal within the chunk. Decode keeps the codes.
"""

from __future__ import annotations

import math

import mlx.core as mx

from kernels.call import PagedAttentionCall
from kernels.layout import PageLayout
from kernels.paging import (
    OnlineSoftmax,
    check_shape,
    clean_block_ids,
    first_visible_key,
    gather_pages,
    prepare_queries,
    visibility_mask,
)

GROUP_SIZES = (32, 64, 128)  # what mx.quantized_matmul takes


def serves(layout: PageLayout) -> bool:
    return layout.packed and layout.group_size in GROUP_SIZES


def _tokens(plane: mx.array, block_ids: mx.array) -> mx.array:
    """[N, H, bs, W] gathered by block_ids [B, n] -> [B, H, n*bs, W] (contiguous)."""
    x = plane[block_ids]
    batch, count, heads, block, width = x.shape
    return x.transpose(0, 2, 1, 3, 4).reshape(batch, heads, count * block, width)


def quantized_attention(call: PagedAttentionCall, partition_tokens: int = 1024,
                        fresh: tuple[mx.array, mx.array] | None = None,
                        dequantize_partitions: bool = False) -> mx.array:
    """queries [B, Hq, L, Dk] -> [B, Hq, L, Dv] in queries.dtype (float32 math).

    fresh: (keys [1, Hkv, L, Dk], values [1, Hkv, L, Dv]) of the L new tokens themselves,
    unrotated, as written (a prefill chunk; batch 1, no window): the partitions then cover
    only the history before them, and the chunk attends to its own tokens in full
    precision (float32 matmuls, causal within the chunk) as the last partition of the
    same merge, as kernels/prefill.py's "dequantized" does with SDPA.

    dequantize_partitions: each partition's pages are dequantized into float32 K/V
    (kernels/paging.py:gather_pages) and scored and weighted by plain float32 matmuls
    instead of mx.quantized_matmul. For a prefill chunk's hundreds of query rows that is
    the faster way on this CPU (the dequantization is O(P * D) against O(rows * P * D) of
    matmul, and MLX's CPU float32 matmul ran ~2x its quantized_matmul at 1024 rows: 0.80
    against 1.45 s for one k4v4 layer's scores at L 512, T 1024, load 5.5); the same
    codes, scales and offsets, float32 throughout (tests/kernels/test_prefill.py)."""
    if call.array_mask:
        raise ValueError("quantized attention takes mask None or 'causal' (array masks: reference)")
    layout = call.layout
    if not serves(layout):
        raise ValueError(f"quantized attention serves packed layouts with groups of {GROUP_SIZES}, not {layout}")
    shape = check_shape(call)
    planes, context_lens, window = call.planes, call.context_lens, call.window
    block_size, group = shape.block_size, layout.group_size
    partition_tokens = max(1, math.ceil(partition_tokens / block_size)) * block_size
    causal = call.mask == "causal" or window is not None
    batch, rows = shape.batch, shape.rep * shape.num_queries

    # queries: [B, Hkv, rep*L, Dk] float32, rotated, scale folded in
    grouped = (prepare_queries(call.queries, layout) * call.scale).reshape(
        batch, shape.n_kv_heads, rows, shape.k_head_dim)
    merge = OnlineSoftmax(shape, call.sinks)

    if fresh is not None and (batch != 1 or window is not None):
        raise ValueError("quantized attention takes fresh K/V for one sequence without a window")
    history = shape.max_context - shape.num_queries if fresh is not None else shape.max_context
    first_key = first_visible_key(context_lens, shape.num_queries, window)
    start = first_key // partition_tokens * partition_tokens
    for token0 in range(start, history, partition_tokens):
        count = min(partition_tokens, history - token0)
        first_block = token0 // block_size
        block_ids = clean_block_ids(call.block_tables, context_lens, block_size, first_block,
                                    first_block + math.ceil(count / block_size))
        width = block_ids.shape[1] * block_size
        if dequantize_partitions:
            keys, values = gather_pages(planes, layout, block_ids)  # [B, Hkv, width, D] float32
            scores = grouped @ keys.swapaxes(-1, -2)  # [B, Hkv, rows, width]
        else:
            k_codes = _tokens(planes["k_codes"], block_ids).view(mx.uint32)
            scores = mx.quantized_matmul(grouped, k_codes, _tokens(planes["k_scales"], block_ids),
                                         _tokens(planes["k_offsets"], block_ids), transpose=True,
                                         group_size=group, bits=layout.k_bits)  # [B, Hkv, rows, width]
        if fresh is None:
            visible = visibility_mask(context_lens, shape.num_queries, token0, width, causal=causal,
                                      window=window)
        else:  # every history key is visible to every new query; the chunk's own are not here
            visible = None if token0 + width <= history else (
                mx.arange(token0, token0 + width, dtype=mx.int32) < history)[None, None, None]
        weights = merge.weights(scores, visible)
        if dequantize_partitions:
            merge.add(weights @ values)
            continue
        v_codes = _tokens(planes["v_codes"], block_ids).view(mx.uint32)
        merge.add(mx.quantized_matmul(weights, v_codes, _tokens(planes["v_scales"], block_ids),
                                      _tokens(planes["v_offsets"], block_ids), transpose=False,
                                      group_size=group, bits=layout.v_bits))
    if fresh is not None:
        keys, values = fresh  # [1, Hkv, L, D] model dtype, unrotated
        keys = prepare_queries(keys, layout)  # float32, in the stored keys' basis
        scores = grouped @ keys.swapaxes(-1, -2)  # [1, Hkv, rows, L]
        visible = None
        if causal and shape.num_queries > 1:  # query l sees the chunk's keys 0..l
            steps = mx.arange(shape.num_queries, dtype=mx.int32)
            visible = (steps[None, :] <= steps[:, None])[None, None]
        merge.add(merge.weights(scores, visible) @ values.astype(mx.float32))
    return merge.result(call.queries.dtype)


def workspace_nbytes(n_q_heads: int, n_kv_heads: int, num_queries: int, k_head_dim: int,
                     v_head_dim: int, context_len: int, block_size: int, layout: PageLayout,
                     partition_tokens: int, *, gpu: bool = False, prefill: bool = False) -> int:
    """Peak temporaries of one sequence's call (an upper estimate, for admission).

    A partition's temporaries: its gathered pages twice (the gather, then the contiguous
    copy), four score-sized float32 arrays (scores, masked, shifted, weights), the
    visibility mask, the partial and running triple. Measured on the CPU
    (tests/kernels/test_quantized_attention.py), the lazy graph keeps about two
    partitions' whole temporaries alive and, of every other partition, a few score-sized
    arrays (peak 1.3 MB at 2K and 2.5 MB at 16K for one k4v4 decode query row block), so
    the price is two partitions in full plus three score-sized arrays per further
    partition; on a GPU every partition in full (as kernels/attention.py prices
    "partitioned" there).

    prefill (a chunk of more than 8 queries, which attends with dequantize_partitions and
    its own K/V): each partition in full also holds its unpacked codes and float32 K/V,
    and the chunk's own part adds its float32 K/V (keys twice where rotated), four
    score-sized float32 arrays [Hq, L, L] and the causal mask."""
    window = min(context_len, max(1, math.ceil(partition_tokens / block_size)) * block_size)
    padded = math.ceil(window / block_size) * block_size
    partitions = math.ceil(context_len / window)
    code_bytes = (k_head_dim * layout.k_bits + v_head_dim * layout.v_bits) // 8
    stored = code_bytes + (k_head_dim + v_head_dim) // layout.group_size * 8
    rows = n_q_heads * num_queries
    scores = rows * padded * 4
    whole = (2 * padded * n_kv_heads * stored + 4 * scores + num_queries * padded
             + 2 * rows * (v_head_dim + 2) * 4)
    chunk = 0
    if prefill:
        whole += padded * n_kv_heads * (k_head_dim + v_head_dim) * (1 + 4)
        chunk = (num_queries * n_kv_heads * (2 * k_head_dim + v_head_dim) * 4
                 + 4 * rows * num_queries * 4 + num_queries * num_queries)
    if gpu:
        alive = partitions * whole
    else:
        alive = min(partitions, 2) * whole + max(0, partitions - 2) * 3 * scores
    return rows * k_head_dim * 4 * 2 + alive + chunk
