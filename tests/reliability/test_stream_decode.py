"""Issue 23, read amplification: a batch read decodes its zstd pages while it sends
them, one 1 MiB piece at a time (kvstore/pagestream.py, api/streaming.py), so the
memory a read holds decoded is one piece, not every page of the read. Fails where the
route decodes every page before the first byte (Store.get_pages): 256 MiB there.

Driven through the ASGI app directly, with a `send` that hashes and drops each body,
so the client side holds nothing either (TestClient would buffer the whole body).
"""

from __future__ import annotations

import json
import tracemalloc

import anyio
import blake3
import pytest

from api.app import create_app
from api.settings import Settings
from kvstore.errors import IntegrityError
from kvstore.ids import page_digest
from kvstore.pagestream import DeferredPage, open_streamed_pages
from kvstore.wire import frame_head, stream_end, stream_header
from tests.kvstore.factories import flip_bit, make_store, stored_value

PAGE_NBYTES = 32 << 20
COPIES = 8  # 256 MiB decoded from about 8 KB stored


def _post(app, path: str, body: dict) -> tuple[int, bytes, int]:
    """(status, blake3 of the response body, its length), holding no body in memory."""
    payload = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80),
             "headers": [(b"host", b"t"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(payload)).encode())]}
    sent = {"body": False}
    hasher, out = blake3.blake3(), {"status": 0, "nbytes": 0}

    async def receive():
        if not sent["body"]:
            sent["body"] = True
            return {"type": "http.request", "body": payload, "more_body": False}
        await anyio.sleep_forever()

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        elif message["type"] == "http.response.body":
            hasher.update(message.get("body", b""))
            out["nbytes"] += len(message.get("body", b""))

    anyio.run(app, scope, receive, send)
    return out["status"], hasher.digest(), out["nbytes"]


def test_a_batch_read_of_zstd_pages_holds_one_piece_decoded_not_the_read(tmp_path):
    store = make_store(tmp_path / "store")
    try:
        zeros = bytes(PAGE_NBYTES)
        digest = page_digest(zeros)
        store.put_pages({digest: zeros})
        assert len(stored_value(store, digest)) < 64 << 10  # stored compressed
        want = blake3.blake3(stream_header(COPIES))
        for _ in range(COPIES):
            want.update(frame_head(digest, PAGE_NBYTES))
            want.update(zeros)
        want.update(stream_end(COPIES, COPIES * PAGE_NBYTES))
        del zeros
        app = create_app(store=store, settings=Settings(data_dir=store.path))
        tracemalloc.start()
        try:
            status, got, nbytes = _post(app, "/v1/pages/get", {"digests": [digest.hex()] * COPIES})
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert status == 200 and nbytes > COPIES * PAGE_NBYTES
        assert got == want.digest()  # the exact stream, byte for byte
        # one 1 MiB piece, one 1 MiB body and the app's own allocations; 256 MiB before
        assert peak < 48 << 20, f"peak {peak / 2**20:.0f} MiB traced during the read"
    finally:
        store.close()


def test_streamed_pages_are_verified_before_anything_is_yielded(tmp_path):
    store = make_store(tmp_path / "store")
    try:
        zeros, other = bytes(4 << 20), b"\x01" * (4 << 20)
        dz, do = page_digest(zeros), page_digest(other)
        store.put_pages({dz: zeros, do: other})
        with open_streamed_pages(store, [dz, do]) as pages:
            assert all(isinstance(p, DeferredPage) for p in pages)
            assert [b"".join(p.pieces()) for p in pages] == [zeros, other]
        # a damaged page: refused before anything is yielded, by the store's own read
        # (which quarantines the page)
        # (the last byte's low bit, inside its segment record)
        value = stored_value(store, do)
        flip_bit(store.path, value, 8 * (len(value) - 1))
        with pytest.raises(IntegrityError):
            with open_streamed_pages(store, [dz, do]):
                raise AssertionError("yielded a damaged page")
        assert store.stats().quarantined_count == 1  # as get_pages does
    finally:
        store.close()
