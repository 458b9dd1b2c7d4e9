"""A stand-in for the grpc.aio context a servicer's handler is given, for unit tests of
the servicers: `abort` records the status and raises, as grpc's does (the handler ends)."""

from __future__ import annotations

import grpc


class Aborted(Exception):
    """What `Context.abort` raises: the status code and details it was given."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    """What a servicer uses of a call's context: `abort`, and the status it ended with."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise Aborted(code, details)
