"""Page bytes copied straight into memory the caller owns: pool planes, KVCache arrays.

Nouns:
  host view    a writable numpy array over an evaluated MLX array's own memory
               (memoryview(arr) aliases it; no copy). Valid on backends whose arrays
               live in host-visible memory: the CPU, Apple's unified memory and CUDA's
               managed memory (see direct_writes; a StagingBuffer is the other path).
  regions      where each plane of a page sits in the page's bytes (engine/formats.py
               gives the layout: planes concatenated, each [H, tokens, width] C order).
  PageCopies   the copies of one restore, collected while caches are laid out and
               run together on worker threads (numpy releases the GIL while it copies),
               each page copied once, from the store's verified view to its target.

Cost model (2-core CPU, 512 MiB of 1 MiB pages): one pass over the bytes at memcpy
speed; no allocation the size of the restore, no MLX graph.

`spec` is always an engine.formats.PageSpec (not imported: formats imports this module
for pages_from_blocks).

What it assumes: a target array is evaluated, row-contiguous in its last axis and
referenced by the caller until the copies ran; nothing else writes it meanwhile (the
blocks a pool hands out belong to their cache alone).
"""

from __future__ import annotations

import ctypes
import functools
import io
import json
import os
import struct
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.errors import FormatMismatch
from kernels.page_hash import page_hashes

# Page copies smaller than this run inline: a thread hop costs more than the copy.
MIN_THREADED_NBYTES = 4 * 2**20
DEFAULT_WORKERS = min(8, os.cpu_count() or 1)


def direct_writes() -> bool:
    """Whether restores write pages into MLX arrays through host views (True), or
    through host staging that the device copies from (False: BlockPool.write_pages).

    True on the CPU and on Apple's unified memory, where a host view is the array's
    own memory. False on a CUDA GPU: a host view there moves the array into managed
    memory (MLX's allocator), so every later host write and GPU read of it migrates
    pages between host and device on faults (H200, 8B-shaped at 8K: host-view restore
    390 ms TTFT; docs/benchmarks.md). There the pages go into a DeviceStaging buffer
    the GPU reads in place, and the pools stay in device memory."""
    return not (mx.default_device() == mx.gpu and mx.cuda.is_available())


# MLX's safetensors name of each dtype a plane can have (_UninitialisedStream).
_SAFETENSORS_DTYPES = {mx.uint8: "U8", mx.uint16: "U16", mx.uint32: "U32", mx.int8: "I8",
                       mx.int16: "I16", mx.int32: "I32", mx.float16: "F16", mx.bfloat16: "BF16",
                       mx.float32: "F32"}


# Whether uninitialised() asks the kernel for transparent huge pages on its fresh arrays.
HUGE_PAGES = True
_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 * 2**20


@functools.cache
def _madvise():
    """libc's madvise, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
    return fn


def advise_huge_pages(buffer: memoryview) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MiB pages inside a writable buffer, so
    that its first touch maps 2 MiB per fault instead of 4 KiB where the kernel's
    transparent huge pages are in "madvise" mode (a fresh 512 MiB restore: 131k faults).
    Only a hint: memory already mapped keeps its pages, and a refusal (EINVAL on a
    kernel without THP) changes nothing. True when the kernel took it. The kernel
    splits the mapping at the advised range's ends; ranges advised side by side merge
    again, so a heap holds at most one extra mapping per 2 MiB (vm.max_map_count is
    65530 by default)."""
    fn = _madvise()
    if fn is None or len(buffer) < _HUGE_PAGE:
        return False
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    lo = -(-start // _HUGE_PAGE) * _HUGE_PAGE
    hi = (start + len(buffer)) // _HUGE_PAGE * _HUGE_PAGE
    return hi > lo and fn(lo, hi - lo, _MADV_HUGEPAGE) == 0


def uninitialised(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, mx.Dtype]) -> dict[str, mx.array]:
    """Fresh evaluated arrays (name -> array of shapes[name], dtypes[name]) whose bytes
    are whatever their memory held: numpy's empty() for MLX, for a caller that writes
    every byte through host views before anything reads them (a restore into KVCache
    layout: the pages cover every token of every plane, _history).

    MLX has no empty(): mx.zeros writes every byte, and on fresh memory that write is
    the first touch, one page fault per 4 KiB (on this VM about 131k per 512 MiB), so
    the restore's copy then writes the bytes a second time. mx.load of a safetensors
    file object allocates each tensor and hands its memory to the object's readinto,
    which here leaves it as it is: the restore's own copy is the first and only write.
    (2-core CPU, a probe: 32 arrays of [2, 1, 8, 4096, 128] bf16 allocated and each
    filled by one numpy copy, medians of 5: 79 ms this way against 148 ms through
    mx.zeros; the restore itself: docs/benchmarks.md "2026-12-03".) A build of MLX that
    called read() instead would get zeros from it: slower, never wrong.

    With HUGE_PAGES, each array's memory is advised MADV_HUGEPAGE before anything
    touches it (advise_huge_pages), so the first write faults 2 MiB at a time where the
    kernel allows it (tools/bench/profile/issue19_hugepages.py measures the difference)."""
    if not shapes:
        return {}
    out = mx.load(_UninitialisedStream([(n, shape, dtypes[n]) for n, shape in shapes.items()]),
                  format="safetensors")
    mx.eval(list(out.values()))  # read here, whatever MLX defers: host views alias them next
    return out


class _UninitialisedStream(io.RawIOBase):
    """A safetensors file of the given tensors whose data bytes are never written:
    readinto past the header leaves the caller's buffer as it is (uninitialised)."""

    def __init__(self, tensors: list[tuple[str, tuple[int, ...], mx.Dtype]]):
        meta, at = {}, 0
        for name, shape, dtype in tensors:
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.size
            meta[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                          "data_offsets": [at, at + nbytes]}
            at += nbytes
        header = json.dumps(meta).encode()
        header += b" " * (-len(header) % 8)
        self._header = struct.pack("<Q", len(header)) + header
        self._size = len(self._header) + at
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._size - self._pos))
        head = max(0, min(n, len(self._header) - self._pos))
        if head:
            view[:head] = self._header[self._pos : self._pos + head]
        if HUGE_PAGES and n > head:
            advise_huge_pages(view[head:n])
        self._pos += n  # past the header: the tensor's memory is left as MLX allocated it
        return n


def host_view(x: mx.array) -> np.ndarray:
    """A writable uint8 numpy view of x's memory: shape x.shape[:-1] + (row bytes,).

    x is evaluated first. Refuses (AssertionError) an array that is not one
    C-contiguous run of its buffer (a strided view): writing it is not this helper's
    job (host_readable copies such an array instead)."""
    mx.eval(x)
    view = memoryview(x)
    assert not view.readonly, "MLX gave a read-only buffer; a host view cannot write it"
    assert view.c_contiguous, f"an array of shape {x.shape} and strides {view.strides} is not C-contiguous"
    row_nbytes = x.shape[-1] * x.dtype.size if x.ndim else x.dtype.size
    # bfloat16 has no PEP 3118 code: cast the bytes, then shape them
    host = np.frombuffer(view.cast("B"), dtype=np.uint8)
    return host.reshape(*x.shape[:-1], row_nbytes)


@dataclass(frozen=True)
class Region:
    """One plane of a page: bytes [start, start + nbytes) hold [heads, tokens, row_nbytes]."""

    name: str
    start: int
    heads: int
    tokens: int
    row_nbytes: int  # width * itemsize

    @property
    def nbytes(self) -> int:
        return self.heads * self.tokens * self.row_nbytes


@functools.lru_cache(maxsize=1024)
def page_regions(spec, tokens: int) -> tuple[Region, ...]:
    """Where each plane of a page of `tokens` tokens sits, in plane order (cached: a
    restore asks once per page)."""
    out, start = [], 0
    widths, dtypes = spec.plane_widths, spec.plane_dtypes
    for name in spec.plane_names:
        region = Region(name, start, spec.kv_heads, tokens, widths[name] * dtypes[name].size)
        out.append(region)
        start += region.nbytes
    assert start == spec.page_nbytes(tokens), (start, spec.page_nbytes(tokens))
    return tuple(out)


def copy_page(page, regions: tuple[Region, ...], targets: dict[str, np.ndarray]) -> None:
    """page (bytes-like) -> targets[name] ([heads, tokens, row_nbytes] uint8, any
    strides: a pool block's slots or a KVCache's token range). One pass."""
    for target, source in _page_pairs(page, regions, targets):
        np.copyto(target, source)


def _page_pairs(page, regions: tuple[Region, ...], targets: dict[str, np.ndarray]) -> list[tuple]:
    raw = np.frombuffer(page, dtype=np.uint8)
    return [(targets[r.name], raw[r.start : r.start + r.nbytes].reshape(r.heads, r.tokens, r.row_nbytes))
            for r in regions]


def page_targets(row: np.ndarray, regions: tuple[Region, ...]) -> dict[str, np.ndarray]:
    """Views of one page-sized uint8 row as its planes [heads, tokens, row_nbytes]."""
    return {r.name: row[r.start : r.start + r.nbytes].reshape(r.heads, r.tokens, r.row_nbytes)
            for r in regions}


def host_readable(x: mx.array) -> np.ndarray:
    """x's bytes on the host as uint8 [..., row bytes]: its own memory where it can be
    (host_view), else one device -> host copy (CUDA, or an unusual layout)."""
    if direct_writes():
        try:
            return host_view(x)
        except AssertionError:
            pass
    raw = x.view(mx.uint8) if x.dtype.size != 1 else x
    return np.array(raw, copy=True)


class PageCopies:
    """The copies of one restore or capture: added while targets are laid out, run once.

    A copy's source must stay valid until run() (or wait()) returns (the store's views
    are valid inside its get_pages block; pool host views until the pool's next MLX
    write). start() hands the copies added so far to the copy threads at once, so they
    overlap the layout of the next targets (a restore into KVCache layout: one layer's
    copies while MLX allocates and fills the next layer's arrays)."""

    def __init__(self):
        self._pairs: list[tuple[np.ndarray, np.ndarray]] = []  # (target, source), not started
        self._started: list = []  # futures of the copies start() handed out
        self._count = 0
        self.nbytes = 0  # of the copies not started

    def add(self, page, regions: tuple[Region, ...], targets: dict[str, np.ndarray]) -> None:
        """Copy page's planes into targets (see copy_page)."""
        self.add_pairs(_page_pairs(page, regions, targets))

    def add_page(self, page, row: np.ndarray) -> None:
        """Copy page's bytes as they are into the start of row (uint8, contiguous):
        one copy, however many planes the page holds (a device backend's staging row,
        BlockPool.write_pages)."""
        raw = np.frombuffer(page, dtype=np.uint8)
        self.add_pairs([(row[: raw.nbytes], raw)])

    def add_pairs(self, pairs) -> None:
        """Copy each source array into its target (same shape, uint8)."""
        for target, source in pairs:
            assert target.shape == source.shape, (target.shape, source.shape)
            self._pairs.append((target, source))
            self._count += 1
            self.nbytes += source.nbytes

    def __len__(self) -> int:
        """Copies added since the last run(), started or not."""
        return self._count

    def start(self, workers: int = DEFAULT_WORKERS) -> None:
        """Hand the copies added so far to the copy threads without waiting for them
        (run() and wait() do). Below MIN_THREADED_NBYTES it leaves them to run()."""
        if min(workers, DEFAULT_WORKERS) <= 1 or self.nbytes < MIN_THREADED_NBYTES:
            return
        pairs, self._pairs, self.nbytes = self._pairs, [], 0
        self._started += _submit_copies(pairs, workers)

    def run(self, workers: int = DEFAULT_WORKERS) -> None:
        """Every copy, on up to `workers` threads (inline below MIN_THREADED_NBYTES),
        and those start() handed out: all done when it returns."""
        pairs, self._pairs, nbytes, self.nbytes = self._pairs, [], self.nbytes, 0
        try:
            run_copies(pairs, nbytes, workers)
        finally:
            self.wait()

    def wait(self) -> None:
        """Wait for the copies start() handed out (the first error is raised)."""
        started, self._started = self._started, []
        self._count = len(self._pairs)
        errors = [f.exception() for f in started]
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed


class DeferredCopies(PageCopies):
    """Where each page goes, recorded while the targets are laid out, so that the pages
    are copied later, each right after the store verified it and while its bytes are
    still in the CPU's caches (the fused read: engine/pageread.py read_into calls
    copy(i, page) from its reader threads).

    Layout code is handed stand-ins (stand_ins(lengths)): read-only zero views of each
    page's expected length. add() with a stand-in records its regions and targets
    instead of copying; copy(i, page) copies the real page i into them. A page whose
    length is not its stand-in's is refused (FormatMismatch) before anything is copied
    from it. Other pages passed to add() are copied by run(), as PageCopies does."""

    def __init__(self, *, hash_on_device: bool = False):
        super().__init__()
        self._zeros = memoryview(b"")
        self._stand_ins: list[memoryview] = []  # kept alive: their ids stay unique
        self._where: dict[int, int] = {}  # id(stand-in) -> page index
        self._targets: list[list[tuple]] = []  # page index -> [(regions, targets)]
        # The device hashes what it copied (kernels/page_hash.py) for the store to settle
        # (kvstore/deferred.py): BlockPool.write_pages then hands its device copy's rows to
        # hash_rows, one entry per pool: (pool, page indices, rows, row bytes, page lengths).
        self.hash_on_device = hash_on_device
        self._hashed: list[tuple] = []

    def stand_ins(self, lengths: list[int]) -> list[memoryview]:
        """One stand-in per page, numbered on from the pages already handed out."""
        if max(lengths, default=0) > len(self._zeros):
            self._zeros = memoryview(bytes(max(lengths)))
        out = []
        for nbytes in lengths:
            view = self._zeros[:nbytes]
            self._where[id(view)] = len(self._stand_ins)
            self._stand_ins.append(view)
            self._targets.append([])
            out.append(view)
        return out

    def add(self, page, regions: tuple[Region, ...], targets: dict[str, np.ndarray]) -> None:
        index = self._index(page)
        if index is None:
            super().add(page, regions, targets)
            return
        self._targets[index].append((regions, targets))

    def add_page(self, page, row: np.ndarray) -> None:
        index = self._index(page)
        if index is None:
            super().add_page(page, row)
            return
        self._targets[index].append((None, row[: len(page)]))

    def _index(self, page) -> int | None:
        """The number of the stand-in `page` is, or None for a real page."""
        index = self._where.get(id(page))
        return index if index is not None and self._stand_ins[index] is page else None

    def hash_rows(self, pool, pages: list, rows: mx.array, row_nbytes: int) -> None:
        """Record that rows (uint8, a device array) holds `pages` (stand-ins of this
        object), page i in the first bytes of row i, for device_hashes."""
        indices = [self._index(page) for page in pages]
        assert None not in indices, "hash_rows takes this object's stand-ins"
        self._hashed.append((pool, indices, rows, row_nbytes, [len(page) for page in pages]))

    def device_hashes(self, pools) -> list[tuple[list[int], mx.array]]:
        """(page indices, [n, 2] uint64 (high, low) xxh3-128 of those pages' rows, lazy
        on a GPU) for the rows hash_rows recorded for `pools`: call it once their pages
        landed. Each pool's entry is handed out once."""
        wanted = {id(pool) for pool in pools}
        out, kept = [], []
        for entry in self._hashed:
            pool, indices, rows, row_nbytes, lengths = entry
            if id(pool) in wanted:
                out.append((indices, page_hashes(rows, row_nbytes, lengths)))
            else:
                kept.append(entry)
        self._hashed = kept
        return out

    def copy(self, index: int, page) -> None:
        """Page `index` (its verified bytes) into every target laid out for its stand-in."""
        nbytes, expected = memoryview(page).nbytes, len(self._stand_ins[index])
        if nbytes != expected:
            raise FormatMismatch(f"page {index} holds {nbytes} bytes; its block's tokens "
                                 f"make it {expected}")
        for regions, targets in self._targets[index]:
            if regions is None:  # add_page: the whole page into one row
                np.copyto(targets, np.frombuffer(page, dtype=np.uint8))
            else:
                copy_page(page, regions, targets)


def run_copies(pairs: list[tuple], nbytes: int, workers: int = DEFAULT_WORKERS) -> None:
    """(target, source) copies on up to `workers` threads of the process's copy pool
    (contiguous runs per thread: neighbouring copies share target rows); inline below
    MIN_THREADED_NBYTES, where a thread hop costs more than the copy."""
    if min(workers, DEFAULT_WORKERS) <= 1 or nbytes < MIN_THREADED_NBYTES or len(pairs) < 2:
        _copy_all(pairs)
        return
    for future in _submit_copies(pairs, workers):
        future.result()


def _submit_copies(pairs: list[tuple], workers: int) -> list:
    workers = max(1, min(workers, DEFAULT_WORKERS))
    step = -(-len(pairs) // workers)
    return [_copy_pool().submit(_copy_all, pairs[i : i + step]) for i in range(0, len(pairs), step)]


@functools.lru_cache(maxsize=1)
def _copy_pool() -> ThreadPoolExecutor:
    """One pool of copy threads per process (made on first use, never shut down): a
    restore runs one batch of copies per layer on the device path, and starting
    threads per batch cost more than a small layer's copies. Copy tasks never wait on
    other tasks, so restores on several threads can share it."""
    return ThreadPoolExecutor(DEFAULT_WORKERS, thread_name_prefix="kv-copy")


def _copy_all(pairs: list[tuple]) -> None:
    for target, source in pairs:
        np.copyto(target, source)


class DeviceStaging:
    """Host memory the device copies pages from, reused across restores (device
    backends: direct_writes() is False).

    One MLX uint8 array made on the host, so that MLX's CUDA allocator puts it in
    managed memory, advised to stay in host memory and be read by the GPU in place
    (engine/managed.py): the host writes it through a host view at memory speed, and
    a slice update on the device reads it once over the bus, with no page migrating
    either way. It grows to the largest request and stays.

    Reuse is ordered: take() first waits for the device work that read the previous
    contents (hold() names it), so a write never lands under a copy still in flight."""

    def __init__(self):
        self._array: mx.array | None = None
        self._host: np.ndarray | None = None
        self._readers: list = []
        self.advised = False

    def take(self, nbytes: int) -> tuple[mx.array, np.ndarray]:
        """(MLX array, writable host view) of at least nbytes (contents undefined)."""
        self.wait()
        if self._array is None or self._array.size < nbytes:
            self._array = None
            self._array = mx.array(np.empty(nbytes, dtype=np.uint8))
            self._host = host_view(self._array)
            self.advised = False
            if mx.cuda.is_available():
                from engine.managed import keep_on_host  # loads libcuda on first use

                self.advised = keep_on_host(self._host.ctypes.data, nbytes)
        return self._array, self._host

    def hold(self, readers: list) -> None:
        """Arrays whose evaluation reads the current contents: take() waits for them."""
        self._readers = list(readers)

    def wait(self) -> None:
        if self._readers:
            readers, self._readers = self._readers, []
            mx.eval(readers)


_UNSIGNED = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def device_copy(x: mx.array) -> mx.array:
    """A (lazy) array holding x's bytes, bit for bit, in a buffer of its own.

    For staging -> arrays where the copy may cover a whole array: MLX returns the
    update itself from a slice update that covers all of its target (ops.cpp
    slice_update), which would leave the target a view of the staging buffer, to be
    overwritten by the next restore. One elementwise pass on the unsigned integer
    view (| 0, exact for every bit pattern, NaN payloads included); never donated,
    since the staging buffer holds the source's memory."""
    unsigned = _UNSIGNED[x.dtype.size]
    raw = x if x.dtype == unsigned else x.view(unsigned)
    out = mx.bitwise_or(raw, mx.array(0, unsigned))
    return out if x.dtype == unsigned else out.view(x.dtype)


class StagingBuffer:
    """Host memory reused across restores, as plain numpy (contents undefined)."""

    def __init__(self):
        self._buffer = np.empty(0, dtype=np.uint8)

    def rows(self, count: int, row_nbytes: int) -> np.ndarray:
        """[count, row_nbytes] uint8 over the buffer (contents undefined)."""
        need = count * row_nbytes
        if self._buffer.nbytes < need:
            self._buffer = np.empty(need, dtype=np.uint8)
        return self._buffer[:need].reshape(count, row_nbytes)


class HostBuffers:
    """Host memory for captures, recycled once every view of it is gone.

    A capture's pages are views of one buffer per layer that lives until the last of
    them is dropped (after its upload). Fresh memory costs a page fault per 4 KiB on
    first touch (several times a copy into warm memory: docs/benchmarks.md), so a
    buffer is kept for the next capture of the same size instead of being freed. Safety: the buffer is lent through a ctypes window
    that every derived array and memoryview keeps alive; only when the window is
    collected (no view of it is left anywhere) does the buffer go back on the free
    list. At most max_nbytes are kept idle (oldest dropped first)."""

    def __init__(self, max_nbytes: int = 1 << 30):
        self.max_nbytes = max_nbytes
        self._free: list[np.ndarray] = []  # idle owners, oldest first
        self._lock = threading.Lock()

    @property
    def idle_nbytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of nbytes (contents undefined)."""
        with self._lock:
            found = next((i for i, b in enumerate(self._free) if b.nbytes == nbytes), None)
            owner = self._free.pop(found) if found is not None else None
        if owner is None:
            owner = np.empty(nbytes, dtype=np.uint8)
        window = (ctypes.c_uint8 * nbytes).from_buffer(owner)
        weakref.finalize(window, self._give_back, owner)
        return np.frombuffer(window, dtype=np.uint8)

    def _give_back(self, owner: np.ndarray) -> None:
        with self._lock:
            self._free.append(owner)
            while sum(b.nbytes for b in self._free) > self.max_nbytes:
                self._free.pop(0)


CAPTURE_BUFFERS = HostBuffers()  # process-wide: captures of every model share it


def gather_pages(spec, hosts: dict[str, np.ndarray], block_ids: list[int], num_tokens: int,
                 copies: PageCopies | None = None) -> list[memoryview]:
    """The kvstore pages of blocks, in one copy: hosts[name] is a layer's plane on the
    host ([num_blocks, H, block_size, row bytes], host_readable of the pool's planes).
    Returns read-only views of one buffer allocated here, the last page possibly
    shorter (capture and pages_from_blocks). With `copies`, the copies are only added
    to it: the pages hold their bytes once the caller ran it.

    A run of consecutive block ids (a pool hands a sequence's blocks out in order, as
    a rule) is copied as one strided copy per plane, [run, plane bytes] out of the
    arena's contiguous blocks into every page's plane, instead of one copy per page and
    plane: fewer, larger copies and less Python per page (the copies themselves still
    run at cached-store speed: docs/benchmarks.md, publish capture)."""
    size = spec.block_size_tokens
    rows = CAPTURE_BUFFERS.take(len(block_ids) * spec.block_nbytes).reshape(len(block_ids), -1)
    run = PageCopies() if copies is None else copies
    full = len(block_ids) if num_tokens >= len(block_ids) * size else len(block_ids) - 1
    regions = page_regions(spec, size)
    at = 0
    while at < full:  # runs of consecutive blocks, full ones
        end = at + 1
        while end < full and block_ids[end] == block_ids[end - 1] + 1:
            end += 1
        first = block_ids[at]
        run.add_pairs((rows[at:end, r.start : r.start + r.nbytes],
                       hosts[r.name][first : first + end - at].reshape(end - at, r.nbytes))
                      for r in regions)
        at = end
    page_nbytes = spec.page_nbytes(size)
    pages = [memoryview(rows[index, :page_nbytes]).toreadonly() for index in range(full)]
    if full < len(block_ids):  # a short last block
        count = num_tokens - full * size
        targets = page_targets(rows[full], page_regions(spec, count))
        run.add_pairs((targets[n], h[block_ids[full], :, :count]) for n, h in hosts.items())
        pages.append(memoryview(rows[full, : spec.page_nbytes(count)]).toreadonly())
    if copies is None:
        run.run()
    return pages


__all__ = ["CAPTURE_BUFFERS", "DeferredCopies", "DeviceStaging", "HostBuffers", "PageCopies", "Region", "StagingBuffer",
           "copy_page", "device_copy", "direct_writes", "gather_pages", "host_readable", "host_view", "page_regions",
           "page_targets", "run_copies"]
