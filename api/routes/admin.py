"""Admin routes (admin token only): POST /v1/admin/gc, /v1/admin/evict, /v1/admin/check."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api.auth import require_admin
from api.deps import StoreDep
from api.errors import BODY, documented
from api.schemas import CheckOut, CheckRequest, EvictOut, EvictRequest, GCOut, GCRequest

router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[Depends(require_admin)])


@router.post("/gc", response_model=GCOut, responses=documented(*BODY, 403, 409, 507))
def gc(body: GCRequest, store: StoreDep) -> dict:
    """Plan a GC of unreferenced pages older than grace_s, and run it unless dry_run.
    Safe while writers run (kvstore/gc.py); 409 gc_aborted when another GC runs."""
    plan = store.plan_gc(body.grace_s)
    return {"plan": plan.summary(), "deleted": None if body.dry_run else plan.execute()}


@router.post("/evict", response_model=EvictOut, responses=documented(*BODY, 403, 507))
def evict(body: EvictRequest, store: StoreDep) -> dict:
    """Evict least-recently-used unpinned blocks until stored bytes <= to_nbytes."""
    report = store.evict(body.to_nbytes)
    return {"blocks": report.blocks, "pages": report.pages, "freed_nbytes": report.freed_nbytes}


@router.post("/check", response_model=CheckOut, responses=documented(*BODY, 403))
def check(body: CheckRequest, store: StoreDep) -> dict:
    """Verify the index (and with read_data every page's blake3); typed problems."""
    return store.check(read_data=body.read_data, subset=body.subset).to_dict()
