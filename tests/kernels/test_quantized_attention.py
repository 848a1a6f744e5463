"""kernels/quantized_attention.py ("quantized", the CPU's packed path) against the reference.

The rows are tests/kernels/test_attention.py's shape table (packed layouts only: native pages
go to "partitioned"), at the same tolerances (max abs error against the reference: float32
2e-4, float16 4e-3, bfloat16 3e-2), with partitions of 256 tokens so that several partitions
merge; plus sinks, dispatch and the workspace price.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from kernels import quantized_attention as quantized_attention_module
from kernels.attention import select_impl, workspace_nbytes
from kernels.call import PagedAttentionCall
from kernels.layout import PageLayout
from kernels.quantized_attention import quantized_attention, serves
from tests.kernels.pages import LAYOUTS, make_case
from tests.kernels.test_attention import TABLE, TOLERANCE, case_call, max_error, row_id, run

PACKED_ROWS = [row for row in TABLE if LAYOUTS[row[0]][0].packed]
# The CPU's path: on MLX 0.32.4 CUDA, mx.quantized_matmul has no implementation for these
# shapes (the error mlx-lm's QuantizedKVCache hits there), and the GPU takes the direct kernels.
pytestmark = pytest.mark.skipif(mx.default_device() == mx.gpu,
                                reason="'quantized' is the CPU's packed path; the GPU runs the direct kernels")


@pytest.mark.parametrize("row", PACKED_ROWS, ids=row_id)
def test_matches_reference(row):
    layout, dim, gqa, block, contexts, queries, mask, window = row
    case = make_case(layout, head_dim=dim, n_kv_heads=2, gqa=gqa, block_size=block,
                     context_lens=contexts, num_queries=queries, seed=hash(row_id(row)) % 1000)
    options = dict(scale=dim**-0.5, mask=mask, window=window)
    expected = run(case, "reference", **options)
    got = run(case, "quantized", partition_tokens=256, **options)
    assert got.shape == expected.shape and got.dtype == case.queries.dtype
    assert not mx.isnan(got).any().item()
    assert max_error(got, expected) <= TOLERANCE[case.queries.dtype]


def test_agrees_with_partitioned_in_float32():
    """Both compute in float32 from the same codes: far tighter than the table's tolerance."""
    case = make_case("k4v4-rot", head_dim=128, n_kv_heads=2, gqa=4, block_size=16,
                     context_lens=[700], num_queries=1, seed=5)
    queries = case.queries.astype(mx.float32)
    args = (queries, case.planes, case.block_tables, case.context_lens, case.layout)
    from kernels.attention import paged_attention
    a = paged_attention(*args, scale=0.088, impl="quantized")
    b = paged_attention(*args, scale=0.088, impl="partitioned")
    assert max_error(a, b) <= 2e-5


@pytest.mark.parametrize("name,queries", [("k4v4-rot", 16), ("k8v4", 64), ("k4v4", 200), ("k8v8-rot", 33)])
def test_prefill_partitions_equal_quantized_matmul(monkeypatch, name, queries):
    """Prefill chunks (DEQUANTIZE_QUERIES or more queries) meet float32 K/V dequantized per
    partition with float32 matmuls; decode steps and small chunks run quantized_matmul over
    the codes. On this CPU the two are bit-identical (tolerance 0, float32 outputs), which
    keeps a prefill's result independent of its chunk sizes (tests/engine/test_packed.py::
    test_prefill_is_chunk_invariant)."""
    case = make_case(name, head_dim=128, n_kv_heads=2, gqa=4, block_size=16,
                     context_lens=[700], num_queries=queries, seed=queries)
    call = PagedAttentionCall(case.queries.astype(mx.float32), case.planes, case.block_tables,
                              case.context_lens, case.layout, scale=0.088, mask="causal")
    dequantized = quantized_attention(call, partition_tokens=256)
    monkeypatch.setattr(quantized_attention_module, "DEQUANTIZE_QUERIES", queries + 1)
    codes = quantized_attention(call, partition_tokens=256)
    assert mx.array_equal(dequantized, codes).item()


def test_sinks_change_the_result_and_match_the_reference():
    case = make_case("k8v4", head_dim=64, n_kv_heads=2, gqa=4, block_size=16,
                     context_lens=[300], num_queries=2, seed=3)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0, 1.0, 3.0, -2.0, 0.25])
    options = dict(scale=0.125, mask="causal", sinks=sinks)
    with_sinks = run(case, "quantized", partition_tokens=64, **options)
    assert max_error(with_sinks, run(case, "reference", **options)) <= TOLERANCE[mx.bfloat16]
    assert max_error(with_sinks, run(case, "quantized", scale=0.125, mask="causal")) > 1e-3


def test_dispatch_and_fallbacks():
    packed, odd_groups = PageLayout(4, 4), PageLayout(8, 8, group_size=16)
    assert serves(packed) and not serves(odd_groups) and not serves(PageLayout())
    assert select_impl("quantized", 1, None, packed, 128, 128) == "quantized"
    assert select_impl("quantized", 1, None, odd_groups, 128, 128) == "partitioned"
    assert select_impl("quantized", 1, None, PageLayout(), 128, 128) == "partitioned"
    assert select_impl("quantized", 1, mx.ones((1, 1, 1, 4), mx.bool_), packed, 128, 128) == "reference"
    case = make_case("k4v4", head_dim=64, n_kv_heads=2, gqa=1, block_size=16, context_lens=[20],
                     num_queries=1)
    with pytest.raises(ValueError):
        quantized_attention(case_call(case, scale=1.0, mask=mx.ones((1, 1, 1, 20), mx.bool_)))


def test_workspace_price_covers_the_measured_peak():
    """Peak active memory of one call above its inputs stays under workspace_nbytes."""
    heads, q_heads, dim, block = 2, 8, 128, 16
    for layout_name, queries, tokens in (("k4v4-rot", 1, 4096), ("k4v4-rot", 1, 16384),
                                         ("k8v4", 64, 2048), ("k8v4", 64, 8192)):
        case = make_case(layout_name, head_dim=dim, n_kv_heads=heads, gqa=q_heads // heads,
                         block_size=block, context_lens=[tokens], num_queries=queries)
        mx.eval(case.queries, case.planes, case.block_tables)
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = run(case, "quantized", scale=dim**-0.5, mask="causal")
        mx.eval(out)
        peak = mx.get_peak_memory() - before - out.nbytes
        price = workspace_nbytes("quantized", q_heads, heads, queries, dim, dim, tokens, block,
                                 case.layout)
        assert 0 < peak <= price, (layout_name, peak, price)
