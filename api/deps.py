"""Dependencies shared by the routers: the store, the settings, the metrics."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.metrics import Metrics
from api.settings import Settings
from kvstore.store import Store


def get_store(request: Request) -> Store:
    store = getattr(request.app.state, "store", None)
    assert store is not None, "the store is opened in the app lifespan; it is not open"
    return store


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


# Annotated dependencies: the route signatures read as types, not as default values.
StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
