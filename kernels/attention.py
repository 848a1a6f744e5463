"""paged_attention: the one attention entry point the engine calls, and its switch.

Implementations (see docs/kernels.md):
  "reference"    gather + dequantize + mx.fast.scaled_dot_product_attention (the control)
  "partitioned"  MLX ops over partitions of partition_tokens, log-sum-exp merge (CPU default)
  "cuda"         mx.fast.cuda_kernel, split-K partials + merge kernel, up to 8 queries
  "metal"        mx.fast.metal_kernel, the same algorithm as "cuda"
  "dequantized"  prefill: the history gathered and dequantized once per call into the model
                 dtype, one mx.fast.scaled_dot_product_attention (kernels/prefill.py)
  "quantized"    packed pages scored and weighted by mx.quantized_matmul over partitions,
                 the same merge as "partitioned" (kernels/quantized_attention.py; CPU default)

Dispatch (impl=None): $KVSTORE_ATTENTION_IMPL if set, else "cuda" when the default device
is a CUDA GPU, "metal" on a Metal GPU, "quantized" otherwise. Then, whatever was chosen:
array masks go to "reference"; "quantized" goes to "partitioned" for native pages and group
sizes mx.quantized_matmul does not take; more than KERNEL_MAX_QUERIES queries go from "cuda"/"metal"
to "dequantized" (prefill chunks on a GPU; "partitioned" where it does not serve: batches,
windows), a shape the kernels do not serve to "partitioned"; on CUDA, packed pages with
fp16/bf16 queries take the tensor-core split kernel, and native fp16/bf16 pages (blocks of
a multiple of 16 tokens) the tensor-core kernel for 16-bit pages (direct.cuda_kernel_for;
DirectTuning.native_mma, KVSTORE_DIRECT_NATIVE_MMA=0 turns it off). Forcing a kernel whose backend is
absent raises BackendUnavailable. This module is the whole rule; kernels/direct.py plans
the kernels' launches, kernels/cuda.py and kernels/metal.py run them.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

from kernels import cuda, cuda_mma, direct, metal, prefill, quantize, quantized_attention
from kernels.call import PagedAttentionCall, call_signature, without_lengths
from kernels.direct import (
    ROWS_PER_BLOCK,
    bind,
    cached_plan,
    cuda_kernel_for,
    kernel_supports,
    respan,
    split_count,
    with_call_inputs,
)
from kernels.errors import BackendUnavailable
from kernels.launch import LaunchPlan
from kernels.layout import PageLayout
from kernels.partitioned import partition_size, partitioned_attention
from kernels.reference import reference_attention
from kernels.tuning import DirectTuning, environment_tuning

IMPLEMENTATIONS = ("reference", "partitioned", "cuda", "metal", "dequantized", "quantized")
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
    return "quantized"


def select_impl(
    impl: str | None, num_queries: int, mask, layout: PageLayout, k_head_dim: int, v_head_dim: int,
    *, tuning: DirectTuning | None = None,
) -> str:
    """The implementation that will run one call (see the module docstring); tuning None:
    environment_tuning()."""
    chosen = impl or default_impl()
    if chosen not in IMPLEMENTATIONS:
        raise ValueError(f"impl {chosen!r} is not one of {IMPLEMENTATIONS}")
    if mask is not None and not isinstance(mask, str):
        return "reference"
    if chosen == "quantized" and not quantized_attention.serves(layout):
        return "partitioned"
    if chosen in ("cuda", "metal"):
        available = cuda_available() if chosen == "cuda" else metal_available()
        if not available:
            raise BackendUnavailable(f"impl {chosen!r} was asked for but {chosen} is not available here")
        if num_queries > KERNEL_MAX_QUERIES:
            return "dequantized"
        if not kernel_supports(layout, k_head_dim, v_head_dim, tuning or environment_tuning()):
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
    tuning: DirectTuning | None = None,
    fresh: tuple[mx.array, mx.array] | None = None,
) -> mx.array:
    """Attention of L new queries over paged (native or packed) K/V history: the arguments
    are PagedAttentionCall's (kernels/call.py has their shapes); returns [B, Hq, L, Dv] in
    queries.dtype. impl, partition_tokens, tuning and fresh as attend()'s.

    A call whose signature (kernels.call.call_signature) has a route to a direct kernel
    already, as every layer of a decode step after the first has, is launched from its
    arrays as given, without a call object (the route's plan was checked for that signature
    when it was made): this is the path a decode step's layers take, and its Python is what
    a step costs beyond the model's own (issue 22). The first layer of a step, whose
    lengths are new, takes the plan of its last step respanned (_respanned)."""
    tuning = tuning or environment_tuning()
    impl = impl or default_impl()
    signature = call_signature(queries, planes, block_tables, context_lens, layout, scale, mask,
                               window, sinks)
    if signature is not None:
        key = _route_key(signature, impl, tuning)
        route = _ROUTES.get(key) or _respanned(signature, key, context_lens, impl, tuning)
        if route is not None and route[1] is not None:
            launch = metal.launch if route[0] == "metal" else cuda.launch
            return launch(bind(route[1], queries, planes, block_tables, sinks))
    call = PagedAttentionCall(queries, planes, block_tables, context_lens, layout, scale=scale,
                              mask=mask, window=window, sinks=sinks)
    return attend(call, impl=impl, partition_tokens=partition_tokens, tuning=tuning, fresh=fresh)


def attend(call: PagedAttentionCall, *, impl: str | None = None, partition_tokens: int = 1024,
           tuning: DirectTuning | None = None, fresh: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """Run one call on the implementation select_impl picks. partition_tokens: the
    partitioned path's partition; tuning: the direct kernels' launch parameters
    (None: environment_tuning()); fresh: the L new tokens' own keys and values
    ([B, Hkv, L, D], unrotated, as written), which "dequantized" attends to in full
    precision (the others read them from the pages)."""
    tuning = tuning or environment_tuning()
    chosen, plan = _route(call, impl, tuning)
    if chosen == "dequantized":
        if prefill.serves(call.mask, call.window, call.queries.shape[0]):
            return prefill.dequantized_attention(call, fresh)
        chosen = "partitioned"
    if chosen == "reference":
        return reference_attention(call)
    if chosen == "partitioned":
        return partitioned_attention(call, partition_tokens=partition_tokens)
    if chosen == "quantized":
        return quantized_attention.quantized_attention(call, partition_tokens=partition_tokens)
    launch = metal.launch if chosen == "metal" else cuda.launch
    return launch(with_call_inputs(plan, call))


_ROUTES: dict[tuple, tuple[str, LaunchPlan | None]] = {}


def _route(call: PagedAttentionCall, impl: str | None, tuning: DirectTuning) -> tuple[str, LaunchPlan | None]:
    """(the implementation select_impl picks for the call, and for "cuda" / "metal" the
    kernels' cached launch plan), cached by the call's signature, the implementation asked
    for, the tuning and which GPU backend is available now: every layer of a decode step
    after the first takes one dictionary lookup for all of it. impl None reads
    $KVSTORE_ATTENTION_IMPL first (default_impl), on every call."""
    impl = impl or default_impl()
    signature = call.signature
    key = _route_key(signature, impl, tuning)
    route = _ROUTES.get(key) if signature is not None else None
    if route is None:
        chosen = select_impl(impl, call.num_queries, call.mask, call.layout, call.k_head_dim,
                             call.v_head_dim, tuning=tuning)
        plan = None
        if chosen == "cuda":
            plan = cached_plan(call, tuning, kernel=cuda_kernel_for(call, tuning))
        elif chosen == "metal":
            plan = cached_plan(call, tuning)
        route = (chosen, plan)
        if signature is not None:
            _remember(_ROUTES, key, route)
            if plan is not None:
                _remember(_SHAPED, _route_key(without_lengths(signature), impl, tuning), route)
    return route


# the routes with a launch plan by their signature without the context lengths, the last
# one made for each: what _respanned starts from
_SHAPED: dict[tuple, tuple[str, LaunchPlan]] = {}


def _respanned(signature: tuple, key: tuple, context_lens, impl: str,
               tuning: DirectTuning) -> tuple[str, LaunchPlan] | None:
    """The route of a call that differs from a routed one with a launch plan only in its
    context lengths, its plan respanned to them (kernels.direct.respan: the same templates
    and kernels, new splits and scalars, the lengths checked), remembered under the call's
    key; None when there is none. Every decode step's first layer takes this: its lengths
    grew by one, so its signature is new, and building its plan whole cost ~35-45 us on
    this project's CPU and ~0.3 ms on the H200 host (docs/kernels.md, run 8)."""
    shaped = _SHAPED.get(_route_key(without_lengths(signature), impl, tuning))
    if shaped is None:
        return None
    route = (shaped[0], respan(shaped[1], context_lens))
    _remember(_ROUTES, key, route)
    return route


def _remember(table: dict, key: tuple, route: tuple[str, LaunchPlan | None]) -> None:
    """route under key in table (_ROUTES or _SHAPED), which holds at most 256 entries."""
    if len(table) >= 256:
        table.clear()
    table[key] = route


def _route_key(signature: tuple, impl: str, tuning: DirectTuning) -> tuple:
    """What _ROUTES is keyed by: a route made while a backend was there is not served once
    it is gone."""
    return (signature, impl, tuning, cuda_available(), metal_available())


def forget_compiled_kernels() -> None:
    """Drop every route, launch plan and CUDA kernel object made so far; the next calls make
    them again, reading the sources and $KVSTORE_KERNEL_DIR anew (kernels/sources.py). For
    benchmarks that compare settings read when a kernel object is made, and for tests that
    make kernel objects through a stand-in of mx.fast.cuda_kernel."""
    _ROUTES.clear()
    _SHAPED.clear()
    direct.forget_plans()
    for made in (cuda._split_kernel, cuda.merge_kernel, cuda_mma.split_kernel,
                 cuda_mma.native_split_kernel, quantize._cuda_kernel, quantize._cuda_launch,
                 prefill._dequantize_kernel):
        made.cache_clear()


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
    tuning: DirectTuning | None = None,
) -> int:
    """Peak temporary bytes one sequence's call allocates beyond its inputs and output
    (an upper estimate, for admission pricing; multiply by the batch size).

    reference:   the whole history gathered (stored bytes) and expanded to the compute
                 dtype, plus the scores [Hq, L, T] in float32.
    partitioned: the same for one partition of partition_tokens, plus the running triple;
                 on a GPU, every partition's (see below).
    cuda/metal:  the split-K partials [Hq, L, splits, Dv + 2] float32 and the rotated queries
                 (splits as tuning plans them, the most any of the kernels the call may take
                 plans; None: environment_tuning()).
    dequantized: the whole history in the model dtype (kernels/prefill.py's estimate).
    quantized:   one partition's gathered pages and score-sized temporaries
                 (kernels/quantized_attention.py's estimate; unserved layouts: partitioned).
    """
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl {impl!r} is not one of {IMPLEMENTATIONS}")
    if impl == "dequantized":
        return prefill.workspace_nbytes(n_q_heads, n_kv_heads, num_queries, k_head_dim, v_head_dim,
                                        context_len, block_size, layout, model_dtype_nbytes)
    rows = n_q_heads * num_queries
    queries_f32 = rows * k_head_dim * 4
    triple = rows * (v_head_dim + 2) * 4
    if impl in ("cuda", "metal"):
        tuning = tuning or environment_tuning()
        # the lane-group kernel's splits, or (CUDA) the tensor-core kernel's for packed or
        # native pages, whichever is larger: the query and page dtypes that pick between
        # them are not known here
        group_rows = num_queries * (n_q_heads // n_kv_heads)
        splits = split_count(1, n_kv_heads, math.ceil(group_rows / ROWS_PER_BLOCK), context_len,
                             tuning.target_blocks)
        mma_chunks = math.ceil(group_rows / (16 if group_rows > 8 and k_head_dim <= 128 else 8))
        if impl == "cuda" and layout.packed:
            splits = max(splits, split_count(1, n_kv_heads, mma_chunks, context_len + 16,
                                             tuning.mma_target_blocks))
        elif impl == "cuda" and tuning.native_mma:
            splits = max(splits, split_count(1, n_kv_heads, mma_chunks, context_len + 16,
                                             tuning.native_target_blocks))
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
    if impl == "quantized" and quantized_attention.serves(layout):
        return quantized_attention.workspace_nbytes(
            n_q_heads, n_kv_heads, num_queries, k_head_dim, v_head_dim, context_len, block_size,
            layout, partition_tokens, gpu=mx.default_device() == mx.gpu)
    if mx.default_device() == mx.gpu:
        # A GPU backend hands a temporary's memory back only once the kernels that read it
        # have run, so within one evaluation the partitions' temporaries can all be alive
        # (measured: docs/kernels.md, Workspace). Priced per partition there.
        partitions = math.ceil(context_len / window_tokens)
        return queries_f32 + partitions * (triple + expansion(window_tokens))
    return queries_f32 + triple + expansion(window_tokens)
