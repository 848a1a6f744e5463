"""The CUDA kernels of direct paged attention: compiles the lane-group split kernel
(cuda_lane_split.cu) and the merge kernel (cuda_merge.cu) with mx.fast.cuda_kernel (NVRTC)
and runs a planned call; the tensor-core split kernel is kernels/cuda_mma.py's.

Two launches per call (the algorithm is in kernels/direct.py's docstring):
  split kernel   grid (splits, Hkv * row_chunks, B), NUM_WARPS warps per block: one pass
                 over a split's pages for up to ROWS_PER_BLOCK grouped query rows, writing a
                 partial (max, sum, output) per row.
  merge kernel   grid (B * Hq * L), Dv threads: log-sum-exp merge of the partials and the
                 optional sink, cast to the output dtype.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from kernels import cuda_mma
from kernels.launch import LaunchPlan, baked, compile_lane_split, compile_merge, run_split_merge
from kernels.sources import kernel_source, nvrtc_text

# the placeholders of cuda_lane_split.cu per layout kind: the page-data type of
# cuda_lane.cuh and the plane arguments of its load()
NATIVE = dict(raw="NativeRaw<UNROLL, DPL, D, KvT>", load_args="kc, vc")
PACKED = dict(raw="PackedRaw<UNROLL, DPL, D, K_BITS, V_BITS, GROUP>", load_args="kc, ks, ko, vc, vs, vo")


def split_source(packed: bool) -> str:
    source = kernel_source("cuda_lane_split.cu")
    for key, text in (PACKED if packed else NATIVE).items():
        source = source.replace("{" + key + "}", text)
    return source


@lru_cache(maxsize=None)
def _split_kernel(packed: bool, template: tuple):
    """The lane-group split kernel for one template, its constants baked in (launch.baked)."""
    suffix, prefix = baked(template)
    return compile_lane_split(mx.fast.cuda_kernel, packed, prefix + nvrtc_text(split_source(packed)),
                              nvrtc_text(kernel_source("cuda_lane.cuh")), suffix)


@lru_cache(maxsize=None)
def merge_kernel(template: tuple):
    """The merge kernel both CUDA split kernels share, for one template (baked in)."""
    suffix, prefix = baked(template)
    return compile_merge(mx.fast.cuda_kernel, prefix + nvrtc_text(kernel_source("cuda_merge.cu")), suffix,
                         header=nvrtc_text(kernel_source("cuda_lane.cuh")))


def launch(plan: LaunchPlan) -> mx.array:
    """Run the split kernel the plan names ("lane", "mma" or "mma_native") and the merge kernel; returns
    [B, Hq, L, Dv]. The kernels are compiled per template with its constants in their source
    (launch.baked: no template arguments to convert on each call), found once per plan."""
    kernels = plan.kernels
    if "split" not in kernels:
        split_template = tuple(plan.split_template)
        if plan.kernel == "mma":
            split = cuda_mma.split_kernel(plan.shared_memory, plan.threads if plan.min_blocks else 0,
                                          plan.min_blocks, split_template)
        elif plan.kernel == "mma_native":
            split = cuda_mma.native_split_kernel(plan.shared_memory, split_template)
        else:
            split = _split_kernel(plan.packed, split_template)
        kernels.update(split=split, merge=merge_kernel(tuple(plan.merge_template)))
    return run_split_merge(plan, kernels["split"], kernels["merge"], templated=False)
