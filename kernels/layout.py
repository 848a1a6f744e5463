"""Page layouts as the kernels see them: which planes a pool layer holds and what they mean.

A pool layer is a set of planes, each shaped [num_blocks, kv_heads, block_size, width]:

  native:  k      [N, H, B, Dk]            model dtype
           v      [N, H, B, Dv]            model dtype
  packed:  k_codes   [N, H, B, Dk*kb/8]    uint8 (4-bit: element 2j in the low nibble of byte j)
           k_scales  [N, H, B, Dk/G]       float32
           k_offsets [N, H, B, Dk/G]       float32
           v_codes / v_scales / v_offsets  the same for V with vb bits

Dequantization is x = code * scale + offset per group of G values along head_dim
(token-local: one scale/offset per token, head and group). Keys of a packed layout may
be stored in a rotated basis (see kernels/hadamard.py); queries are then rotated the
same way, so scores are unchanged in exact arithmetic. Values are never rotated.

This module knows names and shapes only. Which model format maps to which layout is
engine/formats.py's business.
"""

from __future__ import annotations

from dataclasses import dataclass

NATIVE_PLANES = ("k", "v")
PACKED_PLANES = ("k_codes", "k_scales", "k_offsets", "v_codes", "v_scales", "v_offsets")


@dataclass(frozen=True)
class PageLayout:
    """Shape rules of one layer's pages. bits == 0 means native (no quantization)."""

    k_bits: int = 0
    v_bits: int = 0
    group_size: int = 64
    rotation_seed: int | None = None  # keys stored as k @ R(seed) when set (packed only)

    def __post_init__(self):
        if (self.k_bits == 0) != (self.v_bits == 0):
            raise ValueError("native and packed halves cannot be mixed in one layout")
        for bits in (self.k_bits, self.v_bits):
            if bits not in (0, 4, 8):
                raise ValueError(f"unsupported code width {bits} bits (supported: 4, 8)")
        if self.group_size <= 0:
            raise ValueError("group_size must be positive")

    @property
    def rotated_keys(self) -> bool:
        return self.rotation_seed is not None

    @property
    def packed(self) -> bool:
        return self.k_bits != 0

    @property
    def plane_names(self) -> tuple[str, ...]:
        return PACKED_PLANES if self.packed else NATIVE_PLANES

    def plane_widths(self, k_head_dim: int, v_head_dim: int) -> dict[str, int]:
        """Last-axis width of every plane for the given head dims."""
        if not self.packed:
            return {"k": k_head_dim, "v": v_head_dim}
        for dim in (k_head_dim, v_head_dim):
            if dim % self.group_size:
                raise ValueError(f"head dim {dim} is not a multiple of group size {self.group_size}")
        return {
            "k_codes": k_head_dim * self.k_bits // 8,
            "k_scales": k_head_dim // self.group_size,
            "k_offsets": k_head_dim // self.group_size,
            "v_codes": v_head_dim * self.v_bits // 8,
            "v_scales": v_head_dim // self.group_size,
            "v_offsets": v_head_dim // self.group_size,
        }
