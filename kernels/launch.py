"""LaunchPlan, and the two launches (split, merge) both direct backends run from one.

kernels/direct.py builds plans; kernels/cuda.py and kernels/metal.py compile the kernels and
call run_split_merge with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

# The kernels' argument names, in the order LaunchPlan.split_inputs and run_split_merge pass
# the arrays (the names the kernel sources use).
SPLIT_OUTPUTS = ["part_o", "part_ml"]
MERGE_INPUTS = ["part_o", "part_ml", "sinks", "meta"]
MERGE_OUTPUTS = ["result"]


def split_input_names(packed: bool) -> list[str]:
    """The split kernels' inputs: queries, rotation signs, the layout's planes, the block
    tables and the per-call scalars."""
    planes = ["kc", "ks", "ko", "vc", "vs", "vo"] if packed else ["kc", "vc"]
    return ["queries", "signs", *planes, "block_tables", "meta"]


def compile_lane_split(factory, packed: bool, source: str, header: str):
    """The lane-group split kernel from `factory` (mx.fast.cuda_kernel or metal_kernel)."""
    return factory(name=f"kvstore_paged_split_{'packed' if packed else 'native'}",
                   input_names=split_input_names(packed), output_names=SPLIT_OUTPUTS,
                   source=source, header=header)


def compile_merge(factory, source: str, **header):
    """The merge kernel from `factory`; header="..." where the backend's merge needs one."""
    return factory(name="kvstore_paged_merge", input_names=MERGE_INPUTS, output_names=MERGE_OUTPUTS,
                   source=source, **header)


@dataclass
class LaunchPlan:
    """Everything cuda.launch / metal.launch need for one call."""

    packed: bool
    kernel: str  # "lane" (kernels/cuda.py, kernels/metal.py), "mma" or "mma_native" (kernels/cuda_mma.py)
    batch: int
    head_dim: int
    num_splits: int
    grid_y: int  # Hkv * row chunks
    threads: int
    split_inputs: list
    split_template: list
    merge_template: list
    meta: mx.array
    sinks: mx.array
    partial_shape: tuple  # (B * Hq * L, num_splits)
    output_shape: tuple
    output_dtype: mx.Dtype
    shared_memory: int = 0  # dynamic shared bytes of the split kernel (0: static only)
    min_blocks: int = 0  # > 0: the split kernel's __launch_bounds__ minimum blocks per SM

    def with_inputs(self, split_inputs: list, sinks: mx.array) -> LaunchPlan:
        """This plan with one call's arrays: a shallow copy of its attributes (every layer of
        a decode step takes one; dataclasses.replace re-runs __init__ over every field, which
        cost ~10 us per layer and step on the H200 host)."""
        plan = object.__new__(LaunchPlan)
        plan.__dict__.update(self.__dict__)
        plan.split_inputs = split_inputs
        plan.sinks = sinks
        return plan


def run_split_merge(plan: LaunchPlan, split_kernel, merge_kernel) -> mx.array:
    """Split-K partials (output [.., head_dim] and the running max/sum [.., 2], float32),
    then the merge into [B, Hq, L, Dv]. The kernels are the backend's own
    (mx.fast.cuda_kernel or mx.fast.metal_kernel objects)."""
    part_o, part_ml = split_kernel(
        inputs=plan.split_inputs,
        template=plan.split_template,
        grid=(plan.num_splits * plan.threads, plan.grid_y, plan.batch),
        threadgroup=(plan.threads, 1, 1),
        output_shapes=[plan.partial_shape + (plan.head_dim,), plan.partial_shape + (2,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (result,) = merge_kernel(
        inputs=[part_o, part_ml, plan.sinks, plan.meta],
        template=plan.merge_template,
        grid=(plan.partial_shape[0] * plan.head_dim, 1, 1),
        threadgroup=(plan.head_dim, 1, 1),
        output_shapes=[plan.output_shape],
        output_dtypes=[plan.output_dtype],
    )
    return result
