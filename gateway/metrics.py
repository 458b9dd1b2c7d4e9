"""Prometheus metrics of the gateway, served at /metrics on its HTTP port."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from starlette.types import ASGIApp, Receive, Scope, Send

requests_total = Counter(
    "hetero_http_requests", "HTTP requests by route and status", ("route", "status")
)
in_flight = Gauge("hetero_http_requests_in_flight", "HTTP requests being handled")
duration = Histogram(
    "hetero_http_request_duration_seconds",
    "Time to the response head (streams: to the first byte of the stream)",
    ("route",),
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)

routed = Counter(
    "hetero_gateway_routed",
    "Generate calls placed on a control plane, by why: affinity (its prefix's plane on the "
    "hash ring), load (that plane was overloaded: the next one on the ring), unavailable "
    "(that plane was down), failover (re-submitted after its control plane failed)",
    ("control", "reason"),
)
METRICS_PATH = "/metrics"  # (not counted itself: scrapes are not traffic)

control_in_flight = Gauge(
    "hetero_gateway_control_in_flight", "Generate calls running on each control plane", ("control",)
)


class _InFlight:
    """Pure ASGI middleware: a request is in flight until its response's last byte, a
    stream's included (the app returns when the body ends or the client leaves)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == METRICS_PATH:
            await self.app(scope, receive, send)
            return
        in_flight.inc()
        try:
            await self.app(scope, receive, send)
        finally:
            in_flight.dec()


def instrument(app: FastAPI) -> None:
    @app.api_route(METRICS_PATH, methods=["GET", "HEAD"], include_in_schema=False)
    async def _metrics(request: Request) -> Response:
        # The format the scraper asks for (OpenMetrics for Prometheus), as the planes'
        # prometheus_client servers answer: plain text turns each counter's _created
        # sample into a series of its own.
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(REGISTRY), media_type=content_type)

    @app.middleware("http")
    async def _measure(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if request.url.path == METRICS_PATH:
            return await call_next(request)
        start = time.perf_counter()
        status = 500
        try:
            response = await call_next(request)
            status = response.status_code
            return response
        finally:
            route = request.scope.get("route")
            path = getattr(route, "path", "other")
            duration.labels(route=path).observe(time.perf_counter() - start)
            requests_total.labels(route=path, status=str(status)).inc()

    # (call_next returns at the response head: a stream would leave the count there)
    app.add_middleware(_InFlight)
