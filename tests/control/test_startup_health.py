"""A control plane is NOT_SERVING from its first answer until a compute plane attaches,
and LIVENESS is SERVING from the start (the Kubernetes probes of deploy/k8s): grpc's
health servicer answers SERVING for "" until told otherwise, so while the control plane
looked its compute planes up (a slow DNS answer for a headless Service) it was read as
ready with none attached, and its liveness was NOT_FOUND."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hetero_common.grpc_health import LIVENESS
from hetero_infer.local import free_port, stop_process

# The control plane with its compute planes' name lookup taking 3 s (a slow resolver).
SLOW_LOOKUP = """
import asyncio, sys
import control_plane.engine as engine
from hetero_infer.cli import main
found = engine.resolve
async def slow(spec):
    await asyncio.sleep(3)
    return await found(spec)
engine.resolve = slow
sys.exit(main(sys.argv[1:]))
"""


def _status(stub: health_pb2_grpc.HealthStub, service: str) -> str:
    try:
        r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
    except grpc.RpcError as e:
        return str(e.code().name)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def test_not_ready_until_attached_and_live_from_the_first_answer() -> None:
    port = free_port()
    cmd = ["control-plane", "--port", str(port), "--metrics-port", "-1"]
    cmd += ["--compute", f"nowhere.invalid:{free_port()}"]
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOOKUP, *cmd])
    seen: dict[str, set[str]] = {"": set(), LIVENESS: set()}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            while _status(stub, "") == "UNAVAILABLE":  # not listening yet
                assert proc.poll() is None and time.monotonic() < deadline, "no answer"
                time.sleep(0.02)
            end = time.monotonic() + 4  # through the lookup and past it
            while time.monotonic() < end:
                for service, statuses in seen.items():
                    statuses.add(_status(stub, service))
                time.sleep(0.02)
    finally:
        stop_process(proc)
    assert seen == {"": {"NOT_SERVING"}, LIVENESS: {"SERVING"}}
