"""Prometheus metrics, in the text exposition format, with no extra dependency.

Request counters are labelled by route template (never the raw path, whose
cardinality a client controls), method and status. Store gauges come from
Store.stats() at scrape time.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

LATENCY_BUCKETS_S = (0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0)


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)
        self.latency_counts: dict[tuple[str, str], list[int]] = {}
        self.latency_sum: dict[tuple[str, str], float] = defaultdict(float)
        self.bytes_in: dict[str, int] = defaultdict(int)
        self.bytes_out: dict[str, int] = defaultdict(int)

    def observe(self, method: str, route: str, status: int, seconds: float,
                nbytes_in: int, nbytes_out: int) -> None:
        with self._lock:
            self.requests[(method, route, status)] += 1
            counts = self.latency_counts.setdefault((method, route), [0] * (len(LATENCY_BUCKETS_S) + 1))
            for i, bound in enumerate(LATENCY_BUCKETS_S):
                if seconds <= bound:
                    counts[i] += 1
            counts[-1] += 1
            self.latency_sum[(method, route)] += seconds
            self.bytes_in[route] += nbytes_in
            self.bytes_out[route] += nbytes_out

    def render(self, store_stats: dict | None) -> str:
        lines = ["# HELP kvstore_http_requests_total HTTP requests by route and status",
                 "# TYPE kvstore_http_requests_total counter"]
        with self._lock:
            for (method, route, status), n in sorted(self.requests.items()):
                lines.append(f'kvstore_http_requests_total{{method="{method}",route="{route}",'
                             f'status="{status}"}} {n}')
            lines += ["# HELP kvstore_http_request_seconds request latency",
                      "# TYPE kvstore_http_request_seconds histogram"]
            for (method, route), counts in sorted(self.latency_counts.items()):
                labels = f'method="{method}",route="{route}"'
                for bound, n in zip(LATENCY_BUCKETS_S, counts[:-1], strict=True):
                    lines.append(f'kvstore_http_request_seconds_bucket{{{labels},le="{bound}"}} {n}')
                lines.append(f'kvstore_http_request_seconds_bucket{{{labels},le="+Inf"}} {counts[-1]}')
                lines.append(f"kvstore_http_request_seconds_sum{{{labels}}} "
                             f"{self.latency_sum[(method, route)]:.6f}")
                lines.append(f"kvstore_http_request_seconds_count{{{labels}}} {counts[-1]}")
            for name, table in (("received", self.bytes_in), ("sent", self.bytes_out)):
                lines += [f"# TYPE kvstore_http_{name}_bytes_total counter"]
                for route, n in sorted(table.items()):
                    lines.append(f'kvstore_http_{name}_bytes_total{{route="{route}"}} {n}')
        for key, value in sorted((store_stats or {}).items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                lines += [f"# TYPE kvstore_store_{key} gauge", f"kvstore_store_{key} {value}"]
        return "\n".join(lines) + "\n"


class MetricsMiddleware:
    """Pure ASGI; counts bytes both ways without touching the bodies."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status, nbytes_in, nbytes_out = 500, 0, 0

        async def counting_receive():
            nonlocal nbytes_in
            message = await receive()
            nbytes_in += len(message.get("body", b""))
            return message

        async def counting_send(message):
            nonlocal status, nbytes_out
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                nbytes_out += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.observe(scope["method"], template, status,
                                 time.perf_counter() - start, nbytes_in, nbytes_out)
