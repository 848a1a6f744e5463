"""Format identities: PUT /v1/formats/{format_id} (idempotent), GET one, GET all."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.deps import StoreDep
from api.errors import BODY, QUERY, ApiError, documented
from api.schemas import HEX64_PATTERN, FormatBody, FormatList, FormatPut
from kvstore.format import FormatIdentity

router = APIRouter(prefix="/v1/formats", tags=["formats"])
FormatIdPath = Annotated[str, Path(pattern=HEX64_PATTERN,
                                   description="64 hex: blake3 of the canonical identity")]


@router.put("/{format_id}", response_model=FormatPut, responses=documented(*BODY, 409, 507))
def put_format(body: FormatBody, format_id: FormatIdPath, store: StoreDep) -> FormatPut:
    identity = FormatIdentity.from_dict(body.model_dump())
    if identity.format_id_hex != format_id:
        raise ApiError(422, "format_id_mismatch",
                       f"the identity hashes to {identity.format_id_hex}, not to {format_id}")
    return FormatPut(format_id=store.put_format(identity).hex())


@router.get("/{format_id}", response_model=FormatBody, responses=documented(*QUERY, 404))
def get_format(format_id: FormatIdPath, store: StoreDep) -> dict:
    return store.get_format(format_id).to_dict()


@router.get("", response_model=FormatList, responses=documented(401, 500))
def list_formats(store: StoreDep) -> dict:
    return {"formats": [f.to_dict() for f in store.list_formats()]}
