"""Slow and idle clients cannot hold the gateway's connections.

uvicorn times out idle keep-alive connections, but not a client that sends its headers
a byte at a time, or never finishes them (slowloris): any byte cancels the keep-alive
timer. `guarded_h11` is uvicorn's h11 protocol with a deadline for each request's
headers, from the connection's start or the previous response's end, and a cap per
client address on connections waiting for headers: past it, the oldest of them that
has waited a second or more is closed (a burst of new connections is not idle: those
are read within milliseconds, however many there are).
The body has its own read timeout (gateway.body_limit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


def guarded_h11(header_timeout: float, max_idle_per_ip: int) -> type[H11Protocol]:
    """uvicorn's `http=` protocol class with these limits."""
    limits = {"header_timeout": header_timeout, "max_idle_per_ip": max_idle_per_ip, "idle": {}}
    return type("GuardedH11", (GuardedH11,), limits)


class GuardedH11(H11Protocol):
    header_timeout = 10.0
    max_idle_per_ip = 256
    # Per client address: its connections waiting for headers, oldest first (one dict
    # per server, set by guarded_h11).
    idle: dict[str, OrderedDict[GuardedH11, None]] = {}  # noqa: RUF012
    _timer: asyncio.TimerHandle | None = None
    _waiting_since = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_headers()

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not None and not self.cycle.response_complete:
            self._got_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._got_headers()
        super().connection_lost(exc)

    def _ip(self) -> str:
        return self.client[0] if self.client else ""

    def _await_headers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.header_timeout, self._headers_late)
        self._waiting_since = now = time.monotonic()
        mine = self.idle.setdefault(self._ip(), OrderedDict())
        mine[self] = None
        grace = min(1.0, self.header_timeout / 2)
        while len(mine) > self.max_idle_per_ip:
            oldest = next(iter(mine))
            if now - oldest._waiting_since < grace:
                break
            mine.pop(oldest)
            oldest._close("too many idle connections from this address")

    def _got_headers(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        mine = self.idle.get(self._ip())
        if mine is not None:
            mine.pop(self, None)
            if not mine:
                del self.idle[self._ip()]

    def _headers_late(self) -> None:
        self._timer = None
        if self.cycle is None or self.cycle.response_complete:
            self._close(f"no request headers within {self.header_timeout:g} s")

    def _close(self, why: str) -> None:
        if not self.transport.is_closing():
            log.debug("closing a connection from %s: %s", self._ip(), why)
            self.transport.close()
        self._got_headers()
