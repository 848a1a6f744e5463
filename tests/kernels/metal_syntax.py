"""A syntax and type check of the Metal kernels with a host C++ compiler.

There is no Metal compiler off macOS, so the Metal sources would rot unseen. This builds
the translation unit mx.fast.metal_kernel would build for a plan (MLX's write_signature:
header, `template <...>` from the plan's template entries, `[[kernel]] void name(...)` with
one parameter per input, its `_shape` where the body names it, the outputs and the
thread-position attributes the body names; then the explicit instantiation with the plan's
values) and compiles it with `-fsyntax-only` against metal_stand_ins.h, which declares the
metal_stdlib names the kernels use. The instantiation makes the compiler check the template
body itself, not only the names outside it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from kernels import metal
from kernels.launch import MERGE_INPUTS, MERGE_OUTPUTS, SPLIT_OUTPUTS, LaunchPlan, split_input_names
from kernels.sources import PACKAGE, SourceTree

STAND_INS = Path(__file__).with_name("metal_stand_ins.h")
COMPILERS = ("clang++", "g++", "c++")
CXX_ENV = "KVSTORE_CXX"  # a compiler to use instead of the first of COMPILERS on PATH
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX passes smaller inputs in the constant address space

# MLX's get_type_string
TYPE_NAMES = {
    mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.int32: "int32_t",
    mx.uint32: "uint32_t", mx.uint8: "uint8_t", mx.int8: "int8_t", mx.int64: "int64_t",
    mx.uint16: "uint16_t", mx.int16: "int16_t", mx.bool_: "bool",
}

# MLX's metal_attributes: the names a body may use and their types
ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint", "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3", "grid_origin": "uint3", "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint", "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint", "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint", "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint", "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3", "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3", "threads_per_simdgroup": "uint", "threads_per_threadgroup": "uint3",
}


@dataclass(frozen=True)
class Argument:
    """One kernel input as write_signature sees it: its name, dtype, size and rank."""

    name: str
    dtype: mx.Dtype
    size: int
    ndim: int


def find_compiler() -> str | None:
    """$KVSTORE_CXX, else the first of clang++, g++, c++ on PATH; None if there is none."""
    wanted = os.environ.get(CXX_ENV)
    if wanted:
        return shutil.which(wanted)
    for name in COMPILERS:
        found = shutil.which(name)
        if found:
            return found
    return None


def _template_value(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"  # MLX streams bools as integers
    if isinstance(value, int):
        return str(value)
    return TYPE_NAMES[value]


def kernel_unit(name: str, header: str, body: str, inputs: list[Argument],
                outputs: list[tuple[str, mx.Dtype]], template: list[tuple]) -> str:
    """The source MLX's metal_kernel compiles for these arguments (write_signature),
    header first."""
    return header + "\n" + kernel_function(name, body, inputs, outputs, template)


def kernel_function(name: str, body: str, inputs: list[Argument],
                    outputs: list[tuple[str, mx.Dtype]], template: list[tuple]) -> str:
    """kernel_unit without the header: the kernel function and its instantiation."""
    lines = []
    if template:
        kinds = ", ".join(("bool " if isinstance(v, bool) else "int " if isinstance(v, int) else "typename ") + n
                          for n, v in template)
        lines.append(f"template <{kinds}>")
    params = []
    for arg in inputs:
        space = "constant" if arg.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arg.ndim == 0 else "*"
        params.append(f"  const {space} {TYPE_NAMES[arg.dtype]}{ref} {arg.name}")
        if arg.ndim and f"{arg.name}_shape" in body:
            params.append(f"  const constant int* {arg.name}_shape")
        if arg.ndim and f"{arg.name}_strides" in body:
            params.append(f"  const constant int64_t* {arg.name}_strides")
        if arg.ndim and f"{arg.name}_ndim" in body:
            params.append(f"  const constant int& {arg.name}_ndim")
    params += [f"  device {TYPE_NAMES[dtype]}* {out}" for out, dtype in outputs]
    params += [f"  {kind} {attr} [[{attr}]]" for attr, kind in ATTRIBUTES.items() if attr in body]
    lines.append(f"[[kernel]] void {name}(\n" + ",\n".join(params) + ") {")
    lines += [body, "}"]
    if template:
        values = ", ".join(_template_value(v) for _, v in template)
        # MLX writes `template [[host_name("...")]] [[kernel]] decltype(...) ...;`: Metal's
        # front end takes attributes there, clang and gcc do not, so they are left out
        lines.append(f"template decltype({name}<{values}>) {name}<{values}>;")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Unit:
    """One kernel's translation unit: the header MLX puts first, then the function."""

    header: str
    function: str

    @property
    def text(self) -> str:
        return self.header + "\n" + self.function


def plan_units(plan: LaunchPlan, tree: SourceTree = PACKAGE) -> dict[str, Unit]:
    """The split and merge translation units of one lane-group plan."""
    assert plan.kernel == "lane", "the Metal port has the lane-group kernel only"
    header = tree.text(metal.HEADER)
    split_inputs = [Argument(n, a.dtype, a.size, a.ndim)
                    for n, a in zip(split_input_names(plan.packed), plan.split_inputs, strict=True)]
    split = Unit(header, kernel_function("kvstore_paged_split", metal.split_source(plan.packed, tree),
                                         split_inputs, [(n, mx.float32) for n in SPLIT_OUTPUTS],
                                         plan.split_template))
    partials = plan.partial_shape[0] * plan.partial_shape[1]
    merge_shapes = [(partials * plan.head_dim, 3), (partials * 2, 3), (plan.sinks.size, 1),
                    (plan.meta.size, 1)]
    merge_inputs = [Argument(n, mx.float32 if n != "meta" else mx.int32, size, ndim)
                    for n, (size, ndim) in zip(MERGE_INPUTS, merge_shapes, strict=True)]
    merge = Unit("", kernel_function("kvstore_paged_merge", tree.text(metal.MERGE), merge_inputs,
                                     [(n, plan.output_dtype) for n in MERGE_OUTPUTS], plan.merge_template))
    return {"split": split, "merge": merge}


def check_unit(compiler: str, source: str) -> subprocess.CompletedProcess:
    """compiler -fsyntax-only over source, with the stand-ins force-included."""
    # Metal's attributes mean nothing to a host compiler: silence those warnings only
    quiet = "-Wno-unknown-attributes" if "clang" in Path(compiler).name else "-Wno-attributes"
    command = [compiler, "-std=c++17", "-fsyntax-only", quiet, "-include", str(STAND_INS), "-x", "c++", "-"]
    return subprocess.run(command, input=source, capture_output=True, text=True, timeout=120)


def combined_unit(units: list[Unit]) -> str:
    """One source holding every unit's function (one compiler run instead of one per unit):
    each distinct header once, each function under its own name."""
    headers = list(dict.fromkeys(unit.header for unit in units))
    parts = list(headers)
    for index, unit in enumerate(units):
        name = re.search(r"\[\[kernel\]\] void (\w+)\(", unit.function).group(1)
        parts.append(re.sub(rf"\b{name}\b", f"{name}_{index}", unit.function))
    return "\n".join(parts)
