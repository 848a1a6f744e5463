"""The prefill path ("dequantized", kernels/prefill.py) against the reference over the same
pages, its fresh-token input (native pages only: packed chunks are read back from their
pages), its dispatch, and its workspace estimate. Runs everywhere."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kernels import attention, quantize
from kernels.attention import paged_attention, select_impl, workspace_nbytes
from kernels.layout import PageLayout
from kernels.paging import clean_block_ids, gather_pages
from kernels.prefill import dequantized_pages
from tests.kernels.pages import make_case
from tests.kernels.test_attention import TOLERANCE, max_error

# (layout, head dim, gqa, block size, context, chunk): history of context - chunk tokens,
# rotated and unrotated packed layouts, native bf16, a partial last block, a chunk that
# is the whole context
ROWS = [
    ("bf16", 64, 2, 16, 300, 16),
    ("k8v8", 128, 4, 16, 300, 64),
    ("k8v4", 64, 1, 32, 257, 9),
    ("k4v4", 128, 2, 16, 520, 32),
    ("k4v4-rot", 128, 4, 16, 333, 48),
    ("k8v8-rot", 64, 2, 64, 130, 130),
]


def run(case, impl, **options):
    return paged_attention(case.queries, case.planes, case.block_tables, case.context_lens,
                           case.layout, impl=impl, **options)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"{r[0]}-d{r[1]}-T{r[4]}-L{r[5]}")
@pytest.mark.parametrize("sinks", [False, True])
def test_dequantized_matches_reference_over_the_same_pages(row, sinks):
    """Both dequantize the same codes; the prefill path computes in the model dtype (bf16
    here), the reference in float32: the bf16 tolerance of the kernel table holds."""
    layout, dim, gqa, block, context, chunk = row
    case = make_case(layout, head_dim=dim, n_kv_heads=2, gqa=gqa, block_size=block,
                     context_lens=[context], num_queries=chunk, seed=context)
    options = dict(scale=dim ** -0.5, mask="causal",
                   sinks=mx.linspace(-1, 1, 2 * gqa).astype(case.queries.dtype) if sinks else None)
    expected = run(case, "reference", **options)
    got = run(case, "dequantized", **options)
    assert got.shape == expected.shape and got.dtype == case.queries.dtype
    assert max_error(got, expected) <= TOLERANCE[case.queries.dtype]
    if sinks:  # the sinks reached the SDPA
        assert max_error(got, run(case, "dequantized", scale=dim ** -0.5, mask="causal")) > 0


def test_fresh_tokens_are_the_chunk_itself():
    """Handing in the chunk's own K/V as stored gives the result of reading them from the
    pages (native bf16: the same values, tolerance 0); K/V of other tokens do not."""
    case = make_case("bf16", head_dim=64, n_kv_heads=2, gqa=2, block_size=16, context_lens=[300],
                     num_queries=20)
    ids = clean_block_ids(case.block_tables, case.context_lens, 16, 0, 19)
    keys, values = gather_pages(case.planes, case.layout, ids)
    options = dict(scale=0.125, mask="causal")
    paged = run(case, "dequantized", **options)
    fresh = run(case, "dequantized", fresh=(keys[:, :, 280:300], values[:, :, 280:300]), **options)
    assert max_error(fresh, paged) == 0
    shifted = run(case, "dequantized", fresh=(keys[:, :, 279:299], values[:, :, 279:299]), **options)
    assert max_error(shifted, paged) > 0


@pytest.mark.parametrize("name", ["k4v4-rot", "k8v4", "k8v8"])
def test_packed_pages_read_the_chunk_back_whatever_fresh_says(name):
    """Packed pages never attend to the chunk's K/V as handed in: the output with the
    chunk's exact (unquantized) K/V, or with any other arrays, is the output read from
    the pages (tolerance 0), so a packed chunk sees what every later reader sees."""
    case = make_case(name, head_dim=128, n_kv_heads=2, gqa=2, block_size=16, context_lens=[300],
                     num_queries=20)
    options = dict(scale=128 ** -0.5, mask="causal")
    paged = run(case, "dequantized", **options)
    rng = mx.random.key(5)
    exact = (mx.random.normal((1, 2, 20, 128), key=rng).astype(case.queries.dtype),) * 2
    assert mx.array_equal(run(case, "dequantized", fresh=exact, **options), paged).item()


# (layout, head dim, block size, context, model dtype): 4- and 8-bit halves, rotated keys,
# a partial last block, blocks in shuffled pool order (make_case shuffles them)
DEQUANTIZE_ROWS = [
    ("k4v4-rot", 128, 16, 520, mx.bfloat16),
    ("k8v4", 64, 32, 257, mx.float16),
    ("k8v8", 128, 128, 300, mx.float32),
    ("k4v4", 64, 16, 130, mx.bfloat16),
]


@pytest.mark.skipif(not quantize.cuda_available(),
                    reason="kernels/dequantize.cu needs a CUDA GPU (the H200 run: "
                           "KVSTORE_TEST_IMPLS=cuda python3 -m pytest tests/kernels/test_prefill.py)")
@pytest.mark.parametrize("row", DEQUANTIZE_ROWS, ids=lambda r: f"{r[0]}-d{r[1]}-b{r[2]}-T{r[3]}")
def test_cuda_dequantize_is_bit_identical_to_the_reference(row):
    """kernels/dequantize.cu against paging.gather_pages over the same blocks: the same
    values bit for bit (tolerance 0), in every model dtype it writes."""
    name, dim, block, context, dtype = row
    case = make_case(name, head_dim=dim, n_kv_heads=2, gqa=2, block_size=block,
                     context_lens=[context], num_queries=4, seed=context)
    ids = clean_block_ids(case.block_tables, case.context_lens, block, 0, -(-context // block))
    expected = dequantized_pages(case.planes, case.layout, ids, dtype, impl="reference")
    got = dequantized_pages(case.planes, case.layout, ids, dtype, impl="cuda")
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype
        assert mx.array_equal(a, b).item()


def test_prefill_chunks_on_a_gpu_take_the_dequantized_path(monkeypatch):
    monkeypatch.setattr(attention, "cuda_available", lambda: True)
    monkeypatch.delenv(attention.IMPL_ENV, raising=False)
    layout = PageLayout(4, 4, rotation_seed=3)
    assert select_impl("cuda", 16, "causal", layout, 128, 128) == "dequantized"
    assert select_impl("cuda", 8, "causal", layout, 128, 128) == "cuda"
    assert select_impl("partitioned", 16, "causal", layout, 128, 128) == "partitioned"  # CPU default


def test_a_window_falls_back_to_partitioned():
    case = make_case("k8v8", head_dim=64, n_kv_heads=2, gqa=2, block_size=16, context_lens=[200],
                     num_queries=12)
    options = dict(scale=0.125, mask="causal", window=50)
    assert max_error(run(case, "dequantized", **options), run(case, "partitioned", **options)) == 0


@pytest.mark.parametrize("layout", [PageLayout(4, 4, rotation_seed=1), PageLayout()])
def test_workspace_estimate_covers_the_measured_peak(layout):
    """Peak active memory above inputs and output, measured on this device, within the
    estimate admission prices (engine/pricing.py reads it through select_impl)."""
    name = "k4v4-rot" if layout.packed else "bf16"
    case = make_case(name, head_dim=128, n_kv_heads=2, gqa=4, block_size=16, context_lens=[2048],
                     num_queries=256)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = run(case, "dequantized", scale=128 ** -0.5, mask="causal")
    mx.eval(out)
    measured = mx.get_peak_memory() - before - out.nbytes
    estimate = workspace_nbytes("dequantized", 8, 2, 256, 128, 128, 2048, 16, layout)
    assert 0 < measured <= estimate, (measured, estimate)
