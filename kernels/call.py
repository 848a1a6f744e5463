"""PagedAttentionCall: the arguments of one paged attention call, as one frozen value.

Every implementation (reference, partitioned, the planner of the direct kernels) takes one
of these instead of the same nine arguments; kernels.attention.paged_attention builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import mlx.core as mx

from kernels.layout import PageLayout


@dataclass(frozen=True, eq=False)
class PagedAttentionCall:
    """Attention of L new queries over one layer's paged (native or packed) K/V history.

    queries       [B, Hq, L, Dk] model dtype, unrotated
    planes        the layer's pool planes (kernels/layout.py), each [blocks, Hkv, block, width]
    block_tables  [B, max_blocks] int32
    context_lens  B history lengths including the L new tokens (already written)
    mask          None (all history visible), "causal", or an array (reference only)
    window        sliding window in tokens, or None; sinks: per-query-head logits, or None
    The visibility rule is kernels/paging.py's.
    """

    queries: mx.array
    planes: Mapping[str, mx.array]
    block_tables: mx.array
    context_lens: tuple[int, ...]
    layout: PageLayout
    scale: float
    mask: str | mx.array | None = None
    window: int | None = None
    sinks: mx.array | None = None

    def __post_init__(self):
        object.__setattr__(self, "context_lens", tuple(int(length) for length in self.context_lens))
        if isinstance(self.mask, str) and self.mask != "causal":
            raise ValueError(f"unknown mask {self.mask!r} (expected None, 'causal' or an array)")
        if self.window is not None and self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")

    @property
    def signature(self) -> tuple | None:
        """Everything about the call but its arrays' contents (call_signature); computed once."""
        signature = self.__dict__.get("_signature", _UNSET)
        if signature is _UNSET:
            signature = call_signature(self.queries, self.planes, self.block_tables, self.context_lens,
                                       self.layout, self.scale, self.mask, self.window, self.sinks)
            object.__setattr__(self, "_signature", signature)
        return signature

    @property
    def num_queries(self) -> int:
        """L, the new tokens per sequence."""
        return self.queries.shape[2]

    @property
    def k_head_dim(self) -> int:
        return self.queries.shape[-1]

    @property
    def v_head_dim(self) -> int:
        """The stored values' head dim (from the planes' widths)."""
        if self.layout.packed:
            return self.planes["v_codes"].shape[-1] * 8 // self.layout.v_bits
        return self.planes["v"].shape[-1]

    @property
    def array_mask(self) -> bool:
        """True for an array mask, which only the reference applies."""
        return self.mask is not None and not isinstance(self.mask, str)


_UNSET = object()


def call_signature(queries: mx.array, planes: Mapping[str, mx.array], block_tables: mx.array,
                   context_lens, layout: PageLayout, scale: float, mask=None, window: int | None = None,
                   sinks: mx.array | None = None) -> tuple | None:
    """Everything about a call but its arrays' contents, from PagedAttentionCall's arguments
    as they are given: shapes, dtypes, lengths and options, equal for every layer of one
    decode step. What dispatch and launch plans are cached by (kernels/attention.py,
    kernels/direct.py); kernels.attention.paged_attention reads it without making a call
    object, so a route it finds costs no more than this. None where nothing may be cached: an
    array mask, whose contents decide the result, or planes the layout's names are missing
    from (check_shape then says which)."""
    if mask is not None and not isinstance(mask, str):
        return None
    try:
        stored = tuple([(planes[name].shape, planes[name].dtype) for name in layout.plane_names])
    except KeyError:
        return None
    return (queries.shape, queries.dtype, stored, block_tables.shape, layout, scale, mask, window,
            sinks is not None, tuple(map(int, context_lens)))


def without_lengths(signature: tuple) -> tuple:
    """A call_signature without its context lengths (its last item): equal for every decode
    step of one sequence, while the lengths grow by one a step. A launch plan's templates and
    kernels follow from it; kernels.direct.respan makes the rest for other lengths."""
    return signature[:-1]
