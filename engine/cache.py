"""PagedKVCache: an mlx-lm full-attention layer cache whose history lives in pool blocks.

It answers everything mlx-lm 0.32's models, generate_step and cache utilities call on a
KVCache: offset, update_and_fetch, make_mask, state (read in mx.eval), is_trimmable,
trim, size, empty, nbytes. K/V are encoded (rotated and quantized for packed formats)
exactly once, in update_and_fetch, and written into the blocks of a host-side block
table (a Python list of pool block ids, in token order).

Attention does not go through the arrays update_and_fetch returns. Installed (see
engine/attention.py), the layer attends through kernels.attention.paged_attention over
the pool planes, and a cache made for that model (make_cache sets `routed_by`) returns
the NOT_FETCHED marker instead of building a history nobody reads (about 60 us of graph
building per layer and step). Otherwise it returns a lazy gather of the decoded history,
so a model whose attention was not installed still computes the right thing.

Sharing: clone() shares every block (reference counts); the first write into a shared
block copies it (copy-on-write). snapshot() pins the blocks it covers the same way, so
its pages cannot change under later appends, trims or frees.

Batch size 1 only: anything else raises UnsupportedBatch.
"""

from __future__ import annotations

import json
import math
import weakref

import mlx.core as mx
from mlx_lm.models.cache import create_attention_mask

from engine.errors import FormatMismatch, SnapshotReleased, UnsupportedBatch
from engine.formats import (
    PageSpec,
    decode_tokens,
    encode_tokens,
    gather_history,
    pages_from_blocks,
    resolve_format,
)
from engine.pagecopy import DeferredCopies, PageCopies, direct_writes, page_regions
from engine.pool import BlockPool
from kernels.attention import default_impl
from kernels.tuning import DirectTuning, environment_tuning

# Modules whose scaled_dot_product_attention is the engine's router right now, with
# their install counts. engine/attention.py keeps it; caches only read it.
ROUTED_MODULES: dict[str, int] = {}


class NotFetched:
    """What update_and_fetch returns in place of K/V when the engine's router attends.

    Any use other than being handed to the router fails loudly (it is not an array)."""

    def __repr__(self) -> str:
        return ("<PagedKVCache history not fetched: the engine attends for this layer; "
                "uninstall it to get arrays>")


NOT_FETCHED = NotFetched()


def _release(pool: BlockPool, blocks: list[int]) -> None:
    """Finalizer and free(): give a block list's references back, once."""
    if blocks:
        pool.decref(blocks)
        blocks.clear()


class PagedKVCache:
    def __init__(self, pool: BlockPool, *, attention_impl: str | None = None,
                 tuning: DirectTuning | None = None):
        self.pool = pool
        self.spec: PageSpec = pool.spec
        self.attention_impl = attention_impl  # passed to kernels.attention.paged_attention
        # What attention_impl None and tuning None mean, resolved once here rather than on
        # every layer's call (reading the environment cost ~5 us per layer and step:
        # $KVSTORE_ATTENTION_IMPL and the tuning overrides are read when the cache is made)
        self.default_impl = default_impl()
        self.tuning = tuning or environment_tuning()
        self.routed_by: tuple[str, ...] = ()  # model modules whose router attends for us
        self.offset = 0
        self.dtype: mx.Dtype | None = None  # the model's K/V dtype, seen at the first write
        self._blocks: list[int] = []  # host-side block table
        self._table: mx.array | None = None  # device copy, rebuilt when the table changes
        # the last update's keys and values as given while the router is to attend, for
        # native pages only (bit for bit what the pages hold): a prefill chunk's attention
        # takes them instead of gathering its own blocks (kernels/prefill.py), so they live
        # only from this layer's update to its attention. Packed pages keep none: a chunk
        # reads its own tokens back quantized, as every later reader will (chunk-invariant)
        self._fresh: tuple[mx.array, mx.array, int] | None = None  # (keys, values, offset after)
        self._checked: tuple | None = None  # the last input shapes and dtypes _check_input passed
        # A dropped cache gives its blocks back, like a dropped KVCache frees its arrays.
        self._finalizer = weakref.finalize(self, _release, pool, self._blocks)

    # -- mlx-lm cache interface ---------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys [1, Hkv, L, Dk], values [1, Hkv, L, Dv] -> lazy decoded history
        ([1, Hkv, offset, Dk], [1, Hkv, offset, Dv]) in the keys' dtype, or
        (NOT_FETCHED, NOT_FETCHED) while the router of every `routed_by` module attends."""
        self._check_input(keys, values)
        start, stop = self.offset, self.offset + keys.shape[2]
        encoded = encode_tokens(self.spec, keys, values)  # planes [1, Hkv, L, width]
        self._make_writable(start, stop)
        self._write_encoded(encoded, start, stop)
        self.offset = stop
        self.dtype = keys.dtype
        if self.routed_by and all(name in ROUTED_MODULES for name in self.routed_by):
            self._fresh = None if self.spec.format.packed else (keys, values, stop)
            return NOT_FETCHED, NOT_FETCHED
        self._fresh = None  # the model attends over the fetched history itself
        return self.keys_and_values()

    def keys_and_values(self, dtype: mx.Dtype | None = None):
        """The decoded history ([1, Hkv, offset, D] each), lazily; keys unrotated."""
        dtype = dtype or self.dtype or self.spec.format.dtype or mx.float32
        history = gather_history(self.spec, self.pool.planes, self._blocks, self.offset)
        keys, values = decode_tokens(self.spec, history, dtype)
        return keys[None], values[None]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The mask mlx-lm's KVCache would give N new queries at this offset."""
        return create_attention_mask(N, offset=self.offset, return_array=return_array,
                                     window_size=window_size)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n tokens; blocks no longer covering any token are freed."""
        n = max(0, min(self.offset, n))
        self.offset -= n
        self._fresh = None
        keep = math.ceil(self.offset / self.spec.block_size_tokens)
        tail = self._blocks[keep:]
        if tail:
            del self._blocks[keep:]
            self._table = None
            self.pool.decref(tail)
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks this cache references (shared blocks counted in full)."""
        return len(self._blocks) * self.pool.block_nbytes

    @property
    def state(self) -> tuple[mx.array, ...]:
        """The stored planes of the history, in plane order, each [1, Hkv, offset, width].

        Raw pages, not decoded values: packed planes stay packed. mlx-lm evaluates this
        after every prefill chunk, which also flushes pending writes into the pool.
        """
        history = gather_history(self.spec, self.pool.planes, self._blocks, self.offset)
        return tuple(history[name][None] for name in self.spec.plane_names)

    @state.setter
    def state(self, planes) -> None:
        """Replace the history by the given planes (same page format, no re-encoding)."""
        planes = tuple(planes)
        names = self.spec.plane_names
        if len(planes) != len(names):
            raise FormatMismatch(f"{self.spec.format.name} state has planes {names}, got {len(planes)} arrays")
        self.free()
        tokens = planes[0].shape[2]
        self._write_planes({n: p[0] for n, p in zip(names, planes, strict=True)}, tokens)

    @property
    def meta_state(self) -> tuple[str]:
        """The page spec as canonical JSON: what state's arrays mean."""
        spec = self.spec
        return (json.dumps({"page_format": spec.format.name, "kv_heads": spec.kv_heads,
                            "k_head_dim": spec.k_head_dim, "v_head_dim": spec.v_head_dim,
                            "block_size_tokens": spec.block_size_tokens,
                            "group_size": spec.group_size, "rotation_seed": spec.rotation_seed},
                           sort_keys=True, separators=(",", ":")),)

    @classmethod
    def from_state(cls, state, meta_state, pool: BlockPool | None = None, **kwargs):
        """A cache holding `state` in `pool` (a fresh 1-layer pool when None).

        meta_state is required: the page format is read from it, never guessed from the
        arrays.
        """
        meta = json.loads(meta_state[0])
        spec = PageSpec(resolve_format(meta["page_format"], mx.float32), meta["kv_heads"],
                        meta["k_head_dim"], meta["v_head_dim"], meta["block_size_tokens"],
                        meta["group_size"], meta["rotation_seed"])
        if pool is None:
            tokens = state[0].shape[2]
            pool = BlockPool(spec, max(1, math.ceil(tokens / spec.block_size_tokens)))
        elif pool.spec != spec:
            raise FormatMismatch(f"state of {spec} does not fit a pool of {pool.spec}")
        cache = cls(pool, **kwargs)
        cache.state = state
        return cache

    @classmethod
    def merge(cls, caches):
        raise UnsupportedBatch("PagedKVCache serves batch size 1; batched generation "
                               "(BatchGenerator) needs mlx-lm's own caches")

    # -- engine interface ---------------------------------------------------------
    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(self._blocks)

    def take_fresh_tokens(self, num_queries: int) -> tuple[mx.array, mx.array] | None:
        """The keys and values [1, Hkv, L, D] of the last routed update when it wrote
        exactly the num_queries newest tokens (a prefill chunk attending now) into native
        pages, else None (always for packed pages: see _fresh). Taken: a second call
        returns None."""
        fresh, self._fresh = self._fresh, None
        if fresh is None or fresh[0].shape[2] != num_queries or fresh[2] != self.offset:
            return None
        return fresh[0], fresh[1]

    def block_table(self) -> mx.array:
        """[1, num_blocks] int32, cached until the table changes."""
        if self._table is None:
            self._table = mx.array([self._blocks or [0]], dtype=mx.int32)
        return self._table

    def clone(self) -> "PagedKVCache":
        """A cache sharing every block with this one (copy-on-write on either side)."""
        other = type(self)(self.pool, attention_impl=self.attention_impl, tuning=self.tuning)
        other.default_impl = self.default_impl
        other.routed_by = self.routed_by
        self.pool.incref(self._blocks)
        other._blocks.extend(self._blocks)
        other.offset = self.offset
        other.dtype = self.dtype
        return other

    def __deepcopy__(self, memo) -> "PagedKVCache":
        """mlx-lm's LRUPromptCache and evaluate deep-copy caches: a clone is a deep copy
        here (copy-on-write keeps the two independent) and shares the pool."""
        return self.clone()

    __copy__ = clone

    def snapshot(self) -> "PageSnapshot":
        """Immutable pages of the history as it is now (see PageSnapshot)."""
        return PageSnapshot(self.pool, list(self._blocks), self.offset)

    def free(self) -> None:
        """Give every block back to the pool; the cache is empty afterwards."""
        _release(self.pool, self._blocks)
        self._table = None
        self._fresh = None
        self.offset = 0

    @classmethod
    def from_pages(cls, pool: BlockPool, pages: list, *, copies: PageCopies | None = None,
                   **kwargs) -> "PagedKVCache":
        """A cache holding kvstore pages (bytes, in block order) as they are: no
        re-encoding. Every page but the last must hold a full block. Blocks are
        allocated all at once (PoolExhausted changes nothing). `copies`: see
        append_pages."""
        cache = cls(pool, **kwargs)
        cache.append_pages(pages, copies)
        return cache

    @classmethod
    def from_blocks(cls, pool: BlockPool, blocks: list[int], num_tokens: int,
                    **kwargs) -> "PagedKVCache":
        """A cache over blocks already resident in `pool` (shared: each gets one more
        reference; a write into one copies it first)."""
        size = pool.spec.block_size_tokens
        if not (len(blocks) - 1) * size < num_tokens <= len(blocks) * size:
            raise FormatMismatch(f"{num_tokens} tokens do not fill {len(blocks)} blocks of {size}")
        cache = cls(pool, **kwargs)
        pool.incref(blocks)
        cache._blocks.extend(blocks)
        cache.offset = num_tokens
        return cache

    def append_pages(self, pages: list, copies: PageCopies | None = None) -> None:
        """Append kvstore pages after a block-aligned history, byte for byte.

        Blocks are allocated at once (PoolExhausted changes nothing), then each page is
        copied once, straight into its block's slots in the pool planes: through host
        views where arrays live in host memory (engine/pagecopy.py), else into the
        pool's reused staging buffer and to the device in one transfer and one scatter
        per plane. With `copies`, host-view copies are only added to it: the caller
        runs them (on worker threads, for every layer together) while the page views
        are valid, and before anything reads or writes this pool. On a device backend a
        DeferredCopies (the fused read) also records the staging copies, and the caller
        evaluates the pool's planes once they ran (BlockPool.write_pages)."""
        spec = self.spec
        size = spec.block_size_tokens
        if self.offset % size:
            raise FormatMismatch(f"pages append at a block boundary; the cache holds {self.offset} tokens")
        if not pages:
            return
        lengths = [len(memoryview(p).cast("B")) for p in pages]
        full, per_token = spec.page_nbytes(size), spec.page_nbytes(1)
        if any(n != full for n in lengths[:-1]):
            raise FormatMismatch(f"every page but the last must hold a full block ({full} bytes)")
        if lengths[-1] == 0 or lengths[-1] % per_token or lengths[-1] > full:
            raise FormatMismatch(f"the last page must hold 1..{size} tokens of {per_token} bytes")
        start = self.offset
        stop = start + (len(pages) - 1) * size + lengths[-1] // per_token
        first = len(self._blocks)
        self._make_writable(start, stop)
        blocks = self._blocks[first:]
        counts = [min(size, stop - start - index * size) for index in range(len(pages))]
        if direct_writes():
            inline = copies is None
            copies = PageCopies() if inline else copies
            hosts = self.pool.host_planes()  # name -> [num_blocks, H, bs, row bytes]
            for page, block, count in zip(pages, blocks, counts, strict=True):
                copies.add(page, page_regions(spec, count),
                           {n: h[block, :, :count] for n, h in hosts.items()})
            if inline:
                copies.run()
        else:  # a fused read's stand-ins land later: write_pages only records them
            later = copies if isinstance(copies, DeferredCopies) else None
            self.pool.write_pages(blocks, pages, counts, later)
        self.offset = stop

    # -- internals ----------------------------------------------------------------
    def _check_input(self, keys: mx.array, values: mx.array) -> None:
        signature = (keys.shape, values.shape, keys.dtype, values.dtype)
        if signature == self._checked:  # every decode step after the first: one comparison
            return
        self._check_signature(keys, values)
        self._checked = signature

    def _check_signature(self, keys: mx.array, values: mx.array) -> None:
        spec = self.spec
        if keys.ndim != 4 or keys.shape[0] != 1:
            raise UnsupportedBatch(f"PagedKVCache takes keys [1, Hkv, L, D], got {keys.shape}")
        expected_k = (1, spec.kv_heads, keys.shape[2], spec.k_head_dim)
        expected_v = (1, spec.kv_heads, keys.shape[2], spec.v_head_dim)
        if tuple(keys.shape) != expected_k or tuple(values.shape) != expected_v:
            raise FormatMismatch(f"keys {keys.shape} / values {values.shape} do not fit "
                                 f"{expected_k} / {expected_v}")
        native = spec.format.dtype
        if native is not None and (keys.dtype != native or values.dtype != native):
            raise FormatMismatch(f"{spec.format.name} pages cannot hold {keys.dtype} keys")

    def _make_writable(self, start: int, stop: int) -> None:
        """Ensure blocks for tokens [start, stop) exist and are owned by this cache alone.

        All blocks needed (new ones and copy-on-write targets) are allocated in one
        call, so PoolExhausted leaves the table and every block as they were.
        """
        size = self.spec.block_size_tokens
        first = start // size
        count = len(self._blocks)
        if first == count - 1 and stop <= count * size and self.pool.refcount(self._blocks[first]) == 1:
            return  # within the last block, owned: a decode step's common case
        needed = math.ceil(stop / size) - count
        shared = [i for i in range(first, len(self._blocks)) if self.pool.refcount(self._blocks[i]) > 1]
        fresh = self.pool.allocate(max(needed, 0) + len(shared))
        for index, target in zip(shared, fresh[:len(shared)], strict=True):
            source = self._blocks[index]
            self.pool.copy_block(source, target)
            self._blocks[index] = target
            self.pool.decref([source])
        self._blocks.extend(fresh[len(shared):])
        if fresh:
            self._table = None

    def _write_encoded(self, encoded: dict[str, mx.array], start: int, stop: int) -> None:
        """Write encoded planes [1, H, stop - start, width] into token slots [start, stop):
        at most three writes per plane whatever the length (the partial first block, the
        whole blocks in one write_blocks, the partial last block), so a prefill chunk costs a
        few graph nodes per layer rather than one per block. A decode step is one
        SliceUpdate per plane: the planes as encoded, no slicing."""
        size = self.spec.block_size_tokens
        head = min(stop, -(-start // size) * size)  # the end of start's block
        if head > start:
            part = encoded if head == stop else {n: p[:, :, :head - start] for n, p in encoded.items()}
            self.pool.write(self._blocks[start // size], start % size, part)
        whole = (stop - head) // size
        if whole:
            def blocked(plane):  # [1, H, whole * size, W] -> [whole, H, size, W]
                _, heads, _, width = plane.shape
                return plane[0, :, head - start:head - start + whole * size].reshape(
                    heads, whole, size, width).transpose(1, 0, 2, 3)
            first = head // size
            self.pool.write_blocks(self._blocks[first:first + whole],
                                   {n: blocked(p) for n, p in encoded.items()})
        tail = head + whole * size
        if stop > tail:
            part = encoded if tail == start else {n: p[:, :, tail - start:] for n, p in encoded.items()}
            self.pool.write(self._blocks[tail // size], 0, part)

    def _write_planes(self, planes: dict[str, mx.array], tokens: int) -> None:
        """Write already-encoded planes [H, tokens, width] as the history (cache empty)."""
        assert self.offset == 0 and not self._blocks, "write_planes needs an empty cache"
        for name in self.spec.plane_names:
            plane = planes[name]
            if plane.dtype != self.spec.plane_dtypes[name] or plane.shape[1] != tokens:
                raise FormatMismatch(f"plane {name}: {plane.dtype}{plane.shape} does not fit "
                                     f"{self.spec.format.name}")
        self._make_writable(0, tokens)
        size = self.spec.block_size_tokens
        for index, block in enumerate(self._blocks):
            lo, hi = index * size, min(tokens, (index + 1) * size)
            self.pool.write(block, 0, {n: p[:, lo:hi] for n, p in planes.items()})
        self.offset = tokens


class PageSnapshot:
    """Immutable pages of one layer's history at one moment, for publication.

    It holds a reference on every block it covers, so neither the cache it came from
    nor any other can write into them (their next write copies the block first) and
    freeing the cache does not recycle them. release() (or leaving a `with` block, or
    dropping the snapshot) gives the references back.
    """

    def __init__(self, pool: BlockPool, blocks: list[int], num_tokens: int):
        self.pool = pool
        self.spec = pool.spec
        self.num_tokens = num_tokens
        self._blocks = blocks
        pool.incref(blocks)
        self._finalizer = weakref.finalize(self, _release, pool, self._blocks)

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    @property
    def nbytes(self) -> int:
        """Pool bytes this snapshot pins (whole blocks)."""
        return len(self._blocks) * self.pool.block_nbytes

    def pages(self) -> list[bytes]:
        """kvstore pages, one per block, the last covering only the tokens it holds."""
        if self.released:
            raise SnapshotReleased("this page snapshot was released")
        if not self._blocks:
            return []
        return pages_from_blocks(self.spec, self.pool.planes, self._blocks, self.num_tokens)

    def release(self) -> None:
        self._finalizer()

    def __enter__(self) -> "PageSnapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
