"""A real uvicorn subprocess (`python -m tools.cli serve`) and separate client
processes: one saves through RemoteStore, others restore over HTTP and through the
same-host fast path; the bytes are identical to what was saved."""

from __future__ import annotations

import json
import subprocess
import sys

import blake3
import httpx
import pytest

from tests.api.conftest import ADMIN, REPO, USER_A, USER_B
from tests.api.workers import identity, prompt
from tests.kvstore.factories import expected_pages, plan_prefix


def run_worker(*args, timeout=120) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "tests.api.workers", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def expected_blake3(namespace: str, seed: int) -> str:
    records, _ = plan_prefix(identity(), namespace, prompt(seed))
    hasher = blake3.blake3()
    for page in expected_pages(identity(), records):
        hasher.update(page)
    return hasher.hexdigest()


def spawn_worker(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.api.workers", *map(str, args)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_one_process_saves_another_restores_byte_identical(live_server):
    saved = run_worker("save", live_server.url, USER_A, "team-a", 0, 2)
    assert [s["saved"] for s in saved] == [0, 1]
    want = expected_blake3("team-a", 1)
    over_http = run_worker("restore", live_server.url, USER_A, "team-a", 1, 2)
    assert [r["blake3"] for r in over_http] == [want, want]
    assert over_http[0]["matched"] == 1000 and over_http[0]["pages"] == 32
    fast = run_worker("restore", live_server.url, USER_A, "team-a", 1, 1, live_server.data_dir)
    assert fast[0]["blake3"] == want
    # another tenant, same prompt: nothing matches
    other = run_worker("restore", live_server.url, USER_B, "team-b", 1, 1)
    assert other[0]["matched"] == 0
    assert live_server.alive()


def test_fast_path_reads_while_the_server_writes_and_grows_its_map(live_server):
    """The server started with a 1 MiB map; the writer grows the store (at schema 2 its
    segment files: page bodies no longer fill the map) while a read-only fast-path
    reader in another process keeps restoring."""
    run_worker("save", live_server.url, USER_A, "team-a", 10, 1)
    before = httpx.get(live_server.url + "/v1/stats",
                       headers={"Authorization": f"Bearer {ADMIN}"}).json()["map_nbytes"]
    segments_before = len(list((live_server.data_dir / "segments").glob("*.seg")))
    writer = spawn_worker("save", live_server.url, USER_A, "team-a", 100, 6)
    reader = spawn_worker("restore", live_server.url, USER_A, "team-a", 10, 12, live_server.data_dir)
    w_out, w_err = writer.communicate(timeout=180)
    r_out, r_err = reader.communicate(timeout=180)
    assert writer.returncode == 0, w_err[-3000:]
    assert reader.returncode == 0, r_err[-3000:]
    want = expected_blake3("team-a", 10)
    results = [json.loads(line) for line in r_out.splitlines()]
    assert len(results) == 12 and {r["blake3"] for r in results} == {want}
    after = httpx.get(live_server.url + "/v1/stats",
                      headers={"Authorization": f"Bearer {ADMIN}"}).json()["map_nbytes"]
    segments_after = len(list((live_server.data_dir / "segments").glob("*.seg")))
    assert after > before or segments_after > segments_before, (
        "neither the map nor the segment files grew; the test did not exercise growth")
    check = httpx.post(live_server.url + "/v1/admin/check", json={"read_data": True},
                       headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120).json()
    assert check["ok"], check["problems"][:5]


def test_a_reader_that_goes_away_releases_its_read_slot(tmp_path):
    """With one read slot, a client that drops a batch read part-way must not block the
    next reader: the response releases the slot and the read transaction."""
    import socket

    from tests.api.conftest import LiveServer
    (tmp_path / "store").mkdir()
    server = LiveServer(tmp_path / "store", {"KVSTORE_MAX_CONCURRENT_READS": "1"})
    try:
        run_worker("save", server.url, "", "default", 3, 1)
        records, _ = plan_prefix(identity(), "default", prompt(3))
        digests = [d.hex() for r in records for d in r.pages]
        body = json.dumps({"digests": digests}).encode()
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                s.sendall(b"POST /v1/pages/get HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
            # the socket is closed with most of the 8 MiB stream unread
        want = expected_blake3("default", 3)
        assert run_worker("restore", server.url, "", "default", 3, 1, timeout=60)[0]["blake3"] == want
        assert server.alive()
    finally:
        server.stop()


def test_parallel_read_streams_fill_the_right_buffers(live_server, monkeypatch):
    import numpy as np

    from kvstore import client
    from kvstore.client import RemoteStore
    monkeypatch.setattr(client, "PARALLEL_MIN_NBYTES", 1 << 20)
    run_worker("save", live_server.url, USER_A, "team-a", 20, 1)
    records, _ = plan_prefix(identity(), "team-a", prompt(20))
    digests = [d for r in records for d in r.pages]
    want = expected_pages(identity(), records)
    with RemoteStore(live_server.url, USER_A, read_streams=3) as store:
        buffers = [np.empty(len(w), np.uint8) for w in want]
        assert store.read_pages_into(digests, buffers) == sum(map(len, want))
        assert [b.tobytes() for b in buffers] == want


def test_fast_path_lookups_are_local_and_replayed_to_the_server(live_server):
    from kvstore.client import AccessDenied, RemoteStore
    run_worker("save", live_server.url, USER_A, "team-a", 30, 1)
    fmt, tokens = identity(), prompt(30)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    before = httpx.get(live_server.url + "/v1/stats", headers=admin).json()["lookups"]
    with RemoteStore(live_server.url, USER_A) as remote:
        over_http = remote.lookup_prefix(fmt.format_id, "team-a", tokens)
    with RemoteStore(live_server.url, USER_A, local_dir=live_server.data_dir) as fast:
        local = fast.lookup_prefix(fmt.format_id, "team-a", tokens)
        assert local.tokens_matched == over_http.tokens_matched == 1000
        assert local.chain_keys == over_http.chain_keys
        # another namespace: refused at once, since the fast path first asks the server
        # for the namespace's chain salt (it used to answer locally, the replay refused)
        with pytest.raises(AccessDenied):
            fast.lookup_prefix(fmt.format_id, "team-b", tokens)
    assert fast.last_replay_error is None
    after = httpx.get(live_server.url + "/v1/stats", headers=admin).json()["lookups"]
    assert after == before + 2  # the HTTP lookup and the replayed one
