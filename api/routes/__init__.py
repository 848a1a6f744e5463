"""One router per resource, all under /v1 (plus /metrics at the root, where
Prometheus looks). Route bodies call one kvstore function each and let
api/errors.py map what it raises. Handlers that call the store are plain `def`, so
FastAPI runs them in its threadpool and a long LMDB call never blocks the event loop;
the async ones hand their blocking work to run_in_threadpool explicitly."""

from api.routes import (
    admin,
    blocks,
    checkpoints,
    dashboard,
    formats,
    health,
    namespaces,
    pages,
    prefix,
    stats,
)

ROUTERS = [health.router, formats.router, pages.router, blocks.router, prefix.router,
           checkpoints.router, namespaces.router, stats.router, admin.router,
           dashboard.router]
