"""Packed page formats: attention error against an FP32 reference on keys with a few
large outlier channels, with and without the signed Hadamard key rotation.

Data: 2 KV heads, 4 query heads, head_dim 128, 256 tokens of history, 4 queries; keys
standard normal with 4 of 128 channels scaled by 20 (the outlier pattern real models
show in K); values standard normal; queries normal * 0.3 (score spread of a few units,
so the softmax is neither flat nor one-hot). Errors are relative Frobenius norms.
Rotation seed 0, the policy default.

Tolerances (measured over data seeds 0-3 and rotation seeds 0, 5, 123, then given
~1.3x headroom over the worst case; tight enough that a broken codec, queries left
unrotated against rotated keys, or a second quantization fails them):
  output error      rotated    unrotated     (measured worst: rotated / unrotated)
    k8v8            0.015      0.025         0.009 / 0.016
    k8v4            0.12       0.13          0.093 / 0.095
    k4v4            0.25       0.50          0.19  / 0.39
  key error         rotated    unrotated
    8-bit keys      0.006      0.012         0.004 / 0.010
    4-bit keys      0.09       0.2           0.075 / 0.170
  value error: 0.007 for 8-bit values, 0.1 for 4-bit values (measured 0.005 / 0.09).
  k4v4 key error: rotation cuts it at least 2x (measured 0.170 -> 0.074, 2.3x).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

import engine
from engine import BlockPool, KVPolicy, PagedKVCache, PageSpec, make_cache
from engine.attention import attend
from engine.cache import ROUTED_MODULES
from engine.formats import FORMATS
from kernels.attention import KERNEL_MAX_QUERIES
from tests.engine.factories import prompt_tokens, tiny_model

HEADS, DIM, TOKENS = 2, 128, 256
SCALE = DIM**-0.5
OUTPUT_TOLERANCE = {  # (rotated, unrotated)
    "k8v8": (0.015, 0.025),
    "k8v4": (0.12, 0.13),
    "k4v4": (0.25, 0.50),
}


def outlier_data(seed=0):
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((1, HEADS, TOKENS, DIM)).astype(np.float32)
    keys[..., [3, 17, 70, 101]] *= 20.0
    values = rng.standard_normal((1, HEADS, TOKENS, DIM)).astype(np.float32)
    queries = (rng.standard_normal((1, 2 * HEADS, 4, DIM)) * 0.3).astype(np.float32)
    return mx.array(queries), mx.array(keys), mx.array(values)


def relative(x, ref):
    return (mx.linalg.norm((x - ref).reshape(-1)) / mx.linalg.norm(ref.reshape(-1))).item()


def packed_cache(name, rotate, keys, values, impl="reference"):
    spec = PageSpec(FORMATS[name], HEADS, DIM, DIM, 16, 64, 0 if rotate else None)
    cache = PagedKVCache(BlockPool(spec, 4), attention_impl=impl)
    cache.update_and_fetch(keys, values)
    return cache


def errors(name, rotate, seed=0):
    queries, keys, values = outlier_data(seed)
    reference = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=SCALE)
    cache = packed_cache(name, rotate, keys, values)
    decoded_keys, decoded_values = cache.keys_and_values(mx.float32)
    out = attend(cache, queries, scale=SCALE)
    return (relative(out, reference), relative(decoded_keys, keys),
            relative(decoded_values, values))


@pytest.mark.parametrize("name", sorted(OUTPUT_TOLERANCE))
@pytest.mark.parametrize("rotate", [True, False])
def test_attention_error_against_fp32_reference(name, rotate):
    out_error, key_error, value_error = errors(name, rotate)
    tolerance = OUTPUT_TOLERANCE[name][0 if rotate else 1]
    assert out_error < tolerance, (name, rotate, out_error)
    assert out_error > 0  # the data really was quantized
    key_tolerance = {(True, 4): 0.09, (False, 4): 0.2, (True, 8): 0.006, (False, 8): 0.012}
    assert key_error < key_tolerance[rotate, FORMATS[name].k_bits], key_error
    assert value_error < (0.1 if name.endswith("v4") else 0.007)


@pytest.mark.parametrize("seed", [0, 1])
def test_rotation_cuts_k4v4_key_error_at_least_2x(seed):
    _, rotated, _ = errors("k4v4", True, seed)
    _, plain, _ = errors("k4v4", False, seed)
    assert plain / rotated >= 2.0, (plain, rotated)
    out_rotated, _, _ = errors("k4v4", True, seed)
    out_plain, _, _ = errors("k4v4", False, seed)
    assert out_rotated < out_plain


# float32 matmuls are float32 on the CPU and with MLX_ENABLE_TF32=0; on a GPU MLX runs them
# as TF32 by default (10-bit significand). Measured on the H200 (tools/bench/profile/
# issue22_prefill.py arms): a 256x256 float32 matmul 2.9e-4 from float64 with TF32, 1.5e-7
# without; these two arms 1.7e-4 to 9.1e-4 apart with TF32, 3.9e-7 to 4.1e-6 without.
FULL_FP32 = mx.default_device() == mx.cpu or os.environ.get("MLX_ENABLE_TF32") == "0"
ARMS_TOLERANCE = 1e-5 if FULL_FP32 else 2e-3


@pytest.mark.parametrize("name", ["k8v4", "k4v4", "native-f32"])
def test_gathered_and_partitioned_arms_agree(name):
    """The reference (gather, one SDPA) and the partitioned path (codes scored partition by
    partition) over the same pages, both float32: 1e-5 relative where float32 matmuls are
    full precision, TF32's 2e-3 where the GPU rounds their operands (ARMS_TOLERANCE)."""
    queries, keys, values = outlier_data(3)
    rotate = FORMATS[name].packed
    spec = PageSpec(FORMATS[name], HEADS, DIM, DIM, 16, 64, 5 if rotate else None)
    cache = PagedKVCache(BlockPool(spec, 4), attention_impl="reference")
    cache.update_and_fetch(keys, values)
    gathered = attend(cache, queries, scale=SCALE)
    cache.attention_impl = "partitioned"
    partitioned = attend(cache, queries, scale=SCALE)
    assert relative(partitioned, gathered) < ARMS_TOLERANCE


@pytest.mark.parametrize("name", ["k8v8", "k4v4"])
def test_packed_generation_through_a_model(name, paged_calls):
    """A packed cache drives a real mlx-lm model; its logits stay near native."""
    model = tiny_model("qwen3", mx.bfloat16)
    prompt = prompt_tokens(40, seed=8)
    native = make_cache(model, KVPolicy(block_size_tokens=16))
    packed = make_cache(model, KVPolicy(default_format=name, block_size_tokens=16))
    assert packed[0].spec.rotation_seed == 0 and packed[0].attention_impl is None
    with engine.installed(model):
        a = model(prompt[None], cache=native)[0].astype(mx.float32)
        b = model(prompt[None], cache=packed)[0].astype(mx.float32)
        for token in prompt_tokens(8, seed=9):
            a2 = model(token[None, None], cache=native)[0].astype(mx.float32)
            b2 = model(token[None, None], cache=packed)[0].astype(mx.float32)
    # the packed layers attended through the kernels' dispatch, as the cache resolved it
    assert paged_calls and packed[0].default_impl in paged_calls
    limit = {"k8v8": 0.05, "k4v4": 0.5}[name]
    assert relative(b, a) < limit and relative(b2, a2) < limit
    assert packed[0].nbytes < native[0].nbytes


@pytest.mark.parametrize("name", sorted(OUTPUT_TOLERANCE))
@pytest.mark.parametrize("rotate", [True, False])
def test_prefill_and_decode_over_the_same_pages_agree(monkeypatch, name, rotate):
    """A prefill chunk attended the dequantized way (the GPU's prefill path: the pages of
    every token, the chunk's own included, dequantized once) reads exactly what a later
    reading of the same pages reads (tolerance 0: the routed update keeps no full-precision
    copy of a packed chunk), and it and the decode path's reading (the reference here) are
    each within the format's tolerance of exact attention, and of each other."""
    queries, keys, values = outlier_data(3)
    chunk = 16
    queries = mx.concatenate([queries] * (chunk // queries.shape[2]), axis=2)
    spec = PageSpec(FORMATS[name], HEADS, DIM, DIM, 16, 64, 0 if rotate else None)
    cache = PagedKVCache(BlockPool(spec, 4), attention_impl="dequantized")
    monkeypatch.setitem(ROUTED_MODULES, "a routed model module", 1)  # as engine.install does
    cache.routed_by = ("a routed model module",)
    cache.update_and_fetch(keys[:, :, :-chunk], values[:, :, :-chunk])
    cache.update_and_fetch(keys[:, :, -chunk:], values[:, :, -chunk:])
    assert cache.take_fresh_tokens(chunk) is None  # packed: no exact copy of the chunk kept
    cache.update_and_fetch(keys[:, :, :0], values[:, :, :0])  # offset unchanged
    prefill = attend(cache, queries, scale=SCALE, mask="causal")
    from_pages = attend(cache, queries, scale=SCALE, mask="causal")
    cache.attention_impl = "reference"
    decode = attend(cache, queries, scale=SCALE, mask="causal")
    exact = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=SCALE, mask="causal")
    tolerance = OUTPUT_TOLERANCE[name][0 if rotate else 1]
    assert mx.array_equal(prefill, from_pages).item()
    for got in (prefill, decode):
        assert relative(got, exact) < tolerance, (relative(prefill, exact), relative(decode, exact))
    assert relative(prefill, decode) < tolerance  # float32 queries here: 0 on the CPU


# (cuts of a 300-token prompt into prefill chunks): one chunk, a block-aligned cut, cuts
# inside blocks, and chunks of at most 8 queries (the direct kernels' calls on a GPU)
CHUNKINGS = [(300,), (96, 300), (37, 150, 300), (8, 13, 21, 300)]
# (format, rotated keys)
INVARIANT_FORMATS = [("k8v8", True), ("k8v4", True), ("k4v4", True), ("k4v4", False),
                     ("native-bf16", False)]
ON_GPU = mx.default_device() == mx.gpu
# Measured on the H200 (tools/bench/profile/issue22_prefill_h200.sh, 2026-12-02): every
# rotated packed format, on "dequantized" and on the default dispatch, differed from the
# one-chunk prefill at the cuts (37, 150, 300) by the same 0.00195 (one bf16 step of the
# output; the block-aligned cut (96, 300) was identical, and so were native pages at every
# cut). The same difference for three codecs points at the queries' rotation (a float32
# matmul, TF32 on that GPU, whose kernel is picked by the row count) rather than at the
# pages; not yet confirmed there. Unrotated packed pages were not run on the GPU.
ROTATED_ON_GPU = pytest.mark.xfail(
    ON_GPU, strict=False,
    reason="on a GPU the float32 rotation matmul's rows may depend on the chunk's row count "
           "(measured on the H200: 0.00195 at cuts inside blocks); issue 22")


def _prefill_outputs(name, rotate, cuts, impl, monkeypatch, keys, values, queries):
    """Per-position attention outputs [1, Hq, T, D] of a routed cache fed the same K/V in
    the given chunks."""
    spec = PageSpec(FORMATS[name], HEADS, DIM, DIM, 16, 64, 0 if rotate else None)
    cache = PagedKVCache(BlockPool(spec, 24), attention_impl=impl)
    monkeypatch.setitem(ROUTED_MODULES, "a routed model module", 1)  # as engine.install does
    cache.routed_by = ("a routed model module",)
    outputs, start = [], 0
    for stop in cuts:
        cache.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        outputs.append(attend(cache, queries[:, :, start:stop], scale=SCALE, mask="causal"))
        start = stop
    return mx.concatenate(outputs, axis=2)


@pytest.mark.parametrize("impl", ["dequantized", None])
@pytest.mark.parametrize("name,rotate", [
    pytest.param(n, r, marks=ROTATED_ON_GPU if r else ()) for n, r in INVARIANT_FORMATS],
    ids=[f"{n}{'-rot' if r else ''}" for n, r in INVARIANT_FORMATS])
def test_prefill_is_chunk_invariant(monkeypatch, name, rotate, impl):
    """Where the chunk boundaries fall changes nothing a token attends to: the same K/V
    prefilled in other chunks give every position the same output (tolerance 0), on the
    path a GPU takes for prefill chunks ("dequantized", forced so it runs here too) and
    on this device's default dispatch. A chunk that attended to its own K/V in full
    precision (the old "dequantized" path) fails this for every packed format: a
    restored prefix plus its suffix would not be what the same format computes from
    scratch. On a GPU the default dispatch sends chunks of at most 8 queries to the
    decode kernels (fp16 operands, docs/kernels.md), whose last bits are not the prefill
    path's, so there the chunkings with such chunks are left out for impl None."""
    rng = np.random.default_rng(7)
    keys = mx.array(rng.standard_normal((1, HEADS, 300, DIM)).astype(np.float32)).astype(mx.bfloat16)
    values = mx.array(rng.standard_normal((1, HEADS, 300, DIM)).astype(np.float32)).astype(mx.bfloat16)
    queries = mx.array((rng.standard_normal((1, 2 * HEADS, 300, DIM)) * 0.3).astype(np.float32)).astype(mx.bfloat16)
    whole = _prefill_outputs(name, rotate, CHUNKINGS[0], impl, monkeypatch, keys, values, queries)
    for cuts in CHUNKINGS[1:]:
        sizes = [b - a for a, b in zip((0, *cuts[:-1]), cuts, strict=True)]
        if impl is None and ON_GPU and min(sizes) <= KERNEL_MAX_QUERIES:
            continue
        got = _prefill_outputs(name, rotate, cuts, impl, monkeypatch, keys, values, queries)
        assert mx.array_equal(got, whole).item(), (cuts, mx.abs(got - whole).max().item())


@pytest.mark.parametrize("name", ["k4v4", "native"])
def test_model_prefill_is_chunk_invariant_on_the_gpu_prefill_path(name):
    """A model prefilled into pages in one chunk or in three writes the same pages and
    ends on the same logits (tolerance 0), every chunk through "dequantized" (the GPU's
    prefill path). Needs matmuls whose rows do not depend on how many rows there are, as
    on this CPU backend; where they do (a GPU's BLAS picks kernels by shape), the pages
    may differ in their last bits, and this test says so instead of passing."""
    model = tiny_model("llama", mx.bfloat16)
    prompt = prompt_tokens(100, seed=12)
    policy = KVPolicy(default_format=name, block_size_tokens=16)
    results = []
    for cuts in [(100,), (23, 64, 100)]:
        cache = make_cache(model, policy)
        for layer in cache:
            layer.attention_impl = "dequantized"
        start = 0
        with engine.installed(model):
            for stop in cuts:
                logits = model(prompt[None, start:stop], cache=cache)
                mx.eval(logits)
                start = stop
        results.append((logits[0, -1], [p for layer in cache for p in layer.state]))
    (logits_a, pages_a), (logits_b, pages_b) = results
    same_pages = all(mx.array_equal(a, b).item() for a, b in zip(pages_a, pages_b, strict=True))
    if mx.default_device() == mx.gpu and not same_pages:
        pytest.skip("this GPU's projections differ in their last bits between chunkings "
                    "(pages differ before attention sees them); the attention itself is "
                    "covered by test_prefill_is_chunk_invariant")
    for a, b in zip(pages_a, pages_b, strict=True):
        assert mx.array_equal(a, b).item()
    assert mx.array_equal(logits_a, logits_b).item()
