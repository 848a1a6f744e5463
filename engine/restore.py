"""Restore: the longest stored prefix of a prompt, rebuilt as a model's cache.

restore(engine_model, store, RestoreRequest(tokens, ...)) -> Restored(cache,
tokens_restored, ...), which unpacks as (cache, tokens_restored).

Order of work, so that "incompatible" and "does not fit" are decided before anything
is allocated:
  1. the model's format identity under the KV policy (computed once by EngineModel,
     which also compared any pools it was given with it field by field:
     IncompatibleFormat carries the diff) and the target cache kind;
  2. the source: for a model whose layers are all full attention, lookup_prefix over
     block records; for a model with sliding-window or recurrent layers, the longest
     checkpoint of the same format whose tokens prefix the prompt (their state is only
     valid at exactly its own length, so it is never restored partway). A source stops
     before the first block with a missing or quarantined page (lookup_prefix does it;
     for a checkpoint, has_blocks and missing() say so without reading a page): a
     checkpoint without attachments gives the blocks before it, one with attachments
     is passed over for a shorter usable one (or, named, restores nothing). Pages of
     a converted identity (converted_at_token N) are never restored below N tokens;
  3. pool capacity for every paged layer (PoolExhausted before any allocation), or,
     with admission=, the price of the whole request (pages for the prompt plus
     max_new_tokens, staging, workspace) against the budget: a Deferred or Refused
     decision comes back in Restored.decision with no cache and nothing allocated;
  4. pages are read zero-copy from a local Store's map, verified against their hashes
     by the store on several reader threads at once (engine/pageread.py), or fetched
     into buffers from a RemoteStore, and copied once, on worker threads: on the CPU
     and unified memory straight into freshly allocated pool blocks or into one array
     per plane and layer of the stock mlx-lm caches (host views of MLX memory,
     engine/pagecopy.py), fused for a local store: every layer is laid out first (on
     stand-ins of the pages' lengths), then each reader copies the pages it has just
     verified while they are in cache (_read_fused; fresh per-layer arrays are
     allocated uninitialised, and the copies are their only write); on a CUDA GPU, after one
     verified read, into a reused host staging buffer that the GPU reads in place,
     one slice update per plane and layer, started layer by layer so the GPU's copy
     of one layer overlaps the host's copy of the next (_read_views). A page that
     fails its check raises IntegrityError (the store quarantined it) and the blocks
     laid out so far are given back.
     Nothing is evaluated afterwards but what is still lazy (a native layer quantized
     on restore): a paged layer's state is a gather of its whole history, which
     nobody reads.

Targets (cache_kind) by page format; every other pairing is refused with
IncompatibleFormat (and its diff) in step 1, before anything is allocated:
  paged      native-*, k8v8, k8v4, k4v4 into PagedKVCache (pools).
  kvcache    native-* into mlx-lm's KVCache.
  quantized  mlx-qB into mlx-lm's QuantizedKVCache, byte for byte (bits and group size
             come from the identity; quantized_bits / quantized_group_size, if given,
             must agree with it); native-* into a QuantizedKVCache by quantizing on
             restore (KVCache.to_quantized with quantized_group_size, default 64, and
             quantized_bits, default 8): equal to what generate_step(kv_bits=...) makes
             of a natively prefilled cache, not to a cache quantized from its first token.
mlx-qB pages do not go into a PagedKVCache (the kernels have no layout for them) nor
into a KVCache (dequantizing them would be a third computation, equal neither to
recompute nor to the QuantizedKVCache they came from).

At most len(tokens) - 1 tokens are restored by default: the model must still run on
at least one token to produce the logits of the next.
Native restores are bit-exact with recompute; packed and mlx-qB restores are the
published bytes, byte for byte.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

from engine.admission import AdmissionRequest, Decision, Grant
from engine.attachments import decode_attachment, token_offset
from engine.cache import PagedKVCache
from engine.engine_model import EngineModel, check_pools
from engine.errors import FormatMismatch, InvalidRequest, OffsetMismatch, PoolExhausted
from engine.formats import PAGED_FORMATS, PageSpec, page_specs
from engine.geometry import leaf_caches, with_leaves
from engine.models import default_attention_impl
from engine.pagecopy import (
    DeferredCopies,
    DeviceStaging,
    PageCopies,
    device_copy,
    direct_writes,
    host_view,
    page_regions,
    uninitialised,
)
from engine.pageread import STAGING_READ_CHUNK_NBYTES, STAGING_READ_WORKERS, read_into, read_pages
from engine.publish import DEFAULT_NAMESPACE
from engine.stock import ConvertedQuantizedKVCache, TrackedKVCache
from kernels.quantize import cuda_available
from kvstore.errors import IncompatibleFormat, NotFound
from kvstore.format import FormatIdentity, diff
from kvstore.protocol import PageReader
from kvstore.records import BlockRecord, Checkpoint

log = logging.getLogger(__name__)
CACHE_KINDS = ("paged", "kvcache", "quantized")
# mlx-lm's QuantizedKVCache defaults, used when native pages are quantized on restore.
DEFAULT_QUANTIZED_GROUP_SIZE = 64
DEFAULT_QUANTIZED_BITS = 8


@dataclass
class Restored:
    cache: list
    tokens_restored: int
    blocks: int = 0
    bytes_read: int = 0
    source: str = "none"  # "prefix" | "checkpoint" | "none"
    checkpoint: str | None = None
    decision: Decision | None = None  # with admission: Granted, Deferred or Refused
    grant: Grant | None = None  # with admission, when granted: close() it when done
    resident_blocks: int = 0  # leading blocks shared from a ResidentIndex, not read

    @property
    def admitted(self) -> bool:
        return self.decision is None or self.decision.granted

    def __iter__(self):
        yield self.cache
        yield self.tokens_restored


def check_target(identity: FormatIdentity, cache_kind: str, group_size: int | None = None,
                 bits: int | None = None) -> tuple[int, int]:
    """IncompatibleFormat (with a diff per layer) unless caches of `cache_kind` can hold
    the identity's pages (see the module docstring). Returns the (group_size, bits) a
    "quantized" target uses: the identity's for mlx-qB pages, else the arguments or
    mlx-lm's defaults. Reads nothing, allocates nothing."""
    problems, quantized = [], set()
    for index, spec in enumerate(page_specs(identity)):
        if spec is None:
            continue
        fmt, path = spec.format, f"layers[{index}].page_format"
        if cache_kind == "paged" and not fmt.paged:
            problems.append((path, "a paged format (" + ", ".join(PAGED_FORMATS) + ")", fmt.name))
        elif cache_kind == "kvcache" and not fmt.native:
            problems.append((path, "native (a KVCache holds K/V as computed)", fmt.name))
        elif cache_kind == "quantized" and fmt.packed:
            problems.append((path, "native or mlx-qB (a QuantizedKVCache holds mlx's codes)",
                             fmt.name))
        elif cache_kind == "quantized" and fmt.mlx_affine:
            if bits is not None and bits != fmt.k_bits:
                problems.append((path, f"mlx-q{bits}", fmt.name))
            if group_size is not None and group_size != spec.group_size:
                problems.append((f"layers[{index}].group_size", group_size, spec.group_size))
            quantized.add((spec.group_size, fmt.k_bits))
    if problems:
        raise IncompatibleFormat(f"{cache_kind} caches cannot hold the pages this format "
                                 "identity names", problems)
    assert len(quantized) <= 1, f"one identity names several mlx-qB layouts: {quantized}"
    if quantized:
        return quantized.pop()
    return (DEFAULT_QUANTIZED_GROUP_SIZE if group_size is None else group_size,
            DEFAULT_QUANTIZED_BITS if bits is None else bits)


def find_checkpoint(store: PageReader, identity: FormatIdentity, namespace: str,
                    tokens: Sequence[int], limit: int) -> Checkpoint | None:
    """The longest usable checkpoint of this format whose tokens prefix tokens[:limit]
    (and reach the identity's conversion offset). Usable: every block and attachment
    page is present and not quarantined (_complete); a damaged one is passed over for
    the next shorter, since attachment state is only valid at its own length."""
    head = tuple(tokens[:limit])
    candidates = [c for c in store.list_checkpoints(namespace)
                  if c.format_id in _readable_format_ids(identity) and 0 < len(c.tokens) <= limit
                  and len(c.tokens) >= identity.converted_at_token
                  and head[: len(c.tokens)] == tuple(c.tokens)]
    for ckpt in sorted(candidates, key=lambda c: len(c.tokens), reverse=True):
        if _complete(store, ckpt) == (len(ckpt.chain_keys), True):
            return ckpt
        log.info("checkpoint %s/%s has a missing or quarantined page; trying a shorter one",
                 namespace, ckpt.name)
    return None


def _readable_format_ids(identity: FormatIdentity) -> tuple[bytes, ...]:
    """The format ids whose pages this identity may be served from: its own, then the
    schema-1 id of the same pages where one exists (FormatIdentity.equivalent_older:
    stores written before schema 2 keep serving native and kXvY prefixes)."""
    older = identity.equivalent_older()
    return (identity.format_id,) if older is None else (identity.format_id, older.format_id)


def _complete(store: PageReader, ckpt: Checkpoint) -> tuple[int, bool]:
    """(leading chain keys whose blocks are complete, whether every attachment page is
    present): presence checks only, nothing is read or hashed. has_blocks answers False
    for a block whose record or any page is missing or quarantined."""
    present = store.has_blocks(list(ckpt.chain_keys)) if ckpt.chain_keys else []
    whole = next((i for i, ok in enumerate(present) if not ok), len(present))
    attachments = list(ckpt.attachments.values())
    return whole, not attachments or not store.missing(attachments)


def _usable_part(store: PageReader, ckpt: Checkpoint) -> tuple[Checkpoint | None, list]:
    """What of a named checkpoint can be restored: all of it when complete; for one
    without attachments (a model of full-attention layers only) the blocks before the
    first damaged one, the caller recomputing the rest; for one with attachments
    (valid only at exactly its length) nothing."""
    whole, attachments_ok = _complete(store, ckpt)
    if whole == len(ckpt.chain_keys) and attachments_ok:
        return ckpt, store.get_blocks(ckpt.chain_keys)
    log.info("checkpoint %s/%s has a missing or quarantined page after block %d",
             ckpt.namespace, ckpt.name, whole)
    if ckpt.attachments or whole == 0:
        return None, []
    return ckpt, store.get_blocks(ckpt.chain_keys[:whole])


@contextmanager
def _pages(store: PageReader, digests: list):
    """Verified page buffers from store.get_pages: zero-copy views of the store's map
    where the store maps its pages (store.maps_pages; verified on several threads,
    engine/pageread.py), else buffers it fetched into (a RemoteStore over HTTP;
    admission prices those as staging)."""
    with read_pages(store, digests) as views:
        yield views


def _check_capacity(pools, n_blocks: int) -> None:
    for index, pool in enumerate(pools):
        if pool is not None and pool.num_available_blocks < n_blocks:
            raise PoolExhausted(
                f"restoring {n_blocks} blocks into layer {index}'s pool would exceed it "
                f"({pool.num_available_blocks} blocks available); nothing was allocated",
                requested=n_blocks, available=pool.num_available_blocks)


@dataclass(frozen=True)
class RestoreRequest:
    """One restore: what to look up and what the caller will do with it.

    tokens             the prompt (token ids)
    max_restore_tokens restore at most this many (default len(tokens) - 1: the model
                       must still run on one token to produce the next logits)
    max_new_tokens     tokens the caller will generate after it (admission prices them)
    cache_kind         "paged", "kvcache" or "quantized" (see the module docstring)
    checkpoint         restore this named checkpoint exactly (IncompatibleFormat, with
                       the diff, when it was saved under another format)
    deadline           absolute, on the admission controller's clock
    converted_at_token the request's conversion history for mlx-qB pages (0: quantized
                       from the first token; N: a native cache converted at N,
                       engine/stock.py); only pages of that history, never below N
    quantized_group_size, quantized_bits
                       a "quantized" target's layout for native pages (mlx-lm's
                       defaults when None); for mlx-qB pages they must agree
    """

    tokens: Sequence[int]
    max_restore_tokens: int | None = None
    max_new_tokens: int = 0
    cache_kind: str = "paged"
    checkpoint: str | None = None
    deadline: float | None = None
    namespace: str = DEFAULT_NAMESPACE
    request_id: str = ""
    converted_at_token: int = 0
    quantized_group_size: int | None = None
    quantized_bits: int | None = None

    def __post_init__(self):
        if self.cache_kind not in CACHE_KINDS:
            raise InvalidRequest(f"cache_kind must be one of {CACHE_KINDS}, got {self.cache_kind!r}")
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))

    @property
    def limit(self) -> int:
        """The most tokens this request lets a restore provide."""
        if self.max_restore_tokens is None:
            return len(self.tokens) - 1
        return min(self.max_restore_tokens, len(self.tokens))


@dataclass(frozen=True)
class _Plan:
    """What restore decided before allocating anything: the identity to read under, the
    target layout and the source (blocks, and the checkpoint they come from, if any)."""

    identity: FormatIdentity
    cache_kind: str
    group_size: int
    bits: int
    blocks: list[BlockRecord]
    checkpoint: Checkpoint | None

    @property
    def tokens(self) -> int:
        return sum(len(b.tokens) for b in self.blocks)


def restore(engine_model: EngineModel, store: PageReader, request: RestoreRequest) -> Restored:
    """See the module docstring. With the engine model's admission controller, the
    request (its prompt, max_new_tokens and deadline) is priced, restore staging
    included, after the identity check and before any allocation; a Deferred or
    Refused decision comes back with no cache. With its resident index, leading blocks
    it holds are shared from this process's pools instead of read from the store, and
    every restored full block is listed in it afterwards."""
    kind = request.cache_kind
    if kind != "paged" and (engine_model.resident is not None or engine_model.admission is not None):
        raise InvalidRequest("admission and resident reuse serve paged caches only: "
                             f"this engine model cannot restore into {kind!r} caches")
    identity = engine_model.identity_for(request.converted_at_token)
    group_size, bits = check_target(identity, kind, request.quantized_group_size,
                                    request.quantized_bits)
    ckpt, blocks = _source(store, identity, request)
    plan = _Plan(identity, kind, group_size, bits, blocks, ckpt)
    grant, decision = None, None
    if engine_model.admission is not None:
        decision = engine_model.admission.admit(engine_model.profile(), AdmissionRequest(
            request.request_id, len(request.tokens), request.max_new_tokens, request.deadline,
            restore_blocks=len(blocks), restored_tokens=plan.tokens,
            restore_remote=not store.maps_pages))
        if not decision.granted:
            return Restored(None, 0, decision=decision)
        grant = decision.grant
    try:
        result = _build(engine_model, store, plan, grant)
        if engine_model.resident is not None and blocks:
            restored_tokens = [t for b in blocks for t in b.tokens]
            engine_model.resident.register(identity, request.namespace, restored_tokens,
                                           leaf_caches(result.cache),
                                           store.chain_salt(request.namespace))
    except BaseException:
        if grant is not None:
            grant.close()
        raise
    if grant is not None:
        grant.bind(leaf_caches(result.cache))
        grant.staging_done()  # _build evaluated every page into the pools
        result.decision, result.grant = decision, grant
    _assert_one_offset(result)
    return result


def _source(store: PageReader, identity: FormatIdentity,
            request: RestoreRequest) -> tuple[Checkpoint | None, list[BlockRecord]]:
    """The checkpoint (or None) and the blocks a restore reads (module docstring, 2)."""
    tokens, limit, namespace = request.tokens, request.limit, request.namespace
    ckpt, blocks = None, []
    if request.checkpoint is not None:
        ckpt = store.get_checkpoint(namespace, request.checkpoint)
        if ckpt.format_id not in _readable_format_ids(identity):
            try:
                theirs = store.get_format(ckpt.format_id)
            except NotFound:
                theirs = None
            raise IncompatibleFormat(
                f"checkpoint {namespace}/{request.checkpoint} was saved under another format",
                diff(identity, theirs) if theirs is not None else
                [("format_id", identity.format_id_hex, ckpt.format_id.hex())])
        if tokens[: len(ckpt.tokens)] != tuple(ckpt.tokens):
            raise InvalidRequest(f"checkpoint {namespace}/{request.checkpoint} is not a prefix "
                                 "of the prompt")
        ckpt, blocks = _usable_part(store, ckpt)
    elif limit > 0 and all(layer.paged for layer in identity.layers):
        for format_id in _readable_format_ids(identity):  # the current id first
            blocks = list(store.lookup_prefix(format_id, namespace, tokens,
                                              max_tokens=limit).blocks)
            if blocks:
                break
    elif limit > 0:
        ckpt = find_checkpoint(store, identity, namespace, tokens, limit)
        if ckpt is not None:
            blocks = store.get_blocks(ckpt.chain_keys)
    if blocks and sum(len(b.tokens) for b in blocks) < identity.converted_at_token:
        ckpt, blocks = None, []  # below the conversion: no computation of this history had it
    if not blocks and (ckpt is None or not ckpt.attachments):
        ckpt = None  # nothing to restore
    return ckpt, blocks


def _assert_one_offset(result: Restored) -> None:
    """A restored cache continues one sequence: every layer that counts tokens sits at
    exactly tokens_restored. Anything else is a broken invariant (a checkpoint whose
    layers were captured at different offsets would continue differently from
    recompute), so it fails loudly instead of being served."""
    offsets = [token_offset(c) for c in leaf_caches(result.cache)]
    assert all(o is None or o == result.tokens_restored for o in offsets), (
        f"restore of {result.tokens_restored} tokens ({result.source} "
        f"{result.checkpoint or ''}) left the layers at offsets {offsets}")


def _history(spec: PageSpec, pages: list,
             copies: PageCopies | None) -> tuple[dict[str, mx.array], int]:
    """Pages (in block order) -> (name -> [1, H, tokens, width], tokens), bytes as they are.

    Each plane is one array allocated for this layer; every page is copied once into
    its token range by strided copies: through host views, or on device backends into
    a reused DeviceStaging buffer laid out as the planes, which the device copies into
    the layer's arrays (one copy per plane, started, not awaited). With `copies`,
    host-view copies are only added to it and the caller runs them while the pages are
    valid."""
    size = spec.block_size_tokens
    _check_page_lengths(spec, pages)
    tail = len(memoryview(pages[-1]).cast("B")) // spec.page_nbytes(1)
    n_tokens = (len(pages) - 1) * size + tail
    counts = [size] * (len(pages) - 1) + [tail]
    widths, dtypes = spec.plane_widths, spec.plane_dtypes
    shapes = {n: (spec.kv_heads, n_tokens, widths[n] * dtypes[n].size) for n in spec.plane_names}
    direct = direct_writes()
    if direct:
        # uninitialised: the pages below write every byte (_check_page_lengths: they
        # hold exactly n_tokens whole tokens of every plane)
        out = uninitialised({n: (1, spec.kv_heads, n_tokens, widths[n]) for n in spec.plane_names},
                            dtypes)
        hosts = {n: host_view(a)[0] for n, a in out.items()}  # [H, tokens, row bytes]
    else:
        staging = _STAGING.buffer()
        staged, host = staging.take(sum(h * t * r for h, t, r in shapes.values()))
        hosts, devices, at = {}, {}, 0
        for n, shape in shapes.items():
            nbytes = shape[0] * shape[1] * shape[2]
            hosts[n] = host[at : at + nbytes].reshape(shape)
            plane = staged[at : at + nbytes]
            plane = plane if dtypes[n] == mx.uint8 else plane.view(dtypes[n])
            devices[n] = plane.reshape(1, spec.kv_heads, n_tokens, widths[n])
            at += nbytes
    inline = copies is None or not direct
    run = PageCopies() if inline else copies
    for index, (page, count) in enumerate(zip(pages, counts, strict=True)):
        lo = index * size
        run.add(page, page_regions(spec, count), {n: h[:, lo : lo + count] for n, h in hosts.items()})
    if inline:
        run.run()
    if not direct:  # one device copy per plane, out of the staging buffer
        out = {n: device_copy(plane) for n, plane in devices.items()}  # not views of it
        staging.hold(list(out.values()))
        mx.async_eval(list(out.values()))
    return out, n_tokens


def _check_page_lengths(spec: PageSpec, pages: list) -> None:
    """FormatMismatch unless every page but the last holds a full block and the last
    holds 1..block_size_tokens whole tokens."""
    size = spec.block_size_tokens
    lengths = [len(memoryview(p).cast("B")) for p in pages]
    full, per_token = spec.page_nbytes(size), spec.page_nbytes(1)
    if any(n != full for n in lengths[:-1]):
        raise FormatMismatch(f"every page but the last must hold a full block ({full} bytes)")
    if not pages or lengths[-1] == 0 or lengths[-1] % per_token or lengths[-1] > full:
        raise FormatMismatch(f"the last page must hold 1..{size} tokens of {per_token} bytes")


class _ThreadStaging(threading.local):
    """One reused host staging buffer per thread (device backends; restores may run on
    several threads at once)."""

    def buffer(self) -> DeviceStaging:
        if not hasattr(self, "staging"):
            self.staging = DeviceStaging()
        return self.staging


_STAGING = _ThreadStaging()


def kvcache_from_pages(spec: PageSpec, pages: list, copies: PageCopies | None = None) -> KVCache:
    """An mlx-lm KVCache holding native pages (in block order): K/V [1, H, tokens, D].
    With `copies`, the page bytes land when the caller runs them (see _history)."""
    if not spec.format.native:
        raise FormatMismatch(f"a KVCache holds native K/V, not {spec.format.name} pages")
    planes, n_tokens = _history(spec, pages, copies)
    cache = TrackedKVCache()  # a later conversion (generate_step kv_bits) is recorded
    cache.state = (planes["k"], planes["v"], n_tokens)
    return cache


def quantized_kvcache_from_pages(spec: PageSpec, pages: list, converted_at_token: int = 0,
                                 copies: PageCopies | None = None) -> QuantizedKVCache:
    """An mlx-lm QuantizedKVCache holding mlx-qB pages (in block order), byte for byte:
    keys = (codes [1, H, tokens, Dk*B/32] u32, scales [1, H, tokens, Dk/G], biases
    [1, H, tokens, Dk/G]), values likewise; bits and group size from the spec. Pages of
    a converted cache come back as a ConvertedQuantizedKVCache with its offset."""
    if not spec.format.mlx_affine:
        raise FormatMismatch(f"a QuantizedKVCache holds mlx-qB pages, not {spec.format.name}")
    planes, n_tokens = _history(spec, pages, copies)
    cache = (ConvertedQuantizedKVCache(spec.group_size, spec.format.k_bits, converted_at_token)
             if converted_at_token else
             QuantizedKVCache(group_size=spec.group_size, bits=spec.format.k_bits))
    cache.keys = tuple(planes[n] for n in ("k_codes", "k_scales", "k_biases"))
    cache.values = tuple(planes[n] for n in ("v_codes", "v_scales", "v_biases"))
    cache.offset = n_tokens
    return cache


def empty_cache(engine_model: EngineModel, request: RestoreRequest) -> list:
    """The caches a restore of nothing gives for this request's cache kind, without
    looking anything up (generate_with_store recomputes with them)."""
    identity = engine_model.identity_for(request.converted_at_token)
    group_size, bits = check_target(identity, request.cache_kind, request.quantized_group_size,
                                    request.quantized_bits)
    return _fresh(engine_model, _Plan(identity, request.cache_kind, group_size, bits, [], None),
                  None)


def _fresh(engine_model: EngineModel, plan: _Plan, grant: Grant | None) -> list:
    """Empty caches of the plan's kind: paged layers in the engine model's pools (under
    the grant), mlx-lm's caches (engine.stock) for the rest."""
    if plan.cache_kind == "paged":
        return engine_model.make_cache(grant)
    caches = engine_model.make_stock_cache()
    if plan.cache_kind == "quantized":  # empty: quantized from the first token
        caches = [QuantizedKVCache(plan.group_size, plan.bits) if isinstance(c, TrackedKVCache)
                  else c for c in caches]
    return caches


def _build(engine_model: EngineModel, store: PageReader, plan: _Plan,
           grant: Grant | None) -> Restored:
    """The plan's caches: empty ones for an empty plan, else its pages copied in once."""
    if not plan.blocks and plan.checkpoint is None:
        return Restored(_fresh(engine_model, plan, grant), 0)
    blocks, ckpt = plan.blocks, plan.checkpoint
    if plan.cache_kind == "paged":
        _check_capacity(engine_model.pools, len(blocks))
    shared, adopted = _adopt_resident(engine_model, plan)
    fetched = blocks[shared:]
    attachment_names = sorted(ckpt.attachments) if ckpt is not None else []
    top = _fresh(engine_model, plan, grant)
    caches = leaf_caches(top)  # one per identity layer (CacheLists flattened)
    try:
        fused = _fused(engine_model, store, plan)
        read = _read_fused if fused else _read_views
        copies = (DeferredCopies(hash_on_device=_hash_on_device()) if fused else PageCopies())
        targets = _Targets(adopted, grant, copies)
        nbytes = read(engine_model, store, plan, fetched, caches, targets)
        if attachment_names:
            with _pages(store, [ckpt.attachments[name] for name in attachment_names]) as views:
                nbytes += sum(len(v) for v in views)
                for name, view in zip(attachment_names, views, strict=True):
                    index = int(name.split(".", 1)[1])
                    caches[index] = _attachment_cache(ckpt, index, view)
                    mx.eval(caches[index].state)  # decoded from the view: done before it closes
    except BaseException:
        for cache in caches:  # a page failed its check: give back what was laid out
            if isinstance(cache, PagedKVCache):
                cache.free()
        raise
    # What is still lazy (a native layer quantized on restore) is evaluated here; a paged
    # layer's state is a gather of its whole history, which nothing reads: not evaluated.
    mx.eval([c.state for c in caches if isinstance(c, QuantizedKVCache)])
    return Restored(with_leaves(top, _plain_nested(top, caches)), plan.tokens, len(blocks), nbytes,
                    "checkpoint" if ckpt is not None else "prefix",
                    ckpt.name if ckpt is not None else None, resident_blocks=shared)


def _fused(engine_model: EngineModel, store: PageReader, plan: _Plan) -> bool:
    """Whether the plan's pages are read fused (_read_fused), from a store that maps its
    pages: where restores write through host views (direct_writes), unless a layer is
    quantized on restore (that needs the bytes while it is laid out); on a device
    backend, into pools, one per layer (each pool's staging buffer holds one layer's
    pages until the device copies them, BlockPool.write_pages)."""
    if not store.maps_pages:
        return False
    if not direct_writes():
        paged = plan.identity.paged_layers
        return (plan.cache_kind == "paged"
                and len({id(engine_model.pools[layer]) for layer in paged}) == len(paged))
    quantizes = plan.cache_kind == "quantized" and any(
        layer.paged and not PageSpec.from_layer_spec(layer, plan.identity.block_size_tokens).format.mlx_affine
        for layer in plan.identity.layers)
    return not quantizes


def _read_fused(engine_model: EngineModel, store: PageReader, plan: _Plan, fetched: list,
                caches: list, targets: _Targets) -> int:
    """Every paged layer's cache laid out on stand-ins for its pages (each page's length
    from its block's tokens), and each page copied into its targets by the reader that
    verified it, while it is in cache (engine/pageread.py read_into), on several threads
    at once: one pass over the bytes. Every layer is laid out first, then read, into
    pools and into fresh per-layer arrays (KVCache, QuantizedKVCache) alike: the fresh
    arrays are allocated uninitialised (_history), so laying out 32 layers of 512 MiB
    costs about 25 ms and the copies are the first touch of their memory. (2-core CPU,
    512 MiB into KVCache layout, medians of 6: 151 ms warm, 387-412 ms on memory fresh
    from the OS, against 143-240 / 454-476 ms when each layer was read on a thread of
    its own while the next was allocated, which made the allocation wait for the GIL.)
    Returns the bytes read."""
    paged, n, size = plan.identity.paged_layers, len(fetched), plan.identity.block_size_tokens
    specs = [PageSpec.from_layer_spec(plan.identity.layers[layer], size) for layer in paged]
    lengths = [spec.page_nbytes(len(block.tokens)) for spec in specs for block in fetched]
    stand_ins = targets.copies.stand_ins(lengths)  # layer-major: layer j, block i at j * n + i
    page_nbytes = max((s.block_nbytes for s in specs), default=1)
    for j, layer in enumerate(paged):
        caches[layer] = _layer_cache(engine_model, plan, layer, stand_ins[j * n : (j + 1) * n], targets)
    digests = [block.pages[j] for j in range(len(paged)) for block in fetched]
    if direct_writes():
        read_into(store, digests, targets.copies.copy, page_nbytes)
    else:
        _read_into_staging(store, digests, lengths, targets.copies,
                           [engine_model.pools[layer] for layer in paged], page_nbytes)
    targets.copies.run()  # nothing but stand-ins was added: a no-op
    return sum(lengths)


# On a CUDA GPU the restore leaves the pages' xxh3-128 to the device, which hashes the copy
# it made of them (kernels/page_hash.py) before the store compares (kvstore/deferred.py);
# False: the host verifies every page before it copies it (tools/bench/profile compares
# the two).
HASH_ON_DEVICE = True


def _hash_on_device() -> bool:
    return HASH_ON_DEVICE and not direct_writes() and cuda_available()


# A device restore reads its layers in groups of at least this many bytes (the first
# group takes what is left: read_groups lays them out from the end), each group's device
# copies started as soon as its pages are in staging, so that they overlap the next
# group's read (_read_into_staging). H200, 8K tokens, the restore with its device
# copies (tools/bench/profile/issue19_groups.py, medians of 5-6, three runs): 8B-shaped
# (1 GiB) in 256 MiB groups 97.8 ms against 110.7 in one group and 100.2 in 128 MiB
# groups; 1B-shaped (256 MiB, so one group) 41.8 ms, in 128 MiB groups 39.9, in 64 MiB
# groups 42.7-43.2: each group costs the host about 2 ms, the device's copies (about 21
# ms per GiB, over the bus) hide behind the next group's read.
DEVICE_READ_GROUP_NBYTES = 256 * 2**20
# ... and with this set, the groups taper towards the end: the last group holds at least
# this many bytes and each group before it at least twice the one after it (up to the size
# above), so that the device's copies and hashes of the last group, which nothing overlaps,
# are short (on the H200 the 1B-shaped restore, 256 MiB in one group, waited 7.2 ms for
# them after a 14 ms read: docs/benchmarks.md "2026-12-07, later"). None: equal groups.
# Off: on an H100, whose host reads at a third of the H200's speed, tapering to 16-64 MiB
# was no faster than equal groups within the spread (docs/benchmarks.md "2026-12-07,
# night"); no H200 could be had to measure it where the settle is a quarter of the restore
# (tools/bench/profile/issue19_groups.py compares them).
DEVICE_READ_LAST_NBYTES: int | None = None


def read_groups(layer_nbytes: Sequence[int], largest: int, last: int | None) -> list[tuple[int, int]]:
    """(first, stop) layer ranges covering every layer, in order, laid out from the end:
    groups of at least `largest` bytes, or with `last` (DEVICE_READ_LAST_NBYTES) a last
    group of at least `last` bytes and each one before it at least twice the one after
    it, up to `largest`. The first group takes what is left, however little."""
    bounds, stop, want = [], len(layer_nbytes), (largest if last is None else min(last, largest))
    while stop > 0:
        first, nbytes = stop - 1, layer_nbytes[stop - 1]
        while first > 0 and nbytes < want:
            first -= 1
            nbytes += layer_nbytes[first]
        bounds.append((first, stop))
        stop = first
        if last is not None:
            want = min(largest, 2 * nbytes)
    return bounds[::-1]


def _read_into_staging(store: PageReader, digests: list, lengths: list[int], copies: DeferredCopies,
                       pools: list, page_nbytes: int) -> None:
    """The fused read on a device backend: every page into its pool's staging row
    (BlockPool.write_pages laid them out, one pool per layer; digests and their
    lengths layer-major), then the device's copies into the pools. The layers go in
    groups (read_groups: DEVICE_READ_GROUP_NBYTES, tapering to DEVICE_READ_LAST_NBYTES
    at the end): each group is read (read_into in long runs on
    fewer threads, engine/pageread.py; the store's own read_pages_into into the rows
    measured slower, 114.7 against 97.8 ms at 8B, its per-page index lookups run on
    one thread before its copies start), then its pools' device copies start
    (mx.async_eval), and the next group is read meanwhile. With copies.hash_on_device
    the store leaves each page's xxh3-128 to the device (get_pages_deferred): the
    device's copies of a group are hashed as they land, and the store settles every
    page's hash before this returns (_settle)."""
    n = len(digests) // max(1, len(pools))
    checks, hashed = [], []  # (first read index, DeferredPages); (page indices, hashes)
    layer_nbytes = [sum(lengths[j * n : (j + 1) * n]) for j in range(len(pools))]
    for first, last in read_groups(layer_nbytes, DEVICE_READ_GROUP_NBYTES, DEVICE_READ_LAST_NBYTES):
        a, group, group_checks = first * n, pools[first:last], ([] if copies.hash_on_device else None)
        read_into(store, digests[a : last * n], lambda i, page, at=a: copies.copy(at + i, page),
                  page_nbytes, STAGING_READ_WORKERS, STAGING_READ_CHUNK_NBYTES, group_checks)
        started = [plane for pool in group for plane in pool.planes.values()]
        if group_checks is not None:
            checks += [(a + at, pages) for at, pages in group_checks]
            group_hashes = copies.device_hashes(group)
            hashed += group_hashes
            started += [hashes for _, hashes in group_hashes]
        mx.async_eval(started)
    if copies.hash_on_device:
        _settle(checks, hashed, len(digests))


def _settle(checks: list, hashed: list, count: int) -> None:
    """The store's comparison of the device's hashes (waits for them: the restore returns
    only after every page it read matched, kvstore/deferred.py). checks: (first read
    index, DeferredPages) of every run; hashed: (read indices, [n, 2] uint64 hashes)."""
    computed: list[bytes | None] = [None] * count
    for indices, hashes in hashed:
        raw = np.array(hashes).astype(">u8").tobytes()  # (high, low) big-endian: the digest bytes
        for k, index in enumerate(indices):
            computed[index] = raw[16 * k : 16 * (k + 1)]
    for at, pages in checks:
        got = computed[at : at + len(pages.expected)]
        unhashed = [at + i for i, (want, have) in enumerate(zip(pages.expected, got, strict=True))
                    if want is not None and have is None]
        assert not unhashed, f"pages {unhashed[:4]} owe a checksum that nothing computed"
        pages.settle(got)


def _read_views(engine_model: EngineModel, store: PageReader, plan: _Plan, fetched: list,
                caches: list, targets: _Targets) -> int:
    """Every paged layer's pages in one read (verified views, on several reader threads
    for a store that maps its pages, engine/pageread.py), then each layer laid out and
    its pages copied while the views are valid: into the pools or the caches' arrays, or
    on a device backend into staging, with the device's copies of one layer started
    before the host copies the next. (H200, 1 GiB: reading in groups of layers, the
    next group verified while one is copied, took 159-176 ms against 138 ms for one
    read; tools/bench/profile/restore_h200.py stages.) Returns the bytes read."""
    paged, n = plan.identity.paged_layers, len(fetched)
    copies = targets.copies
    # layer-major: pages of block i, layer paged[j] at views[j * n + i]
    with _pages(store, [block.pages[j] for j in range(len(paged)) for block in fetched]) as views:
        try:
            for j, layer in enumerate(paged):
                caches[layer] = _layer_cache(engine_model, plan, layer, views[j * n : (j + 1) * n],
                                             targets)
                copies.start()  # this layer's copies overlap the next one's layout
            copies.run()  # every page once, into the pools, the caches' arrays or staging
        finally:
            copies.wait()  # no copy still reads a view once the with-block ends
        return sum(len(v) for v in views)


def _plain_nested(top: list, leaves: list) -> list:
    """leaves with each TrackedKVCache inside a CacheList made mlx-lm's own KVCache (the
    same arrays): generate_step converts top-level caches only, so nothing is recorded
    there, and mlx-lm's save_prompt_cache names a CacheList's sub-caches by class, which
    its load_prompt_cache looks up in mlx_lm.models.cache (engine.stock.to_mlx_lm)."""
    out, at = list(leaves), 0
    for cache in top:
        count = len(leaf_caches([cache]))
        if isinstance(cache, CacheList):
            for i in range(at, at + count):
                if type(out[i]) is TrackedKVCache:
                    plain = KVCache()
                    plain.keys, plain.values, plain.offset = out[i].keys, out[i].values, out[i].offset
                    out[i] = plain
        at += count
    return out


def _adopt_resident(engine_model: EngineModel, plan: _Plan) -> tuple[int, dict]:
    """(leading blocks shared from the resident index, layer -> adopted cache)."""
    resident, identity = engine_model.resident, plan.identity
    if resident is None:
        return 0, {}
    full = [b.key for b in plan.blocks if len(b.tokens) == identity.block_size_tokens]
    shared = resident.longest(full)
    if not shared:
        return 0, {}
    pool = engine_model.pools[identity.paged_layers[0]]
    impl = _attention_impl(engine_model, pool)
    return shared, resident.adopt([b.key for b in plan.blocks[:shared]],
                                  identity.block_size_tokens, attention_impl=impl)


def _attention_impl(engine_model: EngineModel, pool) -> str | None:
    impl = engine_model.attention_impl
    return default_attention_impl(pool) if impl == "auto" else impl


@dataclass(frozen=True)
class _Targets:
    """Where one restore's pages go: caches adopted from the resident index (layer ->
    cache), the admission grant new caches are made under, and the copies to run."""

    adopted: dict
    grant: Grant | None
    copies: PageCopies


def _layer_cache(engine_model: EngineModel, plan: _Plan, layer: int, pages: list,
                 targets: _Targets):
    """One paged layer's cache laid out for `pages` (in block order) after any adopted
    ones; the bytes land when targets.copies run."""
    spec = PageSpec.from_layer_spec(plan.identity.layers[layer], plan.identity.block_size_tokens)
    adopted, grant, copies = targets.adopted, targets.grant, targets.copies
    if plan.cache_kind == "paged":
        pool = engine_model.pools[layer]
        impl = _attention_impl(engine_model, pool)
        if layer in adopted:
            adopted[layer].append_pages(pages, copies)
            return adopted[layer]
        if grant is None:
            return PagedKVCache.from_pages(pool, pages, attention_impl=impl, copies=copies)
        return grant.cache_from_pages(pool, pages, attention_impl=impl, copies=copies)
    if spec.format.mlx_affine:  # cache_kind "quantized" (check_target)
        return quantized_kvcache_from_pages(spec, pages, plan.identity.converted_at_token,
                                            copies)
    if plan.cache_kind == "quantized":  # quantized from the copied bytes: copy first
        return kvcache_from_pages(spec, pages).to_quantized(plan.group_size, plan.bits)
    return kvcache_from_pages(spec, pages, copies)


def _attachment_cache(ckpt: Checkpoint, index: int, view):
    cache = decode_attachment(view)
    held = token_offset(cache)
    if held is not None and held != len(ckpt.tokens):
        # Written before capture refused checkpoints taken after generation.
        raise OffsetMismatch(
            f"checkpoint {ckpt.namespace}/{ckpt.name} holds {len(ckpt.tokens)} tokens "
            f"but its layer {index} state sits at offset {held}: it was captured after "
            "generation and cannot continue its tokens; delete it and publish again",
            offsets=[held], tokens=len(ckpt.tokens))
    return cache


__all__ = ["Restored", "RestoreRequest", "restore", "empty_cache", "check_pools", "check_target",
           "find_checkpoint", "kvcache_from_pages", "quantized_kvcache_from_pages"]
