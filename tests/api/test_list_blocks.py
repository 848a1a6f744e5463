"""GET /v1/blocks lists block records page by page, one tenant's only."""

from __future__ import annotations

import pytest

from kvstore.client import AccessDenied
from tests.api.conftest import ADMIN, USER_A, USER_B, client_for, remote_for
from tests.kvstore.factories import make_identity, save_prefix


def test_list_blocks_pages_and_stays_in_the_namespace(secured_app, store):
    a = remote_for(client_for(secured_app, USER_A), USER_A)
    b = remote_for(client_for(secured_app, USER_B), USER_B)
    identity = make_identity()
    saved = save_prefix(a, identity, "team-a", list(range(5 * identity.block_size_tokens)))
    save_prefix(b, identity, "team-b", list(range(7, 7 + 2 * identity.block_size_tokens)))
    everything_a = sorted(bytes(k) for k in saved.chain_keys)
    # pages of 2, in key order, exactly the embedded store's answer
    seen, after = [], None
    while True:
        page = a.list_blocks(after=after, limit=2)
        if not page:
            break
        seen.extend(bytes(r.key) for r in page)
        after = page[-1].key
    assert seen == everything_a
    assert [bytes(r.key) for r in store.list_blocks("team-a")] == everything_a
    assert len(b.list_blocks()) == 2
    with pytest.raises(AccessDenied):
        b.list_blocks("team-a")
    admin = remote_for(client_for(secured_app, ADMIN), ADMIN)
    assert len(admin.list_blocks()) == 7
