"""POST /v1/prefix/lookup: the longest stored prefix of some token ids, in the
caller's namespace only (the namespace is hashed into every chain key, so another tenant's
blocks can never match)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api.auth import PrincipalDep
from api.deps import StoreDep
from api.errors import BODY, documented
from api.schemas import PrefixLookup, PrefixMatchOut
from kvstore.wire import block_to_json

router = APIRouter(prefix="/v1/prefix", tags=["prefix"])


@router.post("/lookup", response_model=PrefixMatchOut, responses=documented(*BODY, 403))
def lookup_prefix(body: PrefixLookup, store: StoreDep,
                  principal: PrincipalDep) -> JSONResponse:
    namespace = principal.require_namespace(body.namespace)
    match = store.lookup_prefix(body.format_id, namespace, body.tokens, max_tokens=body.max_tokens)
    # Built from records the store just decoded: returned as is, not re-validated
    # against the response model (that costs more than the lookup for long prompts).
    return JSONResponse({"tokens_matched": match.tokens_matched,
                         "blocks": [block_to_json(b) for b in match.blocks]})
