"""Block records and checkpoint manifests: the index entries that name pages.

Block record (value under its chain key in `blocks`), all integers big-endian:

    offset size field
    0      1    record version (1)
    1      1    flags: bit 0 set = the chain key is salted (keyed by the namespace's
                secret salt, docs/format.md section 3); other bits zero
    2      2    reserved, zero
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

An unsalted record has flags 0, byte for byte the layout of stores written before
salts existed. The salt itself is never stored: decoding a salted record needs the
namespace's salt (ChainSalts), and without it decode refuses rather than derive a
wrong key.

A checkpoint manifest is canonical JSON (sorted keys): format id, namespace, name,
token ids (base64 of u32 little-endian), ordered chain keys, attachments (name ->
page digest), user metadata and created time.

Checkpoint metadata is free-form JSON within limits every writer is held to (the
embedded Store, the TieredStore and the HTTP service alike; check_metadata): at most
MAX_METADATA_DEPTH levels of nesting, MAX_METADATA_ENTRIES object keys and list items
in all, keys of at most MAX_METADATA_KEY_CHARS characters, MAX_METADATA_NBYTES bytes
of canonical JSON, finite numbers only. A Checkpoint built by a caller past them is
refused (InvalidInput) before anything is stored, so a record that could not be
served back is never written. Records decoded from storage are not re-held to them
(Checkpoint.decode): a store written before the limits still serves what it holds.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from dataclasses import InitVar, dataclass, field, replace
from typing import Any, Mapping, Sequence

from kvstore.errors import InvalidInput
from kvstore.ids import (
    ROOT_KEY,
    ChainKey,
    ChainSalts,
    PageDigest,
    chain_key,
    check_chain_salt,
    check_name,
    check_namespace,
    tokens_array_from_bytes,
    tokens_from_bytes,
    tokens_to_array,
    tokens_to_bytes,
)

BLOCK_VERSION = 1
BLOCK_FLAG_SALTED = 0x01
_BLOCK_HEAD = struct.Struct(">BB2x32s32sQQIIH")
MAX_METADATA_NBYTES = 64 * 1024
MAX_METADATA_DEPTH = 16         # nesting levels of objects and arrays, the top one included
MAX_METADATA_ENTRIES = 1024     # object keys plus array items, over the whole tree
MAX_METADATA_KEY_CHARS = 256
MAX_ATTACHMENTS = 4096


def check_metadata(metadata) -> dict:
    """Refuse (InvalidInput) checkpoint metadata past the limits of the module docstring.
    Iterative, and depth is checked before anything recurses (json.dumps of a few
    thousand levels would raise RecursionError)."""
    if not isinstance(metadata, Mapping):
        raise InvalidInput(f"checkpoint metadata must be a JSON object, got {type(metadata).__name__}")
    entries = 0
    stack = [(metadata, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (Mapping, list, tuple)):
            if depth > MAX_METADATA_DEPTH:
                raise InvalidInput(f"checkpoint metadata nests deeper than {MAX_METADATA_DEPTH} levels")
            entries += len(value)
            if entries > MAX_METADATA_ENTRIES:
                raise InvalidInput(f"checkpoint metadata holds more than {MAX_METADATA_ENTRIES} "
                                   "keys and list items")
            if isinstance(value, Mapping):
                for key in value:
                    if not isinstance(key, str):
                        raise InvalidInput(f"checkpoint metadata keys are strings, got {key!r:.40}")
                    if len(key) > MAX_METADATA_KEY_CHARS:
                        raise InvalidInput(f"a checkpoint metadata key is longer than "
                                           f"{MAX_METADATA_KEY_CHARS} characters")
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, Mapping) else value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise InvalidInput("checkpoint metadata holds a non-finite number")
    try:
        nbytes = len(json.dumps(metadata, sort_keys=True, separators=(",", ":"),
                                allow_nan=False).encode())
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"checkpoint metadata must be JSON-serialisable: {exc}") from None
    if nbytes > MAX_METADATA_NBYTES:
        raise InvalidInput(f"checkpoint metadata is {nbytes} bytes of JSON; the limit is "
                           f"{MAX_METADATA_NBYTES}")
    return dict(metadata)


@dataclass(frozen=True)
class BlockRecord:
    """One block of tokens: its key, its parent, and one page digest per paged layer.
    `salt` is the namespace's chain salt (None: unsalted); it keys the derivation and
    sets the record's salted flag, and is never encoded, compared or shown."""

    format_id: bytes
    namespace: str
    parent: bytes
    tokens: tuple[int, ...]
    pages: tuple[PageDigest, ...]
    created_ns: int = 0
    last_used_ns: int = 0
    key: ChainKey = field(default=None, compare=False)  # derived; never trusted from input
    salt: bytes | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        check_namespace(self.namespace)
        if len(self.format_id) != 32 or len(self.parent) != 32:
            raise InvalidInput("format id and parent must be 32 bytes")
        if len(self.tokens) == 0:
            raise InvalidInput("a block holds at least one token")
        # integers in [0, 2^32) or InvalidInput (a float, a bool or a numeric string is
        # refused, never truncated or parsed); one array for the tuple and the key both
        tokens = tokens_to_array(self.tokens)
        object.__setattr__(self, "tokens", tuple(tokens.tolist()))
        object.__setattr__(self, "pages", tuple(PageDigest.coerce(p) for p in self.pages))
        object.__setattr__(self, "parent", bytes(self.parent))
        object.__setattr__(self, "format_id", bytes(self.format_id))
        object.__setattr__(self, "salt", check_chain_salt(self.salt))
        object.__setattr__(self, "key", chain_key(self.format_id, self.namespace, self.parent,
                                                  tokens, salt=self.salt))

    @property
    def salted(self) -> bool:
        return self.salt is not None

    @property
    def is_root(self) -> bool:
        return self.parent == ROOT_KEY

    def with_times(self, created_ns: int, last_used_ns: int) -> "BlockRecord":
        return replace(self, created_ns=created_ns, last_used_ns=last_used_ns)

    def encode(self) -> bytes:
        ns = self.namespace.encode()
        flags = BLOCK_FLAG_SALTED if self.salted else 0
        head = _BLOCK_HEAD.pack(BLOCK_VERSION, flags, self.format_id, self.parent, self.created_ns,
                                self.last_used_ns, len(self.tokens), len(self.pages), len(ns))
        return b"".join([head, ns, tokens_to_bytes(self.tokens), *self.pages])

    @classmethod
    def decode(cls, raw, salts: ChainSalts | None = None) -> "BlockRecord":
        """A stored record; `salts` gives the salt of a salted record's namespace (an
        unsalted record is decoded alike whatever salts say)."""
        raw = bytes(raw)
        version, flags, fid, parent, created, used, ntok, npages, nslen = _BLOCK_HEAD.unpack_from(raw)
        if version != BLOCK_VERSION:
            raise ValueError(f"block record version {version} is not {BLOCK_VERSION}")
        if flags & ~BLOCK_FLAG_SALTED:
            raise ValueError(f"block record flags {flags:#04x} name bits this code does not know")
        at = _BLOCK_HEAD.size
        ns = raw[at : at + nslen].decode()
        salt = None
        if flags & BLOCK_FLAG_SALTED:
            salt = salts.salt_for(ns) if salts is not None else None
            if salt is None:
                raise InvalidInput(
                    f"a block of namespace {ns!r} is keyed by a chain salt this reader was not "
                    "given: open the store with that namespace's salt (StoreConfig.chain_salts; "
                    "the service reads them from its tokens file's [[namespace]] tables, and "
                    "POST /v1/admin/check checks such a store)")
        at += nslen
        tokens = tokens_array_from_bytes(raw[at : at + 4 * ntok])  # u32: no per-token Python
        at += 4 * ntok
        pages = tuple(PageDigest(raw[at + 32 * i : at + 32 * (i + 1)]) for i in range(npages))
        if at + 32 * npages != len(raw):
            raise ValueError("block record length does not match its counts")
        return cls(fid, ns, parent, tokens, pages, created, used, salt=salt)


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
    # True only for a record decoded from storage (decode): it is served as stored, not
    # re-held to the metadata limits. Not a field: dataclasses.replace() (as
    # Store.create_checkpoint does) builds a new record, held to them again.
    from_storage: InitVar[bool] = False

    def __post_init__(self, from_storage: bool):
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
        if not from_storage:
            check_metadata(self.metadata)
        try:
            meta = json.loads(json.dumps(dict(self.metadata), sort_keys=True))
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidInput(f"checkpoint metadata must be JSON-serialisable: {exc}") from None
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
    def from_dict(cls, data: Mapping[str, Any], *, from_storage: bool = False) -> "Checkpoint":
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
                from_storage=from_storage,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidInput):
                raise
            raise InvalidInput(f"bad checkpoint manifest: {exc!r}") from None

    @classmethod
    def decode(cls, raw) -> "Checkpoint":
        """A stored manifest, as stored (not re-held to the metadata limits)."""
        return cls.from_dict(json.loads(bytes(raw)), from_storage=True)


def checkpoint_key(namespace: str, name: str) -> bytes:
    return check_namespace(namespace).encode() + b"\x00" + check_name(name).encode()


def blocks_for_tokens(format_id: bytes, namespace: str, tokens: Sequence[int],
                      block_size_tokens: int, pages: Sequence[Sequence[PageDigest]],
                      salt: bytes | None = None) -> list[BlockRecord]:
    """Chain `tokens` into block records: full blocks plus a partial tail, if any.
    pages[i] holds block i's page digests, one per paged layer; `salt` is the
    namespace's chain salt (store.chain_salt(namespace)), None when unsalted."""
    n_blocks = -(-len(tokens) // block_size_tokens)
    if len(pages) != n_blocks:
        raise InvalidInput(f"{len(tokens)} tokens make {n_blocks} blocks, got pages for {len(pages)}")
    records, parent = [], ROOT_KEY
    for i in range(n_blocks):
        chunk = tuple(tokens[i * block_size_tokens : (i + 1) * block_size_tokens])
        record = BlockRecord(format_id, namespace, parent, chunk, tuple(pages[i]), salt=salt)
        records.append(record)
        parent = record.key
    return records
