"""The bucket's object layout: names, the object envelope, and the checks on read.

Names, under an optional key prefix P (docs/format.md, "S3 layout"):

    P/formats/<format id hex>           canonical identity JSON        immutable
    P/pages/<page digest hex>           the page's canonical bytes     immutable
    P/blocks/<chain key hex>            block record, times zeroed     immutable
    P/checkpoints/<namespace>/<name>    checkpoint manifest JSON       replaceable

Every object body is a 32-byte envelope head and a payload:

    offset size field
    0      8    magic b"MLXKVS3\\0"
    8      2    object schema version, u16 big-endian (OBJECT_SCHEMA_VERSION = 1)
    10     1    kind: b"F" format, b"P" page, b"B" block, b"C" checkpoint
    11     5    reserved, zero
    16     16   payload check: the first 16 bytes of blake3(payload); zero for a page,
                whose name already is the blake3 of its payload
    32     n    payload

and the same version in the user metadata `x-amz-meta-kvstore-schema`, so a HEAD or a
listing tool can tell without a GET. A payload is never compressed (the name of a page
is the blake3 of its canonical bytes; KV pages rarely shrink; a GET lands in one copy).
Block records are the store's own encoding (kvstore/records.py) with both times zero,
so two hosts uploading the same block write the same bytes.

Every read is checked before anything is used: the envelope (magic, a version this
code knows, the kind the name implies), then the payload against the name: a page
re-hashes to its digest, a block record re-derives its chain key, a format identity
re-hashes to its id, a manifest names its own namespace and name. A failure raises
RemoteIntegrityError naming the object key.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import blake3

from kvstore.errors import InvalidInput, UnsupportedVersion
from kvstore.format import FormatIdentity
from kvstore.ids import ChainKey, PageDigest, check_name, check_namespace
from kvstore.records import BlockRecord, Checkpoint
from kvstore.tier.errors import RemoteIntegrityError

OBJECT_SCHEMA_VERSION = 1
MAGIC = b"MLXKVS3\x00"
_HEAD = struct.Struct(">8sHc5x16s")
HEAD_NBYTES = _HEAD.size  # 32
NO_CHECK = bytes(16)
SCHEMA_META_KEY = "kvstore-schema"
KINDS = {"formats": b"F", "pages": b"P", "blocks": b"B", "checkpoints": b"C"}


@dataclass(frozen=True)
class Layout:
    """Object names under one key prefix ('' or 'team/a', no leading or trailing '/')."""

    prefix: str = ""

    def __post_init__(self):
        p = self.prefix.strip("/")
        if any(part in ("", ".", "..") for part in p.split("/")) and p:
            raise InvalidInput(f"bad key prefix {self.prefix!r}")
        object.__setattr__(self, "prefix", p)

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}/{kind}/{name}" if self.prefix else f"{kind}/{name}"

    def kind_prefix(self, kind: str) -> str:
        return self._key(kind, "")

    def format_key(self, format_id: bytes) -> str:
        return self._key("formats", bytes(format_id).hex())

    def page_key(self, digest) -> str:
        return self._key("pages", PageDigest.coerce(digest).hex())

    def block_key(self, key) -> str:
        return self._key("blocks", ChainKey.coerce(key).hex())

    def checkpoint_key(self, namespace: str, name: str) -> str:
        return self._key("checkpoints", f"{check_namespace(namespace)}/{check_name(name)}")

    def checkpoint_prefix(self, namespace: str | None) -> str:
        base = self.kind_prefix("checkpoints")
        return base + f"{check_namespace(namespace)}/" if namespace is not None else base

    def parse(self, key: str) -> tuple[str, str]:
        """An object key -> (kind, name); InvalidInput for a key outside the layout."""
        rest = key[len(self.prefix) + 1:] if self.prefix else key
        if self.prefix and not key.startswith(self.prefix + "/"):
            raise InvalidInput(f"object {key!r} is outside prefix {self.prefix!r}")
        kind, _, name = rest.partition("/")
        if kind not in KINDS or not name:
            raise InvalidInput(f"object {key!r} is not in the kvstore layout")
        return kind, name


# -- envelope ------------------------------------------------------------------------------
def envelope(kind: str, payload) -> list:
    """The object body as pieces (the payload is not copied)."""
    check = NO_CHECK if kind == "pages" else blake3.blake3(payload).digest(length=16)
    return [_HEAD.pack(MAGIC, OBJECT_SCHEMA_VERSION, KINDS[kind], check), payload]


def open_envelope(key: str, kind: str, body) -> memoryview:
    """The payload of an object body, as a view; refuses a foreign, newer or mislabelled one."""
    view = memoryview(body)
    if len(view) < HEAD_NBYTES:
        raise RemoteIntegrityError(key, f"{len(view)} bytes is shorter than the envelope head")
    magic, version, got, check = _HEAD.unpack_from(view)
    if magic != MAGIC:
        raise RemoteIntegrityError(key, "no kvstore envelope (bad magic)")
    if version > OBJECT_SCHEMA_VERSION:
        raise UnsupportedVersion(f"object {key} has schema version {version}; this code reads up "
                                 f"to {OBJECT_SCHEMA_VERSION}. Upgrade mlx-kvstore")
    if got != KINDS[kind]:
        raise RemoteIntegrityError(key, f"envelope says kind {got!r}, the name says {kind}")
    payload = view[HEAD_NBYTES:]
    if kind != "pages" and blake3.blake3(payload).digest(length=16) != check:
        raise RemoteIntegrityError(key, "payload does not match the envelope's blake3 check")
    return payload


# -- payloads and their checks -------------------------------------------------------------
def block_payload(record: BlockRecord) -> bytes:
    return record.with_times(0, 0).encode()


def decode_page(key: str, digest: PageDigest, body) -> memoryview:
    """The page bytes (a view of body), verified against the digest it is named by."""
    from kvstore.pages import hash_page

    payload = open_envelope(key, "pages", body)
    actual = hash_page(payload)
    if actual != digest:
        raise RemoteIntegrityError(key, f"bytes hash to {actual.hex()}")
    return payload


def decode_block(key: str, chain: ChainKey, body, salts=None) -> BlockRecord:
    """salts: the store's ChainSalts (a salted record needs its namespace's salt)."""
    payload = open_envelope(key, "blocks", body)
    try:
        record = BlockRecord.decode(payload, salts)
    except (ValueError, InvalidInput) as exc:
        raise RemoteIntegrityError(key, f"block record does not decode: {exc}") from None
    if record.key != chain:
        raise RemoteIntegrityError(key, f"record derives chain key {record.key.hex()}")
    return record


def decode_format(key: str, format_id: bytes, body) -> FormatIdentity:
    payload = open_envelope(key, "formats", body)
    try:
        identity = FormatIdentity.from_json(bytes(payload))
    except UnsupportedVersion:
        raise
    except InvalidInput as exc:
        raise RemoteIntegrityError(key, f"format identity does not decode: {exc}") from None
    if identity.format_id != bytes(format_id):
        raise RemoteIntegrityError(key, f"identity hashes to {identity.format_id.hex()}")
    return identity


def decode_checkpoint(key: str, namespace: str, name: str, body) -> Checkpoint:
    payload = open_envelope(key, "checkpoints", body)
    try:
        ckpt = Checkpoint.decode(payload)
    except (ValueError, InvalidInput) as exc:
        raise RemoteIntegrityError(key, f"manifest does not decode: {exc}") from None
    if (ckpt.namespace, ckpt.name) != (namespace, name):
        raise RemoteIntegrityError(key, f"manifest names {ckpt.namespace}/{ckpt.name}")
    return ckpt
