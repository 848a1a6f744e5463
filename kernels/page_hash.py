"""The store's page checksum computed by the GPU: page_hashes(rows, row_nbytes, lengths).

Every page record carries the xxh3-128 of its stored bytes (kvstore/pages.py), and every
read checks it. A restore onto a CUDA GPU copies the pages into host staging that the
device then reads over the bus (engine/pool.py write_pages); hashing them on the host
first was about half of that restore's host time (H200, 1 GiB: xxh3 37 ms and the copy
32 ms on 8 threads, docs/benchmarks.md). Here the GPU hashes the pages from the copy it
already made in its own memory, and the store compares the results with the records'
checksums before the restore returns (kvstore.deferred.DeferredPages.settle).

kernels/page_hash.cu runs kernels/xxh3.cuh with eight threads per page (one accumulator
lane each). It covers pages of at least MIN_NBYTES bytes (XXH3's long-input path);
shorter ones come back as (0, 0) and the store verifies those on the host. The reference
is python-xxhash (the algorithm's own implementation): tests/kernels/test_page_hash.py
compares the device kernel with it on CUDA, and the same .cuh compiled for the host with
it everywhere, tolerance 0.

Cost model: one read of the rows from device memory, about 1 GiB per millisecond-ish at
HBM speed with 8 threads per page (not measured alone; the restore's figures are in
docs/benchmarks.md).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import mlx.core as mx

from kernels.errors import BackendUnavailable
from kernels.launch import baked
from kernels.quantize import cuda_available
from kernels.sources import kernel_source, nvrtc_text

MIN_NBYTES = 241  # KVSTORE_XXH3_MIN_NBYTES: XXH3 hashes shorter inputs another way
THREADS = 256  # per block: 32 pages of 8 lanes


def page_hashes(rows: mx.array, row_nbytes: int, lengths: Sequence[int]) -> mx.array:
    """rows: uint8, holding len(lengths) rows of row_nbytes bytes one after another (more
    bytes after them are ignored); row i's page is its first lengths[i] bytes (at most
    row_nbytes). Returns [len(lengths), 2] uint64, lazy: (high, low) of each page's
    xxh3-128, (0, 0) where a page is shorter than MIN_NBYTES. CUDA only."""
    if not cuda_available():
        raise BackendUnavailable("page_hashes runs on a CUDA GPU only; hash on the host elsewhere")
    if any(n > row_nbytes for n in lengths):
        raise ValueError(f"a page of {max(lengths)} bytes does not fit rows of {row_nbytes}")
    if rows.dtype != mx.uint8 or rows.size < len(lengths) * row_nbytes:
        raise ValueError(f"rows must be uint8 of at least {len(lengths) * row_nbytes} bytes, "
                         f"got {rows.dtype} of {rows.size}")
    count = len(lengths)
    if count == 0:
        return mx.zeros((0, 2), mx.uint64)
    threads = count * 8
    (hashes,) = _kernel(row_nbytes)(
        inputs=[rows.reshape(-1), mx.array(list(lengths), dtype=mx.uint32)],
        grid=(-(-threads // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(count, 2)],
        output_dtypes=[mx.uint64])
    return hashes


@lru_cache(maxsize=64)
def _kernel(row_nbytes: int):
    """kernels/page_hash.cu for one row pitch, baked in (launch.baked)."""
    suffix, prefix = baked((("ROW", row_nbytes),))
    return mx.fast.cuda_kernel(
        name="kvstore_page_hashes" + suffix,
        input_names=["rows", "lengths"],
        output_names=["hashes"],
        source=prefix + nvrtc_text(kernel_source("page_hash.cu")),
        header=nvrtc_text(kernel_source("xxh3.cuh")),
    )


__all__ = ["MIN_NBYTES", "page_hashes"]
