"""8. Hostile HTTP input against a live service (uvicorn subprocess, tokens on):
10 GiB declared lengths, lying lengths, an over-limit chunked body, zstd bombs,
10^6-layer and 10^6-deep manifests, traversal / NUL / look-alike digests, symlinks
planted in the store directory, missing and wrong tokens on every route, user tokens
on admin routes, and tenants probing another namespace. Every request is refused with
the right status (100%), the server's peak RSS stays bounded, nothing is written, and
no file outside the store root is touched (a canary directory is hashed before and
after). The server stays up throughout."""

from __future__ import annotations

import socket

import httpx
import pytest
import zstandard

from kvstore.client import RemoteStore
from kvstore.errors import StoreIOError
from kvstore.ids import page_digest
from kvstore.store import Store
from tests.api.conftest import ADMIN, USER_A, USER_B, write_tokens_file
from tests.kvstore.factories import make_identity, save_prefix
from tests.reliability.common import KillableServer, metric, read_status, tree_digest

MAX_PAGE = 1 << 20
MAX_JSON = 4 << 20
RSS_BOUND_MIB = 256
IDENTITY = make_identity()
BAD_DIGESTS = [
    "..", "%2e%2e", "..%2F..%2Fetc%2Fpasswd", "%2F" * 3, "ab" * 31 + "a", "ab" * 32 + "a",
    "AB" * 32, "g" * 64, "\u0430" * 64, "ab" * 31 + "a\u0301", "ab" * 32 + "%00",
    "%00" + "ab" * 32, "ab" * 32 + "%0a", " " + "ab" * 31 + "a", "\uff41" * 64,
    "\u0661" * 64,  # Arabic-Indic digit one: a \\d look-alike
]
RAW_PATHS = [b"/v1/pages/../../etc/passwd", b"/v1/pages/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
             b"/v1/checkpoints/../../x", b"/v1/checkpoints/team-a/..%2f..%2fx",
             b"//v1/pages/" + b"ab" * 32, b"/v1/pages/" + b"ab" * 32 + b"%00"]


class Tally:
    def __init__(self):
        self.cases = self.refused_right = 0
        self.wrong: list = []

    def expect(self, name: str, status, allowed) -> None:
        self.cases += 1
        if status in allowed:
            self.refused_right += 1
        else:
            self.wrong.append((name, status, sorted(allowed, key=str)))


def _raw(port: int, request: bytes, body_parts=(), shut: bool = False, timeout=10.0):
    """Send bytes on a fresh socket; returns the status of the first response or None."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        for part in body_parts:
            s.sendall(part)
        if shut:
            s.shutdown(socket.SHUT_WR)
        try:
            return read_status(s)  # None: closed without a response, nothing was acted on
        except TimeoutError:
            return "timeout"


def _head(method: str, path: str, token: str, extra: str = "") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"{extra}\r\n").encode()


@pytest.fixture
def live(tmp_path):
    store_dir = tmp_path / "root" / "store"
    store_dir.mkdir(parents=True)
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "passwd").write_text("root:x:0:0\n")
    (canary / "data.mdb").write_bytes(b"not yours")
    server = KillableServer(store_dir, tmp_path / "server.log", {
        "KVSTORE_TOKENS_FILE": str(write_tokens_file(tmp_path)),
        "KVSTORE_MAX_PAGE_NBYTES": str(MAX_PAGE), "KVSTORE_MAX_JSON_NBYTES": str(MAX_JSON),
        "KVSTORE_MAP_NBYTES": str(1 << 20)})
    server.start()
    yield server, canary
    server.sigkill()


def test_hostile_http_input(live):
    server, canary = live
    url, port = server.url, server.port
    before = tree_digest(canary)
    t = Tally()
    a = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {USER_A}"}, timeout=60)
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    # tenant B's data, which tenant A will probe
    with RemoteStore(url, USER_B) as b:
        saved_b = save_prefix(b, IDENTITY, "team-b", list(range(40)), checkpoint="secret")
    rss_start = server.rss_kib()
    pages_before = admin.get("/v1/stats").json()["page_count"]

    # -- lengths ---------------------------------------------------------------------------
    digest = page_digest(b"x" * 100).hex()
    t.expect("10GiB page", _raw(port, _head("PUT", f"/v1/pages/{digest}", USER_A,
             "Content-Type: application/octet-stream\r\nContent-Length: 10737418240\r\n")), {413})
    t.expect("10GiB json", _raw(port, _head("POST", "/v1/pages/missing", USER_A,
             "Content-Type: application/json\r\nContent-Length: 10737418240\r\n")), {413})
    t.expect("20-digit length", _raw(port, _head("POST", "/v1/pages/missing", USER_A,
             "Content-Length: 99999999999999999999\r\n")), {400, 413})
    t.expect("length lies long", _raw(port, _head("PUT", f"/v1/pages/{digest}", USER_A,
             "Content-Type: application/octet-stream\r\nContent-Length: 1000\r\n"),
             [b"x" * 100], shut=True), {400, None})
    t.expect("length lies short", _raw(port, _head("PUT", f"/v1/pages/{digest}", USER_A,
             "Content-Type: application/octet-stream\r\nContent-Length: 10\r\n"),
             [b"x" * 100]), {400, 422})
    t.expect("chunked over limit", _raw(port, _head("PUT", f"/v1/pages/{digest}", USER_A,
             "Content-Type: application/octet-stream\r\nTransfer-Encoding: chunked\r\n"),
             [b"%x\r\n" % (256 << 10) + b"y" * (256 << 10) + b"\r\n"] * 8 + [b"0\r\n\r\n"]), {413})
    # -- zstd bombs ----------------------------------------------------------------------------
    zeros = bytes(64 << 20)
    for declared in (True, False):
        frame = zstandard.ZstdCompressor(level=3, write_content_size=declared).compress(zeros)
        r = a.put(f"/v1/pages/{page_digest(zeros).hex()}", content=frame,
                  headers={"Content-Type": "application/octet-stream", "Content-Encoding": "zstd"})
        t.expect(f"zstd bomb declared={declared}", r.status_code, {413})
    many = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(512 << 10)) * 16
    r = a.put(f"/v1/pages/{page_digest(bytes(8 << 20)).hex()}", content=many,
              headers={"Content-Type": "application/octet-stream", "Content-Encoding": "zstd"})
    t.expect("zstd multi-frame bomb", r.status_code, {413})
    # -- huge manifests ------------------------------------------------------------------------
    layers = b'{"model_id":"m","model_fingerprint":"f","block_size_tokens":4,"layers":[' + \
        b",".join([b"{}"] * 1_000_000) + b"]}"
    r = admin.put(f"/v1/formats/{'ab' * 32}", content=layers,
                  headers={"Content-Type": "application/json"})
    t.expect("1e6-layer manifest", r.status_code, {413, 422})
    deep = b'{"model_id":"m","model_fingerprint":"f","block_size_tokens":4,"layers":' + \
        b"[" * 1_000_000 + b"]" * 1_000_000 + b"}"
    r = admin.put(f"/v1/formats/{'ab' * 32}", content=deep[: MAX_JSON - 1] if len(deep) >= MAX_JSON
                  else deep, headers={"Content-Type": "application/json"})
    t.expect("1e6-deep manifest", r.status_code, {400, 413, 422})
    deep_small = b'{"digests":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = a.post("/v1/pages/missing", content=deep_small, headers={"Content-Type": "application/json"})
    t.expect("1e5-deep json", r.status_code, {400, 422})
    ckpt = {"name": "huge", "namespace": "team-a", "format_id": IDENTITY.format_id.hex(),
            "tokens": list(range(300_000)), "chain_keys": ["ab" * 32] * 20_000}
    r = a.post("/v1/checkpoints", json=ckpt)
    t.expect("huge checkpoint", r.status_code, {400, 404, 409, 413, 422})
    # -- digests and paths ----------------------------------------------------------------------
    for bad in BAD_DIGESTS:
        r = a.put(f"/v1/pages/{bad}", content=b"x" * 100,
                  headers={"Content-Type": "application/octet-stream"})
        t.expect(f"put digest {bad!r}", r.status_code, {404, 405, 422})
        r = a.post("/v1/pages/missing", json={"digests": [bad]})
        t.expect(f"missing digest {bad!r}", r.status_code, {422})
        r = a.post("/v1/pages/get", json={"digests": [bad]})
        t.expect(f"get digest {bad!r}", r.status_code, {422})
    for path in RAW_PATHS:
        t.expect(f"raw path {path!r}", _raw(port, _head("GET", path.decode(), USER_A)),
                 {400, 403, 404, 405, 422})
    # -- tokens ------------------------------------------------------------------------------
    spec = admin.get("/openapi.json").json()
    routes = [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]
    for method, path in routes:
        concrete = path.replace("{digest}", "ab" * 32).replace("{format_id}", "ab" * 32) \
            .replace("{namespace}", "team-a").replace("{name}", "x")
        for label, headers in (("no token", {}), ("wrong token", {"Authorization": "Bearer " + "z" * 24}),
                               ("not bearer", {"Authorization": f"Basic {USER_A}"})):
            r = httpx.request(method, url + concrete, headers=headers, timeout=30)
            t.expect(f"{label} {method} {path}", r.status_code, {200} if path == "/v1/health" else {401})
    for method, path in routes:
        if "/admin/" in path or method == "DELETE":
            concrete = path.replace("{namespace}", "team-a").replace("{name}", "x")
            body = {"grace_s": 0.0, "dry_run": False} if path.endswith("/gc") else \
                {"to_nbytes": 0} if path.endswith("/evict") else {"read_data": False}
            r = a.request(method, concrete, json=body if method == "POST" else None)
            t.expect(f"user on admin {method} {path}", r.status_code, {403})
    # -- tenants probing another namespace -----------------------------------------------------
    key_b = saved_b.chain_keys[0].hex()
    probes = [
        ("lookup other ns", a.post("/v1/prefix/lookup", json={"format_id": IDENTITY.format_id.hex(),
         "namespace": "team-b", "tokens": list(range(40))}), {403}),
        ("get other checkpoint", a.get("/v1/checkpoints/team-b/secret"), {403}),
        ("list other ns", a.get("/v1/checkpoints", params={"namespace": "team-b"}), {403}),
        ("get other block", a.post("/v1/blocks/get", json={"keys": [key_b]}), {404}),
        ("has other block", a.post("/v1/blocks/has", json={"keys": [key_b]}), {200}),
        ("commit into other ns", a.post("/v1/blocks/commit", json={"blocks": [{
            "format_id": IDENTITY.format_id.hex(), "namespace": "team-b", "parent": "00" * 32,
            "tokens": [1, 2, 3, 4], "pages": []}]}), {403}),
        ("checkpoint in other ns", a.post("/v1/checkpoints", json={**ckpt, "namespace": "team-b",
         "tokens": [1], "chain_keys": []}), {403}),
        ("delete other checkpoint", a.delete("/v1/checkpoints/team-b/secret"), {403}),
    ]
    for name, r, allowed in probes:
        t.expect(name, r.status_code, allowed)
    has = a.post("/v1/blocks/has", json={"keys": [key_b]}).json()["present"]
    t.expect("has other block reads absent", has == [False], {True})
    same_tokens = a.post("/v1/prefix/lookup", json={"format_id": IDENTITY.format_id.hex(),
                         "namespace": "team-a", "tokens": list(range(40))}).json()["tokens_matched"]
    t.expect("other tenant's tokens never match in mine", same_tokens, {0})

    # -- the aftermath ---------------------------------------------------------------------
    assert httpx.get(url + "/v1/health").status_code == 200 and server.proc.poll() is None
    rss_peak, rss_end = server.rss_kib("VmHWM"), server.rss_kib()
    stats = admin.get("/v1/stats").json()
    assert admin.post("/v1/admin/check", json={"read_data": True}).json()["ok"]
    after = tree_digest(canary)
    metric("hostile_http", cases=t.cases, refused_with_right_status=t.refused_right,
           refused_pct=round(100 * t.refused_right / t.cases, 1), wrong=len(t.wrong),
           rss_start_mib=rss_start >> 10, rss_peak_mib=rss_peak >> 10, rss_end_mib=rss_end >> 10,
           pages_written=stats["page_count"] - pages_before, canary_changed=int(before != after))
    assert not t.wrong, t.wrong[:10]
    assert stats["page_count"] == pages_before
    assert (rss_peak - rss_start) >> 10 < RSS_BOUND_MIB, (rss_start, rss_peak)
    assert before == after


def test_symlinks_planted_in_the_store_directory(live, tmp_path):
    server, canary = live
    store_dir = server.data_dir
    before = tree_digest(canary)
    admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN}"})
    # the GC lock: to an existing file outside, and to one that does not exist yet
    outcomes = []
    for target in (canary / "passwd", canary / "created-by-gc"):
        lock = store_dir / "gc.lock"
        if lock.exists() or lock.is_symlink():
            lock.unlink()
        lock.symlink_to(target)
        r = admin.post("/v1/admin/gc", json={"grace_s": 0.0, "dry_run": False})
        outcomes.append(r.status_code)
        assert r.status_code == 500 and r.json()["code"] == "io_error", r.text
        lock.unlink()
    assert admin.post("/v1/admin/gc", json={"grace_s": 0.0, "dry_run": False}).status_code == 200
    server.sigkill()
    # the LMDB files themselves: a store whose data.mdb or lock.mdb is a symlink is refused
    refused = []
    for name in ("data.mdb", "lock.mdb"):
        path = store_dir / name
        saved = path.read_bytes()
        path.unlink()
        path.symlink_to(canary / name)
        with pytest.raises(StoreIOError):
            Store(store_dir)
        refused.append(name)
        path.unlink()
        path.write_bytes(saved)
    with Store(store_dir) as store:
        assert store.check().ok
    after = tree_digest(canary)
    metric("planted_symlinks", gc_lock_refused=len(outcomes), lmdb_files_refused=len(refused),
           canary_changed=int(before != after))
    assert before == after
