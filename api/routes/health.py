"""GET /v1/health: liveness, no token needed and nothing about the store revealed."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter

from api.schemas import Health

router = APIRouter(prefix="/v1", tags=["health"])


def _version() -> str:
    try:
        return version("mlx-kvstore")
    except PackageNotFoundError:
        return "unknown"


@router.get("/health", response_model=Health)
def health() -> Health:
    return Health(status="ok", version=_version())
