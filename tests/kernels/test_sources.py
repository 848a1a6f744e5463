"""The kernel source files: shipped as package data, includes resolved, placeholders filled.

These run everywhere (no GPU): they check the text MLX would compile, not the compiled kernel.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import stat
import tomllib
from pathlib import Path

import pytest

from kernels import cuda, metal, sources
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


# -- what the CUDA backends hand to mx.fast.cuda_kernel: an #include of a digest-named file --

INCLUDE = re.compile(r'^#include "(/[^"\n]+)"\n(// names for MLX: [\w ]+\n)?', re.MULTILINE)


def _resolved(text: str) -> str:
    """text with nvrtc_text's include lines (and the comment after them) replaced by their
    files' text, as NVRTC sees it."""
    return INCLUDE.sub(lambda match: Path(match.group(1)).read_text(encoding="utf-8"), text)


def _mlx_arguments(source: str, input_names) -> list:
    """What mx.fast.cuda_kernel adds to the kernel's signature per input: shape, strides, ndim
    where the source string names them (custom_kernel.cpp searches it when the kernel is made)."""
    return [tuple(f"{name}_{what}" in source for what in ("shape", "strides", "ndim")) for name in input_names]


@pytest.fixture
def kernel_dir(tmp_path, monkeypatch):
    directory = tmp_path / "kernels"
    monkeypatch.setenv(sources.KERNEL_DIR_VARIABLE, str(directory))
    return directory


def test_a_long_text_goes_to_mlx_as_one_include_of_a_file_named_by_its_digest(kernel_dir):
    text = kernel_source("cuda_mma_split.cu")
    line = sources.nvrtc_text(text)
    ((path, _),) = INCLUDE.findall(line)
    assert line.startswith(f'#include "{path}"\n')
    assert Path(path).parent == kernel_dir
    assert Path(path).read_text(encoding="utf-8") == text
    assert Path(path).name == hashlib.blake2s(text.encode(), digest_size=16).hexdigest() + ".cuh"
    assert stat.S_IMODE(kernel_dir.stat().st_mode) == 0o700
    # another text is another name (so another module in MLX's caches)
    assert sources.nvrtc_text(text + "\n// changed\n") != line


def test_a_file_that_no_longer_matches_its_name_is_written_again(kernel_dir):
    text = kernel_source("cuda_merge.cu")
    line = sources.nvrtc_text(text)
    ((path, _),) = INCLUDE.findall(line)
    Path(path).write_text("__global__ void planted() {}\n")
    assert sources.nvrtc_text(text) == line
    assert Path(path).read_text(encoding="utf-8") == text


def test_a_directory_other_users_can_write_is_not_used(tmp_path, monkeypatch, caplog):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(sources.KERNEL_DIR_VARIABLE, str(shared))
    text = kernel_source("cuda_merge.cu")
    with caplog.at_level("WARNING", logger="kernels.sources"):
        assert sources.nvrtc_text(text) == text
    assert "other users can write it" in caplog.text
    assert not list(shared.iterdir())


def test_inline_hands_the_whole_text(monkeypatch):
    monkeypatch.setenv(sources.KERNEL_DIR_VARIABLE, sources.INLINE)
    text = kernel_source("cuda_merge.cu")
    assert sources.nvrtc_text(text) is text


class _Recorder:
    """mx.fast.cuda_kernel's stand-in: keeps the keyword arguments of every kernel made."""

    made: list = []

    def __init__(self, **kwargs):
        self.made.append(kwargs)


def test_every_cuda_kernel_gets_short_strings_that_resolve_to_the_whole_kernel(kernel_dir, monkeypatch):
    """What each call copies and hashes in MLX (its header and source) stays under 1 KiB;
    with the includes resolved it is the text the kernel had when it was passed whole, and
    MLX gives the kernel the same arguments (the shapes its text uses: on the H200 a first
    version failed to compile, "identifier kc_shape is undefined")."""
    import mlx.core as mx

    from kernels import cuda_mma, prefill, quantize
    from kernels.attention import forget_compiled_kernels
    from kernels.launch import baked
    template = (("D", 128), ("KvT", mx.bfloat16))
    prefix = baked(template)[1]
    expected = {  # name stem: (source, header) as they were handed over before
        "kvstore_paged_split_native": (prefix + cuda.split_source(False), kernel_source("cuda_lane.cuh")),
        "kvstore_paged_split_packed": (prefix + cuda.split_source(True), kernel_source("cuda_lane.cuh")),
        "kvstore_paged_merge": (prefix + kernel_source("cuda_merge.cu"), kernel_source("cuda_lane.cuh")),
        "kvstore_paged_split_mma_native": (prefix + kernel_source("cuda_mma_native_split.cu"),
                                           kernel_source("cuda_mma.cuh")),
        "kvstore_paged_split_mma": (prefix + kernel_source("cuda_mma_split.cu"), kernel_source("cuda_mma.cuh")),
        "kvstore_quantize_write": (prefix + kernel_source("quantize.cu"), kernel_source("quantize.cuh")),
        "kvstore_quantize_rotate_write": (prefix + kernel_source("quantize_rotate.cu"),
                                          kernel_source("quantize.cuh")),
        "kvstore_dequantize_pages": (prefix + kernel_source("dequantize.cu"), kernel_source("dequantize.cuh")),
    }
    monkeypatch.setattr(mx.fast, "cuda_kernel", _Recorder)
    _Recorder.made = []
    forget_compiled_kernels()
    try:
        cuda._split_kernel(False, template)
        cuda._split_kernel(True, template)
        cuda.merge_kernel(template)
        cuda_mma.native_split_kernel(0, template)
        cuda_mma.split_kernel(0, 0, 0, template)
        quantize._cuda_kernel("quantize.cu", ("keys", "values"), template)
        quantize._cuda_kernel("quantize_rotate.cu", ("keys", "values", "signs"), template)
        prefill._dequantize_kernel(template)
    finally:
        forget_compiled_kernels()  # no stand-in stays cached
    made = {kwargs["name"].rsplit("_", 1)[0]: kwargs for kwargs in _Recorder.made}
    assert sorted(made) == sorted(expected)
    for stem, (source, header) in expected.items():
        kwargs = made[stem]
        assert len(kwargs["source"]) + len(kwargs["header"]) < 1024, stem
        assert _resolved(kwargs["source"]) == source, stem
        assert _resolved(kwargs["header"]) == header, stem
        names = kwargs["input_names"]
        assert _mlx_arguments(kwargs["source"], names) == _mlx_arguments(source, names), stem
    assert any(any(map(any, _mlx_arguments(source, made[stem]["input_names"])))
               for stem, (source, _) in expected.items()), "no kernel uses a shape: the check checks nothing"
