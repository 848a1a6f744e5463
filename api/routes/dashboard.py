"""GET / and GET /dashboard/{file}: the read-only dashboard's static shell.

The files live in tools/dashboard/static (their owner; the api package may not import
tools, so they are found by path). The shell holds no data: its script reads /v1/stats,
/v1/checkpoints and /v1/formats/{id} with the bearer token. A browser cannot send that
token with a page load, so for a store with tokens the three SHELL_PATHS must be in
api.auth.PUBLIC_PATHS; the data stay behind the token. Only the named files are
served; no path is built from the request.

Wiring (owned by api/): add `dashboard.router` to api.routes.ROUTERS and SHELL_PATHS
to api.auth.PUBLIC_PATHS.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

STATIC_DIR = Path(__file__).resolve().parents[2] / "tools" / "dashboard" / "static"
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
SHELL_PATHS = frozenset(FILES)
HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self'; form-action 'self'; "
                                "frame-ancestors 'none'; base-uri 'none'"),
}

router = APIRouter(tags=["dashboard"], include_in_schema=False)


def _serve(path: str) -> Response:
    name, media_type = FILES[path]
    return Response((STATIC_DIR / name).read_bytes(), media_type=media_type, headers=HEADERS)


@router.get("/")
def index() -> Response:
    return _serve("/")


@router.get("/dashboard/dashboard.js")
def script() -> Response:
    return _serve("/dashboard/dashboard.js")


@router.get("/dashboard/dashboard.css")
def style() -> Response:
    return _serve("/dashboard/dashboard.css")
