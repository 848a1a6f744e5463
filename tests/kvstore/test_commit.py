"""commit_blocks refusals name what is missing and commit nothing."""

from __future__ import annotations

import pytest

from kvstore.errors import MissingReferences
from tests.kvstore.factories import make_identity, make_store, plan_prefix


def test_missing_pages_across_a_chain_are_all_named(tmp_path):
    store = make_store(tmp_path / "s")
    identity = make_identity()
    store.put_format(identity)
    tokens = list(range(3 * identity.block_size_tokens))
    records, payload = plan_prefix(identity, "default", tokens)
    first_block_pages = set(records[0].pages)
    store.put_pages({d: payload[d] for d in first_block_pages})
    with pytest.raises(MissingReferences) as info:
        store.commit_blocks(records)
    absent = {d for r in records[1:] for d in r.pages} - first_block_pages
    # every absent page is named, and the second block's parent (in the same call) is not
    assert {m.split()[-1] for m in info.value.missing} == {d.hex() for d in absent}
    assert store.has_blocks([r.key for r in records]) == [False] * 3
