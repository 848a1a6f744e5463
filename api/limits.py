"""Request body limits, enforced by the app itself (uvicorn enforces none).

BodyLimitMiddleware wraps every request's receive():
  - a Content-Length that is not a plain decimal number is a 400;
  - a declared Content-Length over the route's limit is a 413 before any body byte
    is read (a 10 GiB declaration costs nothing);
  - while the body streams in, more bytes than the limit is a 413, and more or fewer
    bytes than the declared Content-Length is a 400 (a lying length), so a route
    never acts on a body that was not what the client declared.
The limit is max_page_nbytes for PUT /v1/pages/{digest}, that plus the framing
of max_batch_pages pages for a batch upload (POST /v1/pages/put), and
max_json_nbytes for everything else.

read_page_body reads an upload into one preallocated buffer and undoes an optional
`Content-Encoding: zstd`, stopping at max_page_nbytes of output: a zstd bomb costs
at most that much memory and is a 413.
"""

from __future__ import annotations

import io

import zstandard
from fastapi import Request

from api.errors import ApiError, BadRequest, PayloadTooLarge, error_response
from kvstore.wire import stream_nbytes

PAGE_PATH_PREFIX = "/v1/pages/"
BATCH_UPLOAD_PATH = "/v1/pages/put"
DECOMPRESS_CHUNK = 1 << 20


class BodyLimitMiddleware:
    def __init__(self, app, max_page_nbytes: int, max_json_nbytes: int, max_batch_pages: int = 0):
        self.app = app
        self.max_page_nbytes = max_page_nbytes
        self.max_json_nbytes = max_json_nbytes
        self.max_upload_nbytes = batch_upload_limit(max_page_nbytes, max_batch_pages)

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
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise PayloadTooLarge(f"body exceeds the {limit}-byte limit")
                if declared is not None and received > declared:
                    raise BadRequest(f"body is longer than its Content-Length of {declared}")
                if declared is not None and not message.get("more_body") and received != declared:
                    raise BadRequest(f"body of {received} bytes is shorter than its "
                                     f"Content-Length of {declared}")
            return message

        try:
            return await self.app(scope, limited_receive, send)
        except ApiError as exc:  # raised outside a route (e.g. while FastAPI reads JSON)
            response = error_response(exc.status_code, exc.code, str(exc.detail))
            return await response(scope, receive, send)


def batch_upload_limit(max_page_nbytes: int, max_batch_pages: int) -> int:
    """A batch upload carries at most max_page_nbytes of page bytes plus its framing."""
    return max_page_nbytes + stream_nbytes([0] * max_batch_pages)


async def read_page_body(request: Request, max_nbytes: int) -> bytearray:
    """The upload's bytes, decoded, in one buffer sized from Content-Length."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "zstd"):
        raise ApiError(415, "unsupported_media_type",
                       f"Content-Encoding {encoding!r} is not supported; use zstd or none")
    declared = request.scope.get("state", {}).get("declared_nbytes")
    buf = bytearray(declared) if declared is not None else bytearray()
    filled = 0
    async for chunk in request.stream():
        n = len(chunk)
        if declared is None:
            if filled + n > max_nbytes:
                raise PayloadTooLarge(f"body exceeds the {max_nbytes}-byte limit")
            buf += chunk
        else:  # the middleware has already refused more bytes than declared
            buf[filled : filled + n] = chunk
        filled += n
    if encoding == "zstd":
        return decompress_capped(buf, max_nbytes)
    return buf


def decompress_capped(frame, max_nbytes: int) -> bytearray:
    """Decode zstd frames, refusing (413) output past max_nbytes without producing it."""
    try:
        size = zstandard.frame_content_size(bytes(frame[:18]))
    except zstandard.ZstdError as exc:
        raise BadRequest(f"body is not a zstd frame: {exc}", "invalid_input") from None
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
        raise BadRequest(f"body is not valid zstd: {exc}", "invalid_input") from None
