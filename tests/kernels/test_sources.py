"""The kernel source files: shipped as package data, includes resolved, placeholders filled.

These run everywhere (no GPU): they check the text MLX would compile, not the compiled kernel.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from kernels import cuda, metal
from kernels.sources import kernel_source, source_sections

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ROOT / "kernels"


def compiled_sources() -> dict[str, str]:
    """Every source string the backends hand to mx.fast.cuda_kernel / metal_kernel."""
    return {
        "cuda lane split, native": cuda.split_source(False),
        "cuda lane split, packed": cuda.split_source(True),
        "cuda merge": kernel_source("cuda_merge.cu"),
        "cuda header": kernel_source("cuda_lane.cuh"),
        "cuda tensor-core split": kernel_source("cuda_mma_split.cu"),
        "cuda tensor-core header": kernel_source("cuda_mma.cuh"),
        "metal split, native": metal.split_source(False),
        "metal split, packed": metal.split_source(True),
        "metal merge": kernel_source("metal_merge.metal"),
        "metal header": kernel_source("metal_common.h"),
    }


def test_every_kernel_source_file_is_package_data():
    """An installed wheel holds only what pyproject's package-data names."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kernels"]
    files = [path.name for path in KERNELS.iterdir() if path.is_file() and path.suffix != ".py"
             and not path.name.endswith(".pyc")]
    assert files, "no kernel source files found"
    missing = [name for name in files if not any(fnmatch.fnmatch(name, glob) for glob in globs)]
    assert not missing, f"kernel sources not in package-data: {missing}"


@pytest.mark.parametrize("name", list(compiled_sources()))
def test_sources_are_complete(name):
    text = compiled_sources()[name]
    assert not re.search(r'^#include "', text, re.MULTILINE), "a local include was left unresolved"
    assert not re.search(r"\{(raw|load_args|load_k|load_v)\}", text), "a template placeholder was left unfilled"


def test_split_kernels_share_one_epilogue():
    epilogue = kernel_source("split_epilogue.h")
    for name in ("cuda lane split, native", "cuda lane split, packed", "cuda tensor-core split",
                 "metal split, native", "metal split, packed"):
        assert compiled_sources()[name].endswith(epilogue), name


def test_metal_split_body_names_the_thread_attribute():
    """MLX adds a Metal attribute argument only where the body text names it; the shared
    epilogue reaches it through a macro, so the body must define that macro itself."""
    body = metal.split_source(True)
    assert "#define KV_THREAD thread_index_in_threadgroup" in body


def test_metal_load_sections():
    sections = source_sections("metal_loads.metal")
    assert sorted(sections) == ["LOAD_NATIVE_K", "LOAD_NATIVE_V", "LOAD_PACKED_K", "LOAD_PACKED_V"]
    assert all("\n" not in text and text.endswith(";") for text in sections.values())


def test_lane_split_kernels_share_queries_and_softmax():
    """The Metal port runs the CUDA lane-group kernel's own query prologue and online-softmax
    step (one text each), so the two cannot drift apart there."""
    for shared in ("split_queries.h", "split_softmax.h"):
        text = kernel_source(shared)
        for name in ("cuda lane split, native", "cuda lane split, packed", "metal split, native",
                     "metal split, packed"):
            assert text in compiled_sources()[name], (shared, name)
