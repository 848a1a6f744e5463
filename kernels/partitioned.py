"""Partitioned paged attention in plain MLX ops: the CPU default.

The history is cut into partitions of P tokens (P a multiple of block_size). For each
partition the pages are gathered and dequantized, scores and a partial softmax are
computed in float32, and the running (max, sum, output) triple is merged with the
log-sum-exp rule:

  m' = max(m, max_j s_j)
  l' = l * exp(m - m') + sum_j exp(s_j - m')
  o' = o * exp(m - m') + sum_j exp(s_j - m') v_j          (output = o / l at the end)

Grouped-query attention reshapes queries [B, Hq, L, D] -> [B, Hkv, rep*L, D] (a view:
query head h*rep + i, query l is row i*L + l) so K/V are never repeated. Sinks enter as
the initial triple (m, l, o) = (sink, 1, 0). Partitions wholly outside every query's
window are skipped.

Workspace: one partition of dequantized K and V ([B, Hkv, P, D] float32 each), its scores
[B, Hkv, rep*L, P] float32 and the running triple; never the whole history.
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


def partitioned_attention(call: PagedAttentionCall, partition_tokens: int = 1024) -> mx.array:
    """queries [B, Hq, L, Dk] -> [B, Hq, L, Dv] in queries.dtype (float32 math)."""
    if call.array_mask:
        raise ValueError("partitioned attention takes mask None or 'causal' (array masks: reference)")
    shape = check_shape(call)
    queries, planes, block_tables, layout = call.queries, call.planes, call.block_tables, call.layout
    context_lens, scale, mask, window, sinks = (call.context_lens, call.scale, call.mask, call.window,
                                                call.sinks)
    block_size = shape.block_size
    partition_tokens = partition_size(partition_tokens, block_size)
    causal = mask == "causal" or window is not None
    batch, rows = shape.batch, shape.rep * shape.num_queries

    # queries: [B, Hkv, rep*L, Dk] float32, scale folded in
    grouped = (prepare_queries(queries, layout) * scale).reshape(
        batch, shape.n_kv_heads, rows, shape.k_head_dim
    )
    code_queries = CodeQueries(grouped, layout) if layout.packed else None
    merge = OnlineSoftmax(shape, sinks)

    first_key = first_visible_key(context_lens, shape.num_queries, window)
    start = first_key // partition_tokens * partition_tokens
    for token0 in range(start, shape.max_context, partition_tokens):
        count = min(partition_tokens, shape.max_context - token0)
        first_block = token0 // block_size
        stop_block = first_block + math.ceil(count / block_size)
        block_ids = clean_block_ids(block_tables, context_lens, block_size, first_block, stop_block)
        width = block_ids.shape[1] * block_size  # count rounded up to whole blocks
        if layout.packed:
            pages = PackedPartition(planes, layout, block_ids)
            scores = pages.scores(code_queries)  # [B, Hkv, rows, width]
        else:
            keys, values = gather_pages(planes, layout, block_ids, mx.float32)
            scores = grouped @ keys.transpose(0, 1, 3, 2)  # [B, Hkv, rows, width]
        visible = visibility_mask(
            context_lens, shape.num_queries, token0, width, causal=causal, window=window
        )
        weights = merge.weights(scores, visible)
        merge.add(pages.weighted_values(weights) if layout.packed else weights @ values)
    return merge.result(queries.dtype)


def partition_size(partition_tokens: int, block_size: int) -> int:
    """partition_tokens rounded up to a whole number of blocks (at least one)."""
    if partition_tokens <= 0:
        raise ValueError(f"partition_tokens must be positive, got {partition_tokens}")
    return max(1, math.ceil(partition_tokens / block_size)) * block_size


class CodeQueries:
    """Grouped queries split the way packed key codes are laid out.

    grouped: [B, Hkv, R, Dk] float32 (scaled, rotated). Per group g of G dims:
      parts  [B, Hkv, Gc, R, G] (8-bit) or even / odd dims [B, Hkv, Gc, R, G/2] (4-bit)
      sums   [B, Hkv, R, Gc]    sum of the group's query values (for the offsets)
    """

    def __init__(self, grouped: mx.array, layout: PageLayout):
        batch, heads, rows, dim = grouped.shape
        self.groups = dim // layout.group_size
        by_group = grouped.reshape(batch, heads, rows, self.groups, layout.group_size)
        self.sums = by_group.sum(axis=-1)
        by_group = by_group.transpose(0, 1, 3, 2, 4)  # [B, H, Gc, R, G]
        if layout.k_bits == 8:
            self.parts = [by_group]
        else:
            self.parts = [by_group[..., 0::2], by_group[..., 1::2]]


class PackedPartition:
    """One partition of packed pages, kept as codes: [B, Hkv, P, ...] per plane."""

    def __init__(self, planes: dict[str, mx.array], layout: PageLayout, block_ids: mx.array):
        self.layout = layout

        def tokens(name):  # [B, n, H, bs, W] -> [B, H, n*bs, W]
            x = planes[name][block_ids]
            batch, count, heads, block, width = x.shape
            return x.transpose(0, 2, 1, 3, 4).reshape(batch, heads, count * block, width)

        self.k_codes, self.v_codes = tokens("k_codes"), tokens("v_codes")
        self.k_scales, self.k_offsets = tokens("k_scales"), tokens("k_offsets")
        self.v_scales, self.v_offsets = tokens("v_scales"), tokens("v_offsets")

    def code_planes(self, codes: mx.array, bits: int) -> list[mx.array]:
        """codes [B, H, P, W] -> per plane [B, H, Gc, P, G'] float32 (G' = G, or G/2 for the
        low and high nibbles of 4-bit codes)."""
        batch, heads, tokens, _ = codes.shape
        groups = self.layout.group_size
        raw = [codes] if bits == 8 else [codes & 0x0F, codes >> 4]
        per_group = groups if bits == 8 else groups // 2
        return [
            plane.astype(mx.float32)
            .reshape(batch, heads, tokens, -1, per_group)
            .transpose(0, 1, 3, 2, 4)
            for plane in raw
        ]

    def scores(self, queries: CodeQueries) -> mx.array:
        """-> [B, H, R, P]: sum_g scale_g (q_g . codes_g) + offset_g sum(q_g)."""
        planes = self.code_planes(self.k_codes, self.layout.k_bits)
        dots = sum(q @ c.swapaxes(-1, -2) for q, c in zip(queries.parts, planes, strict=True))
        scales = self.k_scales.transpose(0, 1, 3, 2)[:, :, :, None, :]  # [B, H, Gc, 1, P]
        scaled = (dots * scales).sum(axis=2)
        return scaled + queries.sums @ self.k_offsets.swapaxes(-1, -2)

    def weighted_values(self, weights: mx.array) -> mx.array:
        """weights [B, H, R, P] -> sum_p weights * v_p: [B, H, R, Dv]."""
        batch, heads, rows, _ = weights.shape
        scales = self.v_scales.transpose(0, 1, 3, 2)[:, :, :, None, :]  # [B, H, Gc, 1, P]
        scaled = weights[:, :, None] * scales  # [B, H, Gc, R, P]
        parts = [scaled @ c for c in self.code_planes(self.v_codes, self.layout.v_bits)]
        if len(parts) == 2:  # even and odd dims back into order
            parts = [mx.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)]
        by_group = parts[0] + (weights @ self.v_offsets).transpose(0, 1, 3, 2)[..., None]
        return by_group.transpose(0, 1, 3, 2, 4).reshape(batch, heads, rows, -1)
