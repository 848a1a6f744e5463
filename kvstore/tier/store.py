"""TieredStore: a local Store as the read-through, write-behind cache of an S3 bucket.

It has the Store's method set, so the engine, the service (api/) and the CLI take it
unchanged. Composition only: it holds a kvstore.store.Store and calls its public
methods; it never reaches into the LMDB environment.

Writes commit locally first, exactly as on a plain Store, and are then queued for
upload (kvstore/tier/queue.py, uploader.py). The queue entry is written before the
local commit, so a crash between the two leaves a job whose object is either there
(uploaded) or not (dropped), never a committed object nobody will upload. With
sync=True a write returns only once the bucket has it too (else RemoteUnavailable,
and the data stays committed locally and queued).

Reads go to the local store. On a local miss:
  lookup_prefix   continues the longest stored prefix in the bucket: the chain keys of
                  the remaining full blocks (and of the exact tail) are computed from
                  the tokens and fetched in parallel; the found run from the first one
                  is checked (kvstore/tier/layout.py), its pages fetched in parallel,
                  verified, inserted into the local store, and the records committed
                  locally. The answer is the local store's, so identity and namespace
                  rules are exactly the local ones.
  get_checkpoint, get_blocks, get_pages, read_pages, read_pages_into, page_nbytes,
  get_format      pull what is missing the same way, then answer locally.
  list_checkpoints, list_formats
                  add what the bucket has (manifests and identities only).
A page or record that fails its check raises RemoteIntegrityError and is neither
served nor cached. A lookup that cannot reach the bucket answers with the local match
(a miss costs a recompute, never an error) and lookups skip the bucket for
BUCKET_DOWN_S; an explicit read of an object that is not local (get_checkpoint,
get_blocks, get_pages, ...) raises RemoteUnavailable instead. A block whose page is missing from the bucket (a remote GC racing
a writer, a partial upload by another tool) ends the remote prefix there: a miss.

Local only, by design: missing(), has_blocks() and find_blocks() (a publisher writes through the
local store; the uploader dedups against the bucket), evict, check, plan_gc (the
local GC). The bucket's GC is kvstore.tier.gc.plan_remote_gc (`kvstore gc --remote`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import as_completed
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator, Mapping, Sequence

from kvstore.deferred import DeferredPages
from kvstore.errors import NotFound
from kvstore.format import FormatIdentity
from kvstore.ids import ROOT_KEY, ChainKey, PageDigest, chain_key, chain_keys, check_namespace
from kvstore.records import BlockRecord, Checkpoint
from kvstore.store import PrefixMatch, Store, StoreStats, format_id_bytes
from kvstore.tier import layout as L
from kvstore.tier.bucket import Bucket, TierConfig
from kvstore.tier.errors import RemoteUnavailable
from kvstore.tier.queue import UploadQueue
from kvstore.tier.uploader import Uploader

log = logging.getLogger(__name__)
INSERT_BATCH_NBYTES = 64 << 20  # pages fetched are inserted locally in batches this big
SYNC_TIMEOUT_S = 120.0
BUCKET_DOWN_S = 10.0  # after a failed lookup, lookups answer locally for this long
HOLD_S = 60.0  # a queued intent waits this long for its local commit (crash recovery)


@dataclass(frozen=True)
class TieredStats(StoreStats):
    """StoreStats of the local store plus the tier's: the upload backlog and traffic."""

    remote_bucket: str = ""
    backlog_jobs: int = 0
    backlog_nbytes: int = 0
    backlog_pages: int = 0
    backlog_blocks: int = 0
    backlog_checkpoints: int = 0
    backlog_oldest_age_s: float = 0.0
    backlog_failing: int = 0
    backlog_max_nbytes: int = 0
    remote_uploaded: int = 0
    remote_uploaded_nbytes: int = 0
    remote_skipped_existing: int = 0
    remote_dropped: int = 0
    remote_upload_failures: int = 0
    remote_refused_nbytes: int = 0
    remote_fetched_pages: int = 0
    remote_fetched_nbytes: int = 0
    remote_fetched_blocks: int = 0
    remote_integrity_errors: int = 0
    remote_lookups_unavailable: int = 0


class TieredStore:
    """See the module docstring. TieredStore(Store(dir), TierConfig(bucket=...))."""

    def __init__(self, local: Store, config: TierConfig, *, bucket: Bucket | None = None,
                 start_uploader: bool = True):
        self.local = local
        self.config = local.config
        self.tier_config = config
        self.bucket = bucket or Bucket(config)
        self.layout = L.Layout(config.prefix)
        self.queue = UploadQueue(local.path, config.backlog_max_nbytes)
        self.uploader = Uploader(local, self.bucket, self.layout, self.queue, config.refresh_after_s)
        self._lock = threading.Lock()
        self._counters = {"refused_nbytes": 0, "fetched_pages": 0, "fetched_nbytes": 0,
                          "fetched_blocks": 0, "integrity_errors": 0, "unavailable": 0}
        self._bucket_down_until = 0.0
        self._manifests: dict[str, tuple[str, Checkpoint]] = {}  # object key -> (etag, manifest)
        if start_uploader:
            self.uploader.start()

    @property
    def path(self):
        return self.local.path

    def chain_salt(self, namespace: str) -> bytes | None:
        """The local store's salt of the namespace (StoreConfig.chain_salts)."""
        return self.local.chain_salt(namespace)

    @property
    def maps_pages(self) -> bool:
        """get_pages answers from the local store's map; pages pulled from the bucket
        are inserted locally first (kvstore/protocol.py)."""
        return True

    @property
    def lmdb(self):
        """The local environment (tests that damage it on purpose)."""
        return self.local.lmdb

    @property
    def index(self):
        """The local store's index (kvstore/index.py), for tools that read it."""
        return self.local.index

    def close(self) -> None:
        self.uploader.stop()
        self.bucket.close()
        self.queue.close()
        self.local.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait for the upload backlog to empty; True when it did."""
        return self.uploader.drain(timeout_s)

    # -- writes: local first, then queued --------------------------------------------------
    def _write(self, jobs: list[tuple[str, str, int]], commit, *, force: bool = False):
        """Queue the intent (held), commit locally, release the jobs, and in sync mode
        upload them before returning. The order makes a crash between the two steps
        harmless: a held job comes due later and uploads what the store has."""
        taken = self.queue.add(jobs, force=force, hold_s=HOLD_S)
        if not taken:
            nbytes = sum(n for _, _, n in jobs)
            self._count("refused_nbytes", nbytes)
            log.warning("upload backlog is over its cap of %d bytes: %d bytes stay local only",
                        self.queue.max_nbytes, nbytes)
        keys = [j[:2] for j in jobs]
        try:
            result = commit()
        finally:
            if taken:
                self.queue.release(keys)
        if taken:
            self._sync(keys)
        return result

    def _sync(self, jobs: list[tuple[str, str]]) -> None:
        if not self.tier_config.sync or not jobs:
            return
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while True:
            pending = self.queue.jobs_for(jobs)
            if not pending:
                return
            pending = self.uploader.run_now(pending)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise RemoteUnavailable(f"{len(pending)} object(s) not in the bucket after "
                                        f"{SYNC_TIMEOUT_S:.0f}s; they stay committed locally and queued")
            time.sleep(0.2)

    def put_format(self, identity: FormatIdentity) -> bytes:
        job = ("format", identity.format_id_hex, len(identity.canonical()))
        return self._write([job], lambda: self.local.put_format(identity), force=True)

    def put_pages(self, pages: Mapping | Iterable[tuple]):
        items = list(pages.items()) if isinstance(pages, Mapping) else list(pages)
        jobs = [("page", PageDigest.coerce(d).hex(), len(data)) for d, data in items]
        return self._write(jobs, lambda: self.local.put_pages(items))

    def commit_blocks(self, blocks: Sequence[BlockRecord]):
        blocks = list(blocks)
        jobs = [("block", b.key.hex(), 0) for b in blocks if isinstance(b, BlockRecord)]
        return self._write(jobs, lambda: self.local.commit_blocks(blocks))

    def create_checkpoint(self, checkpoint: Checkpoint, *, replace: bool = False) -> Checkpoint:
        # a manifest is tiny; the cap is decided by its blocks and pages
        job = ("checkpoint", f"{checkpoint.namespace}/{checkpoint.name}", 0)
        return self._write([job], lambda: self.local.create_checkpoint(checkpoint, replace=replace),
                           force=True)

    def delete_checkpoint(self, namespace: str, name: str) -> None:
        def delete():
            try:
                self.local.delete_checkpoint(namespace, name)
            except NotFound:
                if self.bucket.head(self.layout.checkpoint_key(namespace, name)) is None:
                    raise
        self._write([("checkpoint_delete", f"{namespace}/{name}", 0)], delete, force=True)

    # -- local only --------------------------------------------------------------------------
    def missing(self, digests: Iterable) -> list[PageDigest]:
        return self.local.missing(digests)

    def has_blocks(self, keys: Sequence) -> list[bool]:
        """The local store's answer (record stored and every page present), so a block
        with a locally quarantined page is published again, as on a plain Store."""
        return self.local.has_blocks(keys)

    def find_blocks(self, keys: Sequence) -> list[BlockRecord | None]:
        return self.local.find_blocks(keys)

    def list_blocks(self, namespace: str | None = None, *, after=None, limit: int = 1000):
        """The local store's block records (the bucket is listed by `kvstore gc --remote`)."""
        return self.local.list_blocks(namespace, after=after, limit=limit)

    def evict(self, to_nbytes: int):
        return self.local.evict(to_nbytes)

    def check(self, read_data: bool = False, subset=None, progress=None):
        return self.local.check(read_data=read_data, subset=subset, progress=progress)

    def plan_gc(self, grace_s: float = 3600.0):
        return self.local.plan_gc(grace_s)

    def plan_remote_gc(self, grace_s: float = 3600.0):
        from kvstore.tier.gc import plan_remote_gc
        return plan_remote_gc(self.bucket, self.layout, grace_s, self.config.chain_salts)

    def stats(self) -> TieredStats:
        base = asdict(self.local.stats())
        backlog = self.queue.backlog()
        up = dict(self.uploader.counters)
        with self._lock:
            c = dict(self._counters)
        return TieredStats(
            **base, remote_bucket=self.bucket.name, backlog_jobs=backlog.jobs,
            backlog_nbytes=backlog.nbytes, backlog_pages=backlog.by_lane[0],
            backlog_blocks=backlog.by_lane[1], backlog_checkpoints=backlog.by_lane[2],
            backlog_oldest_age_s=backlog.oldest_age_s, backlog_failing=backlog.failing,
            backlog_max_nbytes=self.queue.max_nbytes, remote_uploaded=up["uploaded"],
            remote_uploaded_nbytes=up["uploaded_nbytes"],
            remote_skipped_existing=up["skipped_existing"], remote_dropped=up["dropped"],
            remote_upload_failures=up["failures"], remote_refused_nbytes=c["refused_nbytes"],
            remote_fetched_pages=c["fetched_pages"], remote_fetched_nbytes=c["fetched_nbytes"],
            remote_fetched_blocks=c["fetched_blocks"],
            remote_integrity_errors=c["integrity_errors"],
            remote_lookups_unavailable=c["unavailable"])

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    # -- formats -----------------------------------------------------------------------------
    def get_format(self, format_id) -> FormatIdentity:
        try:
            return self.local.get_format(format_id)
        except NotFound:
            identity = self._pull_format(format_id_bytes(format_id))
            if identity is None:
                raise
            return identity

    def list_formats(self) -> list[FormatIdentity]:
        out = {f.format_id: f for f in self.local.list_formats()}
        for info in self.bucket.list(self.layout.kind_prefix("formats")):
            fid = bytes.fromhex(info.key.rsplit("/", 1)[-1])
            if fid not in out:
                identity = self._pull_format(fid)
                if identity is not None:
                    out[fid] = identity
        return list(out.values())

    def _pull_format(self, fid: bytes) -> FormatIdentity | None:
        key = self.layout.format_key(fid)
        body = self.bucket.get(key)
        if body is None:
            return None
        identity = self._checked(L.decode_format, key, fid, body)
        self.local.put_format(identity)
        return identity

    def _checked(self, decode, key, *args):
        try:
            return decode(key, *args)
        except L.RemoteIntegrityError:
            self._count("integrity_errors")
            raise

    # -- prefix lookup -----------------------------------------------------------------------
    def lookup_prefix(self, format_id, namespace: str, tokens: Sequence[int], *,
                      max_tokens: int | None = None) -> PrefixMatch:
        local = self.local.lookup_prefix(format_id, namespace, tokens, max_tokens=max_tokens)
        if time.monotonic() < self._bucket_down_until:
            return local  # the bucket failed moments ago: a miss, not a stall
        try:
            return self._lookup_remote(local, format_id, namespace, tokens, max_tokens)
        except RemoteUnavailable as exc:
            # an inference host must not fail because the bucket is down: answer with
            # the local match (a miss costs a recompute) and skip the bucket for a while
            self._bucket_down(exc)
            return local

    def _lookup_remote(self, local: PrefixMatch, format_id, namespace: str, tokens, max_tokens):
        fid = format_id_bytes(format_id)
        check_namespace(namespace)
        tokens = list(tokens)[: max_tokens if max_tokens is not None else None]
        try:
            identity = self.get_format(fid)
        except NotFound:
            return local
        bs = identity.block_size_tokens
        full = [b for b in local.blocks if len(b.tokens) == bs]
        n_full, tail = divmod(len(tokens), bs)
        if len(full) == n_full and (not tail or len(local.blocks) > len(full)):
            return local  # nothing longer can exist anywhere
        salt = self.chain_salt(namespace)
        keys = chain_keys(fid, namespace, tokens, bs, salt=salt)
        wanted = keys[len(full):]
        tail_key = None
        if tail:
            tail_key = chain_key(fid, namespace, keys[-1] if keys else ROOT_KEY, tokens[n_full * bs:],
                                 salt=salt)
            wanted.append(tail_key)
        found = self._fetch_blocks(wanted)
        run = []
        for k in wanted[: len(wanted) - (1 if tail_key else 0)]:
            if found.get(k) is None:
                break
            run.append(found[k])
        if tail_key is not None and len(run) == len(keys) - len(full) and found.get(tail_key):
            run.append(found[tail_key])
        run = [r for r in run if r.format_id == fid and r.namespace == namespace]
        committed = self._pull_records(run)
        if not committed:
            return local
        blocks = tuple(full) + tuple(self.local.get_blocks([r.key for r in committed]))
        return PrefixMatch(sum(len(b.tokens) for b in blocks), blocks)

    def _fetch_blocks(self, keys: list[ChainKey]) -> dict[ChainKey, BlockRecord | None]:
        """GET block records in parallel; absent ones map to None. Each is checked."""
        def one(k):
            key = self.layout.block_key(k)
            body = self.bucket.get(key)
            return None if body is None else self._checked(L.decode_block, key, k, body,
                                                           self.config.chain_salts)
        futures = {k: self.bucket.pool.submit(one, k) for k in keys}
        out = {k: f.result() for k, f in futures.items()}
        self._count("fetched_blocks", sum(1 for r in out.values() if r is not None))
        return out

    def _pull_records(self, run: list[BlockRecord]) -> list[BlockRecord]:
        """Fetch the pages of a chain of records (parents first) and commit locally the
        longest leading part whose pages all exist in the bucket. Returns what was committed."""
        if not run:
            return []
        for fid in {r.format_id for r in run}:
            self.get_format(fid)
        digests = list(dict.fromkeys(d for r in run for d in r.pages))
        absent = set(self._pull_pages(digests))
        usable = []
        for r in run:
            if any(d in absent for d in r.pages):
                log.warning("block %s in the bucket names a page the bucket lacks; "
                            "the remote prefix ends there", r.key.short)
                break
            usable.append(r)
        if usable:
            self.local.commit_blocks(usable)
        return usable

    def _pull_pages(self, digests: list[PageDigest]) -> list[PageDigest]:
        """Fetch the pages the local store lacks, verify and insert them; returns the
        digests the bucket does not have either."""
        need = self.local.missing(digests)
        if not need:
            return []

        def one(d):
            key = self.layout.page_key(d)
            body = self.bucket.get(key)
            return d, (None if body is None else self._checked(L.decode_page, key, d, body))
        absent, batch, batch_nbytes = [], [], 0
        futures = [self.bucket.pool.submit(one, d) for d in need]
        try:
            for f in as_completed(futures):
                d, data = f.result()
                if data is None:
                    absent.append(d)
                    continue
                batch.append((d, data))
                batch_nbytes += len(data)
                self._count("fetched_pages")
                self._count("fetched_nbytes", len(data))
                if batch_nbytes >= INSERT_BATCH_NBYTES:
                    self.local.put_pages(batch)
                    batch, batch_nbytes = [], 0
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        if batch:
            self.local.put_pages(batch)
        return absent

    # -- blocks, checkpoints, pages: local, else pulled -------------------------------------
    def get_blocks(self, keys: Sequence) -> list[BlockRecord]:
        try:
            return self.local.get_blocks(keys)
        except NotFound:
            keys = [ChainKey.coerce(k) for k in keys]
            present = self.local.has_blocks(keys)
            self._pull_chain([k for k, p in zip(keys, present, strict=True) if not p])
            return self.local.get_blocks(keys)

    def _pull_chain(self, keys: list[ChainKey]) -> None:
        """Pull records and every ancestor the local store lacks, parents first."""
        records: dict[ChainKey, BlockRecord] = {}
        todo = list(dict.fromkeys(keys))
        while todo:
            found = self._fetch_blocks(todo)
            todo = []
            for k, r in found.items():
                if r is None:
                    raise NotFound(f"block {k.hex()} is neither stored locally nor in the bucket")
                records[k] = r
                if not r.is_root and r.parent not in records and not self.local.has_blocks([r.parent])[0]:
                    todo.append(ChainKey(r.parent))
        ordered, placed = [], set()
        while len(ordered) < len(records):  # parents before children
            for k, r in records.items():
                if k not in placed and (r.is_root or r.parent not in records or r.parent in placed):
                    ordered.append(r)
                    placed.add(k)
        if len(self._pull_records(ordered)) < len(ordered):
            raise NotFound("some blocks in the bucket name pages the bucket no longer has")

    def get_checkpoint(self, namespace: str, name: str) -> Checkpoint:
        try:
            return self.local.get_checkpoint(namespace, name)
        except NotFound:
            ckpt = self._remote_manifest(self.layout.checkpoint_key(namespace, name), namespace, name)
            if ckpt is None:
                raise
        self.get_blocks(ckpt.chain_keys)
        if self._pull_pages(list(ckpt.attachments.values())):
            raise NotFound(f"checkpoint {namespace}/{name}: attachment pages are missing in the bucket")
        self.local.create_checkpoint(ckpt, replace=True)
        return self.local.get_checkpoint(namespace, name)

    def _remote_manifest(self, key: str, namespace: str, name: str, etag: str = "") -> Checkpoint | None:
        cached = self._manifests.get(key)
        if cached is not None and etag and cached[0] == etag:
            return cached[1]
        body = self.bucket.get(key)
        if body is None:
            return None
        ckpt = self._checked(L.decode_checkpoint, key, namespace, name, body)
        if etag:
            self._manifests[key] = (etag, ckpt)
        return ckpt

    def _bucket_down(self, exc: Exception) -> None:
        self._count("unavailable")
        self._bucket_down_until = time.monotonic() + BUCKET_DOWN_S
        log.warning("bucket unavailable; local answers only for %.0fs: %s", BUCKET_DOWN_S, exc)

    def list_checkpoints(self, namespace: str | None = None) -> list[Checkpoint]:
        """Local manifests and the bucket's (without their blocks: get_checkpoint or
        get_blocks pulls those). Local only while the bucket is down."""
        out = {(c.namespace, c.name): c for c in self.local.list_checkpoints(namespace)}
        if time.monotonic() < self._bucket_down_until:
            return sorted(out.values(), key=lambda c: (c.namespace, c.name))
        try:
            self._list_remote_checkpoints(namespace, out)
        except RemoteUnavailable as exc:
            self._bucket_down(exc)
        return sorted(out.values(), key=lambda c: (c.namespace, c.name))

    def _list_remote_checkpoints(self, namespace: str | None, out: dict) -> None:
        for info in self.bucket.list(self.layout.checkpoint_prefix(namespace)):
            ns, _, name = info.key[len(self.layout.checkpoint_prefix(None)):].partition("/")
            if (ns, name) in out:
                continue
            ckpt = self._remote_manifest(info.key, ns, name, info.etag)
            if ckpt is not None:
                out[(ns, name)] = ckpt

    def _ensure_pages(self, digests: Sequence) -> None:
        wanted = [PageDigest.coerce(d) for d in digests]
        absent = self._pull_pages(wanted)
        if absent:
            raise NotFound(f"page {absent[0].hex()} is neither stored locally nor in the bucket")

    def get_pages(self, digests: Sequence) -> AbstractContextManager[list]:
        return self._pulled_first(self.local.get_pages, digests)

    def get_pages_deferred(self, digests: Sequence) -> AbstractContextManager[DeferredPages]:
        """The local store's deferred read (kvstore/deferred.py), pages pulled first."""
        return self._pulled_first(self.local.get_pages_deferred, digests)

    @contextmanager
    def _pulled_first(self, read, digests: Sequence) -> Iterator:
        """The local store's read (get_pages or get_pages_deferred), the pages it lacks
        pulled from the bucket first."""
        with ExitStack() as stack:
            try:
                pages = stack.enter_context(read(digests))
            except NotFound:
                self._ensure_pages(digests)
                pages = stack.enter_context(read(digests))
            yield pages

    def read_pages(self, digests: Sequence) -> list[bytes]:
        try:
            return self.local.read_pages(digests)
        except NotFound:
            self._ensure_pages(digests)
            return self.local.read_pages(digests)

    def read_pages_into(self, digests: Sequence, buffers: Sequence) -> int:
        try:
            return self.local.read_pages_into(digests, buffers)
        except NotFound:
            self._ensure_pages(digests)
            return self.local.read_pages_into(digests, buffers)

    def page_nbytes(self, digests: Sequence) -> list[int]:
        try:
            return self.local.page_nbytes(digests)
        except NotFound:
            self._ensure_pages(digests)
            return self.local.page_nbytes(digests)


def open_tiered(path, config: TierConfig, store_config=None, **kwargs) -> TieredStore:
    """Open the local store at `path` and wrap it (the service's and CLI's factory)."""
    return TieredStore(Store(path, store_config), config, **kwargs)
