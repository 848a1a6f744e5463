"""A damaged page read through RemoteStore, over HTTP and through local_dir (issue 17,
defects 2 and 3 from a client's side): IntegrityError once, then shorter prefixes;
has_blocks agrees with the server; publishing again heals the page. The server is a
real `kvstore serve` subprocess, since local_dir opens the server's directory, and one
process cannot open an LMDB environment twice."""

from __future__ import annotations

import time

import httpx
import pytest

from kvstore.client import RemoteStore
from kvstore.errors import IntegrityError
from kvstore.pages import HEADER_NBYTES
from tests.api.conftest import LiveServer
from tests.kvstore.factories import (
    flip_bit,
    make_identity,
    make_store,
    restore_prefix,
    save_prefix,
    stored_value,
)

IDENTITY = make_identity()
TOKENS = list(range(500, 524))  # six full blocks of 4 tokens
DAMAGED_BLOCK = 3


def _damaged_store(path):
    with make_store(path) as store:
        saved = save_prefix(store, IDENTITY, "default", TOKENS)
        victim = saved.records[DAMAGED_BLOCK].pages[1]
        value = stored_value(store, victim)
    flip_bit(path, value, HEADER_NBYTES * 8 + 9)
    return saved


def _metric(url: str, name: str) -> int | None:
    """The value of an unlabelled metric on the server's /metrics, or None."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    return None


def _wait_for_metric(url: str, name: str, value: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := _metric(url, name)) != value:
        assert time.monotonic() < deadline, f"/metrics never showed {name} {value} (last: {seen})"
        time.sleep(0.05)


@pytest.mark.parametrize("through_local_dir", [False, True], ids=["http", "local_dir"])
def test_remote_reads_of_a_damaged_page_fail_once_and_a_republish_heals(tmp_path, through_local_dir):
    path = tmp_path / "store"
    saved = _damaged_store(path)
    keys = list(saved.chain_keys)
    server = LiveServer(path)
    try:
        local_dir = path if through_local_dir else None
        with RemoteStore(server.url, local_dir=local_dir) as remote:
            assert remote.has_blocks(keys) == [True] * 6, "damage is not known before a read"
            with pytest.raises(IntegrityError):
                restore_prefix(remote, IDENTITY, "default", TOKENS)
            # the server quarantined the page, also when the read went through local_dir
            assert remote.has_blocks(keys) == [i != DAMAGED_BLOCK for i in range(6)]
            for _ in range(2):
                matched, _ = restore_prefix(remote, IDENTITY, "default", TOKENS)
                assert matched == DAMAGED_BLOCK * 4
            assert remote.find_blocks(keys[DAMAGED_BLOCK:DAMAGED_BLOCK + 1])[0] is not None
            # the lookups cut short by the damage are counted by the server; through
            # local_dir they reach it as replays on a background thread, which must all
            # land before the republish below heals the chain (else the server sees a whole
            # chain and counts nothing: this test failed so under load). A replay runs the
            # lookup when it lands: the first one, made before the damage was found, counts
            # as stopped too when it lands after the quarantine (seen in CI: 3)
            _wait_for_metric(server.url, "kvstore_store_lookups", 3)
            stopped = _metric(server.url, "kvstore_store_lookups_stopped_at_damage")
            assert stopped in ((2, 3) if through_local_dir else (2,)), stopped
            save_prefix(remote, IDENTITY, "default", TOKENS)  # sends the quarantined page again
            assert remote.has_blocks(keys) == [True] * 6
            matched, _ = restore_prefix(remote, IDENTITY, "default", TOKENS)
            assert matched == len(TOKENS)
            stats = remote.stats()
            assert stats.quarantined_count == 0
            assert remote.check(read_data=True).problems == []
        # and none after the heal (close() waited for the last replays)
        assert _metric(server.url, "kvstore_store_lookups_stopped_at_damage") == stopped
    finally:
        server.stop()
