"""A cap on request body size (larger bodies get 413 before any of them is parsed) and on
how long the body may pause (408)."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError


class BodyLimit:
    """Pure ASGI middleware: buffers at most `max_bytes` of the body, then replays it.

    Both a declared Content-Length and the bytes actually received are checked, so a
    chunked upload cannot slip past the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout  # seconds between two reads of the body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except TimeoutError:
                error = APIError(
                    408, f"the request body stalled for {self.timeout:g} s", code="timeout"
                )
                await error.response()(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                # The client left before sending its body: nobody reads a response, but
                # one must be sent, or the metrics middleware counts a 500 and logs "No
                # response returned"; 499 as for a client gone before its response.
                error = APIError(
                    499, "the client closed the connection", type="client_closed_request"
                )
                await error.response()(scope, receive, send)
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # later reads wait for the disconnect, as usual

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"the request body is larger than {self.max_bytes} bytes",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)
