"""BlockPool: one layer's arena of fixed-size blocks, shared by every sequence of that layer.

The arena is a set of planes, each [num_blocks, kv_heads, block_size, width] (see
kernels/layout.py for what the planes mean). A block holds block_size tokens of one
layer. Sequences own blocks through reference counts: a block forked into two caches
has count 2 and is copied (copy-on-write) by whichever cache writes into it first; a
block pinned by a page snapshot likewise cannot change until the snapshot is released.

The free list is LIFO so the layout is deterministic: a fresh pool hands out 0, 1, 2...
and the most recently freed block is reused first. When the list is empty the arena
grows by `growth` times, up to `max_blocks`; past that, allocate raises PoolExhausted
before it changes anything.

Cost of growth: one copy of the arena (mx.concatenate), amortized by doubling.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from engine.errors import PoolExhausted
from engine.formats import PageSpec, require_paged
from engine.pagecopy import (
    DeferredCopies,
    DeviceStaging,
    PageCopies,
    Region,
    device_copy,
    host_view,
    page_regions,
)


class BlockPool:
    def __init__(self, spec: PageSpec, num_blocks: int = 16, *, max_blocks: int | None = None,
                 growth: float = 2.0):
        if num_blocks < 1:
            raise ValueError("a pool starts with at least one block")
        if max_blocks is not None and max_blocks < num_blocks:
            raise ValueError(f"max_blocks {max_blocks} < num_blocks {num_blocks}")
        if growth <= 1.0:
            raise ValueError("growth must be > 1")
        require_paged(spec.format)
        self.spec = spec
        self.max_blocks = max_blocks
        self.growth = growth
        self.planes: dict[str, mx.array] = {
            name: mx.zeros(self._plane_shape(name, num_blocks), spec.plane_dtypes[name])
            for name in spec.plane_names
        }
        mx.eval(self.planes)
        self._refs: list[int] = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._staging = DeviceStaging()  # device backends only: pages on their way in

    def _plane_shape(self, name: str, num_blocks: int) -> tuple[int, int, int, int]:
        spec = self.spec
        return (num_blocks, spec.kv_heads, spec.block_size_tokens, spec.plane_widths[name])

    # -- counters (admission reads these) -----------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._refs)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus the blocks growth may still add."""
        cap = self.max_blocks if self.max_blocks is not None else math.inf
        return int(min(cap - self.num_blocks, 2**62)) + self.num_free_blocks

    @property
    def block_nbytes(self) -> int:
        return self.spec.block_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole arena, free blocks included."""
        return self.num_blocks * self.block_nbytes

    @property
    def used_nbytes(self) -> int:
        return self.num_used_blocks * self.block_nbytes

    def refcount(self, block: int) -> int:
        return self._refs[block]

    # -- ownership ----------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """`count` blocks, each with reference count 1. All or nothing."""
        if count <= 0:
            return []
        if count > self.num_free_blocks:
            self._grow(count - self.num_free_blocks)
        ids = [self._free.pop() for _ in range(count)]
        for block in ids:
            assert self._refs[block] == 0, f"block {block} on the free list has {self._refs[block]} refs"
            self._refs[block] = 1
        return ids

    def incref(self, blocks: list[int]) -> None:
        for block in blocks:
            assert self._refs[block] > 0, f"incref of free block {block}"
            self._refs[block] += 1

    def decref(self, blocks: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back on the free
        list so that the first of them is the next one handed out."""
        for block in reversed(blocks):
            assert self._refs[block] > 0, f"decref of free block {block}"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)

    def _grow(self, shortfall: int) -> None:
        cap = self.max_blocks if self.max_blocks is not None else math.inf
        old = self.num_blocks
        if old + shortfall > cap:
            raise PoolExhausted(
                f"pool of {old} blocks ({self.num_free_blocks} free, cap {self.max_blocks}) "
                f"cannot provide {shortfall + self.num_free_blocks} blocks",
                requested=shortfall + self.num_free_blocks, available=self.num_available_blocks)
        new = int(min(cap, max(old + shortfall, math.ceil(old * self.growth))))
        for name in self.spec.plane_names:
            extra = mx.zeros(self._plane_shape(name, new - old), self.spec.plane_dtypes[name])
            self.planes[name] = mx.concatenate([self.planes[name], extra], axis=0)
        mx.eval(self.planes)
        self._refs.extend([0] * (new - old))
        # Older free blocks stay on top; the new ones come after them, lowest id first.
        self._free[:0] = list(range(new - 1, old - 1, -1))

    # -- data ---------------------------------------------------------------------
    def write(self, block: int, start: int, planes: dict[str, mx.array]) -> None:
        """Write planes [H, n, width] (or [1, H, n, width]) into token slots [start, start + n)
        of a block.

        The caller owns the block alone (reference count 1): shared blocks are copied
        first (see copy_block), which is what keeps forks and snapshots unchanged.
        A 4-d plane is one SliceUpdate node; a 3-d one also costs a Broadcast (MLX 0.32
        expands the update for the integer block index): a decode step writes every layer.
        """
        assert self._refs[block] == 1, f"write into block {block} with {self._refs[block]} refs"
        for name, values in planes.items():
            if values.ndim == 4:
                stop = start + values.shape[2]
                self.planes[name][block:block + 1, :, start:stop, :] = values
                continue
            stop = start + values.shape[1]
            self.planes[name][block, :, start:stop, :] = values

    def write_blocks(self, blocks: list[int], planes: dict[str, mx.array]) -> None:
        """Write whole blocks at once: planes [len(blocks), H, block_size, width], as
        write_pages writes them (_write_runs: a slice update per run of consecutive
        ids, which a prefill chunk's fresh blocks are; a scatter where they are not)."""
        for block in blocks:
            assert self._refs[block] == 1, f"write into block {block} with {self._refs[block]} refs"
        runs = _consecutive_runs(blocks)
        ids = mx.array(blocks, dtype=mx.int32) if len(runs) > MAX_SLICE_RUNS else None
        for name, values in planes.items():
            self._write_runs(name, values, runs, ids)

    def _write_runs(self, name: str, values: mx.array, runs: list[tuple[int, int, int]],
                    ids: mx.array | None) -> None:
        """values [len(blocks), ...] into plane `name` at the blocks whose runs
        (_consecutive_runs) are given: one scatter by `ids` when given, else one slice
        update per run. MLX's CUDA scatter is slow: on the H200 a 2048-token chunk of one
        8B-shaped layer spent 0.48 ms writing its two native planes (8 MiB) by scatter
        (docs/kernels.md, Prefill)."""
        if ids is not None:
            self.planes[name][ids] = values
            return
        for first, start, count in runs:
            if count == self.num_blocks:  # a slice update of all of it would alias values
                self.planes[name] = device_copy(values)
            else:
                self.planes[name][first : first + count] = values[start : start + count]

    def copy_block(self, source: int, target: int) -> None:
        """Copy every plane of one block into another (the copy of copy-on-write)."""
        assert self._refs[target] == 1, f"copy into block {target} with {self._refs[target]} refs"
        for name in self.spec.plane_names:
            # a[b, :], not a[b]: an integer index alone is a gather copy in MLX 0.32
            self.planes[name][target, :] = self.planes[name][source, :]

    def host_planes(self) -> dict[str, np.ndarray]:
        """name -> writable uint8 host view [num_blocks, H, block_size, row bytes] of the
        planes (evaluated first; engine/pagecopy.py). Valid until the planes change:
        write only blocks you own, and before the next MLX write into this pool."""
        return {name: host_view(plane) for name, plane in self.planes.items()}

    def write_pages(self, blocks: list[int], pages: list, counts: list[int],
                    later: DeferredCopies | None = None) -> None:
        """Pages (bytes, page layout, counts[i] tokens each) into whole blocks, for
        device backends (direct_writes() False): each page copied once, on the copy
        threads, into its own row of the pool's DeviceStaging buffer (row i holds page
        i's bytes as they are, one contiguous copy, and is block_nbytes long), then per
        plane one slice update per run of consecutive block ids (one scatter when the
        ids are scattered: MLX's CUDA scatter is far slower than a copy,
        docs/benchmarks.md) reads its strided part of every row on the device. A short
        last page (fewer tokens than a block: its planes sit closer together) is then
        written again from its own row, by its token count. The device work is
        started, not awaited: the caller's next layer is copied on the host meanwhile;
        the staging buffer is rewritten only after it (DeviceStaging.take waits), and
        anything that reads the planes is ordered after it by MLX.

        With `later` (the fused read of a restore, engine/restore.py), the pages are
        its stand-ins: the copies into staging are only recorded in it (each a whole
        page into its row), and the device work is neither started nor awaited,
        since it must read the staging after the pages land. The caller runs the read,
        then evaluates self.planes. Where `later.hash_on_device`, the device first
        copies the rows into memory of its own in one transfer, the planes read that
        copy, and later.hash_rows records it: the caller hashes it
        (DeferredCopies.device_hashes) and has the store settle the hashes."""
        for block in blocks:
            assert self._refs[block] == 1, f"write into block {block} with {self._refs[block]} refs"
        spec = self.spec
        n, row = len(blocks), spec.block_nbytes
        staged, host = self._staging.take(n * row)
        rows = host[: n * row].reshape(n, row)
        copies = PageCopies() if later is None else later
        for index, page in enumerate(pages):
            copies.add_page(page, rows[index])
        if later is None:
            copies.run()
        staged = staged[: n * row]
        if later is not None and later.hash_on_device:
            # one bulk transfer into device memory, which the device hashes (the store
            # settles the hashes before the restore returns) and the planes read
            staged = device_copy(staged)
            later.hash_rows(self, pages, staged, row)
        runs = _consecutive_runs(blocks)
        ids = mx.array(blocks, dtype=mx.int32) if len(runs) > MAX_SLICE_RUNS else None
        for r in page_regions(spec, spec.block_size_tokens):  # plane r of every row
            self._write_runs(r.name, self._staged_plane(staged, r, n, row), runs, ids)
        for index, count in enumerate(counts):
            if count == spec.block_size_tokens:
                continue
            block = blocks[index]
            for r in page_regions(spec, count):  # the short page's planes, from its row
                plane = self._staged_plane(staged[index * row : (index + 1) * row], r, 1, row)
                self.planes[r.name][block : block + 1, :, :count, :] = plane
        written = list(self.planes.values())
        self._staging.hold(written)
        if later is None:
            mx.async_eval(written)

    def _staged_plane(self, staged: mx.array, r: Region, blocks: int, row: int) -> mx.array:
        """Plane r of `blocks` staging rows of `row` bytes each (staged: uint8, those
        rows only), as the plane's dtype and shape [blocks, H, r.tokens, width]: a view,
        no copy. The dtype view is taken of the contiguous rows, then sliced: in MLX
        0.32 a dtype view of a strided slice is a copy (on CUDA a fresh device buffer
        filled over the bus, then read again by the slice update: 8B-shaped restore at
        8K, TTFT 167-202 ms against 114-131 ms for the previous, plane-major staging)."""
        dtype = self.spec.plane_dtypes[r.name]
        size = dtype.size
        if row % size or r.start % size:  # never for this project's formats; right anyway
            raw = staged.reshape(blocks, row)[:, r.start : r.start + r.nbytes]
            raw = raw if dtype == mx.uint8 else raw.view(dtype)
        else:
            raw = (staged if dtype == mx.uint8 else staged.view(dtype)).reshape(blocks, row // size)
            raw = raw[:, r.start // size : (r.start + r.nbytes) // size]
        return raw.reshape(blocks, self.spec.kv_heads, r.tokens, self.spec.plane_widths[r.name])


# Blocks written by slice updates, one per run of consecutive ids, while they make at
# most this many runs; one scatter beyond that (each slice update is a graph node).
MAX_SLICE_RUNS = 4


def _consecutive_runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(first block id, index in `blocks`, length) of each run of consecutive ids."""
    runs = []
    for index, block in enumerate(blocks):
        if runs and runs[-1][0] + runs[-1][2] == block:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((block, index, 1))
    return runs
