"""Quantize-on-write: one layer's new keys and values encoded into packed page planes.

    encode(keys, values, layout, *, impl=None, lead_shape=None) -> {plane name: [*lead, width]}
    # keys [..., Dk], values [..., Dv] (model dtype, keys unrotated; leading dims alike,
    # e.g. [1, Hkv, L]); planes as kernels/layout.py names them, with leading dims
    # lead_shape (default: the inputs'; same element count, e.g. [Hkv, L] for [1, Hkv, L]:
    # the CUDA kernel writes that shape directly, so no reshape node is built)

The arithmetic is kernels/quant.py's quantize (rotation first, kernels/hadamard.py, when
the layout rotates keys). Implementations:

  "reference"  plain MLX ops: rotate, then quantize keys and values (~40 graph nodes; on a
               GPU as many small launches per layer and step)
  "compiled"   the same function under mx.compile, one compiled graph per input shape:
               elementwise work fused (CPU and GPU), the Python that builds it cut from
               ~70 us to ~10 us per layer (this CPU). Bit-identical to the reference.
  "cuda"       kernels/quantize.cu through mx.fast.cuda_kernel: the rotation's float32
               matmul (as the reference computes it) and ONE launch for every group of
               keys and values (one thread per group). Same ops in the same order and
               precision, IEEE division and round-half-to-even: bit-identical to the
               reference on the same rotated input (tests/kernels/test_quantize.py).
  "cuda-rotate"  opt-in: kernels/quantize_rotate.cu, the rotation inside the same launch
               (signs, fast Walsh-Hadamard transform, 1/sqrt(d) per key row in registers),
               so no cast and matmul launch before it. Not bit-identical: the transform sums
               in another order than the matmul, so a code may differ by one step at a
               rounding boundary (the test's tolerance). Unrotated layouts: "cuda".

Dispatch (impl=None): $KVSTORE_QUANTIZE_IMPL if set, else "cuda" on a CUDA GPU where the
kernel serves the layout (group size a divisor of both head dims, float inputs), else
"compiled". Forcing "cuda" without CUDA raises BackendUnavailable.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import mlx.core as mx

from kernels.errors import BackendUnavailable
from kernels.hadamard import rotate, sign_vector
from kernels.launch import baked
from kernels.layout import PACKED_PLANES, PageLayout
from kernels.quant import quantize
from kernels.sources import kernel_source, nvrtc_text

IMPLEMENTATIONS = ("reference", "compiled", "cuda", "cuda-rotate")
IMPL_ENV = "KVSTORE_QUANTIZE_IMPL"
THREADS = 128  # threads per block of the CUDA kernel (one per quantization group)


def reference_encode(keys: mx.array, values: mx.array, layout: PageLayout,
                     lead_shape: tuple[int, ...] | None = None) -> dict[str, mx.array]:
    """The MLX-ops encoder (the numerical control)."""
    if layout.rotated_keys:
        keys = rotate(keys, layout.rotation_seed)
    planes = (*quantize(keys, layout.k_bits, layout.group_size),
              *quantize(values, layout.v_bits, layout.group_size))
    if lead_shape is not None:
        planes = tuple(p.reshape(*lead_shape, p.shape[-1]) for p in planes)
    return dict(zip(PACKED_PLANES, planes, strict=True))


@lru_cache(maxsize=64)
def _compiled(layout: PageLayout, lead_shape: tuple[int, ...] | None):
    def encode_planes(keys, values):
        planes = reference_encode(keys, values, layout, lead_shape)
        return tuple(planes[name] for name in PACKED_PLANES)

    return mx.compile(encode_planes)


def compiled_encode(keys: mx.array, values: mx.array, layout: PageLayout,
                    lead_shape: tuple[int, ...] | None = None) -> dict[str, mx.array]:
    return dict(zip(PACKED_PLANES, _compiled(layout, lead_shape)(keys, values), strict=True))


@lru_cache(maxsize=None)
def _cuda_kernel(source_name: str, input_names: tuple, template: tuple):
    """quantize.cu or quantize_rotate.cu for one template, its constants baked into the
    source (kernels/launch.py baked: no template arguments to convert on each call)."""
    suffix, prefix = baked(template)
    stem = "kvstore_quantize_write" if source_name == "quantize.cu" else "kvstore_quantize_rotate_write"
    return mx.fast.cuda_kernel(
        name=stem + suffix,
        input_names=list(input_names),
        output_names=list(PACKED_PLANES),
        source=prefix + nvrtc_text(kernel_source(source_name)),
        header=nvrtc_text(kernel_source("quantize.cuh")),
    )


@lru_cache(maxsize=256)
def _cuda_launch(layout: PageLayout, key_shape: tuple, value_dim: int, key_dtype, value_dtype,
                 lead_shape: tuple | None, rotate: bool = False) -> tuple:
    """(kernel, launch arguments) of one write shape (cached: every layer of a step shares
    them); rotate: quantize_rotate.cu's launch, a thread per key row."""
    *lead, dk = key_shape
    rows = math.prod(lead)
    if rotate:
        threads = rows + rows * value_dim // layout.group_size
    else:
        threads = rows * (dk + value_dim) // layout.group_size
    widths = layout.plane_widths(dk, value_dim)
    out_lead = tuple(lead) if lead_shape is None else tuple(lead_shape)
    assert math.prod(out_lead) == rows, f"lead_shape {lead_shape} does not hold {rows} rows"
    template = (("K_BITS", layout.k_bits), ("V_BITS", layout.v_bits), ("GROUP", layout.group_size),
                ("DK", dk), ("DV", value_dim), ("NDIM", len(key_shape)), ("KT", key_dtype),
                ("VT", value_dtype))
    kernel = (_cuda_kernel("quantize_rotate.cu", ("keys", "values", "signs"), template) if rotate
              else _cuda_kernel("quantize.cu", ("keys", "values"), template))
    return kernel, dict(
        grid=(-(-threads // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*out_lead, widths[name]) for name in PACKED_PLANES],
        output_dtypes=[mx.uint8 if name.endswith("codes") else mx.float32 for name in PACKED_PLANES],
    )


def cuda_encode(keys: mx.array, values: mx.array, layout: PageLayout,
                lead_shape: tuple[int, ...] | None = None) -> dict[str, mx.array]:
    """kernels/quantize.cu: one launch for the whole write (keys rotated first, as the
    reference does it). Inputs of any rank, row-contiguous (the launch copies others)."""
    if layout.rotated_keys:
        keys = rotate(keys, layout.rotation_seed)
    kernel, launch = _cuda_launch(layout, tuple(keys.shape), values.shape[-1], keys.dtype,
                                  values.dtype, None if lead_shape is None else tuple(lead_shape))
    outputs = kernel(inputs=[keys, values], **launch)
    return dict(zip(PACKED_PLANES, outputs, strict=True))


def cuda_rotate_encode(keys: mx.array, values: mx.array, layout: PageLayout,
                       lead_shape: tuple[int, ...] | None = None) -> dict[str, mx.array]:
    """kernels/quantize_rotate.cu: rotation and quantization in one launch (unrotated
    layouts: cuda_encode)."""
    if not layout.rotated_keys:
        return cuda_encode(keys, values, layout, lead_shape)
    kernel, launch = _cuda_launch(layout, tuple(keys.shape), values.shape[-1], keys.dtype,
                                  values.dtype, None if lead_shape is None else tuple(lead_shape),
                                  rotate=True)
    outputs = kernel(inputs=[keys, values, _signs(keys.shape[-1], layout.rotation_seed)], **launch)
    return dict(zip(PACKED_PLANES, outputs, strict=True))


@lru_cache(maxsize=32)
def _signs(dim: int, seed: int) -> mx.array:
    signs = mx.array(sign_vector(dim, seed), dtype=mx.float32)
    mx.eval(signs)
    return signs


def cuda_available() -> bool:
    try:
        return bool(mx.cuda.is_available()) and mx.default_device() == mx.gpu
    except AttributeError:
        return False


def cuda_serves(layout: PageLayout, k_head_dim: int, v_head_dim: int) -> bool:
    return (layout.packed and k_head_dim % layout.group_size == 0
            and v_head_dim % layout.group_size == 0 and layout.group_size % 2 == 0)


def select_impl(impl: str | None, layout: PageLayout, k_head_dim: int, v_head_dim: int) -> str:
    """The implementation encode() runs (see the module docstring)."""
    chosen = impl or os.environ.get(IMPL_ENV) or None
    if chosen is None:
        chosen = "cuda" if cuda_available() and cuda_serves(layout, k_head_dim, v_head_dim) else "compiled"
    if chosen not in IMPLEMENTATIONS:
        raise ValueError(f"quantize impl {chosen!r} is not one of {IMPLEMENTATIONS}")
    if chosen.startswith("cuda") and not cuda_available():
        raise BackendUnavailable(f"quantize impl {chosen!r} was asked for but CUDA is not available here")
    return chosen


_ENCODERS = {"reference": reference_encode, "compiled": compiled_encode, "cuda": cuda_encode,
             "cuda-rotate": cuda_rotate_encode}


def encode(keys: mx.array, values: mx.array, layout: PageLayout, *, impl: str | None = None,
           lead_shape: tuple[int, ...] | None = None) -> dict[str, mx.array]:
    """keys [..., Dk], values [..., Dv] -> the six packed planes [*lead_shape, width]
    (module docstring)."""
    if not layout.packed:
        raise ValueError("encode() quantizes packed layouts; native pages store K/V as given")
    if keys.shape[:-1] != values.shape[:-1]:
        raise ValueError(f"keys {keys.shape} and values {values.shape} differ before the head dim")
    chosen = select_impl(impl, layout, keys.shape[-1], values.shape[-1])
    return _ENCODERS[chosen](keys, values, layout, None if lead_shape is None else tuple(lead_shape))
