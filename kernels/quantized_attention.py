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

Prefill chunks (DEQUANTIZE_QUERIES or more queries): each partition is dequantized into
float32 (paging.gather_pages) and met by plain float32 matmuls instead. On this CPU that
is bit for bit what quantized_matmul computes from the same codes (MLX's CPU kernel
dequantizes and multiplies the same way; test_prefill_partitions_equal_quantized_matmul,
tolerance 0), so a chunk's result does not depend on which of the two ran, and prefill
stays chunk-invariant; for hundreds of query rows the float32 matmuls are the faster way
(one 16-head layer, a 512-token chunk at 1024 tokens, load 4.9, within rounds against
KVCache's bf16 SDPA: k4v4 1.20x against 1.46x for quantized_matmul, k8v4 1.22x against
1.23x). Decode steps keep quantized_matmul (no dequantized copy). The scores' matmul takes
the keys copied into [B, Hkv, D, width] first: on this CPU a float32 matmul against a
transposed view took 1583 ms where the same product against its contiguous copy took 805
ms, bit for bit the same (16 query / 8 KV heads of 128, a 512-token chunk over 1024
tokens, medians of 3).
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
# From this many queries (a prefill chunk) each partition is dequantized into float32 and met
# by plain float32 matmuls (module docstring)
DEQUANTIZE_QUERIES = 16


def serves(layout: PageLayout) -> bool:
    return layout.packed and layout.group_size in GROUP_SIZES


def _tokens(plane: mx.array, block_ids: mx.array) -> mx.array:
    """[N, H, bs, W] gathered by block_ids [B, n] -> [B, H, n*bs, W] (contiguous)."""
    x = plane[block_ids]
    batch, count, heads, block, width = x.shape
    return x.transpose(0, 2, 1, 3, 4).reshape(batch, heads, count * block, width)


def quantized_attention(call: PagedAttentionCall, partition_tokens: int = 1024) -> mx.array:
    """queries [B, Hq, L, Dk] -> [B, Hq, L, Dv] in queries.dtype (float32 math)."""
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
    dequantize = shape.num_queries >= DEQUANTIZE_QUERIES

    first_key = first_visible_key(context_lens, shape.num_queries, window)
    start = first_key // partition_tokens * partition_tokens
    for token0 in range(start, shape.max_context, partition_tokens):
        count = min(partition_tokens, shape.max_context - token0)
        first_block = token0 // block_size
        block_ids = clean_block_ids(call.block_tables, context_lens, block_size, first_block,
                                    first_block + math.ceil(count / block_size))
        width = block_ids.shape[1] * block_size
        visible = visibility_mask(context_lens, shape.num_queries, token0, width, causal=causal,
                                  window=window)
        if dequantize:  # [B, Hkv, width, D] float32 each, the codes' exact values
            keys, values = gather_pages(planes, layout, block_ids)
            # the keys laid out transposed first: the same bits, half the time (module docstring)
            merge.add(merge.weights(grouped @ mx.contiguous(keys.swapaxes(-1, -2)), visible) @ values)
            continue
        k_codes = _tokens(planes["k_codes"], block_ids).view(mx.uint32)
        scores = mx.quantized_matmul(grouped, k_codes, _tokens(planes["k_scales"], block_ids),
                                     _tokens(planes["k_offsets"], block_ids), transpose=True,
                                     group_size=group, bits=layout.k_bits)  # [B, Hkv, rows, width]
        weights = merge.weights(scores, visible)
        v_codes = _tokens(planes["v_codes"], block_ids).view(mx.uint32)
        merge.add(mx.quantized_matmul(weights, v_codes, _tokens(planes["v_scales"], block_ids),
                                      _tokens(planes["v_offsets"], block_ids), transpose=False,
                                      group_size=group, bits=layout.v_bits))
    return merge.result(call.queries.dtype)


def workspace_nbytes(n_q_heads: int, n_kv_heads: int, num_queries: int, k_head_dim: int,
                     v_head_dim: int, context_len: int, block_size: int, layout: PageLayout,
                     partition_tokens: int, *, gpu: bool = False) -> int:
    """Peak temporaries of one sequence's call (an upper estimate, for admission).

    A partition's temporaries: its gathered pages twice (the gather, then the contiguous
    copy), four score-sized float32 arrays (scores, masked, shifted, weights), the
    visibility mask, the partial and running triple. Measured on the CPU
    (tests/kernels/test_quantized_attention.py), the lazy graph keeps about two
    partitions' whole temporaries alive and, of every other partition, a few score-sized
    arrays (peak 1.3 MB at 2K and 2.5 MB at 16K for one k4v4 decode query row block), so
    the price is two partitions in full plus three score-sized arrays per further
    partition; on a GPU every partition in full (as kernels/attention.py prices
    "partitioned" there). From DEQUANTIZE_QUERIES queries a partition also holds its
    unpacked codes and its float32 keys and values (gather_pages: grouped, then laid out)."""
    window = min(context_len, max(1, math.ceil(partition_tokens / block_size)) * block_size)
    padded = math.ceil(window / block_size) * block_size
    partitions = math.ceil(context_len / window)
    code_bytes = (k_head_dim * layout.k_bits + v_head_dim * layout.v_bits) // 8
    stored = code_bytes + (k_head_dim + v_head_dim) // layout.group_size * 8
    rows = n_q_heads * num_queries
    scores = rows * padded * 4
    whole = (2 * padded * n_kv_heads * stored + 4 * scores + num_queries * padded
             + 2 * rows * (v_head_dim + 2) * 4)
    if num_queries >= DEQUANTIZE_QUERIES:  # the partition's unpacked codes and float32 K/V, twice
        whole += padded * n_kv_heads * (k_head_dim + v_head_dim) * (1 + 2 * 4)
    if gpu:
        alive = partitions * whole
    else:
        alive = min(partitions, 2) * whole + max(0, partitions - 2) * 3 * scores
    return rows * k_head_dim * 4 * 2 + alive
