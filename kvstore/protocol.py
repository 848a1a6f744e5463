"""What a store can do, declared: the narrow views callers take, and their capabilities.

Three classes implement the whole protocol (StoreProtocol): kvstore.store.Store (the
embedded LMDB store), kvstore.client.RemoteStore (the same over HTTP) and
kvstore.tier.TieredStore (a local Store in front of an S3 bucket). A caller names the
narrowest view it uses, as restic's Loader and Saver views of its Repository do:

  PageReader     what a restore needs: formats, prefix lookup, block records,
                 verified pages, checkpoints.
  PageWriter     what a publish needs: formats, missing(), put_pages, commit_blocks,
                 has_blocks, checkpoints.
  StoreAdmin     capacity and maintenance: stats, evict, check, plan_gc.
  IndexedStore   a local store's index, one transaction at a time (Store and
                 TieredStore; not RemoteStore): what GC, check and the tools read.

Capabilities are attributes of the protocol, never guessed from the method set
(`hasattr(store, "get_pages")` is true of every implementation, so it says nothing):

  maps_pages     True when get_pages yields zero-copy views of pages that lie in a
                 memory-mapped local file, so a restore needs no staging buffer of
                 its own for them. Store: True. RemoteStore: True only when it reads
                 through local_dir (the server's directory, opened read-only), else
                 False: get_pages then fetches each page into a buffer it allocates,
                 and a restore must price those buffers. TieredStore: True: get_pages
                 answers from the local store's map; pages pulled from the bucket are
                 inserted locally first (in batches of at most INSERT_BATCH_NBYTES) and
                 then mapped.

Semantics every implementation keeps (the conformance test in
tests/kvstore/test_protocol.py checks the method set and signatures of all three):

  chain_salt(ns)    the namespace's secret chain salt (docs/format.md section 3), None
                    when it is unsalted: what a publisher passes to chain_key and
                    BlockRecord so its keys are the store's. Store and TieredStore read
                    StoreConfig.chain_salts; RemoteStore asks the service, which tells a
                    token only its own namespace's salt (an admin's: any).

  has_blocks(keys)  one bool per key: True only when the block's record is stored AND
                    every page it names is present (not missing, not quarantined). A
                    presence check: no page is copied or hashed. A block that answers
                    False is published again (its pages re-sent); commit_blocks of a
                    record that exists only touches it.
  find_blocks(keys) the stored record or None per key: record presence alone.
  lookup_prefix     stops before the first block that names a missing or quarantined
                    page: the caller gets the shorter prefix and recomputes the rest;
                    stats count such a lookup in lookups_stopped_at_damage.
  get_pages         verifies every page; a damaged page is quarantined and raises
                    IntegrityError once, at that read (a restore never reads it again:
                    lookup_prefix stops before it; an explicit get_pages of that digest
                    still refuses it).
  get_pages_deferred
                    get_pages for a caller that hashes the bytes where it copies them
                    (a restore onto a CUDA GPU): a kvstore.deferred.DeferredPages whose
                    `expected` names the xxh3-128 each view still owes, compared by its
                    settle() before the caller uses the copies. Store defers the raw
                    records of a schema-2 store; RemoteStore verifies everything as
                    get_pages does (nothing owed); TieredStore is its local store's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Iterable, Mapping, Protocol, Sequence, runtime_checkable

from kvstore.format import FormatIdentity
from kvstore.ids import PageDigest
from kvstore.records import BlockRecord, Checkpoint


@runtime_checkable
class PageReader(Protocol):
    """The reads of a restore (see the module docstring)."""

    @property
    def maps_pages(self) -> bool: ...

    def chain_salt(self, namespace: str) -> bytes | None: ...

    def get_format(self, format_id) -> FormatIdentity: ...

    def list_formats(self) -> list[FormatIdentity]: ...

    def lookup_prefix(self, format_id, namespace: str, tokens: Sequence[int], *,
                      max_tokens: int | None = None): ...

    def has_blocks(self, keys: Sequence) -> list[bool]: ...

    def find_blocks(self, keys: Sequence) -> list[BlockRecord | None]: ...

    def get_blocks(self, keys: Sequence) -> list[BlockRecord]: ...

    def list_blocks(self, namespace: str | None = None, *, after=None,
                    limit: int = 1000) -> list[BlockRecord]: ...

    def get_pages(self, digests: Sequence) -> AbstractContextManager[list]: ...

    def get_pages_deferred(self, digests: Sequence) -> AbstractContextManager: ...

    def read_pages(self, digests: Sequence) -> list[bytes]: ...

    def read_pages_into(self, digests: Sequence, buffers: Sequence) -> int: ...

    def page_nbytes(self, digests: Sequence) -> list[int]: ...

    def get_checkpoint(self, namespace: str, name: str) -> Checkpoint: ...

    def list_checkpoints(self, namespace: str | None = None) -> list[Checkpoint]: ...


@runtime_checkable
class PageWriter(Protocol):
    """The writes of a publish: missing -> put_pages -> commit_blocks -> checkpoint."""

    def put_format(self, identity: FormatIdentity) -> bytes: ...

    def chain_salt(self, namespace: str) -> bytes | None: ...

    def missing(self, digests: Iterable) -> list[PageDigest]: ...

    def put_pages(self, pages: Mapping | Iterable[tuple]): ...

    def has_blocks(self, keys: Sequence) -> list[bool]: ...

    def commit_blocks(self, blocks: Sequence[BlockRecord]): ...

    def create_checkpoint(self, checkpoint: Checkpoint, *, replace: bool = False) -> Checkpoint: ...

    def delete_checkpoint(self, namespace: str, name: str) -> None: ...


@runtime_checkable
class StoreAdmin(Protocol):
    """Capacity and maintenance."""

    def stats(self): ...

    def evict(self, to_nbytes: int): ...

    def check(self, read_data: bool = False, subset: tuple[int, int] | None = None,
              progress=None): ...

    def plan_gc(self, grace_s: float = 3600.0): ...

    def close(self) -> None: ...


@runtime_checkable
class IndexedStore(Protocol):
    """A local store whose index (kvstore/index.py) is handed out one transaction at
    a time, through `index` (an IndexAccess): Store and TieredStore, not RemoteStore.
    kvstore.gc, kvstore.check and tools/inventory.py take it."""

    @property
    def index(self): ...


@runtime_checkable
class StoreProtocol(PageReader, PageWriter, StoreAdmin, Protocol):
    """Everything: what Store, RemoteStore and TieredStore all implement."""


VIEWS = (PageReader, PageWriter, StoreAdmin)

__all__ = ["PageReader", "PageWriter", "StoreAdmin", "StoreProtocol", "IndexedStore", "VIEWS"]
