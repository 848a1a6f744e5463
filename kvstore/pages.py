"""How one page sits in the `pages` database: a 48-byte header, then the stored bytes.

    offset size field
    0      4    magic b"KVP1"
    4      1    codec: 0 raw, 1 zstd
    5      3    reserved, zero
    8      8    raw_nbytes     u64be, length of the canonical uncompressed bytes
    16     8    stored_nbytes  u64be, length of what follows the header
    24     16   xxh3-128 of the stored bytes (big-endian digest as xxhash prints it)
    40     8    reserved, zero
    48     ...  stored bytes

The page's name stays blake3 of the raw bytes; the xxh3-128 lets every read verify
the stored bytes at memory speed. The header is 48 bytes so that, in an LMDB overflow
page (16-byte page header), raw page data starts 64-byte aligned and can be viewed as
any dtype without a copy.

zstd is used only where it saves at least `min_saving` of the bytes. Whether to try
is decided on a 64 KiB sample, so incompressible pages (most KV data) pay ~0.1 ms.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash
import zstandard

from kvstore.errors import InvalidInput

MAGIC = b"KVP1"
HEADER = struct.Struct(">4sB3xQQ16s8x")
HEADER_NBYTES = HEADER.size
assert HEADER_NBYTES == 48
CODEC_RAW = 0
CODEC_ZSTD = 1
CODEC_NAMES = {CODEC_RAW: "raw", CODEC_ZSTD: "zstd"}
SAMPLE_NBYTES = 64 * 1024
MAX_PAGE_NBYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class PageHeader:
    codec: int
    raw_nbytes: int
    stored_nbytes: int
    xxh3: bytes

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, self.codec, self.raw_nbytes, self.stored_nbytes, self.xxh3)

    @classmethod
    def unpack(cls, value) -> "PageHeader":
        if len(value) < HEADER_NBYTES:
            raise ValueError(f"page record of {len(value)} bytes is shorter than its header")
        magic, codec, raw, stored, xxh = HEADER.unpack_from(value)
        if magic != MAGIC:
            raise ValueError(f"bad page magic {bytes(magic)!r}")
        if codec not in CODEC_NAMES:
            raise ValueError(f"unknown page codec {codec}")
        return cls(codec, raw, stored, bytes(xxh))


@dataclass(frozen=True)
class Compression:
    """zstd policy: enabled, level, and the fraction of bytes a frame must save."""

    enabled: bool = True
    level: int = 1
    min_saving: float = 0.10

    def __post_init__(self):
        if not 0.0 <= self.min_saving < 1.0:
            raise InvalidInput("min_saving must be in [0, 1)")


def encode_page(raw, policy: Compression) -> tuple[bytes, bytes]:
    """raw page bytes -> (header, stored bytes). stored may be `raw` itself (no copy)."""
    nbytes = len(raw)
    if nbytes > MAX_PAGE_NBYTES:
        raise InvalidInput(f"page of {nbytes} bytes exceeds the {MAX_PAGE_NBYTES}-byte page limit")
    stored, codec = raw, CODEC_RAW
    if policy.enabled and nbytes >= 256 and _worth_compressing(raw, policy):
        frame = zstandard.ZstdCompressor(level=policy.level, write_content_size=True).compress(raw)
        if len(frame) <= nbytes * (1.0 - policy.min_saving):
            stored, codec = frame, CODEC_ZSTD
    header = PageHeader(codec, nbytes, len(stored), xxhash.xxh3_128_digest(stored))
    return header.pack(), stored


def _worth_compressing(raw, policy: Compression) -> bool:
    if len(raw) <= 2 * SAMPLE_NBYTES:
        return True
    sample = memoryview(raw)[:SAMPLE_NBYTES]
    frame = zstandard.ZstdCompressor(level=policy.level).compress(sample)
    return len(frame) <= SAMPLE_NBYTES * (1.0 - policy.min_saving)


def verify_stored(value) -> tuple[PageHeader, memoryview]:
    """value: a full page record. Returns (header, stored bytes view) or raises ValueError
    describing the damage. Checks length and xxh3-128, not blake3."""
    header = PageHeader.unpack(value)
    body = memoryview(value)[HEADER_NBYTES:]
    if len(body) != header.stored_nbytes:
        raise ValueError(f"stored length {len(body)} != header's {header.stored_nbytes}")
    if xxhash.xxh3_128_digest(body) != header.xxh3:
        raise ValueError("xxh3-128 of the stored bytes does not match the header")
    return header, body


def decode_stored(header: PageHeader, body) -> memoryview | bytes:
    """Stored bytes -> raw bytes (a view of body itself when raw)."""
    if header.codec == CODEC_RAW:
        return body
    raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=header.raw_nbytes)
    if len(raw) != header.raw_nbytes:
        raise ValueError(f"zstd frame gave {len(raw)} bytes, header says {header.raw_nbytes}")
    return raw
