"""Start real plane processes for end-to-end tests and wait until they are serving."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_grpc_serving(address: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Poll grpc.health.v1 until SERVING; fail early if the process died."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"process exited with {proc.returncode} before serving on {address}"
                )
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not SERVING after {timeout} s")


@contextlib.contextmanager
def plane(
    args: list[str], address: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `hetero-infer ARGS` as a child process, yield it once serving, stop it after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hetero_infer.cli", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    try:
        wait_grpc_serving(address, proc)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def compute_plane(*extra: str) -> Iterator[str]:
    """A compute plane with the bundled model on a free port; yields its address."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    with plane(["compute-plane", "--port", str(port), *extra], address):
        yield address
