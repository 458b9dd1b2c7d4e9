"""Every HTTP request gets a request id: the client's `X-Request-Id`, or a new one.

It is set in the request's context (hetero_common.logs.REQUEST_ID) for the log lines
and the control-plane request ids made while serving it, and returned as the
`X-Request-Id` header of the response and in error bodies.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hetero_common.logs import REQUEST_ID, valid_request_id

HEADER = b"x-request-id"


class RequestIdMiddleware:
    """Pure ASGI middleware (outermost): runs the app with REQUEST_ID set."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER, b"").decode("latin-1")
        request_id = given if valid_request_id(given) else uuid.uuid4().hex
        raw = request_id.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, raw)]}
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
