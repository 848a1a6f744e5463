"""Direct paged attention: the host side shared by the CUDA and Metal kernels.

Algorithm (split-K decode, the same on both backends):
  1. Queries are viewed as grouped rows [B, Hkv, rep*L, D] (a reshape, no copy) and,
     when keys are stored rotated, rotated inside the kernel (signs, then a fast
     Walsh-Hadamard transform, float32). Up to ROWS_PER_BLOCK rows share one pass over the
     pages, so a KV head's pages are read once per row chunk, not once per query head.
  2. The visible token span [first_key, max_context) is cut into num_splits equal splits.
     One thread block per (split, KV head, row chunk, sequence) reads its split's tokens
     through the block table, straight from the packed (or native) planes: codes are
     turned into floats in registers, scores use score = scale_g * (q . codes) + offset_g *
     sum(q) per group, and each lane group keeps an online softmax. The block writes
     partial (max, sum, output) per row, in the log2 domain.
  3. A merge kernel combines the splits (and the sink logit, if any) with the
     log-sum-exp rule and writes [B, Hq, L, Dv] in the queries' dtype.

Served: up to 8 queries, Dk == Dv a power of two from 16 to 512, group sizes that are
multiples of the dims per lane (DIMS_PER_LANE), any block size, mask None or "causal", any
window, sinks. Everything else is routed to the partitioned path by kernels/attention.py.
Launch parameters come from the H200 sweep in docs/kernels.md ($KVSTORE_DIRECT_TUNING or
apply_tuning() override them).

On CUDA, packed pages with fp16/bf16 queries take the tensor-core split kernel instead
(kernels/cuda_mma.py, planned by _build_mma_plan: 8 or 16 rows per block, 16-token warp
steps, 6 warps per block with cp.async rings in dynamic shared memory where they need more
than 48 KB, which MLX's cuda_kernel(shared_memory=...) opts the kernel in to); the partials
and the merge are the same.

Planes must be row-contiguous arrays (the pool's own arrays, not strided views): the
kernel launcher would otherwise copy a whole pool plane per call.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx

from kernels.hadamard import sign_vector
from kernels.layout import PageLayout
from kernels.paging import check_shape, first_visible_key

ROWS_PER_BLOCK = 4
NUM_WARPS = 4
TARGET_BLOCKS = 132 * 2  # two blocks per SM of an H200 (132 SMs): best of the sweep in docs/kernels.md
MIN_SPLIT_TOKENS = 256
UNROLL = 2  # tokens a lane group loads per step (halved for float32 pages: registers)
TABLE_CAP = 256  # block-table entries a split block stages in shared memory
DIMS_PER_LANE = 16  # head_dim values per lane; a lane group is D / DIMS_PER_LANE lanes

# The tensor-core kernel (kernels/cuda_mma.py): packed pages, fp16/bf16 queries, CUDA only.
MMA_WARPS = 6  # H200 sweep (docs/kernels.md): 12 warps per SM beat 8 at 128K; the kernel is latency-bound
MMA_TARGET_BLOCKS = 132 * 2  # H200 sweep (docs/kernels.md): fewer, longer splits won at 128K
MMA_HEAD_DIMS = (64, 128, 256)
MMA_PIPE: bool | None = None  # prefetch the next step's page words; None: where registers allow
MMA_STAGES: int | None = None  # cp.async ring depth; None: as many as fit (up to 4), 0: off
MMA_SUB: int | None = None  # 16-token steps per warp iteration; None: see _build_mma_plan
# shared memory for a block's rings and queries when the ring depth is not set (up to 4
# steps): two such blocks fit an H100/H200 SM (228 KB), and one fits the 99 KB a block may opt
# in to on sm_86/sm_89; beyond 48 KB it is dynamic
MMA_SHARED_BYTES = 96 * 1024
STATIC_SHARED_BYTES = 48 * 1024  # a block's static shared memory; beyond it, dynamic (opt-in)
MMA_ENV = "KVSTORE_DIRECT_MMA"  # "0": packed pages use the lane-group kernel too
# codes into the mma as they are, scales per quantization group outside it; "0" in
# $KVSTORE_DIRECT_MMA_RAW dequantizes every pair before the mma instead
MMA_RAW = os.environ.get("KVSTORE_DIRECT_MMA_RAW", "1") != "0"
# queries in their own shared memory where it fits, so the rings' first copies are issued
# before the query prologue (tuning field 11; 0 overlays them as before, for comparison)
MMA_EARLY_ISSUE = True


TUNING_ENV = "KVSTORE_DIRECT_TUNING"


def apply_tuning(text: str) -> None:
    """Set launch parameters from "unroll,warps,target_blocks[,dims_per_lane[,mma_warps,
    mma_target_blocks[,mma_pipe[,mma_stages[,mma_sub[,mma_raw[,mma_early_issue]]]]]]]"
    (benchmarks and device tests; $KVSTORE_DIRECT_TUNING is applied at import)."""
    global UNROLL, NUM_WARPS, TARGET_BLOCKS, DIMS_PER_LANE, MMA_WARPS, MMA_TARGET_BLOCKS, MMA_PIPE
    global MMA_STAGES, MMA_SUB, MMA_RAW, MMA_EARLY_ISSUE
    values = [int(x) for x in text.split(",")]
    UNROLL, NUM_WARPS, TARGET_BLOCKS = values[:3]
    if len(values) > 3:
        DIMS_PER_LANE = values[3]
    if len(values) > 5:
        MMA_WARPS, MMA_TARGET_BLOCKS = values[4:6]
    if len(values) > 6:
        MMA_PIPE = bool(values[6])
    if len(values) > 7:
        MMA_STAGES = values[7]
    if len(values) > 8:
        MMA_SUB = values[8]
    if len(values) > 9:
        MMA_RAW = bool(values[9])
    if len(values) > 10:
        MMA_EARLY_ISSUE = bool(values[10])


if os.environ.get(TUNING_ENV):
    apply_tuning(os.environ[TUNING_ENV])


def float_bits(value: float) -> int:
    """The int32 whose bits are the float32 value (scalars travel in one int32 array)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


@lru_cache(maxsize=64)
def meta_array(values: tuple[int, ...]) -> mx.array:
    """The per-call int32 scalars as a device array, cached by content.

    A fresh host array costs a host-to-device transfer (tens of microseconds on the H200,
    more than a 4K-token decode kernel). Every layer of one decode step passes the same
    values, so only the first layer of a step pays it.
    """
    return mx.array(values, dtype=mx.int32)


@lru_cache(maxsize=32)
def rotation_signs(dim: int, seed: int | None) -> mx.array:
    """The +-1 sign vector of the signed Hadamard rotation as float32 [dim] (a one-element
    placeholder when keys are not rotated); the kernels apply H by a fast transform."""
    if seed is None:
        return mx.ones((1,), dtype=mx.float32)
    signs = mx.array(sign_vector(dim, seed), dtype=mx.float32)
    mx.eval(signs)
    return signs


def dims_per_lane(head_dim: int) -> int:
    """head_dim values one lane owns: DIMS_PER_LANE, more when a warp would not cover D."""
    return max(DIMS_PER_LANE, head_dim // 32)


def kernel_supports(layout: PageLayout, k_head_dim: int, v_head_dim: int) -> bool:
    """True when the custom kernels serve this geometry (else: partitioned)."""
    per_lane = dims_per_lane(k_head_dim)
    if k_head_dim != v_head_dim or per_lane not in (8, 16) or k_head_dim % per_lane:
        return False
    lanes = k_head_dim // per_lane
    if lanes & (lanes - 1):  # a lane group is a power-of-two slice of a warp
        return False
    return not layout.packed or layout.group_size % per_lane == 0


def split_count(batch: int, n_kv_heads: int, row_chunks: int, span_tokens: int,
                target_blocks: int | None = None) -> int:
    """Splits per sequence: enough blocks to fill the GPU, at least MIN_SPLIT_TOKENS each."""
    wanted = math.ceil((target_blocks or TARGET_BLOCKS) / max(1, batch * n_kv_heads * row_chunks))
    return max(1, min(wanted, math.ceil(span_tokens / MIN_SPLIT_TOKENS)))


def mma_serves(layout: PageLayout, k_head_dim: int, v_head_dim: int, query_dtype: mx.Dtype) -> bool:
    """True when the tensor-core kernel serves this call: packed pages whose dequantized
    values it may hold in fp16 (queries fp16/bf16; float32 queries keep float32 math), head
    dims 64/128/256 and quantization groups of at least 8 values."""
    return (
        os.environ.get(MMA_ENV, "1") != "0"
        and layout.packed
        and query_dtype in (mx.float16, mx.bfloat16)
        and k_head_dim == v_head_dim
        and k_head_dim in MMA_HEAD_DIMS
        and layout.group_size % 8 == 0
        and k_head_dim % layout.group_size == 0
    )


@dataclass
class LaunchPlan:
    """Everything cuda.launch / metal.launch need for one call."""

    packed: bool
    kernel: str  # "lane" (kernels/cuda.py, kernels/metal.py) or "mma" (kernels/cuda_mma.py)
    batch: int
    head_dim: int
    num_splits: int
    grid_y: int  # Hkv * row chunks
    threads: int
    split_inputs: list
    split_template: list
    merge_template: list
    meta: mx.array
    sinks: mx.array
    partial_shape: tuple  # (B * Hq * L, num_splits)
    output_shape: tuple
    output_dtype: mx.Dtype
    shared_memory: int = 0  # dynamic shared bytes of the split kernel (0: static only)


def plan_launch(
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
    kernel: str = "lane",
) -> LaunchPlan:
    """The launch of one call. Everything but the input arrays is cached by shape, dtype,
    lengths and options: every layer of a decode step shares one plan, so the Python work
    per layer is a dictionary lookup and two kernel calls."""
    plane_arrays = [planes[name] for name in layout.plane_names]
    key = (
        tuple(queries.shape), queries.dtype, tuple((tuple(p.shape), p.dtype) for p in plane_arrays),
        tuple(block_tables.shape), tuple(context_lens), layout, scale, mask, window,
        sinks is not None, UNROLL, NUM_WARPS, TARGET_BLOCKS, DIMS_PER_LANE, kernel,
        MMA_WARPS, MMA_TARGET_BLOCKS, MMA_PIPE, MMA_STAGES, MMA_SUB, MMA_RAW, MMA_EARLY_ISSUE,
    )
    cached = _PLANS.get(key)
    if cached is None:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        build = _build_mma_plan if kernel == "mma" else _build_plan
        cached = _PLANS[key] = build(
            queries, planes, block_tables, context_lens, layout,
            scale=scale, mask=mask, window=window, sinks=sinks,
        )
    signs = rotation_signs(queries.shape[-1], layout.rotation_seed)
    return replace(
        cached,
        split_inputs=[queries, signs, *plane_arrays, _as(block_tables, mx.int32), cached.meta],
        sinks=_as(sinks, mx.float32) if sinks is not None else _no_sinks(),
    )


_PLANS: dict[tuple, LaunchPlan] = {}


def _as(array: mx.array, dtype: mx.Dtype) -> mx.array:
    """array in dtype, without a conversion op in the graph when it already is."""
    return array if array.dtype == dtype else array.astype(dtype)


@lru_cache(maxsize=1)
def _no_sinks() -> mx.array:
    return mx.zeros((1,), dtype=mx.float32)


def _build_plan(
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
) -> LaunchPlan:
    shape = check_shape(queries, planes, block_tables, context_lens, layout)
    if not kernel_supports(layout, shape.k_head_dim, shape.v_head_dim):
        raise ValueError(f"direct kernels do not serve layout {layout} with head dims "
                         f"{shape.k_head_dim}/{shape.v_head_dim}")
    num_splits, row_chunks, meta = _split_plan(shape, context_lens, window, scale, ROWS_PER_BLOCK,
                                               TARGET_BLOCKS, align=1)
    causal = shape.num_queries > 1 and (mask == "causal" or window is not None)
    unroll = UNROLL if layout.packed or planes["k"].dtype != mx.float32 else max(1, UNROLL // 2)
    num_warps = NUM_WARPS if shape.k_head_dim <= 256 else 4  # shared memory: groups * rows * D
    split_template = [
        ("D", shape.k_head_dim),
        ("DPL", dims_per_lane(shape.k_head_dim)),
        ("ROWS", ROWS_PER_BLOCK),
        ("UNROLL", unroll),
        ("NUM_WARPS", num_warps),
        ("BLOCK_SIZE", shape.block_size),
        ("K_BITS", layout.k_bits),
        ("V_BITS", layout.v_bits),
        ("GROUP", layout.group_size),
        ("CAUSAL", causal),
        ("WINDOWED", window is not None),
        ("ROTATE", layout.rotated_keys),
        ("TABLE_CAP", TABLE_CAP),
    ]
    if not layout.packed:
        split_template.append(("KvT", planes["k"].dtype))
    return _launch_plan("lane", layout, shape, queries, sinks, num_splits, row_chunks, meta,
                        num_warps * 32, split_template)


def _split_plan(shape, context_lens: list[int], window: int | None, scale: float,
                rows_per_block: int, target_blocks: int, *, align: int) -> tuple[int, int, mx.array]:
    """(splits, row chunks, meta) of a call: the visible span [first_key, max_context) cut
    into equal splits, first_key and the split size rounded to `align` tokens (earlier
    keys are masked by position), and the per-call scalars of the split kernels."""
    rows = shape.rep * shape.num_queries
    row_chunks = math.ceil(rows / rows_per_block)
    first_key = first_visible_key(context_lens, shape.num_queries, window) // align * align
    span = shape.max_context - first_key
    num_splits = split_count(shape.batch, shape.n_kv_heads, row_chunks, span, target_blocks)
    split_tokens = math.ceil(math.ceil(span / num_splits) / align) * align
    num_splits = math.ceil(span / split_tokens)
    meta = meta_array(
        (rows, shape.num_queries, split_tokens, window or 0, first_key, row_chunks,
         float_bits(scale), *context_lens)
    )
    return num_splits, row_chunks, meta


def _launch_plan(kernel: str, layout: PageLayout, shape, queries: mx.array, sinks, num_splits: int,
                 row_chunks: int, meta: mx.array, threads: int, split_template: list,
                 shared_memory: int = 0) -> LaunchPlan:
    """The LaunchPlan both split kernels share the merge and partial layout of."""
    merge_template = [("D", shape.v_head_dim), ("HAS_SINKS", sinks is not None), ("OutT", queries.dtype)]
    return LaunchPlan(
        packed=layout.packed,
        kernel=kernel,
        batch=shape.batch,
        head_dim=shape.k_head_dim,
        num_splits=num_splits,
        grid_y=shape.n_kv_heads * row_chunks,
        threads=threads,
        split_inputs=[],
        split_template=split_template,
        merge_template=merge_template,
        meta=meta,
        sinks=None,
        partial_shape=(shape.batch * shape.n_q_heads * shape.num_queries, num_splits),
        output_shape=(shape.batch, shape.n_q_heads, shape.num_queries, shape.v_head_dim),
        output_dtype=queries.dtype,
        shared_memory=shared_memory,
    )


def _build_mma_plan(
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
) -> LaunchPlan:
    """The tensor-core kernel's launch: 8 (or 16, D <= 128) query rows per block, a warp
    takes 16 tokens per step, so the visible span starts at a multiple of 16 (earlier keys
    are masked by position) and splits are whole steps."""
    shape = check_shape(queries, planes, block_tables, context_lens, layout)
    if not mma_serves(layout, shape.k_head_dim, shape.v_head_dim, queries.dtype):
        raise ValueError(f"the tensor-core kernel does not serve layout {layout} with head dims "
                         f"{shape.k_head_dim}/{shape.v_head_dim} and {queries.dtype} queries")
    rows16 = shape.rep * shape.num_queries > 8 and shape.k_head_dim <= 128
    rows = 16 if rows16 else 8
    num_splits, row_chunks, meta = _split_plan(shape, context_lens, window, scale, rows,
                                               MMA_TARGET_BLOCKS, align=16)
    causal = shape.num_queries > 1 and (mask == "causal" or window is not None)
    d = shape.k_head_dim
    raw_words = 2 * (d // 4) * layout.k_bits // 32 + 4 * (d // 8) * layout.v_bits // 32
    # cp.async rings: a warp step is 16 tokens of every plane (codes and four scale planes)
    slot = 16 * (d * (layout.k_bits + layout.v_bits) // 8 + 4 * 4 * (d // layout.group_size))
    stages = min(4, (MMA_SHARED_BYTES - rows * d * 4) // (MMA_WARPS * slot)) if MMA_STAGES is None else MMA_STAGES
    if shape.block_size % 16 or stages < 2:
        stages = 0
    raw = raw_codes_serve(layout, d, stages)
    # raw codes take one step per warp iteration (140 registers, so two 6-warp blocks fit an
    # SM; two steps need 170); two steps paid off when every pair was dequantized before the
    # mma (H200 sweeps in docs/kernels.md)
    sub = (2 if stages >= 4 and not raw else 1) if MMA_SUB is None else MMA_SUB
    if stages < 2 * sub:  # a warp needs its iteration's slots plus at least one iteration ahead
        sub = 1
    stages -= stages % sub
    separate_queries, shared_memory = _mma_shared_layout(d, rows, stages, slot)
    split_template = [
        ("D", d),
        ("ROWS16", rows16),
        ("NUM_WARPS", MMA_WARPS),
        ("BLOCK_SIZE", shape.block_size),
        ("K_BITS", layout.k_bits),
        ("V_BITS", layout.v_bits),
        ("GROUP", layout.group_size),
        ("CAUSAL", causal),
        ("WINDOWED", window is not None),
        ("ROTATE", layout.rotated_keys),
        ("TABLE_CAP", TABLE_CAP),
        ("PIPE", raw_words <= 32 if MMA_PIPE is None else MMA_PIPE),
        ("PROBE", 0),
        ("ASYNC", stages > 0),
        ("STAGES", max(stages, 1)),
        ("SUB", sub),
        ("RAW", raw),
        ("QSEP", separate_queries),
        ("SMEM", shared_memory),
    ]
    return _launch_plan("mma", layout, shape, queries, sinks, num_splits, row_chunks, meta,
                        MMA_WARPS * 32, split_template, shared_memory)


def _mma_shared_layout(head_dim: int, rows: int, stages: int, slot: int) -> tuple[bool, int]:
    """(separate query space, dynamic shared bytes) of the tensor-core kernel, mirroring its
    SHARED layout: one region for the rings (stages > 0) or the warps' partial outputs, and
    the block's float32 queries either after it (their own space: the rings' first copies are
    issued before the query prologue) or overlaid on it. Static shared memory while the whole
    block fits STATIC_SHARED_BYTES (the block table and softmax state included), preferring
    the separate layout; beyond that (deep rings) the region is dynamic shared memory
    (0 bytes: static)."""
    ring = MMA_WARPS * stages * slot
    queries = rows * head_dim * 4
    region = max(ring, MMA_WARPS * rows * head_dim * 4)
    rest = TABLE_CAP * 4 + 2 * MMA_WARPS * rows * 4
    if stages and MMA_EARLY_ISSUE and region + queries + rest <= STATIC_SHARED_BYTES:
        return True, 0
    if max(region, queries) + rest <= STATIC_SHARED_BYTES:
        return False, 0
    # MLX opts a kernel in to more than 48 KB only above 48000 dynamic bytes
    return stages > 0 and MMA_EARLY_ISSUE, max(region + queries, 48001)


def raw_codes_serve(layout: PageLayout, head_dim: int, stages: int) -> bool:
    """Whether the tensor-core kernel takes codes into the mma as they are, with scales and
    offsets applied per quantization group (kernels/cuda_mma.py): it reads the scales from
    the cp.async rings, and a lane's share of a group must be whole 32-bit words (a group of
    at least 32 dims for 4-bit keys, 64 for 4-bit values). Head dims up to 128: at 256 the
    per-group accumulators no longer fit in registers."""
    return (MMA_RAW and stages > 0 and head_dim <= 128  # at 256 its accumulators spill
            and layout.group_size * layout.k_bits >= 128
            and layout.group_size * layout.v_bits >= 256)


def run_split_merge(plan: LaunchPlan, split_kernel, merge_kernel) -> mx.array:
    """The launch both backends share: split-K partials (output [.., head_dim] and the
    running max/sum [.., 2], float32), then the merge into [B, Hq, L, Dv]. The kernels
    are the backend's own (mx.fast.cuda_kernel or mx.fast.metal_kernel objects)."""
    part_o, part_ml = split_kernel(
        inputs=plan.split_inputs,
        template=plan.split_template,
        grid=(plan.num_splits * plan.threads, plan.grid_y, plan.batch),
        threadgroup=(plan.threads, 1, 1),
        output_shapes=[plan.partial_shape + (plan.head_dim,), plan.partial_shape + (2,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (result,) = merge_kernel(
        inputs=[part_o, part_ml, plan.sinks, plan.meta],
        template=plan.merge_template,
        grid=(plan.partial_shape[0] * plan.head_dim, 1, 1),
        threadgroup=(plan.head_dim, 1, 1),
        output_shapes=[plan.output_shape],
        output_dtypes=[plan.output_dtype],
    )
    return result


def direct_attention(
    backend: str,
    queries: mx.array,
    planes: dict[str, mx.array],
    block_tables: mx.array,
    context_lens: list[int],
    layout: PageLayout,
    **options,
) -> mx.array:
    """Run the custom kernel of `backend` ("cuda" or "metal"); see the module docstring.
    On CUDA, packed pages with fp16/bf16 queries take the tensor-core kernel."""
    kernel = "lane"
    if backend == "cuda" and layout.packed:
        v_head_dim = planes["v_codes"].shape[-1] * 8 // layout.v_bits
        if mma_serves(layout, queries.shape[-1], v_head_dim, queries.dtype):
            kernel = "mma"
    plan = plan_launch(queries, planes, block_tables, context_lens, layout, kernel=kernel, **options)
    if backend == "cuda":
        from kernels import cuda

        return cuda.launch(plan)
    if backend == "metal":
        from kernels import metal

        return metal.launch(plan)
    raise ValueError(f"no direct kernel for backend {backend!r}")
