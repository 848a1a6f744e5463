"""Request limits, enforced by the app itself. uvicorn caps the request line and the
header bytes (h11's max incomplete event size, set in api/server.py); everything else
is here.

HeaderLimitMiddleware refuses (431) a request with more than max_header_count header
lines before authentication or routing sees it.

BodyLimitMiddleware wraps every request's receive():
  - a Content-Length that is not a plain decimal number is a 400;
  - a declared Content-Length over the route's limit is a 413 before any body byte
    is read (a 10 GiB declaration costs nothing);
  - while the body streams in, more bytes than the limit is a 413, and more or fewer
    bytes than the declared Content-Length is a 400 (a lying length), so a route
    never acts on a body that was not what the client declared;
  - a body must keep coming: it has arrived by body_timeout_s + received /
    min_body_bytes_per_s seconds after its first read, or the request is a 408 with
    Connection: close. A stalled or trickling client holds an upload slot for
    seconds, not for ever;
  - a client that goes away mid-body ends the request as a 499 (nginx's "client
    closed request"; nobody receives it): counted as such, never logged as a 500.
The limit is max_page_nbytes for PUT /v1/pages/{digest}, that plus the framing
of max_batch_pages pages for a batch upload (POST /v1/pages/put), and
max_json_nbytes for everything else.

read_page_body reads an upload into a buffer that grows as bytes arrive (never one
sized from the declared Content-Length: a declaration costs nothing until its bytes
come) and undoes an optional `Content-Encoding: zstd`, stopping at max_page_nbytes of
output: a zstd bomb costs at most that much memory and is a 413; a truncated or
malformed frame is a 400 bad_encoding.

UploadSlots bounds the upload bodies in memory: max_concurrent_uploads in all, at most
max_uploads_per_token of them held by one principal, so one tenant cannot take them all.
"""

from __future__ import annotations

import io
from contextlib import asynccontextmanager

import anyio
import zstandard
from fastapi import Request

from api.errors import (
    ApiError,
    BadRequest,
    ClientClosedRequest,
    PayloadTooLarge,
    RequestTimeout,
    error_response,
)
from kvstore.wire import stream_nbytes

PAGE_PATH_PREFIX = "/v1/pages/"
BATCH_UPLOAD_PATH = "/v1/pages/put"
DECOMPRESS_CHUNK = 1 << 20
ZSTD_MAGIC = 0xFD2FB528
ZSTD_SKIPPABLE = range(0x184D2A50, 0x184D2A60)


class HeaderLimitMiddleware:
    """Pure ASGI: more than max_header_count header lines is a 431, before the app."""

    def __init__(self, app, max_header_count: int):
        self.app = app
        self.max_header_count = max_header_count

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(scope.get("headers", ())) > self.max_header_count:
            response = error_response(431, "header_fields_too_large",
                                      f"more than {self.max_header_count} header lines",
                                      {"Connection": "close"})
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


class BodyLimitMiddleware:
    def __init__(self, app, max_page_nbytes: int, max_json_nbytes: int, max_batch_pages: int = 0,
                 body_timeout_s: float = 10.0, min_body_bytes_per_s: int = 1 << 20):
        self.app = app
        self.max_page_nbytes = max_page_nbytes
        self.max_json_nbytes = max_json_nbytes
        self.max_upload_nbytes = batch_upload_limit(max_page_nbytes, max_batch_pages)
        self.body_timeout_s = body_timeout_s
        self.min_body_bytes_per_s = min_body_bytes_per_s

    def limit_for(self, method: str, path: str) -> int:
        if method == "PUT" and path.startswith(PAGE_PATH_PREFIX):
            return self.max_page_nbytes
        if method == "POST" and path == BATCH_UPLOAD_PATH:
            return self.max_upload_nbytes
        return self.max_json_nbytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_for(scope["method"], scope["path"])
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if declared is not None or not value.isdigit() or len(value) > 19:
                    return await error_response(400, "bad_request", "bad Content-Length header")(
                        scope, receive, send)
                declared = int(value)
        if declared is not None and declared > limit:
            response = error_response(413, "payload_too_large",
                                      f"body of {declared} bytes exceeds the {limit}-byte limit",
                                      {"Connection": "close"})
            return await response(scope, receive, send)
        scope.setdefault("state", {})["declared_nbytes"] = declared
        received, started, body_done = 0, None, False

        async def limited_receive():
            nonlocal received, started, body_done
            if body_done:  # after the body only a disconnect can come: no deadline
                return await receive()
            now = anyio.current_time()
            started = now if started is None else started
            deadline = started + self.body_timeout_s + received / self.min_body_bytes_per_s
            with anyio.move_on_after(max(0.0, deadline - now)) as waited:
                message = await receive()
            if waited.cancelled_caught:
                raise RequestTimeout(
                    f"the body stalled at {received} bytes after {now - started:.1f} s; a body "
                    f"must arrive within {self.body_timeout_s:g} s plus 1 s per "
                    f"{self.min_body_bytes_per_s} bytes")
            if message["type"] == "http.disconnect":
                body_done = True
                raise ClientClosedRequest(f"the client went away after {received} body bytes")
            body_done = not message.get("more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
                if declared is not None and received > declared:
                    raise BadRequest(f"body is longer than its Content-Length of {declared}")
                if declared is not None and body_done and received != declared:
                    raise BadRequest(f"body of {received} bytes is shorter than its "
                                     f"Content-Length of {declared}")
            return message

        try:
            return await self.app(scope, limited_receive, send)
        except ApiError as exc:  # raised outside a route (e.g. while FastAPI reads JSON)
            response = error_response(exc.status_code, exc.code, str(exc.detail), exc.headers)
            return await response(scope, receive, send)


def batch_upload_limit(max_page_nbytes: int, max_batch_pages: int) -> int:
    """A batch upload carries at most max_page_nbytes of page bytes plus its framing."""
    return max_page_nbytes + stream_nbytes([0] * max_batch_pages)


async def read_page_body(request: Request, max_nbytes: int) -> bytearray:
    """The upload's bytes, decoded. The buffer grows as bytes arrive (bytearray's
    amortised growth), so memory follows what was received, never what was declared."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "zstd"):
        raise ApiError(415, "unsupported_media_type",
                       f"Content-Encoding {encoding!r} is not supported; use zstd or none")
    buf = bytearray()
    async for chunk in request.stream():
        if len(buf) + len(chunk) > max_nbytes:  # the middleware refuses this too
            raise PayloadTooLarge(f"body exceeds the {max_nbytes}-byte limit")
        buf += chunk
    if encoding == "zstd":
        return decompress_capped(buf, max_nbytes)
    return buf


def decompress_capped(frame, max_nbytes: int) -> bytearray:
    """Decode zstd frames, refusing (413) output past max_nbytes without producing it,
    and (400 bad_encoding) a frame that is malformed or cut short."""
    check_zstd_frames(frame)
    try:
        size = zstandard.frame_content_size(bytes(frame[:18]))
    except zstandard.ZstdError as exc:
        raise BadRequest(f"body is not a zstd frame: {exc}", "bad_encoding") from None
    if size > max_nbytes:  # -1: unknown size, decided while decoding
        raise PayloadTooLarge(f"zstd frame declares {size} bytes, over the {max_nbytes}-byte limit")
    out = bytearray()
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(frame), read_across_frames=True)
    try:
        while True:
            chunk = reader.read(DECOMPRESS_CHUNK)
            if not chunk:
                return out
            if len(out) + len(chunk) > max_nbytes:
                raise PayloadTooLarge(f"zstd body decompresses past the {max_nbytes}-byte limit")
            out += chunk
    except zstandard.ZstdError as exc:
        raise BadRequest(f"body is not valid zstd: {exc}", "bad_encoding") from None
    finally:
        reader.close()


def check_zstd_frames(data) -> None:
    """Walk the frames' headers and block headers (RFC 8878, sections 3.1.1 to 3.1.1.2)
    without decoding: each frame must end with its last block (and checksum) inside
    the body. zstandard's stream reader returns a truncated frame's prefix silently,
    which would surface later as a digest mismatch rather than as the bad encoding it
    is. Cost: one step per 128 KiB block."""
    view, at, end = memoryview(data), 0, len(data)

    def need(n: int, what: str) -> None:
        if at + n > end:
            raise BadRequest(f"zstd body is truncated inside {what} (byte {at} of {end})",
                             "bad_encoding")
    while at < end:
        need(4, "a frame's magic number")
        magic = int.from_bytes(view[at : at + 4], "little")
        if magic in ZSTD_SKIPPABLE:
            need(8, "a skippable frame's header")
            at += 8 + int.from_bytes(view[at + 4 : at + 8], "little")
            need(0, "a skippable frame")
            continue
        if magic != ZSTD_MAGIC:
            raise BadRequest(f"body is not zstd: bad frame magic at byte {at}", "bad_encoding")
        need(5, "a frame header")
        descriptor = view[at + 4]
        single_segment = (descriptor >> 5) & 1
        at += 5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3] \
            + ((1 if single_segment else 0), 2, 4, 8)[descriptor >> 6]
        while True:
            need(3, "a block header")
            header = int.from_bytes(view[at : at + 3], "little")
            kind, nbytes = (header >> 1) & 3, header >> 3
            if kind == 3:
                raise BadRequest(f"zstd block of reserved type at byte {at}", "bad_encoding")
            at += 3 + (1 if kind == 1 else nbytes)
            need(0, "a block")
            if header & 1:
                break
        at += 4 if (descriptor >> 2) & 1 else 0
        need(0, "a frame checksum")


class UploadSlots:
    """At most `total` upload bodies in memory, at most `per_principal` of them held by
    one principal (a token's namespace and role). The anonymous principal of a server
    without tokens is its only tenant: `total` alone bounds it. A request waits for
    one of its principal's slots before it takes a shared one, so a tenant whose slots
    are all busy holds none of the others'."""

    def __init__(self, total: int, per_principal: int):
        self._total = anyio.Semaphore(total)
        self._per_principal = per_principal
        self._mine: dict[object, list] = {}  # principal -> [Semaphore, requests using it]

    @asynccontextmanager
    async def hold(self, principal):
        if principal is None or getattr(principal, "anonymous", False):
            async with self._total:
                yield
            return
        entry = self._mine.setdefault(principal, [anyio.Semaphore(self._per_principal), 0])
        entry[1] += 1
        try:
            async with entry[0], self._total:
                yield
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._mine[principal]
