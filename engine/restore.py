"""Restore: the longest stored prefix of a prompt, rebuilt as a model's cache.

restore(model, tokens, store, ...) -> Restored(cache, tokens_restored, ...), which
unpacks as (cache, tokens_restored).

Order of work, so that "incompatible" and "does not fit" are decided before anything
is allocated:
  1. the model's format identity under the KV policy; caller-supplied pools are
     compared with it field by field (IncompatibleFormat carries the diff);
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
  4. pages are read zero-copy from the LMDB map for a local Store (each verified
     against its hash on read) or fetched into buffers from a RemoteStore, and copied
     once into freshly allocated pool blocks (or stock mlx-lm caches).

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
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from engine.admission import AdmissionRequest
from engine.attachments import decode_attachment, token_offset
from engine.cache import PagedKVCache
from engine.errors import FormatMismatch, InvalidRequest, OffsetMismatch, PoolExhausted
from engine.formats import PAGED_FORMATS, PageSpec, blocks_from_pages, page_specs
from engine.models import default_attention_impl, make_cache, make_pools, model_identity
from engine.policy import KVPolicy
from engine.publish import DEFAULT_NAMESPACE
from engine.stock import ConvertedQuantizedKVCache, TrackedKVCache, make_stock_cache
from kvstore.errors import IncompatibleFormat, NotFound
from kvstore.format import FormatIdentity, LayerSpec, diff
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
    decision: object = None  # with admission: Granted, Deferred or Refused
    grant: object = None  # with admission, when granted: close() it when done
    resident_blocks: int = 0  # leading blocks shared from a ResidentIndex, not read

    @property
    def admitted(self) -> bool:
        return self.decision is None or self.decision.granted

    def __iter__(self):
        yield self.cache
        yield self.tokens_restored


def check_pools(identity: FormatIdentity, pools: Sequence) -> None:
    """IncompatibleFormat (with the per-layer field diff) unless every paged layer's pool
    stores exactly the pages the identity names."""
    if len(pools) != len(identity.layers):
        raise IncompatibleFormat("pools do not match the model's format identity",
                                 [("len(layers)", len(identity.layers), len(pools))])
    problems = []
    for index, (layer, pool) in enumerate(zip(identity.layers, pools)):
        if layer.paged != (pool is not None):
            problems.append((f"layers[{index}].paged", layer.paged, pool is not None))
            continue
        if pool is None:
            continue
        theirs = pool.spec.layer_spec()
        for field_name in LayerSpec.__dataclass_fields__:
            a, b = getattr(layer, field_name), getattr(theirs, field_name)
            if a != b:
                problems.append((f"layers[{index}].{field_name}", a, b))
        if pool.spec.block_size_tokens != identity.block_size_tokens:
            problems.append((f"layers[{index}].block_size_tokens", identity.block_size_tokens,
                             pool.spec.block_size_tokens))
    if problems:
        raise IncompatibleFormat("the pools store pages of another format than the model's "
                                 "identity", problems)


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
                  if c.format_id == identity.format_id and 0 < len(c.tokens) <= limit
                  and len(c.tokens) >= identity.converted_at_token
                  and head[: len(c.tokens)] == tuple(c.tokens)]
    for ckpt in sorted(candidates, key=lambda c: len(c.tokens), reverse=True):
        if _complete(store, ckpt) == (len(ckpt.chain_keys), True):
            return ckpt
        log.info("checkpoint %s/%s has a missing or quarantined page; trying a shorter one",
                 namespace, ckpt.name)
    return None


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
    """Verified page buffers from store.get_pages: zero-copy views of the LMDB map where
    the store maps its pages (store.maps_pages), else buffers it fetched into (a
    RemoteStore over HTTP; admission prices those as staging)."""
    if not digests:
        yield []
        return
    with store.get_pages(digests) as views:
        yield views


def _check_capacity(pools, n_blocks: int) -> None:
    for index, pool in enumerate(pools):
        if pool is not None and pool.num_available_blocks < n_blocks:
            raise PoolExhausted(
                f"restoring {n_blocks} blocks into layer {index}'s pool would exceed it "
                f"({pool.num_available_blocks} blocks available); nothing was allocated",
                requested=n_blocks, available=pool.num_available_blocks)


def restore(model, tokens: Sequence[int], store, *, model_id: str,
            policy: KVPolicy | None = None, namespace: str = DEFAULT_NAMESPACE,
            pools: list | None = None, cache_kind: str = "paged", max_tokens: int | None = None,
            attention_impl: str | None = "auto", quantized_group_size: int | None = None,
            quantized_bits: int | None = None, tokenizer_fingerprint: str = "",
            checkpoint: str | None = None, admission=None, max_new_tokens: int = 0,
            request_id: str = "", deadline: float | None = None,
            resident=None, converted_at_token: int = 0) -> Restored:
    """See the module docstring. checkpoint=NAME restores that checkpoint exactly and
    raises IncompatibleFormat (with the diff) when it was saved under another format.

    admission: an engine.admission.AdmissionController serving `pools` (required with
    it); the request (len(tokens) prompt tokens, max_new_tokens, deadline) is priced,
    restore staging included, after the identity check and before any allocation.

    resident: an engine.resident.ResidentIndex over `pools` (its pools when none are
    given). Leading blocks it holds are shared from this process's pools instead of
    read from the store; every restored full block is listed in it afterwards.

    converted_at_token: the request's conversion history for mlx-qB pages (0: quantized
    from the first token; N: a native cache converted at N, engine/stock.py). Only
    pages of the same history are served, and never fewer than N tokens of them."""
    if cache_kind not in CACHE_KINDS:
        raise InvalidRequest(f"cache_kind must be one of {CACHE_KINDS}, got {cache_kind!r}")
    if resident is not None:
        if cache_kind != "paged" or admission is not None:
            raise InvalidRequest("resident reuse serves paged caches without admission")
        pools = resident.pools if pools is None else pools
        if list(pools) != resident.pools:
            raise InvalidRequest("the resident index serves other pools than these")
    policy = policy or KVPolicy()
    identity = model_identity(model, policy, model_id=model_id,
                              tokenizer_fingerprint=tokenizer_fingerprint,
                              converted_at_token=converted_at_token)
    quantized_group_size, quantized_bits = check_target(identity, cache_kind,
                                                        quantized_group_size, quantized_bits)
    if cache_kind == "paged" and pools is not None:
        check_pools(identity, pools)
    limit = len(tokens) - 1 if max_tokens is None else min(max_tokens, len(tokens))
    all_full = all(layer.paged for layer in identity.layers)

    ckpt, blocks = None, []
    if checkpoint is not None:
        ckpt = store.get_checkpoint(namespace, checkpoint)
        if ckpt.format_id != identity.format_id:
            try:
                theirs = store.get_format(ckpt.format_id)
            except NotFound:
                theirs = None
            raise IncompatibleFormat(
                f"checkpoint {namespace}/{checkpoint} was saved under another format",
                diff(identity, theirs) if theirs is not None else
                [("format_id", identity.format_id_hex, ckpt.format_id.hex())])
        if tuple(tokens[: len(ckpt.tokens)]) != tuple(ckpt.tokens):
            raise InvalidRequest(f"checkpoint {namespace}/{checkpoint} is not a prefix of the prompt")
        ckpt, blocks = _usable_part(store, ckpt)
    elif limit > 0 and all_full:
        blocks = list(store.lookup_prefix(identity.format_id, namespace, tokens,
                                          max_tokens=limit).blocks)
    elif limit > 0:
        ckpt = find_checkpoint(store, identity, namespace, tokens, limit)
        if ckpt is not None:
            blocks = store.get_blocks(ckpt.chain_keys)
    if blocks and sum(len(b.tokens) for b in blocks) < identity.converted_at_token:
        ckpt, blocks = None, []  # below the conversion: no computation of this history had it

    grant, decision = None, None
    if admission is not None:
        if cache_kind != "paged" or pools is None:
            raise InvalidRequest("admission prices paged caches: pass the pools it serves")
        profile = admission.profile(model, pools, model_fingerprint=identity.model_fingerprint,
                                    attention_impl=attention_impl)
        decision = admission.admit(profile, AdmissionRequest(
            request_id, len(tokens), max_new_tokens, deadline, restore_blocks=len(blocks),
            restored_tokens=sum(len(b.tokens) for b in blocks),
            restore_remote=not store.maps_pages))
        if not decision.granted:
            return Restored(None, 0, decision=decision)
        grant = decision.grant
    if pools is None and cache_kind == "paged":
        pools = make_pools(model, policy, model_id=model_id)
    try:
        if not blocks and ckpt is None:
            result = Restored(_fresh(model, policy, model_id, pools, cache_kind, attention_impl,
                                     quantized_group_size, quantized_bits, grant), 0)
        else:
            if cache_kind == "paged":
                _check_capacity(pools, len(blocks))
            result = _build(model, policy, model_id, identity, pools, blocks, ckpt, store,
                            cache_kind, attention_impl, quantized_group_size, quantized_bits,
                            grant, resident)
            if resident is not None:
                restored_tokens = [t for b in blocks for t in b.tokens]
                resident.register(identity, namespace, restored_tokens, result.cache)
    except BaseException:
        if grant is not None:
            grant.close()
        raise
    if grant is not None:
        grant.bind(result.cache)
        grant.staging_done()  # _build evaluated every page into the pools
        result.decision, result.grant = decision, grant
    _assert_one_offset(result)
    return result


def _assert_one_offset(result: Restored) -> None:
    """A restored cache continues one sequence: every layer that counts tokens sits at
    exactly tokens_restored. Anything else is a broken invariant (a checkpoint whose
    layers were captured at different offsets would continue differently from
    recompute), so it fails loudly instead of being served."""
    offsets = [token_offset(c) for c in result.cache]
    assert all(o is None or o == result.tokens_restored for o in offsets), (
        f"restore of {result.tokens_restored} tokens ({result.source} "
        f"{result.checkpoint or ''}) left the layers at offsets {offsets}")


def _history(spec: PageSpec, pages: list) -> tuple[dict[str, mx.array], int]:
    """Pages (in block order) -> (name -> [1, H, tokens, width], tokens), bytes as they are."""
    planes, n_tokens = blocks_from_pages(spec, pages)  # name -> [n, H, bs, W]
    out = {}
    for name, p in planes.items():
        n, heads, size, width = p.shape
        out[name] = p.transpose(1, 0, 2, 3).reshape(1, heads, n * size, width)[:, :, :n_tokens]
    return out, n_tokens


def kvcache_from_pages(spec: PageSpec, pages: list) -> KVCache:
    """An mlx-lm KVCache holding native pages (in block order): K/V [1, H, tokens, D]."""
    if not spec.format.native:
        raise FormatMismatch(f"a KVCache holds native K/V, not {spec.format.name} pages")
    planes, n_tokens = _history(spec, pages)
    cache = TrackedKVCache()  # a later conversion (generate_step kv_bits) is recorded
    cache.state = (planes["k"], planes["v"], n_tokens)
    return cache


def quantized_kvcache_from_pages(spec: PageSpec, pages: list,
                                 converted_at_token: int = 0) -> QuantizedKVCache:
    """An mlx-lm QuantizedKVCache holding mlx-qB pages (in block order), byte for byte:
    keys = (codes [1, H, tokens, Dk*B/32] u32, scales [1, H, tokens, Dk/G], biases
    [1, H, tokens, Dk/G]), values likewise; bits and group size from the spec. Pages of
    a converted cache come back as a ConvertedQuantizedKVCache with its offset."""
    if not spec.format.mlx_affine:
        raise FormatMismatch(f"a QuantizedKVCache holds mlx-qB pages, not {spec.format.name}")
    planes, n_tokens = _history(spec, pages)
    cache = (ConvertedQuantizedKVCache(spec.group_size, spec.format.k_bits, converted_at_token)
             if converted_at_token else
             QuantizedKVCache(group_size=spec.group_size, bits=spec.format.k_bits))
    cache.keys = tuple(planes[n] for n in ("k_codes", "k_scales", "k_biases"))
    cache.values = tuple(planes[n] for n in ("v_codes", "v_scales", "v_biases"))
    cache.offset = n_tokens
    return cache


def _fresh(model, policy, model_id, pools, cache_kind, attention_impl, group_size, bits,
           grant=None) -> list:
    if cache_kind == "paged":
        return make_cache(model, policy, model_id=model_id, pools=pools,
                          attention_impl=attention_impl, grant=grant)
    caches = make_stock_cache(model)
    if cache_kind == "quantized":  # empty: quantized from the first token
        caches = [QuantizedKVCache(group_size, bits) if isinstance(c, TrackedKVCache) else c
                  for c in caches]
    return caches


def _build(model, policy, model_id, identity, pools, blocks: list[BlockRecord], ckpt, store,
           cache_kind, attention_impl, group_size, bits, grant=None, resident=None) -> Restored:
    specs = page_specs(identity)
    paged = identity.paged_layers
    shared = 0
    if resident is not None:
        full = [b.key for b in blocks if len(b.tokens) == identity.block_size_tokens]
        shared = resident.longest(full)
    fetched = blocks[shared:]
    digests = [d for b in fetched for d in b.pages]
    attachment_names = sorted(ckpt.attachments) if ckpt is not None else []
    attachment_digests = [ckpt.attachments[n] for n in attachment_names]
    caches = _fresh(model, policy, model_id, pools, cache_kind, attention_impl, group_size, bits,
                    grant)
    adopted = {}
    if shared:
        impl = default_attention_impl(pools[paged[0]]) if attention_impl == "auto" else attention_impl
        adopted = resident.adopt([b.key for b in blocks[:shared]], identity.block_size_tokens,
                                 attention_impl=impl)
    nbytes = 0
    with _pages(store, digests + attachment_digests) as views:
        nbytes = sum(len(v) for v in views)
        per_layer = {layer: [views[i * len(paged) + j] for i in range(len(fetched))]
                     for j, layer in enumerate(paged)}
        for layer, pages in per_layer.items():
            spec = specs[layer]
            if cache_kind == "paged":
                impl = default_attention_impl(pools[layer]) if attention_impl == "auto" else attention_impl
                if layer in adopted:
                    caches[layer] = adopted[layer]
                    adopted[layer].append_pages(pages)
                elif grant is None:
                    caches[layer] = PagedKVCache.from_pages(pools[layer], pages, attention_impl=impl)
                else:
                    caches[layer] = grant.cache_from_pages(pools[layer], pages, attention_impl=impl)
            elif spec.format.mlx_affine:  # cache_kind "quantized" (check_target)
                caches[layer] = quantized_kvcache_from_pages(spec, pages,
                                                             identity.converted_at_token)
            else:
                stock = kvcache_from_pages(spec, pages)
                caches[layer] = stock.to_quantized(group_size, bits) if cache_kind == "quantized" else stock
        for name, view in zip(attachment_names, views[len(digests):]):
            index = int(name.split(".", 1)[1])
            caches[index] = decode_attachment(view)
            held = token_offset(caches[index])
            if held is not None and held != len(ckpt.tokens):
                # Written before capture refused checkpoints taken after generation.
                raise OffsetMismatch(
                    f"checkpoint {ckpt.namespace}/{ckpt.name} holds {len(ckpt.tokens)} tokens "
                    f"but its layer {index} state sits at offset {held}: it was captured after "
                    "generation and cannot continue its tokens; delete it and publish again",
                    offsets=[held], tokens=len(ckpt.tokens))
        mx.eval([c.state for c in caches])
    restored = sum(len(b.tokens) for b in blocks)
    return Restored(caches, restored, len(blocks), nbytes,
                    "checkpoint" if ckpt is not None else "prefix",
                    ckpt.name if ckpt is not None else None, resident_blocks=shared)


__all__ = ["Restored", "restore", "check_pools", "check_target", "find_checkpoint",
           "kvcache_from_pages", "quantized_kvcache_from_pages"]
