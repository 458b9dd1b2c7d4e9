"""A span per HTTP request when tracing is on (hetero_common.tracing).

It is the current span while the request is served, so the generate calls sent for it
carry it as their `traceparent`; its parent is the client's `traceparent` header.
Probes (/health, /ready, /metrics) get none.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hetero_common.logs import REQUEST_ID
from hetero_common.tracing import start_span

UNTRACED = frozenset({"/health", "/ready", "/metrics"})


class TracingMiddleware:
    """Pure ASGI middleware, inside RequestIdMiddleware (the span names the request id)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED:
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        parent = dict(scope["headers"]).get(b"traceparent", b"").decode("latin-1")
        span = start_span(
            f"{method} {path}",
            parent,
            {
                "http.request.method": method,
                "url.path": path,
                "hetero.request_id": REQUEST_ID.get() or "",
            },
            server=True,
        )
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set({"http.response.status_code": status})
            await send(message)

        try:
            with span.active():
                await self.app(scope, receive, send_status)
        finally:
            span.end(error=f"HTTP {status}" if status >= 500 else None)
