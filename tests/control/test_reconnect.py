"""A lost gRPC link is retried soon and steadily: the control plane's channel to a compute
plane, and the gateway's to a control plane, try again at least every ~0.6 s however long
the peer has been away (gRPC's own default backs off 1 s, 1.6, 2.6, 4.1 s... up to two
minutes, so a plane that came back after 40 s was attached 25 s late)."""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from control_plane.compute_client import ComputeClient
from gateway.control_planes import ControlPlane
from hetero_common.tls import ClientTLS

WINDOW = 6.0  # seconds: gRPC's defaults retry at ~0, 1, 2.6, 5.2 s (each ±20 %)


@pytest.fixture
def refusing_peer() -> Iterator[tuple[str, list[float]]]:
    """A TCP port that accepts each connection and closes it at once (a peer that does not
    speak gRPC yet); yields its address and the times connections came."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    sock.settimeout(0.05)
    times: list[float] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                continue
            times.append(time.monotonic())
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}", times
    finally:
        done.set()
        thread.join(timeout=5)
        sock.close()


async def _probe_for(check: Callable[[], Awaitable[bool]]) -> float:
    """Health-check every 50 ms for WINDOW seconds (each check fails); returns the start."""
    start = time.monotonic()
    while time.monotonic() - start < WINDOW:
        assert not await check()
        await asyncio.sleep(0.05)
    return start


def _gaps(start: float, times: list[float]) -> list[float]:
    """Seconds between the start, each connection attempt and the window's end."""
    marks = [start, *sorted(times), start + WINDOW]
    return [b - a for a, b in itertools.pairwise(marks)]


def test_control_plane_retries_a_lost_compute_plane_steadily(
    refusing_peer: tuple[str, list[float]],
) -> None:
    address, times = refusing_peer

    async def main() -> float:
        client = ComputeClient(address)
        try:
            return await _probe_for(lambda: client.alive(timeout=0.5))
        finally:
            await client.close()

    gaps = _gaps(asyncio.run(main()), times)
    assert len(times) >= 8 and max(gaps) < 1.0, [round(g, 2) for g in gaps]


def test_gateway_retries_a_lost_control_plane_steadily(
    refusing_peer: tuple[str, list[float]],
) -> None:
    address, times = refusing_peer

    async def main() -> float:
        plane = ControlPlane(address, "127.0.0.1", ClientTLS())
        plane.open()
        assert plane.health is not None and plane.channel is not None

        async def check() -> bool:
            assert plane.health is not None
            try:
                await plane.health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                return False
            return True

        try:
            return await _probe_for(check)
        finally:
            await plane.channel.close()

    gaps = _gaps(asyncio.run(main()), times)
    assert len(times) >= 8 and max(gaps) < 1.0, [round(g, 2) for g in gaps]
