"""PageStreamResponse: sends verified zero-copy page views as the kvstore.wire stream.

Shape and cost: the views point into the LMDB map and stay valid only while the
store's read transaction is open, which this response holds until its last byte is
handed to the server (and releases in `finally`, also when the client goes away).
Each 1 MiB piece is copied once from the map into a fresh bytes before send(): the
server's transport may keep a reference to what it was given after send() returns,
and a reference into the map must not outlive the transaction. No buffer larger than
CHUNK_NBYTES is ever built, whatever the batch size.

A zstd page comes as a kvstore.pagestream.DeferredPage (verified, not yet decoded) and
is decoded here while it is sent, CHUNK_NBYTES at a time: a stream holds at most one
decoded piece and one body, whatever its pages' sizes (issue 23, read amplification).

A client too slow to take the stream within its deadline (STREAM_MIN_BYTES_PER_S,
at least STREAM_MIN_S) is cut off, so a stalled reader cannot pin a read transaction
(and with it LMDB's free pages and the map's growth) for ever.
"""

from __future__ import annotations

import anyio
from starlette.responses import Response

from kvstore.pagestream import DeferredPage
from kvstore.wire import PAGE_STREAM_MEDIA_TYPE, frame_head, stream_end, stream_header

CHUNK_NBYTES = 1 << 20
STREAM_MIN_BYTES_PER_S = 8 << 20
STREAM_MIN_S = 30.0


class PageStreamResponse(Response):
    media_type = PAGE_STREAM_MEDIA_TYPE

    def __init__(self, digests, views, context, content_length: int, release=None):
        super().__init__(content=b"", media_type=PAGE_STREAM_MEDIA_TYPE)
        self.digests, self.views, self.context = digests, views, context
        self.headers["content-length"] = str(content_length)
        self.content_length = content_length
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            deadline = max(STREAM_MIN_S, self.content_length / STREAM_MIN_BYTES_PER_S)
            with anyio.move_on_after(deadline):
                await self._send_frames(send)
        finally:
            views, self.views = self.views, None
            del views
            try:
                self.context.__exit__(None, None, None)
            finally:
                if self.release is not None:
                    self.release()

    def _pieces(self):
        """The stream in order: header, (frame head, page view) per page, end marker."""
        yield stream_header(len(self.digests))
        total = 0
        for digest, view in zip(self.digests, self.views, strict=True):
            yield frame_head(digest, len(view))
            if isinstance(view, DeferredPage):  # decoded now, one piece at a time
                yield from view.pieces(CHUNK_NBYTES)
            else:
                yield view
            total += len(view)
        yield stream_end(len(self.digests), total)

    async def _send_frames(self, send) -> None:
        # Bodies of exactly CHUNK_NBYTES (the last one shorter): pending holds slices
        # of pieces, and b"".join copies each byte exactly once into a fresh bytes.
        pending, pending_nbytes = [], 0
        for piece in self._pieces():
            at = 0
            while at < len(piece):
                take = min(CHUNK_NBYTES - pending_nbytes, len(piece) - at)
                pending.append(piece[at : at + take])
                pending_nbytes, at = pending_nbytes + take, at + take
                if pending_nbytes == CHUNK_NBYTES:
                    body = b"".join(pending)
                    pending, pending_nbytes = [], 0
                    await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})
