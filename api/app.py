"""create_app: the FastAPI application around one Store.

    create_app(settings=Settings(...))                 opens Store(settings.data_dir)
    create_app(store_factory=lambda s: Store(...))     opens whatever the factory builds
    create_app(store=existing_store)                   uses it; the caller closes it

The store is opened in the lifespan (never at import, never before a fork) and
closed there, unless the caller passed an open one. The middleware stack, outermost
first: metrics (counts every request, refused ones too), the header count (before
anything reads the headers), authentication (before routing, so every path but
/v1/health needs the token when one is set), body limits and timeouts, the method
check (405 with a true Allow), then FastAPI's routing and the error table of
api/errors.py. Header bytes are capped even earlier, by uvicorn (api/server.py).
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Callable

import anyio
from fastapi import FastAPI

from api import errors
from api.auth import AuthMiddleware, TokenTable, chain_salts_from_settings
from api.budget import DecodeBudget
from api.limits import BodyLimitMiddleware, HeaderLimitMiddleware, UploadSlots
from api.methods import MethodMiddleware
from api.metrics import Metrics, MetricsMiddleware
from api.routes import ROUTERS
from api.settings import Settings
from kvstore.store import Store, StoreConfig

API_DESCRIPTION = """A content-addressed store of KV-cache pages. Pages are uploaded raw
(PUT /v1/pages/{digest}) and read in batches as a binary stream (POST /v1/pages/get).
Send `Authorization: Bearer <token>` on every route but /v1/health when the server has
tokens. docs/api.md describes the framing, errors and settings."""


def open_store(settings: Settings) -> Store:
    config = StoreConfig(map_nbytes=settings.map_nbytes, max_map_nbytes=settings.max_map_nbytes,
                         budget_nbytes=settings.budget_nbytes or None,
                         reserve_nbytes=settings.reserve_nbytes,
                         chain_salts=chain_salts_from_settings(settings))
    store = Store(settings.data_dir, config)
    tier = settings.tier_config()
    if tier is None:
        return store
    from kvstore.tier import TieredStore  # the S3 tier behind the local store (issue 11)

    return TieredStore(store, tier)


def create_app(store: Store | None = None, settings: Settings | None = None, *,
               store_factory: Callable[[Settings], Store] | None = None) -> FastAPI:
    settings = settings or Settings()
    if store is not None and store_factory is not None:
        raise ValueError("pass a store or a store_factory, not both")
    tokens = TokenTable.from_settings(settings)
    salts = chain_salts_from_settings(settings)
    if store is not None and salts and store.config.chain_salts != salts:
        raise ValueError("the store was opened with other chain salts than the tokens file's "
                         "[[namespace]] tables: open it with StoreConfig(chain_salts=...) of "
                         "those (api.auth.chain_salts_from_settings)")
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if store is not None:  # the caller's, already open: used as is, never closed here
            yield
            return
        app.state.store = (store_factory or open_store)(settings)
        try:
            yield
        finally:
            opened, app.state.store = app.state.store, None
            opened.close()

    app = FastAPI(title="mlx-kvstore", version="1", description=API_DESCRIPTION,
                  lifespan=lifespan, redirect_slashes=False)
    app.state.store = store
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.tokens = tokens
    app.state.upload_slots = UploadSlots(settings.max_concurrent_uploads,
                                         settings.max_uploads_per_token)
    app.state.read_slots = anyio.Semaphore(settings.max_concurrent_reads)
    app.state.decode_budget = DecodeBudget(settings.max_read_decoded_nbytes,
                                           settings.max_read_decoded_nbytes_per_token,
                                           settings.read_budget_wait_s)
    for router in ROUTERS:
        app.include_router(router)
    errors.install(app)
    # add_middleware wraps: the last added is the outermost
    app.add_middleware(MethodMiddleware, routes=app.router.routes)
    app.add_middleware(BodyLimitMiddleware, max_page_nbytes=settings.max_page_nbytes,
                       max_json_nbytes=settings.max_json_nbytes,
                       max_batch_pages=settings.max_batch_pages,
                       body_timeout_s=settings.body_timeout_s,
                       min_body_bytes_per_s=settings.min_body_bytes_per_s)
    app.add_middleware(AuthMiddleware, tokens=tokens)
    app.add_middleware(HeaderLimitMiddleware, max_header_count=settings.max_header_count)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    return app
