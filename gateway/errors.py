"""OpenAI error objects, and the one mapping from failures to HTTP statuses."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class APIError(Exception):
    """An error to return to the client as `{"error": {...}}`."""

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
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_grpc(e: grpc.aio.AioRpcError) -> APIError:
    return _from_status(e.code(), e.details())


def from_code(name: str, message: str) -> APIError:
    """A GenerateMany request's error: its gRPC status code by name, and message."""
    return _from_status(getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN), message)


def _from_status(code: grpc.StatusCode, details: str | None) -> APIError:
    status, kind = _GRPC_TO_HTTP.get(code, (500, "internal_error"))
    param = "messages" if "chat" in (details or "") else None
    return APIError(status, details or code.name, type=kind, param=param, code=code.name.lower())
