"""Factories for paged K/V test data: random history written into a pool at shuffled
(non-contiguous) block ids, in any layout."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import mlx.core as mx

from kernels.hadamard import rotate
from kernels.layout import PageLayout
from kernels.quant import quantize

# name -> (layout, native dtype); packed layouts take keys/values in float32
LAYOUTS = {
    "bf16": (PageLayout(), mx.bfloat16),
    "f16": (PageLayout(), mx.float16),
    "f32": (PageLayout(), mx.float32),
    "bf16-rot": (PageLayout(rotation_seed=7), mx.bfloat16),
    "k8v8": (PageLayout(8, 8), mx.bfloat16),
    "k8v4": (PageLayout(8, 4), mx.bfloat16),
    "k4v4": (PageLayout(4, 4), mx.bfloat16),
    "k8v8-rot": (PageLayout(8, 8, rotation_seed=11), mx.bfloat16),
    "k8v4-rot": (PageLayout(8, 4, rotation_seed=12), mx.bfloat16),
    "k4v4-rot": (PageLayout(4, 4, rotation_seed=13), mx.bfloat16),
    # float16 queries: the tighter tolerance checks the CUDA tensor-core kernel's fp16 operands
    "k4v4-rot-f16": (PageLayout(4, 4, rotation_seed=14), mx.float16),
    "k8v8-f16": (PageLayout(8, 8, group_size=32), mx.float16),
}


@dataclass
class PagedCase:
    queries: mx.array        # [B, Hq, L, D] model dtype
    planes: dict
    block_tables: mx.array   # [B, max_blocks] int32, padding = -1
    context_lens: list[int]
    layout: PageLayout


def make_case(
    layout_name: str,
    *,
    head_dim: int,
    n_kv_heads: int,
    gqa: int,
    block_size: int,
    context_lens: list[int],
    num_queries: int,
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedCase:
    layout, dtype = LAYOUTS[layout_name]
    rng = random.Random(seed)
    mx.random.seed(seed)
    used = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(used) + spare_blocks
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    widths = layout.plane_widths(head_dim, head_dim)
    planes = {}
    for name in layout.plane_names:
        if name.endswith("codes"):
            planes[name] = mx.zeros((num_blocks, n_kv_heads, block_size, widths[name]), mx.uint8)
        elif layout.packed:
            # never-written slots hold garbage scales so reading them would show
            planes[name] = mx.full((num_blocks, n_kv_heads, block_size, widths[name]), 1e4)
        else:
            planes[name] = mx.full((num_blocks, n_kv_heads, block_size, widths[name]), 1e4, dtype)
    max_blocks = max(used) + 2
    tables = [[-1] * max_blocks for _ in context_lens]
    cursor = 0
    for b in range(len(context_lens)):
        padded = used[b] * block_size
        keys = mx.random.normal((n_kv_heads, padded, head_dim))
        values = mx.random.normal((n_kv_heads, padded, head_dim))
        if layout.rotated_keys:
            keys = rotate(keys, layout.rotation_seed)
        own = ids[cursor: cursor + used[b]]
        cursor += used[b]
        tables[b][: used[b]] = own
        rows = mx.array(own, dtype=mx.int32)

        def blocked(x, count=used[b]):  # [H, count*bs, W] -> [count, H, bs, W]
            return x.reshape(n_kv_heads, count, block_size, -1).transpose(1, 0, 2, 3)

        if layout.packed:
            for half, x, bits in (("k", keys, layout.k_bits), ("v", values, layout.v_bits)):
                c, s, o = quantize(x, bits, layout.group_size)
                planes[f"{half}_codes"][rows] = blocked(c)
                planes[f"{half}_scales"][rows] = blocked(s)
                planes[f"{half}_offsets"][rows] = blocked(o)
        else:
            planes["k"][rows] = blocked(keys.astype(dtype))
            planes["v"][rows] = blocked(values.astype(dtype))
    queries = mx.random.normal((len(context_lens), n_kv_heads * gqa, num_queries, head_dim)).astype(dtype)
    mx.eval(queries, *planes.values())
    return PagedCase(queries, planes, mx.array(tables, dtype=mx.int32), list(context_lens), layout)
