"""GET /v1/namespaces/{namespace}/chain-salt: a namespace's chain salt, for its own
tokens (an admin: any namespace's).

A salted namespace's chain keys are blake3 keyed by a secret (docs/format.md section
3). The tenant's processes must compute the keys the store computes (a publish hashes
its blocks before it asks which are stored), so they get the salt here: a token
learns only its own namespace's, which lets it compute only keys it may read anyway.
Another namespace is a 403, salted or not, so the answer tells nothing about it."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.auth import PrincipalDep
from api.deps import StoreDep
from api.errors import QUERY, documented
from api.schemas import NAMESPACE_PATTERN, ChainSaltOut

router = APIRouter(prefix="/v1/namespaces", tags=["namespaces"])
NamespacePath = Annotated[str, Path(pattern=NAMESPACE_PATTERN, max_length=64)]


@router.get("/{namespace}/chain-salt", response_model=ChainSaltOut,
            responses=documented(*QUERY, 403))
def get_chain_salt(namespace: NamespacePath, store: StoreDep,
                   principal: PrincipalDep) -> ChainSaltOut:
    """The namespace's 32-byte chain salt as 64 hex characters, or null when its keys
    are unsalted. Keep it as secret as the token."""
    principal.require_namespace(namespace)
    salt = store.chain_salt(namespace)
    return ChainSaltOut(namespace=namespace, salted=salt is not None,
                        salt=salt.hex() if salt is not None else None)
