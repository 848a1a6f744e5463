"""Hostile input: every request below is refused with the right status, nothing is
written, no file outside the store is touched, and the server stays up."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
import zstandard
from fastapi.testclient import TestClient

from api.app import create_app
from api.limits import BodyLimitMiddleware
from api.settings import Settings
from kvstore.ids import page_digest
from tests.api.conftest import ADMIN, USER_A

LIMIT = 64 << 10
BAD_DIGESTS = [
    "..", "%2e%2e", "..%2F..%2Fetc%2Fpasswd", "%2F" * 3, "ab" * 31 + "a", "ab" * 32 + "a",
    "AB" * 32, "g" * 64, "\u0430" * 64, "ab" * 31 + "a\u0301", "ab" * 32 + "%00",
    "%00" + "ab" * 32, "ab" * 32 + "%0a", " " + "ab" * 31 + "a",
    "\uff41" * 64,  # fullwidth 'a'
]
# httpx removes dot segments before sending; these go over a raw socket instead
RAW_PATHS = [b"/v1/pages/../../etc/passwd", b"/v1/formats/" + b"ab" * 32 + b"/..",
             b"/v1/pages/%2e%2e%2f%2e%2e%2fetc%2fpasswd", b"/v1/checkpoints/../../x",
             b"/v1/checkpoints/team-a/..%2f..%2fx", b"//v1/pages/" + b"ab" * 32]
BAD_NAMES = [".hidden", "...", "a/b", "a%2Fb", "a%00b", "-x", "x" * 129, "\u0430bc", "a b"]


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(str(path.relative_to(root)).encode())
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


@pytest.fixture
def guarded(tmp_path, store):
    """A limited app, plus a canary directory beside the store that must not change."""
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "passwd").write_text("root:x:0:0\n")
    settings = Settings(data_dir=store.path, max_page_nbytes=LIMIT, max_json_nbytes=LIMIT)
    client = TestClient(create_app(store=store, settings=settings))
    before = (tree_digest(canary), sorted(p.name for p in store.path.iterdir()))
    yield client
    assert (tree_digest(canary), sorted(p.name for p in store.path.iterdir())) == before
    stats = store.stats()
    assert (stats.page_count, stats.block_count, stats.checkpoint_count) == (0, 0, 0)
    assert client.get("/v1/health").status_code == 200


def test_traversal_and_look_alike_digests_are_refused(guarded):
    for bad in BAD_DIGESTS:
        for method, path in (("PUT", f"/v1/pages/{bad}"), ("GET", f"/v1/formats/{bad}")):
            r = guarded.request(method, path, content=b"x")
            assert r.status_code in (404, 405, 422), (bad, method, r.status_code)
            assert r.json()["code"] in ("not_found", "method_not_allowed", "validation_error")
        r = guarded.post("/v1/pages/missing", json={"digests": [bad]})
        assert r.status_code == 422, bad
        r = guarded.post("/v1/pages/get", json={"digests": [bad]})
        assert r.status_code == 422, bad


def test_bad_names_and_namespaces_are_refused(guarded):
    for bad in BAD_NAMES:
        for path in (f"/v1/checkpoints/{bad}/ok", f"/v1/checkpoints/ok/{bad}"):
            for method in ("GET", "DELETE"):
                r = guarded.request(method, path)
                assert r.status_code in (404, 405, 422), (bad, path, r.status_code)
        r = guarded.post("/v1/prefix/lookup", json={"format_id": "ab" * 32, "namespace": bad,
                                                    "tokens": [1]})
        assert r.status_code == 422, bad


def test_wrong_lengths_and_types_are_refused(guarded):
    cases = [
        {"format_id": "ab" * 32, "namespace": "n", "tokens": [-1]},
        {"format_id": "ab" * 32, "namespace": "n", "tokens": [2**32]},
        {"format_id": "ab" * 32, "namespace": "n", "tokens": ["1"]},
        {"format_id": "ab" * 32, "namespace": "n", "tokens": [1.5]},
        {"format_id": "ab" * 32, "namespace": "n", "tokens": [True]},
        {"format_id": "ab" * 32, "namespace": "n", "tokens": [1], "extra": 1},
    ]
    for body in cases:
        assert guarded.post("/v1/prefix/lookup", json=body).status_code == 422, body
    block = {"format_id": "ab" * 32, "namespace": "n", "parent": "00" * 32, "tokens": [],
             "pages": []}
    assert guarded.post("/v1/blocks/commit", json={"blocks": [block]}).status_code == 422
    r = guarded.post("/v1/pages/missing", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code in (400, 422)


def test_oversized_bodies_are_413(guarded):
    data = os.urandom(LIMIT + 1)
    r = guarded.put(f"/v1/pages/{page_digest(data).hex()}", content=data)
    assert r.status_code == 413 and r.json()["code"] == "payload_too_large"
    r = guarded.post("/v1/pages/missing", json={"digests": ["ab" * 32] * 2000})
    assert r.status_code == 413
    # a chunked upload (no Content-Length) is cut off while streaming
    r = guarded.put(f"/v1/pages/{page_digest(data).hex()}", content=iter([data[:LIMIT], data[LIMIT:]]))
    assert r.status_code == 413


def test_a_million_layer_manifest_is_refused_cheaply(guarded):
    body = b'{"model_id":"m","model_fingerprint":"f","block_size_tokens":4,"layers":[' + \
        b",".join([b"{}"] * 10**6) + b"]}"
    r = guarded.put("/v1/formats/" + "ab" * 32, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 413  # 3 MB against a 64 KiB limit
    big = TestClient(create_app(store=guarded.app.state.store, settings=Settings(
        data_dir=guarded.app.state.store.path)))
    r = big.put("/v1/formats/" + "ab" * 32, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["code"] == "validation_error"


def bomb(nbytes: int, declare_size: bool) -> bytes:
    """A zstd frame of `nbytes` zeros: a few KiB that decompress to nbytes."""
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=declare_size)
    cobj = cctx.compressobj(size=nbytes if declare_size else -1)
    zeros = bytes(1 << 20)
    parts = [cobj.compress(zeros) for _ in range(nbytes >> 20)]
    return b"".join(parts) + cobj.flush()


@pytest.mark.parametrize("declare_size", [True, False])
def test_zstd_bombs_are_413(guarded, declare_size):
    frame = bomb(256 << 20, declare_size)
    assert len(frame) < LIMIT
    r = guarded.put("/v1/pages/" + page_digest(bytes(256 << 20)).hex(), content=frame,
                    headers={"content-encoding": "zstd"})
    assert r.status_code == 413, r.text
    r = guarded.put("/v1/pages/" + "ab" * 32, content=b"not zstd at all",
                    headers={"content-encoding": "zstd"})
    assert r.status_code == 400
    r = guarded.put("/v1/pages/" + "ab" * 32, content=b"x", headers={"content-encoding": "gzip"})
    assert r.status_code == 415


async def _call(app, headers, chunks):
    """Drive an ASGI app directly, so a body can disagree with its Content-Length."""
    scope = {"type": "http", "method": "PUT", "path": "/v1/pages/x", "headers": headers,
             "state": {}}
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return start["status"], json.loads(b"".join(m.get("body", b"") for m in sent
                                                if m["type"] == "http.response.body"))


@pytest.mark.anyio
@pytest.mark.parametrize("declared,chunks,status", [
    (b"10", [b"x" * 5, b"x" * 20], 400),      # longer than declared
    (b"100", [b"x" * 10], 400),               # shorter than declared
    (b"10737418240", [b""], 413),             # 10 GiB declared, refused before reading
    (b"-5", [b""], 400),
    (b"1e3", [b""], 400),
])
async def test_content_length_that_lies_is_refused(declared, chunks, status):
    async def app(scope, receive, send):
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    limited = BodyLimitMiddleware(app, max_page_nbytes=1 << 20, max_json_nbytes=1 << 20)
    got, body = await _call(limited, [(b"content-length", declared)], chunks)
    assert got == status and body["code"] in ("bad_request", "payload_too_large")


@pytest.fixture
def anyio_backend():
    return "asyncio"


# -- against the real server --------------------------------------------------------
def raw_request(port: int, head: bytes, body: bytes = b"", *, close_after: bool = False) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head + body)
        if close_after:
            s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            try:
                data = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not data:
                break
            chunks.append(data)
            if b"\r\n\r\n" in b"".join(chunks) and not close_after:
                break
        return b"".join(chunks)


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_real_server_refuses_lies_and_bombs_with_bounded_memory(live_server):
    import httpx
    auth = f"Authorization: Bearer {USER_A}\r\n".encode()
    digest = "ab" * 32
    before_pages = httpx.get(live_server.url + "/v1/stats",
                             headers={"Authorization": f"Bearer {ADMIN}"}).json()["page_count"]
    reply = raw_request(live_server.port, b"PUT /v1/pages/" + digest.encode() + b" HTTP/1.1\r\n"
                        b"Host: x\r\n" + auth + b"Content-Length: 10737418240\r\n\r\n", b"x" * 1000)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    # declared 1000, sent 10, then the client gives up: nothing is stored
    raw_request(live_server.port, b"PUT /v1/pages/" + digest.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                + auth + b"Content-Length: 1000\r\n\r\n", b"y" * 10, close_after=True)
    # no token at all, 10 GiB declared
    reply = raw_request(live_server.port, b"PUT /v1/pages/" + digest.encode() + b" HTTP/1.1\r\n"
                        b"Host: x\r\nContent-Length: 10737418240\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    for path in RAW_PATHS:
        for method in (b"GET", b"PUT", b"DELETE"):
            reply = raw_request(live_server.port, method + b" " + path + b" HTTP/1.1\r\nHost: x\r\n"
                                + f"Authorization: Bearer {ADMIN}\r\n".encode()
                                + b"Content-Length: 3\r\n\r\n", b"abc")
            status = int(reply.split(b" ", 2)[1])
            assert status in (400, 404, 405, 422), (method, path, reply[:300])
    headers = {"Authorization": f"Bearer {USER_A}", "Content-Encoding": "zstd"}
    for declare in (True, False):
        frame = bomb(1 << 30, declare)
        r = httpx.put(f"{live_server.url}/v1/pages/{digest}", content=frame, headers=headers,
                      timeout=60)
        assert r.status_code == 413, r.text
    assert vm_hwm_kib(live_server.proc.pid) < 400 * 1024, "server memory was not bounded"
    after_pages = httpx.get(live_server.url + "/v1/stats",
                            headers={"Authorization": f"Bearer {ADMIN}"}).json()["page_count"]
    assert after_pages == before_pages
    assert live_server.alive()


def test_malformed_batch_uploads_are_refused_and_store_nothing(guarded):
    from kvstore.wire import (
        FRAME_HEAD,
        STREAM_END,
        encode_stream,
        frame_head,
        stream_end,
        stream_header,
    )
    a, b = os.urandom(1000), os.urandom(2000)
    good = encode_stream([(page_digest(a), a), (page_digest(b), b)])
    media = {"content-type": "application/vnd.kvstore.pages.v1"}
    head_a = frame_head(page_digest(a), len(a))
    cases = {
        "truncated": (good[:-1], 400),
        "trailing byte": (good + b"x", 400),
        "count says 3": (stream_header(3) + good[16:], 400),
        "count says 1": (stream_header(1) + good[16:], 400),
        "frame longer than body": (stream_header(1) + frame_head(page_digest(a), 10**9) + a
                                   + stream_end(1, 10**9), 400),
        "end total lies": (good[: -STREAM_END.size] + stream_end(2, 5), 400),
        "bad magic": (b"XXXX" + good[4:], 400),
        "empty": (b"", 400),
        "one digest wrong": (stream_header(2) + head_a + a + frame_head(page_digest(a), len(b)) + b
                             + stream_end(2, 3000), 422),
        "a million pages declared": (stream_header(10**6) + good[16:], 400),
        "over the byte limit": (encode_stream([(page_digest(x), x) for x in
                                               [os.urandom(40000), os.urandom(40000)]]), 413),
    }
    for label, (body, status) in cases.items():
        r = guarded.post("/v1/pages/put", content=body, headers=media)
        assert r.status_code == status, (label, r.status_code, r.text)
        assert isinstance(r.json()["code"], str)
    r = guarded.post("/v1/pages/put", content=good, headers={"content-type": "application/json"})
    assert r.status_code == 415
    assert FRAME_HEAD.size == 40
