"""The Metal kernels of direct paged attention (mx.fast.metal_kernel), for Apple GPUs:
metal_split.metal and metal_merge.metal, the plain form of the CUDA lane-group kernel.

Same plan, partial layout and merge as kernels/cuda.py: one shuffle reduction per score
(simd_shuffle_xor), no software pipelining, no shared-memory block table. It has never run
(no Apple GPU here): tests/kernels/test_attention.py compares it with the reference where
Metal exists and skips with a stated reason elsewhere.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from kernels.launch import LaunchPlan, compile_lane_split, compile_merge, run_split_merge
from kernels.sources import PACKAGE, SourceTree, kernel_source

HEADER = "metal_common.h"
MERGE = "metal_merge.metal"


def split_source(packed: bool, tree: SourceTree = PACKAGE) -> str:
    """The split kernel's body for native or packed pages, as metal_kernel takes it."""
    loads = tree.sections("metal_loads.metal")
    kind = "PACKED" if packed else "NATIVE"
    return (tree.text("metal_split.metal")
            .replace("{load_k}", loads[f"LOAD_{kind}_K"]).replace("{load_v}", loads[f"LOAD_{kind}_V"]))


@lru_cache(maxsize=None)
def _split_kernel(packed: bool):
    return compile_lane_split(mx.fast.metal_kernel, packed, split_source(packed), kernel_source(HEADER))


@lru_cache(maxsize=1)
def _merge_kernel():
    return compile_merge(mx.fast.metal_kernel, kernel_source(MERGE))


def launch(plan: LaunchPlan) -> mx.array:
    """Run the split and merge kernels of one planned call; returns [B, Hq, L, Dv]."""
    return run_split_merge(plan, _split_kernel(plan.packed), _merge_kernel())
