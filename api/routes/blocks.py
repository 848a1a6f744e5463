"""Block records: POST commit, POST get, POST has, GET (list). A token sees only the
blocks of its namespace: another namespace's block reads exactly as an absent one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.auth import Principal, PrincipalDep
from api.deps import StoreDep
from api.errors import BODY, QUERY, documented
from api.schemas import NAMESPACE_PATTERN, BlockList, CommitBlocks, CommitOut, KeyList, Presence
from kvstore.errors import NotFound
from kvstore.ids import ChainKey
from kvstore.store import Store
from kvstore.wire import block_from_json, block_to_json

router = APIRouter(prefix="/v1/blocks", tags=["blocks"])


@router.post("/commit", response_model=CommitOut, responses=documented(*BODY, 403, 409, 507))
def commit_blocks(body: CommitBlocks, store: StoreDep,
                  principal: PrincipalDep) -> dict:
    """Atomically add block records, parents before children (409 missing_references
    names whatever must be uploaded first; nothing is committed then)."""
    for block in body.blocks:
        principal.require_namespace(block.namespace)
    # keyed with the store's salt of each block's namespace (the key is never sent)
    result = store.commit_blocks([block_from_json(b.model_dump(), store.chain_salt(b.namespace))
                                  for b in body.blocks])
    return {"new": result.new, "existing": result.existing, "evicted_blocks": result.evicted_blocks}


def _visible(store: Store, principal: Principal, keys: list[ChainKey]) -> list:
    """Records for `keys`, or None where absent or in another namespace."""
    records = store.find_blocks(keys)
    return [r if r is not None and principal.may_access(r.namespace) else None for r in records]


@router.post("/get", response_model=BlockList, responses=documented(*BODY, 404))
def get_blocks(body: KeyList, store: StoreDep,
               principal: PrincipalDep) -> dict:
    keys = [ChainKey.parse(k) for k in body.keys]
    records = _visible(store, principal, keys)
    for key, record in zip(keys, records, strict=True):
        if record is None:
            raise NotFound(f"block {key.hex()} is not stored")
    return {"blocks": [block_to_json(r) for r in records]}


@router.post("/has", response_model=Presence, responses=documented(*BODY))
def has_blocks(body: KeyList, store: StoreDep,
               principal: PrincipalDep) -> Presence:
    """Present: the record is visible and every page it names is stored (not missing,
    not quarantined), as Store.has_blocks answers."""
    keys = [ChainKey.parse(k) for k in body.keys]
    complete = store.has_blocks(keys)
    return Presence(present=[r is not None and c for r, c in
                             zip(_visible(store, principal, keys), complete, strict=True)])


@router.get("", response_model=BlockList, responses=documented(*QUERY, 403))
def list_blocks(store: StoreDep, principal: PrincipalDep,
                namespace: Annotated[str | None, Query(pattern=NAMESPACE_PATTERN, max_length=64)] = None,
                after: Annotated[str | None, Query(pattern="^[0-9a-f]{64}$")] = None,
                limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> dict:
    """Block records in chain-key order, one page of at most `limit` after the key
    `after`: of the token's namespace (or, for an admin over '*', of `namespace` or of
    all)."""
    scope = principal.default_namespace(namespace)
    records = store.list_blocks(scope, after=ChainKey.parse(after) if after else None, limit=limit)
    return {"blocks": [block_to_json(r) for r in records]}
