"""Budget eviction: least-recently-used unpinned blocks first, children before parents,
pinned blocks never. The clock is replaced by a counter so the order is exact."""

from __future__ import annotations

import itertools

import pytest

import kvstore.store as store_module
from kvstore.records import Checkpoint
from tests.kvstore.factories import (
    assert_check_clean,
    make_identity,
    make_store,
    plan_prefix,
    restore_prefix,
    save_prefix,
)

IDENTITY = make_identity()


@pytest.fixture
def clock(monkeypatch):
    ticks = itertools.count(1_000)
    monkeypatch.setattr(store_module, "now_ns", lambda: next(ticks))


def _keys(ns, tokens):
    return [r.key for r in plan_prefix(IDENTITY, ns, tokens)[0]]


def _eviction_order(store, keys: dict) -> list[str]:
    """Evict one block at a time (each block's pages are its own) and name it."""
    order = []
    while True:
        present = {name for name, k in keys.items() if store.has_blocks([k])[0]}
        report = store.evict(max(store.stats().stored_nbytes - 1, 0))
        if report.blocks == 0:
            return order
        assert report.blocks == 1, f"evicted {report.blocks} blocks for one block's bytes"
        gone = present - {name for name, k in keys.items() if store.has_blocks([k])[0]}
        assert len(gone) == 1
        order.append(gone.pop())
        assert_check_clean(store)


def _distinct_tokens(seed):
    # tokens whose pages are all random (no shared zero pages), so one block = its own bytes
    for offset in itertools.count(seed * 1000, 7):
        tokens = [offset + i for i in range(8)]
        records, payload = plan_prefix(IDENTITY, "ns", tokens)
        if all(any(payload[d]) for r in records for d in r.pages):
            return tokens


def test_lru_children_before_parents_and_pins(tmp_path, clock):
    a, b, c = _distinct_tokens(1), _distinct_tokens(2), _distinct_tokens(3)
    a_tail = a + [a[0]]  # a third, partial block under a
    with make_store(tmp_path, compression=store_module.Compression(enabled=False)) as store:
        save_prefix(store, IDENTITY, "ns", a_tail)  # a1 a2 a3 at t1
        save_prefix(store, IDENTITY, "ns", b)       # b1 b2 at t2
        save_prefix(store, IDENTITY, "ns", c, checkpoint="keep")  # c1 c2 pinned
        assert restore_prefix(store, IDENTITY, "ns", a)[0] == 8  # touches a1 a2: now newer than b
        names = dict(zip(["a1", "a2", "a3"], _keys("ns", a_tail), strict=True))
        names.update(zip(["b1", "b2"], _keys("ns", b), strict=True))
        names.update(zip(["c1", "c2"], _keys("ns", c), strict=True))
        # leaves: a3 (t1), b2 (t2); a1 a2 were used at t4 but still have a child.
        # a3 goes first (oldest leaf), then b2, then b1 (t2 < a2's t4), then a2, a1.
        assert _eviction_order(store, names) == ["a3", "b2", "b1", "a2", "a1"]
        assert store.has_blocks([names["c1"], names["c2"]]) == [True, True]
        assert restore_prefix(store, IDENTITY, "ns", c)[0] == 8

        # once the checkpoint is gone, its blocks go too, child first
        store.delete_checkpoint("ns", "keep")
        assert _eviction_order(store, {"c1": names["c1"], "c2": names["c2"]}) == ["c2", "c1"]
        assert store.stats().block_count == 0


def test_budget_evicts_on_commit_and_keeps_pinned(tmp_path, clock):
    first, second, third = _distinct_tokens(4), _distinct_tokens(5), _distinct_tokens(6)
    records, payload = plan_prefix(IDENTITY, "ns", first)
    block_nbytes = sum(48 + len(payload[d]) for d in records[0].pages)
    budget = 4 * block_nbytes + block_nbytes // 2  # two prefixes of two blocks fit, three do not
    with make_store(tmp_path, budget_nbytes=budget,
                    compression=store_module.Compression(enabled=False)) as store:
        save_prefix(store, IDENTITY, "ns", first, checkpoint="pinned")
        save_prefix(store, IDENTITY, "ns", second)
        save_prefix(store, IDENTITY, "ns", third)
        stats = store.stats()
        assert stats.stored_nbytes <= budget
        assert stats.evicted_blocks == 2
        assert store.has_blocks(_keys("ns", first)) == [True, True]   # pinned
        assert store.has_blocks(_keys("ns", second)) == [False, False]  # least recently used
        assert store.has_blocks(_keys("ns", third)) == [True, True]
        assert_check_clean(store)


def test_checkpoint_pins_survive_evict_to_zero(tmp_path):
    tokens = list(range(300, 313))
    with make_store(tmp_path) as store:
        saved = save_prefix(store, IDENTITY, "ns", tokens, checkpoint="c")
        store.create_checkpoint(Checkpoint("d", "ns", IDENTITY.format_id, tuple(tokens),
                                           saved.chain_keys))
        store.evict(0)
        assert store.has_blocks(saved.chain_keys) == [True] * len(saved.chain_keys)
        store.delete_checkpoint("ns", "c")
        store.evict(0)  # still pinned by "d"
        assert store.stats().block_count == len(saved.chain_keys)
        store.delete_checkpoint("ns", "d")
        store.evict(0)
        assert store.stats().block_count == 0 and store.stats().page_count == 0
        assert_check_clean(store)
