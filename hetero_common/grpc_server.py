"""The life of a gRPC plane, the same in both: bind (TLS or not) with health and
reflection, Prometheus on its own port, run until SIGINT/SIGTERM, drain, stop.

    plane = GrpcPlane(config, SERVICE_NAME)
    add_XServicer_to_server(servicer, plane.server)
    await plane.start()
    await plane.stopped()                      # SIGTERM
    left = await plane.drain(lambda: len(in_flight), config.drain_timeout)
    await plane.close()
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import prometheus_client

from hetero_common.grpc_health import HealthReporter
from hetero_common.server_config import GrpcServerConfig

log = logging.getLogger(__name__)

# The status details a compute plane's open Run streams end with when it stops (SIGTERM,
# its drain over): its control plane tells this planned stop from a loss (a crash, a kill,
# the network), which ends the stream otherwise.
COMPUTE_STOPPED = "the compute plane stopped"


class GrpcPlane:
    def __init__(
        self, config: GrpcServerConfig, service: str, max_receive_bytes: int | None = None
    ) -> None:
        """`max_receive_bytes`: the largest message the server reads (None: grpc's 4 MiB,
        -1: any)."""
        self.config = config
        self.address = f"{config.host}:{config.port}"
        options = (
            []
            if max_receive_bytes is None
            else [("grpc.max_receive_message_length", max_receive_bytes)]
        )
        self.server = grpc.aio.server(options=options)
        self.health = HealthReporter(self.server, service)
        self._stop = asyncio.Event()
        self.metrics_port: int | None = None  # once serving /metrics

    async def start(self) -> None:
        """Listen (NOT_SERVING until `health.set(True)`), serve /metrics, catch signals."""
        host, port = self.config.host, self.config.metrics_port
        try:
            self.config.tls.add_port(self.server, self.address)
        except RuntimeError:  # grpc's "Failed to bind": a start-up error, not a crash
            raise ValueError(
                f"--port {self.config.port}: cannot listen on {self.address} (the port is "
                "in use, or --host is not an address of this machine)"
            ) from None
        if port >= 0:  # 0: a free port, -1: none
            try:
                httpd, _ = prometheus_client.start_http_server(port, addr=host)
            except OSError as e:
                raise ValueError(
                    f"--metrics-port {port}: cannot listen on {host}:{port}: {e.strerror or e}"
                ) from None
            self.metrics_port = int(httpd.server_port)
            # (with its gRPC address: serve's compute planes log theirs side by side)
            log.info(
                "metrics at http://%s:%d/metrics (gRPC on %s)",
                host,
                self.metrics_port,
                self.address,
            )
        # grpc's health servicer answers SERVING for "" until told otherwise, and nothing
        # for LIVENESS: a control plane read as ready (a Kubernetes readiness probe, the
        # gateways) from its first answer until its first check for a compute plane.
        await self.health.set(False)
        await self.server.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)

    async def stopped(self) -> None:
        """Until SIGINT or SIGTERM."""
        await self._stop.wait()

    async def before_stop(self, work: Awaitable[Any]) -> bool:
        """Await `work` unless a signal comes first; True when `work` finished (its
        result or error is then `work`'s to give)."""
        task = asyncio.ensure_future(work)
        stop = asyncio.ensure_future(self._stop.wait())
        done, _ = await asyncio.wait((task, stop), return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        return task in done

    async def drain(self, in_flight: Callable[[], int], timeout: float) -> int:
        """NOT_SERVING, then wait up to `timeout` s for `in_flight()` to reach 0; returns
        what is left."""
        await self.health.set(False)
        deadline = time.monotonic() + timeout
        while in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return in_flight()

    async def close(self) -> None:
        await self.server.stop(grace=1)
