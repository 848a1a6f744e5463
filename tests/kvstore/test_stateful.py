"""The store against a plain dict model, driven by hypothesis.

Rules: save prefixes that share blocks (tokens from a 3-symbol alphabet, 4-token
blocks, two namespaces), restore them, upload pages without committing them, create
and delete checkpoints, GC with grace 0, evict to a fraction of the stored bytes,
close and reopen the Store (with a tiny initial map, so growth runs too), and damage a
stored page on disk, then publish and restore again (IntegrityError once, a shorter
prefix while quarantined, whole again after the re-publish).

The model is `blocks`: chain key -> the record the store must hold, plus the
checkpoints and the loose (uploaded, never committed) pages. After every step:
  - every restore returns exactly the model's longest prefix, byte for byte;
  - check() reports 0 problems (it recomputes reference counts, pins and counters);
  - the stored block set equals the model's.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvstore.errors import IntegrityError, MissingReferences, NotFound
from kvstore.ids import ROOT_KEY, chain_key, page_digest
from kvstore.pages import HEADER_NBYTES
from kvstore.records import Checkpoint
from tests.kvstore.factories import (
    expected_pages,
    flip_bit,
    gc_now,
    make_identity,
    make_store,
    plan_prefix,
    restore_prefix,
    save_prefix,
    stored_value,
)

IDENTITY = make_identity()
BS = IDENTITY.block_size_tokens
SOAK = os.environ.get("KVSTORE_SOAK") == "1"

prompts = st.tuples(st.sampled_from(["ns-a", "ns-b"]),
                    st.lists(st.integers(0, 2), min_size=1, max_size=14).map(tuple))


class StoreMachine(RuleBasedStateMachine):
    saved = Bundle("saved")

    @initialize()
    def open_store(self):
        self.dir = tempfile.mkdtemp(prefix="kvstore-stateful-")
        self.store = make_store(self.dir)
        self.blocks = {}         # chain key -> BlockRecord the store must hold
        self.checkpoints = {}    # (namespace, name) -> chain keys
        self.loose = {}          # digest -> bytes uploaded without a commit

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- rules --------------------------------------------------------------------------
    @rule(target=saved, prompt=prompts)
    def save(self, prompt):
        ns, tokens = prompt
        result = save_prefix(self.store, IDENTITY, ns, tokens)
        for record in result.records:
            self.blocks.setdefault(record.key, record)
        return prompt

    @rule(prompt=st.one_of(saved, prompts))
    def restore(self, prompt):
        ns, tokens = prompt
        matched, records = restore_prefix(self.store, IDENTITY, ns, tokens)
        want = self._model_match(ns, tokens)
        assert [r.key for r in records] == want, "lookup_prefix disagrees with the model"

    @rule(data=st.binary(min_size=1, max_size=600))
    def upload_loose(self, data):
        digest = page_digest(data)
        self.store.put_pages({digest: data})
        self.loose[digest] = data

    @rule(prompt=saved, name=st.sampled_from(["c1", "c2", "c3"]))
    def create_checkpoint(self, prompt, name):
        ns, tokens = prompt
        records, _ = plan_prefix(IDENTITY, ns, tokens)
        keys = tuple(r.key for r in records)
        ckpt = Checkpoint(name, ns, IDENTITY.format_id, tokens, keys, metadata={"n": len(tokens)})
        if all(k in self.blocks for k in keys):
            self.store.create_checkpoint(ckpt, replace=True)
            self.checkpoints[(ns, name)] = keys
        else:  # a block was evicted: the store refuses, nothing changes
            try:
                self.store.create_checkpoint(ckpt, replace=True)
            except MissingReferences:
                return
            raise AssertionError("checkpoint over evicted blocks was accepted")

    @precondition(lambda self: self.checkpoints)
    @rule(data=st.data())
    def delete_checkpoint(self, data):
        ns, name = data.draw(st.sampled_from(sorted(self.checkpoints)))
        self.store.delete_checkpoint(ns, name)
        del self.checkpoints[(ns, name)]
        try:
            self.store.get_checkpoint(ns, name)
        except NotFound:
            return
        raise AssertionError("deleted checkpoint is still readable")

    @rule()
    def gc(self):
        gc_now(self.store)
        referenced = {d for r in self.blocks.values() for d in r.pages}
        absent = set(self.store.missing(list(self.loose)))
        assert absent == set(self.loose) - referenced, "GC kept garbage or deleted a referenced page"
        self.loose = {}

    @rule(fraction=st.sampled_from([0.0, 0.3, 0.7]))
    def evict(self, fraction):
        stored = self.store.stats().stored_nbytes
        self.store.evict(int(stored * fraction))
        keys = list(self.blocks)
        present = dict(zip(keys, self.store.has_blocks(keys), strict=True))
        pinned = {k for ks in self.checkpoints.values() for k in ks}
        for k, record in self.blocks.items():
            if k in pinned:
                assert present[k], "a pinned block was evicted"
            if present[k] and not record.is_root:
                assert present[record.parent], "eviction left a child without its parent"
        self.blocks = {k: r for k, r in self.blocks.items() if present[k]}
        # pages of evicted blocks may be gone now; loose pages were never evictable
        self.loose = {d: v for d, v in self.loose.items() if self.store.missing([d]) == []}

    @rule(prompt=saved, data=st.data())
    def damage_then_publish_and_restore_again(self, prompt, data):
        """Flip one bit of a stored page on disk (the Store closed), then: the restore
        that reads it raises IntegrityError once and quarantines it; the next restore
        stops before the first block naming it and is counted as stopped; publishing
        the prompt again re-sends the page; the restore then equals the model again."""
        ns, tokens = prompt
        keys = self._model_match(ns, tokens)
        if not keys:
            return  # its blocks were evicted: nothing stored to damage
        block = self.blocks[data.draw(st.sampled_from(keys), label="block")]
        victim = data.draw(st.sampled_from(block.pages), label="page")
        value = stored_value(self.store, victim)
        self.store.close()
        bit = 8 * (HEADER_NBYTES + (len(value) - HEADER_NBYTES) // 2) + 3  # in the body
        flip_bit(self.dir, value, bit)
        self.store = make_store(self.dir)
        stopped = self.store.stats().lookups_stopped_at_damage

        with pytest.raises(IntegrityError) as info:
            restore_prefix(self.store, IDENTITY, ns, tokens)
        assert info.value.digest == victim.hex()
        cut = next(i for i, k in enumerate(keys) if victim in self.blocks[k].pages)
        for _ in range(2):  # never raised again: the prefix ends before the damage
            _, records = restore_prefix(self.store, IDENTITY, ns, tokens)
            assert [r.key for r in records] == keys[:cut]
        stats = self.store.stats()
        assert stats.lookups_stopped_at_damage == stopped + 2
        assert stats.quarantined_count == 1
        problems = [(p.kind, p.object) for p in self.store.check().problems]
        assert problems == [("page_quarantined", victim.hex())]
        assert self.store.has_blocks([block.key]) == [False]

        # publish again what was matched (the prompt itself may end in another partial
        # block than the one matched): its blocks are incomplete, so their pages are sent
        matched_tokens = tuple(t for k in keys for t in self.blocks[k].tokens)
        result = save_prefix(self.store, IDENTITY, ns, matched_tokens)
        assert [r.key for r in result.records] == keys
        assert self.store.has_blocks([block.key]) == [True]
        _, records = restore_prefix(self.store, IDENTITY, ns, tokens)
        assert [r.key for r in records] == self._model_match(ns, tokens)
        assert [r.key for r in records][: len(keys)] == keys
        assert self.store.stats().quarantined_count == 0

    @rule()
    def reopen(self):
        self.store.close()
        self.store = make_store(self.dir)

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def check_is_clean(self):
        if not hasattr(self, "store"):
            return
        report = self.store.check()
        assert report.problems == [], report.problems
        stats = self.store.stats()
        assert stats.block_count == len(self.blocks), (stats.block_count, len(self.blocks))
        assert stats.checkpoint_count == len(self.checkpoints)
        for (ns, name), keys in self.checkpoints.items():
            assert self.store.get_checkpoint(ns, name).chain_keys == keys

    @invariant()
    def model_blocks_restore(self):
        if not hasattr(self, "store") or not self.blocks:
            return
        records = list(self.blocks.values())
        got = self.store.read_pages([d for r in records for d in r.pages])
        assert got == expected_pages(IDENTITY, records)

    # -- the model's lookup ---------------------------------------------------------------
    def _model_match(self, ns, tokens):
        fid, parent, pos, keys = IDENTITY.format_id, ROOT_KEY, 0, []
        while pos + BS <= len(tokens):
            key = chain_key(fid, ns, parent, tokens[pos : pos + BS])
            if key not in self.blocks:
                break
            keys.append(key)
            parent, pos = key, pos + BS
        for n in range(min(len(tokens) - pos, BS - 1), 0, -1):
            key = chain_key(fid, ns, parent, tokens[pos : pos + n])
            if key in self.blocks:
                keys.append(key)
                break
        return keys


StoreMachine.TestCase.settings = settings(
    max_examples=300 if SOAK else 60, stateful_step_count=50 if SOAK else 30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestStoreAgainstModel = StoreMachine.TestCase
