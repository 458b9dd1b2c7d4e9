"""The control plane's link to a compute plane reports its step stream's end by itself
(`ComputeClient.ended`): the idle step loop notices a stopped or killed compute plane at
once. A step written to such a stream is the link's failure, not grpc's bare
asyncio.InvalidStateError (which ended the step loop: the request hung for ever)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from control_plane.compute_client import ComputeClient, ComputeLinkError
from hetero_proto import compute_pb2 as pb
from hetero_proto import compute_pb2_grpc as pb_grpc
from tests.control.fake_compute import linked


class _Compute(pb_grpc.ComputePlaneServicer):
    """Answers Describe and Reset; ends each Run stream when `stop` is set."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()

    async def Describe(self, request: pb.DescribeRequest, context: object) -> pb.DescribeResponse:
        return pb.DescribeResponse(model_name="fake")

    async def Reset(self, request: pb.ResetRequest, context: object) -> pb.ResetResponse:
        return pb.ResetResponse()

    async def Run(
        self, request_iterator: AsyncIterator[pb.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.StepResult]:
        await self.stop.wait()
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the compute plane stopped")
        yield pb.StepResult()  # (a generator: never reached)


async def _with_link(check: object) -> None:
    servicer = _Compute()
    async with linked(servicer) as client:
        await check(servicer, client)  # type: ignore[operator]


def test_the_stream_ending_by_itself_is_reported_and_a_step_sent_then_fails_the_link() -> None:
    async def check(servicer: _Compute, client: ComputeClient) -> None:
        await client.attach()
        ended = asyncio.ensure_future(client.ended())
        await asyncio.sleep(0.1)
        assert not ended.done()  # open, idle
        servicer.stop.set()
        error = await asyncio.wait_for(ended, 5)
        assert (
            str(error) == f"compute plane {client.address}: UNAVAILABLE: the compute plane stopped"
        )
        assert error.code == "UNAVAILABLE"
        with pytest.raises(ComputeLinkError, match="UNAVAILABLE: the compute plane stopped"):
            await client.send(pb.StepRequest(step_id=1))

    asyncio.run(_with_link(check))


def test_a_stream_this_side_ends_is_not_reported() -> None:
    async def check(servicer: _Compute, client: ComputeClient) -> None:
        await client.attach()
        ended = asyncio.ensure_future(client.ended())
        await asyncio.sleep(0.1)
        await client.attach()  # a new stream: the old one is cancelled here
        await asyncio.sleep(0.3)
        assert not ended.done()
        again = asyncio.ensure_future(client.ended())
        await asyncio.sleep(0.1)
        await client.detach()
        await asyncio.sleep(0.3)
        assert not again.done()
        ended.cancel()
        again.cancel()

    asyncio.run(_with_link(check))
