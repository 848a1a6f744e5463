"""The tensor-core kernel for native fp16/bf16 pages (kernels/cuda_mma_native_split.cu) and the
tensor-core kernel under __launch_bounds__ (DirectTuning.mma_min_blocks): which calls the
planner gives them (everywhere), and their output against the reference (CUDA only; the
tolerances of test_attention.py)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from kernels import direct
from kernels.attention import cuda_available, paged_attention
from kernels.call import PagedAttentionCall
from kernels.tuning import DirectTuning
from tests.kernels.pages import make_case
from tests.kernels.test_attention import TOLERANCE, max_error

NATIVE = DirectTuning()  # native_mma: the default

# Columns: layout, head_dim, GQA ratio, block size, context lengths, queries L, mask, window.
NATIVE_ROWS = [
    ("bf16", 128, 4, 16, [1], 1, None, None),                  # one token: a split's only step is partial
    ("bf16", 128, 1, 16, [17], 1, None, None),                 # MHA: 1 row of 8; partial second step
    ("f16", 64, 8, 64, [200, 64], 4, "causal", None),          # fp16, 32 rows: 16-row blocks, batch
    ("bf16", 256, 4, 16, [300], 1, None, None),                # head dim 256 (8-row blocks)
    ("bf16", 64, 1, 256, [33001], 2, None, 4096),              # window over 32K, block 256
    ("bf16", 128, 4, 16, [4099, 17], 3, "causal", None),       # 12 rows, unequal lengths
    ("f16", 128, 8, 128, [32768], 1, None, None),              # long splits, block 128 (the engine's)
]
NATIVE_TUNINGS = [NATIVE, replace(NATIVE, native_warps=8, native_stages=2),
                  replace(NATIVE, native_stages=2, native_target_blocks=396)]


def native_call(row, seed=0):
    layout, dim, gqa, block, contexts, queries, mask, window = row
    case = make_case(layout, head_dim=dim, n_kv_heads=2, gqa=gqa, block_size=block,
                     context_lens=contexts, num_queries=queries, seed=seed)
    return case, dict(scale=dim**-0.5, mask=mask, window=window)


def test_native_mma_serves_what_it_can_read():
    k = dict(k_head_dim=128, v_head_dim=128)
    case, _ = native_call(NATIVE_ROWS[0])
    plain, rotated = case.layout, replace(case.layout, rotation_seed=3)
    assert direct.native_mma_serves(plain, **k, query_dtype=mx.bfloat16, page_dtype=mx.bfloat16,
                                    block_size=16, tuning=NATIVE)
    refused = [
        (plain, mx.bfloat16, mx.bfloat16, 16, DirectTuning(native_mma=False)),  # turned off
        (rotated, mx.bfloat16, mx.bfloat16, 16, NATIVE),   # rotated keys: the lane-group kernel
        (plain, mx.float32, mx.float32, 16, NATIVE),       # float32 keeps float32 math
        (plain, mx.float16, mx.bfloat16, 16, NATIVE),      # queries of another type
        (plain, mx.bfloat16, mx.bfloat16, 8, NATIVE),      # a 16-token step spans two blocks
    ]
    # rings of two steps must fit: at D = 256, 8 warps would need 256 KB of shared memory
    assert not direct.native_mma_serves(plain, 256, 256, mx.bfloat16, mx.bfloat16, 16,
                                        replace(NATIVE, native_warps=8))
    assert direct.native_mma_serves(plain, 256, 256, mx.bfloat16, mx.bfloat16, 16, NATIVE)
    for layout, query_dtype, page_dtype, block, tuning in refused:
        assert not direct.native_mma_serves(layout, **k, query_dtype=query_dtype, page_dtype=page_dtype,
                                            block_size=block, tuning=tuning)


@pytest.mark.parametrize("tuning", NATIVE_TUNINGS, ids=["4w3s", "8w2s", "4w2s-396"])
def test_native_mma_plan(tuning):
    case, options = native_call(NATIVE_ROWS[2])
    call = PagedAttentionCall(case.queries, case.planes, case.block_tables, case.context_lens, case.layout, **options)
    plan = direct.plan_launch(call, tuning, kernel="mma_native")
    template = dict(plan.split_template)
    assert plan.kernel == "mma_native" and plan.threads == 32 * tuning.native_warps
    assert template["ROWS16"] and plan.grid_y == 2 * 2  # 32 rows per KV head: two 16-row chunks
    assert template["CAUSAL"] and template["KvT"] == mx.float16
    slot = 2 * 16 * 64 * 2
    assert template["SMEM"] == plan.shared_memory >= template["STAGES"] * tuning.native_warps * slot
    assert plan.shared_memory > 48000  # MLX opts the kernel in to its dynamic shared memory
    # kernels/attention.py picks it for CUDA calls (direct.cuda_kernel_for); the planner plans
    # the kernel it is asked for (the Metal port asks for "lane")
    assert direct.cuda_kernel_for(call, tuning) == "mma_native"
    assert direct.plan_launch(call, tuning, kernel="lane").kernel == "lane"


def test_launch_bounds_reach_the_plan():
    case = make_case("k4v4-rot", head_dim=128, n_kv_heads=2, gqa=4, block_size=16,
                     context_lens=[3000], num_queries=1)
    call = PagedAttentionCall(case.queries.astype(mx.bfloat16), case.planes, case.block_tables,
                              case.context_lens, case.layout, scale=128**-0.5)
    plan = direct.plan_launch(call, DirectTuning(mma_warps=8, mma_min_blocks=2), kernel="mma")
    assert (plan.min_blocks, plan.threads) == (2, 256)
    assert direct.plan_launch(call, DirectTuning(), kernel="mma").min_blocks == 0
    with pytest.raises(ValueError):
        DirectTuning(mma_min_blocks=-1)
    with pytest.raises(ValueError):
        DirectTuning(native_stages=1)


def require_cuda():
    if not cuda_available():
        pytest.skip("CUDA is not available: mx.cuda.is_available() is False or the default device is the CPU")


def run(case, options, impl, tuning=None):
    return paged_attention(case.queries, case.planes, case.block_tables, case.context_lens, case.layout,
                           impl=impl, tuning=tuning, **options)


@pytest.mark.parametrize("tuning", NATIVE_TUNINGS, ids=["4w3s", "8w2s", "4w2s-396"])
@pytest.mark.parametrize("row", NATIVE_ROWS, ids=lambda row: f"{row[0]}-d{row[1]}-g{row[2]}-b{row[3]}-T{row[4][0]}-L{row[5]}")
def test_native_mma_matches_reference(row, tuning):
    require_cuda()
    case, options = native_call(row, seed=len(row[4]) + row[1])
    call = PagedAttentionCall(case.queries, case.planes, case.block_tables, case.context_lens, case.layout, **options)
    # D = 256 with 8 warps: two ring steps per warp do not fit in shared memory (the lane-group
    # kernel serves it; its launch failed on the H200 before native_mma_serves said so)
    fits = tuning.native_warps * 2 * direct.native_slot_nbytes(row[1]) <= direct.NATIVE_SHARED_BYTES
    assert direct.cuda_kernel_for(call, tuning) == ("mma_native" if fits else "lane")
    expected = run(case, options, "reference")
    got = run(case, options, "cuda", tuning)
    assert max_error(got, expected) <= TOLERANCE[case.queries.dtype]


@pytest.mark.parametrize("tuning", [DirectTuning(mma_warps=8, mma_min_blocks=2),
                                    DirectTuning(mma_warps=4, mma_min_blocks=4, mma_target_blocks=528)],
                         ids=["8w-2blocks", "4w-4blocks"])
@pytest.mark.parametrize("layout,contexts,queries", [("k4v4-rot", [4099], 1), ("k8v4-rot", [2049, 9], 3),
                                                     ("k4v4-rot-f16", [65536], 1)])
def test_launch_bounds_match_reference(layout, contexts, queries, tuning):
    require_cuda()
    case = make_case(layout, head_dim=128, n_kv_heads=8, gqa=4, block_size=16, context_lens=contexts,
                     num_queries=queries)
    queries_in = case.queries.astype(mx.bfloat16) if case.queries.dtype == mx.float32 else case.queries
    case = replace(case, queries=queries_in)
    options = dict(scale=128**-0.5, mask="causal" if queries > 1 else None, window=None)
    expected = run(case, options, "reference").astype(mx.float32)
    got = run(case, options, "cuda", tuning).astype(mx.float32)
    assert max_error(got, expected) <= TOLERANCE[case.queries.dtype]
    rel = (mx.sqrt(((got - expected) ** 2).sum()) / mx.sqrt((expected**2).sum())).item()
    assert rel <= 5e-3, f"relative L2 error {rel:.2e} against the reference"
