"""Pages: POST missing, PUT one page as raw bytes, POST sizes, POST a batch read that
streams the kvstore.wire page stream. Page bytes never travel as JSON or base64."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from starlette.concurrency import run_in_threadpool

from api.auth import PrincipalDep
from api.deps import SettingsDep, StoreDep
from api.errors import BODY, ApiError, PayloadTooLarge, documented
from api.limits import batch_upload_limit, read_page_body
from api.schemas import HEX64_PATTERN, DigestList, MissingPages, PagePut, PageSizes, PutPages
from api.settings import Settings
from api.streaming import PageStreamResponse
from kvstore.ids import PageDigest
from kvstore.pagestream import open_streamed_pages
from kvstore.protocol import IndexedStore
from kvstore.wire import PAGE_STREAM_MEDIA_TYPE, parse_stream, stream_nbytes

router = APIRouter(prefix="/v1/pages", tags=["pages"])
DigestPath = Annotated[str, Path(pattern=HEX64_PATTERN,
                                 description="64 hex: blake3 of the page's raw bytes")]
OCTET_STREAM = "application/octet-stream"


def _parse(digests: list[str], settings: Settings) -> list[PageDigest]:
    if len(digests) > settings.max_batch_pages:
        raise PayloadTooLarge(f"{len(digests)} digests in one request; the limit is "
                              f"{settings.max_batch_pages}. Split the request")
    return [PageDigest.parse(d) for d in digests]


@router.post("/missing", response_model=MissingPages, responses=documented(*BODY, 507))
def missing(body: DigestList, store: StoreDep,
            settings: SettingsDep) -> MissingPages:
    """The digests the store does not hold, in request order. Upload only those."""
    return MissingPages(missing=[d.hex() for d in store.missing(_parse(body.digests, settings))])


@router.post("/nbytes", response_model=PageSizes, responses=documented(*BODY, 404))
def page_nbytes(body: DigestList, store: StoreDep,
                settings: SettingsDep) -> PageSizes:
    """Raw length of each page; 404 when one is absent."""
    return PageSizes(nbytes=store.page_nbytes(_parse(body.digests, settings)))


@router.put("/{digest}", response_model=PagePut, responses=documented(*BODY, 415, 507),
            openapi_extra={"requestBody": {
    "required": True, "content": {OCTET_STREAM: {"schema": {"type": "string", "format": "binary"}}}}})
async def put_page(request: Request, digest: DigestPath, store: StoreDep,
                   settings: SettingsDep, principal: PrincipalDep) -> PagePut:
    """Store one page. The body is its raw bytes (optionally `Content-Encoding: zstd`);
    the server recomputes blake3 and refuses a mismatch with 422. Idempotent."""
    media = request.headers.get("content-type", OCTET_STREAM).split(";")[0].strip().lower()
    if media != OCTET_STREAM:
        raise ApiError(415, "unsupported_media_type", f"send pages as {OCTET_STREAM}, not {media!r}")
    claimed = PageDigest.parse(digest)
    async with request.app.state.upload_slots.hold(principal):  # bounds upload buffers
        data = await read_page_body(request, settings.max_page_nbytes)
        result = await run_in_threadpool(store.put_pages, [(claimed, data)])
        del data
    return PagePut(digest=digest, new=result.new == 1, stored_nbytes=result.stored_nbytes)


@router.post("/put", response_model=PutPages, responses=documented(*BODY, 415, 507),
             openapi_extra={"requestBody": {
    "required": True,
    "content": {media: {"schema": {"type": "string", "format": "binary"}}
                for media in (PAGE_STREAM_MEDIA_TYPE, OCTET_STREAM)}}})
async def put_pages(request: Request, store: StoreDep, settings: SettingsDep,
                    principal: PrincipalDep) -> PutPages:
    """Store a batch of pages sent as one page stream (the framing of a batch read;
    optionally `Content-Encoding: zstd`), at most max_page_nbytes of page bytes. All or
    nothing: one digest mismatch (422) stores none of them. Idempotent."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in (PAGE_STREAM_MEDIA_TYPE, OCTET_STREAM):  # the body format is fixed
        raise ApiError(415, "unsupported_media_type",
                       f"send a batch as {PAGE_STREAM_MEDIA_TYPE}, not {media!r}")
    limit = batch_upload_limit(settings.max_page_nbytes, settings.max_batch_pages)
    async with request.app.state.upload_slots.hold(principal):
        data = await read_page_body(request, limit)
        pages = parse_stream(data, settings.max_batch_pages)
        if sum(len(v) for _, v in pages) > settings.max_page_nbytes:
            raise PayloadTooLarge(f"a batch carries at most {settings.max_page_nbytes} page bytes")
        result = await run_in_threadpool(store.put_pages, pages)
        del pages, data
    return PutPages(new=result.new, existing=result.existing, stored_nbytes=result.stored_nbytes)


# No response_class: FastAPI would document the errors (JSON) under the stream's media
# type. The 200 names the stream explicitly; the route returns a PageStreamResponse.
@router.post("/get", status_code=200, response_model=None, responses={
    **documented(*BODY, 404, 503), 200: {
    "description": "the page stream (docs/api.md, kvstore/wire.py)",
    "content": {PAGE_STREAM_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}})
async def get_pages(request: Request, body: DigestList, store: StoreDep,
                    settings: SettingsDep, principal: PrincipalDep) -> PageStreamResponse:
    """Read pages as one binary stream. Every page is verified before the first byte
    is sent, so any failure (404, integrity 500) is a JSON error, never a cut stream.
    The bytes decoded for zstd pages count against the caller's and the server's
    decode budgets (api/budget.py): 413 past the caller's share, 503 busy when full.
    zstd pages are decoded while they are sent, 1 MiB at a time (kvstore/pagestream.py)."""
    digests = _parse(body.digests, settings)
    sizes = await run_in_threadpool(store.page_nbytes, digests)
    if sum(sizes) > settings.max_batch_nbytes:
        raise PayloadTooLarge(f"{sum(sizes)} bytes of pages in one read; the limit is "
                              f"{settings.max_batch_nbytes}. Split the request")
    opened = {}

    def open_batch():  # one threadpool hop: verify everything; zstd pages decode as sent
        context = (open_streamed_pages(store, digests) if isinstance(store, IndexedStore)
                   else store.get_pages(digests))
        views = context.__enter__()
        opened["context"] = context  # from here on, someone must exit it
        return context, views

    # A slot bounds the reads holding a transaction; the budget bounds what they
    # decode. The response releases both with the read transaction.
    slots, budget = request.app.state.read_slots, request.app.state.decode_budget
    grant = await budget.acquire(principal, sum(sizes))
    try:
        await slots.acquire()
    except BaseException:
        budget.release(grant)
        raise

    def release():
        budget.release(grant)
        slots.release()
    try:
        context, views = await run_in_threadpool(open_batch)
        # zero-copy views of the map cost nothing; zstd pages (decoded as they are sent)
        # stay reserved: the budget bounds the decode work in flight
        budget.shrink(grant, sum(len(v) for v in views if not isinstance(v, memoryview)))
    except BaseException:  # also a cancellation that lands after the thread finished
        if "context" in opened:
            opened["context"].__exit__(None, None, None)
        release()
        raise
    return PageStreamResponse(digests, views, context, stream_nbytes(sizes), release)
