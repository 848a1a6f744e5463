"""MethodMiddleware: 405 with a true Allow header, decided from the whole route table.

Starlette answers a wrong method from the first route whose path matches, so
PUT /v1/checkpoints got `Allow: POST` (GET is allowed too), and a method that a
parametrised sibling takes reached that sibling: PUT /v1/pages/missing was validated as
a page digest (a 422) although /v1/pages/missing only takes POST. Here a literal path
(no parameters) is answered by the routes with exactly that path; any other path by
every route whose pattern matches it. A method none of them takes is a 405 whose
Allow lists what they do take. Cost: one regex match per route per request (about 30).
"""

from __future__ import annotations

from api.errors import error_response

try:  # FastAPI >= 0.16x keeps included routers lazily; this flattens them
    from fastapi.routing import iter_route_contexts
except ImportError:  # pragma: no cover - older FastAPI: the route list is already flat
    def iter_route_contexts(routes):
        return iter(routes)


class MethodMiddleware:
    def __init__(self, app, routes: list):
        self.app = app
        self.routes = routes  # the app's live route list, flattened at the first request
        self._table: list[tuple[str, object, bool, frozenset[str]]] | None = None

    def table(self) -> list[tuple[str, object, bool, frozenset[str]]]:
        if self._table is None:
            table = []
            for route in iter_route_contexts(self.routes):
                methods, regex = getattr(route, "methods", None), getattr(route, "path_regex", None)
                if methods and regex is not None:
                    table.append((route.path, regex, bool(route.param_convertors), frozenset(methods)))
            self._table = table
        return self._table

    def allowed_methods(self, path: str) -> set[str]:
        table = self.table()
        literal = {m for p, _, params, methods in table if not params and p == path for m in methods}
        if literal:
            return literal
        return {m for _, regex, params, methods in table if params and regex.match(path)
                for m in methods}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            allowed = self.allowed_methods(scope["path"])
            if allowed and scope["method"] not in allowed:
                listed = ", ".join(sorted(allowed))
                response = error_response(405, "method_not_allowed",
                                          f"{scope['method']} is not allowed here; use {listed}",
                                          {"Allow": listed})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)
