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
Where the page format is known (a PageBatch carries it), the decision is taken once
per format in a put, on its first page, and never tried for packed or quantised
formats (their codes are high-entropy: zstd saves a few percent at most).
The default, 35%, keeps bf16 KV pages raw: zstd saves them only ~20-25% (the exponent
bits), and decompressing at a few hundred MB/s would cost a restore more than the
disk it saves; zero runs, padding and repetitive attachments still compress. Set
min_saving lower to trade restore speed for disk.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import blake3
import xxhash
import zstandard

from kvstore.errors import DigestMismatch, InvalidInput
from kvstore.format import MLX_AFFINE_FORMATS, PACKED_FORMATS
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
HASH_WORKERS = os.cpu_count() or 1  # hash_pages: one thread per core (blake3 drops the GIL)
# never tried with zstd: packed and quantised codes (see the module docstring)
NEVER_COMPRESSED_FORMATS = frozenset(PACKED_FORMATS) | frozenset(MLX_AFFINE_FORMATS)


def hash_page(data) -> PageDigest:
    """A page's name: blake3 of its raw bytes; multithreaded for large pages."""
    threads = blake3.blake3.AUTO if len(data) >= BLAKE3_THREADS_FROM else 1
    return PageDigest(blake3.blake3(data, max_threads=threads).digest())


def _hash_one(data) -> PageDigest:
    return PageDigest(blake3.blake3(data).digest())


def hash_pages(buffers: Sequence, workers: int | None = None) -> list[PageDigest]:
    """Each page's name, in order, on `workers` threads (default HASH_WORKERS): one page
    per thread at a time, so many pages use every core; a single page uses hash_page's
    own threads."""
    workers = min(workers or HASH_WORKERS, len(buffers))
    if workers <= 1:
        return [hash_page(b) for b in buffers]
    with ThreadPoolExecutor(workers, thread_name_prefix="kvstore-hash") as pool:
        return list(pool.map(_hash_one, buffers, chunksize=max(1, len(buffers) // (4 * workers))))


def verified_pages(pages: Mapping | Iterable[tuple]) -> list[tuple[PageDigest, object]]:
    """(digest, bytes) pairs from {digest: bytes} or pairs, every digest recomputed (on
    HASH_WORKERS threads). One mismatch raises DigestMismatch before the caller writes
    or sends anything."""
    items = list(pages.items()) if isinstance(pages, Mapping) else list(pages)
    claimed = [PageDigest.coerce(d) for d, _ in items]
    actual = hash_pages([data for _, data in items])
    for digest, got in zip(claimed, actual, strict=True):
        if got != digest:
            raise DigestMismatch(digest.hex(), got.hex())
    return [(digest, data) for digest, (_, data) in zip(claimed, items, strict=True)]


_SEAL = object()


@dataclass(frozen=True)
class PageBatch:
    """Pages whose digests kvstore computed itself, in this process (PageBatch.hash):
    the in-process save path. Store.put_pages takes one without hashing the pages
    again; every other store (RemoteStore, TieredStore) and every client digest is
    still verified, since a PageBatch iterates as (digest, bytes) pairs.

    It assumes what it can check: page buffers are immutable (bytes, or read-only
    views of memory their owner no longer writes, as a capture's pages are), so the
    bytes a put writes are the bytes hash() named. page_formats (optional, one per
    page: a LayerSpec.page_format, or None for attachments) let the store decide zstd
    once per format (see the module docstring)."""

    digests: tuple[PageDigest, ...]
    buffers: tuple
    page_formats: tuple[str | None, ...]
    seal: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        assert self.seal is _SEAL, "a PageBatch is made by PageBatch.hash(), which names the pages"
        assert len(self.digests) == len(self.buffers) == len(self.page_formats)

    @classmethod
    def hash(cls, buffers: Sequence, page_formats: Sequence[str | None] | None = None, *,
             workers: int | None = None) -> "PageBatch":
        buffers = tuple(buffers)
        formats = tuple(page_formats) if page_formats is not None else (None,) * len(buffers)
        if len(formats) != len(buffers):
            raise InvalidInput(f"{len(buffers)} pages but {len(formats)} page formats")
        for i, b in enumerate(buffers):
            if not memoryview(b).readonly:
                raise InvalidInput(f"page {i} is a writable buffer; a PageBatch holds immutable "
                                   "pages (bytes or read-only views), so what is stored is "
                                   "what was hashed")
        return cls(tuple(hash_pages(buffers, workers)), buffers, formats, _SEAL)

    def __len__(self) -> int:
        return len(self.digests)

    def __iter__(self):
        """(digest, bytes) pairs: what every store's put_pages takes."""
        return iter(zip(self.digests, self.buffers, strict=True))

    def only(self, digests: Iterable) -> "PageBatch":
        """The pages named by `digests` (each once, in that order): what missing() left."""
        at = {d: i for i, d in enumerate(self.digests)}
        try:
            picked = [at[PageDigest.coerce(d)] for d in dict.fromkeys(digests)]
        except KeyError as exc:
            raise InvalidInput(f"page {exc.args[0]!s:.16} is not in this batch") from None
        return PageBatch(tuple(self.digests[i] for i in picked),
                         tuple(self.buffers[i] for i in picked),
                         tuple(self.page_formats[i] for i in picked), _SEAL)

    def zstd_decisions(self, policy: "Compression") -> list[bool | None]:
        """Per page: False (never tried: packed format, or its format's first page did
        not compress), True (its format's first page did), or None (no format known:
        encode_page samples the page itself)."""
        decided: dict[str, bool] = {}
        out: list[bool | None] = []
        for fmt, data in zip(self.page_formats, self.buffers, strict=True):
            if fmt is None or not policy.enabled:
                out.append(None if policy.enabled else False)
            elif fmt in NEVER_COMPRESSED_FORMATS:
                out.append(False)
            else:
                if fmt not in decided:
                    decided[fmt] = len(data) >= 256 and _worth_compressing(data, policy)
                out.append(decided[fmt])
        return out


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


def encode_page(raw, policy: Compression, digest: bytes | None = None, *,
                try_zstd: bool | None = None) -> tuple[bytes, bytes]:
    """raw page bytes -> (header, stored bytes). stored may be `raw` itself (no copy).
    `digest` (the page's name) is bound into the header; the store always passes it.
    try_zstd: None samples this page (see _worth_compressing); False stores it raw;
    True compresses it whole (kept only if it saves min_saving)."""
    frame = zstd_frame(raw, policy, try_zstd=try_zstd)
    if frame is None:
        return raw_page_header(raw, digest), raw
    return zstd_page_header(len(raw), frame, digest), frame


def zstd_frame(raw, policy: Compression, *, try_zstd: bool | None = None) -> bytes | None:
    """The zstd frame to store `raw` as, or None to store it raw (encode_page's choice,
    try_zstd as there). InvalidInput for a page past MAX_PAGE_NBYTES."""
    nbytes = len(raw)
    if nbytes > MAX_PAGE_NBYTES:
        raise InvalidInput(f"page of {nbytes} bytes exceeds the {MAX_PAGE_NBYTES}-byte page limit")
    if try_zstd is None:
        try_zstd = policy.enabled and nbytes >= 256 and _worth_compressing(raw, policy)
    if try_zstd and policy.enabled and nbytes >= 256:
        frame = zstandard.ZstdCompressor(level=policy.level, write_content_size=True).compress(raw)
        if len(frame) <= nbytes * (1.0 - policy.min_saving):
            return frame
    return None


def zstd_page_header(raw_nbytes: int, frame: bytes, digest: bytes | None = None) -> bytes:
    """The header of a page stored as the zstd frame `frame` of raw_nbytes bytes."""
    prefix = bytes(digest)[:8] if digest is not None else bytes(8)
    return PageHeader(CODEC_ZSTD, raw_nbytes, len(frame), xxhash.xxh3_128_digest(frame), prefix).pack()


def raw_page_header(raw, digest: bytes | None = None) -> bytes:
    """The header of a page stored raw (codec raw, both lengths len(raw)): one xxh3-128
    pass over `raw`. The segment writer calls it on its write threads, just before the
    pwritev that reads the same bytes (kvstore/segments.py append)."""
    nbytes = memoryview(raw).nbytes  # what pwritev writes, whatever the buffer's item size
    prefix = bytes(digest)[:8] if digest is not None else bytes(8)
    return PageHeader(CODEC_RAW, nbytes, nbytes, xxhash.xxh3_128_digest(raw), prefix).pack()


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
