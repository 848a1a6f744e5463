"""Inventory: what is stored, as rows an operator can read. Thin reads over a store.

Nouns:
  entry       one row of `kvstore ls`: a checkpoint, or a stored prefix
  prefix      a chain of block records from the root to a leaf (a block with no child
              in the store); its tokens are the chain's tokens. A prefix pinned by a
              checkpoint is listed under that checkpoint's name as well.
  logical     raw bytes of every page the entry names, counted once per mention
              (what a restore reads)
  stored      bytes on disk of the distinct pages it names, headers included; shared
              pages count in full for every entry that names them

Checkpoints and block records come from the store protocol (list_checkpoints,
list_blocks), so they list through Store and RemoteStore alike; pins are recounted
from the checkpoints. Per-page stored sizes and reverse references need the page
tables: for a local store they are read in one read transaction of its index
(Store.index, kvstore/index.py, as kvstore.check and kvstore.gc do); over HTTP
stored sizes are reported as unknown. Cost: one pass over every block record (O(blocks) memory), which
suits an admin tool.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

from kvstore.format import FormatIdentity
from kvstore.ids import ROOT_KEY
from kvstore.pages import accounted_nbytes
from kvstore.protocol import IndexedStore
from kvstore.records import BlockRecord, Checkpoint


@dataclass
class Entry:
    kind: str                       # "checkpoint" | "prefix"
    name: str                       # checkpoint name, or the leaf chain key (hex)
    namespace: str
    format_id: str
    model_id: str
    page_format: str
    tokens: int
    blocks: int
    logical_nbytes: int
    stored_nbytes: Optional[int]    # None where the store cannot say (remote)
    pinned: bool
    created_ns: int
    last_used_ns: int
    checkpoints: list[str] = field(default_factory=list)

    @property
    def age_s(self) -> float:
        return max(0.0, time.time() - self.created_ns / 1e9) if self.created_ns else 0.0

    @property
    def idle_s(self) -> Optional[float]:
        return max(0.0, time.time() - self.last_used_ns / 1e9) if self.last_used_ns else None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["evictable"] = not self.pinned
        out["age_s"] = round(self.age_s, 3)
        out["idle_s"] = None if self.idle_s is None else round(self.idle_s, 3)
        return out


def page_formats(identity: Optional[FormatIdentity]) -> str:
    """'native-bf16', or 'native-bf16+k8v4' for a format with mixed paged layers."""
    if identity is None:
        return "?"
    names = [identity.layers[i].page_format for i in identity.paged_layers]
    return "+".join(dict.fromkeys(names)) or "none"


def local_only(store) -> bool:
    """A local store (Store, TieredStore): its index can be read (kvstore.protocol)."""
    return isinstance(store, IndexedStore)


# -- local reads ----------------------------------------------------------------------------
def all_blocks(store, page_size: int = 5000) -> dict[bytes, BlockRecord]:
    """Every block record the store lets this caller see, by chain key."""
    out: dict[bytes, BlockRecord] = {}
    after = None
    while True:
        page = store.list_blocks(after=after, limit=page_size)
        out.update((bytes(r.key), r) for r in page)
        if len(page) < page_size:
            return out
        after = page[-1].key


def page_sizes(store, digests: Iterable) -> dict[bytes, tuple[int, Optional[int]]]:
    """digest -> (raw bytes, stored bytes). Stored is None for a RemoteStore; a page
    that is not stored is left out."""
    wanted = list(dict.fromkeys(bytes(d) for d in digests))
    out: dict[bytes, tuple[int, Optional[int]]] = {}
    if not local_only(store):
        try:  # one request; per page only when some page is absent
            return {d: (n, None) for d, n in zip(wanted, store.page_nbytes(wanted), strict=True)}
        except KeyError:
            pass
        for d in wanted:
            try:
                out[d] = (store.page_nbytes([d])[0], None)
            except KeyError:
                continue
        return out
    with store.index.read(buffers=True) as index:
        for d in wanted:
            value = index.page(d)
            if value is not None:
                out[d] = accounted_nbytes(value)
    return out


def pins(store, checkpoints: Optional[list[Checkpoint]] = None) -> dict[bytes, int]:
    """Block -> number of checkpoints naming it (recounted from the checkpoints, so it
    works over HTTP too)."""
    counts: dict[bytes, int] = defaultdict(int)
    for c in checkpoints if checkpoints is not None else store.list_checkpoints():
        for k in c.chain_keys:
            counts[bytes(k)] += 1
    return dict(counts)


def refcount(store, digest: bytes) -> int:
    with store.index.read() as index:
        return index.refs(digest)


# -- rows ------------------------------------------------------------------------------------
def _formats(store) -> dict[bytes, FormatIdentity]:
    return {f.format_id: f for f in store.list_formats()}


def checkpoint_entry(store, ckpt: Checkpoint, formats: dict, blocks: Optional[dict] = None,
                     sizes: Optional[dict] = None) -> Entry:
    records = ([blocks[bytes(k)] for k in ckpt.chain_keys if bytes(k) in blocks]
               if blocks is not None else store.get_blocks(ckpt.chain_keys))
    digests = [bytes(d) for r in records for d in r.pages] + [bytes(d) for d in ckpt.attachments.values()]
    sizes = sizes if sizes is not None else page_sizes(store, digests)
    logical = sum(sizes.get(d, (0, 0))[0] for d in digests)
    stored_parts = [sizes[d][1] for d in dict.fromkeys(digests) if d in sizes]
    stored = None if any(s is None for s in stored_parts) else sum(stored_parts)
    identity = formats.get(ckpt.format_id)
    return Entry("checkpoint", ckpt.name, ckpt.namespace, ckpt.format_id.hex(),
                 identity.model_id if identity else "?", page_formats(identity), len(ckpt.tokens),
                 len(ckpt.chain_keys), logical, stored, True, ckpt.created_ns,
                 max((r.last_used_ns for r in records), default=ckpt.created_ns))


def entries(store, *, prefixes: bool = True) -> tuple[list[Entry], list[str]]:
    """Every checkpoint, and (local stores) every stored prefix. Returns (rows, notes)."""
    formats = _formats(store)
    notes: list[str] = []
    checkpoints = store.list_checkpoints()
    blocks = all_blocks(store)
    digests = {bytes(d) for r in blocks.values() for d in r.pages}
    digests |= {bytes(d) for c in checkpoints for d in c.attachments.values()}
    sizes = page_sizes(store, digests)
    rows = [checkpoint_entry(store, c, formats, blocks, sizes) for c in checkpoints]
    if prefixes:
        rows.extend(prefix_entries(blocks, sizes, formats, pins(store, checkpoints), checkpoints))
    if not local_only(store):
        notes.append("stored sizes are known only for a local --data-dir")
    return rows, notes


def chain(blocks: dict[bytes, BlockRecord], leaf: bytes) -> list[BlockRecord]:
    """The records from the root to `leaf`, in order (stops at a missing parent)."""
    out = []
    key = leaf
    while key != ROOT_KEY and key in blocks:
        out.append(blocks[key])
        key = bytes(blocks[key].parent)
    return out[::-1]


def prefix_entries(blocks: dict[bytes, BlockRecord], sizes: dict, formats: dict,
                   pin_counts: dict[bytes, int], checkpoints: list[Checkpoint]) -> list[Entry]:
    parents = {bytes(r.parent) for r in blocks.values() if not r.is_root}
    by_leaf = defaultdict(list)
    for c in checkpoints:
        if c.chain_keys:
            by_leaf[bytes(c.chain_keys[-1])].append(f"{c.namespace}/{c.name}")
    rows = []
    for key, leaf in blocks.items():
        if key in parents:
            continue
        records = chain(blocks, key)
        digests = [bytes(d) for r in records for d in r.pages]
        stored_parts = [sizes[d][1] for d in dict.fromkeys(digests) if d in sizes]
        identity = formats.get(leaf.format_id)
        rows.append(Entry(
            "prefix", key.hex(), leaf.namespace, leaf.format_id.hex(),
            identity.model_id if identity else "?", page_formats(identity),
            sum(len(r.tokens) for r in records), len(records),
            sum(sizes.get(d, (0, 0))[0] for d in digests),
            None if any(n is None for n in stored_parts) else sum(stored_parts),
            all(pin_counts.get(bytes(r.key), 0) > 0 for r in records),
            records[0].created_ns if records else leaf.created_ns,
            max(r.last_used_ns for r in records) if records else leaf.last_used_ns,
            sorted(by_leaf.get(key, [])),
        ))
    return rows


def referencing(store, obj: bytes) -> dict[str, list[str]]:
    """Which blocks and checkpoints name a page or a block (local store only)."""
    obj = bytes(obj)
    blocks = [k.hex() for k, r in all_blocks(store).items()
              if obj in {bytes(d) for d in r.pages} or bytes(r.parent) == obj]
    checkpoints = [f"{c.namespace}/{c.name}" for c in store.list_checkpoints()
                   if obj in {bytes(k) for k in c.chain_keys}
                   or obj in {bytes(d) for d in c.attachments.values()}]
    return {"blocks": blocks, "checkpoints": checkpoints}


def parse_hex32(text: str) -> Optional[bytes]:
    text = text.strip().lower()
    if len(text) == 64 and all(ch in "0123456789abcdef" for ch in text):
        return bytes.fromhex(text)
    return None


__all__ = ["Entry", "entries", "chain", "all_blocks", "page_sizes", "pins", "refcount",
           "referencing", "page_formats", "local_only", "parse_hex32"]
