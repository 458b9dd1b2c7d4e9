"""Optional API keys: `Authorization: Bearer KEY` on the OpenAI routes (probes and scrapes stay open)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response

from gateway.errors import APIError


def require_api_key(app: FastAPI, key: str) -> None:
    expected = key.encode()

    @app.middleware("http")
    async def _check(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if request.url.path.startswith("/v1/"):
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), expected
            ):
                return APIError(
                    401,
                    "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key",
                ).response()
        return await call_next(request)
