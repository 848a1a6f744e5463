"""The prefill path ("dequantized", kernels/prefill.py) against the reference over the same
pages, its fresh-token input, its dispatch, and its workspace estimate. Runs everywhere."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kernels import attention
from kernels.attention import paged_attention, select_impl, workspace_nbytes
from kernels.hadamard import unrotate
from kernels.layout import PageLayout
from kernels.paging import clean_block_ids, gather_pages
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


# The CPU's prefill: "quantized" (mx.quantized_matmul over the packed history) with the
# chunk's own K/V in full precision as its last partition.
PACKED_ROWS = [row for row in ROWS if row[0] != "bf16"]


def chunk_as_stored(case, chunk):
    """The chunk's K/V [1, Hkv, L, D] as the pages decode them (float32, keys unrotated)."""
    context = case.context_lens[0]
    block = case.planes[case.layout.plane_names[0]].shape[2]
    ids = clean_block_ids(case.block_tables, case.context_lens, block, 0, -(-context // block))
    keys, values = gather_pages(case.planes, case.layout, ids)
    if case.layout.rotated_keys:
        keys = unrotate(keys, case.layout.rotation_seed)
    return keys[:, :, context - chunk:context], values[:, :, context - chunk:context]


@pytest.mark.parametrize("row", PACKED_ROWS, ids=lambda r: f"{r[0]}-d{r[1]}-T{r[4]}-L{r[5]}")
def test_quantized_fresh_tokens_are_the_chunk_itself(row):
    """Handing "quantized" the chunk's K/V as the pages decode them gives its result from the
    pages (float32 math both ways, one bf16 rounding of the output apart: tolerance 1e-3,
    measured <= 2.5e-4); another chunk's K/V do not (> 1e-2)."""
    layout, dim, gqa, block, context, chunk = row
    case = make_case(layout, head_dim=dim, n_kv_heads=2, gqa=gqa, block_size=block,
                     context_lens=[context], num_queries=chunk, seed=context)
    options = dict(scale=dim ** -0.5, mask="causal")
    paged = run(case, "quantized", **options)
    keys, values = chunk_as_stored(case, chunk)
    assert max_error(run(case, "quantized", fresh=(keys, values), **options), paged) <= 1e-3
    if context > chunk:
        other = chunk_as_stored(make_case(layout, head_dim=dim, n_kv_heads=2, gqa=gqa,
                                          block_size=block, context_lens=[context - 1],
                                          num_queries=chunk, seed=context), chunk)
        assert max_error(run(case, "quantized", fresh=other, **options), paged) > 1e-2


@pytest.mark.parametrize("row", PACKED_ROWS, ids=lambda r: f"{r[0]}-d{r[1]}-T{r[4]}-L{r[5]}")
@pytest.mark.parametrize("sinks", [False, True])
def test_quantized_prefill_matches_dequantized_prefill(row, sinks):
    """Both read the same history codes and the same exact chunk K/V; "quantized" computes
    in float32, "dequantized" in the model dtype: the bf16 tolerance of the kernel table."""
    layout, dim, gqa, block, context, chunk = row
    case = make_case(layout, head_dim=dim, n_kv_heads=2, gqa=gqa, block_size=block,
                     context_lens=[context], num_queries=chunk, seed=context)
    mx.random.seed(context + 1)
    fresh = (mx.random.normal((1, 2, chunk, dim)).astype(mx.bfloat16),
             mx.random.normal((1, 2, chunk, dim)).astype(mx.bfloat16))
    options = dict(scale=dim ** -0.5, mask="causal", fresh=fresh,
                   sinks=mx.linspace(-1, 1, 2 * gqa).astype(case.queries.dtype) if sinks else None)
    got = run(case, "quantized", **options)
    assert got.shape == case.queries.shape and got.dtype == case.queries.dtype
    assert max_error(got, run(case, "dequantized", **options)) <= TOLERANCE[case.queries.dtype]


def test_only_prefill_chunks_take_fresh_tokens_on_the_quantized_path():
    """More than 8 queries: the fresh K/V are attended (the result moves); up to 8 (decode
    and the kernels' range): they are ignored, every token is read from the pages
    (tolerance 0 against no fresh K/V)."""
    for chunk, moves in ((9, True), (8, False), (1, False)):
        case = make_case("k4v4", head_dim=64, n_kv_heads=2, gqa=2, block_size=16,
                         context_lens=[100], num_queries=chunk)
        fresh = tuple(mx.zeros((1, 2, chunk, 64), dtype=mx.bfloat16) for _ in range(2))
        options = dict(scale=0.125, mask="causal")
        error = max_error(run(case, None, fresh=fresh, **options), run(case, None, **options))
        assert (error > 0) == moves, (chunk, error)


@pytest.mark.parametrize("name", ["k8v8", "k8v4", "k4v4"])
@pytest.mark.parametrize("rotate", [True, False])
def test_cpu_prefill_and_decode_over_the_same_pages_agree(monkeypatch, name, rotate):
    """The CPU's default path (impl None: "quantized"): a prefill chunk with its own K/V in
    full precision (handed over by the routed update) and the decode path's reading of the
    same pages are each within the format's tolerance of exact attention and of each other
    (tests/engine/test_packed.py's OUTPUT_TOLERANCE)."""
    from engine import BlockPool, PagedKVCache, PageSpec
    from engine.attention import attend
    from engine.cache import ROUTED_MODULES
    from engine.formats import FORMATS
    from tests.engine.test_packed import DIM, HEADS, OUTPUT_TOLERANCE, SCALE, outlier_data, relative

    queries, keys, values = outlier_data(3)
    chunk = 16
    queries = mx.concatenate([queries] * (chunk // queries.shape[2]), axis=2)
    spec = PageSpec(FORMATS[name], HEADS, DIM, DIM, 16, 64, 0 if rotate else None)
    cache = PagedKVCache(BlockPool(spec, 4), attention_impl=None)
    monkeypatch.delenv(attention.IMPL_ENV, raising=False)
    monkeypatch.setitem(ROUTED_MODULES, "a routed model module", 1)  # as engine.install does
    cache.routed_by = ("a routed model module",)
    cache.update_and_fetch(keys[:, :, :-chunk], values[:, :, :-chunk])
    cache.update_and_fetch(keys[:, :, -chunk:], values[:, :, -chunk:])
    assert select_impl(None, chunk, "causal", spec.layout, DIM, DIM) == "quantized"
    prefill = attend(cache, queries, scale=SCALE, mask="causal")  # takes the fresh K/V
    from_pages = attend(cache, queries, scale=SCALE, mask="causal")  # nothing left to take
    cache.attention_impl = "reference"
    decode = attend(cache, queries, scale=SCALE, mask="causal")
    exact = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=SCALE, mask="causal")
    tolerance = OUTPUT_TOLERANCE[name][0 if rotate else 1]
    assert relative(prefill, from_pages) > 0  # the chunk's own tokens were exact in prefill
    for got in (prefill, decode):
        assert relative(got, exact) < tolerance, (relative(prefill, exact), relative(decode, exact))
    assert 0 < relative(prefill, decode) < tolerance


@pytest.mark.parametrize("layout", ["k4v4-rot", "k8v8"])
def test_quantized_prefill_workspace_estimate_covers_the_measured_peak(layout):
    """A CPU prefill chunk (dequantized partitions, the chunk's own K/V): peak active
    memory above inputs and output within what admission prices for "quantized"."""
    case = make_case(layout, head_dim=128, n_kv_heads=2, gqa=4, block_size=16,
                     context_lens=[2048], num_queries=256)
    fresh = tuple(mx.random.normal((1, 2, 256, 128)).astype(mx.bfloat16) for _ in range(2))
    mx.eval(fresh)
    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = run(case, "quantized", scale=128 ** -0.5, mask="causal", fresh=fresh)
    mx.eval(out)
    measured = mx.get_peak_memory() - before - out.nbytes
    estimate = workspace_nbytes("quantized", 8, 2, 256, 128, 128, 2048, 16, case.layout)
    assert 0 < measured <= estimate, (measured, estimate)
