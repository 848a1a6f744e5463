"""The one table from error to HTTP status, and the JSON error body every route returns.

Every error body is {"code": <stable machine name>, "message": <for a human>, ...}
with the exception's own fields added (kvstore.wire.error_to_body): `diff` for
incompatible formats, `digest` for integrity errors, `missing` for missing
references, `claimed`/`actual` for digest mismatches. kvstore.client turns these
bodies back into the same exception types.

    status  code                    raised by
    400     invalid_input           InvalidInput: a bad digest, name, record or length
    400     bad_request             a Content-Length that is malformed or lies; a bad body
    400     bad_encoding            a zstd body that is malformed or cut short
    401     unauthorized            no token, or a token no one was given
    403     forbidden               a user token on an admin route, or another namespace
    404     not_found               NotFound (also any unknown path)
    405     method_not_allowed      a known path with another method; Allow lists its methods
    408     request_timeout         a body that stalled, or trickled under the minimum rate
    409     already_exists          AlreadyExists: a checkpoint of that name exists
    409     incompatible_format     IncompatibleFormat (+ UnsupportedVersion): with `diff`
    409     missing_references      MissingReferences: upload those first, then retry
    409     gc_aborted              GCAborted: another GC runs, or the plan went stale
    413     payload_too_large       a body, a decompressed body or a batch over its limit
    415     unsupported_media_type  a body encoding or content type the route does not take
    422     digest_mismatch         DigestMismatch: uploaded bytes hash to another digest
    422     format_id_mismatch      a format identity that hashes to another id than its path
    422     validation_error        a body or parameter that fails its schema
    431     header_fields_too_large more header lines than max_header_count (header bytes
                                    past max_header_nbytes are refused by uvicorn: a 400)
    499     client_closed_request   the client went away mid-body: sent to no one, logged
                                    as no error, counted in /metrics under 499, never 500
    500     integrity_error         IntegrityError: stored bytes failed verification;
                                    `digest` names the page, now quarantined
    500     io_error                StoreIOError: the OS failed a read, write or sync
    500     internal_error          a bug; the message carries no internals
    503     busy                    the decoded-bytes budget of batch reads stayed full;
                                    retry after Retry-After seconds (RemoteStore does)
    507     store_full              StoreFull: disk or map limit full, nothing committed

MissingReferences is a 409, not a 422: the request is well formed and becomes
valid once the referenced objects are uploaded; the state of the store conflicts.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvstore import errors
from kvstore.wire import error_to_body

log = logging.getLogger("kvstore.api")

# Most specific first: the first class an exception is an instance of wins.
STATUS_OF: list[tuple[type[errors.KVStoreError], int]] = [
    (errors.DigestMismatch, 422),
    (errors.MissingReferences, 409),
    (errors.InvalidInput, 400),
    (errors.NotFound, 404),
    (errors.AlreadyExists, 409),
    (errors.IncompatibleFormat, 409),
    (errors.IntegrityError, 500),
    (errors.StoreFull, 507),
    (errors.GCAborted, 409),
    (errors.StoreIOError, 500),
    (errors.KVStoreError, 500),
]

HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
              405: "method_not_allowed", 408: "request_timeout", 413: "payload_too_large",
              415: "unsupported_media_type", 422: "validation_error",
              431: "header_fields_too_large", 499: "client_closed_request", 503: "busy"}


class ApiError(HTTPException):
    """An HTTP-level refusal raised by api code itself (not by the store)."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(status, message, headers)
        self.code = code


class Unauthorized(ApiError):
    def __init__(self, message: str = "a valid bearer token is required"):
        super().__init__(401, "unauthorized", message, {"WWW-Authenticate": "Bearer"})


class Forbidden(ApiError):
    def __init__(self, message: str):
        super().__init__(403, "forbidden", message)


class PayloadTooLarge(ApiError):
    def __init__(self, message: str):
        super().__init__(413, "payload_too_large", message)


class BadRequest(ApiError):
    def __init__(self, message: str, code: str = "bad_request"):
        super().__init__(400, code, message)


class RequestTimeout(ApiError):
    def __init__(self, message: str):
        super().__init__(408, "request_timeout", message, {"Connection": "close"})


class ClientClosedRequest(ApiError):
    def __init__(self, message: str):
        super().__init__(499, "client_closed_request", message, {"Connection": "close"})


class Busy(ApiError):
    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(503, "busy", message, {"Retry-After": str(retry_after_s)})


DESCRIPTIONS = {
    400: "invalid input, a malformed or lying Content-Length, a malformed zstd body",
    401: "no token, or a token no one was given",
    403: "a user token on an admin route, or on another namespace",
    404: "not stored",
    408: "the request body stalled or came slower than the minimum rate",
    409: "conflicts with the store's state (see `code`)",
    413: "a body, decompressed body or batch over its limit",
    415: "a body encoding or content type this route does not take",
    422: "fails its schema, or bytes that hash to another digest",
    500: "stored bytes failed verification, the OS failed an I/O, or a bug",
    503: "the decoded-bytes budget of batch reads is full; retry after Retry-After",
    507: "disk or map limit full; nothing was committed",
}


BODY = (400, 401, 408, 413, 422, 500)  # any route with a body, behind the token
QUERY = (400, 401, 422, 500)           # any route with only path and query parameters


def documented(*statuses: int) -> dict:
    """OpenAPI `responses` for a route: the error statuses it really gives, each with
    the ErrorBody shape every error has."""
    from api.schemas import ErrorBody  # api.schemas is a leaf; imported late to stay one

    return {status: {"model": ErrorBody, "description": DESCRIPTIONS[status]}
            for status in sorted(statuses)}


def status_of(exc: errors.KVStoreError) -> int:
    for cls, status in STATUS_OF:
        if isinstance(exc, cls):
            return status
    raise AssertionError(f"{type(exc).__name__} is not a KVStoreError")


def error_response(status: int, code: str, message: str, headers: dict | None = None,
                   **extra) -> JSONResponse:
    return JSONResponse({"code": code, "message": message, **extra}, status_code=status,
                        headers=headers)


async def _store_error(request: Request, exc: errors.KVStoreError) -> JSONResponse:
    status = status_of(exc)
    if status >= 500:
        log.error("%s %s: %s", request.method, request.url.path, exc)
    return JSONResponse(error_to_body(exc), status_code=status)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    code = getattr(exc, "code", None) or HTTP_CODES.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail), getattr(exc, "headers", None))


def _shown_loc(loc) -> list[str]:
    # pydantic names union branches in the location (body.grace_s.constrained-float);
    # a client only needs the field
    return [str(x) for x in loc if not str(x).startswith(("constrained-", "function-"))
            and x not in ("int", "float", "bool", "str")]


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    details = [{"loc": _shown_loc(e.get("loc", ())), "msg": str(e.get("msg", ""))}
               for e in exc.errors()[:20]]
    first = details[0] if details else {"loc": [], "msg": "invalid request"}
    return error_response(422, "validation_error",
                          f"{'.'.join(first['loc'])}: {first['msg']}", errors=details)


async def _client_gone(request: Request, exc: ClientDisconnect) -> JSONResponse:
    # starlette's own signal that the client went away (it reads receive() itself in
    # places): the same 499 as api/limits.py gives, no traceback
    return error_response(499, "client_closed_request", "the client went away")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(500, "internal_error", "internal server error; see the server log")


def install(app: FastAPI) -> None:
    app.add_exception_handler(errors.KVStoreError, _store_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ClientDisconnect, _client_gone)
    app.add_exception_handler(Exception, _unexpected)
