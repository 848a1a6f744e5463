"""Block records and checkpoint manifests: the index entries that name pages.

Block record (value under its chain key in `blocks`), all integers big-endian:

    offset size field
    0      1    record version (1)
    1      3    reserved, zero
    4      32   format id
    36     32   parent chain key (32 zero bytes for a first block)
    68     8    created ns
    76     8    last used ns
    84     4    token count n
    88     4    page count p
    92     2    namespace length m
    94     m    namespace, utf-8
    94+m   4n   token ids, u32 little-endian (the chain key's own byte order)
    ...    32p  page digests, one per paged layer in layer order

A checkpoint manifest is canonical JSON (sorted keys): format id, namespace, name,
token ids (base64 of u32 little-endian), ordered chain keys, attachments (name ->
page digest), user metadata and created time.
"""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from kvstore.errors import InvalidInput
from kvstore.ids import (
    ROOT_KEY,
    ChainKey,
    PageDigest,
    chain_key,
    check_name,
    check_namespace,
    tokens_from_bytes,
    tokens_to_bytes,
)

BLOCK_VERSION = 1
_BLOCK_HEAD = struct.Struct(">B3x32s32sQQIIH")
MAX_METADATA_NBYTES = 64 * 1024
MAX_ATTACHMENTS = 4096


@dataclass(frozen=True)
class BlockRecord:
    """One block of tokens: its key, its parent, and one page digest per paged layer."""

    format_id: bytes
    namespace: str
    parent: bytes
    tokens: tuple[int, ...]
    pages: tuple[PageDigest, ...]
    created_ns: int = 0
    last_used_ns: int = 0
    key: ChainKey = field(default=None, compare=False)  # derived; never trusted from input

    def __post_init__(self):
        check_namespace(self.namespace)
        if len(self.format_id) != 32 or len(self.parent) != 32:
            raise InvalidInput("format id and parent must be 32 bytes")
        if not self.tokens:
            raise InvalidInput("a block holds at least one token")
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "pages", tuple(PageDigest.coerce(p) for p in self.pages))
        object.__setattr__(self, "parent", bytes(self.parent))
        object.__setattr__(self, "format_id", bytes(self.format_id))
        object.__setattr__(self, "key", chain_key(self.format_id, self.namespace, self.parent, self.tokens))

    @property
    def is_root(self) -> bool:
        return self.parent == ROOT_KEY

    def with_times(self, created_ns: int, last_used_ns: int) -> "BlockRecord":
        return replace(self, created_ns=created_ns, last_used_ns=last_used_ns)

    def encode(self) -> bytes:
        ns = self.namespace.encode()
        head = _BLOCK_HEAD.pack(BLOCK_VERSION, self.format_id, self.parent, self.created_ns,
                                self.last_used_ns, len(self.tokens), len(self.pages), len(ns))
        return b"".join([head, ns, tokens_to_bytes(self.tokens), *self.pages])

    @classmethod
    def decode(cls, raw) -> "BlockRecord":
        raw = bytes(raw)
        version, fid, parent, created, used, ntok, npages, nslen = _BLOCK_HEAD.unpack_from(raw)
        if version != BLOCK_VERSION:
            raise ValueError(f"block record version {version} is not {BLOCK_VERSION}")
        at = _BLOCK_HEAD.size
        ns = raw[at : at + nslen].decode()
        at += nslen
        tokens = tokens_from_bytes(raw[at : at + 4 * ntok])
        at += 4 * ntok
        pages = tuple(PageDigest(raw[at + 32 * i : at + 32 * (i + 1)]) for i in range(npages))
        if at + 32 * npages != len(raw):
            raise ValueError("block record length does not match its counts")
        return cls(fid, ns, parent, tuple(tokens), pages, created, used)


@dataclass(frozen=True)
class Checkpoint:
    """A named, complete save: every block in order plus non-paged state as attachments."""

    name: str
    namespace: str
    format_id: bytes
    tokens: tuple[int, ...]
    chain_keys: tuple[ChainKey, ...]
    attachments: Mapping[str, PageDigest] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    created_ns: int = 0

    def __post_init__(self):
        check_name(self.name)
        check_namespace(self.namespace)
        if len(self.format_id) != 32:
            raise InvalidInput("format id must be 32 bytes")
        object.__setattr__(self, "format_id", bytes(self.format_id))
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "chain_keys", tuple(ChainKey.coerce(k) for k in self.chain_keys))
        if len(self.attachments) > MAX_ATTACHMENTS:
            raise InvalidInput(f"at most {MAX_ATTACHMENTS} attachments")
        atts = {}
        for key, value in dict(self.attachments).items():
            if not isinstance(key, str) or not 0 < len(key) <= 128:
                raise InvalidInput(f"bad attachment name {key!r}")
            atts[key] = PageDigest.coerce(value)
        object.__setattr__(self, "attachments", atts)
        try:
            meta = json.loads(json.dumps(dict(self.metadata), sort_keys=True))
        except (TypeError, ValueError) as exc:
            raise InvalidInput(f"checkpoint metadata must be JSON-serialisable: {exc}") from None
        if len(json.dumps(meta)) > MAX_METADATA_NBYTES:
            raise InvalidInput(f"checkpoint metadata exceeds {MAX_METADATA_NBYTES} bytes")
        object.__setattr__(self, "metadata", meta)

    @property
    def db_key(self) -> bytes:
        return checkpoint_key(self.namespace, self.name)

    def referenced_pages(self) -> list[PageDigest]:
        return list(self.attachments.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "format_id": self.format_id.hex(),
            "tokens_u32le_b64": base64.b64encode(tokens_to_bytes(self.tokens)).decode(),
            "num_tokens": len(self.tokens),
            "chain_keys": [k.hex() for k in self.chain_keys],
            "attachments": {k: v.hex() for k, v in sorted(self.attachments.items())},
            "metadata": self.metadata,
            "created_ns": self.created_ns,
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Checkpoint":
        try:
            tokens = tokens_from_bytes(base64.b64decode(data["tokens_u32le_b64"], validate=True))
            return cls(
                name=data["name"],
                namespace=data["namespace"],
                format_id=bytes.fromhex(data["format_id"]),
                tokens=tuple(tokens),
                chain_keys=tuple(ChainKey.parse(k) for k in data["chain_keys"]),
                attachments={k: PageDigest.parse(v) for k, v in data.get("attachments", {}).items()},
                metadata=data.get("metadata", {}),
                created_ns=int(data.get("created_ns", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidInput):
                raise
            raise InvalidInput(f"bad checkpoint manifest: {exc!r}") from None

    @classmethod
    def decode(cls, raw) -> "Checkpoint":
        return cls.from_dict(json.loads(bytes(raw)))


def checkpoint_key(namespace: str, name: str) -> bytes:
    return check_namespace(namespace).encode() + b"\x00" + check_name(name).encode()


def blocks_for_tokens(format_id: bytes, namespace: str, tokens: Sequence[int],
                      block_size_tokens: int, pages: Sequence[Sequence[PageDigest]]) -> list[BlockRecord]:
    """Chain `tokens` into block records: full blocks plus a partial tail, if any.
    pages[i] holds block i's page digests, one per paged layer."""
    n_blocks = -(-len(tokens) // block_size_tokens)
    if len(pages) != n_blocks:
        raise InvalidInput(f"{len(tokens)} tokens make {n_blocks} blocks, got pages for {len(pages)}")
    records, parent = [], ROOT_KEY
    for i in range(n_blocks):
        chunk = tuple(tokens[i * block_size_tokens : (i + 1) * block_size_tokens])
        record = BlockRecord(format_id, namespace, parent, chunk, tuple(pages[i]))
        records.append(record)
        parent = record.key
    return records
