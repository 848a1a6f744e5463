"""paged_attention: every implementation against the gather reference over a shape table.

Implementations under test come from KVSTORE_TEST_IMPLS (default "partitioned,cuda,metal").
"cuda" and "metal" skip loudly where their backend is absent; on the H200 the same file
runs the CUDA kernel. KVSTORE_SOAK=1 runs the whole product of the sweep axes.

Tolerances (max |impl - reference| over the output, per output dtype). Both sides round
their result to the output dtype once; the reference of native bf16/f16 pages also runs
SDPA in that dtype, while the other paths accumulate in float32:
  float32   2e-4   (float32 accumulation order only)
  float16   4e-3   (a few f16 ulps at |x| < 2)
  bfloat16  3e-2   (a few bf16 ulps at |x| < 2; bf16 SDPA in the reference)
Packed pages: both sides dequantize the same codes in float32, so the bf16 output rounding
dominates and the same bf16 tolerance holds.
"""

from __future__ import annotations

import itertools
import math
import os
import random

import mlx.core as mx
import numpy as np
import pytest

from kernels.attention import (
    IMPL_ENV,
    KERNEL_MAX_QUERIES,
    cuda_available,
    metal_available,
    paged_attention,
    select_impl,
    workspace_nbytes,
)
from kernels.call import PagedAttentionCall
from kernels.errors import BackendUnavailable
from kernels.layout import PageLayout
from kernels.partitioned import partitioned_attention
from kernels.tuning import DirectTuning
from tests.kernels.pages import LAYOUTS, make_case

SOAK = os.environ.get("KVSTORE_SOAK") == "1"
TOLERANCE = {mx.float32: 2e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}
IMPLS = [name for name in os.environ.get("KVSTORE_TEST_IMPLS", "partitioned,cuda,metal").split(",") if name]


def require(impl: str) -> None:
    if impl == "cuda" and not cuda_available():
        pytest.skip("CUDA is not available: mx.cuda.is_available() is False or the default device is the CPU")
    if impl == "metal" and not metal_available():
        pytest.skip("Metal is not available: mx.metal.is_available() is False (no Apple GPU on this machine)")


# The shape table. Columns: layout, head_dim, GQA ratio (q heads per kv head), block size,
# context lengths (one per sequence), queries L, mask, window.
# Each row says what it is there for.
TABLE = [
    ("bf16", 128, 4, 16, [1], 1, None, None),                 # one token of history
    ("bf16", 128, 1, 16, [17], 1, None, None),                # partial second block, MHA
    ("f16", 64, 8, 64, [200, 64], 4, "causal", None),         # batch of unequal lengths, full last block
    ("f32", 256, 4, 16, [300], 8, "causal", None),            # head dim 256, 8 queries
    ("bf16-rot", 64, 4, 16, [129], 2, None, None),            # rotated native keys
    ("k8v8", 128, 4, 16, [1000], 1, None, None),              # decode, several partitions
    ("k8v4", 64, 8, 64, [77, 300], 3, "causal", None),        # GQA 8, causal with unequal lengths
    ("k4v4", 128, 4, 256, [513], 5, None, 100),               # window, block 256 partial
    ("k8v8-rot", 256, 1, 64, [260], 1, None, 64),             # window on decode
    ("k8v4-rot", 128, 4, 16, [2049, 9], 7, "causal", 300),    # window longer than one partition
    ("k4v4-rot", 64, 4, 16, [40], 8, None, None),             # 8 queries, no mask
    ("k4v4-rot", 128, 8, 256, [33000], 1, None, None),        # over 32K, decode
    ("k4v4", 128, 4, 64, [32800], 4, "causal", None),         # over 32K, short speculative window
    ("bf16", 64, 1, 256, [33001], 2, None, 4096),             # over 32K, sliding window
    ("k4v4-rot-f16", 128, 4, 16, [4099], 1, None, None),      # float16 queries, decode
    ("k8v8-f16", 128, 8, 64, [1500, 700], 2, "causal", None), # float16, group 32, 16 rows
]

SOAK_AXES = dict(
    layout=list(LAYOUTS),
    head_dim=[64, 128, 256],
    gqa=[1, 4, 8],
    block_size=[16, 64, 256],
    contexts=[[1], [17], [255, 1000], [4097], [33000]],
    num_queries=[1, 2, 5, 8],
    masking=[(None, None), ("causal", None), (None, 100)],
)


def soak_rows(count: int = 400, seed: int = 1):
    """A seeded sample of the full product (the product has ~60k rows)."""
    rng = random.Random(seed)
    product = list(itertools.product(*SOAK_AXES.values()))
    for layout, dim, gqa, block, contexts, queries, (mask, window) in rng.sample(product, count):
        yield (layout, dim, gqa, block, contexts, queries, mask, window)


ROWS = TABLE + (list(soak_rows()) if SOAK else [])


def row_id(row) -> str:
    layout, dim, gqa, block, contexts, queries, mask, window = row
    return f"{layout}-d{dim}-g{gqa}-b{block}-T{'_'.join(map(str, contexts))}-L{queries}-{mask}-w{window}"


def run(case, impl, **options):
    return paged_attention(
        case.queries, case.planes, case.block_tables, case.context_lens, case.layout,
        impl=impl, **options,
    )


def case_call(case, **options) -> PagedAttentionCall:
    return PagedAttentionCall(case.queries, case.planes, case.block_tables, case.context_lens,
                              case.layout, **options)


def max_error(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_matches_reference(impl, row):
    require(impl)
    layout, dim, gqa, block, contexts, queries, mask, window = row
    if any(length < queries for length in contexts):
        pytest.skip("fewer history tokens than queries")
    case = make_case(layout, head_dim=dim, n_kv_heads=2, gqa=gqa, block_size=block,
                     context_lens=contexts, num_queries=queries, seed=hash(row_id(row)) % 1000)
    options = dict(scale=dim**-0.5, mask=mask, window=window)
    expected = run(case, "reference", **options)
    got = run(case, impl, partition_tokens=256, **options)
    mx.eval(expected, got)
    assert got.shape == expected.shape and got.dtype == case.queries.dtype
    assert not mx.isnan(got).any().item()
    assert max_error(got, expected) <= TOLERANCE[case.queries.dtype]


# The GPU kernels' split-K partials each sum thousands of tokens at long contexts (B=1 with
# 8 KV heads at 128K: 33 splits of ~4K tokens; B=4 at 64K: 8 splits of ~8K). Averaged over
# that many random values the output is small (~1/sqrt(T) of a value), so the absolute
# tolerance above cannot see rounding that accumulates along a split: these rows check the
# relative L2 error against the reference. (An earlier tensor-core kernel that left the codes'
# 1024 bias in its fp32 accumulators measured 2.6e-2 against exact attention at 128K, of
# which 8-bit quantization is ~1e-2.)
LONG_SPLITS = [("k8v8-f16", [131072]), ("k4v4-rot-f16", [65536] * 4)]


@pytest.mark.parametrize("impl", [name for name in IMPLS if name in ("cuda", "metal")] or ["cuda"])
@pytest.mark.parametrize("layout,contexts", LONG_SPLITS, ids=["k8v8-f16-128K", "k4v4-rot-f16-4x64K"])
def test_long_splits_keep_relative_precision(impl, layout, contexts):
    require(impl)
    case = make_case(layout, head_dim=128, n_kv_heads=8, gqa=4, block_size=16,
                     context_lens=contexts, num_queries=1)
    expected = run(case, "reference", scale=128**-0.5).astype(mx.float32)
    got = run(case, impl, scale=128**-0.5).astype(mx.float32)
    rel = (mx.sqrt(((got - expected) ** 2).sum()) / mx.sqrt((expected**2).sum())).item()
    assert rel <= 5e-3, f"relative L2 error {rel:.2e} against the reference"


# The tensor-core kernel's shared-memory layouts (kernels/direct._mma_shared_layout): the
# queries in their own space, so the rings' first copies are issued before the query prologue
# (the default where it fits in 48 KB), overlaid on the rings (16 rows per block, or early
# issue turned off), and rings deeper than static shared memory allows (dynamic shared memory,
# which MLX opts the kernel in to). The plan is checked everywhere; the kernel on CUDA.
SHARED_LAYOUTS = [
    # DirectTuning fields over 4 warps, layout, GQA ratio, queries L, expected (queries separate, dynamic)
    ({}, "k4v4-rot-f16", 4, 1, (True, False)),
    ({"mma_early_issue": False}, "k4v4-rot-f16", 4, 1, (False, False)),
    ({"mma_stages": 2}, "k8v8-f16", 8, 2, (False, False)),  # 16 rows per block: no room beside the rings
    ({"mma_stages": 8}, "k4v4-rot-f16", 4, 1, (True, True)),
    ({"mma_warps": 6}, "k4v4-rot-f16", 4, 1, (True, True)),  # the shipped 6 warps: 4 steps need 60 KB
    ({"mma_stages": 8, "mma_sub": 2, "mma_raw": False}, "k8v4-rot", 4, 3, (True, True)),
]


@pytest.mark.parametrize("overrides,layout,gqa,queries,expected", SHARED_LAYOUTS,
                         ids=["separate", "overlaid", "overlaid-16-rows", "dynamic", "dynamic-6-warps", "dynamic-pairs"])
def test_tensor_core_shared_layouts(overrides, layout, gqa, queries, expected):
    from kernels import direct

    tuning = DirectTuning(**{"mma_warps": 4, **overrides})  # explicit: independent of the environment
    case = make_case(layout, head_dim=128, n_kv_heads=2, gqa=gqa, block_size=16,
                     context_lens=[3000, 1100], num_queries=queries)
    options = dict(scale=128**-0.5, mask="causal" if queries > 1 else None)
    plan = direct.plan_launch(case_call(case, **options), tuning, kernel="mma")
    template = dict(plan.split_template)
    assert (template["QSEP"], plan.shared_memory > 0) == expected
    assert template["SMEM"] == plan.shared_memory
    assert plan.shared_memory == 0 or plan.shared_memory > 48000  # where MLX opts in
    if not cuda_available():
        pytest.skip("plan checked; the tensor-core kernel itself runs on CUDA only")
    expected_out = run(case, "reference", **options)
    got = run(case, "cuda", tuning=tuning, **options)
    assert max_error(got, expected_out) <= TOLERANCE[case.queries.dtype]


def dense_truth(case, scale, mask, window) -> np.ndarray:
    """Float64 attention in numpy from the dequantized pages: checks the reference itself."""
    from kernels.paging import gather_pages, prepare_queries

    out = []
    for b, length in enumerate(case.context_lens):
        blocks = case.block_tables[b : b + 1, : math.ceil(length / case.planes[case.layout.plane_names[0]].shape[2])]
        keys, values = gather_pages(case.planes, case.layout, blocks, mx.float32)
        k = np.array(keys[0, :, :length], dtype=np.float64)
        v = np.array(values[0, :, :length], dtype=np.float64)
        q = np.array(prepare_queries(case.queries[b], case.layout), dtype=np.float64)
        rep = q.shape[0] // k.shape[0]
        k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
        scores = scale * q @ k.transpose(0, 2, 1)
        num_queries = q.shape[1]
        pos = length - num_queries + np.arange(num_queries)[:, None]
        keys_at = np.arange(length)[None, :]
        visible = np.ones_like(scores[0], dtype=bool)
        if mask == "causal" or window is not None:
            visible &= keys_at <= pos
        if window is not None:
            visible &= keys_at > pos - window
        scores = np.where(visible, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out.append((weights / weights.sum(-1, keepdims=True)) @ v)
    return np.stack(out)


@pytest.mark.parametrize("row", TABLE[:11], ids=row_id)
def test_reference_matches_float64_truth(row):
    layout, dim, gqa, block, contexts, queries, mask, window = row
    case = make_case(layout, head_dim=dim, n_kv_heads=2, gqa=gqa, block_size=block,
                     context_lens=contexts, num_queries=queries, seed=5)
    got = run(case, "reference", scale=dim**-0.5, mask=mask, window=window)
    truth = dense_truth(case, dim**-0.5, mask, window)
    error = np.abs(np.array(got.astype(mx.float32), dtype=np.float64) - truth).max()
    assert error <= TOLERANCE[case.queries.dtype]


def test_native_reference_is_bit_exact_with_mlx_lm_kvcache():
    """B=1 native pages: the reference equals mlx-lm's KVCache + SDPA with tolerance 0."""
    from mlx_lm.models.cache import KVCache

    if mx.default_device() == mx.gpu:
        pytest.skip("bit-exactness with KVCache is claimed on the CPU only: on the H200, CUDA "
                    "SDPA over KVCache's strided buffer rounded differently (1 bf16 ulp)")

    heads, dim, block = 2, 64, 16
    case = make_case("bf16", head_dim=dim, n_kv_heads=heads, gqa=4, block_size=block,
                     context_lens=[300], num_queries=1, seed=3)
    blocks = case.block_tables[0, : math.ceil(300 / block)]
    keys = case.planes["k"][blocks].transpose(1, 0, 2, 3).reshape(1, heads, -1, dim)[:, :, :300]
    values = case.planes["v"][blocks].transpose(1, 0, 2, 3).reshape(1, heads, -1, dim)[:, :, :300]
    for mask, queries_len in ((None, 1), ("causal", 5)):
        cache = KVCache()
        cache.update_and_fetch(keys[:, :, : 300 - queries_len], values[:, :, : 300 - queries_len])
        k_all, v_all = cache.update_and_fetch(keys[:, :, 300 - queries_len :], values[:, :, 300 - queries_len :])
        queries = mx.random.normal((1, heads * 4, queries_len, dim)).astype(mx.bfloat16)
        expected = mx.fast.scaled_dot_product_attention(queries, k_all, v_all, scale=dim**-0.5, mask=mask)
        got = paged_attention(queries, case.planes, case.block_tables, [300], case.layout,
                              scale=dim**-0.5, mask=mask, impl="reference")
        assert mx.array_equal(got, expected).item()


@pytest.mark.parametrize("impl", IMPLS)
def test_sinks(impl):
    require(impl)
    case = make_case("k8v4", head_dim=64, n_kv_heads=2, gqa=4, block_size=16,
                     context_lens=[90, 33], num_queries=2, seed=9)
    sinks = mx.random.normal((8,)) * 3
    options = dict(scale=0.125, mask="causal", sinks=sinks)
    expected = run(case, "reference", **options)
    assert max_error(run(case, impl, partition_tokens=32, **options), expected) <= TOLERANCE[mx.bfloat16]
    # sinks must matter, or this test proves nothing
    assert max_error(run(case, impl, scale=0.125, mask="causal"), expected) > 0.05


def test_array_mask_falls_back_to_reference():
    case = make_case("k4v4", head_dim=64, n_kv_heads=2, gqa=2, block_size=16, context_lens=[50],
                     num_queries=3, seed=4)
    boolean = mx.random.uniform(shape=(1, 1, 3, 50)) > 0.3
    additive = mx.where(boolean, 0.0, -1e9)
    assert select_impl("partitioned", 3, boolean, case.layout, 64, 64) == "reference"
    a = run(case, None, scale=0.125, mask=boolean)
    b = run(case, None, scale=0.125, mask=additive)
    c = run(case, None, scale=0.125)
    assert max_error(a, b) <= TOLERANCE[mx.bfloat16]
    assert max_error(a, c) > 0.05  # the mask was applied


def test_dispatch(monkeypatch):
    layout = PageLayout(4, 4)
    monkeypatch.delenv(IMPL_ENV, raising=False)
    expected_default = "cuda" if cuda_available() else "metal" if metal_available() else "quantized"
    assert select_impl(None, 1, None, layout, 128, 128) == expected_default
    monkeypatch.setenv(IMPL_ENV, "reference")
    assert select_impl(None, 1, None, layout, 128, 128) == "reference"
    assert select_impl("partitioned", 1, None, layout, 128, 128) == "partitioned"  # argument wins
    monkeypatch.setenv(IMPL_ENV, "bogus")
    with pytest.raises(ValueError):
        select_impl(None, 1, None, layout, 128, 128)
    monkeypatch.delenv(IMPL_ENV)
    for backend, available in (("cuda", cuda_available()), ("metal", metal_available())):
        if available:
            assert select_impl(backend, 1, None, layout, 128, 128) == backend
            # prefill chunks: the history dequantized once, one SDPA (kernels/prefill.py)
            assert select_impl(backend, KERNEL_MAX_QUERIES + 1, None, layout, 128, 128) == "dequantized"
            assert select_impl(backend, 1, None, layout, 128, 64) == "partitioned"
        else:
            with pytest.raises(BackendUnavailable):
                select_impl(backend, 1, None, layout, 128, 128)


def test_partition_size_does_not_change_the_result():
    case = make_case("k8v4-rot", head_dim=64, n_kv_heads=2, gqa=4, block_size=16,
                     context_lens=[700, 311], num_queries=3, seed=2)
    call = case_call(case, scale=0.125, mask="causal")
    outs = [
        partitioned_attention(call, partition_tokens=size)
        for size in (16, 100, 256, 4096)  # 100 rounds up to 112 (7 blocks)
    ]
    for out in outs[1:]:
        assert max_error(out, outs[0]) <= TOLERANCE[mx.bfloat16]


def test_workspace_is_bounded_by_the_partition():
    """On the CPU the partitioned path's workspace is one partition's, whatever the context;
    on a GPU it is priced per partition (kernels/attention.py says why); the kernels' split
    partials stay small either way."""
    layout = PageLayout(4, 4, rotation_seed=1)
    args = dict(n_q_heads=32, n_kv_heads=8, num_queries=1, k_head_dim=128, v_head_dim=128,
                block_size=16, layout=layout, partition_tokens=1024)
    part_1k = workspace_nbytes("partitioned", context_len=1024, **args)
    part_32k = workspace_nbytes("partitioned", context_len=32768, **args)
    part_1m = workspace_nbytes("partitioned", context_len=1 << 20, **args)
    ref_32k = workspace_nbytes("reference", context_len=32768, **args)
    ref_64k = workspace_nbytes("reference", context_len=65536, **args)
    assert ref_64k > 1.9 * ref_32k
    if mx.default_device() == mx.gpu:
        assert part_32k == 32 * part_1k - 31 * (32 * 128 * 4)  # 32 partitions, queries once
    else:
        assert part_32k == part_1m
        assert ref_32k > 20 * part_32k
    for impl in ("cuda", "metal"):
        assert 0 < workspace_nbytes(impl, context_len=1 << 17, **args) < part_1k


def test_rejects_bad_arguments():
    case = make_case("bf16", head_dim=64, n_kv_heads=2, gqa=2, block_size=16, context_lens=[20],
                     num_queries=1)
    with pytest.raises(ValueError):
        run(case, "partitioned", scale=1.0, mask="bogus")
    with pytest.raises(ValueError):
        run(case, "partitioned", scale=1.0, window=0)
    with pytest.raises(ValueError):  # needs 3 blocks, the table has 4 columns of which 2 used
        paged_attention(case.queries, case.planes, case.block_tables, [100], case.layout, scale=1.0)
