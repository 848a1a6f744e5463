"""The store's page checksum computed by the GPU: page_hashes(rows, row_nbytes, lengths).

Every page record carries the xxh3-128 of its stored bytes (kvstore/pages.py), and every
read checks it. A restore onto a CUDA GPU copies the pages into host staging that the
device then reads over the bus (engine/pool.py write_pages); hashing them on the host
first was about half of that restore's host time (H200, 1 GiB: xxh3 37 ms and the copy
32 ms on 8 threads, docs/benchmarks.md). Here the GPU hashes the pages from the copy it
already made in its own memory, and the store compares the results with the records'
checksums before the restore returns (kvstore.deferred.DeferredPages.settle).

Two passes over kernels/xxh3.cuh: page_hash_blocks.cu sums what every whole 1024-byte
block of every page adds to each of the eight accumulators, one thread per (page, block,
lane), all in parallel (those sums never read an accumulator); page_hash.cu then folds
them per page and lane (add and scramble, the serial part, 8 bytes per 1 KiB) and merges
the eight lanes. (The first version, one pass with eight threads per page, gave a layer's 32
pages of an 8B-shaped model 256 threads in all, each reading 1 MiB in order; it was
replaced before it ever ran on a GPU, so the two were not compared.) Pages of at
least MIN_NBYTES bytes are covered (XXH3's long-input path); shorter ones come back as
(0, 0) and the store verifies those on the host. The reference is python-xxhash (the
algorithm's own implementation): tests/kernels/test_page_hash.py compares the kernel with it
on CUDA, and the same .cuh compiled for the host with it everywhere, tolerance 0.

Cost model: one read of the rows from device memory (each 64-byte stripe's words are read
by two lanes; the second read hits L1), plus sums of 1/128 of the rows' bytes written and
read back; two launches per call. Measured on an H100 (2026-12-07, docs/benchmarks.md):
1 GiB of 1 MiB pages in 2.50 ms as 32 calls of 32 pages (a restore's per-layer calls),
1.38 ms as one call.
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
THREADS = 256  # per threadgroup: whole warps, 8 lanes per page


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
    blocks = (row_nbytes - 1) // 1024  # whole XXH3 blocks a full row holds
    flat = rows.reshape(-1)
    lengths_array = mx.array(list(lengths), dtype=mx.uint32)
    template = (("ROW", row_nbytes), ("BLOCKS", max(1, blocks)))
    if blocks:
        (sums,) = _kernel("page_hash_blocks.cu", template)(
            inputs=[flat, lengths_array],
            grid=(_whole(count * blocks * 8), 1, 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(count * blocks * 8,)], output_dtypes=[mx.uint64])
    else:
        sums = mx.zeros((1,), mx.uint64)
    (hashes,) = _kernel("page_hash.cu", template)(
        inputs=[flat, lengths_array, sums],
        grid=(_whole(count * 8), 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(count, 2)], output_dtypes=[mx.uint64])
    return hashes


def _whole(threads: int) -> int:
    """threads rounded up to whole threadgroups (page_hash.cu's shuffles need whole warps)."""
    return -(-threads // THREADS) * THREADS


@lru_cache(maxsize=64)
def _kernel(source: str, template: tuple):
    """One of the two passes for one row pitch, its constants baked in (launch.baked)."""
    suffix, prefix = baked(template)
    first_pass = source == "page_hash_blocks.cu"
    return mx.fast.cuda_kernel(
        name=("kvstore_page_hash_blocks" if first_pass else "kvstore_page_hashes") + suffix,
        input_names=["rows", "lengths"] if first_pass else ["rows", "lengths", "sums"],
        output_names=["sums"] if first_pass else ["hashes"],
        source=prefix + nvrtc_text(kernel_source(source)),
        header=nvrtc_text(kernel_source("xxh3.cuh")),
    )


__all__ = ["MIN_NBYTES", "page_hashes"]
