"""How one page sits in the `pages` database: a 48-byte header, then the stored bytes.

    offset size field
    0      4    magic b"KVP1"
    4      1    codec: 0 raw, 1 zstd
    5      3    reserved, zero (checked)
    8      8    raw_nbytes     u64be, length of the canonical uncompressed bytes
    16     8    stored_nbytes  u64be, length of what follows the header
    24     16   xxh3-128 of the stored bytes (big-endian digest as xxhash prints it)
    40     8    the first 8 bytes of the page's digest (its name), or zero
    48     ...  stored bytes

The page's name stays blake3 of the raw bytes; the xxh3-128 lets every read verify
the stored bytes at memory speed. The xxh3 alone does not bind a record to its key: a
record moved under another page's key (a misdirected write, a swapped pair) is
self-consistent. So the header carries the first 8 bytes of the digest it was written
for, and a read refuses a record whose prefix is not its key's (zero: a record written
before the field existed, accepted). The header is 48 bytes so that, in an LMDB overflow
page (16-byte page header), raw page data starts 64-byte aligned and can be viewed as
any dtype without a copy.

zstd is used only where it saves at least `min_saving` of the bytes. Whether to try
is decided on a 64 KiB sample, so incompressible pages (most KV data) pay ~0.1 ms.
The default, 35%, keeps bf16 KV pages raw: zstd saves them only ~20-25% (the exponent
bits), and decompressing at a few hundred MB/s would cost a restore more than the
disk it saves; zero runs, padding and repetitive attachments still compress. Set
min_saving lower to trade restore speed for disk.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

import blake3
import xxhash
import zstandard

from kvstore.errors import DigestMismatch, InvalidInput
from kvstore.ids import PageDigest

MAGIC = b"KVP1"
HEADER = struct.Struct(">4sB3sQQ16s8s")
HEADER_NBYTES = HEADER.size
assert HEADER_NBYTES == 48
CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd"}
SAMPLE_NBYTES = 64 * 1024
MAX_PAGE_NBYTES = 256 * 1024 * 1024
BLAKE3_THREADS_FROM = 1 << 20  # pages this large are hashed on several threads


def hash_page(data) -> PageDigest:
    """A page's name: blake3 of its raw bytes; multithreaded for large pages."""
    threads = blake3.blake3.AUTO if len(data) >= BLAKE3_THREADS_FROM else 1
    return PageDigest(blake3.blake3(data, max_threads=threads).digest())


def verified_pages(pages: Mapping | Iterable[tuple]) -> list[tuple[PageDigest, object]]:
    """(digest, bytes) pairs from {digest: bytes} or pairs, every digest recomputed.
    One mismatch raises DigestMismatch before the caller writes or sends anything."""
    items = list(pages.items()) if isinstance(pages, Mapping) else list(pages)
    checked = []
    for claimed, data in items:
        digest = PageDigest.coerce(claimed)
        actual = hash_page(data)
        if actual != digest:
            raise DigestMismatch(digest.hex(), actual.hex())
        checked.append((digest, data))
    return checked


@dataclass(frozen=True)
class PageHeader:
    codec: int
    raw_nbytes: int
    stored_nbytes: int
    xxh3: bytes
    digest_prefix: bytes = bytes(8)

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.codec, bytes(3), self.raw_nbytes, self.stored_nbytes,
                           self.xxh3, self.digest_prefix)

    @classmethod
    def unpack(cls, value) -> "PageHeader":
        """Parse a header. Every bit of it is meaningful: reserved bytes must be zero and
        a raw page's two lengths must agree, so one flipped bit anywhere in the header
        is refused here or by the length, xxh3 and digest-prefix checks in verify_stored."""
        if len(value) < HEADER_NBYTES:
            raise ValueError(f"page record of {len(value)} bytes is shorter than its header")
        magic, codec, reserved_a, raw, stored, xxh, prefix = HEADER.unpack_from(value)
        if magic != MAGIC:
            raise ValueError(f"bad page magic {bytes(magic)!r}")
        if codec not in CODEC_NAMES:
            raise ValueError(f"unknown page codec {codec}")
        if any(reserved_a):
            raise ValueError("reserved header bytes are not zero")
        if codec == CODEC_RAW and raw != stored:
            raise ValueError(f"raw page with raw_nbytes {raw} != stored_nbytes {stored}")
        return cls(codec, raw, stored, bytes(xxh), bytes(prefix))


@dataclass(frozen=True)
class Compression:
    """zstd policy: enabled, level, and the fraction of bytes a frame must save."""

    enabled: bool = True
    level: int = 1
    min_saving: float = 0.35

    def __post_init__(self):
        if not 0.0 <= self.min_saving < 1.0:
            raise InvalidInput("min_saving must be in [0, 1)")


def encode_page(raw, policy: Compression, digest: bytes | None = None) -> tuple[bytes, bytes]:
    """raw page bytes -> (header, stored bytes). stored may be `raw` itself (no copy).
    `digest` (the page's name) is bound into the header; the store always passes it."""
    nbytes = len(raw)
    if nbytes > MAX_PAGE_NBYTES:
        raise InvalidInput(f"page of {nbytes} bytes exceeds the {MAX_PAGE_NBYTES}-byte page limit")
    stored, codec = raw, CODEC_RAW
    if policy.enabled and nbytes >= 256 and _worth_compressing(raw, policy):
        frame = zstandard.ZstdCompressor(level=policy.level, write_content_size=True).compress(raw)
        if len(frame) <= nbytes * (1.0 - policy.min_saving):
            stored, codec = frame, CODEC_ZSTD
    prefix = bytes(digest)[:8] if digest is not None else bytes(8)
    header = PageHeader(codec, nbytes, len(stored), xxhash.xxh3_128_digest(stored), prefix)
    return header.pack(), stored


def _worth_compressing(raw, policy: Compression) -> bool:
    if len(raw) <= 2 * SAMPLE_NBYTES:
        return True
    sample = memoryview(raw)[:SAMPLE_NBYTES]
    frame = zstandard.ZstdCompressor(level=policy.level).compress(sample)
    return len(frame) <= SAMPLE_NBYTES * (1.0 - policy.min_saving)


def verify_stored(value, digest: bytes | None = None) -> tuple[PageHeader, memoryview]:
    """value: a full page record, read under key `digest`. Returns (header, stored bytes
    view) or raises ValueError describing the damage. Checks length, xxh3-128 and that
    the record was written for `digest`; not blake3."""
    header = PageHeader.unpack(value)
    if (digest is not None and any(header.digest_prefix)
            and header.digest_prefix != bytes(digest)[:8]):
        raise ValueError(f"the record was written for page {header.digest_prefix.hex()}..., "
                         "not for this one (misplaced or swapped)")
    body = memoryview(value)[HEADER_NBYTES:]
    if len(body) != header.stored_nbytes:
        raise ValueError(f"stored length {len(body)} != header's {header.stored_nbytes}")
    if xxhash.xxh3_128_digest(body) != header.xxh3:
        raise ValueError("xxh3-128 of the stored bytes does not match the header")
    return header, body


def trusted_header(value) -> PageHeader | None:
    """The header of a page record when it parses and its stored length matches the
    record; None when the header itself is damaged (its byte counts cannot be used)."""
    try:
        header = PageHeader.unpack(value)
    except ValueError:
        return None
    return header if len(value) - HEADER_NBYTES == header.stored_nbytes else None


def accounted_nbytes(value) -> tuple[int, int]:
    """(raw, stored) byte counts a page record was written with, where the store's byte
    counters count it. Recovered also when one field of the record is damaged, so the
    counters stay exact through quarantine, GC and check: the stored count is the
    record's length; a zstd frame names its own content size, a raw body is its size."""
    stored = len(value)
    body = memoryview(value)[HEADER_NBYTES:]
    header = trusted_header(value)
    if header is not None and header.codec == CODEC_RAW:
        return header.raw_nbytes, stored
    content = _zstd_content_size(body)
    if header is not None:
        # A zstd page: header and frame agree unless one was damaged; the xxh3 of the
        # body says which (an intact body means the frame's size is the true one).
        if (content is None or content == header.raw_nbytes
                or xxhash.xxh3_128_digest(body) != header.xxh3):
            return header.raw_nbytes, stored
        return content, stored
    return (content if content is not None else len(body)), stored


def _zstd_content_size(body) -> int | None:
    if len(body) < 4 or bytes(body[:4]) != b"\x28\xb5\x2f\xfd":
        return None
    try:
        size = zstandard.frame_content_size(bytes(body[:18]))
    except zstandard.ZstdError:
        return None
    return size if size >= 0 else None


def decode_stored(header: PageHeader, body) -> memoryview | bytes:
    """Stored bytes -> raw bytes (a view of body itself when raw). Raises ValueError for
    any damage, including a broken zstd frame."""
    if header.codec == CODEC_RAW:
        return body
    if header.raw_nbytes > MAX_PAGE_NBYTES:  # xxh3 covers the body, not this header field
        raise ValueError(f"header's raw_nbytes {header.raw_nbytes} exceeds the page limit")
    try:
        raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=header.raw_nbytes)
    except zstandard.ZstdError as exc:
        raise ValueError(f"zstd frame does not decode: {exc}") from None
    if len(raw) != header.raw_nbytes:
        raise ValueError(f"zstd frame gave {len(raw)} bytes, header says {header.raw_nbytes}")
    return raw
