"""Prefill attention over paged history: the pages dequantized once per chunk.

A prefill chunk of L queries (more than the direct kernels' 8) attends to T = history + L
keys. The partitioned path dequantizes the history partition by partition and merges in
MLX ops, which made prefill into packed pages grow with the square of the context on the
H200 (issue 22). This path instead:

  1. gathers the blocks of all T tokens once and dequantizes them into the model dtype
     (packed pages; native pages are gathered as stored): the workspace, priced by
     attention.workspace_nbytes("dequantized", ...) before admission allocates it;
  2. runs one mx.fast.scaled_dot_product_attention in the model dtype, causal from the
     end (query l sits at T - L + l), with sinks.

The chunk's own tokens are read back from the pages like the history: for packed pages
they are the quantized values every later reader (decode, a restore, another chunking of
the same prompt) sees, so what a chunk attends to does not depend on where the chunk
boundaries fall, and a restored prefix plus its suffix computes what the same format
computes from scratch. `fresh`, the chunk's K/V as the model handed them in, is used in
their place only where that is bit-identical to reading them back: native unrotated
pages of the same dtype (it saves gathering the chunk's own blocks). Packed pages ignore
it: their chunk attends in full precision nowhere.

Numerics against the decode path (docs/kernels.md, "Prefill"): both read the same codes
and scales for every token; prefill computes in the model dtype (bf16: 8-bit
significand) where the decode kernels use fp16 operands and fp32 accumulation, and
rotated keys are met by queries rotated in float32 then cast.
"""
from __future__ import annotations

import math

import mlx.core as mx

from kernels.call import PagedAttentionCall
from kernels.hadamard import rotate
from kernels.paging import check_shape, clean_block_ids, exact_native, gather_pages


def serves(call_mask, window: int | None, batch: int) -> bool:
    """The calls this path takes: one sequence, mask None or "causal", no window."""
    return batch == 1 and window is None and (call_mask is None or isinstance(call_mask, str))


def dequantized_attention(call: PagedAttentionCall, fresh: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """queries [1, Hq, L, Dk] -> [1, Hq, L, Dv] in queries.dtype.
    fresh: (keys [1, Hkv, L, Dk], values [1, Hkv, L, Dv]) of the chunk itself as written,
    or None. Taken in place of the chunk's pages only where they are those pages' values
    bit for bit (fresh_is_exact); otherwise, and always for packed pages, ignored."""
    shape = check_shape(call)
    assert serves(call.mask, call.window, shape.batch), "dequantized_attention: batch 1, no window"
    layout, dtype = call.layout, call.queries.dtype
    if fresh is not None and not fresh_is_exact(call, fresh):
        fresh = None
    total = shape.max_context
    history = total - shape.num_queries if fresh is not None else total
    keys = values = None
    if history > 0:
        num_blocks = math.ceil(history / shape.block_size)
        block_ids = clean_block_ids(call.block_tables, list(call.context_lens), shape.block_size, 0, num_blocks)
        if layout.packed:
            keys, values = dequantized_pages(call.planes, layout, block_ids, dtype)
        else:
            keys, values = gather_pages(call.planes, layout, block_ids, dtype)
        if keys.shape[2] != history:
            keys, values = keys[:, :, :history], values[:, :, :history]
    if fresh is not None:  # native pages: the stored values themselves
        fresh_keys, fresh_values = (x.astype(dtype) for x in fresh)
        keys = fresh_keys if keys is None else mx.concatenate([keys, fresh_keys], axis=2)
        values = fresh_values if values is None else mx.concatenate([values, fresh_values], axis=2)
    queries = call.queries
    if layout.rotated_keys:
        queries = rotate(queries, layout.rotation_seed).astype(dtype)
    mask = "causal" if call.mask == "causal" and shape.num_queries > 1 else None
    sinks = None if call.sinks is None else call.sinks.astype(dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=call.scale, mask=mask, sinks=sinks)


def dequantized_pages(planes: dict[str, mx.array], layout, block_ids: mx.array,
                      dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Packed pages of block_ids [1, n] -> keys [1, Hkv, n*bs, Dk], values [1, Hkv, n*bs, Dv]
    in dtype: the values of paging.gather_pages (code * scale + offset in float32, one
    cast), in one fused elementwise pass per half that reads the gathered codes in block
    order and writes token order (gather_pages: about ten passes of float32 temporaries).
    Each token's values depend on its own codes only, never on the call's shape."""
    halves = []
    for half, bits in (("k", layout.k_bits), ("v", layout.v_bits)):
        codes = planes[f"{half}_codes"][block_ids]  # [1, n, H, bs, W] uint8
        scales = planes[f"{half}_scales"][block_ids]  # [1, n, H, bs, Gc] float32
        offsets = planes[f"{half}_offsets"][block_ids]
        batch, count, heads, block, width = codes.shape
        groups = scales.shape[-1]
        per_byte = 8 // bits
        # [1, n, H, bs, Gc, bytes per group, 1] -> [1, H, n, bs, Gc, bytes per group, 1]
        # (views), and out [1, H, n, bs, Gc, bytes per group, codes per byte] contiguous
        codes = codes.reshape(batch, count, heads, block, groups, width // groups, 1)
        order = (0, 2, 1, 3, 4, 5, 6)
        scales = scales.reshape(batch, count, heads, block, groups, 1, 1).transpose(order)
        offsets = offsets.reshape(batch, count, heads, block, groups, 1, 1).transpose(order)
        out = _affine(bits, dtype)(codes.transpose(order), scales, offsets)
        halves.append(out.reshape(batch, heads, count * block, width * per_byte))
    return halves[0], halves[1]


_AFFINE: dict = {}


def _affine(bits: int, dtype: mx.Dtype):
    """A compiled code -> value map for (bits, dtype): 4-bit codes split into their low
    nibble (element 2j) and high nibble (2j + 1) by broadcasting against shifts (0, 4)."""
    key = (bits, dtype)
    if key not in _AFFINE:
        if bits == 8:
            def affine(codes, scales, offsets):
                return (codes.astype(mx.float32) * scales + offsets).astype(dtype)
        else:
            shifts = mx.array([0, 4], dtype=mx.uint8)

            def affine(codes, scales, offsets):
                nibbles = (codes >> shifts) & 0x0F
                return (nibbles.astype(mx.float32) * scales + offsets).astype(dtype)
        _AFFINE[key] = mx.compile(affine, shapeless=True)
    return _AFFINE[key]


def fresh_is_exact(call: PagedAttentionCall, fresh: tuple[mx.array, mx.array]) -> bool:
    """True when the chunk's K/V as handed in are bit for bit what its pages hold: native
    unrotated pages of the same dtype and shape (packed or rotated pages hold an
    encoding of them, never the values themselves)."""
    if not exact_native(call.layout):
        return False
    keys, values = fresh
    planes = call.planes
    return (keys.dtype == planes["k"].dtype and values.dtype == planes["v"].dtype
            and keys.shape[2] == values.shape[2] == call.num_queries)


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
