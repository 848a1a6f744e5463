"""Helpers every attention implementation shares: block-table slicing, page gathering,
query preparation and the visibility rule of the L new queries.

Shapes used throughout (one layer):
  queries       [B, Hq, L, Dk]            model dtype, unrotated
  plane         [num_blocks, Hkv, block_size, width]
  block_tables  [B, max_blocks] int32     row b uses its first ceil(context_lens[b] / block_size)
                                          entries; the rest is padding of any value
  context_lens  B ints                    history per sequence, the L new tokens included

Query l of row b sits at position context_lens[b] - L + l. It sees key position j when
  j < context_lens[b]                                   (always)
  j <= position                                         (mask "causal", or any window)
  j > position - window                                 (window)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from kernels.call import PagedAttentionCall
from kernels.hadamard import rotate
from kernels.layout import PageLayout
from kernels.quant import dequantize


class AttentionShapeError(ValueError):
    """The arguments of paged_attention do not fit together (a caller's mistake)."""


@dataclass(frozen=True)
class AttentionShape:
    """The geometry of one paged_attention call, checked once."""

    batch: int
    n_q_heads: int
    n_kv_heads: int
    num_queries: int  # L
    k_head_dim: int
    v_head_dim: int
    block_size: int
    max_context: int

    @property
    def rep(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.n_q_heads // self.n_kv_heads


def check_shape(call: PagedAttentionCall) -> AttentionShape:
    """The call's geometry, or AttentionShapeError naming what does not fit together."""
    queries, planes, block_tables, layout = call.queries, call.planes, call.block_tables, call.layout
    context_lens = call.context_lens
    if queries.ndim != 4:
        raise AttentionShapeError(f"queries must be [B, Hq, L, D], got shape {queries.shape}")
    batch, n_q_heads, num_queries, k_head_dim = queries.shape
    missing = [name for name in layout.plane_names if name not in planes]
    if missing:
        raise AttentionShapeError(f"planes lack {missing} for layout {layout}")
    first = planes[layout.plane_names[0]]
    _, n_kv_heads, block_size, _ = first.shape
    if layout.packed:
        v_head_dim = planes["v_codes"].shape[-1] * 8 // layout.v_bits
        stored_k_dim = planes["k_codes"].shape[-1] * 8 // layout.k_bits
    else:
        v_head_dim = planes["v"].shape[-1]
        stored_k_dim = planes["k"].shape[-1]
    if stored_k_dim != k_head_dim:
        raise AttentionShapeError(f"query head dim {k_head_dim} != stored key head dim {stored_k_dim}")
    if n_q_heads % n_kv_heads:
        raise AttentionShapeError(f"{n_q_heads} query heads do not divide into {n_kv_heads} KV heads")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise AttentionShapeError(
            f"batch {batch}: got {len(context_lens)} context lengths and block table "
            f"shape {block_tables.shape}"
        )
    check_lengths(context_lens, batch, num_queries, block_size, block_tables.shape[1])
    return AttentionShape(
        batch=batch,
        n_q_heads=n_q_heads,
        n_kv_heads=n_kv_heads,
        num_queries=num_queries,
        k_head_dim=k_head_dim,
        v_head_dim=v_head_dim,
        block_size=block_size,
        max_context=max(context_lens),
    )


def check_lengths(context_lens, batch: int, num_queries: int, block_size: int, table_blocks: int) -> None:
    """check_shape's rule for the context lengths alone (AttentionShapeError): one per
    sequence of the batch, each covering the new queries and within the block table's
    table_blocks blocks. kernels.direct.respan checks a plan's new lengths by it."""
    if len(context_lens) != batch:
        raise AttentionShapeError(f"batch {batch}: got {len(context_lens)} context lengths")
    for length in context_lens:
        if length < num_queries:
            raise AttentionShapeError(f"context length {length} is shorter than {num_queries} queries")
        if math.ceil(length / block_size) > table_blocks:
            raise AttentionShapeError(
                f"context length {length} needs more than {table_blocks} blocks of {block_size}"
            )


def clean_block_ids(
    block_tables: mx.array, context_lens: list[int], block_size: int, first: int, stop: int
) -> mx.array:
    """Columns [first, stop) of the block table, with padding entries replaced by block 0.

    Padding may hold any value (-1, stale ids); replacing it keeps every gather in
    bounds. The tokens of such blocks are masked out by position anyway.
    # returns: [B, stop - first] int32
    """
    ids = block_tables[:, first:stop].astype(mx.int32)
    used = [math.ceil(length / block_size) for length in context_lens]
    if all(count >= stop for count in used):
        return ids
    columns = mx.arange(first, stop, dtype=mx.int32)[None, :]
    return mx.where(columns < mx.array(used, dtype=mx.int32)[:, None], ids, 0)


def gather_pages(
    planes: dict[str, mx.array], layout: PageLayout, block_ids: mx.array, compute_dtype=None
) -> tuple[mx.array, mx.array]:
    """Keys and values of the given blocks, contiguous per sequence.

    block_ids: [B, n] -> keys [B, Hkv, n*block_size, Dk], values [B, Hkv, n*block_size, Dv].
    Packed pages are dequantized (float32 math) into compute_dtype (default float32);
    native pages keep their dtype unless compute_dtype says otherwise.
    """

    def contiguous(x: mx.array) -> mx.array:
        batch, count, heads, block, width = x.shape
        return x.transpose(0, 2, 1, 3, 4).reshape(batch, heads, count * block, width)

    if not layout.packed:
        keys = contiguous(planes["k"][block_ids])
        values = contiguous(planes["v"][block_ids])
        if compute_dtype is not None:
            keys, values = keys.astype(compute_dtype), values.astype(compute_dtype)
        return keys, values
    dtype = compute_dtype or mx.float32
    halves = []
    for half, bits in (("k", layout.k_bits), ("v", layout.v_bits)):
        codes = planes[f"{half}_codes"][block_ids]
        scales = planes[f"{half}_scales"][block_ids]
        offsets = planes[f"{half}_offsets"][block_ids]
        halves.append(contiguous(dequantize(codes, scales, offsets, bits, dtype)))
    return halves[0], halves[1]


def exact_native(layout: PageLayout) -> bool:
    """True when attention runs in the model dtype on the stored keys as they are."""
    return not layout.packed and not layout.rotated_keys


def prepare_queries(queries: mx.array, layout: PageLayout) -> mx.array:
    """Queries in the keys' basis: rotated by R in float32 when keys are stored rotated."""
    if layout.rotated_keys:
        return rotate(queries, layout.rotation_seed)
    return queries.astype(mx.float32)


def visibility_mask(
    context_lens: list[int],
    num_queries: int,
    first_key: int,
    num_keys: int,
    *,
    causal: bool,
    window: int | None,
) -> mx.array | None:
    """Boolean [B, 1, L, num_keys] (True = visible) for key positions first_key.., or None
    when every key in the range is visible to every query (no mask needed)."""
    last_key = first_key + num_keys - 1
    lowest_position = min(context_lens) - num_queries
    all_visible = last_key < min(context_lens)
    if causal or window is not None:
        all_visible = all_visible and last_key <= lowest_position
    if window is not None:
        all_visible = all_visible and first_key > max(context_lens) - 1 - window
    if all_visible:
        return None
    keys = mx.arange(first_key, first_key + num_keys, dtype=mx.int32)[None, None, None, :]
    lengths = mx.array(context_lens, dtype=mx.int32)[:, None, None, None]
    positions = lengths - num_queries + mx.arange(num_queries, dtype=mx.int32)[None, None, :, None]
    visible = keys < lengths
    if causal or window is not None:
        visible = visible & (keys <= positions)
    if window is not None:
        visible = visible & (keys > positions - window)
    return visible


def first_visible_key(context_lens: list[int], num_queries: int, window: int | None) -> int:
    """The lowest key position any query can see (0 without a window)."""
    if window is None:
        return 0
    return max(0, min(context_lens) - num_queries - window + 1)


def sink_logits(sinks: mx.array, shape: AttentionShape) -> mx.array:
    """Per-head sink logits laid out like grouped query rows: [Hkv, rep*L, 1] float32."""
    per_head = sinks.astype(mx.float32).reshape(shape.n_kv_heads, shape.rep, 1)
    rows = mx.broadcast_to(per_head, (shape.n_kv_heads, shape.rep, shape.num_queries))
    return rows.reshape(shape.n_kv_heads, shape.rep * shape.num_queries, 1)


class OnlineSoftmax:
    """The running (max, sum, output) triple of partitioned attention, merged with the
    log-sum-exp rule (kernels/partitioned.py's docstring), in float32; one per call.
    Rows are grouped query rows [B, Hkv, rep*L]; sinks enter as the initial triple
    (sink, 1, 0)."""

    def __init__(self, shape: AttentionShape, sinks: mx.array | None):
        self.shape = shape
        rows = shape.rep * shape.num_queries
        stats = (shape.batch, shape.n_kv_heads, rows, 1)
        if sinks is None:
            self.max = mx.full(stats, -mx.inf, dtype=mx.float32)
            self.sum = mx.zeros(stats, dtype=mx.float32)
        else:
            self.max = mx.broadcast_to(sink_logits(sinks, shape), stats)
            self.sum = mx.ones(stats, dtype=mx.float32)
        self.output = mx.zeros((shape.batch, shape.n_kv_heads, rows, shape.v_head_dim),
                               dtype=mx.float32)
        self._correction = None

    def weights(self, scores: mx.array, visible: mx.array | None) -> mx.array:
        """One partition's scores [B, Hkv, rows, width], masked by visible ([B, 1, L, width]
        from visibility_mask, or None), move the running max and sum; returns the
        partition's unnormalised weights for add()."""
        shape = self.shape
        if visible is not None:
            # visible: [B, 1, L, width] -> rows are (rep, L): broadcast over rep
            batch, heads, rows, width = scores.shape
            by_rep = scores.reshape(batch, heads, shape.rep, shape.num_queries, width)
            scores = mx.where(visible[:, :, None], by_rep, -mx.inf).reshape(batch, heads, rows, width)
        new_max = mx.maximum(self.max, scores.max(axis=-1, keepdims=True))
        # a row that has seen nothing yet keeps max -inf; shift by 0 so exp() gives 0, not nan
        shift = mx.where(new_max == -mx.inf, 0.0, new_max)
        weights = mx.exp(scores - shift)
        self._correction = mx.exp(self.max - shift)
        self.sum = self.sum * self._correction + weights.sum(axis=-1, keepdims=True)
        self.max = new_max
        return weights

    def add(self, partial: mx.array) -> None:
        """Merges weights @ values of the partition weights() was last given."""
        self.output = self.output * self._correction + partial

    def result(self, dtype) -> mx.array:
        """[B, Hq, L, Dv] in dtype."""
        shape = self.shape
        result = (self.output / self.sum).reshape(
            shape.batch, shape.n_q_heads, shape.num_queries, shape.v_head_dim)
        return result.astype(dtype)
