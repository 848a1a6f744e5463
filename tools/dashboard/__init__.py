"""The read-only dashboard: static/index.html, dashboard.js and dashboard.css.

Plain HTML plus a little JS, no build step. The page is a shell with no data in it;
its script reads GET /v1/stats, /v1/checkpoints and /v1/formats/{id} with the bearer
token, so the data are exactly as protected as the API (a 401 brings up a token
form). The shell files themselves must therefore be served without a token: a browser
cannot attach an Authorization header to a page load.

Serving. SHELL maps each public URL path to one file in STATIC_DIR; nothing else is
served and no path is built from the request. with_dashboard(app) wraps any ASGI app
(the API's create_app result) so those paths are answered before the API's
authentication middleware and every other path goes to the API unchanged:

    app = with_dashboard(create_app(settings=settings))

The API package may not import tools (layering), so an api/routes/dashboard.py would
serve the same files by path instead and add the SHELL paths to the auth middleware's
public paths; either way the files and their contract live here.
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).resolve().parent / "static"
SHELL = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
# The shell may only load its own script and style, and talk to its own origin.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; "
                           "connect-src 'self'; img-src 'self'; form-action 'self'; "
                           "frame-ancestors 'none'; base-uri 'none'")


def shell_response(path: str) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:
    """(body, headers) for a shell path, or None for any other path."""
    entry = SHELL.get(path)
    if entry is None:
        return None
    name, media_type = entry
    body = (STATIC_DIR / name).read_bytes()
    return body, [(b"content-type", media_type.encode()),
                  (b"content-length", str(len(body)).encode()),
                  (b"cache-control", b"no-cache"),
                  (b"x-content-type-options", b"nosniff"),
                  (b"referrer-policy", b"no-referrer"),
                  (b"content-security-policy", CONTENT_SECURITY_POLICY.encode())]


def with_dashboard(app):
    """An ASGI app that answers GET/HEAD of the SHELL paths and passes everything else
    (lifespan included) to `app`."""

    async def dashboard_app(scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            found = shell_response(scope["path"])
            if found is not None:
                body, headers = found
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body",
                            "body": b"" if scope["method"] == "HEAD" else body})
                return
        await app(scope, receive, send)

    dashboard_app.inner = app
    return dashboard_app


__all__ = ["STATIC_DIR", "SHELL", "with_dashboard", "shell_response"]
