"""StoreTier: the L2 prompt cache of a server; the one adapter onto engine restore/publish.

Every call from engine.serving into engine.restore, engine.publish, engine.models and
engine.writebehind is in this file (issue 18 changes restore's signature: only
StoreTier.restore_prefix needs to follow it).

Lookup (off the generation thread; the generation thread never waits on the store):
  1. prefetch(tokens, l1_hint), on the HTTP handler thread when the request arrives
     (engine/serving/mlx_server.py tokenizes it there with mlx-lm's own _tokenize):
     in an I/O thread, the longest stored prefix of the prompt (leaving one token to
     compute): for a model of full-attention layers, lookup_prefix over block records;
     for a model with sliding-window layers (gemma3: RotatingKVCache), the longest
     checkpoint whose tokens prefix the prompt (engine.restore.find_checkpoint: a ring
     is valid only at exactly its own length). Only if it beats what L1 held when the
     request arrived, read its pages and attachments (verified against their hashes as
     they are read). The handler thread waits at most settings.lookup_timeout_s; a
     timeout or any store error is a miss, counted, and L2 is skipped for
     settings.retry_after_s so that a dead store costs one timeout, not one per
     request. Only then does the request join mlx-lm's queue: its own answer waits
     for its lookup, no other request's decoding does. The I/O thread does no MLX
     work, so one that is left running cannot race the generation thread;
  2. lookup(tokens, l1_tokens), on the generation thread from fetch_nearest_cache:
     takes the prefetched result (ready by construction; a prompt that was not
     prefetched is a miss at once, "unprefetched") and, when it beats L1's actual
     match, engine.restore rebuilds the pages into plain mlx-lm KVCache objects
     (cache_kind="kvcache") and a checkpoint's attachments into the sliding layers'
     RotatingKVCaches, which mlx-lm's BatchGenerator can merge. That restore (host
     copies into new arrays) is the only L2 work on the generation thread.

Publish (generation thread, never waits on the store):
  the policy (segment type, minimum length, second sighting, byte budget per namespace)
  decides; engine.publish.capture copies the pages to host memory (a copy of the
  segment's K/V: the only work done on the generation thread) and the
  WriteBehindPublisher uploads it from its own thread, dropping captures beyond its
  byte cap. Prefixes this process already published or restored are not captured again
  (their chain keys are remembered, a bounded LRU). A model with sliding-window layers
  publishes a checkpoint (engine.publish: capture with attachments, named by
  prompt_checkpoint_name) and only where every layer sits exactly at the segment's
  tokens; anything else is skipped ("skipped_inexact"), never stored partway.

Supported models: full-attention layers (KVCache) with or without sliding-window
layers (RotatingKVCache). Draft models and models none of whose layers counts its
tokens (purely recurrent) are served from L1 only (see unsupported_reason); --kv-bits
is refused by serve-model at start-up (KV_BITS_REFUSAL).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Sequence

import blake3
import numpy as np
from mlx_lm.models.cache import KVCache

from engine.attachments import token_offset
from engine.attention import GATHERED
from engine.engine_model import EngineModel
from engine.geometry import leaf_caches
from engine.policy import KVPolicy
from engine.publish import capture, capture_later, prompt_checkpoint_name
from engine.restore import RestoreRequest, check_target, find_checkpoint, restore
from engine.serving.identity import ModelFingerprint
from engine.writebehind import DEFAULT_CAPACITY_NBYTES, WriteBehindPublisher
from kvstore.ids import ROOT_KEY, chain_key, check_namespace
from kvstore.records import Checkpoint
from kvstore.store import PrefixMatch

log = logging.getLogger("kvstore.serve_model")

SEGMENT_TYPES = ("system", "user", "assistant")
DEFAULT_LOOKUP_TIMEOUT_S = 2.0
DEFAULT_RETRY_AFTER_S = 10.0
KNOWN_PREFIXES = 4096  # chain keys remembered for "already stored" and "seen once"
PENDING_PROMPTS = 256  # prefetched prompts waiting for the generation thread, at most
KV_BITS_REFUSAL = (
    "--kv-bits is not supported by serve-model: mlx-lm quantizes the cache once it holds "
    "--quantized-kv-start tokens, at whatever offset the prefill reached, so a prompt "
    "restored from the store would be quantized at another token than a recompute and "
    "answer differently from stock mlx_lm.server. Run serve-model without --kv-bits, or "
    "stock mlx_lm.server with it")


@dataclass(frozen=True)
class ServingSettings:
    """The store tier's settings (docs/server.md lists each with its default)."""

    namespace: str | None = None  # None: named after the model (ModelFingerprint)
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    retry_after_s: float = DEFAULT_RETRY_AFTER_S
    publish_segments: tuple[str, ...] = SEGMENT_TYPES
    # With an L1 match, L2 must add this many tokens (0: one block): a restore re-reads
    # the whole prefix, so a few more tokens than L1 has are cheaper computed.
    lookup_min_gain_tokens: int = 0
    publish_min_tokens: int = 0  # 0: one block (policy.block_size_tokens)
    publish_on_second_sighting: bool = False
    namespace_budget_nbytes: int | None = None  # bytes this process may publish per namespace
    publish_queue_nbytes: int = DEFAULT_CAPACITY_NBYTES
    policy: KVPolicy = field(default_factory=KVPolicy)

    def __post_init__(self):
        unknown = set(self.publish_segments) - set(SEGMENT_TYPES)
        if unknown:
            raise ValueError(f"unknown segment types {sorted(unknown)}; use some of {SEGMENT_TYPES}")
        if self.namespace is not None:
            check_namespace(self.namespace)
        if not self.lookup_timeout_s > 0 or self.retry_after_s < 0:
            raise ValueError("lookup_timeout_s must be > 0 and retry_after_s >= 0")
        if self.lookup_min_gain_tokens < 0:
            raise ValueError("lookup_min_gain_tokens must be >= 0")
        if self.publish_min_tokens < 0 or self.publish_queue_nbytes <= 0:
            raise ValueError("publish_min_tokens must be >= 0 and publish_queue_nbytes > 0")
        if self.namespace_budget_nbytes is not None and self.namespace_budget_nbytes < 0:
            raise ValueError("namespace_budget_nbytes must be >= 0")

    @property
    def min_tokens(self) -> int:
        return self.publish_min_tokens or self.policy.block_size_tokens

    @property
    def min_gain_tokens(self) -> int:
        return self.lookup_min_gain_tokens or self.policy.block_size_tokens


@dataclass
class Lookup:
    """What one L2 lookup gave: a cache list (None on a miss) and how it went."""

    cache: list | None
    tokens: int = 0
    bytes_read: int = 0
    seconds: float = 0.0  # on the generation thread (the restore)
    outcome: str = "miss"  # hit | miss | shorter | stale | unprefetched | timeout | error | skipped | off
    prefetch_seconds: float = 0.0  # on the HTTP handler thread, before the request queued


@dataclass(frozen=True)
class _Pending:
    """A prefetch's result, waiting for its request on the generation thread: what the
    store had (None when it was not asked or failed: outcome says why), and how long
    the handler thread waited for it."""

    found: Found | None
    outcome: str | None
    seconds: float


def _prompt_key(tokens: Sequence[int]) -> bytes:
    """The prefetch table's key: blake3 of the prompt's token ids."""
    return blake3.blake3(b"".join(int(t).to_bytes(4, "little", signed=True)
                                  for t in tokens)).digest()


@dataclass(frozen=True)
class Found:
    """What the I/O thread found for one prompt: a prefix match (full-attention model)
    or a checkpoint and its block records (sliding-window model), and the verified
    bytes of their pages and attachments when they beat L1 (else pages is None)."""

    tokens: int
    match: PrefixMatch | None = None
    checkpoint: Checkpoint | None = None
    blocks: tuple = ()
    pages: dict | None = None

    @property
    def tail_keys(self) -> list:
        if self.checkpoint is not None:
            return list(self.checkpoint.chain_keys[-1:])
        return [b.key for b in self.blocks[-1:]]


class _Prefetched:
    """A PageReader (kvstore.protocol) over what the I/O thread already fetched: one
    prefix match or checkpoint and its verified page bytes. It answers the reads of
    that one restore and nothing else (anything else would be a bug here:
    AssertionError)."""

    maps_pages = False  # the pages are buffers in this process, not a mapped file

    def __init__(self, found: Found):
        self._found, self._pages = found, found.pages
        keys = (found.checkpoint.chain_keys if found.checkpoint is not None
                else [b.key for b in found.blocks])
        self._blocks = {bytes(k): b for k, b in zip(keys, found.blocks, strict=True)}

    def lookup_prefix(self, format_id, namespace, tokens, *, max_tokens=None) -> PrefixMatch:
        assert self._found.match is not None, "a checkpoint restore looked a prefix up"
        return self._found.match

    def get_checkpoint(self, namespace, name) -> Checkpoint:
        assert self._found.checkpoint is not None and name == self._found.checkpoint.name
        return self._found.checkpoint

    def has_blocks(self, keys: Sequence) -> list[bool]:
        return [bytes(k) in self._blocks for k in keys]

    def get_blocks(self, keys: Sequence) -> list:
        return [self._blocks[bytes(k)] for k in keys]

    def missing(self, digests) -> list:
        return [d for d in digests if d not in self._pages]

    def read_pages(self, digests: Sequence) -> list:
        return [self._pages[d] for d in digests]

    @contextmanager
    def get_pages(self, digests: Sequence):
        yield self.read_pages(digests)

    def __getattr__(self, name):
        raise AssertionError(f"a prefetched restore read store.{name}")


def unsupported_reason(model, cli_args) -> str | None:
    """Why L2 cannot serve this model under these flags, or None when it can."""
    if getattr(cli_args, "draft_model", None):
        return "a draft model (speculative decoding) appends the draft's caches"
    if getattr(cli_args, "kv_bits", None) is not None:
        return KV_BITS_REFUSAL
    caches = leaf_caches(model.make_cache() if hasattr(model, "make_cache") else [KVCache()])
    if all(token_offset(c) is None for c in caches):
        return ("no layer counts its tokens (recurrent state only), so a segment boundary "
                "cannot be checked before publishing")
    return None


def _fetch(store, identity, namespace: str, tokens: list[int], limit: int,
           better_than: int) -> Found:
    """I/O thread: the longest stored prefix, and its page bytes when it beats
    `better_than`. Store calls only: an abandoned (timed-out) call holds no model, cache
    or MLX array, so it cannot race the generation thread."""
    if all(layer.paged for layer in identity.layers):
        match = store.lookup_prefix(identity.format_id, namespace, tokens, max_tokens=limit)
        found = Found(match.tokens_matched, match=match, blocks=tuple(match.blocks))
        digests = [d for b in match.blocks for d in b.pages]
    else:  # sliding layers: restored from checkpoints only, at exactly their length
        ckpt = find_checkpoint(store, identity, namespace, tokens, limit)
        if ckpt is None:
            return Found(0)
        if len(ckpt.tokens) <= better_than:
            return Found(len(ckpt.tokens), checkpoint=ckpt)
        blocks = tuple(store.get_blocks(ckpt.chain_keys))
        found = Found(len(ckpt.tokens), checkpoint=ckpt, blocks=blocks)
        digests = [d for b in blocks for d in b.pages] + list(ckpt.attachments.values())
    if found.tokens <= better_than:
        return found
    return replace(found, pages=dict(zip(digests, _read_verified(store, digests), strict=True)))


def _read_verified(store, digests: list) -> list[memoryview]:
    """The verified bytes of each page, as read-only views of one buffer filled by
    store.read_pages_into: verified and copied in one pass on the store's reader threads
    (read_pages would verify and copy on this one thread: 1.2-1.3 GB/s on the H200's
    host, 905 ms of an 8K prompt's TTFT, docs/server.md)."""
    if not digests:
        return []
    sizes = store.page_nbytes(digests)
    buffer = memoryview(np.empty(sum(sizes), dtype=np.uint8))  # not zeroed: every byte is read into
    views, at = [], 0
    for nbytes in sizes:
        views.append(buffer[at:at + nbytes])
        at += nbytes
    store.read_pages_into(digests, views)
    return [v.toreadonly() for v in views]


@dataclass
class TierThreads:
    """The threads a StoreTier runs, apart from the tier itself: whoever stops the
    server closes these without holding the tier, whose model and MLX arrays must be
    freed on mlx-lm's generation thread (mlx-lm deletes its prompt cache there, and
    freeing MLX arrays at interpreter exit instead can abort the process)."""

    publisher: WriteBehindPublisher
    io: ThreadPoolExecutor

    def close(self, drain_timeout_s: float) -> bool:
        """Upload what is queued (up to drain_timeout_s), then stop. True if all went."""
        drained = self.publisher.drain(drain_timeout_s)
        self.publisher.close(drain=False, timeout=1.0)
        self.io.shutdown(wait=False, cancel_futures=True)
        return drained


class _LRUSet:
    def __init__(self, capacity: int):
        self._items: OrderedDict = OrderedDict()
        self._capacity = capacity

    def add(self, key) -> None:
        self._items[key] = None
        self._items.move_to_end(key)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def __contains__(self, key) -> bool:
        return key in self._items


class StoreTier:
    """L2 for one served model (see the module docstring).

    lookup_store answers lookups (a RemoteStore with a short timeout, or the Store);
    publish_store receives uploads (may be the same object)."""

    def __init__(self, model, fingerprint: ModelFingerprint, lookup_store, publish_store,
                 settings: ServingSettings, metrics):
        self.settings = settings
        self.metrics = metrics
        self.namespace = settings.namespace or fingerprint.default_namespace
        # attention_impl GATHERED: the tier restores into mlx-lm's own caches, never into
        # paged ones, so the paged-attention load check (a run of the model, about a
        # second at start-up, before the first request can be served) is not needed
        self.engine_model = EngineModel(model, fingerprint.model_id, policy=settings.policy,
                                        tokenizer_fingerprint=fingerprint.tokenizer_fingerprint,
                                        attention_impl=GATHERED)
        self.identity = self.engine_model.identity
        check_target(self.identity, "kvcache")  # native pages only: IncompatibleFormat
        # a model with sliding (non-paged) layers publishes and restores checkpoints
        self._checkpointed = not all(layer.paged for layer in self.identity.layers)
        self.model_id = fingerprint.model_id
        self.block_size = self.identity.block_size_tokens
        self._lookup_store = lookup_store
        self._skip_until = 0.0
        self._known = _LRUSet(KNOWN_PREFIXES)   # tail chain keys the store has
        self._seen = _LRUSet(KNOWN_PREFIXES)    # tail chain keys seen once (second sighting)
        self._published_nbytes = 0
        self._lost = 0  # publisher drops + failures when _known was last trusted
        self._pending: OrderedDict[bytes, deque] = OrderedDict()  # prompt key -> _Pending
        self._lock = threading.Lock()
        self.publisher = WriteBehindPublisher(publish_store, namespace=self.namespace,
                                              capacity_nbytes=settings.publish_queue_nbytes)
        self.threads = TierThreads(self.publisher,
                                   ThreadPoolExecutor(2, thread_name_prefix="kvstore-lookup"))
        # the salt the store keys this namespace's blocks with: asked off this thread
        self._salt_future = self.threads.io.submit(lookup_store.chain_salt, self.namespace)

    # -- lookup --------------------------------------------------------------------
    def _better_than(self, l1_tokens: int) -> int:
        """Tokens a store prefix must exceed to be used over L1's l1_tokens."""
        return l1_tokens + (self.settings.min_gain_tokens - 1 if l1_tokens else 0)

    def prefetch(self, tokens: Sequence[int], l1_hint: int) -> float:
        """HTTP handler thread, before the request reaches the generation thread: find
        and read the longest stored prefix of `tokens` that beats L1's l1_hint (what L1
        held when the request arrived), waiting at most settings.lookup_timeout_s; the
        result waits for lookup(). Returns the seconds waited. Never raises for store
        trouble: a timeout or an error is what lookup() will report, and L2 is skipped
        for settings.retry_after_s after one."""
        tokens = [int(t) for t in tokens]
        start = time.monotonic()
        found, outcome = None, None
        limit, better_than = len(tokens) - 1, self._better_than(l1_hint)
        if limit <= better_than:
            outcome = "shorter"
        elif min(tokens) < 0:  # mlx-lm marks image patches with negative ids: not text KV
            outcome = "off"
        elif start < self._skip_until:
            outcome = "skipped"
        else:
            self._ask_salt_again()
            future = self.threads.io.submit(_fetch, self._lookup_store, self.identity,
                                            self.namespace, tokens, limit, better_than)
            try:
                found = future.result(timeout=self.settings.lookup_timeout_s)
            except FutureTimeout:
                self._skip_until = time.monotonic() + self.settings.retry_after_s
                log.warning("store lookup took over %.2fs: served as a miss; skipping the "
                            "store for %.0fs", self.settings.lookup_timeout_s,
                            self.settings.retry_after_s)
                outcome = "timeout"
            except Exception as exc:  # noqa: BLE001 - a store problem is a miss, never a client error
                self._skip_until = time.monotonic() + self.settings.retry_after_s
                log.warning("store lookup failed (%s: %s): served as a miss; skipping the "
                            "store for %.0fs", type(exc).__name__, exc,
                            self.settings.retry_after_s)
                outcome = "error"
        waited = time.monotonic() - start
        key = _prompt_key(tokens)
        with self._lock:
            self._pending.setdefault(key, deque()).append(_Pending(found, outcome, waited))
            self._pending.move_to_end(key)
            while len(self._pending) > PENDING_PROMPTS:  # never served (another model?)
                self._pending.popitem(last=False)
        return waited

    def _take(self, tokens: Sequence[int]) -> _Pending | None:
        key = _prompt_key(tokens)
        with self._lock:
            queue = self._pending.get(key)
            if not queue:
                return None
            entry = queue.popleft()
            if not queue:
                del self._pending[key]
            return entry

    def lookup(self, tokens: list[int], l1_tokens: int) -> Lookup:
        """Generation thread: the prefetched prefix of `tokens` (prefetch()) if it beats
        L1's l1_tokens (by settings.min_gain_tokens when L1 matched anything), restored
        as the model's caches, or a miss. Never waits on the store: a prompt that was
        not prefetched is a miss ("unprefetched"). Lookup.seconds is the time spent here
        (the restore's copies), Lookup.prefetch_seconds the handler thread's wait."""
        start = time.monotonic()
        entry = self._take(tokens)
        better_than, limit = self._better_than(l1_tokens), len(tokens) - 1
        if entry is None:
            outcome = "shorter" if limit <= better_than else "unprefetched"
            return Lookup(None, outcome=outcome)
        found, waited = entry.found, entry.seconds
        if found is None:  # not asked (L1 held enough, images, skipped) or failed
            stale = entry.outcome == "shorter" and limit > better_than
            return Lookup(None, outcome="stale" if stale else entry.outcome,
                          prefetch_seconds=waited)
        if found.tokens <= better_than or limit <= better_than:
            return Lookup(None, outcome="shorter" if found.tokens else "miss",
                          prefetch_seconds=waited)
        if found.pages is None:  # L1 held it on arrival, and dropped it since
            return Lookup(None, outcome="stale", prefetch_seconds=waited)
        restored = self.restore_prefix(tokens, found, limit)
        self._remember(found.tail_keys)
        return Lookup(restored.cache, restored.tokens_restored, restored.bytes_read,
                      time.monotonic() - start, "hit", prefetch_seconds=waited)

    def restore_prefix(self, tokens: list[int], found: Found, limit: int):
        """engine.restore over the prefetched pages: mlx-lm KVCaches for full-attention
        layers, a checkpoint's RotatingKVCaches for sliding ones."""
        name = found.checkpoint.name if found.checkpoint is not None else None
        return restore(self.engine_model, _Prefetched(found),
                       RestoreRequest(tokens, max_restore_tokens=limit, cache_kind="kvcache",
                                      checkpoint=name, namespace=self.namespace))

    # -- publish -------------------------------------------------------------------
    def chain_salt(self) -> bytes | None:
        """The namespace's chain salt as the store keys blocks with it (None: unsalted,
        or not known yet). Asked once, on the I/O thread; a failed ask is asked again at
        the next prefetch. Never waits."""
        with self._lock:
            future = self._salt_future
            if not future.done():
                return None
            if future.exception() is None:
                return future.result()
            return None

    def _ask_salt_again(self) -> None:
        with self._lock:
            future = self._salt_future
            if future.done() and future.exception() is not None:
                self._salt_future = self.threads.io.submit(self._lookup_store.chain_salt,
                                                           self.namespace)

    def tail_key(self, tokens: Sequence[int]) -> bytes:
        """The chain key of the last block (full or partial) of `tokens`, keyed with the
        namespace's chain salt as the store keys it (engine.publish.upload, restore)."""
        fid, parent, salt = self.identity.format_id, ROOT_KEY, self.chain_salt()
        for start in range(0, len(tokens), self.block_size):
            parent = chain_key(fid, self.namespace, parent, tokens[start:start + self.block_size],
                               salt=salt)
        return parent

    def _remember(self, keys) -> None:
        with self._lock:
            for key in keys:
                self._known.add(bytes(key))

    def offer(self, tokens: Sequence[int], caches: list, segment_type: str) -> str:
        """Publish what a segment boundary inserted into L1, if the policy says so.
        Returns the decision (for metrics): queued, or why not."""
        s = self.settings
        if segment_type not in s.publish_segments:
            return "skipped_type"
        leaves = leaf_caches(caches) if caches else []
        if len(leaves) != len(self.identity.layers):
            return "skipped_cache"
        if min(tokens, default=0) < 0:
            return "skipped_images"
        if self._checkpointed:
            # sliding rings are valid at exactly their own length: a checkpoint is taken
            # only where every counting layer sits at the segment's tokens
            n = len(tokens)
            if {token_offset(c) for c in leaves} - {None} != {n}:
                return "skipped_inexact"
        elif not all(isinstance(c, KVCache) for c in leaves):
            return "skipped_cache"
        else:
            n = min(len(tokens), min(c.offset for c in leaves))
        if n < s.min_tokens:
            return "skipped_short"
        tokens = [int(t) for t in tokens[:n]]
        key = bytes(self.tail_key(tokens))
        stats = self.publisher.stats()
        lost = stats["dropped"] + stats["failed"]
        with self._lock:
            if lost != self._lost:  # something queued never reached the store: re-offer all
                self._known, self._lost = _LRUSet(KNOWN_PREFIXES), lost
            if key in self._known:
                return "skipped_known"
            if s.publish_on_second_sighting and key not in self._seen:
                self._seen.add(key)
                return "skipped_first_sighting"
            nbytes = self.identity.block_nbytes(self.block_size) * -(-n // self.block_size)
            if (s.namespace_budget_nbytes is not None
                    and self._published_nbytes + nbytes > s.namespace_budget_nbytes):
                return "skipped_budget"
            self._published_nbytes += nbytes
            self._known.add(key)
        if self._checkpointed:  # as engine.publish.publish does at a prompt boundary
            cap = capture(self.identity, tokens, caches, attachments=True)
            queued = self.publisher.submit(cap, namespace=self.namespace,
                                           checkpoint=prompt_checkpoint_name(cap.tokens))
        else:
            # on a GPU only device copies here: the host copies run on the publisher's
            # thread, and the live cache stays in device memory (capture_later)
            queued = self.publisher.submit(capture_later(self.identity, tokens, caches),
                                           namespace=self.namespace)
        return "queued" if queued else "dropped"

    def close(self, drain_timeout_s: float) -> bool:
        return self.threads.close(drain_timeout_s)
