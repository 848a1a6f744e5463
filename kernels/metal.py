"""The Metal kernels of direct paged attention (mx.fast.metal_kernel), for Apple GPUs:
metal_split.metal and metal_merge.metal, the plain form of the CUDA lane-group kernel.

Same plan, partial layout and merge as kernels/cuda.py: one shuffle reduction per score
(simd_shuffle_xor), no software pipelining, no shared-memory block table. It has never run
(no Apple GPU here): tests/kernels/test_attention.py compares it with the reference where
Metal exists and skips with a stated reason elsewhere.
"""

from __future__ import annotations

import mlx.core as mx

from kernels.launch import LaunchPlan, run_split_merge
from kernels.sources import kernel_source, source_sections

_KERNELS: dict[tuple, object] = {}


def split_source(packed: bool) -> str:
    loads = source_sections("metal_loads.metal")
    kind = "PACKED" if packed else "NATIVE"
    return (kernel_source("metal_split.metal")
            .replace("{load_k}", loads[f"LOAD_{kind}_K"]).replace("{load_v}", loads[f"LOAD_{kind}_V"]))


def _split_kernel(packed: bool):
    key = ("split", packed)
    if key not in _KERNELS:
        planes = ["kc", "ks", "ko", "vc", "vs", "vo"] if packed else ["kc", "vc"]
        _KERNELS[key] = mx.fast.metal_kernel(
            name=f"kvstore_paged_split_{'packed' if packed else 'native'}",
            input_names=["queries", "signs", *planes, "block_tables", "meta"],
            output_names=["part_o", "part_ml"],
            source=split_source(packed),
            header=kernel_source("metal_common.h"),
        )
    return _KERNELS[key]


def _merge_kernel():
    if "merge" not in _KERNELS:
        _KERNELS["merge"] = mx.fast.metal_kernel(
            name="kvstore_paged_merge",
            input_names=["part_o", "part_ml", "sinks", "meta"],
            output_names=["result"],
            source=kernel_source("metal_merge.metal"),
        )
    return _KERNELS["merge"]


def launch(plan: LaunchPlan) -> mx.array:
    """Run the split and merge kernels of one planned call; returns [B, Hq, L, Dv]."""
    return run_split_merge(plan, _split_kernel(plan.packed), _merge_kernel())
