"""Publish: a cache's pages become store pages under its format identity.

publish(engine_model, store, tokens, caches) runs in three steps:
  capture   (caller's thread, cheap)   copy the pages of every paged layer out of
            the pool or the stock cache into host memory, plus the attachments of
            non-paged layers when a checkpoint is asked for. Later appends, trims or
            frees cannot change a capture.
  upload    (any thread, no MLX)       chain keys for every block (full blocks and
            the partial tail); blocks whose keys the store has are skipped without
            hashing their pages; the rest are hashed (blake3), missing() says which
            pages to send, put_pages sends them, commit_blocks commits the records.
  checkpoint (optional)                attachments are uploaded as pages and a named
            checkpoint pins the whole chain.

Packed pages are published byte for byte as they sit in the pool. Sources for
full-attention layers: the engine's PagedKVCache (any paged format), mlx-lm's KVCache
(native pages) and mlx-lm's QuantizedKVCache (mlx-qB pages: its codes, scales and
biases copied byte for byte, never dequantized or re-quantized; the identity must name
the cache's bits, group size and dtype, e.g. KVPolicy(default_format="mlx-q8",
group_size=64)). Any registered mlx-lm cache (engine/attachments.py) serves the other
layers, as attachments. A cache that does not hold what the identity names is refused
(FormatMismatch) rather than converted.

WriteBehindPublisher (engine/writebehind.py) runs the upload step off the decode path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import blake3
import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from engine.attachments import encode_attachment, token_offset
from engine.cache import PagedKVCache
from engine.errors import FormatMismatch, InvalidRequest, MixedComputation, OffsetMismatch
from engine.formats import PageSpec, page_specs, pages_from_blocks
from engine.geometry import leaf_caches
from engine.pagecopy import (
    CAPTURE_BUFFERS,
    PageCopies,
    device_copy,
    direct_writes,
    host_readable,
    page_regions,
    page_targets,
)
from engine.stock import conversion_offset
from kvstore.errors import MissingReferences
from kvstore.format import FormatIdentity
from kvstore.ids import ROOT_KEY, chain_key, page_digest
from kvstore.pages import PageBatch
from kvstore.protocol import PageWriter
from kvstore.records import BlockRecord, Checkpoint

if TYPE_CHECKING:  # engine_model imports nothing from here; restore imports both
    from engine.engine_model import EngineModel

log = logging.getLogger(__name__)
PROMPT_CHECKPOINT_PREFIX = "prompt-"
DEFAULT_NAMESPACE = "default"


@dataclass
class LayerCapture:
    """One paged layer's history in host memory, as its kvstore pages.

    pages[i] is block i's page (the last covers only its tokens): read-only views of
    one host buffer that the capture filled in one copy (engine/pagecopy.py)."""

    spec: PageSpec
    pages: list[memoryview]
    num_tokens: int

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pages)

    def page(self, index: int) -> memoryview:
        """Block `index` as kvstore page bytes (the last block holds only its tokens)."""
        data = self.pages[index]
        size = self.spec.block_size_tokens
        assert len(data) == self.spec.page_nbytes(min(size, self.num_tokens - index * size)), (
            "page bytes do not fit the spec")
        return data


@dataclass
class Capture:
    """Everything a publication needs, detached from the live caches."""

    identity: FormatIdentity
    tokens: tuple[int, ...]
    layers: list[LayerCapture]  # one per paged layer, in identity.paged_layers order
    attachments: dict[str, bytes] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Host bytes this capture pins until it is published or dropped."""
        return sum(layer.nbytes for layer in self.layers) + sum(map(len, self.attachments.values()))


@dataclass(frozen=True)
class PublishResult:
    tokens: int
    blocks: int
    blocks_skipped: int
    pages_sent: int
    bytes_sent: int
    checkpoint: str | None = None


def _capture_paged(cache: PagedKVCache, spec: PageSpec, num_tokens: int,
                   copies: PageCopies) -> LayerCapture:
    """The cache's first num_tokens tokens, read from the pool in one copy (added to
    `copies`: the pages hold their bytes once it ran)."""
    if cache.spec != spec:
        raise FormatMismatch(f"cache pages are {cache.spec}, the identity says {spec}")
    blocks = list(cache.block_ids[: -(-num_tokens // spec.block_size_tokens)])
    return LayerCapture(spec, pages_from_blocks(spec, cache.pool.planes, blocks, num_tokens, copies),
                        num_tokens)


def _stock_planes(cache, spec: PageSpec) -> dict[str, mx.array]:
    """A stock cache's arrays by plane name, each [1, H, capacity, width], after checking
    that the cache holds what the identity names."""
    fmt = spec.format
    if isinstance(cache, QuantizedKVCache):
        if not fmt.mlx_affine:
            raise FormatMismatch(
                f"a QuantizedKVCache holds mlx's affine codes ({cache.bits} bits, groups of "
                f"{cache.group_size}); the identity says {fmt.name}: publish it under "
                f"KVPolicy(default_format='mlx-q{cache.bits}', group_size={cache.group_size})")
        if (cache.bits, cache.group_size) != (fmt.k_bits, spec.group_size):
            raise FormatMismatch(
                f"the QuantizedKVCache holds {cache.bits}-bit codes in groups of "
                f"{cache.group_size}; the identity says {fmt.name} in groups of {spec.group_size}")
        return dict(zip(spec.plane_names, (*cache.keys, *cache.values), strict=True))
    if not fmt.native:
        raise FormatMismatch(f"a stock KVCache holds native K/V, the identity says {fmt.name}")
    return {"k": cache.keys, "v": cache.values}


def _capture_stock(cache, spec: PageSpec, num_tokens: int, copies: PageCopies) -> LayerCapture:
    """A KVCache's or QuantizedKVCache's first num_tokens tokens, as they are, in one
    copy: each block's token range of each [1, H, capacity, width] array, read where
    the array lies (engine/pagecopy.py), into one host buffer of pages."""
    return _capture_planes(_checked_planes(cache, spec), spec, num_tokens, copies)


def _checked_planes(cache, spec: PageSpec) -> dict[str, mx.array]:
    """_stock_planes, each plane's dtype and [1, H, tokens, width] checked against spec."""
    planes = _stock_planes(cache, spec)
    for name, array in planes.items():
        expected = (spec.kv_heads, spec.plane_widths[name])
        if array.dtype != spec.plane_dtypes[name] or (array.shape[1], array.shape[3]) != expected:
            raise FormatMismatch(f"{type(cache).__name__} plane {name} is {array.dtype}{array.shape}, "
                                 f"the identity says {spec.plane_dtypes[name]} [1, {expected[0]}, "
                                 f"tokens, {expected[1]}] ({spec.format.name})")
    return planes


def _capture_planes(planes: dict[str, mx.array], spec: PageSpec, num_tokens: int,
                    copies: PageCopies) -> LayerCapture:
    size = spec.block_size_tokens
    n_blocks = -(-num_tokens // size)
    hosts = {}
    for name, array in planes.items():
        whole = direct_writes() or array.shape[2] == num_tokens
        hosts[name] = host_readable(array if whole else array[:, :, :num_tokens])[0]
    rows = CAPTURE_BUFFERS.take(n_blocks * spec.block_nbytes).reshape(n_blocks, -1)
    pages = []
    for index in range(n_blocks):
        lo = index * size
        count = min(size, num_tokens - lo)
        targets = page_targets(rows[index], page_regions(spec, count))
        copies.add_pairs((targets[n], h[:, lo : lo + count]) for n, h in hosts.items())
        pages.append(memoryview(rows[index, : spec.page_nbytes(count)]).toreadonly())
    return LayerCapture(spec, pages, num_tokens)


class DeferredCapture:
    """A capture of stock caches whose host copies run later, on the thread that calls
    result() (WriteBehindPublisher's worker): capture_later()."""

    def __init__(self, identity: FormatIdentity, tokens: tuple[int, ...],
                 layers: list[tuple[PageSpec, dict[str, mx.array]]]):
        self.identity, self.tokens, self._layers = identity, tokens, layers
        n = len(tokens)
        self.nbytes = sum(spec.page_nbytes(min(spec.block_size_tokens, n - lo))
                          for spec, _ in layers for lo in range(0, n, spec.block_size_tokens))

    def result(self) -> Capture:
        """The Capture, bit for bit what capture() would have made when capture_later()
        was called. Waits for the device copies, then copies to the host."""
        copies = PageCopies()
        layers = [_capture_planes(planes, spec, len(self.tokens), copies)
                  for spec, planes in self._layers]
        copies.run()
        self._layers = []  # the device copies are freed with the last reference
        return Capture(self.identity, self.tokens, layers)


def capture_later(identity: FormatIdentity, tokens: Sequence[int], caches: Sequence,
                  *, defer: bool | None = None) -> Capture | DeferredCapture:
    """capture() without attachments, for a thread that must not wait (the generation
    thread of mlx_lm.server): the same checks, raised here, and the same bytes.

    Where the host cannot read MLX arrays in place (a CUDA GPU: direct_writes() is
    False), reading a plane would wait for the device and move the live cache's buffer
    into managed memory, which every later decode step then reads across the bus
    (engine/pagecopy.py). So this only queues a device copy of each plane's first
    len(tokens) tokens into a buffer of its own (device_copy, mx.async_eval: no wait)
    and returns a DeferredCapture; its result() makes the host copies on another
    thread, from those buffers alone. The queued copies hold device memory of the
    capture's nbytes until then. Elsewhere (the CPU, unified memory) a device copy
    would be one more pass over memory on the stream the next step waits for, so the
    capture is made at once, as capture() does. `defer` overrides the choice (tests).

    Only stock caches (KVCache, QuantizedKVCache) are deferred; a PagedKVCache's pool
    is read at once (its blocks may be freed and rewritten after this returns)."""
    caches = leaf_caches(caches)
    defer = (not direct_writes()) if defer is None else defer
    if not defer or not all(isinstance(c, (KVCache, QuantizedKVCache)) for c in caches):
        return capture(identity, tokens, caches)
    caches, tokens = _checked_caches(identity, tokens, caches, exact=False)
    layers, frozen = [], []
    for cache, spec in zip(caches, page_specs(identity), strict=True):
        if spec is None:
            continue
        planes = {name: device_copy(array[:, :, : len(tokens)])
                  for name, array in _checked_planes(cache, spec).items()}
        layers.append((spec, planes))
        frozen += planes.values()
    mx.async_eval(frozen)
    return DeferredCapture(identity, tokens, layers)


def capture(identity: FormatIdentity, tokens: Sequence[int], caches: Sequence,
            *, attachments: bool = False) -> Capture:
    """Copy what publishing `tokens` needs out of `caches` (the model's cache list; each
    CacheList counts as its sub-caches, engine/geometry.py leaf_caches).

    Without attachments, the paged layers must hold at least len(tokens) tokens and only
    that many are taken: the first n tokens of a full-attention layer are the K/V of the
    first n tokens whatever followed (this is how generate_with_store publishes a
    prompt after generating from it). With attachments=True (a checkpoint) every layer
    must sit at exactly len(tokens): a sliding ring or recurrent state is only valid at
    its own length, so a checkpoint after generation is refused (OffsetMismatch) rather
    than stored with layers at different offsets; publish the tokens the cache holds
    (the prompt and the generated tokens fed back) instead.
    """
    caches, tokens = _checked_caches(identity, tokens, caches, exact=attachments)
    specs = page_specs(identity)
    layers, extra = [], {}
    copies = PageCopies()  # every layer's, run together on one set of threads
    for index, (cache, spec) in enumerate(zip(caches, specs)):
        if spec is None:
            if attachments:
                extra[f"layer.{index}"] = encode_attachment(cache)
            continue
        if isinstance(cache, PagedKVCache):
            layers.append(_capture_paged(cache, spec, len(tokens), copies))
        elif isinstance(cache, (KVCache, QuantizedKVCache)):
            layers.append(_capture_stock(cache, spec, len(tokens), copies))
        else:
            raise FormatMismatch(f"layer {index} is a full-attention layer with a "
                                 f"{type(cache).__name__}, which has no pages")
    copies.run()
    return Capture(identity, tokens, layers, extra)


def _checked_caches(identity: FormatIdentity, tokens: Sequence[int], caches: Sequence,
                    *, exact: bool) -> tuple[list, tuple[int, ...]]:
    """(the leaf caches, the tokens as ints) after the checks every capture makes: one
    cache per identity layer (a CacheList's sub-caches are layers of their own), the
    offsets (_check_offsets) and the conversion history (_check_conversion)."""
    caches = leaf_caches(caches)
    if len(caches) != len(identity.layers):
        raise InvalidRequest(f"{len(caches)} caches for a format of {len(identity.layers)} layers")
    tokens = tuple(int(t) for t in tokens)
    _check_offsets(caches, len(tokens), exact=exact)
    _check_conversion(identity, caches, len(tokens))
    return caches, tokens


def _check_conversion(identity: FormatIdentity, caches: Sequence, num_tokens: int) -> None:
    """FormatMismatch unless the identity names how the caches' mlx-qB pages were made
    (engine/stock.py): from the first token, or converted at converted_at_token. A
    converted cache is never published below its conversion offset."""
    held = conversion_offset(caches)
    named = identity.converted_at_token
    if held != named:
        raise FormatMismatch(
            f"the cache was quantized {'at token ' + str(held) if held else 'from its first token'}"
            f", the identity says {'converted at token ' + str(named) if named else 'from the first token'}"
            f": publish it under EngineModel.identity_for({held}), the identity with "
            f"converted_at_token={held}")
    if named and num_tokens < named:
        raise InvalidRequest(f"a cache converted at token {named} is not published below it "
                             f"({num_tokens} tokens asked): no computation holds that prefix")


def _check_offsets(caches: Sequence, num_tokens: int, *, exact: bool) -> None:
    """OffsetMismatch unless every counted layer sits at one offset: exactly num_tokens
    for a checkpoint, at least num_tokens for a prefix of full-attention layers."""
    offsets = [token_offset(c) for c in caches]
    counted = {o for o in offsets if o is not None}
    if len(counted) > 1:
        raise OffsetMismatch(f"the cache's layers sit at different offsets {offsets}; a "
                             "publication needs one sequence position for every layer",
                             offsets=offsets, tokens=num_tokens)
    held = counted.pop() if counted else num_tokens
    if exact and held != num_tokens:
        raise OffsetMismatch(
            f"a checkpoint of {num_tokens} tokens needs every layer at offset {num_tokens}, "
            f"the cache's layers sit at {held} (sliding and recurrent state is only valid "
            f"at its own length): publish the {held} tokens the cache holds (the prompt "
            "and the generated tokens fed back), or checkpoint before generating",
            offsets=offsets, tokens=num_tokens)
    if held < num_tokens:
        raise OffsetMismatch(f"the cache's layers hold {held} tokens, fewer than the "
                             f"{num_tokens} to publish", offsets=offsets, tokens=num_tokens)


def upload(store, cap: Capture, *, namespace: str = DEFAULT_NAMESPACE,
           checkpoint: str | None = None, metadata: dict | None = None) -> PublishResult:
    """Send a capture to the store (see the module docstring). No MLX calls."""
    identity = cap.identity
    fid = store.put_format(identity)
    size = identity.block_size_tokens
    tokens = cap.tokens
    chunks = [tokens[i : i + size] for i in range(0, len(tokens), size)]
    keys, parent, salt = [], ROOT_KEY, store.chain_salt(namespace)
    for chunk in chunks:
        parent = chain_key(fid, namespace, parent, chunk, salt=salt)
        keys.append(parent)
    stored = store.has_blocks(keys) if keys else []
    first_new = next((i for i, present in enumerate(stored) if not present), len(keys))
    if checkpoint is not None and cap.attachments and first_new:
        _check_same_computation(store, cap, keys[:first_new])
    records, payload = [], {}
    parent = keys[first_new - 1] if first_new else ROOT_KEY
    # every page hashed once, by kvstore, on all cores; a Store trusts these digests
    new = [(layer.page(i), layer.spec.format.name) for i in range(first_new, len(keys))
           for layer in cap.layers]
    new += [(data, None) for data in (cap.attachments.values() if checkpoint is not None else ())]
    batch = PageBatch.hash([data for data, _ in new], [fmt for _, fmt in new])
    names = iter(batch.digests)
    for i in range(first_new, len(keys)):
        digests = []
        for layer in cap.layers:
            data = layer.page(i)
            digest = next(names)
            payload[digest] = data
            digests.append(digest)
        record = BlockRecord(fid, namespace, parent, chunks[i], tuple(digests),
                             salt=salt)
        records.append(record)
        parent = record.key
    attachment_digests = {}
    if checkpoint is not None:
        for name, data in cap.attachments.items():
            digest = next(names)
            payload[digest] = data
            attachment_digests[name] = digest
    sent = _send(store, batch, records)
    if checkpoint is not None:
        store.create_checkpoint(Checkpoint(checkpoint, namespace, fid, tokens, tuple(keys),
                                           attachment_digests, metadata or {}), replace=True)
    return PublishResult(len(tokens), len(keys), first_new, len(sent), sum(len(payload[d]) for d in sent),
                         checkpoint)


def _check_same_computation(store, cap: Capture, keys: list) -> None:
    """MixedComputation unless the stored blocks a checkpoint would reuse hold exactly
    this capture's pages. Blocks are deduplicated by chain key (tokens), not by bytes:
    a prefix computed in another prefill chunking can differ in its last bits, and a
    sliding ring or recurrent state computed over these pages would not continue from
    those."""
    for i, record in enumerate(store.get_blocks(keys)):
        ours = tuple(page_digest(layer.page(i)) for layer in cap.layers)
        if tuple(record.pages) != ours:
            raise MixedComputation(
                f"block {i} of this checkpoint is stored with pages of another computation "
                "of the same tokens; its attachments would not continue from them: "
                "restore that prefix first (its checkpoint), or publish under another "
                "namespace")


def _send(store, batch: PageBatch, records: list[BlockRecord]) -> list:
    """missing -> put_pages -> commit_blocks. A page collected between missing() and the
    commit (eviction, or a GC past its grace) makes the commit refuse; send again once."""
    for attempt in range(2):
        absent = store.missing(list(dict.fromkeys(batch.digests))) if len(batch) else []
        if absent:
            store.put_pages(batch.only(absent))
        try:
            if records:
                store.commit_blocks(records)
            return absent
        except MissingReferences:
            if attempt:
                raise
            log.info("pages vanished between upload and commit; sending them again")
    raise AssertionError("unreachable")


def publish(engine_model: EngineModel, store: PageWriter, tokens: Sequence[int],
            caches: Sequence, *, namespace: str = DEFAULT_NAMESPACE,
            checkpoint: str | None = None, metadata: dict | None = None) -> PublishResult:
    """Capture and upload in the caller's thread, under the engine model's identity for
    the caches' conversion history (engine/stock.py). For write-behind use
    WriteBehindPublisher.submit(capture(engine_model.identity, tokens, caches))."""
    identity = engine_model.identity_for(conversion_offset(leaf_caches(caches)))
    if checkpoint is None and _at_prompt_boundary(identity, caches, len(tokens)):
        # sliding, chunked or recurrent layers are restored from checkpoints only: a cache
        # that sits exactly at the prompt gets one, as generate_with_store gives it
        cap = capture(identity, tokens, caches, attachments=True)
        try:
            return upload(store, cap, namespace=namespace,
                          checkpoint=prompt_checkpoint_name(cap.tokens), metadata=metadata)
        except MixedComputation as exc:
            log.info("prompt checkpoint skipped: %s", exc)
            return upload(store, cap, namespace=namespace)
    cap = capture(identity, tokens, caches, attachments=checkpoint is not None)
    return upload(store, cap, namespace=namespace, checkpoint=checkpoint, metadata=metadata)


def prompt_checkpoint_name(tokens: Sequence[int]) -> str:
    """The checkpoint name a prompt boundary gets (publish, generate_with_store)."""
    data = b"".join(int(t).to_bytes(4, "little") for t in tokens)
    return PROMPT_CHECKPOINT_PREFIX + blake3.blake3(data).hexdigest()[:32]


def _at_prompt_boundary(identity: FormatIdentity, caches: Sequence, num_tokens: int) -> bool:
    """True for a model with non-paged layers whose every counted layer sits at exactly
    num_tokens: a checkpoint of it is valid. A cache that ran past the tokens (generated
    tokens fed back) publishes its full-attention prefix only, and a cache none of whose
    layers counts its tokens (pure recurrent state) cannot show where it sits, so it is
    checkpointed only when the caller names one (generate_with_store does)."""
    if all(layer.paged for layer in identity.layers) or not num_tokens:
        return False
    offsets = {token_offset(c) for c in leaf_caches(caches)} - {None}
    return offsets == {num_tokens}
