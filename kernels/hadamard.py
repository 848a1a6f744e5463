"""The fixed signed Hadamard basis used to rotate keys (and queries) of packed formats.

R = diag(s) @ H / sqrt(d), where H is the d x d Sylvester Hadamard matrix (entries
+-1, d a power of two) and s a +-1 sign vector drawn from a seed by splitmix64. R is
orthogonal, so (q R)(k R)^T = q k^T in exact arithmetic, while the rotation spreads
outlier channels over all channels before quantization.

The sign rule, so another implementation can reproduce it bit for bit:
  state = seed (u64); for i in 0..d-1:
    state = (state + 0x9E3779B97F4A7C15) mod 2^64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2^64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2^64
    z = z ^ (z >> 31)
    s[i] = -1 if z & 1 else +1
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

_MASK64 = (1 << 64) - 1


def sign_vector(dim: int, seed: int) -> list[int]:
    """The +-1 signs for one head dim and seed (see the module docstring)."""
    state = seed & _MASK64
    signs = []
    for _ in range(dim):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
        signs.append(-1 if z & 1 else 1)
    return signs


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


@lru_cache(maxsize=32)
def _rotation_f32(dim: int, seed: int) -> mx.array:
    if not is_power_of_two(dim):
        raise ValueError(f"signed Hadamard rotation needs a power-of-two head dim, got {dim}")
    h = mx.array([[1.0]], dtype=mx.float32)
    while h.shape[0] < dim:
        h = mx.concatenate(
            [mx.concatenate([h, h], axis=1), mx.concatenate([h, -h], axis=1)], axis=0
        )
    signs = mx.array(sign_vector(dim, seed), dtype=mx.float32)
    rot = (signs[:, None] * h) / (dim**0.5)
    mx.eval(rot)
    return rot


def rotation_matrix(dim: int, seed: int, dtype=mx.float32) -> mx.array:
    """R: [dim, dim], orthogonal. Rotate row vectors with x @ R; undo with x @ R.T."""
    rot = _rotation_f32(dim, seed)
    return rot if dtype == mx.float32 else rot.astype(dtype)


def rotate(x: mx.array, seed: int) -> mx.array:
    """x: [..., dim] -> x @ R, computed in float32."""
    return x.astype(mx.float32) @ rotation_matrix(x.shape[-1], seed)


def unrotate(x: mx.array, seed: int) -> mx.array:
    """x: [..., dim] (rotated) -> x @ R.T, computed in float32."""
    return x.astype(mx.float32) @ rotation_matrix(x.shape[-1], seed).T
