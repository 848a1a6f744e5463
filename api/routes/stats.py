"""GET /v1/stats (JSON) and GET /metrics (Prometheus text)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from api.deps import MetricsDep, StoreDep
from api.errors import documented
from api.schemas import StatsOut

router = APIRouter(tags=["stats"])


@router.get("/v1/stats", response_model=StatsOut, responses=documented(401, 500))
def stats(store: StoreDep) -> dict:
    return store.stats().to_dict()


@router.get("/metrics", response_class=PlainTextResponse, responses=documented(401, 500))
def metrics(store: StoreDep, table: MetricsDep) -> str:
    return PlainTextResponse(table.render(store.stats().to_dict()),
                             media_type="text/plain; version=0.0.4")
