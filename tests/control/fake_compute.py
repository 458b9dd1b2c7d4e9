"""A stand-in compute plane on a real gRPC server, for tests of the control plane's link."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from control_plane.compute_client import ComputeClient
from hetero_proto import compute_pb2_grpc as pb_grpc


@contextlib.asynccontextmanager
async def linked(servicer: pb_grpc.ComputePlaneServicer) -> AsyncIterator[ComputeClient]:
    """`servicer` served on a free local port, and a ComputeClient to it (not attached);
    both closed at the end of the block."""
    server = grpc.aio.server()
    pb_grpc.add_ComputePlaneServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = ComputeClient(f"127.0.0.1:{port}")
    try:
        yield client
    finally:
        await client.close()
        await server.stop(None)
