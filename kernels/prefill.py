"""Prefill attention over paged history: the pages dequantized once per chunk.

A prefill chunk of L queries (more than the direct kernels' 8) attends to T = history + L
keys. The partitioned path dequantizes the history partition by partition and merges in
MLX ops, which made prefill into packed pages grow with the square of the context on the
H200 (issue 22). This path instead:

  1. gathers the blocks of all T tokens once and dequantizes them into the model dtype
     (packed pages, on CUDA in one launch: dequantized_pages; native pages are gathered
     as stored): the workspace, priced by attention.workspace_nbytes("dequantized", ...)
     before admission allocates it;
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
rotated keys are met by queries rotated in float32 then cast. Chunk invariance is bit
for bit on the CPU; on the H200 rotated layouts differed by one bf16 step at cuts inside
blocks (docs/kernels.md, "Prefill": the queries' float32 rotation matmul is the suspect).
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from kernels.call import PagedAttentionCall
from kernels.errors import BackendUnavailable
from kernels.hadamard import rotate
from kernels.launch import CUDA_TYPES, baked
from kernels.layout import PACKED_PLANES
from kernels.paging import check_shape, clean_block_ids, exact_native, gather_pages
from kernels.quantize import cuda_available
from kernels.sources import kernel_source, nvrtc_text


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
                      dtype: mx.Dtype, *, impl: str | None = None) -> tuple[mx.array, mx.array]:
    """Packed pages of block_ids [1, n] -> keys [1, Hkv, n*bs, Dk], values [1, Hkv, n*bs, Dv]
    in dtype. impl "reference": paging.gather_pages (six gathers and about ten MLX ops of
    float32 temporaries per half); "cuda": kernels/dequantize.cu, one launch for both halves
    that reads the blocks the table names and writes token order, bit-identical to the
    reference (tests/kernels/test_prefill.py). None: "cuda" on a CUDA GPU for the dtypes it
    writes, else "reference". Each token's values depend on its own codes only, never on the
    call's shape."""
    chosen = impl or ("cuda" if cuda_available() and dtype in CUDA_TYPES else "reference")
    if chosen == "reference":
        return gather_pages(planes, layout, block_ids, dtype)
    if chosen != "cuda":
        raise ValueError(f"dequantized_pages impl {chosen!r} is not 'reference' or 'cuda'")
    if not cuda_available():
        raise BackendUnavailable("dequantized_pages impl 'cuda' was asked for but CUDA is not available here")
    _, heads, block, k_width = planes["k_codes"].shape
    v_width = planes["v_codes"].shape[-1]
    k_dim, v_dim = k_width * 8 // layout.k_bits, v_width * 8 // layout.v_bits
    count = block_ids.shape[-1]
    template = (("K_BITS", layout.k_bits), ("V_BITS", layout.v_bits), ("GROUP", layout.group_size),
                ("DK", k_dim), ("DV", v_dim), ("KW", k_width), ("VW", v_width), ("H", heads),
                ("BS", block), ("OT", dtype))
    threads = count * heads * block * (k_width + v_width)
    keys, values = _dequantize_kernel(template)(
        inputs=[block_ids.reshape(-1).astype(mx.int32), *(planes[name] for name in PACKED_PLANES)],
        grid=(-(-threads // DEQUANTIZE_THREADS) * DEQUANTIZE_THREADS, 1, 1),
        threadgroup=(DEQUANTIZE_THREADS, 1, 1),
        output_shapes=[(1, heads, count * block, k_dim), (1, heads, count * block, v_dim)],
        output_dtypes=[dtype, dtype])
    return keys, values


DEQUANTIZE_THREADS = 256  # threads per block of kernels/dequantize.cu (one per code byte)


@lru_cache(maxsize=64)
def _dequantize_kernel(template: tuple):
    """kernels/dequantize.cu for one template, its constants baked in (launch.baked)."""
    suffix, prefix = baked(template)
    return mx.fast.cuda_kernel(
        name="kvstore_dequantize_pages" + suffix,
        input_names=["block_ids", "kc", "ks", "ko", "vc", "vs", "vo"],
        output_names=["keys", "values"],
        source=prefix + nvrtc_text(kernel_source("dequantize.cu")),
        header=nvrtc_text(kernel_source("dequantize.cuh")),
    )


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
    """Peak temporaries of one call over all T tokens (the chunk's own included): the
    gathered pages (stored bytes), for packed pages the unpacked codes and the float32
    dequantization of the reference (dequantize.cu writes the model dtype directly, less),
    the keys and values in the model dtype twice (gathered, then sliced to T or, native,
    concatenated with the chunk), rotated queries, and the scores [Hq, L, T] float32 the
    SDPA may materialise. Unchanged by reading the chunk back: it always counted T."""
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
