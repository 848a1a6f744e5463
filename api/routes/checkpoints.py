"""Checkpoints: POST create, GET list, GET one, DELETE one (admin). Addressed as
/v1/checkpoints/{namespace}/{name}; a token may only name its own namespace.

Reads answer the stored records as JSON directly, not through the response model:
a store written before kvstore held every writer to the metadata limits
(kvstore/records.py check_metadata) may hold metadata past them, and pydantic refuses
to serialise nesting past 255 levels. One such record must not make the namespace's
listing, or the admin's listing of every namespace, a 500. Creation is held to the
limits by the Checkpoint the route builds (400, nothing stored)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import JSONResponse

from api.auth import AdminDep, PrincipalDep
from api.deps import StoreDep
from api.errors import BODY, QUERY, documented
from api.schemas import (
    NAME_PATTERN,
    NAMESPACE_PATTERN,
    CheckpointCreate,
    CheckpointList,
    CheckpointOut,
)
from kvstore.wire import checkpoint_from_json, checkpoint_to_json

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"])
NamespacePath = Annotated[str, Path(pattern=NAMESPACE_PATTERN, max_length=64)]
NamePath = Annotated[str, Path(pattern=NAME_PATTERN, max_length=128)]
NamespaceQuery = Annotated[str | None, Query(pattern=NAMESPACE_PATTERN, max_length=64)]


@router.post("", response_model=CheckpointOut, status_code=201,
             responses=documented(*BODY, 403, 409, 507))
def create_checkpoint(body: CheckpointCreate, store: StoreDep,
                      principal: PrincipalDep) -> dict:
    """Atomically store a named checkpoint over committed blocks (409 already_exists
    unless `replace`; 409 missing_references when a block or attachment is absent, or
    belongs to another namespace: the two read alike). Metadata past its limits is a 400
    and nothing is stored."""
    principal.require_namespace(body.namespace)
    record = checkpoint_from_json(body.model_dump(exclude={"replace"}))
    return checkpoint_to_json(store.create_checkpoint(record, replace=body.replace))


@router.get("", response_model=CheckpointList, responses=documented(*QUERY, 403))
def list_checkpoints(store: StoreDep,
                     principal: PrincipalDep, namespace: NamespaceQuery = None) -> JSONResponse:
    """Checkpoints of one namespace (the token's own when none is named; every
    namespace for an admin over '*' that names none)."""
    scope = principal.default_namespace(namespace)
    return JSONResponse({"checkpoints": [checkpoint_to_json(c) for c in store.list_checkpoints(scope)]})


@router.get("/{namespace}/{name}", response_model=CheckpointOut,
            responses=documented(*QUERY, 403, 404))
def get_checkpoint(namespace: NamespacePath, name: NamePath,
                   store: StoreDep,
                   principal: PrincipalDep) -> JSONResponse:
    principal.require_namespace(namespace)
    return JSONResponse(checkpoint_to_json(store.get_checkpoint(namespace, name)))


@router.delete("/{namespace}/{name}", status_code=204,
               responses=documented(*QUERY, 403, 404, 507))
def delete_checkpoint(namespace: NamespacePath, name: NamePath,
                      store: StoreDep,
                      principal: AdminDep) -> None:
    """Admin only: unpin a checkpoint (its pages go at the next eviction or GC)."""
    principal.require_namespace(namespace)
    store.delete_checkpoint(namespace, name)
