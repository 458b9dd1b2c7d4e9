"""grpc.health.v1 and server reflection, the same way on both gRPC planes."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

LIVENESS = "liveness"  # SERVING whenever the process answers (Kubernetes liveness probes)


class HealthReporter:
    """Registers health + reflection for `service`; `set(serving)` flips both names ("" and it).

    Readiness is "" / the service name. LIVENESS stays SERVING: a control plane waiting
    for its compute plane, or a plane draining, is not ready but must not be restarted.
    """

    def __init__(self, server: grpc.aio.Server, service: str) -> None:
        self.service = service
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        reflection.enable_server_reflection((service, health_name, reflection.SERVICE_NAME), server)

    async def set(self, serving: bool) -> None:
        r = health_pb2.HealthCheckResponse
        status = r.SERVING if serving else r.NOT_SERVING
        for name in ("", self.service):
            await self.servicer.set(name, status)
        await self.servicer.set(LIVENESS, r.SERVING)
