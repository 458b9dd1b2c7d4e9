"""OpenAI error objects, and the one mapping from failures to HTTP statuses."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import grpc
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


# What a client is told when a plane behind the gateway fails: the details (addresses,
# the other plane's words) go to the gateway's log, not to the client.
_SERVER_MESSAGES = {
    grpc.StatusCode.UNAVAILABLE: "the model server is unavailable; retry shortly",
    grpc.StatusCode.DEADLINE_EXCEEDED: "the request timed out",
}


class ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote input that is not valid Unicode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


class APIError(Exception):
    """An error to return to the client as `{"error": {...}}`."""

    # The generate call of a request's several (a completions batch's prompt) that this
    # error is about, when it is about one: set where the calls' messages are read.
    call_index: int | None = None

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, object]:
        # Exactly OpenAI's error object; the request id travels in the X-Request-Id header.
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        # Overload and unavailability are temporary: tell clients when to come back.
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return ErrorJSON(self.body(), status_code=self.status, headers=headers)


def from_grpc(e: grpc.aio.AioRpcError) -> APIError:
    return _from_status(e.code(), e.details())


def from_code(name: str, message: str) -> APIError:
    """A GenerateMany request's error: its gRPC status code by name, and message."""
    return _from_status(getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN), message)


# Fields the control plane names at the start of its INVALID_ARGUMENT messages.
_PARAMS = ("logit_bias", "stop_token_ids", "chat_template_kwargs", "tools_json", "prompt")
# A message of the chat it names ("messages[2]: the chat template refuses it: ..."), named
# as the gateway's own validation names it (messages.2)
_MESSAGE = re.compile(r"messages\[(\d+)\]")


def _from_status(code: grpc.StatusCode, details: str | None) -> APIError:
    status, kind = _GRPC_TO_HTTP.get(code, (500, "internal_error"))
    param = "messages" if "chat" in (details or "") else None
    for field in _PARAMS:  # a message that starts with the field it blames
        if (details or "").startswith(f"{field}:"):
            param = field
    if m := _MESSAGE.match(details or ""):
        param = f"messages.{m[1]}"
    message = details or code.name
    name = code.name.lower()
    if status == 400 and "maximum context length" in message:
        name = "context_length_exceeded"  # (OpenAI's code: clients look for it)
    if status >= 500:
        log.warning("the control plane answered %s: %s", code.name, details)
        message = _SERVER_MESSAGES.get(code, "the request failed in the model server")
        if code == grpc.StatusCode.INTERNAL and details:
            message = f"the request failed in the model server: {_first_line(details)}"
    return APIError(status, message, type=kind, param=param, code=name)


def _first_line(details: str) -> str:
    """A request's own failure, as the compute plane words it: no trace, no address."""
    line = details.strip().splitlines()[0] if details.strip() else ""
    return line if "ipv4:" not in line and "ipv6:" not in line else "internal error"


def http_error(status: int, detail: str) -> APIError:
    """Starlette's own errors (unknown route, wrong method, unreadable body) as OpenAI's."""
    kind = "invalid_request_error" if status < 500 else "internal_error"
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return APIError(status, detail, type=kind, code=code)


class InternalErrors:
    """Pure ASGI middleware, just outside the app's exception handlers: an exception none
    of them takes (a bug) becomes OpenAI's error object with status 500, its trace goes
    to the log, and the connection stays usable. Starlette's last resort answers plain
    text and raises on, and uvicorn then closes the connection under the client's next
    request. Once the response has started there is no answer left to give: it raises on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            log.exception("%s %s failed", scope.get("method"), scope.get("path"))
            if started:
                raise
            error = APIError(500, "internal error in the gateway", type="internal_error")
            await error.response()(scope, receive, send)
