"""The store's page checksum (xxh3-128) as the GPU computes it: kernels/xxh3.cuh, and its
CUDA launcher kernels/page_hash.py, against python-xxhash, tolerance 0.

The .cuh is plain C++ outside NVRTC, so here it is built with the host compiler into a
small library (one function: the eight lanes one after another, then the merge) and
compared with xxhash over every length class the long-input path has (one partial block,
block boundaries, an unaligned last stripe, unaligned starts, 1 MiB pages). The CUDA test
runs the kernel itself (eight threads per page, lanes gathered by shuffles) where a CUDA GPU
is present, and skips saying so elsewhere.
"""

from __future__ import annotations

import ctypes
import subprocess

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from kernels import page_hash
from kernels.quantize import cuda_available
from kernels.sources import PACKAGE
from tests.kernels.metal_syntax import find_compiler

COMPILER = find_compiler()
needs_compiler = pytest.mark.skipif(
    COMPILER is None,
    reason="no C++ compiler (clang++, g++ or c++ on PATH, or $KVSTORE_CXX): the host build of "
           "kernels/xxh3.cuh is not checked; apt-get install g++ to run it")
needs_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (mlx[cuda]): the "
                                "page hash kernel runs there only")

HARNESS = r"""
extern "C" void kvstore_xxh3_128(const unsigned char* input, unsigned long long len,
                                 unsigned long long* high, unsigned long long* low) {
  kvstore_u64 acc[8];
  for (int lane = 0; lane < 8; ++lane) acc[lane] = kvstore_xxh3_lane(input, len, lane);
  kvstore_xxh3_finish(acc, len, high, low);
}
"""

# every branch of the long-input loop: one partial block (241..1024), exactly one or more
# whole blocks (the last partial block then holds 0..15 stripes), lengths that are not a
# multiple of 8 (the last stripe unaligned), and pages as a restore moves them
LENGTHS = [241, 242, 255, 256, 257, 320, 1000, 1023, 1024, 1025, 1088, 1089, 2048, 2049, 3071,
           4096 + 7, 65536, 65536 + 13, 2**20, 2**20 + 3]


@pytest.fixture(scope="module")
def host_xxh3(tmp_path_factory):
    if COMPILER is None:
        pytest.skip("no C++ compiler")
    where = tmp_path_factory.mktemp("xxh3")
    source = where / "xxh3_host.cpp"
    source.write_text(PACKAGE.text("xxh3.cuh") + HARNESS, encoding="utf-8")
    library = where / "libxxh3_host.so"
    subprocess.run([COMPILER, "-std=c++17", "-O2", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True, capture_output=True, text=True)
    function = ctypes.CDLL(str(library)).kvstore_xxh3_128
    function.argtypes = [ctypes.c_void_p, ctypes.c_ulonglong,
                         ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong)]

    def digest(data: np.ndarray) -> bytes:
        high, low = ctypes.c_ulonglong(), ctypes.c_ulonglong()
        function(data.ctypes.data, data.nbytes, ctypes.byref(high), ctypes.byref(low))
        return high.value.to_bytes(8, "big") + low.value.to_bytes(8, "big")

    return digest


@needs_compiler
@pytest.mark.parametrize("start", [0, 1, 3])
def test_the_host_build_equals_xxhash(host_xxh3, start):
    rng = np.random.default_rng(start)
    for length in LENGTHS:
        data = rng.integers(0, 256, start + length, dtype=np.uint8)[start:]
        assert host_xxh3(data) == xxhash.xxh3_128_digest(data.tobytes()), length


@needs_compiler
def test_the_host_build_sees_one_flipped_bit(host_xxh3):
    data = np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)
    before = host_xxh3(data)
    for at in (0, 1023, 1024, 4095):
        data[at] ^= 1
        assert host_xxh3(data) != before, at
        data[at] ^= 1
    assert host_xxh3(data) == before


def test_page_hashes_refuses_a_machine_without_cuda():
    if cuda_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(page_hash.BackendUnavailable):
        page_hash.page_hashes(mx.zeros((4096,), mx.uint8), 1024, [1024] * 4)


@needs_cuda
def test_the_kernel_equals_xxhash():
    rng = np.random.default_rng(11)
    row = 2**20 + 64
    # long pages of every class, short ones (hashed on the host: (0, 0) here), a row pitch
    # that is not a multiple of 8
    for pitch, lengths in ((row, LENGTHS + [240, 100, 1]), (1089, [1089, 241, 1000, 7])):
        rows = rng.integers(0, 256, pitch * len(lengths), dtype=np.uint8)
        hashes = np.array(page_hash.page_hashes(mx.array(rows), pitch, lengths))
        for i, length in enumerate(lengths):
            got = int(hashes[i, 0]).to_bytes(8, "big") + int(hashes[i, 1]).to_bytes(8, "big")
            page = rows[i * pitch : i * pitch + length].tobytes()
            want = xxhash.xxh3_128_digest(page) if length >= page_hash.MIN_NBYTES else bytes(16)
            assert got == want, (pitch, i, length)
