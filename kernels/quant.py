"""Token-local affine quantization along head_dim: the codecs of the packed page formats.

For each token, head and group of G consecutive head_dim values (G = group_size):
  offset = min(x), scale = (max(x) - min(x)) / (2^bits - 1)   (both float32)
  code   = clip(round((x - offset) / scale), 0, 2^bits - 1)   (scale 0 -> code 0)
  x'     = code * scale + offset
Codes of 8 bits are one uint8 each; codes of 4 bits pack two per byte, element 2j in
the low nibble of byte j. Values are quantized once, when written; these functions
never see a page twice.
"""

from __future__ import annotations

import mlx.core as mx


def quantize(x: mx.array, bits: int, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """x: [..., D] -> codes [..., D*bits/8] uint8, scales [..., D/G] f32, offsets [..., D/G] f32."""
    *lead, dim = x.shape
    if dim % group_size:
        raise ValueError(f"head dim {dim} is not a multiple of group size {group_size}")
    if bits not in (4, 8):
        raise ValueError(f"unsupported code width {bits} bits (supported: 4, 8)")
    levels = (1 << bits) - 1
    groups = x.astype(mx.float32).reshape(*lead, dim // group_size, group_size)
    lo = groups.min(axis=-1, keepdims=True)
    hi = groups.max(axis=-1, keepdims=True)
    scale = (hi - lo) / levels
    safe = mx.where(scale > 0, scale, mx.ones_like(scale))
    codes = mx.clip(mx.round((groups - lo) / safe), 0, levels).astype(mx.uint8)
    codes = codes.reshape(*lead, dim)
    if bits == 4:
        pairs = codes.reshape(*lead, dim // 2, 2)
        codes = pairs[..., 0] | (pairs[..., 1] << 4)
    return codes, scale.squeeze(-1), lo.squeeze(-1)


def unpack_codes(codes: mx.array, bits: int) -> mx.array:
    """codes [..., W] uint8 -> [..., W*8/bits] uint8, one code per element."""
    if bits == 8:
        return codes
    low = codes & 0x0F
    high = codes >> 4
    return mx.stack([low, high], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)


def dequantize(
    codes: mx.array, scales: mx.array, offsets: mx.array, bits: int, dtype=mx.float32
) -> mx.array:
    """codes [..., W], scales/offsets [..., D/G] -> x' [..., D] in dtype (math in float32)."""
    values = unpack_codes(codes, bits)
    *lead, dim = values.shape
    ngroups = scales.shape[-1]
    grouped = values.reshape(*lead, ngroups, dim // ngroups).astype(mx.float32)
    out = grouped * scales[..., None] + offsets[..., None]
    out = out.reshape(*lead, dim)
    return out if dtype == mx.float32 else out.astype(dtype)
