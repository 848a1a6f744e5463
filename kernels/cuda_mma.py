"""The tensor-core split kernel for packed pages on CUDA (cuda_mma_split.cu: mma.sync
m16n8k16, fp16 operands, fp32 accumulation), compiled with mx.fast.cuda_kernel.

It takes the place of the lane-group split kernel for packed pages with fp16/bf16 queries
(direct.mma_serves); the plan's partial layout and the merge kernel are the lane-group
kernel's. Why: the lane-group kernel is bound by instruction issue on code unpacking and
scalar FMAs; here a warp scores and accumulates 16 tokens per step in 24 mma instructions.
The kernel's layout, the raw-code scheme and its precision are described at the head of
cuda_mma_split.cu; measurements are in docs/kernels.md.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from kernels.launch import SPLIT_OUTPUTS, baked, split_input_names
from kernels.sources import kernel_source, nvrtc_text


@lru_cache(maxsize=None)
def split_kernel(shared_memory: int = 0, threads: int = 0, min_blocks: int = 0, template: tuple = ()):
    """The mx.fast.cuda_kernel object with `shared_memory` dynamic shared bytes, for one
    template whose constants are baked into its source (launch.baked; empty: passed per call;
    the template's SMEM carries the same number, so kernels of different sizes never share a
    compiled function). min_blocks > 0: the kernel is declared
    __launch_bounds__(threads, min_blocks); MLX writes the `__global__ void` line itself, so
    the header redefines __global__ for it (the last declaration in the source), and the
    kernel's name carries the bounds (MLX caches compiled modules by name and template)."""
    header = nvrtc_text(kernel_source("cuda_mma.cuh"))
    suffix, prefix = baked(template) if template else ("", "")
    name = "kvstore_paged_split_mma" + suffix
    if min_blocks:
        header += (f"\n#undef __global__\n#define __global__ __attribute__((global)) "
                   f"__launch_bounds__({threads}, {min_blocks})\n")
        name += f"_lb{threads}x{min_blocks}"
    return mx.fast.cuda_kernel(
        name=name,
        input_names=split_input_names(packed=True),
        output_names=SPLIT_OUTPUTS,
        source=prefix + nvrtc_text(kernel_source("cuda_mma_split.cu")),
        header=header,
        shared_memory=shared_memory,
    )


@lru_cache(maxsize=None)
def native_split_kernel(shared_memory: int, template: tuple = ()):
    """The tensor-core split kernel for native fp16/bf16 pages (cuda_mma_native_split.cu),
    with `shared_memory` dynamic shared bytes (the template's SMEM carries the same number),
    for one template baked into its source (launch.baked; empty: passed per call)."""
    suffix, prefix = baked(template) if template else ("", "")
    return mx.fast.cuda_kernel(
        name="kvstore_paged_split_mma_native" + suffix,
        input_names=split_input_names(packed=False),
        output_names=SPLIT_OUTPUTS,
        source=prefix + nvrtc_text(kernel_source("cuda_mma_native_split.cu")),
        header=nvrtc_text(kernel_source("cuda_mma.cuh")),
        shared_memory=shared_memory,
    )
