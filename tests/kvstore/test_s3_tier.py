"""The S3 page tier (kvstore/tier) against a real Ceph RADOS Gateway.

One single-node cluster (tools/ceph_dev.py) serves the whole test session; each test
gets its own bucket. Hosts are store directories: A publishes, B restores, through
one bucket. When the Ceph packages cannot be installed every test here is skipped
with the reason printed in the summary (pytest -ra) and as a warning, never silently.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings

import pytest

from kvstore.errors import IntegrityError, InvalidInput, NotFound, UnsupportedVersion
from kvstore.tier import RemoteIntegrityError, TierConfig, TieredStore
from kvstore.tier import layout as L
from kvstore.tier.bucket import Bucket
from kvstore.tier.gc import plan_remote_gc
from kvstore.tier.queue import read_backlog
from tests.kvstore.factories import (
    assert_check_clean,
    expected_pages,
    make_identity,
    make_store,
    plan_prefix,
    restore_prefix,
    save_prefix,
)

_bucket_names = (f"kvstore-test-{i}" for i in itertools.count())


@pytest.fixture(scope="session")
def ceph(tmp_path_factory):
    from tools.ceph_dev import CephCluster, PackagesUnavailable

    try:
        cluster = CephCluster.start(str(tmp_path_factory.mktemp("ceph")), log=lambda m: None)
    except PackagesUnavailable as exc:
        message = f"S3 TIER TESTS SKIPPED: Ceph packages unavailable: {exc}"
        warnings.warn(message, stacklevel=1)
        pytest.skip(message)
    yield cluster
    cluster.stop()
    assert not cluster.pids(), f"daemons left running: {cluster.pids()}"


@pytest.fixture
def tier(ceph):
    """A fresh bucket; returns a factory of TierConfig for it."""
    name = next(_bucket_names)

    def config(**overrides) -> TierConfig:
        fields = dict(bucket=name, endpoint_url=ceph.endpoint, access_key=ceph.access_key,
                      secret_key=ceph.secret_key, prefix="fleet", threads=8)
        fields.update(overrides)
        return TierConfig(**fields)
    bucket = Bucket(config())
    bucket.ensure_bucket()
    bucket.close()
    return config


@pytest.fixture
def hosts(tmp_path, tier):
    """host(name, **config) opens a TieredStore over <tmp>/<name>; all closed at the end."""
    opened = []

    def host(name: str, **overrides) -> TieredStore:
        start = overrides.pop("start_uploader", True)
        store = TieredStore(make_store(tmp_path / name), tier(**overrides), start_uploader=start)
        opened.append(store)
        return store
    yield host
    for store in opened:
        try:
            store.close()
        except Exception:  # already closed by the test
            pass


def tokens_for(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


def bucket_keys(config: TierConfig, kind: str) -> list[str]:
    bucket = Bucket(config)
    try:
        return [o.key for o in bucket.list(L.Layout(config.prefix).kind_prefix(kind))]
    finally:
        bucket.close()


def assert_records_complete(config: TierConfig) -> int:
    """Every block record visible in the bucket names pages that are all there, and
    every checkpoint names blocks that are all there. Returns the records seen."""
    bucket, layout = Bucket(config), L.Layout(config.prefix)
    try:
        pages = {o.key for o in bucket.list(layout.kind_prefix("pages"))}
        blocks = {o.key for o in bucket.list(layout.kind_prefix("blocks"))}
        for key in blocks:
            body = bucket.get(key)
            if body is None:
                continue
            chain = L.ChainKey.parse(key.rsplit("/", 1)[-1])
            record = L.decode_block(key, chain, body)
            gone = [d for d in record.pages if layout.page_key(d) not in pages
                    and bucket.head(layout.page_key(d)) is None]
            assert not gone, f"record {key} is visible but {len(gone)} of its pages are not"
        for info in bucket.list(layout.checkpoint_prefix(None)):
            ns, _, name = info.key[len(layout.checkpoint_prefix(None)):].partition("/")
            ckpt = L.decode_checkpoint(info.key, ns, name, bucket.get(info.key))
            for k in ckpt.chain_keys:
                assert layout.block_key(k) in blocks or bucket.head(layout.block_key(k)), \
                    f"checkpoint {ns}/{name} is visible but block {k.short} is not"
        return len(blocks)
    finally:
        bucket.close()


# -- publish on A, restore on B ----------------------------------------------------------------
def test_publish_on_a_restore_on_b_byte_identical(hosts, tier):
    ident = make_identity()
    a, b = hosts("a"), hosts("b")
    tokens = tokens_for(1, 42)  # 10 full blocks and a partial tail of 2
    saved = save_prefix(a, ident, "team", tokens, checkpoint="chat-1")
    assert a.drain(30), f"backlog did not drain: {a.stats().backlog_jobs} jobs"
    assert a.stats().remote_uploaded > 0

    matched, records = restore_prefix(b, ident, "team", tokens)
    assert matched == 42 and [r.key for r in records] == list(saved.chain_keys)
    # read-through: B's own store now answers without the bucket
    assert b.local.lookup_prefix(ident.format_id, "team", tokens).tokens_matched == 42
    assert b.stats().remote_fetched_pages == len({d for r in records for d in r.pages} - {None})
    # a longer prompt matches the full blocks (the stored tail is not its prefix)
    longer = tokens[:40] + [1, 2, 3, 4, 5]
    assert b.lookup_prefix(ident.format_id, "team", longer).tokens_matched == 40
    # the checkpoint travels too, and C restores it with nothing local
    c = hosts("c")
    ckpt = c.get_checkpoint("team", "chat-1")
    assert ckpt.tokens == tuple(tokens)
    blocks = c.get_blocks(ckpt.chain_keys)
    with c.get_pages([d for r in blocks for d in r.pages]) as views:
        assert [bytes(v) for v in views] == expected_pages(ident, blocks)
    assert [x.name for x in hosts("d").list_checkpoints("team")] == ["chat-1"]
    assert_check_clean(b.local, read_data=True)
    assert_check_clean(c.local, read_data=True)


def test_if_none_match_is_honoured_by_rgw(tier):
    """Pages are written once: RGW 16.2 answers 412 to a second PUT with If-None-Match: *."""
    bucket = Bucket(tier())
    try:
        assert bucket.put("fleet/pages/probe", [b"first"], if_none_match=True) is True
        assert bucket.put("fleet/pages/probe", [b"second"], if_none_match=True) is False
        assert bucket.get("fleet/pages/probe") == b"first"
        assert bucket.put_immutable("fleet/pages/probe", [b"third"], refresh_after_s=3600) == "exists"
        assert bucket.get("fleet/pages/probe") == b"first"
    finally:
        bucket.close()


def test_sync_mode_acknowledges_after_the_bucket(hosts):
    ident = make_identity()
    a, b = hosts("a", sync=True, start_uploader=False), hosts("b")
    tokens = tokens_for(2, 16)
    save_prefix(a, ident, "team", tokens, checkpoint="now")
    assert a.stats().backlog_jobs == 0  # no uploader thread ran: the saves themselves did
    assert b.lookup_prefix(ident.format_id, "team", tokens).tokens_matched == 16
    assert b.get_checkpoint("team", "now").tokens == tuple(tokens)


def test_cross_namespace_lookup_through_the_bucket_finds_nothing(hosts):
    ident = make_identity()
    a, b = hosts("a"), hosts("b")
    tokens = tokens_for(3, 24)
    save_prefix(a, ident, "tenant-a", tokens, checkpoint="secret")
    assert a.drain(30)
    assert b.lookup_prefix(ident.format_id, "tenant-b", tokens).tokens_matched == 0
    assert b.lookup_prefix(ident.format_id, "tenant-a", tokens[:8] + [9, 9, 9, 9]).tokens_matched == 8
    with pytest.raises(NotFound):
        b.get_checkpoint("tenant-b", "secret")
    assert b.list_checkpoints("tenant-b") == []
    # another format identity under the same namespace and tokens: no match either
    other = make_identity(model_fingerprint="e" * 64)
    b.put_format(other)
    assert b.lookup_prefix(other.format_id, "tenant-a", tokens).tokens_matched == 0


def test_checkpoint_replace_and_delete_reach_the_bucket_in_order(hosts, tier):
    ident = make_identity()
    a = hosts("a")
    first, second = tokens_for(13, 8), tokens_for(14, 12)
    save_prefix(a, ident, "team", first, checkpoint="latest")
    save_prefix(a, ident, "team", second, checkpoint="latest")  # replaced: the last one wins
    assert a.drain(30)
    assert hosts("b").get_checkpoint("team", "latest").tokens == tuple(second)
    a.delete_checkpoint("team", "latest")
    assert a.drain(30)
    assert bucket_keys(tier(), "checkpoints") == []
    c = hosts("c")
    with pytest.raises(NotFound):
        c.get_checkpoint("team", "latest")
    assert c.list_checkpoints("team") == []
    with pytest.raises(NotFound):
        a.delete_checkpoint("team", "latest")  # gone everywhere


# -- the backlog is persistent ----------------------------------------------------------------
def test_backlog_survives_a_restart_of_a(hosts, tier, tmp_path):
    ident = make_identity()
    a = hosts("a", start_uploader=False)  # a host that dies before uploading anything
    tokens = tokens_for(4, 32)
    save_prefix(a, ident, "team", tokens, checkpoint="later")
    backlog = a.stats()
    assert backlog.backlog_jobs > 0 and backlog.backlog_pages > 0 and backlog.backlog_checkpoints == 1
    a.close()
    assert read_backlog(tmp_path / "a").jobs == backlog.backlog_jobs
    assert bucket_keys(tier(), "blocks") == []

    a = hosts("a")  # restarted: the uploader resumes the queue
    assert a.drain(30)
    assert read_backlog(tmp_path / "a").jobs == 0
    b = hosts("b")
    matched, _ = restore_prefix(b, ident, "team", tokens)
    assert matched == 32
    assert b.get_checkpoint("team", "later").tokens == tuple(tokens)


def test_backlog_cap_keeps_saves_local_and_records_consistent(hosts, tier):
    ident = make_identity()
    a = hosts("a", backlog_max_nbytes=2048, start_uploader=False)
    save_prefix(a, ident, "team", tokens_for(5, 64))
    stats = a.stats()
    assert stats.remote_refused_nbytes > 0 and stats.backlog_nbytes <= 2048
    a.uploader.start()
    assert a.drain(30)
    assert assert_records_complete(tier()) >= 0
    assert restore_prefix(a, ident, "team", tokens_for(5, 64))[0] == 64  # local is whole


# -- RGW killed mid-upload ---------------------------------------------------------------------
def test_rgw_killed_mid_upload_retries_complete_and_records_never_precede_pages(ceph, hosts, tier):
    ident = make_identity(layers=(*(make_identity().layers[:1] * 8),))  # 8 paged layers
    a = hosts("a")
    prompts = [tokens_for(100 + i, 40) for i in range(6)]
    seen_violations = []
    stop = threading.Event()

    def watch():  # a remote reader, all along: no record may be visible before its pages
        while not stop.is_set():
            try:
                assert_records_complete(tier())
            except AssertionError as exc:
                seen_violations.append(str(exc))
            except Exception:
                pass  # the gateway is down: nothing is visible
            time.sleep(0.05)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i, tokens in enumerate(prompts):
            save_prefix(a, ident, "team", tokens, checkpoint=f"p{i}")
            if i == 2:
                time.sleep(0.1)  # some of it uploaded, the rest queued
                ceph.stop_rgw()
        time.sleep(2.0)
        down = a.stats()
        assert down.backlog_jobs > 0, "the kill should have left work queued"
        # a host that misses locally while the bucket is down gets a miss, not an error
        started = time.monotonic()
        probe = hosts("probe")
        assert probe.lookup_prefix(ident.format_id, "team", prompts[0]).tokens_matched == 0
        assert probe.lookup_prefix(ident.format_id, "team", prompts[1]).tokens_matched == 0
        assert time.monotonic() - started < 15
        assert probe.stats().remote_lookups_unavailable == 1  # the second skipped the bucket
        ceph.start_rgw()
        assert a.drain(90), f"backlog stuck after restart: {a.stats().backlog_jobs} jobs"
    finally:
        if not ceph.pids().get("rgw"):
            ceph.start_rgw()
        stop.set()
        watcher.join()
    assert not seen_violations, seen_violations[:3]
    assert a.stats().remote_upload_failures > 0
    b = hosts("b")
    for i, tokens in enumerate(prompts):
        assert restore_prefix(b, ident, "team", tokens)[0] == 40
        assert b.get_checkpoint("team", f"p{i}").tokens == tuple(tokens)


# -- corruption in the bucket ------------------------------------------------------------------
def test_corrupt_object_is_refused_with_a_typed_error_and_never_served(hosts, tier):
    ident = make_identity()
    a, b = hosts("a"), hosts("b")
    tokens = tokens_for(6, 12)
    saved = save_prefix(a, ident, "team", tokens)
    assert a.drain(30)
    config, layout = tier(), L.Layout("fleet")
    bucket = Bucket(config)
    victim = saved.records[1].pages[0]
    body = bytearray(bucket.get(layout.page_key(victim)))
    body[L.HEAD_NBYTES + 5] ^= 0x10
    bucket.put(layout.page_key(victim), [bytes(body)])

    for _ in range(2):  # refused every time, never cached
        with pytest.raises(RemoteIntegrityError) as info:
            b.lookup_prefix(ident.format_id, "team", tokens)
        assert isinstance(info.value, IntegrityError) and victim.hex() in str(info.value)
        assert b.local.missing([victim]) == [victim]
        with pytest.raises(RemoteIntegrityError):
            b.read_pages([victim])
    assert b.stats().remote_integrity_errors >= 3

    # a record that does not derive its own name, and an envelope from the future
    record_key = layout.block_key(saved.records[0].key)
    raw = bytearray(bucket.get(record_key))
    raw[-1] ^= 1
    bucket.put(record_key, [bytes(raw)])
    c = hosts("c")
    with pytest.raises(RemoteIntegrityError):
        c.lookup_prefix(ident.format_id, "team", tokens)
    newer = bytearray(bucket.get(layout.format_key(ident.format_id)))
    newer[8:10] = (L.OBJECT_SCHEMA_VERSION + 1).to_bytes(2, "big")
    bucket.put(layout.format_key(ident.format_id), [bytes(newer)])
    with pytest.raises(UnsupportedVersion):
        hosts("d").get_format(ident.format_id)
    bucket.close()


# -- remote GC ---------------------------------------------------------------------------------
GRACE_S = 4.0
REFRESH_S = 2.0  # writers re-PUT what they depend on past this age: grace >= 2 x refresh


def test_remote_gc_deletes_old_unreferenced_and_nothing_referenced_or_young(hosts, tier):
    ident = make_identity()
    a = hosts("a", refresh_after_s=REFRESH_S)
    pinned = save_prefix(a, ident, "team", tokens_for(7, 20), checkpoint="keep")
    loose = save_prefix(a, ident, "team", tokens_for(8, 20))  # blocks only: expire with age
    _, stray = plan_prefix(ident, "team", tokens_for(9, 8))    # pages nobody references
    a.put_pages(stray)
    assert a.drain(30)
    config = tier()
    time.sleep(GRACE_S + 1.5)
    young = save_prefix(a, ident, "team", tokens_for(10, 20))   # younger than the grace
    assert a.drain(30)

    bucket = Bucket(config)
    try:
        plan = plan_remote_gc(bucket, L.Layout("fleet"), GRACE_S)
        summary = plan.summary()
        pinned_pages = {d for r in pinned.records for d in r.pages}
        loose_only = {d for r in loose.records for d in r.pages} - pinned_pages
        assert summary["unreferenced_blocks"] == len(loose.records)
        assert summary["unreferenced_pages"] == len(loose_only | (set(stray) - pinned_pages))
        before = set(bucket_keys(config, "pages"))
        # a dry run (the plan alone) deletes nothing
        assert set(bucket_keys(config, "pages")) == before

        # A keeps publishing while the sweep runs
        stop, published = threading.Event(), []

        def publish():
            for i in itertools.count():
                if stop.is_set():
                    return
                published.append(save_prefix(a, ident, "team", tokens_for(200 + i, 12),
                                             checkpoint=f"live-{i}" if i % 2 else None))
        writer = threading.Thread(target=publish)
        writer.start()
        try:
            deleted = plan.execute()
        finally:
            stop.set()
            writer.join()
        assert deleted["blocks"] == len(loose.records)
        assert a.drain(30)
    finally:
        bucket.close()

    pages_after = set(bucket_keys(config, "pages"))
    layout = L.Layout("fleet")
    assert not {layout.page_key(d) for d in loose_only} & pages_after
    assert {layout.page_key(d) for r in pinned.records + young.records for d in r.pages} <= pages_after
    assert_records_complete(config)
    b = hosts("b")
    assert restore_prefix(b, ident, "team", tokens_for(7, 20))[0] == 20
    assert restore_prefix(b, ident, "team", tokens_for(10, 20))[0] == 20
    for saved in published:
        assert restore_prefix(b, ident, "team", saved.tokens)[0] == len(saved.tokens)
    assert b.lookup_prefix(ident.format_id, "team", tokens_for(8, 20)).tokens_matched == 0
    assert published, "the writer published nothing during the GC"


def test_remote_gc_while_uploading_refreshes_old_dependencies(hosts, tier):
    """A writer that dedups against an old page re-PUTs it, so a sweep planned before
    cannot take it from under the new record."""
    ident = make_identity()
    a = hosts("a", refresh_after_s=REFRESH_S)
    base = tokens_for(11, 8)
    save_prefix(a, ident, "team", base)
    assert a.drain(30)
    time.sleep(GRACE_S + 1.5)
    bucket = Bucket(tier())
    try:
        plan = plan_remote_gc(bucket, L.Layout("fleet"), GRACE_S)
        assert plan.summary()["unreferenced_blocks"] == 2, plan.summary()
        # B (fresh, nothing confirmed) now builds on the old prefix, before the sweep
        b = hosts("b", refresh_after_s=REFRESH_S)
        assert b.lookup_prefix(ident.format_id, "team", base).tokens_matched == 8
        b.create_checkpoint(L.Checkpoint("on-top", "team", ident.format_id, tuple(base),
                                         tuple(r.key for r in b.get_blocks(
                                             [r.key for r in plan_prefix(ident, "team", base)[0]]))))
        assert b.drain(30)
        deleted = plan.execute()
        assert deleted["blocks"] == 0 and deleted["pages"] == 0, (deleted, b.uploader.counters)
    finally:
        bucket.close()
    assert_records_complete(tier())
    assert restore_prefix(hosts("c"), ident, "team", base)[0] == 8


# -- the layout's golden vectors (no cluster needed) -------------------------------------------
def test_envelope_golden_vectors():
    """docs/format.md section 9 gives these bytes; another implementation must match."""
    import blake3

    from kvstore.ids import ROOT_KEY, PageDigest
    from kvstore.records import BlockRecord

    empty = PageDigest(blake3.blake3(b"").digest())
    record = BlockRecord(bytes(range(32)), "default", ROOT_KEY, (1, 2, 3, 4), (empty,), 1000, 2000)
    layout = L.Layout("fleet")
    assert layout.block_key(record.key) == \
        "fleet/blocks/a61d3aa6717d63271703d9987a4833f7edd6fdb12e3659f769c06d4983937f31"
    head, payload = L.envelope("blocks", L.block_payload(record))
    assert head.hex() == "4d4c584b5653330000014200000000005857c47e78c71a6ef51abe9ad86c1391"
    assert len(payload) == 149 and L.decode_block("k", record.key, head + payload) == record.with_times(0, 0)
    page_head, _ = L.envelope("pages", b"")
    assert page_head.hex() == "4d4c584b56533300000150000000000000000000000000000000000000000000"
    assert bytes(L.decode_page("k", empty, page_head)) == b""
    with pytest.raises(RemoteIntegrityError):
        L.decode_block("k", record.key, head + payload[:-1] + bytes([payload[-1] ^ 1]))
    with pytest.raises(RemoteIntegrityError):
        L.decode_page("k", empty, page_head + b"x")
    with pytest.raises(UnsupportedVersion):
        L.decode_page("k", empty, page_head[:8] + b"\x00\x02" + page_head[10:])
    for bad in ("a//b", "../a", "a/./b"):
        with pytest.raises(InvalidInput):
            L.Layout(bad)
    assert L.Layout("/fleet/").prefix == "fleet"


# -- the same through the HTTP service on both hosts, and the CLI ------------------------------
def test_two_services_share_prefixes_through_the_bucket(ceph, tier, tmp_path):
    import os
    import subprocess
    import sys

    import httpx

    from kvstore.client import RemoteStore
    from tests.api.conftest import REPO, LiveServer

    config = tier()
    env = {"KVSTORE_S3_BUCKET": config.bucket, "KVSTORE_S3_ENDPOINT": ceph.endpoint,
           "KVSTORE_S3_PREFIX": config.prefix, "KVSTORE_S3_ACCESS_KEY": ceph.access_key,
           "KVSTORE_S3_SECRET_KEY": ceph.secret_key}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    server_a, server_b = LiveServer(tmp_path / "a" / "store", env), LiveServer(tmp_path / "b" / "store", env)
    try:
        ident = make_identity()
        tokens = tokens_for(12, 30)
        with RemoteStore(server_a.url) as a:
            saved = save_prefix(a, ident, "team", tokens, checkpoint="over-http")
            deadline = time.monotonic() + 30
            while httpx.get(server_a.url + "/v1/stats").json()["backlog_jobs"]:
                assert time.monotonic() < deadline, "A's backlog did not drain"
                time.sleep(0.1)
        metrics = httpx.get(server_a.url + "/metrics").text
        assert "kvstore_store_backlog_jobs 0" in metrics and "kvstore_store_remote_uploaded " in metrics
        with RemoteStore(server_b.url) as b:
            matched, records = restore_prefix(b, ident, "team", tokens)
            assert matched == 30 and [r.key for r in records] == list(saved.chain_keys)
            assert b.get_checkpoint("team", "over-http").tokens == tuple(tokens)
        assert httpx.get(server_b.url + "/v1/stats").json()["remote_fetched_pages"] > 0
    finally:
        server_a.stop()
        server_b.stop()

    cli_env = {**os.environ, **env, "PYTHONPATH": str(REPO)}
    stats = subprocess.run([sys.executable, "-m", "tools.cli", "stats", "--data-dir",
                            str(tmp_path / "a" / "store")], cwd=REPO, env=cli_env,
                           capture_output=True, text=True, timeout=60)
    assert stats.returncode == 0 and "s3 backlog  0 uploads queued" in stats.stdout, stats.stdout + stats.stderr
    gc = subprocess.run([sys.executable, "-m", "tools.cli", "gc", "--remote", "--dry-run",
                         "--grace", "0", "--json"], cwd=REPO, env=cli_env, capture_output=True,
                        text=True, timeout=60)
    assert gc.returncode == 0, gc.stderr
    import json

    doc = json.loads(gc.stdout)
    assert doc["dry_run"] and doc["deleted"] is None and doc["plan"]["checkpoints"] == 1
    assert doc["plan"]["unreferenced_pages"] == 0  # everything is pinned by the checkpoint
    assert len(bucket_keys(config, "pages")) == len({d for r in saved.records for d in r.pages})


def test_tiered_store_has_the_store_method_set():
    """The engine, the service and the CLI take a TieredStore wherever they take a Store."""
    from kvstore.store import Store

    public = {n for n in dir(Store) if not n.startswith("_") and callable(getattr(Store, n))}
    missing = sorted(n for n in public - {"open"} if not hasattr(TieredStore, n))
    assert not missing, f"TieredStore lacks {missing}"
