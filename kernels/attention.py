"""paged_attention: the one attention entry point the engine calls, and its switch.

Implementations (see docs/kernels.md):
  "reference"    gather + dequantize + mx.fast.scaled_dot_product_attention (the control)
  "partitioned"  MLX ops over partitions of partition_tokens, log-sum-exp merge (CPU default)
  "cuda"         mx.fast.cuda_kernel, split-K partials + merge kernel, up to 8 queries
  "metal"        mx.fast.metal_kernel, the same algorithm as "cuda"

Dispatch (impl=None): $KVSTORE_ATTENTION_IMPL if set, else "cuda" when the default device
is a CUDA GPU, "metal" on a Metal GPU, "partitioned" otherwise. Then, whatever was chosen:
array masks go to "reference"; more than KERNEL_MAX_QUERIES queries, or a shape the
kernels do not serve, go from "cuda"/"metal" to "partitioned". Forcing a kernel whose
backend is absent raises BackendUnavailable.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

from kernels.errors import BackendUnavailable
from kernels.layout import PageLayout
from kernels.partitioned import partition_size, partitioned_attention
from kernels.reference import reference_attention

IMPLEMENTATIONS = ("reference", "partitioned", "cuda", "metal")
IMPL_ENV = "KVSTORE_ATTENTION_IMPL"
KERNEL_MAX_QUERIES = 8


def cuda_available() -> bool:
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available()) and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def default_impl() -> str:
    """The implementation dispatch picks for this process (before per-call fallbacks)."""
    forced = os.environ.get(IMPL_ENV)
    if forced:
        if forced not in IMPLEMENTATIONS:
            raise ValueError(f"{IMPL_ENV}={forced!r} is not one of {IMPLEMENTATIONS}")
        return forced
    if cuda_available():
        return "cuda"
    if metal_available():
        return "metal"
    return "partitioned"


def select_impl(
    impl: str | None, num_queries: int, mask, layout: PageLayout, k_head_dim: int, v_head_dim: int
) -> str:
    """The implementation that will run one call (see the module docstring)."""
    chosen = impl or default_impl()
    if chosen not in IMPLEMENTATIONS:
        raise ValueError(f"impl {chosen!r} is not one of {IMPLEMENTATIONS}")
    if mask is not None and not isinstance(mask, str):
        return "reference"
    if chosen in ("cuda", "metal"):
        available = cuda_available() if chosen == "cuda" else metal_available()
        if not available:
            raise BackendUnavailable(f"impl {chosen!r} was asked for but {chosen} is not available here")
        from kernels.direct import kernel_supports

        if num_queries > KERNEL_MAX_QUERIES or not kernel_supports(layout, k_head_dim, v_head_dim):
            return "partitioned"
    return chosen


def paged_attention(
    queries: mx.array,
    planes: dict[str, mx.array],
    block_tables: mx.array,
    context_lens: list[int],
    layout: PageLayout,
    *,
    scale: float,
    mask=None,
    window: int | None = None,
    sinks: mx.array | None = None,
    impl: str | None = None,
    partition_tokens: int = 1024,
) -> mx.array:
    """Attention of L new queries over paged (native or packed) K/V history.

    queries [B, Hq, L, Dk] model dtype, unrotated; planes per kernels/layout.py, one layer;
    block_tables [B, max_blocks] int32; context_lens [B] history lengths including the L new
    tokens (already written). Returns [B, Hq, L, Dv] in queries.dtype. With mask None all
    history is visible; "causal" and window restrict by position (see kernels/paging.py).
    """
    if isinstance(mask, str) and mask != "causal":
        raise ValueError(f"unknown mask {mask!r} (expected None, 'causal' or an array)")
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    k_head_dim = queries.shape[-1]
    v_head_dim = _stored_v_head_dim(planes, layout)
    chosen = select_impl(impl, queries.shape[2], mask, layout, k_head_dim, v_head_dim)
    common = dict(scale=scale, mask=mask, window=window, sinks=sinks)
    if chosen == "reference":
        return reference_attention(queries, planes, block_tables, context_lens, layout, **common)
    if chosen == "partitioned":
        return partitioned_attention(
            queries, planes, block_tables, context_lens, layout,
            partition_tokens=partition_tokens, **common,
        )
    from kernels.direct import direct_attention

    return direct_attention(
        chosen, queries, planes, block_tables, context_lens, layout, **common
    )


def _stored_v_head_dim(planes: dict[str, mx.array], layout: PageLayout) -> int:
    if layout.packed:
        return planes["v_codes"].shape[-1] * 8 // layout.v_bits
    return planes["v"].shape[-1]


def workspace_nbytes(
    impl: str,
    n_q_heads: int,
    n_kv_heads: int,
    num_queries: int,
    k_head_dim: int,
    v_head_dim: int,
    context_len: int,
    block_size: int,
    layout: PageLayout,
    partition_tokens: int = 1024,
    *,
    model_dtype_nbytes: int = 2,
) -> int:
    """Peak temporary bytes one sequence's call allocates beyond its inputs and output
    (an upper estimate, for admission pricing; multiply by the batch size).

    reference:   the whole history gathered (stored bytes) and expanded to the compute
                 dtype, plus the scores [Hq, L, T] in float32.
    partitioned: the same for one partition of partition_tokens, plus the running triple;
                 on a GPU, every partition's (see below).
    cuda/metal:  the split-K partials [Hq, L, splits, Dv + 2] float32 and the rotated queries.
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl {impl!r} is not one of {IMPLEMENTATIONS}")
    rows = n_q_heads * num_queries
    queries_f32 = rows * k_head_dim * 4
    triple = rows * (v_head_dim + 2) * 4
    if impl in ("cuda", "metal"):
        from kernels.direct import MMA_TARGET_BLOCKS, ROWS_PER_BLOCK, split_count

        # the lane-group kernel's splits, or (CUDA, packed pages) the tensor-core kernel's,
        # whichever is larger: the query dtype that picks between them is not known here
        group_rows = num_queries * (n_q_heads // n_kv_heads)
        splits = split_count(1, n_kv_heads, math.ceil(group_rows / ROWS_PER_BLOCK), context_len)
        if impl == "cuda" and layout.packed:
            mma_chunks = math.ceil(group_rows / (16 if group_rows > 8 and k_head_dim <= 128 else 8))
            splits = max(splits, split_count(1, n_kv_heads, mma_chunks, context_len + 16, MMA_TARGET_BLOCKS))
        return queries_f32 + rows * splits * (v_head_dim + 2) * 4

    def expansion(tokens: int) -> int:
        padded = math.ceil(tokens / block_size) * block_size
        dims = k_head_dim + v_head_dim
        if layout.packed:
            code_bytes = (k_head_dim * layout.k_bits + v_head_dim * layout.v_bits) // 8
            groups = (k_head_dim + v_head_dim) // layout.group_size
            stored = code_bytes + groups * 8
            # gathered pages, unpacked codes (uint8), float32 values (twice: grouped + laid out)
            per_token = stored + dims + 2 * dims * 4
        else:
            compute = model_dtype_nbytes if not layout.rotated_keys else 4
            per_token = dims * model_dtype_nbytes + dims * compute
        return padded * n_kv_heads * per_token + rows * padded * 4 * 2  # scores and weights

    if impl == "reference":
        return queries_f32 + expansion(context_len)
    window_tokens = min(context_len, partition_size(partition_tokens, block_size))
    if mx.default_device() == mx.gpu:
        # A GPU backend hands a temporary's memory back only once the kernels that read it
        # have run, so within one evaluation the partitions' temporaries can all be alive:
        # on the H200, k4v4 L=512 T=2048 (two partitions) peaked at 92 MB against 61 MB on
        # the CPU, and one run went over the one-partition price. Priced per partition there.
        partitions = math.ceil(context_len / window_tokens)
        return queries_f32 + partitions * (triple + expansion(window_tokens))
    return queries_f32 + triple + expansion(window_tokens)
