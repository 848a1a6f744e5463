"""Content addresses: page digests, chain keys, and the strict patterns for client names.

PageDigest = blake3(page bytes), 32 bytes, written as 64 lowercase hex characters.

ChainKey = blake3(
    b"mlx-kvstore/chain/v1\\x00"          domain tag (21 bytes)
    || format_id                          32 bytes
    || u16le(len(namespace)) || namespace utf-8
    || parent                             32 bytes; 32 zero bytes for the first block
    || u32le(len(tokens))
    || u32le(t) for t in tokens
)
No per-process seed: the same tokens under the same format and namespace give the same
key in every process, after every restart, on every machine. docs/format.md has vectors.

Salted (optional, per namespace): the same message hashed by blake3 in keyed mode, the
key being the namespace's 32-byte secret salt. Still deterministic for whoever holds
the salt; without it no one can compute a key for a guessed prompt. salt=None is the
unsalted key above, byte for byte.

ChainSalts is where a store (StoreConfig.chain_salts) or the service (the tokens
file's [[namespace]] tables, api/auth.py) keeps the secrets: namespace -> salt, every
other namespace unsalted. Its repr never shows a salt.
"""

from __future__ import annotations

import hmac
import re
import struct
from typing import Iterable, Iterator, Mapping, Sequence

import blake3
import numpy as np

from kvstore.errors import InvalidInput

DIGEST_NBYTES = 32
ROOT_KEY = bytes(DIGEST_NBYTES)
CHAIN_DOMAIN_TAG = b"mlx-kvstore/chain/v1\x00"
_HEX64 = re.compile(r"[0-9a-f]{64}")
# Namespaces and checkpoint names: no slashes, no dots at the start, no control bytes.
_NAMESPACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-:@+]{0,127}")
MAX_TOKEN_ID = 2**32 - 1
CHAIN_SALT_NBYTES = 32  # blake3's key length


class Digest(bytes):
    """32 raw bytes with a strict hex parser and a short display form."""

    __slots__ = ()

    def __new__(cls, raw: bytes):
        if len(raw) != DIGEST_NBYTES:
            raise InvalidInput(f"a {cls.__name__} is {DIGEST_NBYTES} bytes, got {len(raw)}")
        return super().__new__(cls, raw)

    @classmethod
    def parse(cls, text: str):
        """Strict: exactly 64 lowercase hex characters, nothing else."""
        if not isinstance(text, str) or _HEX64.fullmatch(text) is None:
            shown = repr(text)[:80]
            raise InvalidInput(
                f"not a {cls.__name__}: {shown} (expected 64 lowercase hex characters)"
            )
        return cls(bytes.fromhex(text))

    @classmethod
    def coerce(cls, value):
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, (bytes, bytearray, memoryview)):
            return cls(bytes(value))
        raise InvalidInput(f"cannot read a {cls.__name__} from {type(value).__name__}")

    @property
    def hex_str(self) -> str:
        return self.hex()

    @property
    def short(self) -> str:
        return self.hex()[:12]

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.short}…)"


class PageDigest(Digest):
    __slots__ = ()

    @classmethod
    def of(cls, data) -> "PageDigest":
        return cls(blake3.blake3(data).digest())


class ChainKey(Digest):
    __slots__ = ()


def page_digest(data) -> PageDigest:
    """blake3 of a page's canonical uncompressed bytes."""
    return PageDigest.of(data)


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or _NAMESPACE.fullmatch(namespace) is None:
        raise InvalidInput(
            f"bad namespace {namespace!r}: use 1-64 characters of letters, digits, "
            "'_', '.', '-', not starting with '.' or '-'"
        )
    return namespace


def check_name(name: str) -> str:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise InvalidInput(
            f"bad checkpoint name {name!r}: use 1-128 characters of letters, digits and "
            "'_.-:@+', starting with a letter, digit or '_'"
        )
    return name


def tokens_to_array(tokens: Sequence[int]) -> np.ndarray:
    """Token ids as little-endian u32; refuses non-integers, negatives and ids >= 2^32."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidInput("token ids must be a flat sequence of integers")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise InvalidInput("token ids must be integers in [0, 2^32)")
    return arr.astype("<u4", copy=False)


def tokens_to_bytes(tokens: Sequence[int]) -> bytes:
    return tokens_to_array(tokens).tobytes()


def tokens_array_from_bytes(data: bytes) -> np.ndarray:
    """Little-endian u32 token ids as a read-only array over data."""
    if len(data) % 4:
        raise InvalidInput(f"token bytes must be a multiple of 4, got {len(data)}")
    return np.frombuffer(data, dtype="<u4")


def tokens_from_bytes(data: bytes) -> list[int]:
    return tokens_array_from_bytes(data).tolist()


def check_chain_salt(salt) -> bytes | None:
    """A namespace's salt: None (unsalted) or exactly CHAIN_SALT_NBYTES bytes."""
    if salt is None:
        return None
    if not isinstance(salt, (bytes, bytearray, memoryview)) or len(salt) != CHAIN_SALT_NBYTES:
        raise InvalidInput(f"a chain salt is {CHAIN_SALT_NBYTES} bytes (64 hex characters); "
                           "generate one with `python -c 'import secrets; print(secrets.token_hex(32))'`")
    return bytes(salt)


class ChainSalts(Mapping):
    """namespace -> 32-byte chain salt, immutable; namespaces not named are unsalted.
    Built from bytes or 64-hex strings: ChainSalts({"team-b": "ab12..."})."""

    __slots__ = ("_salts",)

    def __init__(self, salts: Mapping | None = None):
        parsed = {}
        for namespace, salt in dict(salts or {}).items():
            if isinstance(salt, str):
                if _HEX64.fullmatch(salt) is None:
                    raise InvalidInput(f"the chain salt of namespace {namespace!r} is not 64 "
                                       "lowercase hex characters")
                salt = bytes.fromhex(salt)
            parsed[check_namespace(namespace)] = check_chain_salt(salt)
        object.__setattr__(self, "_salts", parsed)

    def __setattr__(self, name, value):
        raise AttributeError("ChainSalts is immutable")

    def salt_for(self, namespace: str) -> bytes | None:
        """The namespace's salt, or None when it is unsalted."""
        return self._salts.get(namespace)

    def __getitem__(self, namespace: str) -> bytes:
        return self._salts[namespace]

    def __iter__(self) -> Iterator[str]:
        return iter(self._salts)

    def __len__(self) -> int:
        return len(self._salts)

    def __hash__(self) -> int:
        return hash(frozenset(self._salts.items()))

    def __repr__(self) -> str:  # the namespaces, never the secrets
        return f"ChainSalts(salted={sorted(self._salts)})"


def compare_salts(a: bytes | None, b: bytes | None) -> bool:
    """Whether two salts (or Nones) are the same, in constant time for equal lengths."""
    if a is None or b is None:
        return a is b
    return hmac.compare_digest(a, b)


def chain_key(format_id: bytes, namespace: str, parent: bytes, tokens: Sequence[int],
              salt: bytes | None = None) -> ChainKey:
    """The deterministic key of one block (see the module docstring); keyed by the
    namespace's secret salt when one is given."""
    if len(format_id) != DIGEST_NBYTES or len(parent) != DIGEST_NBYTES:
        raise InvalidInput("format id and parent key must be 32 bytes each")
    ns = check_namespace(namespace).encode()
    token_bytes = tokens_to_bytes(tokens)
    salt = check_chain_salt(salt)
    hasher = blake3.blake3(CHAIN_DOMAIN_TAG) if salt is None else blake3.blake3(CHAIN_DOMAIN_TAG, key=salt)
    hasher.update(bytes(format_id))
    hasher.update(struct.pack("<H", len(ns)))
    hasher.update(ns)
    hasher.update(bytes(parent))
    hasher.update(struct.pack("<I", len(token_bytes) // 4))
    hasher.update(token_bytes)
    return ChainKey(hasher.digest())


def chain_keys(
    format_id: bytes, namespace: str, tokens: Sequence[int], block_size_tokens: int,
    parent: bytes = ROOT_KEY, salt: bytes | None = None,
) -> list[ChainKey]:
    """Keys of every full block of `tokens`, in order (a partial tail gets none)."""
    keys = []
    for start in range(0, len(tokens) - block_size_tokens + 1, block_size_tokens):
        parent = chain_key(format_id, namespace, parent, tokens[start : start + block_size_tokens],
                           salt=salt)
        keys.append(parent)
    return keys


def parse_digests(values: Iterable, kind=PageDigest) -> list:
    return [kind.coerce(v) for v in values]
