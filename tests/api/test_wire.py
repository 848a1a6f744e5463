"""The page stream codec (kvstore/wire.py) and the server's chunking of it.

(kvstore/wire.py is shared by api/ and kvstore.client; its tests live with the API
tests, whose owner wrote it.)"""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from api.streaming import CHUNK_NBYTES, PageStreamResponse
from kvstore.errors import InvalidInput, StoreIOError
from kvstore.ids import page_digest
from kvstore.wire import (
    PageStreamReader,
    frame_head,
    read_stream_into,
    stream_end,
    stream_header,
    stream_nbytes,
)


def encode(pages: list[bytes]) -> bytes:
    parts = [stream_header(len(pages))]
    for p in pages:
        parts += [frame_head(page_digest(p), len(p)), p]
    parts.append(stream_end(len(pages), sum(map(len, pages))))
    return b"".join(parts)


pages_strategy = st.lists(st.binary(max_size=300), max_size=8)


@settings(max_examples=200, deadline=None)
@given(pages=pages_strategy, cuts=st.lists(st.integers(1, 97), min_size=1, max_size=30))
def test_stream_round_trips_whatever_the_chunking(pages, cuts):
    blob = encode(pages)
    assert len(blob) == stream_nbytes([len(p) for p in pages])
    buffers = [bytearray(len(p)) for p in pages]
    reader = PageStreamReader([page_digest(p) for p in pages], buffers)
    at, i = 0, 0
    while at < len(blob):
        step = cuts[i % len(cuts)]
        reader.feed(blob[at : at + step])
        at, i = at + step, i + 1
    assert reader.finish() == sum(map(len, pages))
    assert [bytes(b) for b in buffers] == pages
    buffers2 = [bytearray(len(p)) for p in pages]
    source = io.BytesIO(blob)
    assert read_stream_into(source.readinto, [page_digest(p) for p in pages], buffers2) == \
        sum(map(len, pages))
    assert [bytes(b) for b in buffers2] == pages


@settings(max_examples=100, deadline=None)
@given(pages=pages_strategy.filter(bool), data=st.data())
def test_truncated_or_extended_streams_are_refused(pages, data):
    blob = encode(pages)
    cut = data.draw(st.integers(0, len(blob) - 1))
    digests = [page_digest(p) for p in pages]
    reader = PageStreamReader(digests, [bytearray(len(p)) for p in pages])
    reader.feed(blob[:cut])
    with pytest.raises(StoreIOError):
        reader.finish()
    reader = PageStreamReader(digests, [bytearray(len(p)) for p in pages])
    with pytest.raises(StoreIOError):
        reader.feed(blob + b"x")


def test_frames_must_match_what_was_asked():
    a, b = b"a" * 10, b"b" * 20
    with pytest.raises(StoreIOError):  # another order
        PageStreamReader([page_digest(b), page_digest(a)], [bytearray(20), bytearray(10)]).feed(encode([a, b]))
    with pytest.raises(InvalidInput):  # a buffer of the wrong size
        PageStreamReader([page_digest(a), page_digest(b)], [bytearray(10), bytearray(21)]).feed(encode([a, b]))
    with pytest.raises(StoreIOError):  # count differs
        PageStreamReader([page_digest(a)], [bytearray(10)]).feed(encode([a, b]))
    with pytest.raises(InvalidInput):
        PageStreamReader([page_digest(a)], [bytes(10)])  # read-only buffer


@pytest.mark.anyio
async def test_server_sends_bounded_chunks_and_exits_the_read_context():
    rng = np.random.default_rng(0)
    pages = [rng.bytes(n) for n in (3 * CHUNK_NBYTES + 5, 17, 0, CHUNK_NBYTES - 40)]
    exited, released, sent = [], [], []

    class Context:
        def __exit__(self, *exc):
            exited.append(exc)

    response = PageStreamResponse([page_digest(p) for p in pages], [memoryview(p) for p in pages],
                                  Context(), stream_nbytes([len(p) for p in pages]),
                                  lambda: released.append(1))

    async def send(message):
        sent.append(message)

    await response({"type": "http"}, None, send)
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert max(map(len, bodies)) == CHUNK_NBYTES and len(bodies[-1]) <= CHUNK_NBYTES
    assert b"".join(bodies) == encode(pages)
    headers = dict(sent[0]["headers"])
    assert int(headers[b"content-length"]) == len(encode(pages))
    assert exited == [(None, None, None)] and released == [1]


@pytest.fixture
def anyio_backend():
    return "asyncio"
