"""Page formats: byte math against kvstore's LayerSpec, exact bits per value, page
round trips, and the format identity built from a model config and a KV policy."""

from __future__ import annotations

from fractions import Fraction

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import BlockPool, KVPolicy, PagedKVCache, PageSpec, bits_per_value, format_identity
from engine.errors import FormatMismatch, UnknownPageFormat
from engine.formats import (
    FORMATS,
    PAGED_FORMATS,
    blocks_from_pages,
    page_from_planes,
    page_specs,
    pages_from_blocks,
    planes_from_page,
    resolve_format,
)
from engine.geometry import model_fingerprint
from kvstore.format import FormatIdentity
from tests.engine.factories import model_config, tiny_model

PACKED = ("k8v8", "k8v4", "k4v4")


def spec_of(name, heads=2, k_dim=128, v_dim=128, block=16, group=64, seed=None,
            model_dtype=mx.bfloat16):
    # resolve_format binds an mlx-qB format's scale dtype (the model's); others ignore it
    return PageSpec(resolve_format(name, model_dtype), heads, k_dim, v_dim, block, group, seed)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("dims", [(64, 64), (128, 128), (128, 64), (256, 256)])
def test_page_nbytes_equals_kvstore_layer_spec(name, dims):
    spec = spec_of(name, heads=3, k_dim=dims[0], v_dim=dims[1])
    layer = spec.layer_spec()
    for tokens in (1, 7, 16):
        assert spec.page_nbytes(tokens) == layer.page_nbytes(tokens)


@pytest.mark.parametrize("name,bits", [("k4v4", 5), ("k8v4", 7), ("k8v8", 9),
                                       ("native-bf16", 16), ("native-f32", 32)])
def test_bits_per_value_exact_from_nbytes(name, bits):
    spec = spec_of(name, heads=2, k_dim=128, v_dim=128, block=16)
    assert bits_per_value(spec) == bits
    # The same from a live cache's nbytes: 3 full blocks of 16 tokens, 2 heads, K+V 256.
    dtype = spec.format.dtype or mx.bfloat16
    cache = PagedKVCache(BlockPool(spec, 4))
    keys = mx.random.normal((1, 2, 48, 128)).astype(dtype)
    cache.update_and_fetch(keys, keys)
    values_stored = 48 * 2 * 256
    assert cache.nbytes * 8 == bits * values_stored
    assert cache.nbytes == spec.storage_nbytes(48) == spec.storage_nbytes(33)
    assert spec.num_blocks(48) == 3 and spec.num_blocks(49) == 4 and spec.num_blocks(0) == 0
    # and bf16 / k4v4 is the promised 3.2x
    if name == "k4v4":
        assert bits_per_value(spec_of("native-bf16")) / bits_per_value(spec) == pytest.approx(3.2)


def test_resolve_native_follows_model_dtype_and_refuses_unknown():
    assert resolve_format("native", mx.bfloat16).name == "native-bf16"
    assert resolve_format("native", mx.float16).name == "native-f16"
    assert resolve_format("native", mx.float32).name == "native-f32"
    with pytest.raises(UnknownPageFormat):
        resolve_format("k2v2", mx.float32)


def test_rotation_refused_for_native_and_non_power_of_two():
    with pytest.raises(FormatMismatch):
        spec_of("native-bf16", seed=0)
    with pytest.raises(FormatMismatch):
        spec_of("k4v4", k_dim=192, v_dim=192, seed=0)


def _filled_cache(spec, tokens, seed=0):
    rng = np.random.default_rng(seed)
    dtype = spec.format.dtype or mx.float16
    keys = mx.array(rng.standard_normal((1, spec.kv_heads, tokens, spec.k_head_dim)) * 3).astype(dtype)
    values = mx.array(rng.standard_normal((1, spec.kv_heads, tokens, spec.v_head_dim))).astype(dtype)
    cache = PagedKVCache(BlockPool(spec, 2))
    cache.update_and_fetch(keys, values)
    return cache


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(PAGED_FORMATS)), tokens=st.integers(1, 70),
       rotate=st.booleans(), block=st.sampled_from([1, 8, 16]))
def test_pages_round_trip_byte_for_byte(name, tokens, rotate, block):
    seed = 7 if rotate and FORMATS[name].packed else None
    spec = spec_of(name, heads=2, k_dim=64, v_dim=64, block=block, seed=seed)
    cache = _filled_cache(spec, tokens)
    pages = pages_from_blocks(spec, cache.pool.planes, list(cache.block_ids), tokens)
    assert len(pages) == -(-tokens // block)
    assert [len(p) for p in pages[:-1]] == [spec.page_nbytes(block)] * (len(pages) - 1)
    assert len(pages[-1]) == spec.page_nbytes(tokens - (len(pages) - 1) * block)
    planes, count = blocks_from_pages(spec, pages)
    assert count == tokens
    restored = PagedKVCache.from_pages(BlockPool(spec, 1), pages)
    assert restored.offset == tokens
    again = pages_from_blocks(spec, restored.pool.planes, list(restored.block_ids), tokens)
    assert again == pages
    for name_, plane in planes.items():
        assert plane.shape == (len(pages), 2, block, spec.plane_widths[name_])


def test_native_page_layout_is_k_then_v_c_order():
    spec = spec_of("native-f32", heads=2, k_dim=64, v_dim=64, block=4)
    keys = mx.arange(2 * 3 * 64, dtype=mx.float32).reshape(1, 2, 3, 64)
    values = -keys
    cache = PagedKVCache(BlockPool(spec, 1))
    cache.update_and_fetch(keys, values)
    (page,) = cache.snapshot().pages()
    expected = np.concatenate([np.array(keys[0]).ravel(), np.array(values[0]).ravel()])
    assert page == expected.astype("<f4").tobytes()


def test_blocks_from_pages_refuses_bad_lengths():
    spec = spec_of("k8v4", heads=2, k_dim=64, v_dim=64, block=4)
    good = _filled_cache(spec, 6).snapshot().pages()
    with pytest.raises(FormatMismatch):
        blocks_from_pages(spec, [good[0][:-1], good[1]])
    with pytest.raises(FormatMismatch):
        blocks_from_pages(spec, [good[0], bytes(good[1]) + b"\0"])


# -- identity ---------------------------------------------------------------------------
def test_identity_from_config_dict_equals_identity_from_model_args():
    config = model_config("llama")
    model = tiny_model("llama")
    policy = KVPolicy(default_format="k8v4", block_size_tokens=16)
    a = format_identity(config, policy, model_id="m", model_dtype=mx.bfloat16)
    b = format_identity(model.args, policy, model_id="m", model_dtype=mx.bfloat16)
    assert a.format_id == b.format_id
    assert FormatIdentity.from_json(a.canonical()).format_id == a.format_id
    layer = a.layers[0]
    assert (layer.kind, layer.page_format, layer.group_size, layer.scale_dtype, layer.rotation) == (
        "full", "k8v4", 64, "float32", "signed-hadamard:0")
    assert a.block_size_tokens == 16
    assert a.layers[0].page_nbytes(16) == page_specs(a)[0].page_nbytes(16)


def test_identity_changes_with_every_input_that_changes_page_bytes():
    config = model_config("llama")
    base = format_identity(config, KVPolicy(), model_id="m", model_dtype=mx.bfloat16)
    variants = [
        format_identity(config, KVPolicy(), model_id="m", model_dtype=mx.float16),
        format_identity(config, KVPolicy(default_format="k4v4"), model_id="m", model_dtype=mx.bfloat16),
        format_identity(config, KVPolicy(block_size_tokens=64), model_id="m", model_dtype=mx.bfloat16),
        format_identity({**config, "rope_theta": 5e5}, KVPolicy(), model_id="m", model_dtype=mx.bfloat16),
        format_identity(config, KVPolicy(), model_id="other", model_dtype=mx.bfloat16),
    ]
    ids = {base.format_id} | {v.format_id for v in variants}
    assert len(ids) == 1 + len(variants)
    k4 = variants[1]
    assert format_identity(config, KVPolicy(default_format="k4v4", rotation="off"), model_id="m",
                           model_dtype=mx.bfloat16).layers[0].rotation == "none"
    assert k4.layers[0].rotation == "signed-hadamard:0"


def test_weight_quantization_does_not_change_identity_or_precision():
    config = model_config("llama")
    quantized = {**config, "quantization": {"group_size": 64, "bits": 4}, "torch_dtype": "bfloat16"}
    assert model_fingerprint(config) == model_fingerprint(quantized)
    a = format_identity(quantized, KVPolicy(), model_id="m-4bit", model_dtype=mx.bfloat16)
    assert a.layers[0].page_format == "native-bf16"


def test_gemma3_identity_has_sliding_layers_with_window():
    config = model_config("gemma3_text")
    ident = format_identity(config, KVPolicy(default_format="k4v4"), model_id="g",
                            model_dtype=mx.bfloat16)
    kinds = [layer.kind for layer in ident.layers]
    assert kinds == ["sliding", "full", "sliding", "full"]
    assert ident.layers[0].window == 8 and ident.layers[0].page_format == "native-bf16"
    assert ident.paged_layers == (1, 3)
    assert [s is None for s in page_specs(ident)] == [True, False, True, False]


@pytest.mark.parametrize("name", ["native", "k8v4"])
def test_specs_from_policy_and_from_identity_are_equal(name):
    from engine import make_pools

    model = tiny_model("qwen3", mx.bfloat16)
    policy = KVPolicy(default_format=name, block_size_tokens=32, group_size=32)
    ident = format_identity(model.args, policy, model_id="m", model_dtype=mx.bfloat16)
    pools = make_pools(model, policy)
    assert [p.spec for p in pools] == page_specs(ident)


# Golden page digests (blake3, first 16 bytes in hex) of a fixed input. The inputs are
# multiples of 1/4 and the rotation's entries are +-1/8, so every product and partial sum
# is exact in float32 and the digests do not depend on the summation order of a BLAS.
# A change here changes what published pages mean: bump the format, do not edit digests.
GOLDEN = {
    ("native-bf16", None): ("3191d79b217487a203ec2d8ebbb8c961", "ff05ed91f04f904389f6c8842656efca"),
    ("k8v4", None): ("bfbd6bbb99005d4d8966748e67f31318", "0619f81da66e2a3ebb665fe647c94a43"),
    ("k4v4", 0): ("898838c087bc616b4296e01feb38b9e3", "40253d387ccef9fd701b0a47f101647b"),
    ("k8v8", 0): ("adfc82d4870bd1199c1681d6bc0c2728", "4c85b59b9e2658673ad1f933feb4a18d"),
}


@pytest.mark.parametrize("name,seed", sorted(GOLDEN, key=str))
def test_golden_page_digests(name, seed):
    import blake3

    spec = spec_of(name, heads=2, k_dim=64, v_dim=64, block=4, seed=seed)
    cache = PagedKVCache(BlockPool(spec, 2))
    x = ((mx.arange(2 * 6 * 64, dtype=mx.float32).reshape(1, 2, 6, 64) % 23 - 11) / 4)
    x = x.astype(mx.bfloat16)
    cache.update_and_fetch(x, x * -0.5)
    pages = cache.snapshot().pages()
    assert [len(p) for p in pages] == [spec.page_nbytes(4), spec.page_nbytes(2)]
    assert tuple(blake3.blake3(p).hexdigest()[:32] for p in pages) == GOLDEN[name, seed]


# -- mlx-qB: mlx's own affine quantization (mlx-lm's QuantizedKVCache) ------------------------
MLX_BITS = (2, 3, 4, 5, 6, 8)


def _doc_codes(page: bytes, offset: int, rows: int, width_words: int, bits: int, count: int):
    """docs/format.md's code packing, read with numpy alone: each row is width_words u32le
    words; code j of a row is bits j*B .. j*B+B-1 of its bit stream, LSB first."""
    raw = np.frombuffer(page, np.uint8, rows * width_words * 4, offset).reshape(rows, -1)
    stream = np.unpackbits(raw, axis=1, bitorder="little")[:, : count * bits]
    weights = 1 << np.arange(bits)
    return (stream.reshape(rows, count, bits) * weights).sum(axis=2)


@pytest.mark.parametrize("bits", MLX_BITS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_mlx_q_pages_hold_mx_quantize_codes_in_the_documented_layout(bits, group):
    spec = spec_of(f"mlx-q{bits}", heads=2, k_dim=128, v_dim=128, block=4, group=group,
                   model_dtype=mx.float32)
    x = mx.random.normal((2, 3, 128), key=mx.random.key(bits * group))
    k, v = mx.quantize(x, group_size=group, bits=bits), mx.quantize(-x, group_size=group, bits=bits)
    planes = dict(zip(spec.plane_names, (*k, *v), strict=True))
    page = page_from_planes(spec, planes)
    assert len(page) == spec.page_nbytes(3) == spec.layer_spec().page_nbytes(3)
    widths = spec.plane_widths
    assert widths["k_codes"] == 128 * bits // 32 and widths["k_scales"] == 128 // group
    # codes read per the doc equal mlx's own codes (dequantized with scale 1, bias 0)
    codes = _doc_codes(page, 0, 6, widths["k_codes"], bits, 128)
    ones = mx.ones((2, 3, 128 // group))
    mlx_codes = mx.dequantize(k[0], ones, ones * 0, group_size=group, bits=bits)
    assert np.array_equal(codes, np.array(mlx_codes).reshape(6, 128))
    # x' = scale * code + bias per group, computed from the page's bytes alone (float32
    # scales: exact in float32 arithmetic)
    offset = 6 * widths["k_codes"] * 4
    scales = np.frombuffer(page, "<f4", 6 * 128 // group, offset).reshape(6, -1, 1)
    biases = np.frombuffer(page, "<f4", 6 * 128 // group, offset + scales.nbytes).reshape(6, -1, 1)
    ours = (codes.reshape(6, -1, group).astype(np.float32) * scales + biases).reshape(6, 128)
    theirs = np.array(mx.dequantize(*k, group_size=group, bits=bits)).reshape(6, 128)
    assert np.array_equal(ours, theirs)
    # and the page parses back to exactly the planes it was made from
    for name, plane in planes_from_page(spec, page, 3).items():
        assert plane.dtype == planes[name].dtype and mx.array_equal(plane, planes[name]).item()


def test_golden_mlx_q4_page_means_what_the_format_doc_says():
    """docs/format.md section 7's mlx-q4 page, dequantized by mlx itself."""
    page = bytes.fromhex("1032547698badcfe1032547698badcfe803f00c1"
                         "efcdab8967452301efcdab8967452301003f803e")
    spec = spec_of("mlx-q4", heads=1, k_dim=32, v_dim=32, block=1, group=32)
    planes = planes_from_page(spec, page, 1)
    keys = mx.dequantize(planes["k_codes"], planes["k_scales"], planes["k_biases"], group_size=32, bits=4)
    values = mx.dequantize(planes["v_codes"], planes["v_scales"], planes["v_biases"], group_size=32, bits=4)
    j = np.arange(32)
    assert np.array_equal(np.array(keys.astype(mx.float32)).ravel(), j % 16 - 8.0)
    assert np.array_equal(np.array(values.astype(mx.float32)).ravel(), (15 - j % 16) * 0.5 + 0.25)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_mlx_q_page_bytes_are_what_a_quantized_kvcache_holds(bits, dtype):
    from mlx_lm.models.cache import QuantizedKVCache

    spec = spec_of(f"mlx-q{bits}", heads=2, k_dim=64, v_dim=64, block=16, group=64,
                   model_dtype=dtype)
    assert spec.layer_spec().scale_dtype == {mx.bfloat16: "bfloat16", mx.float16: "float16",
                                             mx.float32: "float32"}[dtype]
    cache = QuantizedKVCache(group_size=64, bits=bits)
    keys = mx.random.normal((1, 2, 256, 64)).astype(dtype)  # one mlx-lm step: no slack
    cache.update_and_fetch(keys, keys)
    assert cache.nbytes == spec.page_nbytes(256)
    scale_bits = 16 if dtype != mx.float32 else 32
    assert bits_per_value(spec) == bits + Fraction(2 * scale_bits, 64)


def test_mlx_q_identity_and_specs_round_trip_and_refuse_rotation():
    config = model_config("llama")
    for dtype, name in [(mx.bfloat16, "bfloat16"), (mx.float16, "float16"), (mx.float32, "float32")]:
        ident = format_identity(config, KVPolicy(default_format="mlx-q8", group_size=32),
                                model_id="m", model_dtype=dtype)
        layer = ident.layers[0]
        assert (layer.page_format, layer.group_size, layer.scale_dtype, layer.rotation) == (
            "mlx-q8", 32, name, "none")  # never rotated, whatever the policy's rotation
        spec = page_specs(ident)[0]
        assert spec.format.dtype == dtype and spec.layer_spec() == layer
        assert FormatIdentity.from_json(ident.canonical()).format_id == ident.format_id
    with pytest.raises(FormatMismatch):
        spec_of("mlx-q4", seed=0)
    with pytest.raises(FormatMismatch):
        spec_of("mlx-q4", group=16)  # mlx quantizes in groups of 32, 64 or 128
    with pytest.raises(FormatMismatch):
        PageSpec(FORMATS["mlx-q4"], 2, 64, 64, 16, 64)  # unresolved: no scale dtype


def test_paged_engine_does_not_serve_mlx_q_pages():
    from engine.errors import UnpagedFormat

    spec = spec_of("mlx-q4")
    with pytest.raises(UnpagedFormat, match="QuantizedKVCache"):
        BlockPool(spec, 2)
    with pytest.raises(UnpagedFormat):
        _ = spec.layout
    assert set(PAGED_FORMATS) == set(FORMATS) - {f"mlx-q{b}" for b in MLX_BITS}
