"""The wire formats shared by the HTTP service (api/) and its client (kvstore.client).

They live here, not in api/, because the client must not import api/.

1. The page stream: the body of a batch page read (POST /v1/pages/get), media type
   PAGE_STREAM_MEDIA_TYPE. All integers are big-endian; frames follow request order.

       offset size field
       stream header (16 bytes)
       0      4    magic b"KVPS"
       4      1    version (1)
       5      3    reserved, zero
       8      4    page count n
       12     4    reserved, zero
       n frames, each
       0      32   page digest (raw bytes of the blake3 name)
       32     8    nbytes, u64: the page's raw (uncompressed) length
       40     ...  nbytes of page bytes
       end marker (24 bytes)
       0      4    magic b"KVPE"
       4      4    page count n again
       8      8    total page bytes (sum of nbytes)
       16     8    reserved, zero

   The same stream is the body of a batch upload (POST /v1/pages/put), where
   parse_stream checks it strictly, as client input.

   The response also carries an exact Content-Length. The end marker lets a reader
   that lost the length (a proxy re-chunked the body) detect truncation anyway.
   Every page was verified by the server's store before the first byte was sent, so
   an error is always a normal JSON error response, never a half-sent stream.

2. JSON forms of block records and checkpoints (block_to_json, checkpoint_to_json and
   their inverses): hex for digests, keys and format ids; token ids as integers.
   A block's key is derived again on decode, never trusted from the wire.

3. Error bodies: JSON objects {"code": ..., "message": ..., extra fields}. `code` is
   the KVStoreError subclass's `code`; the extra fields carry what the exception
   carries (diff, digest, missing, claimed/actual). error_to_body and
   error_from_body are inverses, so a RemoteStore raises the same types, with the
   same messages, as the embedded Store.
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

from kvstore import errors
from kvstore.errors import InvalidInput, KVStoreError, StoreIOError
from kvstore.ids import DIGEST_NBYTES, ChainKey, PageDigest
from kvstore.records import BlockRecord, Checkpoint

PAGE_STREAM_MEDIA_TYPE = "application/vnd.kvstore.pages.v1"
STREAM_HEADER = struct.Struct(">4sB3xI4x")
FRAME_HEAD = struct.Struct(">32sQ")
STREAM_END = struct.Struct(">4sIQ8x")
STREAM_MAGIC = b"KVPS"
END_MAGIC = b"KVPE"
STREAM_VERSION = 1


def stream_nbytes(page_nbytes: Sequence[int]) -> int:
    """Exact length of a page stream holding pages of these lengths."""
    return (STREAM_HEADER.size + STREAM_END.size
            + len(page_nbytes) * FRAME_HEAD.size + sum(page_nbytes))


def stream_header(count: int) -> bytes:
    return STREAM_HEADER.pack(STREAM_MAGIC, STREAM_VERSION, count)


def frame_head(digest: bytes, nbytes: int) -> bytes:
    return FRAME_HEAD.pack(bytes(digest), nbytes)


def stream_end(count: int, total_nbytes: int) -> bytes:
    return STREAM_END.pack(END_MAGIC, count, total_nbytes)


class PageStreamReader:
    """Parses a page stream fed as chunks, copying page bytes straight into the
    caller's buffers (one memcpy per byte; no bytes object per page is built).

    digests[i] and buffers[i] describe the i-th expected frame; each buffer must be
    exactly the page's length. feed(chunk) may be called with any chunk sizes;
    finish() checks that the whole stream arrived.
    """

    def __init__(self, digests: Sequence, buffers: Sequence):
        if len(digests) != len(buffers):
            raise InvalidInput(f"{len(digests)} digests but {len(buffers)} buffers")
        self._digests = [bytes(PageDigest.coerce(d)) for d in digests]
        self._dest = [memoryview(b).cast("B") for b in buffers]
        for view in self._dest:
            if view.readonly:
                raise InvalidInput("read_pages_into needs writable buffers")
        self._small = bytearray()   # partial header/frame head/end marker
        self._index = -1            # -1: expecting the stream header
        self._pos = 0               # bytes written into the current page
        self._in_page = False
        self._done = False
        self.total_nbytes = 0

    def _need(self) -> int:
        if self._index < 0:
            return STREAM_HEADER.size
        if self._index < len(self._digests):
            return FRAME_HEAD.size
        return STREAM_END.size

    def feed(self, chunk) -> None:
        data = memoryview(chunk).cast("B")
        at = 0
        while at < len(data):
            if self._done:
                raise StoreIOError("the page stream has bytes past its end marker")
            if self._in_page:
                dest = self._dest[self._index]
                n = min(len(data) - at, len(dest) - self._pos)
                dest[self._pos : self._pos + n] = data[at : at + n]
                self._pos += n
                at += n
                if self._pos == len(dest):
                    self._in_page = False
                    self._index += 1
                continue
            take = min(self._need() - len(self._small), len(data) - at)
            self._small += data[at : at + take]
            at += take
            if len(self._small) == self._need():
                self._parse_small(bytes(self._small))
                self._small.clear()

    def _parse_small(self, raw: bytes) -> None:
        if self._index < 0:
            magic, version, count = STREAM_HEADER.unpack(raw)
            if magic != STREAM_MAGIC or version != STREAM_VERSION:
                raise StoreIOError(f"not a version-{STREAM_VERSION} page stream (magic {magic!r})")
            if count != len(self._digests):
                raise StoreIOError(f"page stream holds {count} pages, asked for {len(self._digests)}")
            self._index = 0
            self._skip_empty_pages()
            return
        if self._index < len(self._digests):
            digest, nbytes = FRAME_HEAD.unpack(raw)
            want = self._digests[self._index]
            if digest != want:
                raise StoreIOError(f"page stream frame {self._index} is {digest.hex()}, "
                                   f"expected {want.hex()}")
            if nbytes != len(self._dest[self._index]):
                raise InvalidInput(f"buffer for page {want.hex()[:12]} holds "
                                   f"{len(self._dest[self._index])} bytes, the page has {nbytes}")
            self.total_nbytes += nbytes
            self._pos = 0
            self._in_page = True
            self._skip_empty_pages()
            return
        magic, count, total = STREAM_END.unpack(raw)
        if magic != END_MAGIC or count != len(self._digests) or total != self.total_nbytes:
            raise StoreIOError("page stream end marker does not match what was received")
        self._done = True

    def _skip_empty_pages(self) -> None:
        if self._in_page and len(self._dest[self._index]) == 0:
            self._in_page = False
            self._index += 1

    def finish(self) -> int:
        if not self._done:
            raise StoreIOError(f"page stream ended early: {max(self._index, 0)} of "
                               f"{len(self._digests)} pages received")
        return self.total_nbytes


def encode_stream(pages: Sequence[tuple[bytes, object]]) -> bytes:
    """A whole page stream of (digest, page bytes) pairs as one bytes object (used for
    batch uploads, whose size the caller bounds)."""
    parts = [stream_header(len(pages))]
    total = 0
    for digest, data in pages:
        view = memoryview(data).cast("B")
        parts += (frame_head(bytes(PageDigest.coerce(digest)), view.nbytes), view)
        total += view.nbytes
    parts.append(stream_end(len(pages), total))
    return b"".join(parts)


def parse_stream(data, max_pages: int) -> list[tuple[PageDigest, memoryview]]:
    """Split a complete page stream held in memory into (digest, view of its bytes);
    no page is copied. Anything malformed is InvalidInput: this parses client input."""
    view = memoryview(data).cast("B")
    if len(view) < STREAM_HEADER.size + STREAM_END.size:
        raise InvalidInput("page stream is shorter than its header and end marker")
    magic, version, count = STREAM_HEADER.unpack_from(view)
    if magic != STREAM_MAGIC or version != STREAM_VERSION:
        raise InvalidInput(f"not a version-{STREAM_VERSION} page stream")
    if count > max_pages:
        raise InvalidInput(f"page stream declares {count} pages; the limit is {max_pages}")
    at, out, total = STREAM_HEADER.size, [], 0
    for i in range(count):
        if at + FRAME_HEAD.size > len(view):
            raise InvalidInput(f"page stream ends inside frame {i}")
        digest, nbytes = FRAME_HEAD.unpack_from(view, at)
        at += FRAME_HEAD.size
        if nbytes > len(view) - at:
            raise InvalidInput(f"frame {i} declares {nbytes} bytes; fewer follow")
        out.append((PageDigest(digest), view[at : at + nbytes]))
        at, total = at + nbytes, total + nbytes
    if len(view) - at != STREAM_END.size:
        raise InvalidInput("page stream does not end with its end marker")
    magic, end_count, end_total = STREAM_END.unpack_from(view, at)
    if magic != END_MAGIC or end_count != count or end_total != total:
        raise InvalidInput("page stream end marker does not match its frames")
    return out


def read_stream_into(readinto: Callable[[memoryview], int], digests: Sequence,
                     buffers: Sequence) -> int:
    """Same parse as PageStreamReader, for a source with readinto (a file, a socket):
    page bytes go from the source straight into the buffers."""
    reader = PageStreamReader(digests, buffers)
    small = bytearray(max(STREAM_HEADER.size, FRAME_HEAD.size, STREAM_END.size))
    while not reader._done:
        if reader._in_page:
            dest = reader._dest[reader._index]
            n = readinto(dest[reader._pos :])
            if n <= 0:
                break
            reader._pos += n
            if reader._pos == len(dest):
                reader._in_page = False
                reader._index += 1
            continue
        need = reader._need() - len(reader._small)
        n = readinto(memoryview(small)[:need])
        if n <= 0:
            break
        reader.feed(memoryview(small)[:n])
    return reader.finish()


# -- records as JSON ----------------------------------------------------------------------
def _hex32(value: str, what: str) -> bytes:
    return bytes(ChainKey.parse(value)) if isinstance(value, str) else _bad(what)


def _bad(what: str):
    raise InvalidInput(f"{what} must be 64 lowercase hex characters")


def block_to_json(record: BlockRecord, with_times: bool = True) -> dict:
    out = {"format_id": record.format_id.hex(), "namespace": record.namespace,
           "parent": record.parent.hex(), "tokens": list(record.tokens),
           "pages": [p.hex() for p in record.pages]}
    if with_times:
        out.update(key=record.key.hex(), created_ns=record.created_ns,
                   last_used_ns=record.last_used_ns)
    return out


def block_from_json(data: dict, salt: bytes | None = None) -> BlockRecord:
    """salt: the chain salt of data's namespace (store.chain_salt), None when unsalted;
    the key is derived with it, never read from data."""
    return BlockRecord(_hex32(data["format_id"], "format_id"), data["namespace"],
                       _hex32(data["parent"], "parent"), tuple(data["tokens"]),
                       tuple(PageDigest.parse(p) for p in data["pages"]),
                       int(data.get("created_ns", 0)), int(data.get("last_used_ns", 0)),
                       salt=salt)


def checkpoint_to_json(c: Checkpoint, with_times: bool = True) -> dict:
    out = {"name": c.name, "namespace": c.namespace, "format_id": c.format_id.hex(),
           "tokens": list(c.tokens), "chain_keys": [k.hex() for k in c.chain_keys],
           "attachments": {k: v.hex() for k, v in sorted(c.attachments.items())},
           "metadata": dict(c.metadata)}
    if with_times:
        out.update(created_ns=c.created_ns, num_tokens=len(c.tokens))
    return out


def checkpoint_from_json(data: dict) -> Checkpoint:
    return Checkpoint(name=data["name"], namespace=data["namespace"],
                      format_id=_hex32(data["format_id"], "format_id"),
                      tokens=tuple(data["tokens"]),
                      chain_keys=tuple(ChainKey.parse(k) for k in data["chain_keys"]),
                      attachments={k: PageDigest.parse(v)
                                   for k, v in data.get("attachments", {}).items()},
                      metadata=data.get("metadata", {}),
                      created_ns=int(data.get("created_ns", 0)))


# -- error bodies ------------------------------------------------------------------------
def _error_classes() -> dict[str, type]:
    out = {}
    for value in vars(errors).values():
        if isinstance(value, type) and issubclass(value, KVStoreError):
            out.setdefault(value.code, value)
    return out


ERROR_CLASSES = _error_classes()


def error_to_body(exc: KVStoreError) -> dict:
    """{"code", "message", ...the fields the exception carries}."""
    body = {"code": exc.code, "message": str(exc)}
    if isinstance(exc, errors.IncompatibleFormat):
        body["diff"] = [{"field": path, "ours": ours, "theirs": theirs}
                        for path, ours, theirs in exc.diff]
    if isinstance(exc, errors.IntegrityError):
        body["digest"] = exc.digest
    if isinstance(exc, errors.DigestMismatch):
        body["claimed"], body["actual"] = exc.claimed, exc.actual
    if isinstance(exc, errors.MissingReferences):
        body["missing"] = list(exc.missing)
    return body


def error_from_body(body: dict, status: int) -> KVStoreError:
    """The exception error_to_body described; unknown codes become KVStoreError (or
    StoreIOError for a 5xx) so callers still catch one base class."""
    code = body.get("code") if isinstance(body, dict) else None
    message = body.get("message") if isinstance(body, dict) else None
    message = str(message) if message is not None else f"HTTP {status}"
    cls = ERROR_CLASSES.get(code)
    if cls is None:
        cls = StoreIOError if status >= 500 else (InvalidInput if status in (400, 413, 422)
                                                  else KVStoreError)
        exc = cls(f"{message} (HTTP {status}, code {code!r})")
        exc.http_status, exc.http_code = status, code
        return exc
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)  # keep the server's message verbatim
    if issubclass(cls, errors.IncompatibleFormat):
        exc.diff = [(d.get("field"), d.get("ours"), d.get("theirs"))
                    for d in body.get("diff", []) if isinstance(d, dict)]
    if issubclass(cls, errors.IntegrityError):
        exc.digest = str(body.get("digest", ""))
    if issubclass(cls, errors.DigestMismatch):
        exc.claimed, exc.actual = str(body.get("claimed", "")), str(body.get("actual", ""))
    if issubclass(cls, errors.MissingReferences):
        exc.missing = [str(m) for m in body.get("missing", [])]
    exc.http_status = status
    return exc


assert DIGEST_NBYTES == 32 and FRAME_HEAD.size == 40
