"""Direct paged attention: the launch plans of the CUDA and Metal kernels (planning only;
kernels/attention.py dispatches, kernels/cuda.py and kernels/metal.py run the plans).

Split-K decode: the visible span of each sequence is cut into equal splits, one thread block
per (split, KV head, row chunk, sequence) scores up to ROWS_PER_BLOCK grouped query rows
(8 or 16 for the tensor-core kernel) straight from the pages and writes a partial
(max, sum, output), and a merge kernel combines the splits. A plan is the template, grid and
per-call scalars of one call, cached so every layer of a decode step shares it. The steps,
what is served and why are in docs/kernels.md ("Direct kernels"). Planes must be
row-contiguous arrays (the pool's own, not strided views), or the launcher copies them.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx

from kernels.call import PagedAttentionCall
from kernels.hadamard import sign_vector
from kernels.launch import LaunchPlan
from kernels.layout import PageLayout
from kernels.paging import AttentionShape, check_lengths, check_shape, first_visible_key
from kernels.tuning import DirectTuning

ROWS_PER_BLOCK = 4  # grouped query rows a lane-group block scores
MIN_SPLIT_TOKENS = 256
TABLE_CAP = 256  # block-table entries a split block stages in shared memory
MMA_HEAD_DIMS = (64, 128, 256)
# shared memory for a tensor-core block's rings and queries when the ring depth is not set
# (up to 4 steps): two such blocks fit an H100/H200 SM (228 KB), and one fits the 99 KB a
# block may opt in to on sm_86/sm_89; beyond 48 KB it is dynamic
MMA_SHARED_BYTES = 96 * 1024
STATIC_SHARED_BYTES = 48 * 1024  # a block's static shared memory; beyond it, dynamic (opt-in)
# the native tensor-core kernel's rings at most (a block may opt in to 227 KB on sm_90)
NATIVE_SHARED_BYTES = 200 * 1024


def float_bits(value: float) -> int:
    """The int32 whose bits are the float32 value (scalars travel in one int32 array)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


@lru_cache(maxsize=64)
def meta_array(values: tuple[int, ...]) -> mx.array:
    """The per-call int32 scalars as a device array, cached by content: a fresh host array
    costs a host-to-device transfer, and every layer of one decode step passes the same
    values, so only the first layer of a step pays it."""
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


def dims_per_lane(head_dim: int, tuning: DirectTuning) -> int:
    """head_dim values one lane owns: tuning.dims_per_lane, more when a warp would not cover D."""
    return max(tuning.dims_per_lane, head_dim // 32)


def kernel_supports(layout: PageLayout, k_head_dim: int, v_head_dim: int, tuning: DirectTuning) -> bool:
    """True when the custom kernels serve this geometry (else: partitioned)."""
    per_lane = dims_per_lane(k_head_dim, tuning)
    if k_head_dim != v_head_dim or per_lane not in (8, 16) or k_head_dim % per_lane:
        return False
    lanes = k_head_dim // per_lane
    if lanes & (lanes - 1):  # a lane group is a power-of-two slice of a warp
        return False
    return not layout.packed or layout.group_size % per_lane == 0


def split_count(batch: int, n_kv_heads: int, row_chunks: int, span_tokens: int,
                target_blocks: int) -> int:
    """Splits per sequence: enough blocks to fill the GPU, at least MIN_SPLIT_TOKENS each."""
    wanted = math.ceil(target_blocks / max(1, batch * n_kv_heads * row_chunks))
    return max(1, min(wanted, math.ceil(span_tokens / MIN_SPLIT_TOKENS)))


def mma_serves(layout: PageLayout, k_head_dim: int, v_head_dim: int, query_dtype: mx.Dtype,
               tuning: DirectTuning) -> bool:
    """True when the tensor-core kernel serves this call: packed pages whose dequantized
    values it may hold in fp16 (queries fp16/bf16; float32 queries keep float32 math), head
    dims 64/128/256 and quantization groups of at least 8 values."""
    return (
        tuning.mma
        and layout.packed
        and query_dtype in (mx.float16, mx.bfloat16)
        and k_head_dim == v_head_dim
        and k_head_dim in MMA_HEAD_DIMS
        and layout.group_size % 8 == 0
        and k_head_dim % layout.group_size == 0
    )


def native_mma_serves(layout: PageLayout, k_head_dim: int, v_head_dim: int, query_dtype: mx.Dtype,
                      page_dtype: mx.Dtype, block_size: int, tuning: DirectTuning) -> bool:
    """True when the tensor-core kernel for native pages (cuda_mma_native_split.cu) serves a
    call: tuning.native_mma, unrotated fp16/bf16 pages with queries of the same type, head dims
    64/128/256, blocks of a multiple of 16 tokens (a warp step's tokens lie in one block), and
    rings of at least two steps per warp within NATIVE_SHARED_BYTES (D = 256 with 8 warps
    would need 256 KB: the launch failed on the H200)."""
    return (
        tuning.native_mma
        and tuning.native_warps * 2 * native_slot_nbytes(k_head_dim) <= NATIVE_SHARED_BYTES
        and not layout.packed
        and not layout.rotated_keys
        and page_dtype in (mx.float16, mx.bfloat16)
        and query_dtype == page_dtype
        and k_head_dim == v_head_dim
        and k_head_dim in MMA_HEAD_DIMS
        and block_size % 16 == 0
    )


def native_slot_nbytes(head_dim: int) -> int:
    """One warp step of the native tensor-core kernel's ring: 16 tokens of K and of V, 16-bit."""
    return 2 * 16 * head_dim * 2


def plan_launch(call: PagedAttentionCall, tuning: DirectTuning, kernel: str = "lane") -> LaunchPlan:
    """The launch of one call on `kernel` ("lane", "mma" or "mma_native"), which
    kernels/attention.py picks (cuda_kernel_for): cached_plan's plan with the call's arrays."""
    return with_call_inputs(cached_plan(call, tuning, kernel), call)


def cached_plan(call: PagedAttentionCall, tuning: DirectTuning, kernel: str = "lane") -> LaunchPlan:
    """The launch of a call on `kernel` without its arrays: everything is cached by the call's
    signature (shapes, dtypes, lengths, options), the tuning and the kernel, so every layer
    of a decode step shares one plan and only the first layer of a step builds it."""
    key = (call.signature, tuning, kernel)
    cached = _PLANS.get(key)
    if cached is None:
        if len(_PLANS) >= 256:
            _PLANS.clear()
        build = {"mma": _build_mma_plan, "mma_native": _build_native_mma_plan}.get(kernel, _build_plan)
        cached = build(call, tuning)
        if call.signature is not None:
            _PLANS[key] = cached
    return cached


def forget_plans() -> None:
    """Drop the cached plans (and with them the kernel objects they found)."""
    _PLANS.clear()


def with_call_inputs(plan: LaunchPlan, call: PagedAttentionCall) -> LaunchPlan:
    """A cached plan with one call's arrays (a shallow copy; the plan itself is shared)."""
    return bind(plan, call.queries, call.planes, call.block_tables, call.sinks)


def bind(plan: LaunchPlan, queries: mx.array, planes, block_tables: mx.array,
         sinks: mx.array | None) -> LaunchPlan:
    """with_call_inputs from a call's arrays as paged_attention was given them, for the calls
    it routes without a call object: the plan's signature (call_signature) is theirs."""
    return plan.with_inputs(
        [queries, plan.signs, *[planes[name] for name in plan.plane_names],
         _as(block_tables, mx.int32), plan.meta],
        _no_sinks() if sinks is None else _as(sinks, mx.float32),
    )


def respan(plan: LaunchPlan, context_lens) -> LaunchPlan:
    """The plan of a call that differs from plan's own only in its context lengths (equal
    kernels.call.without_lengths of their signatures): its templates and compiled kernels,
    with the splits and per-call scalars _split_plan gives those lengths, which are checked
    as check_shape checks them (AttentionShapeError). The first layer of every decode step
    takes this instead of building a plan: its lengths grew by one since the last step."""
    rule = plan.split_rule
    lengths = tuple([int(length) for length in context_lens])
    check_lengths(lengths, rule.batch, rule.num_queries, rule.block_size, rule.table_blocks)
    num_splits, meta = _splits(rule, lengths)
    return plan.respanned(num_splits, meta)


_PLANS: dict[tuple, LaunchPlan] = {}


def _as(array: mx.array, dtype: mx.Dtype) -> mx.array:
    """array in dtype, without a conversion op in the graph when it already is."""
    return array if array.dtype == dtype else array.astype(dtype)


@lru_cache(maxsize=1)
def _no_sinks() -> mx.array:
    return mx.zeros((1,), dtype=mx.float32)


def _build_plan(call: PagedAttentionCall, tuning: DirectTuning) -> LaunchPlan:
    """The lane-group kernel's launch: ROWS_PER_BLOCK rows per block, any block size."""
    shape = check_shape(call)
    layout = call.layout
    if not kernel_supports(layout, shape.k_head_dim, shape.v_head_dim, tuning):
        raise ValueError(f"direct kernels do not serve layout {layout} with head dims "
                         f"{shape.k_head_dim}/{shape.v_head_dim}")
    num_splits, meta, rule = _split_plan(call, shape, ROWS_PER_BLOCK, tuning.target_blocks, align=1)
    native_f32 = not layout.packed and call.planes["k"].dtype == mx.float32
    unroll = max(1, tuning.unroll // 2) if native_f32 else tuning.unroll
    num_warps = tuning.num_warps if shape.k_head_dim <= 256 else 4  # shared memory: groups * rows * D
    split_template = [
        ("D", shape.k_head_dim),
        ("DPL", dims_per_lane(shape.k_head_dim, tuning)),
        ("ROWS", ROWS_PER_BLOCK),
        ("UNROLL", unroll),
        ("NUM_WARPS", num_warps),
        *_page_template(call, shape),
    ]
    if not layout.packed:
        split_template.append(("KvT", call.planes["k"].dtype))
    return _launch_plan("lane", call, shape, num_splits, meta, rule, num_warps * 32, split_template)


def _page_template(call: PagedAttentionCall, shape: AttentionShape) -> list[tuple]:
    """The template entries both split kernels take, in their order: the page geometry and
    codes, the visibility rule, the staged block-table size."""
    causal = shape.num_queries > 1 and (call.mask == "causal" or call.window is not None)
    layout = call.layout
    return [
        ("BLOCK_SIZE", shape.block_size),
        ("K_BITS", layout.k_bits),
        ("V_BITS", layout.v_bits),
        ("GROUP", layout.group_size),
        ("CAUSAL", causal),
        ("WINDOWED", call.window is not None),
        ("ROTATE", layout.rotated_keys),
        ("TABLE_CAP", TABLE_CAP),
    ]


@dataclass(frozen=True)
class SplitRule:
    """What a plan's splits and per-call scalars follow from besides the context lengths
    (_splits), kept on the plan for respan."""

    batch: int
    n_kv_heads: int
    num_queries: int
    rows: int  # grouped query rows per KV head: rep * L
    row_chunks: int  # blocks of rows_per_block rows that cover them
    target_blocks: int
    align: int
    window: int | None
    scale_bits: int
    block_size: int
    table_blocks: int


def _split_plan(call: PagedAttentionCall, shape: AttentionShape, rows_per_block: int,
                target_blocks: int, *, align: int) -> tuple[int, mx.array, SplitRule]:
    """(splits, meta, the rule they follow) of a call (_splits)."""
    rows = shape.rep * shape.num_queries
    rule = SplitRule(
        batch=shape.batch, n_kv_heads=shape.n_kv_heads, num_queries=shape.num_queries, rows=rows,
        row_chunks=math.ceil(rows / rows_per_block), target_blocks=target_blocks, align=align,
        window=call.window, scale_bits=float_bits(call.scale), block_size=shape.block_size,
        table_blocks=call.block_tables.shape[1],
    )
    num_splits, meta = _splits(rule, call.context_lens)
    return num_splits, meta, rule


def _splits(rule: SplitRule, context_lens: tuple[int, ...]) -> tuple[int, mx.array]:
    """(splits, meta) for the lengths: the visible span [first_key, max context) cut into
    equal splits, first_key and the split size rounded to rule.align tokens (earlier keys
    are masked by position), and the per-call scalars of the split kernels."""
    align = rule.align
    first_key = first_visible_key(context_lens, rule.num_queries, rule.window) // align * align
    span = max(context_lens) - first_key
    num_splits = split_count(rule.batch, rule.n_kv_heads, rule.row_chunks, span, rule.target_blocks)
    split_tokens = math.ceil(math.ceil(span / num_splits) / align) * align
    num_splits = math.ceil(span / split_tokens)
    meta = meta_array(
        (rule.rows, rule.num_queries, split_tokens, rule.window or 0, first_key, rule.row_chunks,
         rule.scale_bits, *context_lens)
    )
    return num_splits, meta


def _launch_plan(kernel: str, call: PagedAttentionCall, shape: AttentionShape, num_splits: int,
                 meta: mx.array, rule: SplitRule, threads: int, split_template: list,
                 shared_memory: int = 0) -> LaunchPlan:
    """The LaunchPlan both split kernels share the merge and partial layout of."""
    merge_template = [("D", shape.v_head_dim), ("HAS_SINKS", call.sinks is not None),
                      ("OutT", call.queries.dtype)]
    return LaunchPlan(
        packed=call.layout.packed,
        kernel=kernel,
        batch=shape.batch,
        head_dim=shape.k_head_dim,
        num_splits=num_splits,
        grid_y=shape.n_kv_heads * rule.row_chunks,
        threads=threads,
        split_inputs=[],
        split_template=split_template,
        merge_template=merge_template,
        meta=meta,
        split_rule=rule,
        sinks=None,
        signs=rotation_signs(shape.k_head_dim, call.layout.rotation_seed),
        plane_names=call.layout.plane_names,
        partial_shape=(shape.batch * shape.n_q_heads * shape.num_queries, num_splits),
        output_shape=(shape.batch, shape.n_q_heads, shape.num_queries, shape.v_head_dim),
        output_dtype=call.queries.dtype,
        shared_memory=shared_memory,
    )


def _build_mma_plan(call: PagedAttentionCall, tuning: DirectTuning) -> LaunchPlan:
    """The tensor-core kernel's launch: 8 (or 16, D <= 128) query rows per block, a warp
    takes 16 tokens per step, so the visible span starts at a multiple of 16 (earlier keys
    are masked by position) and splits are whole steps."""
    shape = check_shape(call)
    layout = call.layout
    if not mma_serves(layout, shape.k_head_dim, shape.v_head_dim, call.queries.dtype, tuning):
        raise ValueError(f"the tensor-core kernel does not serve layout {layout} with head dims "
                         f"{shape.k_head_dim}/{shape.v_head_dim} and {call.queries.dtype} queries")
    rows16 = shape.rep * shape.num_queries > 8 and shape.k_head_dim <= 128
    rows = 16 if rows16 else 8
    num_splits, meta, rule = _split_plan(call, shape, rows, tuning.mma_target_blocks, align=16)
    d = shape.k_head_dim
    raw_words = 2 * (d // 4) * layout.k_bits // 32 + 4 * (d // 8) * layout.v_bits // 32
    # cp.async rings: a warp step is 16 tokens of every plane (codes and four scale planes)
    slot = 16 * (d * (layout.k_bits + layout.v_bits) // 8 + 4 * 4 * (d // layout.group_size))
    if tuning.mma_stages is None:
        stages = min(4, (MMA_SHARED_BYTES - rows * d * 4) // (tuning.mma_warps * slot))
    else:
        stages = tuning.mma_stages
    if shape.block_size % 16 or stages < 2:
        stages = 0
    raw = raw_codes_serve(layout, d, stages, tuning)
    # raw codes take one step per warp iteration (registers: two 6-warp blocks fit an SM);
    # two steps paid off when every pair was dequantized before the mma (docs/kernels.md)
    sub = (2 if stages >= 4 and not raw else 1) if tuning.mma_sub is None else tuning.mma_sub
    if stages < 2 * sub:  # a warp needs its iteration's slots plus at least one iteration ahead
        sub = 1
    stages -= stages % sub
    separate_queries, shared_memory = _mma_shared_layout(d, rows, stages, slot, tuning)
    split_template = [
        ("D", d),
        ("ROWS16", rows16),
        ("NUM_WARPS", tuning.mma_warps),
        *_page_template(call, shape),
        ("PIPE", raw_words <= 32 if tuning.mma_pipe is None else tuning.mma_pipe),
        ("PROBE", 0),
        ("ASYNC", stages > 0),
        ("STAGES", max(stages, 1)),
        ("SUB", sub),
        ("RAW", raw),
        ("QSEP", separate_queries),
        ("SMEM", shared_memory),
    ]
    plan = _launch_plan("mma", call, shape, num_splits, meta, rule, tuning.mma_warps * 32,
                        split_template, shared_memory)
    return replace(plan, min_blocks=tuning.mma_min_blocks)


def _mma_shared_layout(head_dim: int, rows: int, stages: int, slot: int,
                       tuning: DirectTuning) -> tuple[bool, int]:
    """(separate query space, dynamic shared bytes) of the tensor-core kernel, mirroring its
    SHARED layout: one region for the rings (stages > 0) or the warps' partial outputs, and
    the block's float32 queries either after it (their own space: the rings' first copies are
    issued before the query prologue) or overlaid on it. Static shared memory while the whole
    block fits STATIC_SHARED_BYTES (the block table and softmax state included), preferring
    the separate layout; beyond that (deep rings) the region is dynamic shared memory
    (0 bytes: static)."""
    ring = tuning.mma_warps * stages * slot
    queries = rows * head_dim * 4
    region = max(ring, tuning.mma_warps * rows * head_dim * 4)
    rest = TABLE_CAP * 4 + 2 * tuning.mma_warps * rows * 4
    if stages and tuning.mma_early_issue and region + queries + rest <= STATIC_SHARED_BYTES:
        return True, 0
    if max(region, queries) + rest <= STATIC_SHARED_BYTES:
        return False, 0
    # MLX opts a kernel in to more than 48 KB only above 48000 dynamic bytes
    return stages > 0 and tuning.mma_early_issue, max(region + queries, 48001)


def raw_codes_serve(layout: PageLayout, head_dim: int, stages: int, tuning: DirectTuning) -> bool:
    """Whether the tensor-core kernel takes codes into the mma as they are, with scales and
    offsets applied per quantization group (kernels/cuda_mma.py): it reads the scales from
    the cp.async rings, and a lane's share of a group must be whole 32-bit words (a group of
    at least 32 dims for 4-bit keys, 64 for 4-bit values). Head dims up to 128: at 256 the
    per-group accumulators no longer fit in registers."""
    return (tuning.mma_raw and stages > 0 and head_dim <= 128
            and layout.group_size * layout.k_bits >= 128
            and layout.group_size * layout.v_bits >= 256)


def cuda_kernel_for(call: PagedAttentionCall, tuning: DirectTuning) -> str:
    """The CUDA split kernel of a call the direct kernels serve: "mma" for packed pages with
    fp16/bf16 queries (mma_serves), "mma_native" for native fp16/bf16 pages (native_mma_serves:
    the default, measured at 1.00x dense SDPA at 32K on the H200 against the lane-group
    kernel's 0.85x, docs/kernels.md), else "lane"."""
    layout = call.layout
    if layout.packed:
        return "mma" if mma_serves(layout, call.k_head_dim, call.v_head_dim, call.queries.dtype,
                                   tuning) else "lane"
    return "mma_native" if _native_serves(call, tuning) else "lane"


def _native_serves(call: PagedAttentionCall, tuning: DirectTuning) -> bool:
    k = call.planes["k"] if not call.layout.packed else None
    return k is not None and native_mma_serves(call.layout, call.k_head_dim, call.v_head_dim,
                                               call.queries.dtype, k.dtype, k.shape[2], tuning)


def _build_native_mma_plan(call: PagedAttentionCall, tuning: DirectTuning) -> LaunchPlan:
    """The launch of the tensor-core kernel for native pages: 8 (or 16, D <= 128) query rows
    per block, 16-token warp steps (the span starts at a multiple of 16; earlier keys are
    masked by position), tuning.native_stages steps of K and V per warp in a cp.async ring of
    dynamic shared memory (always opted in: MLX does so above 48000 bytes), which the warps'
    partial outputs overlay at the end."""
    shape = check_shape(call)
    if not _native_serves(call, tuning):
        raise ValueError(f"the native tensor-core kernel does not serve layout {call.layout} with "
                         f"head dims {shape.k_head_dim}/{shape.v_head_dim}, {call.planes['k'].dtype} "
                         f"pages, {call.queries.dtype} queries, block size {shape.block_size}")
    d = shape.k_head_dim
    rows16 = shape.rep * shape.num_queries > 8 and d <= 128
    rows = 16 if rows16 else 8
    num_splits, meta, rule = _split_plan(call, shape, rows, tuning.native_target_blocks, align=16)
    slot = native_slot_nbytes(d)
    # as many of the stages asked for as fit (native_mma_serves: at least two do)
    stages = min(tuning.native_stages, NATIVE_SHARED_BYTES // (tuning.native_warps * slot))
    shared_memory = max(tuning.native_warps * stages * slot, tuning.native_warps * rows * d * 4, 48001)
    causal = shape.num_queries > 1 and (call.mask == "causal" or call.window is not None)
    split_template = [
        ("D", d),
        ("ROWS16", rows16),
        ("NUM_WARPS", tuning.native_warps),
        ("BLOCK_SIZE", shape.block_size),
        ("CAUSAL", causal),
        ("WINDOWED", call.window is not None),
        ("TABLE_CAP", TABLE_CAP),
        ("STAGES", stages),
        ("KvT", call.planes["k"].dtype),
        ("SMEM", shared_memory),
    ]
    return _launch_plan("mma_native", call, shape, num_splits, meta, rule,
                        tuning.native_warps * 32, split_template, shared_memory)
