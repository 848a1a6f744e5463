"""LaunchPlan, and the two launches (split, merge) both direct backends run from one.

kernels/direct.py builds plans; kernels/cuda.py and kernels/metal.py compile the kernels and
call run_split_merge with them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

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


def compile_lane_split(factory, packed: bool, source: str, header: str, suffix: str = ""):
    """The lane-group split kernel from `factory` (mx.fast.cuda_kernel or metal_kernel);
    suffix: appended to its name (a CUDA variant with its constants baked in, baked())."""
    return factory(name=f"kvstore_paged_split_{'packed' if packed else 'native'}{suffix}",
                   input_names=split_input_names(packed), output_names=SPLIT_OUTPUTS,
                   source=source, header=header)


def compile_merge(factory, source: str, suffix: str = "", **header):
    """The merge kernel from `factory`; header="..." where the backend's merge needs one."""
    return factory(name=f"kvstore_paged_merge{suffix}", input_names=MERGE_INPUTS,
                   output_names=MERGE_OUTPUTS, source=source, **header)


# mx.fast.cuda_kernel's names for the template dtypes (MLX's dtype_to_cuda_type)
CUDA_TYPES = {mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}


def baked(template) -> tuple[str, str]:
    """(name suffix, body prefix) of a CUDA kernel variant with `template`'s constants written
    into its source: the lines mx.fast.cuda_kernel itself writes at the head of the kernel body
    for a template (`constexpr int D = 128;`, `constexpr bool CAUSAL = false;`,
    `using KvT = __nv_bfloat16;`), so the kernel is the same code, but written once per variant
    instead of on every call, where converting and formatting ~20 template arguments was a
    good part of the ~16-25 us one call cost on the H200 host (issue 22). The suffix (a digest
    of the constants) keeps MLX's compiled-module cache, keyed by kernel name, per variant."""
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        else:
            lines.append(f"  using {name} = {CUDA_TYPES[value]};")
    prefix = "\n".join(lines) + "\n\n"
    return "_" + hashlib.blake2s(prefix.encode(), digest_size=8).hexdigest(), prefix


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
    signs: mx.array | None = None  # the split kernels' rotation signs (direct.rotation_signs)
    plane_names: tuple = ()  # the planes the split kernels read, in their input order
    shared_memory: int = 0  # dynamic shared bytes of the split kernel (0: static only)
    min_blocks: int = 0  # > 0: the split kernel's __launch_bounds__ minimum blocks per SM
    # how the splits follow from the context lengths (kernels.direct.SplitRule), for respan
    split_rule: object = None
    # the backend's compiled kernels for this plan's templates, found on its first launch,
    # shared with every per-call copy (with_inputs) and every respanned plan (respanned)
    kernels: dict = field(default_factory=dict)
    # the launches' arguments but their inputs (run_split_merge), shared with the per-call copies
    arguments: dict = field(default_factory=dict)

    def with_inputs(self, split_inputs: list, sinks: mx.array) -> LaunchPlan:
        """This plan with one call's arrays: a shallow copy of its attributes (every layer of
        a decode step takes one; dataclasses.replace re-runs __init__ over every field, which
        cost ~10 us per layer and step on the H200 host)."""
        plan = object.__new__(LaunchPlan)
        plan.__dict__.update(self.__dict__)
        plan.split_inputs = split_inputs
        plan.sinks = sinks
        return plan

    def respanned(self, num_splits: int, meta: mx.array) -> LaunchPlan:
        """This plan for other context lengths (kernels.direct.respan): its own splits,
        per-call scalars and launch arguments, the same templates and compiled kernels."""
        plan = object.__new__(LaunchPlan)
        plan.__dict__.update(self.__dict__)
        plan.num_splits = num_splits
        plan.meta = meta
        plan.partial_shape = (self.partial_shape[0], num_splits)
        plan.arguments = {}
        return plan


def run_split_merge(plan: LaunchPlan, split_kernel, merge_kernel, *, templated: bool = True) -> mx.array:
    """Split-K partials (output [.., head_dim] and the running max/sum [.., 2], float32),
    then the merge into [B, Hq, L, Dv]. The kernels are the backend's own
    (mx.fast.cuda_kernel or mx.fast.metal_kernel objects); templated False: they were
    compiled with the plan's templates baked in (baked()), and get none. The launches'
    other arguments are made once per plan (launch_arguments) and shared by its copies."""
    arguments = plan.arguments.get(templated)
    if arguments is None:
        arguments = plan.arguments[templated] = launch_arguments(plan, templated)
    split_arguments, merge_arguments = arguments
    part_o, part_ml = split_kernel(inputs=plan.split_inputs, **split_arguments)
    (result,) = merge_kernel(inputs=[part_o, part_ml, plan.sinks, plan.meta], **merge_arguments)
    return result


def launch_arguments(plan: LaunchPlan, templated: bool = True) -> tuple[dict, dict]:
    """The split and merge kernels' arguments but their inputs, as run_split_merge passes them."""
    split = dict(
        template=plan.split_template if templated else [],
        grid=(plan.num_splits * plan.threads, plan.grid_y, plan.batch),
        threadgroup=(plan.threads, 1, 1),
        output_shapes=[plan.partial_shape + (plan.head_dim,), plan.partial_shape + (2,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    merge = dict(
        template=plan.merge_template if templated else [],
        grid=(plan.partial_shape[0] * plan.head_dim, 1, 1),
        threadgroup=(plan.head_dim, 1, 1),
        output_shapes=[plan.output_shape],
        output_dtypes=[plan.output_dtype],
    )
    return split, merge
